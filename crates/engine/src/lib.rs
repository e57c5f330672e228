//! Runs suspendable modules on wasmtime or wasmi, and turns their state into snapshot objects and back.
//!
//! * [`Runtime::prepare`] — original module → instrumented module (an object derived from the
//!   original's κ, cached through a ref) → compiled code (a machine cache, never the contract).
//! * [`Runtime::run`] — runs a guest from the start or from a snapshot; when a suspend or
//!   checkpoint is requested through [`Control`] the guest unwinds at its next safe point,
//!   [`snapshot::write`] stores the snapshot, and the guest either stops or rewinds and goes on.
//! * [`snapshot::load`] — the verified resume transition of DESIGN §1.6 up to `Restoring`.

mod cache;
pub mod closure;
mod control;
pub mod dirty;
mod error;
pub mod gc;
mod host;
mod imports;
mod incremental;
mod interp;
mod jit;
mod mapped;
mod prepare;
mod run;
mod seam;
pub mod snapshot;
mod throttle;

pub use control::{Control, Hold, Request};
pub use error::{EXIT_TRAPPED, EngineError, Stage};
pub use imports::ImportError;
pub use prepare::{OtherVersions, Prepared, Runtime};
pub use run::{Outcome, PlainModule, SnapshotMeta, Start};
pub use seam::{EngineKind, Stop, TrapFrame, TrapReport, Value};
pub use throttle::MAX_PERCENT as MAX_THROTTLE;

/// Holds this thread `ms` milliseconds when `FERRY_FAULT_PAUSE=<step>:<ms>` names `step`: the
/// fault-injection tests use it to act inside a window that is otherwise short (the space's
/// migration steps, and `check-mapped`: the check of the chunks a resume mapped, which then
/// starts that much after the guest runs).
pub fn fault_pause(step: &str) {
    if let Ok(v) = std::env::var("FERRY_FAULT_PAUSE")
        && let Some((at, ms)) = v.split_once(':')
        && at == step
        && let Ok(ms) = ms.parse()
    {
        tracing::warn!(step, ms, "fault injection: pausing");
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Host contract version recorded in every snapshot's profile.
pub const HOST_CONTRACT: &str = "ferry-host/1";
/// Engine class every ferry snapshot needs: core Wasm 2.0 (SIMD included) plus multi-memory
/// (the saved stack and the control word live in memories of their own). Both engines provide
/// it; an engine that lacks part of it (say, a browser without SIMD) declares a narrower class
/// and refuses such snapshots at Admitting, naming what it lacks.
pub const ENGINE_CLASS: &str = "wasm-core-2+multi-memory";
/// Engine class of snapshots of modules that use the exception-handling proposal (tags,
/// `try_table`, `exnref`): only the JIT engine provides it.
pub const ENGINE_CLASS_EXCEPTIONS: &str = "wasm-core-2+multi-memory+exceptions";

/// Whether `wasm` declares exception tags (the sections before the code are enough: a module
/// that throws or catches must declare its tags).
pub(crate) fn uses_exceptions(wasm: &[u8]) -> bool {
    for payload in wasmparser::Parser::new(0).parse_all(wasm) {
        match payload {
            Ok(wasmparser::Payload::TagSection(r)) => return r.count() > 0,
            Ok(wasmparser::Payload::CodeSectionStart { .. }) | Err(_) => return false,
            _ => {}
        }
    }
    false
}
