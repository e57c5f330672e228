//! The contract between an instrumented module and the host that runs it.
//!
//! * Import `ferry.poll : [] -> []` — called at a safe point when the flag word is non-zero.
//!   If the host wants to suspend it sets `ferry:state` to [`STATE_UNWIND`] and `ferry:sp` to 0
//!   and returns; every frame then saves itself and returns, so the entry function returns to
//!   the host. While rewinding, the host sets the state back to [`STATE_NORMAL`] here.
//! * Exported memory `ferry:ctl` (1 page, never grows): word 0 is the poll flag. The host may
//!   write it from any thread. It must stay non-zero while an unwind is under way (the guest's
//!   own safe points leave it raised; a host starting an unwind raises it): a return poll
//!   (v14) tests it, not `ferry:state`, to learn that its callee is unwinding.
//! * Exported memory `ferry:stack`: the saved frames, `ferry:sp` bytes long. Each frame is
//!   `[defined function index: u32][call site: u32][locals, naturally aligned]`, innermost frame
//!   first. Rewinding pops frames from the top (outermost first).
//! * Exported globals `ferry:state` and `ferry:sp` (both mutable i32).
//! * Every original memory `N` is exported as `ferry:memory:N`, every mutable global `N` as
//!   `ferry:global:N`, so the host can capture and restore them without knowing the module.
//!   Since v19 a module that drops data segments also exports, past its own globals, one
//!   `ferry:global:N` per dropped segment (1 once dropped); its `ferry:rewind:<name>` exports
//!   drop those segments again before they rewind, so the host does nothing more.
//! * A start function is exported as `ferry:start` instead of running at instantiation.
//! * Imports listed in [`UNWINDING_IMPORTS`] are call sites too: the host may start an unwind
//!   from inside them (a sleep or a blocking read), and on rewind they are called again with
//!   their original arguments while the state is still [`STATE_REWIND`].

/// Version of this contract. Bump it whenever a host must behave differently towards the
/// modules the transform makes (an import, an export, the flag, the state machine or the
/// frame stack as the host sees it): a snapshot made by another version of the transform is
/// resumed with its own instrumented module only if that module speaks this contract
/// ([`host_contract_of`]).
pub const HOST_ABI: u32 = 1;

/// Oldest version of the transform whose modules speak [`HOST_ABI`]: v14 made the poll flag
/// stay raised throughout an unwind; nothing the host sees has changed since.
pub const OLDEST_COMPATIBLE: u32 = 14;

/// The host contract the modules of transform version `version` speak, if this ferry knows
/// it: [`HOST_ABI`] for [`OLDEST_COMPATIBLE`] up to this ferry's own version; `None` for
/// older versions (their contract is no longer spoken) and newer ones (not known here).
pub fn host_contract_of(version: u32) -> Option<u32> {
    (OLDEST_COMPATIBLE..=crate::INSTRUMENT_VERSION)
        .contains(&version)
        .then_some(HOST_ABI)
}

/// Module name of ferry's own imports.
pub const MODULE: &str = "ferry";
/// The safe-point import.
pub const POLL: &str = "poll";
/// Control memory export (flag word at offset 0).
pub const CTL_MEMORY: &str = "ferry:ctl";
/// Saved-stack memory export.
pub const STACK_MEMORY: &str = "ferry:stack";
/// Unwind state global export.
pub const STATE_GLOBAL: &str = "ferry:state";
/// Saved-stack pointer global export.
pub const SP_GLOBAL: &str = "ferry:sp";
/// The module's start function, if it had one: no longer run at instantiation (a resume
/// instantiates again); the host calls it before `_start` on a fresh run.
pub const START_EXPORT: &str = "ferry:start";
/// Prefix of the rewind copy of each exported instrumented function (`_start` included):
/// after an unwind, the host calls `ferry:rewind:<name>` instead of `<name>`.
pub const REWIND_PREFIX: &str = "ferry:rewind:";
/// Prefix of the exports of the original memories.
pub const MEMORY_PREFIX: &str = "ferry:memory:";
/// Prefix of the exports of the original mutable globals.
pub const GLOBAL_PREFIX: &str = "ferry:global:";

/// Running normally.
pub const STATE_NORMAL: i32 = 0;
/// Frames are saving themselves and returning.
pub const STATE_UNWIND: i32 = 1;
/// Frames are restoring themselves and re-entering their call sites.
pub const STATE_REWIND: i32 = 2;

/// WASI imports from which the host may start an unwind (they can block).
pub const UNWINDING_IMPORTS: &[(&str, &str)] = &[
    ("wasi_snapshot_preview1", "poll_oneoff"),
    ("wasi_snapshot_preview1", "fd_read"),
];

/// Name of the export of original memory `index`.
pub fn memory_export(index: u32) -> String {
    format!("{MEMORY_PREFIX}{index}")
}

/// Name of the export of original mutable global `index`.
pub fn global_export(index: u32) -> String {
    format!("{GLOBAL_PREFIX}{index}")
}

/// Name of the rewind copy's export of export `name`.
pub fn rewind_export(name: &str) -> String {
    format!("{REWIND_PREFIX}{name}")
}
