//! The `interp` engine: wasmi, a pure-Rust interpreter. No native code is generated, so it runs
//! where JIT is forbidden; it decodes modules lazily (function bodies are translated on first
//! call). What it loads is the module with its `select`s guarded (see [`Interp::compile`]'s
//! body), which costs a read of every function body, so that copy is cached per machine beside
//! the JIT's compiled code.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use ferry_instrument::abi;
use ferry_kappa::Kappa;
use ferry_wasi::FUNCTIONS;
use wasmi::{Caller, FuncType, Global, Linker, Memory, TypedFunc, Val, ValType};

use crate::error::EngineError;
use crate::host::{self, HostCx, HostState, HostStop};
use crate::seam::{Backend, Compiled, EngineKind, Instance, Stop, TrapReport, Value};

/// Deepest call stack a guest may build (frames live on the heap; 20,000-deep C recursion and
/// CPython's own recursion limit fit well within it).
const MAX_RECURSION_DEPTH: usize = 1 << 20;
/// Largest value stack, in bytes.
const MAX_STACK_HEIGHT: usize = 1 << 30;

#[derive(Debug, Clone)]
pub(crate) struct Interp {
    engine: wasmi::Engine,
    /// Where the guarded modules are cached (none: guard at every load).
    cache_dir: Option<PathBuf>,
}

impl Interp {
    pub(crate) fn new(cache_dir: Option<PathBuf>) -> Self {
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
            cache_dir,
        }
    }
}

struct InterpModule {
    engine: wasmi::Engine,
    module: wasmi::Module,
    /// Memory 0's type when the module was rewritten to import it ([`import_memory0`]).
    memory0: Option<wasmi::MemoryType>,
}

impl Backend for Interp {
    fn kind(&self) -> EngineKind {
        EngineKind::Interp
    }

    fn compile(
        &self,
        cache_key: Option<&str>,
        bytes: &mut dyn FnMut() -> Result<Vec<u8>, EngineError>,
        _progress: &(dyn Fn(&str) + Sync),
    ) -> Result<Arc<dyn Compiled>, EngineError> {
        let path = cache_key.and_then(|k| self.cache_path(k));
        // A cached copy was guarded by the same rewrite (the file name carries its version)
        // and ends with the κ of what precedes it: wasmi validates function bodies only when
        // they first run, so a damaged copy must be caught here. One that fails the check, or
        // does not load, falls through to a fresh guard.
        if let Some(p) = path.as_ref()
            && let Ok(mut file) = std::fs::read(p)
            && let Some(at) = file.len().checked_sub(32)
            && Kappa::of(&file[..at]).as_bytes()[..] == file[at..]
        {
            file.truncate(at);
            if let Ok(compiled) = self.load(&file) {
                crate::cache::touch(p);
                return Ok(compiled);
            }
        }
        let mut bytes = bytes()?;
        if crate::uses_exceptions(&bytes) {
            return Err(EngineError::Compile(
                "interp: the module uses the exception-handling proposal, which wasmi does not \
                 implement; run it with `--engine jit`"
                    .into(),
            ));
        }
        // wasmi 2.0.0 miscompiles a `select` on `i32.eqz` of a local
        // (ferry_instrument::guard_select_conditions): every `select` on a computed condition
        // takes it through a local of its own instead. A module the rewrite cannot read is
        // left for wasmi to refuse.
        if let Ok(Some(guarded)) = ferry_instrument::guard_select_conditions(&bytes) {
            bytes = guarded;
        }
        let compiled = self.load(&bytes)?;
        // A cache write that fails only costs a guard next time.
        if let Some(p) = path {
            let sum = *Kappa::of(&bytes).as_bytes();
            bytes.extend_from_slice(&sum);
            let _ = crate::cache::insert(&p, &bytes);
        }
        Ok(compiled)
    }
}

impl Interp {
    fn cache_path(&self, key: &str) -> Option<PathBuf> {
        self.cache_dir.as_ref().map(|d| {
            d.join(format!(
                "{key}-ferry{}-guard{}.{}",
                env!("CARGO_PKG_VERSION"),
                ferry_instrument::SELECT_GUARD_VERSION,
                crate::cache::INTERP_EXT
            ))
        })
    }

    /// Hands wasmi a module whose `select`s are already guarded.
    fn load(&self, bytes: &[u8]) -> Result<Arc<dyn Compiled>, EngineError> {
        // Memory 0 in a reservation of ferry's own (see `Reservation`), when the module
        // allows.
        let (module, memory0) = match import_memory0(bytes).ok().flatten() {
            Some((rewritten, ty)) => (
                wasmi::Module::new(&self.engine, &rewritten),
                Some(wasmi::MemoryType::new(
                    u32::try_from(ty.initial).unwrap_or(u32::MAX),
                    ty.maximum.map(|m| u32::try_from(m).unwrap_or(u32::MAX)),
                )),
            ),
            None => (wasmi::Module::new(&self.engine, bytes), None),
        };
        let module = module.map_err(|e| EngineError::Compile(format!("interp: {e}")))?;
        Ok(Arc::new(InterpModule {
            engine: self.engine.clone(),
            module,
            memory0,
        }))
    }
}

/// Where the interp engine's rewrite puts memory 0: an import only ferry provides.
const MEMORY0_IMPORT: (&str, &str) = ("ferry:interp", "memory0");

/// Memory 0 of `wasm`, if the module defines it (and imports no memory), as `wasm` rewritten
/// to import it instead ([`MEMORY0_IMPORT`]) and its type. Memory indices do not change: an
/// imported memory comes first, and the module's other memories follow as before. Nothing
/// else changes, so the rewritten module runs exactly as the original. `None`: nothing to
/// rewrite (no memory, an imported one, or a kind a static buffer does not serve: 64-bit,
/// shared, custom page sizes).
fn import_memory0(wasm: &[u8]) -> Result<Option<(Vec<u8>, wasmparser::MemoryType)>, String> {
    use wasmparser::{BinaryReader, TypeRef};
    let bad = |e: wasmparser::BinaryReaderError| e.to_string();
    let mut sections = Vec::new();
    let mut at = 8;
    if wasm.len() < 8 {
        return Ok(None);
    }
    while at < wasm.len() {
        let id = wasm[at];
        let mut r = BinaryReader::new(&wasm[at + 1..], at + 1);
        let size = r.read_var_u32().map_err(bad)? as usize;
        let start = at + 1 + r.current_position();
        let end = start
            .checked_add(size)
            .filter(|&e| e <= wasm.len())
            .ok_or("section runs past the module's end")?;
        sections.push((id, start, end));
        at = end;
    }
    const IMPORT: u8 = 2;
    const MEMORY: u8 = 5;
    let Some(&(_, mstart, mend)) = sections.iter().find(|(id, ..)| *id == MEMORY) else {
        return Ok(None);
    };
    let mut r = BinaryReader::new(&wasm[mstart..mend], mstart);
    let count = r.read_var_u32().map_err(bad)?;
    if count == 0 {
        return Ok(None);
    }
    let ty: wasmparser::MemoryType = r.read().map_err(bad)?;
    if ty.memory64 || ty.shared || ty.page_size_log2.is_some() {
        return Ok(None);
    }
    let rest_of_memories = &wasm[mstart + r.current_position()..mend];
    let import = sections.iter().find(|(id, ..)| *id == IMPORT).copied();
    let mut import_body = Vec::new();
    match import {
        Some((_, istart, iend)) => {
            let reader = wasmparser::ImportSectionReader::new(BinaryReader::new(
                &wasm[istart..iend],
                istart,
            ))
            .map_err(bad)?;
            let groups = reader.count();
            for i in reader.clone().into_imports() {
                if matches!(i.map_err(bad)?.ty, TypeRef::Memory(_)) {
                    return Ok(None);
                }
            }
            let mut r = BinaryReader::new(&wasm[istart..iend], istart);
            r.read_var_u32().map_err(bad)?;
            leb(&mut import_body, groups + 1);
            import_body.extend_from_slice(&wasm[istart + r.current_position()..iend]);
        }
        None => leb(&mut import_body, 1),
    }
    for name in [MEMORY0_IMPORT.0, MEMORY0_IMPORT.1] {
        leb(&mut import_body, name.len() as u32);
        import_body.extend_from_slice(name.as_bytes());
    }
    import_body.push(0x02); // memory
    match ty.maximum {
        None => {
            import_body.push(0x00);
            leb(&mut import_body, ty.initial as u32);
        }
        Some(max) => {
            import_body.push(0x01);
            leb(&mut import_body, ty.initial as u32);
            leb(&mut import_body, max as u32);
        }
    }
    let mut memory_body = Vec::new();
    leb(&mut memory_body, count - 1);
    memory_body.extend_from_slice(rest_of_memories);

    let mut out = wasm[..8].to_vec();
    let section = |out: &mut Vec<u8>, id: u8, body: &[u8]| {
        out.push(id);
        leb(out, body.len() as u32);
        out.extend_from_slice(body);
    };
    let mut import_written = false;
    for &(id, start, end) in &sections {
        // The import section goes where it was, or else before the first section that must
        // follow it (any but custom sections and the type section).
        if !import_written && import.is_none() && id != 0 && id != 1 {
            section(&mut out, IMPORT, &import_body);
            import_written = true;
        }
        match id {
            IMPORT => {
                section(&mut out, IMPORT, &import_body);
                import_written = true;
            }
            MEMORY => section(&mut out, MEMORY, &memory_body),
            _ => section(&mut out, id, &wasm[start..end]),
        }
    }
    Ok(Some((out, ty)))
}

/// `v` as an unsigned LEB128 number.
fn leb(out: &mut Vec<u8>, mut v: u32) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// The address range memory 0 of a rewritten module lives in ([`import_memory0`]): reserved
/// whole for its largest size (4 GiB unless the module says less; pages are only backed once
/// touched), so the memory never moves when it grows and starts on a page. That is what lets
/// a restore map chunks from packs into it, snapshots track which pages the guest wrote, and
/// a pre-writer read it while the guest runs, as with wasmtime's memories; wasmi's own
/// memories are heap buffers, moved as they grow.
struct Reservation {
    at: *mut u8,
    len: usize,
}

// SAFETY: an owned mapping, not tied to the thread that made it.
unsafe impl Send for Reservation {}

impl Reservation {
    /// Whether `data` (a memory's bytes) lies here: the memory kept in the reservation.
    fn holds(&self, data: &[u8]) -> bool {
        data.as_ptr() == self.at.cast_const()
    }

    fn new(pages: u64) -> Result<Self, String> {
        let len = usize::try_from(pages.min(1 << 16) << 16).map_err(|e| e.to_string())?;
        // SAFETY: a fresh anonymous mapping, owned by the value returned.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(format!(
                "cannot reserve {len} bytes for the guest's memory: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Self { at: at.cast(), len })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: the mapping `new` made (with whatever `map_file` put in it), no longer
        // used: its store is dropped first.
        unsafe { libc::munmap(self.at.cast(), self.len.max(1)) };
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
        let fail = |e: String| EngineError::Instantiate(e);
        let mut linker = linker(&self.engine).map_err(|e| fail(e.to_string()))?;
        let reservation = match self.memory0 {
            Some(ty) => {
                let r = Reservation::new(ty.maximum().unwrap_or(1 << 16)).map_err(fail)?;
                // SAFETY: the reservation outlives every use of the slice: `InterpInstance`
                // drops its store before its reservation, and on the way out below the store
                // is dropped without touching a static buffer.
                let buf: &'static mut [u8] = unsafe { std::slice::from_raw_parts_mut(r.at, r.len) };
                let memory =
                    Memory::new_static(&mut store, ty, buf).map_err(|e| fail(e.to_string()))?;
                linker
                    .define(MEMORY0_IMPORT.0, MEMORY0_IMPORT.1, memory)
                    .map_err(|e| fail(e.to_string()))?;
                Some(r)
            }
            None => None,
        };
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
            mappings: 0,
            reservation,
        }))
    }
}

struct InterpInstance {
    // Dropped in this order: the store (and its memories) before the reservation.
    store: wasmi::Store<Data>,
    instance: wasmi::Instance,
    funcs: HashMap<String, Entry>,
    /// Mappings [`Instance::map_file`] made in the reservation (counted in `mapped` until the
    /// instance is dropped).
    mappings: usize,
    reservation: Option<Reservation>,
}

impl Drop for InterpInstance {
    fn drop(&mut self) {
        crate::mapped::released(self.mappings);
    }
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
            // The specification's wording, as on the JIT (wasmi adds " 2" to one of them).
            None => match e.as_trap_code() {
                Some(wasmi::TrapCode::IndirectCallToNull) => {
                    Stop::Trap(TrapReport::bare("uninitialized element"))
                }
                Some(code) => Stop::Trap(TrapReport::bare(code.trap_message())),
                None => Stop::Fatal(e.to_string()),
            },
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
        // wasmi writes zeros over what it grows, faulting each page in; in the reservation
        // the kernel can do that for the whole range at once, in about half the time (256
        // MiB: ~100 ms against ~185 ms here). A restore grows a memory to its full size.
        let data = m.data(&self.store);
        if let Some(r) = &self.reservation
            && r.holds(data)
            && let Some(add) = usize::try_from(pages)
                .ok()
                .and_then(|p| p.checked_mul(1 << 16))
            && data.len().checked_add(add).is_some_and(|end| end <= r.len)
        {
            // SAFETY: within the reservation's mapping; populating changes no byte.
            unsafe { libc::madvise(r.at.add(data.len()).cast(), add, libc::MADV_POPULATE_WRITE) };
        }
        m.grow(&mut self.store, pages)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn memory_stays_put(&self) -> bool {
        self.reservation.is_some()
    }

    fn map_file(
        &mut self,
        name: &str,
        at: usize,
        file: &std::fs::File,
        offset: u64,
        len: usize,
    ) -> Result<bool, String> {
        let Some(r) = &self.reservation else {
            return Ok(false);
        };
        let Some(m) = self.instance.get_memory(&self.store, name) else {
            return Ok(false);
        };
        let data = m.data_mut(&mut self.store);
        // Only the memory in the reservation: a heap buffer moves as it grows.
        if !r.holds(data) {
            return Ok(false);
        }
        // SAFETY: `data` lies in the reservation, mapped read-write until the instance is
        // dropped (after its store) and then unmapped whole; `&mut self` borrows it.
        unsafe { crate::mapped::map_file(data, at, file, offset, len, &mut self.mappings) }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn imports_and_memories(wasm: &[u8]) -> (Vec<String>, u32) {
        let mut imports = Vec::new();
        let mut memories = 0;
        for p in wasmparser::Parser::new(0).parse_all(wasm) {
            match p.unwrap() {
                wasmparser::Payload::ImportSection(r) => {
                    for i in r.into_imports() {
                        let i = i.unwrap();
                        imports.push(format!("{}.{}", i.module, i.name));
                    }
                }
                wasmparser::Payload::MemorySection(r) => memories = r.count(),
                _ => {}
            }
        }
        (imports, memories)
    }

    #[test]
    fn memory_0_becomes_an_import_and_the_module_runs_the_same() {
        let wat = r#"(module
            (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
            (memory (export "memory") 2 100)
            (memory (export "second") 1 1)
            (data (i32.const 70000) "\2a")
            (func (export "get") (result i32)
                (drop (memory.grow (i32.const 3)))
                (i32.store8 (i32.const 300000) (i32.const 5))
                (i32.add (i32.load8_u (i32.const 70000)) (i32.add (memory.size)
                    (i32.load8_u (i32.const 300000)))))
            (@custom "after" (after data) "x"))"#;
        let wasm = wat::parse_str(wat).unwrap();
        let (rewritten, ty) = import_memory0(&wasm).unwrap().unwrap();
        assert_eq!((ty.initial, ty.maximum), (2, Some(100)));
        wasmparser::Validator::new()
            .validate_all(&rewritten)
            .unwrap();
        assert_eq!(
            imports_and_memories(&rewritten),
            (
                vec![
                    "wasi_snapshot_preview1.proc_exit".to_owned(),
                    "ferry:interp.memory0".to_owned()
                ],
                1
            )
        );
        // Run on wasmi with the memory in a reservation: data at 70000, grown by 3 pages.
        let engine = wasmi::Engine::default();
        let module = wasmi::Module::new(&engine, &rewritten).unwrap();
        let mut store = wasmi::Store::new(&engine, ());
        let r = Reservation::new(100).unwrap();
        // SAFETY: the reservation outlives the store (dropped at the end of the test, after).
        let buf: &'static mut [u8] = unsafe { std::slice::from_raw_parts_mut(r.at, r.len) };
        let memory =
            Memory::new_static(&mut store, wasmi::MemoryType::new(2, Some(100)), buf).unwrap();
        let mut linker = wasmi::Linker::<()>::new(&engine);
        linker
            .define(MEMORY0_IMPORT.0, MEMORY0_IMPORT.1, memory)
            .unwrap();
        linker
            .func_wrap("wasi_snapshot_preview1", "proc_exit", |_: i32| {})
            .unwrap();
        let instance = linker.instantiate_and_start(&mut store, &module).unwrap();
        let get = instance.get_typed_func::<(), i32>(&store, "get").unwrap();
        assert_eq!(get.call(&mut store, ()).unwrap(), 42 + 5 + 5);
        let m = instance.get_memory(&store, "memory").unwrap();
        assert_eq!(m.data(&store).as_ptr(), r.at.cast_const(), "it never moved");
        assert_eq!(m.data(&store).len(), 5 << 16);
        let second = instance.get_memory(&store, "second").unwrap();
        assert_eq!(second.data(&store).len(), 1 << 16);
        drop(store);
    }

    #[test]
    fn a_module_without_imports_gets_an_import_section_in_its_place() {
        let wasm = wat::parse_str(
            r#"(module (type (func (result i32))) (memory 1)
                (func (export "f") (type 0) (i32.load (i32.const 0))))"#,
        )
        .unwrap();
        let (rewritten, ty) = import_memory0(&wasm).unwrap().unwrap();
        assert_eq!((ty.initial, ty.maximum), (1, None));
        wasmparser::Validator::new()
            .validate_all(&rewritten)
            .unwrap();
        assert_eq!(
            imports_and_memories(&rewritten),
            (vec!["ferry:interp.memory0".to_owned()], 0)
        );
    }

    #[test]
    fn what_a_reservation_cannot_serve_is_left_alone() {
        for wat in [
            r#"(module (func (export "f")))"#,
            r#"(module (import "env" "memory" (memory 1)))"#,
            r#"(module (memory i64 1))"#,
            r#"(module (memory 1 1 shared))"#,
        ] {
            let wasm = wat::parse_str(wat).unwrap();
            assert!(import_memory0(&wasm).unwrap().is_none(), "{wat}");
        }
        assert!(import_memory0(b"\0asm\x01\0\0\0\x05\xff").is_err());
    }

    #[test]
    fn the_guarded_module_is_cached_and_a_damaged_copy_is_guarded_again() {
        let wasm = wat::parse_str(
            r#"(module (memory 1)
                (func (export "f") (param $a i32) (param $b i32) (result i32)
                    (select (i32.const 1) (local.get $b) (i32.eqz (local.get $a)))))"#,
        )
        .unwrap();
        let guarded = ferry_instrument::guard_select_conditions(&wasm)
            .unwrap()
            .expect("a select to guard");
        let dir = tempfile::tempdir().unwrap();
        let interp = Interp::new(Some(dir.path().to_owned()));
        let reads = std::cell::Cell::new(0);
        let load_on = |interp: &Interp| {
            interp
                .compile(
                    Some("k"),
                    &mut || {
                        reads.set(reads.get() + 1);
                        Ok(wasm.clone())
                    },
                    &|_| {},
                )
                .unwrap()
        };
        let load = || load_on(&interp);
        let file = dir
            .path()
            .join(format!("k-ferry{}-guard1.iwasm", env!("CARGO_PKG_VERSION")));
        let cached = || std::fs::read(&file).unwrap();

        load();
        assert_eq!(reads.get(), 1);
        let first = cached();
        let (body, sum) = first.split_at(first.len() - 32);
        assert_eq!(body, &guarded[..], "the cache holds the guarded module");
        assert_eq!(sum, Kappa::of(body).as_bytes());

        load();
        assert_eq!(
            reads.get(),
            1,
            "a cached module is not read or guarded again"
        );

        // One byte changed in the middle of a function body: wasmi would take it (it
        // validates bodies at their first call); the checksum does not.
        let mut damaged = first.clone();
        let at = body.len() - 3;
        damaged[at] ^= 0x40;
        std::fs::write(&file, &damaged).unwrap();
        load();
        assert_eq!(reads.get(), 2, "a damaged copy is guarded afresh");
        assert_eq!(cached(), first, "and replaced");

        std::fs::write(&file, &first[..10]).unwrap();
        load();
        assert_eq!(reads.get(), 3, "so is one cut short");
        assert_eq!(cached(), first);

        let uncached = Interp::new(None);
        for _ in 0..2 {
            load_on(&uncached);
        }
        assert_eq!(reads.get(), 5, "no cache directory: read at every load");
    }
}
