//! Original module → instrumented module (object) → compiled code (machine cache).

use std::path::PathBuf;
use std::sync::Arc;

use ferry_instrument::{INSTRUMENT_VERSION, abi};
use ferry_kappa::Kappa;
use ferry_object::Snapshot;
use ferry_store::{RefValue, Store};
use tracing::{info, warn};

use crate::error::{EngineError, Stage};
use crate::interp::Interp;
use crate::jit::Jit;
use crate::seam::{Backend, Compiled, EngineKind};

/// An engine (see [`EngineKind`]) ready to prepare and run guests.
#[derive(Clone, Debug)]
pub struct Runtime {
    pub(crate) backend: Arc<dyn Backend>,
}

/// A module ready to run.
#[derive(Clone)]
pub struct Prepared {
    /// κ of the original module.
    pub module: Kappa,
    /// κ of the instrumented module derived from it.
    pub instrumented: Kappa,
    /// The version of the transform that derived it: this ferry's own
    /// ([`INSTRUMENT_VERSION`]), or an older one when a snapshot's own instrumented module is
    /// run ([`Runtime::prepare_snapshot`]). Snapshots of the guest record it.
    pub instrument_version: u32,
    /// The engine class its snapshots need ([`crate::ENGINE_CLASS`] or, when the module uses
    /// the exception-handling proposal, [`crate::ENGINE_CLASS_EXCEPTIONS`]).
    pub engine_class: &'static str,
    pub(crate) compiled: Arc<dyn Compiled>,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("module", &self.module)
            .field("instrumented", &self.instrumented)
            .finish_non_exhaustive()
    }
}

/// Whether a snapshot made by another version of the transform may run with its own
/// instrumented module (one that speaks this host's contract, [`abi::host_contract_of`]).
/// This ferry cannot re-derive such a module from the program to check it, so something
/// else must vouch for its code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtherVersions {
    /// Only if this store derived it from the program itself: its `derived/instrument-vN`
    /// ref (written by the ferry that instrumented the program here) names that module.
    Derived,
    /// Also when nothing here derived it (a snapshot from a machine with another ferry): its
    /// code is taken as the program's on the word of whoever made the snapshot.
    Trusted,
}

/// Refs `<this><version>/<κ of module>`: the instrumented module a version derived.
pub(crate) const DERIVED_PREFIX: &str = "derived/instrument-v";
/// Refs `<this><κ of instrumented module>`: marks (see [`exceptions_ref`]).
pub(crate) const EXCEPTIONS_PREFIX: &str = "derived/exceptions/";

/// Marks an instrumented module that declares exception tags (its snapshots need
/// [`crate::ENGINE_CLASS_EXCEPTIONS`]), so a prepare that finds it compiled need not read it.
fn exceptions_ref(instrumented: &Kappa) -> String {
    format!("{EXCEPTIONS_PREFIX}{}", instrumented.to_hex())
}

impl Runtime {
    /// A runtime on engine `kind`. Compiled code (for engines that compile) is cached under
    /// `cache_dir` (none: always compile).
    pub fn new(kind: EngineKind, cache_dir: Option<PathBuf>) -> Result<Self, EngineError> {
        let backend: Arc<dyn Backend> = match kind {
            EngineKind::Jit => Arc::new(Jit::new(cache_dir)?),
            EngineKind::Interp => Arc::new(Interp::new(cache_dir)),
        };
        Ok(Self { backend })
    }

    /// The engine this runtime runs guests on.
    pub fn kind(&self) -> EngineKind {
        self.backend.kind()
    }

    /// Stores `wasm`, then prepares it (see [`Runtime::prepare_kappa`]).
    pub fn prepare(
        &self,
        store: &dyn Store,
        wasm: &[u8],
        progress: &(dyn Fn(&str) + Sync),
    ) -> Result<Prepared, EngineError> {
        // Refuse bad input before anything is stored.
        if wasm.len() < 8 || &wasm[..4] != b"\0asm" {
            return Err(ferry_instrument::InstrumentError::NotWasm.into());
        }
        crate::imports::check(wasm)?;
        let module = store.put(wasm)?;
        self.prepare_kappa(store, module, progress)
    }

    /// The ref naming the instrumented module derived from `module`.
    pub fn derived_ref(module: &Kappa) -> String {
        derived_ref_of(INSTRUMENT_VERSION, module)
    }

    /// Prepares the module snapshot `snapshot` ran, to resume it (Admitting). A snapshot made
    /// by this ferry's transform runs the module derived here, which must be the one it names
    /// ("module mismatch" otherwise). One made by another version runs its own instrumented
    /// module (part of its closure) if that speaks this host's contract and `other` admits it;
    /// its later snapshots keep that version.
    pub fn prepare_snapshot(
        &self,
        store: &dyn Store,
        snapshot: &Snapshot,
        other: OtherVersions,
        progress: &(dyn Fn(&str) + Sync),
    ) -> Result<Prepared, EngineError> {
        let refuse = |why: String| EngineError::refused(Stage::Admitting, why);
        let v = snapshot.instrument_version;
        if v == INSTRUMENT_VERSION {
            let prepared = self.prepare_kappa(store, snapshot.module, progress)?;
            if prepared.instrumented != snapshot.instrumented {
                return Err(refuse(format!(
                    "module mismatch: the snapshot ran {} but its module instruments to {} here",
                    snapshot.instrumented, prepared.instrumented
                )));
            }
            return Ok(prepared);
        }
        if abi::host_contract_of(v) != Some(abi::HOST_ABI) {
            let which = if v > INSTRUMENT_VERSION {
                "a newer ferry"
            } else {
                "an older ferry"
            };
            return Err(refuse(format!(
                "snapshot was made by instrumentation v{v}; this ferry (v{INSTRUMENT_VERSION}) \
                 runs the modules of v{}-v{INSTRUMENT_VERSION} only: resume it with {which} \
                 (one of instrumentation v{v})",
                abi::OLDEST_COMPATIBLE
            )));
        }
        let derived_here = store
            .get_ref(&derived_ref_of(v, &snapshot.module))?
            .is_some_and(|r| r.target == snapshot.instrumented);
        if !derived_here && other == OtherVersions::Derived {
            return Err(refuse(format!(
                "snapshot was made by instrumentation v{v} (this ferry has v{INSTRUMENT_VERSION}), \
                 and this store did not derive its instrumented module {} from the program {}, \
                 so its code cannot be checked here: trust it to run it as it is (`ferry resume \
                 --trust-instrumented`; a space: `trust_instrumented = true` in its policy), \
                 or resume with a ferry of instrumentation v{v}",
                snapshot.instrumented, snapshot.module
            )));
        }
        if derived_here {
            info!(version = v, instrumented = %snapshot.instrumented,
                "running the snapshot's own instrumented module (this store derived it)");
        } else {
            warn!(version = v, instrumented = %snapshot.instrumented,
                "running the snapshot's own instrumented module, trusted: not derived here");
        }
        // Whether it declares exception tags: a module this store derived has its mark if it
        // does (every ferry since before v14 marks them), so its bytes are read only if it
        // must be compiled; one from elsewhere is read (and re-hashed) whole to find out.
        let mut bytes = None;
        let uses_exceptions = if derived_here {
            store
                .get_ref(&exceptions_ref(&snapshot.instrumented))?
                .is_some()
        } else {
            let b = store.get(&snapshot.instrumented)?;
            let eh = crate::uses_exceptions(&b);
            bytes = Some(b);
            eh
        };
        let engine_class = if uses_exceptions {
            crate::ENGINE_CLASS_EXCEPTIONS
        } else {
            crate::ENGINE_CLASS
        };
        let compiled = self.backend.compile(
            Some(&snapshot.instrumented.to_hex()),
            &mut || match bytes.take() {
                Some(b) => Ok(b),
                None => Ok(store.get(&snapshot.instrumented)?),
            },
            progress,
        )?;
        Ok(Prepared {
            module: snapshot.module,
            instrumented: snapshot.instrumented,
            instrument_version: v,
            engine_class,
            compiled,
        })
    }

    /// The counting build of a prepared module (see `ferry_instrument::instrument_counting`),
    /// compiled once per machine; never stored as an object (snapshots name the ordinary
    /// build, whose frames it shares).
    pub(crate) fn counting_build(
        &self,
        store: &dyn Store,
        prepared: &Prepared,
    ) -> Result<Arc<dyn Compiled>, EngineError> {
        if prepared.instrument_version != INSTRUMENT_VERSION {
            return Err(EngineError::refused(
                Stage::Admitting,
                format!(
                    "counting safe points needs the module instrumented by this ferry \
                     (v{INSTRUMENT_VERSION}), not v{}",
                    prepared.instrument_version
                ),
            ));
        }
        let wasm = store.get(&prepared.module)?;
        let out = ferry_instrument::instrument_counting(&wasm)?;
        let key = Kappa::of(&out.wasm).to_hex();
        let mut wasm = Some(out.wasm);
        self.backend.compile(
            Some(&key),
            &mut || Ok(wasm.take().unwrap_or_default()),
            &|_| {},
        )
    }

    /// Instruments (once per module and store) and compiles (once per machine) module κ.
    pub fn prepare_kappa(
        &self,
        store: &dyn Store,
        module: Kappa,
        progress: &(dyn Fn(&str) + Sync),
    ) -> Result<Prepared, EngineError> {
        let name = Self::derived_ref(&module);
        let cached = store.get_ref(&name)?;
        // The instrumented bytes are read only when they must be compiled (a 95 MB
        // interpreter instruments to ~550 MB: reading and verifying it would dominate the
        // start of every run).
        let (instrumented, mut bytes, uses_exceptions) = match cached {
            Some(r) if store.has(&r.target)? => {
                let marked = store.get_ref(&exceptions_ref(&r.target))?.is_some();
                (r.target, None, marked)
            }
            _ => {
                let wasm = store.get(&module)?;
                crate::imports::check(&wasm)?;
                if wasm.len() > 4 << 20 {
                    progress(&format!(
                        "making {} suspendable ({} MB; done once, then cached)",
                        module.fmt_short(),
                        wasm.len() >> 20
                    ));
                }
                let started = std::time::Instant::now();
                let out = ferry_instrument::instrument(&wasm)?;
                if wasm.len() > 4 << 20 {
                    progress(&format!(
                        "made suspendable in {:.1} s ({} of {} functions instrumented)",
                        started.elapsed().as_secs_f64(),
                        out.stats.instrumented,
                        out.stats.functions
                    ));
                }
                let k = store.put(&out.wasm)?;
                // Durable before a ref names it (after a crash, a ref to a torn object would
                // make every later run fail instead of instrumenting again).
                store.sync()?;
                let eh = crate::uses_exceptions(&out.wasm);
                let value = Some(RefValue {
                    epoch: 0,
                    target: k,
                });
                // Marked before the derived ref is published, so a derived ref without the
                // mark always means "no exception tags".
                // (It may already be there: the same module instrumented before, its derived
                // ref or object lost since.)
                if eh {
                    let mark = exceptions_ref(&k);
                    if let Err(e) = store.cas_ref(&mark, None, value)
                        && store.get_ref(&mark)?.is_none_or(|m| m.target != k)
                    {
                        return Err(e.into());
                    }
                }
                let _ = store.cas_ref(&name, cached, value);
                (k, Some(out.wasm), eh)
            }
        };
        let compiled = self.backend.compile(
            Some(&instrumented.to_hex()),
            &mut || match bytes.take() {
                Some(b) => Ok(b),
                None => Ok(store.get(&instrumented)?),
            },
            progress,
        )?;
        let engine_class = if uses_exceptions {
            crate::ENGINE_CLASS_EXCEPTIONS
        } else {
            crate::ENGINE_CLASS
        };
        Ok(Prepared {
            module,
            instrumented,
            instrument_version: INSTRUMENT_VERSION,
            engine_class,
            compiled,
        })
    }
}

/// The ref naming the instrumented module version `version` of the transform derived from
/// `module`.
fn derived_ref_of(version: u32, module: &Kappa) -> String {
    format!("{DERIVED_PREFIX}{version}/{}", module.to_hex())
}
