//! The host side of a running guest: ferry's WASI and the `ferry.poll` safe-point import,
//! registered with wasmtime.

use std::sync::Arc;

use ferry_instrument::abi;
use ferry_wasi::{FUNCTIONS, HostError, WasiCtx};
use wasmtime::{Caller, FuncType, Global, Linker, Memory, Val, ValType, bail};

use crate::control::{Control, Request};

/// Per-guest host state, owned by the wasmtime store.
pub(crate) struct HostState {
    pub wasi: WasiCtx,
    /// The guest's `memory` export, which WASI calls read and write.
    pub memory: Option<Memory>,
    /// The unwind machinery (absent when a plain module runs, e.g. as a benchmark baseline).
    pub handles: Option<Handles>,
    pub control: Arc<Control>,
    /// Why the current unwind started.
    pub unwind_reason: Request,
}

/// Exports of the instrumented module the host needs on every call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Handles {
    pub ctl: Memory,
    pub stack: Memory,
    pub state: Global,
    pub sp: Global,
}

/// The guest called `proc_exit`.
#[derive(Debug)]
pub struct GuestExit(pub i32);

impl std::fmt::Display for GuestExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "guest exited with code {}", self.0)
    }
}

impl std::error::Error for GuestExit {}

fn handles(caller: &Caller<'_, HostState>) -> wasmtime::Result<Handles> {
    match caller.data().handles {
        Some(h) => Ok(h),
        None => bail!("host function called before the instance was ready"),
    }
}

pub(crate) fn set_flag(caller: &mut Caller<'_, HostState>, ctl: Memory, on: bool) {
    ctl.data_mut(caller)[..4].copy_from_slice(&u32::from(on).to_le_bytes());
}

/// The innermost frame has been re-entered: the guest runs normally again.
fn finish_rewind(caller: &mut Caller<'_, HostState>) -> wasmtime::Result<()> {
    let h = handles(caller)?;
    if h.sp.get(&mut *caller).unwrap_i32() != 0 {
        bail!("corrupt saved stack: frames left over after the rewind reached its target");
    }
    h.state.set(&mut *caller, Val::I32(abi::STATE_NORMAL))?;
    caller.data().control.mark_running();
    let control = &caller.data().control;
    let pending = control.pending() != Request::None || control.counting();
    set_flag(caller, h.ctl, pending);
    Ok(())
}

fn start_unwind(caller: &mut Caller<'_, HostState>, reason: Request) -> wasmtime::Result<()> {
    let h = handles(caller)?;
    caller.data_mut().unwind_reason = reason;
    h.state.set(&mut *caller, Val::I32(abi::STATE_UNWIND))?;
    h.sp.set(&mut *caller, Val::I32(0))?;
    set_flag(caller, h.ctl, false);
    Ok(())
}

fn poll(caller: &mut Caller<'_, HostState>) -> wasmtime::Result<()> {
    let h = handles(caller)?;
    if h.state.get(&mut *caller).unwrap_i32() == abi::STATE_REWIND {
        return finish_rewind(caller);
    }
    let control = caller.data().control.clone();
    if control.count_safe_point() {
        return start_unwind(caller, Request::Suspend);
    }
    match control.take() {
        Request::None | Request::Probe => {
            set_flag(caller, h.ctl, control.counting());
            Ok(())
        }
        r => start_unwind(caller, r),
    }
}

pub(crate) fn linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<HostState>> {
    let mut linker = Linker::new(engine);
    linker.func_wrap(
        abi::MODULE,
        abi::POLL,
        |mut caller: Caller<'_, HostState>| poll(&mut caller),
    )?;
    for (name, sig) in FUNCTIONS {
        let params = sig
            .params
            .iter()
            .map(|&wide| if wide { ValType::I64 } else { ValType::I32 });
        let results: &[ValType] = if sig.returns { &[ValType::I32] } else { &[] };
        let ty = FuncType::new(engine, params, results.iter().cloned());
        let unwinding = abi::UNWINDING_IMPORTS.contains(&("wasi_snapshot_preview1", name));
        let returns = sig.returns;
        linker.func_new(
            "wasi_snapshot_preview1",
            name,
            ty,
            move |mut caller, args, results| {
                let mut rewinding = false;
                if let (true, Some(h)) = (unwinding, caller.data().handles)
                    && h.state.get(&mut caller).unwrap_i32() == abi::STATE_REWIND
                {
                    finish_rewind(&mut caller)?;
                    rewinding = true;
                }
                let ints: Vec<i64> = args
                    .iter()
                    .map(|v| match v {
                        Val::I32(x) => i64::from(*x),
                        Val::I64(x) => *x,
                        _ => 0,
                    })
                    .collect();
                let Some(memory) = caller.data().memory else {
                    bail!("the module calls WASI but exports no `memory`");
                };
                let (mem, host) = memory.data_and_store_mut(&mut caller);
                host.wasi.rewinding = rewinding;
                let r = host.wasi.call(name, mem, &ints);
                host.wasi.rewinding = false;
                match r {
                    Ok(v) => {
                        if returns {
                            results[0] = Val::I32(v);
                        }
                        Ok(())
                    }
                    Err(HostError::Exit(code)) => Err(wasmtime::Error::new(GuestExit(code))),
                    Err(HostError::Unwind) => {
                        let reason = caller.data().control.take();
                        start_unwind(&mut caller, reason)?;
                        if returns {
                            results[0] = Val::I32(0);
                        }
                        Ok(())
                    }
                    Err(HostError::Fatal(m)) => bail!("{name}: {m}"),
                }
            },
        )?;
    }
    Ok(linker)
}
