//! ferry's own WASI preview 1, over virtual state that can be captured at any safe point and
//! rebuilt in another process, engine or machine.
//!
//! The implementation is engine-neutral: every call takes the guest's memory as a byte slice
//! and its arguments as integers ([`WasiCtx::call`]). Guest-visible failures are WASI errnos
//! ([`Errno`]); host-level outcomes — the guest exiting, a suspend starting inside a blocking
//! call, a fault — are [`HostError`], kept apart as in wasmtime.
//!
//! What is virtual: args and env; the fd table (paths and offsets, not host handles); mounts
//! (guest path → host directory, granted again at every resume); stdio byte counts; a
//! monotonic clock that continues from its captured value; a sleep in progress. Sockets are
//! never granted: `sock_*` calls fail with `ENOTSUP` (DESIGN §1.5).

mod calls;
mod ctx;
mod errno;
mod inodes;
pub mod input;
mod mem;
pub mod output;
mod path;
pub mod tree;
pub mod written;

#[cfg(test)]
mod tests;

pub use calls::{FUNCTIONS, Signature};
pub use ctx::{Clock, HostClock, MountSpec, Stdio, WasiCtx};
pub use errno::Errno;
pub use input::{InputError, InputLog, StoredInput};
pub use output::{AppendAtError, OutputBuffer};

/// A host-level outcome of a WASI call (not a guest-visible errno).
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The guest called `proc_exit`.
    #[error("guest exited with code {0}")]
    Exit(i32),
    /// A suspend was requested while the guest was blocked in this call: unwind from here.
    #[error("suspend requested inside a blocking call")]
    Unwind,
    /// Something the guest cannot be allowed to continue from.
    #[error("{0}")]
    Fatal(String),
}
