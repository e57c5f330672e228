//! Asking a running guest to stop at its next safe point, from any thread.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ferry_wasi::WasiCtx;

use crate::snapshot::Loaded;

/// What the host wants from the guest at its next safe point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// Nothing.
    None = 0,
    /// Only measure how long the guest takes to reach a safe point (benchmarks).
    Probe = 1,
    /// Snapshot and keep running.
    Checkpoint = 2,
    /// Snapshot and stop.
    Suspend = 3,
}

impl Request {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Request::None,
            1 => Request::Probe,
            2 => Request::Checkpoint,
            _ => Request::Suspend,
        }
    }
}

/// Shared between the guest's thread and whoever asks it to stop (signal handlers, timers).
#[derive(Debug, Default)]
pub struct Control {
    request: AtomicU8,
    /// Address of the guest's poll flag word (in its `ferry:ctl` memory), 0 when no guest runs.
    flag: AtomicUsize,
    /// When the pending request was made, and the delays until safe points were reached.
    timing: Mutex<Timing>,
    /// Suspend at exactly the n-th safe point from now (0 = off): deterministic churn tests.
    countdown: AtomicU64,
    /// Request a suspend as the guest makes its n-th call to this WASI function (0 = off).
    call_countdown: AtomicU64,
    call_name: Mutex<&'static str>,
    /// Largest size (bytes) any memory of the guest may have, 0 for no limit: instantiation
    /// fails above it and `memory.grow` beyond it returns -1 to the guest.
    memory_limit: AtomicU64,
    /// Called once a snapshot is restored, before the guest runs: `false` stops the run there
    /// (a migration's destination holds a restored guest until the move commits).
    gate: Mutex<Gate>,
    /// Checks of a restored snapshot still running while the guest runs (see
    /// [`Control::check_while_running`]).
    checks: Mutex<Checks>,
    checked: Condvar,
    /// Whether a restoring run may start the guest before its checks end.
    run_while_checking: AtomicBool,
    /// Whether a suspend whose snapshot cannot be written ends the run anyway (a kill).
    end_without_snapshot: AtomicBool,
    /// Pre-write interval in milliseconds, 0 for none (see [`Control::pre_write_every`]).
    pre_write_ms: AtomicU64,
    /// The guest's `memory` as a host function last saw it: address and length in bytes
    /// (address 0: not seen yet), and how many times it was seen.
    memory_at: AtomicUsize,
    memory_len: AtomicUsize,
    memory_seen: AtomicU64,
    /// Asks the next poll to report the memory (see [`Control::look_at_memory`]).
    look: AtomicBool,
    /// Whether a JIT run pre-writes before each [`Control::request_checkpoint`] even
    /// without an interval (see [`Control::pre_write_before_checkpoints`]).
    pre_write_checkpoints: AtomicBool,
    /// The running pre-writer, if any.
    pre_writer: Mutex<Option<Arc<crate::incremental::Waker>>>,
    /// When the snapshot being written now began (its request was taken), if one is (see
    /// [`Control::writing`]).
    writing_since: Mutex<Option<(Instant, Request)>>,
    /// How long the last snapshot written took, from its request being taken (see
    /// [`Control::last_write`]).
    last_write: Mutex<Option<Duration>>,
    /// Bytes of mounted files the snapshot being written has read so far.
    files_read: Arc<AtomicU64>,
    /// Holding the guest back to a share of its time (see [`Control::throttle`]).
    pub(crate) throttle: crate::throttle::Throttle,
}

/// Marks a snapshot as being written (see [`Control::writing`]) until dropped.
pub(crate) struct Writing<'a> {
    control: &'a Control,
}

impl Writing<'_> {
    /// The counter of mounted-file bytes read for this snapshot.
    pub(crate) fn files_read(&self) -> Arc<AtomicU64> {
        self.control.files_read.clone()
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        let since = self
            .control
            .writing_since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((at, _)) = since {
            *self
                .control
                .last_write
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(at.elapsed());
        }
    }
}

/// Checks in flight and the first that failed.
#[derive(Debug, Default)]
struct Checks {
    pending: u32,
    failed: Option<(crate::Stage, String)>,
    /// When the last pending check ended.
    done_at: Option<Instant>,
}

/// What a restored guest that is held (see [`Control::hold_after_restore`]) does next.
pub enum Hold {
    /// Run.
    Run,
    /// Stop without running: the run ends refused.
    Abort,
    /// Stop without running, refused at this stage for this reason (a check that ran while
    /// the guest was restored failed).
    Refuse(crate::Stage, String),
    /// Bring the held guest forward to a later snapshot of the same run (only the memory
    /// chunks that differ are copied), with the WASI context rebuilt from it; then ask again.
    Patch(Box<Loaded>, Box<WasiCtx>),
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Hold::Run => f.write_str("Run"),
            Hold::Abort => f.write_str("Abort"),
            Hold::Refuse(stage, why) => write!(f, "Refuse({stage:?}, {why})"),
            Hold::Patch(l, _) => write!(f, "Patch({})", l.kappa),
        }
    }
}

/// See [`Control::hold_after_restore`].
#[derive(Default)]
struct Gate(Option<Box<dyn FnMut() -> Hold + Send>>);

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Gate(set)"
        } else {
            "Gate"
        })
    }
}

#[derive(Debug, Default)]
struct Timing {
    requested: Option<Instant>,
    to_safe_point: Vec<Duration>,
    running_at: Option<Instant>,
    /// When the guest stopped for the snapshot it is being written now, if any.
    stopped_at: Option<Instant>,
    /// How long the guest was stopped for each snapshot it then went on from.
    pauses: Vec<Duration>,
}

impl Control {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the next suspends end the run even when their snapshot cannot be written:
    /// the run then ends with [`EngineError::Unsaved`](crate::EngineError::Unsaved) once the
    /// guest has unwound (a kill — the guest must stop, saved or not). Off by default: a
    /// failed snapshot leaves the guest running.
    pub fn end_without_snapshot(&self, on: bool) {
        self.end_without_snapshot.store(on, Ordering::SeqCst);
    }

    pub(crate) fn ends_without_snapshot(&self) -> bool {
        self.end_without_snapshot.load(Ordering::SeqCst)
    }

    /// Makes the next restoring run call `gate` once the guest's state is restored and
    /// before it runs, and again after each [`Hold::Patch`], until it says
    /// [`Hold::Run`] or [`Hold::Abort`]. A migration's destination holds a restored guest
    /// this way — brought forward by each pre-copy round — until the move commits.
    pub fn hold_after_restore(&self, gate: impl FnMut() -> Hold + Send + 'static) {
        self.gate.lock().unwrap_or_else(|p| p.into_inner()).0 = Some(Box::new(gate));
    }

    /// Lets the next restoring run start its guest while the last checks of the snapshot —
    /// re-hashing the memory chunks mapped from the store's packs, and the module — still
    /// run on other threads (post-copy). The guest is held at its first host call (output,
    /// files, clocks, exit: anything another party could see) and before any snapshot until
    /// every check has passed; if one fails, the guest is stopped at its next safe point and
    /// the run ends refused, with nothing shown. A migration's destination does not use it:
    /// it must have checked everything before the move commits.
    pub fn check_while_running(&self, on: bool) {
        self.run_while_checking.store(on, Ordering::SeqCst);
    }

    /// See [`Control::check_while_running`].
    pub fn runs_while_checking(&self) -> bool {
        self.run_while_checking.load(Ordering::SeqCst)
    }

    fn checks(&self) -> std::sync::MutexGuard<'_, Checks> {
        self.checks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A check of the restored snapshot has started; [`Control::end_check`] must follow.
    pub(crate) fn begin_check(&self) {
        self.checks().pending += 1;
    }

    /// A check has ended; a failure stops the guest at its next safe point.
    pub(crate) fn end_check(&self, result: Result<(), (crate::Stage, String)>) {
        let mut c = self.checks();
        c.pending = c.pending.saturating_sub(1);
        if let Err(e) = result {
            c.failed.get_or_insert(e);
        }
        if c.pending == 0 {
            c.done_at = Some(Instant::now());
        }
        let failed = c.failed.is_some();
        drop(c);
        self.checked.notify_all();
        if failed {
            self.raise_flag();
        }
    }

    /// Waits until no check is pending: the first failure, if any, as the run's refusal.
    pub(crate) fn wait_checked(&self) -> Result<(), crate::EngineError> {
        let mut c = self.checks();
        while c.pending > 0 {
            c = self.checked.wait(c).unwrap_or_else(|p| p.into_inner());
        }
        match &c.failed {
            Some((stage, why)) => Err(crate::EngineError::refused(*stage, why)),
            None => Ok(()),
        }
    }

    /// Whether a check is still running.
    pub(crate) fn checks_pending(&self) -> bool {
        self.checks().pending > 0
    }

    /// Whether a check has failed (without waiting for the others).
    pub(crate) fn check_failed(&self) -> bool {
        self.checks().failed.is_some()
    }

    /// When the checks that ran while the guest ran last ended (none if none ran).
    pub fn checked_at(&self) -> Option<Instant> {
        self.checks().done_at
    }

    pub(crate) fn take_gate(&self) -> Option<Box<dyn FnMut() -> Hold + Send>> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner()).0.take()
    }

    /// Caps each memory of the guest that is instantiated next at `bytes`: its
    /// `memory.grow` beyond that fails (returns -1), as on a machine with less memory.
    pub fn limit_memory(&self, bytes: u64) {
        self.memory_limit.store(bytes, Ordering::SeqCst);
    }

    /// The cap set by [`Control::limit_memory`], if any.
    pub fn memory_limit(&self) -> Option<u64> {
        Some(self.memory_limit.load(Ordering::SeqCst)).filter(|&b| b > 0)
    }

    /// Copies the guest's memory to the store in the background every `every` (`None`:
    /// never), so that a suspend or checkpoint has only what was written since to store
    /// (`crate::incremental`); a checkpoint asked for with [`Control::request_checkpoint`]
    /// then comes after one more pass. Set before the run starts; the JIT engine only (an
    /// interpreter's memory may move as it grows).
    pub fn pre_write_every(&self, every: Option<Duration>) {
        let ms = every.map_or(0, |d| d.as_millis().clamp(1, u128::from(u64::MAX)) as u64);
        self.pre_write_ms.store(ms, Ordering::SeqCst);
    }

    pub(crate) fn pre_write(&self) -> Option<Duration> {
        Some(self.pre_write_ms.load(Ordering::SeqCst))
            .filter(|&ms| ms > 0)
            .map(Duration::from_millis)
    }

    /// Whether a run on the JIT copies the guest's changed memory before each checkpoint
    /// asked for with [`Control::request_checkpoint`] even without
    /// [`Control::pre_write_every`]: the guest runs during that pass and then pauses only
    /// for what it wrote meanwhile (1 GiB changed: ~25–60 ms instead of ~0.2–0.7 s). Set
    /// before the run starts.
    pub fn pre_write_before_checkpoints(&self, on: bool) {
        self.pre_write_checkpoints.store(on, Ordering::SeqCst);
    }

    /// [`Control::pre_write_before_checkpoints`] as this host is told to: on, unless
    /// `FERRY_PRE_WRITE_CHECKPOINTS=off` (for all that changed, at once) — for runs with
    /// periodic checkpoints, local (`ferry run --checkpoint-every`) or on a space.
    pub fn pre_write_before_checkpoints_unless_off(&self) {
        self.pre_write_before_checkpoints(
            std::env::var("FERRY_PRE_WRITE_CHECKPOINTS").map_or(true, |v| v != "off"),
        );
    }

    /// Whether this run has a pre-writer (on the JIT): an interval, or passes before
    /// checkpoints only.
    pub(crate) fn pre_writes(&self) -> bool {
        self.pre_write().is_some() || self.pre_write_checkpoints.load(Ordering::SeqCst)
    }

    pub(crate) fn attach_pre_writer(&self, w: Option<Arc<crate::incremental::Waker>>) {
        *self.pre_writer.lock().unwrap_or_else(|p| p.into_inner()) = w;
    }

    /// Asks for a checkpoint: where a pre-writer runs ([`Control::pre_write_every`]), after
    /// one pass of it (the guest runs meanwhile, and then pauses only for what it wrote
    /// during the pass), else at once.
    pub fn request_checkpoint(&self) {
        match &*self.pre_writer.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(w) => w.checkpoint(),
            None => self.request(Request::Checkpoint),
        }
    }

    /// Notes where the guest's `memory` is and how long, as a host function sees it.
    pub(crate) fn saw_memory(&self, memory: &[u8]) {
        self.memory_len.store(memory.len(), Ordering::SeqCst);
        self.memory_at
            .store(memory.as_ptr() as usize, Ordering::SeqCst);
        self.memory_seen.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether a look at the memory was asked for (and now is being served).
    pub(crate) fn take_look(&self) -> bool {
        self.look.swap(false, Ordering::SeqCst)
    }

    /// The guest's `memory` (address, length), as its next safe point reports it — or, if it
    /// reaches none within 20 ms (it waits in a host call, which noted the memory on its way
    /// in), as a host function last saw it. A memory only grows, so the length is at most
    /// what it is now. `None` before any was seen.
    pub(crate) fn look_at_memory(&self) -> Option<(usize, usize)> {
        let seen = self.memory_seen.load(Ordering::SeqCst);
        self.look.store(true, Ordering::SeqCst);
        self.raise_flag();
        for _ in 0..20 {
            if self.memory_seen.load(Ordering::SeqCst) != seen {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let at = self.memory_at.load(Ordering::SeqCst);
        (at != 0).then(|| (at, self.memory_len.load(Ordering::SeqCst)))
    }

    /// Asks for `r`. A suspend is never downgraded to a checkpoint.
    pub fn request(&self, r: Request) {
        self.timing().requested.get_or_insert_with(Instant::now);
        let _ = self.request.fetch_max(r as u8, Ordering::SeqCst);
        self.raise_flag();
    }

    fn timing(&self) -> std::sync::MutexGuard<'_, Timing> {
        self.timing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Delays from each request to the safe point that served it, oldest first.
    pub fn safe_point_delays(&self) -> Vec<Duration> {
        self.timing().to_safe_point.clone()
    }

    /// When the last rewind completed (the guest was running again).
    pub fn running_at(&self) -> Option<Instant> {
        self.timing().running_at
    }

    pub(crate) fn mark_running(&self) {
        self.running_again();
        let now = Instant::now();
        let mut t = self.timing();
        t.running_at = Some(now);
        if let Some(at) = t.stopped_at.take() {
            t.pauses.push(now - at);
        }
    }

    /// How long the guest was stopped for each snapshot it went on from (a checkpoint), from
    /// the safe point that served the request until it ran again, oldest first.
    pub fn pauses(&self) -> Vec<Duration> {
        self.timing().pauses.clone()
    }

    /// Marks the snapshot [`Control::take`] asked for as being written until the returned
    /// guard is dropped.
    pub(crate) fn begin_writing(&self) -> Writing<'_> {
        self.files_read.store(0, Ordering::Relaxed);
        self.writing_since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(|| (Instant::now(), Request::Checkpoint));
        Writing { control: self }
    }

    /// The snapshot being written now, if any: how long it has taken so far and how many
    /// bytes of mounted files it has read (a first snapshot of a big directory reads it all;
    /// later ones only the files that changed). A CLI shows it when a suspend takes long.
    pub fn writing(&self) -> Option<(Duration, u64)> {
        let (since, _) = (*self.writing_since.lock().unwrap_or_else(|p| p.into_inner()))?;
        Some((since.elapsed(), self.files_read.load(Ordering::Relaxed)))
    }

    /// How long the last snapshot took to write (or fail), from the safe point that took its
    /// request — the guest was stopped meanwhile. Read it in `on_snapshot`.
    pub fn last_write(&self) -> Option<Duration> {
        *self.last_write.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a suspend is asked for or its snapshot being written: background work on the
    /// guest's behalf gives way (a checkpoint, the guest running on, does not stop it).
    pub(crate) fn suspending(&self) -> bool {
        self.pending() == Request::Suspend
            || matches!(
                *self.writing_since.lock().unwrap_or_else(|p| p.into_inner()),
                Some((_, Request::Suspend))
            )
    }

    /// The pending request.
    pub fn pending(&self) -> Request {
        Request::from_u8(self.request.load(Ordering::SeqCst))
    }

    /// The interrupt check the WASI layer polls while the guest is blocked (a sleep, a read):
    /// whether anything is asked of it.
    pub fn interrupt(self: &Arc<Self>) -> Arc<dyn Fn() -> bool + Send + Sync> {
        let c = self.clone();
        Arc::new(move || c.pending() != Request::None)
    }

    /// Takes the pending request, leaving none, and records how long it waited.
    pub(crate) fn take(&self) -> Request {
        let r = Request::from_u8(self.request.swap(0, Ordering::SeqCst));
        let mut t = self.timing();
        if let Some(at) = t.requested.take() {
            t.to_safe_point.push(at.elapsed());
        }
        if !matches!(r, Request::None | Request::Probe) {
            let now = Instant::now();
            t.stopped_at = Some(now);
            // A snapshot is written from here on (see `begin_writing`): no gap in which one
            // is asked for and none is being written.
            *self.writing_since.lock().unwrap_or_else(|p| p.into_inner()) = Some((now, r));
        }
        r
    }

    /// Suspends at exactly the `n`-th safe point reached from now (`n` ≥ 1). Every poll then
    /// calls the host, which counts: a run armed so uses the counting build of the module
    /// (same frames; see `ferry_instrument::instrument_counting`), so this is for tests that
    /// must suspend at each point in turn.
    pub fn suspend_at_safe_point(&self, n: u64) {
        self.countdown.store(n, Ordering::SeqCst);
        self.raise_flag();
    }

    /// Counts one safe point; `true` when the countdown reaches it. While a countdown runs the
    /// flag stays raised.
    pub(crate) fn count_safe_point(&self) -> bool {
        let n = self.countdown.load(Ordering::SeqCst);
        if n == 0 {
            return false;
        }
        self.countdown.store(n - 1, Ordering::SeqCst);
        n == 1
    }

    /// Requests a suspend just as the guest makes its `n`-th call (`n` ≥ 1) to the WASI
    /// function `name`: a blocking call (a sleep, a read) unwinds inside the call, any other
    /// suspends at the next safe point. Deterministic, for the conformance kit.
    pub fn suspend_in_call(&self, name: &str, n: u64) {
        let known = ferry_wasi::FUNCTIONS
            .iter()
            .find(|(f, _)| *f == name)
            .map(|(f, _)| *f);
        *self.call_name.lock().unwrap_or_else(|p| p.into_inner()) = known.unwrap_or("");
        self.call_countdown.store(n, Ordering::SeqCst);
    }

    /// Counts a call to `name` against [`Control::suspend_in_call`].
    pub(crate) fn count_call(&self, name: &str) {
        let n = self.call_countdown.load(Ordering::Relaxed);
        if n == 0 || *self.call_name.lock().unwrap_or_else(|p| p.into_inner()) != name {
            return;
        }
        self.call_countdown.store(n - 1, Ordering::SeqCst);
        if n == 1 {
            self.request(Request::Suspend);
        }
    }

    pub(crate) fn counting(&self) -> bool {
        self.countdown.load(Ordering::SeqCst) != 0
    }

    pub(crate) fn attach(&self, flag_addr: usize) {
        self.flag.store(flag_addr, Ordering::SeqCst);
        if self.pending() != Request::None || self.counting() {
            self.raise_flag();
        }
    }

    pub(crate) fn detach(&self) {
        self.flag.store(0, Ordering::SeqCst);
    }

    pub(crate) fn raise_flag(&self) {
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
