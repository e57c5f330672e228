//! Asking a running guest to stop at its next safe point, from any thread.

use std::sync::atomic::{AtomicU8, AtomicU32, AtomicUsize, Ordering};

/// What the host wants from the guest at its next safe point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// Nothing.
    None = 0,
    /// Snapshot and keep running.
    Checkpoint = 1,
    /// Snapshot and stop.
    Suspend = 2,
}

/// Shared between the guest's thread and whoever asks it to stop (signal handlers, timers).
#[derive(Debug, Default)]
pub struct Control {
    request: AtomicU8,
    /// Address of the guest's poll flag word (in its `ferry:ctl` memory), 0 when no guest runs.
    flag: AtomicUsize,
}

impl Control {
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks for `r`. A suspend is never downgraded to a checkpoint.
    pub fn request(&self, r: Request) {
        let _ = self.request.fetch_max(r as u8, Ordering::SeqCst);
        self.raise_flag();
    }

    /// The pending request.
    pub fn pending(&self) -> Request {
        match self.request.load(Ordering::SeqCst) {
            0 => Request::None,
            1 => Request::Checkpoint,
            _ => Request::Suspend,
        }
    }

    /// Takes the pending request, leaving none.
    pub(crate) fn take(&self) -> Request {
        match self.request.swap(0, Ordering::SeqCst) {
            0 => Request::None,
            1 => Request::Checkpoint,
            _ => Request::Suspend,
        }
    }

    pub(crate) fn attach(&self, flag_addr: usize) {
        self.flag.store(flag_addr, Ordering::SeqCst);
        if self.pending() != Request::None {
            self.raise_flag();
        }
    }

    pub(crate) fn detach(&self) {
        self.flag.store(0, Ordering::SeqCst);
    }

    fn raise_flag(&self) {
        let addr = self.flag.load(Ordering::SeqCst);
        if addr != 0 {
            // SAFETY: `addr` is the start of a live, 4-byte-aligned, one-page Wasm memory that
            // never grows or moves (`ferry:ctl`, min = max = 1 page); it is detached before
            // that memory is freed. Guest code reads the word with plain loads, as wasmtime's
            // own epoch counter is read.
            unsafe { (*(addr as *const AtomicU32)).store(1, Ordering::SeqCst) };
        }
    }
}
