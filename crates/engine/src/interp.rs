//! The `interp` engine: wasmi, a pure-Rust interpreter. No native code is generated, so it runs
//! where JIT is forbidden; it decodes modules lazily (function bodies are translated on first
//! call), so there is nothing worth caching.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_instrument::abi;
use ferry_wasi::FUNCTIONS;
use wasmi::{Caller, FuncType, Global, Linker, Memory, TypedFunc, Val, ValType};

use crate::error::EngineError;
use crate::host::{self, HostCx, HostState, HostStop};
use crate::seam::{Backend, Compiled, EngineKind, Instance, Stop, Value};

/// Deepest call stack a guest may build (frames live on the heap; 20,000-deep C recursion and
/// CPython's own recursion limit fit well within it).
const MAX_RECURSION_DEPTH: usize = 1 << 20;
/// Largest value stack, in bytes.
const MAX_STACK_HEIGHT: usize = 1 << 30;

#[derive(Debug, Clone)]
pub(crate) struct Interp {
    engine: wasmi::Engine,
}

impl Interp {
    pub(crate) fn new() -> Self {
        let mut config = wasmi::Config::default();
        config
            .wasm_multi_memory(true)
            .wasm_multi_value(true)
            .wasm_simd(true)
            .wasm_extended_const(true)
            .set_max_recursion_depth(MAX_RECURSION_DEPTH)
            .set_max_stack_height(MAX_STACK_HEIGHT)
            .compilation_mode(wasmi::CompilationMode::Lazy);
        Self {
            engine: wasmi::Engine::new(&config),
        }
    }
}

struct InterpModule {
    engine: wasmi::Engine,
    module: wasmi::Module,
}

impl Backend for Interp {
    fn kind(&self) -> EngineKind {
        EngineKind::Interp
    }

    fn compile(
        &self,
        _cache_key: Option<&str>,
        bytes: &mut dyn FnMut() -> Result<Vec<u8>, EngineError>,
        _progress: &dyn Fn(&str),
    ) -> Result<Arc<dyn Compiled>, EngineError> {
        let bytes = &bytes()?;
        if crate::uses_exceptions(bytes) {
            return Err(EngineError::Compile(
                "interp: the module uses the exception-handling proposal, which wasmi does not \
                 implement; run it with `--engine jit`"
                    .into(),
            ));
        }
        let module = wasmi::Module::new(&self.engine, bytes)
            .map_err(|e| EngineError::Compile(format!("interp: {e}")))?;
        Ok(Arc::new(InterpModule {
            engine: self.engine.clone(),
            module,
        }))
    }
}

/// Store data: the host state plus the exports host functions use on every call.
struct Data {
    host: HostState,
    memory: Option<Memory>,
    handles: Option<Handles>,
    limits: wasmi::StoreLimits,
}

#[derive(Debug, Clone, Copy)]
struct Handles {
    ctl: Memory,
    state: Global,
    sp: Global,
}

fn stop_error(s: HostStop) -> wasmi::Error {
    match s {
        HostStop::Exit(code) => wasmi::Error::i32_exit(code),
        HostStop::Fatal(m) => wasmi::Error::new(m),
    }
}

fn i32_of(v: Val) -> i32 {
    match v {
        Val::I32(x) => x,
        _ => 0,
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
        i32_of(h.state.get(&*self))
    }
    fn set_state(&mut self, v: i32) {
        let h = self.data().handles.expect("instrumented");
        h.state
            .set(&mut *self, Val::I32(v))
            .expect("ferry:state is a mutable i32");
    }
    fn sp(&mut self) -> i32 {
        let h = self.data().handles.expect("instrumented");
        i32_of(h.sp.get(&*self))
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

fn linker(engine: &wasmi::Engine) -> Result<Linker<Data>, wasmi::Error> {
    let mut linker = Linker::new(engine);
    linker.func_wrap(abi::MODULE, abi::POLL, |mut caller: Caller<'_, Data>| {
        host::poll(&mut caller).map_err(stop_error)
    })?;
    let (module, name) = host::HOST_DOOR;
    linker.func_wrap(module, name, |_: i32, _: i32, _: i32, _: i32| -> i32 {
        host::NO_HOST
    })?;
    for (name, sig) in FUNCTIONS {
        let params: Vec<ValType> = sig
            .params
            .iter()
            .map(|&wide| if wide { ValType::I64 } else { ValType::I32 })
            .collect();
        let results: &[ValType] = if sig.returns { &[ValType::I32] } else { &[] };
        let ty = FuncType::new(params, results.iter().copied());
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

impl Compiled for InterpModule {
    fn instantiate(
        &self,
        host: HostState,
        instrumented: bool,
    ) -> Result<Box<dyn Instance>, EngineError> {
        let mut limits = wasmi::StoreLimitsBuilder::new();
        if let Some(max) = host.control.memory_limit() {
            limits = limits.memory_size(usize::try_from(max).unwrap_or(usize::MAX));
        }
        let data = Data {
            host,
            memory: None,
            handles: None,
            limits: limits.build(),
        };
        let mut store = wasmi::Store::new(&self.engine, data);
        store.limiter(|d| &mut d.limits);
        let linker = linker(&self.engine).map_err(|e| EngineError::Instantiate(e.to_string()))?;
        let instance = linker
            .instantiate_and_start(&mut store, &self.module)
            .map_err(|e| EngineError::Instantiate(e.to_string()))?;
        let lacks =
            |name: &str| EngineError::Instantiate(format!("instrumented module lacks `{name}`"));
        store.data_mut().memory = instance.get_memory(&store, "memory");
        if instrumented {
            let ctl = instance
                .get_memory(&store, abi::CTL_MEMORY)
                .ok_or_else(|| lacks(abi::CTL_MEMORY))?;
            let state = instance
                .get_global(&store, abi::STATE_GLOBAL)
                .ok_or_else(|| lacks(abi::STATE_GLOBAL))?;
            let sp = instance
                .get_global(&store, abi::SP_GLOBAL)
                .ok_or_else(|| lacks(abi::SP_GLOBAL))?;
            store.data_mut().handles = Some(Handles { ctl, state, sp });
        }
        Ok(Box::new(InterpInstance {
            store,
            instance,
            funcs: HashMap::new(),
        }))
    }
}

struct InterpInstance {
    store: wasmi::Store<Data>,
    instance: wasmi::Instance,
    funcs: HashMap<String, Entry>,
}

impl InterpInstance {
    fn func(&mut self, name: &str) -> Option<Entry> {
        if let Some(f) = self.funcs.get(name) {
            return Some(*f);
        }
        let f = match self.instance.get_typed_func::<(), ()>(&self.store, name) {
            Ok(f) => Entry::Unit(f),
            Err(_) => Entry::Code(
                self.instance
                    .get_typed_func::<(), i32>(&self.store, name)
                    .ok()?,
            ),
        };
        self.funcs.insert(name.to_owned(), f);
        Some(f)
    }
}

impl Instance for InterpInstance {
    fn host(&mut self) -> &mut HostState {
        &mut self.store.data_mut().host
    }

    fn export_names(&mut self) -> Vec<String> {
        self.instance
            .exports(&self.store)
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
        r.map_err(|e| match e.i32_exit_status() {
            Some(code) => Stop::Exit(code),
            None if e.as_trap_code().is_some() => Stop::Trap(e.to_string()),
            None => Stop::Fatal(e.to_string()),
        })
    }

    fn memory(&mut self, name: &str) -> Option<&[u8]> {
        let m = self.instance.get_memory(&self.store, name)?;
        Some(m.data(&self.store))
    }

    fn memory_mut(&mut self, name: &str) -> Option<&mut [u8]> {
        let m = self.instance.get_memory(&self.store, name)?;
        Some(m.data_mut(&mut self.store))
    }

    fn grow(&mut self, name: &str, pages: u64) -> Result<(), String> {
        let m = self
            .instance
            .get_memory(&self.store, name)
            .ok_or_else(|| format!("no memory `{name}`"))?;
        m.grow(&mut self.store, pages)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn global(&mut self, name: &str) -> Option<Value> {
        let g = self.instance.get_global(&self.store, name)?;
        Some(match g.get(&self.store) {
            Val::I32(x) => Value::I32(x),
            Val::I64(x) => Value::I64(x),
            Val::F32(x) => Value::F32(x.to_bits()),
            Val::F64(x) => Value::F64(x.to_bits()),
            Val::V128(x) => Value::V128(x.as_u128()),
            _ => return None,
        })
    }

    fn set_global(&mut self, name: &str, v: Value) -> Result<(), String> {
        let g = self
            .instance
            .get_global(&self.store, name)
            .ok_or_else(|| format!("no global `{name}`"))?;
        let v = match v {
            Value::I32(x) => Val::I32(x),
            Value::I64(x) => Val::I64(x),
            Value::F32(x) => Val::F32(wasmi::F32::from_bits(x)),
            Value::F64(x) => Val::F64(wasmi::F64::from_bits(x)),
            Value::V128(x) => Val::V128(x.into()),
        };
        g.set(&mut self.store, v).map_err(|e| e.to_string())
    }
}

/// An exported entry function: `() -> ()`, or a reactor's `() -> i32` returning an exit code.
#[derive(Clone, Copy)]
enum Entry {
    Unit(TypedFunc<(), ()>),
    Code(TypedFunc<(), i32>),
}
