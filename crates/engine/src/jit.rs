//! The `jit` engine: wasmtime with Cranelift. Compiled code is cached per machine (a cache,
//! never the contract: the instrumented module object is).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry_instrument::abi;
use ferry_wasi::FUNCTIONS;
use wasmtime::{Caller, FuncType, Global, Linker, Memory, TypedFunc, Val, ValType};

use crate::error::EngineError;
use crate::host::{self, HostCx, HostState, HostStop};
use crate::seam::{Backend, Compiled, EngineKind, Instance, Stop, TrapFrame, TrapReport, Value};

/// Largest Wasm stack a guest may use (deep recursion, CPython).
pub(crate) const MAX_WASM_STACK: usize = 64 << 20;

#[derive(Clone)]
pub(crate) struct Jit {
    engine: wasmtime::Engine,
    cache_dir: Option<PathBuf>,
}

impl std::fmt::Debug for Jit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jit")
            .field("cache_dir", &self.cache_dir)
            .finish()
    }
}

impl Jit {
    pub(crate) fn new(cache_dir: Option<PathBuf>) -> Result<Self, EngineError> {
        let mut config = wasmtime::Config::new();
        config.wasm_multi_memory(true);
        config.wasm_multi_value(true);
        config.async_stack_size(MAX_WASM_STACK + (1 << 20));
        config.max_wasm_stack(MAX_WASM_STACK);
        config.cranelift_opt_level(wasmtime::OptLevel::Speed);
        // The transform marks its unwind paths unlikely; Cranelift then lays them out cold.
        config.wasm_branch_hinting(true);
        // The exception-handling proposal (CPython 3.15 with numpy uses it); exnref lives on
        // the GC heap, hence the `gc` feature.
        config.wasm_exceptions(true);
        // No map from machine code back to wasm offsets: a trap's backtrace still names each
        // function, and the offsets it would give are the instrumented module's, which a user
        // cannot relate to their program. Without the map, compiling CPython 3.15 needs ~1.2
        // GB less memory and caches 1.33 GB of code instead of 1.53 (docs/benchmarks.md,
        // "Compiling a big module"). FERRY_ADDRESS_MAP=1 (with an empty FERRY_CACHE) keeps it,
        // to read offsets while working on the transform.
        config.generate_address_map(std::env::var_os("FERRY_ADDRESS_MAP").is_some());
        // FERRY_PERFMAP=1 writes /tmp/perf-<pid>.map, so `perf report` names guest functions.
        if std::env::var_os("FERRY_PERFMAP").is_some() {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        // FERRY_EMIT_CLIF=DIR writes each compiled function's optimised Cranelift IR into DIR
        // (with FERRY_CACHE pointing at an empty directory, so the module is compiled again).
        if let Some(dir) = std::env::var_os("FERRY_EMIT_CLIF") {
            config.emit_clif(std::path::Path::new(&dir));
        }
        let engine =
            wasmtime::Engine::new(&config).map_err(|e| EngineError::Compile(e.to_string()))?;
        Ok(Self { engine, cache_dir })
    }

    fn cache_path(&self, key: &str) -> Option<PathBuf> {
        self.cache_dir
            .as_ref()
            .map(|d| d.join(format!("{key}-ferry{}.cwasm", env!("CARGO_PKG_VERSION"))))
    }
}

struct JitModule {
    engine: wasmtime::Engine,
    module: wasmtime::Module,
}

impl Backend for Jit {
    fn kind(&self) -> EngineKind {
        EngineKind::Jit
    }
    fn engine_classes(&self) -> &'static [&'static str] {
        &[crate::ENGINE_CLASS, crate::ENGINE_CLASS_EXCEPTIONS]
    }

    fn compile(
        &self,
        cache_key: Option<&str>,
        bytes: &mut dyn FnMut() -> Result<Vec<u8>, EngineError>,
        progress: &(dyn Fn(&str) + Sync),
    ) -> Result<Arc<dyn Compiled>, EngineError> {
        let done = |module| -> Result<Arc<dyn Compiled>, EngineError> {
            Ok(Arc::new(JitModule {
                engine: self.engine.clone(),
                module,
            }))
        };
        let path = cache_key.and_then(|k| self.cache_path(k));
        if let Some(p) = path.as_ref().filter(|p| p.exists()) {
            // SAFETY: the file was written by `Module::serialize` of this same build into the
            // user's own cache directory; wasmtime checks engine compatibility when loading
            // and an incompatible or damaged file falls through to a fresh compile.
            if let Ok(m) = unsafe { wasmtime::Module::deserialize_file(&self.engine, p) } {
                crate::cache::touch(p);
                return done(m);
            }
        }
        let bytes = bytes()?;
        let big = bytes.len() > 1 << 20;
        if big {
            progress(&format!(
                "compiling {} MB of wasm (cached afterwards)",
                bytes.len() >> 20
            ));
        }
        let started = std::time::Instant::now();
        // A big module compiles for minutes (CPython 3.15: ~9 on 2 cores) with nothing else
        // to show: say every minute that it is still going.
        let compile = || wasmtime::Module::new(&self.engine, &bytes);
        let m = if big {
            while_ticking(COMPILE_TICK, progress, compile)
        } else {
            compile()
        }
        .map_err(|e| EngineError::Compile(format!("{e:#}")))?;
        if big {
            progress(&format!(
                "compiled in {:.1} s",
                started.elapsed().as_secs_f64()
            ));
        }
        // A cache write that fails only costs a compile next time.
        if let (Some(p), Ok(ser)) = (path, m.serialize()) {
            let _ = crate::cache::insert(&p, &ser);
        }
        done(m)
    }
}

/// How often a long compile says it is still going.
const COMPILE_TICK: Duration = Duration::from_secs(60);

/// Runs `work`; every `tick` until it returns, reports (through `progress`) how long it has
/// run so far.
fn while_ticking<T>(
    tick: Duration,
    progress: &(dyn Fn(&str) + Sync),
    work: impl FnOnce() -> T,
) -> T {
    let (done, wait) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            let mut so_far = Duration::ZERO;
            // Ends when `done` is dropped (the work returned or panicked).
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(tick) {
                so_far += tick;
                progress(&format!("still compiling ({} so far)", minutes(so_far)));
            }
        });
        let out = work();
        drop(done);
        out
    })
}

/// `90 s` as "1 min 30 s", `60 s` as "1 min", `45 s` as "45 s".
fn minutes(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 60, s % 60) {
        (0, s) => format!("{s} s"),
        (m, 0) => format!("{m} min"),
        (m, s) => format!("{m} min {s} s"),
    }
}

/// Store data: the host state plus the exports host functions use on every call.
struct Data {
    host: HostState,
    memory: Option<Memory>,
    handles: Option<Handles>,
    limits: wasmtime::StoreLimits,
}

#[derive(Debug, Clone, Copy)]
struct Handles {
    ctl: Memory,
    state: Global,
    sp: Global,
}

/// The guest has called `proc_exit`.
#[derive(Debug)]
struct GuestExit(i32);

impl std::fmt::Display for GuestExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "guest exited with code {}", self.0)
    }
}

impl std::error::Error for GuestExit {}

fn stop_error(s: HostStop) -> wasmtime::Error {
    match s {
        HostStop::Exit(code) => wasmtime::Error::new(GuestExit(code)),
        HostStop::Fatal(m) => wasmtime::Error::msg(m),
    }
}

impl HostCx for Caller<'_, Data> {
    fn host(&mut self) -> &mut HostState {
        &mut self.data_mut().host
    }
    fn instrumented(&self) -> bool {
        self.data().handles.is_some()
    }
    fn state(&mut self) -> i32 {
        let h = self.data().handles.expect("instrumented");
        h.state.get(&mut *self).unwrap_i32()
    }
    fn set_state(&mut self, v: i32) {
        let h = self.data().handles.expect("instrumented");
        h.state
            .set(&mut *self, Val::I32(v))
            .expect("ferry:state is a mutable i32");
    }
    fn sp(&mut self) -> i32 {
        let h = self.data().handles.expect("instrumented");
        h.sp.get(&mut *self).unwrap_i32()
    }
    fn set_sp(&mut self, v: i32) {
        let h = self.data().handles.expect("instrumented");
        h.sp.set(&mut *self, Val::I32(v))
            .expect("ferry:sp is a mutable i32");
    }
    fn set_flag(&mut self, on: bool) {
        let h = self.data().handles.expect("instrumented");
        h.ctl.data_mut(&mut *self)[..4].copy_from_slice(&u32::from(on).to_le_bytes());
    }
    fn memory_and_host(&mut self) -> Option<(&mut [u8], &mut HostState)> {
        let m = self.data().memory?;
        let (mem, data) = m.data_and_store_mut(self);
        Some((mem, &mut data.host))
    }
}

fn linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<Data>> {
    let mut linker = Linker::new(engine);
    linker.func_wrap(abi::MODULE, abi::POLL, |mut caller: Caller<'_, Data>| {
        host::poll(&mut caller).map_err(stop_error)
    })?;
    let (module, name) = host::HOST_DOOR;
    linker.func_wrap(module, name, |_: i32, _: i32, _: i32, _: i32| -> i32 {
        host::NO_HOST
    })?;
    for (name, sig) in FUNCTIONS {
        let params = sig
            .params
            .iter()
            .map(|&wide| if wide { ValType::I64 } else { ValType::I32 });
        let results: &[ValType] = if sig.returns { &[ValType::I32] } else { &[] };
        let ty = FuncType::new(engine, params, results.iter().cloned());
        let returns = sig.returns;
        linker.func_new(
            "wasi_snapshot_preview1",
            name,
            ty,
            move |mut caller, args, results| {
                let ints: Vec<i64> = args
                    .iter()
                    .map(|v| match v {
                        Val::I32(x) => i64::from(*x),
                        Val::I64(x) => *x,
                        _ => 0,
                    })
                    .collect();
                let v = host::wasi_call(&mut caller, name, &ints).map_err(stop_error)?;
                if returns {
                    results[0] = Val::I32(v);
                }
                Ok(())
            },
        )?;
    }
    Ok(linker)
}

impl Compiled for JitModule {
    fn instantiate(
        &self,
        host: HostState,
        instrumented: bool,
    ) -> Result<Box<dyn Instance>, EngineError> {
        let mut limits = wasmtime::StoreLimitsBuilder::new();
        if let Some(max) = host.control.memory_limit() {
            limits = limits.memory_size(usize::try_from(max).unwrap_or(usize::MAX));
        }
        let data = Data {
            host,
            memory: None,
            handles: None,
            limits: limits.build(),
        };
        let mut store = wasmtime::Store::new(&self.engine, data);
        store.limiter(|d| &mut d.limits);
        let linker = linker(&self.engine).map_err(|e| EngineError::Instantiate(e.to_string()))?;
        let instance = linker
            .instantiate(&mut store, &self.module)
            .map_err(|e| EngineError::Instantiate(format!("{e:#}")))?;
        let lacks =
            |name: &str| EngineError::Instantiate(format!("instrumented module lacks `{name}`"));
        store.data_mut().memory = instance.get_memory(&mut store, "memory");
        if instrumented {
            let ctl = instance
                .get_memory(&mut store, abi::CTL_MEMORY)
                .ok_or_else(|| lacks(abi::CTL_MEMORY))?;
            let state = instance
                .get_global(&mut store, abi::STATE_GLOBAL)
                .ok_or_else(|| lacks(abi::STATE_GLOBAL))?;
            let sp = instance
                .get_global(&mut store, abi::SP_GLOBAL)
                .ok_or_else(|| lacks(abi::SP_GLOBAL))?;
            store.data_mut().handles = Some(Handles { ctl, state, sp });
        }
        Ok(Box::new(JitInstance {
            store,
            instance,
            funcs: HashMap::new(),
            mappings: 0,
        }))
    }
}

struct JitInstance {
    store: wasmtime::Store<Data>,
    instance: wasmtime::Instance,
    funcs: HashMap<String, Entry>,
    /// Mappings [`Instance::map_file`] made in this instance's memories (counted in
    /// `mapped`'s count until the instance, and with it its memories, is dropped).
    mappings: usize,
}

impl Drop for JitInstance {
    fn drop(&mut self) {
        crate::mapped::released(self.mappings);
    }
}

impl JitInstance {
    fn func(&mut self, name: &str) -> Option<Entry> {
        if let Some(f) = self.funcs.get(name) {
            return Some(f.clone());
        }
        let f = match self
            .instance
            .get_typed_func::<(), ()>(&mut self.store, name)
        {
            Ok(f) => Entry::Unit(f),
            Err(_) => Entry::Code(
                self.instance
                    .get_typed_func::<(), i32>(&mut self.store, name)
                    .ok()?,
            ),
        };
        self.funcs.insert(name.to_owned(), f.clone());
        Some(f)
    }
}

impl Instance for JitInstance {
    fn host(&mut self) -> &mut HostState {
        &mut self.store.data_mut().host
    }

    fn export_names(&mut self) -> Vec<String> {
        self.instance
            .exports(&mut self.store)
            .map(|e| e.name().to_owned())
            .collect()
    }

    fn has_func(&mut self, name: &str) -> bool {
        self.func(name).is_some()
    }

    fn call(&mut self, name: &str) -> Result<Option<i32>, Stop> {
        let f = self
            .func(name)
            .ok_or_else(|| Stop::Fatal(format!("no function `{name}`")))?;
        let r = match f {
            Entry::Unit(f) => f.call(&mut self.store, ()).map(|()| None),
            Entry::Code(f) => f.call(&mut self.store, ()).map(Some),
        };
        r.map_err(|e| match e.downcast_ref::<GuestExit>() {
            Some(GuestExit(code)) => Stop::Exit(*code),
            None => match e.downcast_ref::<wasmtime::Trap>() {
                Some(trap) => Stop::Trap(trap_report(&e, trap)),
                None => Stop::Fatal(trap_message(&e)),
            },
        })
    }

    fn memory(&mut self, name: &str) -> Option<&[u8]> {
        let m = self.instance.get_memory(&mut self.store, name)?;
        Some(m.data(&self.store))
    }

    fn memory_mut(&mut self, name: &str) -> Option<&mut [u8]> {
        let m = self.instance.get_memory(&mut self.store, name)?;
        Some(m.data_mut(&mut self.store))
    }

    fn grow(&mut self, name: &str, pages: u64) -> Result<(), String> {
        let m = self
            .instance
            .get_memory(&mut self.store, name)
            .ok_or_else(|| format!("no memory `{name}`"))?;
        m.grow(&mut self.store, pages)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn memory_stays_put(&self) -> bool {
        // Each 32-bit memory has a 4 GiB reservation of its own.
        true
    }

    fn map_file(
        &mut self,
        name: &str,
        at: usize,
        file: &std::fs::File,
        offset: u64,
        len: usize,
    ) -> Result<bool, String> {
        let Some(m) = self.instance.get_memory(&mut self.store, name) else {
            return Ok(false);
        };
        let data = m.data_mut(&mut self.store);
        // SAFETY: wasmtime keeps a memory's accessible bytes mapped read-write for the
        // memory's life, and unmaps its whole reservation when the memory is dropped.
        unsafe { crate::mapped::map_file(data, at, file, offset, len, &mut self.mappings) }
    }

    fn global(&mut self, name: &str) -> Option<Value> {
        let g = self.instance.get_global(&mut self.store, name)?;
        Some(match g.get(&mut self.store) {
            Val::I32(x) => Value::I32(x),
            Val::I64(x) => Value::I64(x),
            Val::F32(x) => Value::F32(x),
            Val::F64(x) => Value::F64(x),
            Val::V128(x) => Value::V128(x.as_u128()),
            _ => return None,
        })
    }

    fn set_global(&mut self, name: &str, v: Value) -> Result<(), String> {
        let g = self
            .instance
            .get_global(&mut self.store, name)
            .ok_or_else(|| format!("no global `{name}`"))?;
        let v = match v {
            Value::I32(x) => Val::I32(x),
            Value::I64(x) => Val::I64(x),
            Value::F32(x) => Val::F32(x),
            Value::F64(x) => Val::F64(x),
            Value::V128(x) => Val::V128(x.into()),
        };
        g.set(&mut self.store, v).map_err(|e| e.to_string())
    }
}

/// A trap as ferry reports it: its cause worded as on the interpreter (the WebAssembly
/// specification's wording, without wasmtime's `wasm trap:` prefix), then the guest's call
/// stack.
fn trap_report(e: &wasmtime::Error, trap: &wasmtime::Trap) -> TrapReport {
    let cause = trap.to_string();
    let cause = cause.strip_prefix("wasm trap: ").unwrap_or(&cause);
    let frames = e
        .downcast_ref::<wasmtime::WasmBacktrace>()
        .map_or(&[][..], |b| b.frames())
        .iter()
        .map(|f| TrapFrame {
            func: f.func_index(),
            name: f.func_name().map(str::to_owned),
            // Only with `FERRY_ADDRESS_MAP=1` (work on the transform): the offset in the
            // instrumented module.
            offset: f.module_offset(),
        })
        .collect();
    TrapReport::with_frames(cause, frames)
}

/// A host-side failure's message and the innermost frames of its backtrace.
fn trap_message(e: &wasmtime::Error) -> String {
    let full = format!("{e:?}");
    let lines: Vec<&str> = full.lines().collect();
    if lines.len() <= 16 {
        return full;
    }
    let causes: Vec<&str> = lines
        .iter()
        .skip_while(|l| !l.starts_with("Caused by"))
        .copied()
        .collect();
    let mut out: Vec<&str> = lines[..9].to_vec();
    out.push("    ...");
    out.extend(causes);
    out.join("\n")
}

/// An exported entry function: `() -> ()`, or a reactor's `() -> i32` returning an exit code.
#[derive(Clone)]
enum Entry {
    Unit(TypedFunc<(), ()>),
    Code(TypedFunc<(), i32>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn long_work_says_it_is_still_going_until_it_returns() {
        let said = Mutex::new(Vec::new());
        let progress = |m: &str| said.lock().unwrap().push(m.to_owned());
        let out = while_ticking(Duration::from_millis(40), &progress, || {
            std::thread::sleep(Duration::from_millis(400));
            7
        });
        assert_eq!(out, 7);
        let said = said.into_inner().unwrap();
        // Ten ticks fit in 400 ms (a loaded machine may tick late, never early).
        assert!((1..=10).contains(&said.len()), "{said:?}");
        assert!(
            said[0].starts_with("still compiling (0 s so far"),
            "{said:?}"
        );
        let quick = Mutex::new(0);
        while_ticking(
            Duration::from_secs(60),
            &|_: &str| *quick.lock().unwrap() += 1,
            || {},
        );
        assert_eq!(
            *quick.lock().unwrap(),
            0,
            "work done before the first tick says nothing"
        );
    }

    #[test]
    fn durations_read_in_minutes_and_seconds() {
        let m = |s| minutes(Duration::from_secs(s));
        assert_eq!(
            [m(45), m(60), m(90), m(600)],
            ["45 s", "1 min", "1 min 30 s", "10 min"]
        );
    }
}
