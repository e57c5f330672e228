//! Running a guest: from the start or from a snapshot, until it exits or is suspended.

use std::sync::Arc;

use ferry_instrument::abi;
use ferry_kappa::Kappa;
use ferry_store::Store;
use ferry_wasi::WasiCtx;
use tracing::info;
use wasmtime::Val;

use crate::control::{Control, Request};
use crate::error::{EngineError, Stage};
use crate::host::{GuestExit, Handles, HostState, linker};
use crate::prepare::{Prepared, Runtime};
use crate::snapshot::{self, Loaded};

/// Where a run begins.
#[derive(Debug)]
pub enum Start {
    /// At `_start`.
    Fresh,
    /// Where a snapshot stopped (already verified by [`snapshot::load`]).
    Restore(Box<Loaded>),
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The guest exited with this code.
    Exited(i32),
    /// The guest was suspended; this is its snapshot.
    Suspended(Kappa),
}

/// A module compiled without instrumentation.
#[derive(Debug, Clone)]
pub struct PlainModule(wasmtime::Module);

/// Facts recorded in each snapshot the run writes.
#[derive(Debug, Clone)]
pub struct SnapshotMeta {
    pub program: String,
    pub parent: Option<Kappa>,
    pub generation: u64,
}

/// Detaches the control word before the memory it points into is freed.
struct Attached<'a>(&'a Control);

impl Drop for Attached<'_> {
    fn drop(&mut self) {
        self.0.detach();
    }
}

impl Runtime {
    /// Runs `prepared` until it exits or a suspend completes. Every snapshot taken (suspend or
    /// checkpoint) is reported to `on_snapshot`; a snapshot that fails to be written is
    /// reported too and the guest keeps running (nothing is lost: the previous snapshot stays
    /// as it was).
    #[allow(clippy::too_many_arguments)] // one call site per CLI verb; a builder adds nothing
    pub fn run(
        &self,
        prepared: &Prepared,
        wasi: WasiCtx,
        control: Arc<Control>,
        start: Start,
        store: &dyn Store,
        mut meta: SnapshotMeta,
        on_snapshot: &mut dyn FnMut(Result<Kappa, EngineError>, Request),
    ) -> Result<Outcome, EngineError> {
        let state = HostState {
            wasi,
            memory: None,
            handles: None,
            control: control.clone(),
            unwind_reason: Request::None,
        };
        let mut ws = wasmtime::Store::new(&self.engine, state);
        let linker = linker(&self.engine).map_err(|e| EngineError::Instantiate(e.to_string()))?;
        let instance = linker
            .instantiate(&mut ws, &prepared.compiled)
            .map_err(|e| EngineError::Instantiate(format!("{e:#}")))?;
        let mem = |ws: &mut wasmtime::Store<HostState>, name: &str| {
            instance.get_memory(&mut *ws, name).ok_or_else(|| {
                EngineError::Instantiate(format!("instrumented module lacks `{name}`"))
            })
        };
        let glob = |ws: &mut wasmtime::Store<HostState>, name: &str| {
            instance.get_global(&mut *ws, name).ok_or_else(|| {
                EngineError::Instantiate(format!("instrumented module lacks `{name}`"))
            })
        };
        ws.data_mut().memory = instance.get_memory(&mut ws, "memory");
        let h = Handles {
            ctl: mem(&mut ws, abi::CTL_MEMORY)?,
            stack: mem(&mut ws, abi::STACK_MEMORY)?,
            state: glob(&mut ws, abi::STATE_GLOBAL)?,
            sp: glob(&mut ws, abi::SP_GLOBAL)?,
        };
        ws.data_mut().handles = Some(h);
        // A fresh run calls the former start function, then `_start`; a restored run re-enters
        // the one it was suspended in.
        let mut entries = Vec::new();
        for name in [abi::START_EXPORT, "_start"] {
            if let Ok(f) = instance.get_typed_func::<(), ()>(&mut ws, name) {
                // After an unwind the entry is re-entered through its rewind copy.
                let rewind = instance
                    .get_typed_func::<(), ()>(&mut ws, &abi::rewind_export(name))
                    .ok();
                entries.push((name, f, rewind));
            }
        }
        if entries.last().is_none_or(|(n, _, _)| *n != "_start") {
            return Err(EngineError::Instantiate(
                "module has no `_start` function".into(),
            ));
        }
        let mut phase = 0;
        let mut rewinding = false;

        control.attach(h.ctl.data_ptr(&ws) as usize);
        let _attached = Attached(&control);

        if let Start::Restore(loaded) = start {
            phase = entries
                .iter()
                .position(|(n, _, _)| *n == loaded.snapshot.entry)
                .ok_or_else(|| {
                    EngineError::refused(
                        Stage::Restoring,
                        format!(
                            "snapshot was taken inside `{}`, which this module lacks",
                            loaded.snapshot.entry
                        ),
                    )
                })?;
            snapshot::restore_into(&mut ws, &instance, &loaded, store)?;
            begin_rewind(&mut ws, h)?;
            rewinding = true;
            info!(snapshot = %meta.parent.map(|k| k.to_string()).unwrap_or_default(), "running");
        }

        loop {
            let (name, entry, rewind) = &entries[phase];
            let call = if std::mem::take(&mut rewinding) {
                rewind.as_ref().ok_or_else(|| {
                    EngineError::refused(Stage::Restoring, format!("`{name}` has no rewind copy"))
                })?
            } else {
                entry
            };
            match call.call(&mut ws, ()) {
                Ok(()) => {
                    let state = h.state.get(&mut ws).unwrap_i32();
                    if state == abi::STATE_REWIND {
                        return Err(EngineError::refused(
                            Stage::Restoring,
                            "corrupt saved stack: the rewind never reached its call site",
                        ));
                    }
                    if state != abi::STATE_UNWIND {
                        phase += 1;
                        if phase < entries.len() {
                            continue;
                        }
                        ws.data_mut().wasi.flush();
                        return Ok(Outcome::Exited(0));
                    }
                    let reason = ws.data().unwind_reason;
                    let written =
                        snapshot::write(&mut ws, &instance, h, store, &meta, prepared, name);
                    let ok = written.as_ref().ok().copied();
                    on_snapshot(written, reason);
                    if let Some(k) = ok {
                        meta.parent = Some(k);
                        meta.generation += 1;
                        if reason == Request::Suspend {
                            return Ok(Outcome::Suspended(k));
                        }
                    }
                    begin_rewind(&mut ws, h)?;
                    rewinding = true;
                }
                Err(e) => {
                    ws.data_mut().wasi.flush();
                    if let Some(GuestExit(code)) = e.downcast_ref::<GuestExit>() {
                        return Ok(Outcome::Exited(*code));
                    }
                    return Err(EngineError::Trap(trap_message(&e)));
                }
            }
        }
    }
}

impl Runtime {
    /// Compiles a module as it is, without instrumentation (the benchmark baseline).
    pub fn compile_plain(&self, wasm: &[u8]) -> Result<PlainModule, EngineError> {
        wasmtime::Module::new(&self.engine, wasm)
            .map(PlainModule)
            .map_err(|e| EngineError::Compile(format!("{e:#}")))
    }

    /// Runs an uninstrumented module to completion with the same WASI. Returns its exit code.
    pub fn run_plain(&self, module: &PlainModule, wasi: WasiCtx) -> Result<i32, EngineError> {
        let module = &module.0;
        let state = HostState {
            wasi,
            memory: None,
            handles: None,
            control: Arc::new(Control::new()),
            unwind_reason: Request::None,
        };
        let mut ws = wasmtime::Store::new(&self.engine, state);
        let linker = linker(&self.engine).map_err(|e| EngineError::Instantiate(e.to_string()))?;
        let instance = linker
            .instantiate(&mut ws, module)
            .map_err(|e| EngineError::Instantiate(format!("{e:#}")))?;
        ws.data_mut().memory = instance.get_memory(&mut ws, "memory");
        let entry = instance
            .get_typed_func::<(), ()>(&mut ws, "_start")
            .map_err(|e| EngineError::Instantiate(format!("`_start`: {e}")))?;
        let r = entry.call(&mut ws, ());
        ws.data_mut().wasi.flush();
        match r {
            Ok(()) => Ok(0),
            Err(e) => match e.downcast_ref::<GuestExit>() {
                Some(GuestExit(code)) => Ok(*code),
                None => Err(EngineError::Trap(trap_message(&e))),
            },
        }
    }
}

/// Arms a rewind of the frames saved in `ferry:stack`: the next `_start` call re-enters them.
fn begin_rewind(ws: &mut wasmtime::Store<HostState>, h: Handles) -> Result<(), EngineError> {
    let err = |e: wasmtime::Error| EngineError::Trap(e.to_string());
    h.state
        .set(&mut *ws, Val::I32(abi::STATE_REWIND))
        .map_err(err)?;
    h.ctl.data_mut(&mut *ws)[..4].copy_from_slice(&1u32.to_le_bytes());
    Ok(())
}

/// The trap's cause and the innermost frames of its backtrace (a deep recursion would print
/// thousands of identical lines).
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
