//! Runs suspendable modules on wasmtime or wasmi, and turns their state into snapshot objects and back.
//!
//! * [`Runtime::prepare`] — original module → instrumented module (an object derived from the
//!   original's κ, cached through a ref) → compiled code (a machine cache, never the contract).
//! * [`Runtime::run`] — runs a guest from the start or from a snapshot; when a suspend or
//!   checkpoint is requested through [`Control`] the guest unwinds at its next safe point,
//!   [`snapshot::write`] stores the snapshot, and the guest either stops or rewinds and goes on.
//! * [`snapshot::load`] — the verified resume transition of DESIGN §1.6 up to `Restoring`.

pub mod closure;
mod control;
pub mod dirty;
mod error;
mod host;
mod interp;
mod jit;
mod prepare;
mod run;
mod seam;
pub mod snapshot;

pub use control::{Control, Hold, Request};
pub use error::{EngineError, Stage};
pub use prepare::{Prepared, Runtime};
pub use run::{Outcome, PlainModule, SnapshotMeta, Start};
pub use seam::{EngineKind, Stop, Value};

/// Host contract version recorded in every snapshot's profile.
pub const HOST_CONTRACT: &str = "ferry-host/1";
/// Engine class every ferry snapshot needs: core Wasm 2.0 (SIMD included) plus multi-memory
/// (the saved stack and the control word live in memories of their own). Both engines provide
/// it; an engine that lacks part of it (say, a browser without SIMD) declares a narrower class
/// and refuses such snapshots at Admitting, naming what it lacks.
pub const ENGINE_CLASS: &str = "wasm-core-2+multi-memory";
