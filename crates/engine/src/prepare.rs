//! Original module → instrumented module (object) → compiled code (machine cache).

use std::path::{Path, PathBuf};

use ferry_instrument::INSTRUMENT_VERSION;
use ferry_kappa::Kappa;
use ferry_store::{RefValue, Store};

use crate::error::EngineError;

/// The wasmtime engine and the compiled-code cache.
#[derive(Clone)]
pub struct Runtime {
    pub(crate) engine: wasmtime::Engine,
    cache_dir: Option<PathBuf>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("cache_dir", &self.cache_dir)
            .finish()
    }
}

/// A module ready to run.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// κ of the original module.
    pub module: Kappa,
    /// κ of the instrumented module derived from it.
    pub instrumented: Kappa,
    pub(crate) compiled: wasmtime::Module,
}

/// Largest Wasm stack a guest may use (deep recursion, CPython).
pub const MAX_WASM_STACK: usize = 64 << 20;

impl Runtime {
    /// A runtime whose compiled code is cached under `cache_dir` (none: always compile).
    pub fn new(cache_dir: Option<PathBuf>) -> Result<Self, EngineError> {
        let mut config = wasmtime::Config::new();
        config.wasm_multi_memory(true);
        config.wasm_multi_value(true);
        config.async_stack_size(MAX_WASM_STACK + (1 << 20));
        config.max_wasm_stack(MAX_WASM_STACK);
        config.cranelift_opt_level(wasmtime::OptLevel::Speed);
        let engine =
            wasmtime::Engine::new(&config).map_err(|e| EngineError::Compile(e.to_string()))?;
        Ok(Self { engine, cache_dir })
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

    /// Instruments (once per module and store) and compiles (once per machine) module κ.
    pub fn prepare_kappa(
        &self,
        store: &dyn Store,
        module: Kappa,
        progress: &dyn Fn(&str),
    ) -> Result<Prepared, EngineError> {
        let name = Self::derived_ref(&module);
        let cached = store.get_ref(&name)?;
        let (instrumented, bytes) = match cached {
            Some(r) if store.has(&r.target)? => (r.target, store.get(&r.target)?),
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
                let _ = store.cas_ref(
                    &name,
                    cached,
                    Some(RefValue {
                        epoch: 0,
                        target: k,
                    }),
                );
                (k, out.wasm)
            }
        };
        let compiled = self.compile(&instrumented, &bytes, progress)?;
        Ok(Prepared {
            module,
            instrumented,
            compiled,
        })
    }

    fn cache_path(&self, k: &Kappa) -> Option<PathBuf> {
        self.cache_dir.as_ref().map(|d| {
            d.join(format!(
                "{}-ferry{}.cwasm",
                k.to_hex(),
                env!("CARGO_PKG_VERSION")
            ))
        })
    }

    fn compile(
        &self,
        k: &Kappa,
        bytes: &[u8],
        progress: &dyn Fn(&str),
    ) -> Result<wasmtime::Module, EngineError> {
        let path = self.cache_path(k);
        if let Some(p) = path.as_ref().filter(|p| p.exists()) {
            // SAFETY: the file was written by `Module::serialize` of this same build into the
            // user's own cache directory; wasmtime checks engine compatibility when loading
            // and an incompatible or damaged file falls through to a fresh compile.
            if let Ok(m) = unsafe { wasmtime::Module::deserialize_file(&self.engine, p) } {
                return Ok(m);
            }
        }
        if bytes.len() > 1 << 20 {
            progress(&format!(
                "compiling {} ({} MB; cached afterwards)",
                k.fmt_short(),
                bytes.len() >> 20
            ));
        }
        let started = std::time::Instant::now();
        let m = wasmtime::Module::new(&self.engine, bytes)
            .map_err(|e| EngineError::Compile(format!("{e:#}")))?;
        if bytes.len() > 1 << 20 {
            progress(&format!(
                "compiled in {:.1} s",
                started.elapsed().as_secs_f64()
            ));
        }
        // A cache write that fails only costs a compile next time.
        if let (Some(p), Ok(ser)) = (path, m.serialize()) {
            let _ = write_atomic(&p, &ser);
        }
        Ok(m)
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
