//! Original module → instrumented module (object) → compiled code (machine cache).

use std::path::PathBuf;
use std::sync::Arc;

use ferry_instrument::INSTRUMENT_VERSION;
use ferry_kappa::Kappa;
use ferry_store::{RefValue, Store};

use crate::error::EngineError;
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

/// Marks an instrumented module that declares exception tags (its snapshots need
/// [`crate::ENGINE_CLASS_EXCEPTIONS`]), so a prepare that finds it compiled need not read it.
fn exceptions_ref(instrumented: &Kappa) -> String {
    format!("derived/exceptions/{}", instrumented.to_hex())
}

impl Runtime {
    /// A runtime on engine `kind`. Compiled code (for engines that compile) is cached under
    /// `cache_dir` (none: always compile).
    pub fn new(kind: EngineKind, cache_dir: Option<PathBuf>) -> Result<Self, EngineError> {
        let backend: Arc<dyn Backend> = match kind {
            EngineKind::Jit => Arc::new(Jit::new(cache_dir)?),
            EngineKind::Interp => Arc::new(Interp::new()),
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
        progress: &dyn Fn(&str),
    ) -> Result<Prepared, EngineError> {
        // Refuse bad input before anything is stored.
        if wasm.len() < 8 || &wasm[..4] != b"\0asm" {
            return Err(ferry_instrument::InstrumentError::NotWasm.into());
        }
        let module = store.put(wasm)?;
        self.prepare_kappa(store, module, progress)
    }

    /// The ref naming the instrumented module derived from `module`.
    pub fn derived_ref(module: &Kappa) -> String {
        format!(
            "derived/instrument-v{INSTRUMENT_VERSION}/{}",
            module.to_hex()
        )
    }

    /// The counting build of a prepared module (see `ferry_instrument::instrument_counting`),
    /// compiled once per machine; never stored as an object (snapshots name the ordinary
    /// build, whose frames it shares).
    pub(crate) fn counting_build(
        &self,
        store: &dyn Store,
        prepared: &Prepared,
    ) -> Result<Arc<dyn Compiled>, EngineError> {
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
        progress: &dyn Fn(&str),
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
            engine_class,
            compiled,
        })
    }
}
