//! Makes a WebAssembly (WASI preview 1) command module *suspendable*: it can stop at a safe
//! point, hand its whole call stack to the host as plain bytes, and later — in another process,
//! engine or machine — rebuild that stack and continue.
//!
//! # Why ferry has its own transform
//! Engines do not expose their native stacks, so the module must save and rebuild its own.
//! Binaryen's Asyncify does this by *flattening* every instrumented function, which measured
//! ~12x slower on CPython (hundreds of always-live locals in the interpreter loop) and cannot
//! handle the exception-handling proposal. This transform never flattens. For each function
//! that can be on the stack at a safe point it:
//!
//! * spills the operand stack into locals only *at* unwind-capable call sites (values are
//!   re-pushed immediately, so on the normal path these are SSA copies);
//! * wraps the straight-line code between such sites in `if (!rewinding)` guards, so a rewind
//!   skips everything up to the call site it must re-enter, keeping the original nesting;
//! * after each such call, checks the global unwind state and, if unwinding, branches to one
//!   shared epilogue that writes the locals and the call-site number to a *secondary memory*
//!   (never the guest's own memory) and returns;
//! * on entry while rewinding, pops that record (checking it names this function) and
//!   restores the locals.
//!
//! Safe points are polls at every loop header (a counted loop's unpolled copy polls only on
//! the ways back of the loops inside it: `counted.rs`) and, in functions on a call-graph cycle, just
//! after each call that stays inside the cycle (a return poll), so the time to reach one is
//! bounded. A poll costs one load and one branch while no suspend
//! is pending: the host raises a flag word in a one-page control memory that never moves.
//!
//! The run-time contract between the instrumented module and the host is in [`abi`].

pub mod abi;
mod counted;
mod emit;
mod error;
mod frames;
mod live;
mod module;
mod plan;
mod select_guard;

pub use error::InstrumentError;
pub use frames::frame_functions;
pub use module::{
    Instrumented, Stats, instrument, instrument_any, instrument_any_counting, instrument_counting,
};
pub use select_guard::{SELECT_GUARD_VERSION, guard_select_conditions};

#[cfg(test)]
mod cross_engine;
#[cfg(test)]
mod differential;
#[cfg(test)]
mod tests;

/// Version of this transform. It is part of the derivation ref of every instrumented module
/// (`derived/instrument-v<N>/<κ>`) and of every snapshot: change it whenever the output for
/// some input changes.
pub const INSTRUMENT_VERSION: u32 = 19;
