//! Incremental snapshots and pre-writing.
//!
//! For each memory a run keeps what the store holds of it — the κ of each non-zero chunk —
//! and which chunks may have changed since: those under pages written since ([`crate::dirty`])
//! and those not hashed yet (`pending`). A snapshot hashes and stores only those; the others
//! keep their κ. Where tracking is unavailable (or `FERRY_DIRTY=off`), every snapshot hashes
//! the whole memory. `FERRY_VERIFY_DIRTY=1` also hashes everything and fails the snapshot if
//! the image differs from the memory (the tests run with it).
//!
//! Pre-writing (`Control::pre_write_every`; and one more pass before each checkpoint asked
//! for with `Control::request_checkpoint`, which `Control::pre_write_before_checkpoints` asks
//! for without an interval) does the same work while the guest runs: a thread
//! copies the changed chunks of memory 0 out of the running guest, stores the copies and
//! records their κ, so that a suspend or checkpoint has only what was written since to store —
//! CRIU's pre-dump, done as the guest runs. A chunk the guest writes while it is copied is
//! reported written again and hashed at the next pass or snapshot; the copy itself is stored
//! under its own κ, a consistent object whatever the guest did meanwhile. A `--keep` prune
//! right after a snapshot cannot delete a chunk the run still counts as the memory's: the
//! snapshot names every chunk recorded and leaves none pending, and the guest, stopped until
//! the prune ends, writes nothing a pass could store meanwhile.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry_instrument::abi;
use ferry_kappa::Kappa;
use ferry_object::{CHUNK_SIZE, MemoryImage};
use ferry_store::{Store, StoreError};
use ferry_wasi::tree::ImportCache;
use tracing::info;

use crate::control::Control;
use crate::dirty::Tracker;
use crate::seam::Instance;
use crate::snapshot::{is_zero, memory_image};

const SIZE: usize = CHUNK_SIZE as usize;

/// Pre-write passes store at most this many times the memory's size between two snapshots;
/// then they wait for the next. What a pass stores and the guest then writes again is named
/// by no snapshot (until `ferry store gc` or `--keep` deletes it), so a run that pre-writes
/// for hours without a snapshot must not fill the disk with it.
const PRE_WRITE_BUDGET: u64 = 2;

/// Every this many pre-write passes, one protects every written page again (see `pass`).
const FULL_EVERY: u64 = 8;

/// Chunks a pre-write pass copies and stores at a time (16 MiB: one pack each). A snapshot
/// that wants the memory waits for at most one batch.
const PASS_BATCH: usize = 256;

/// See the module documentation. Mounted directories are re-imported at every snapshot,
/// reading only files that changed since this run last stored them
/// ([`ferry_wasi::tree::ImportCache`]).
#[derive(Debug, Default)]
pub(crate) struct Incremental {
    memories: Vec<Slot>,
    /// Mounted files already stored, by this run's snapshots or by earlier runs (the store's
    /// `import-cache`, read at the first snapshot).
    pub(crate) trees: ferry_wasi::tree::ImportCache,
    pub(crate) trees_loaded: bool,
}

/// One memory's tracking, shared between the guest's thread and a pre-writer.
#[derive(Debug, Default, Clone)]
pub(crate) struct Slot(Arc<SlotInner>);

#[derive(Debug, Default)]
struct SlotInner {
    tracked: Mutex<Option<Tracked>>,
    /// Set while a snapshot waits for the slot: a pre-write pass stops at its next batch.
    wanted: AtomicBool,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, Option<Tracked>> {
        self.0.tracked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The tracking, as soon as a pre-write pass in progress has stopped.
    fn take_over(&self) -> MutexGuard<'_, Option<Tracked>> {
        self.0.wanted.store(true, Ordering::SeqCst);
        let g = self.lock();
        self.0.wanted.store(false, Ordering::SeqCst);
        g
    }

    fn wanted(&self) -> bool {
        self.0.wanted.load(Ordering::SeqCst)
    }
}

/// A memory whose writes are tracked: the κ the store holds for each of its non-zero chunks,
/// exact for every chunk but those the tracker reports written and those `pending`.
#[derive(Debug)]
struct Tracked {
    tracker: Tracker,
    chunks: BTreeMap<u32, Kappa>,
    pending: BTreeSet<u32>,
    /// Bytes pre-write passes stored since the last snapshot (see [`PRE_WRITE_BUDGET`]).
    pre_written: u64,
    /// Chunks written in the interval before the last pass's.
    written_before: BTreeSet<u32>,
    /// Pre-write passes so far.
    passes: u64,
}

fn tracking_enabled() -> bool {
    std::env::var("FERRY_DIRTY").map_or(true, |v| v != "off")
}

fn verifying() -> bool {
    std::env::var_os("FERRY_VERIFY_DIRTY").is_some()
}

impl Tracked {
    /// Tracks `len` bytes at `start`, which hold `chunks` except for the chunks `pending`.
    ///
    /// # Safety
    /// As for [`Tracker::new`].
    unsafe fn new(
        start: *const u8,
        len: usize,
        chunks: BTreeMap<u32, Kappa>,
        pending: BTreeSet<u32>,
    ) -> std::io::Result<Self> {
        // SAFETY: the caller's.
        let tracker = unsafe { Tracker::new(start, len) }.inspect_err(|e| {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(
                || info!(error = %e, "write tracking unavailable; snapshots hash all memory"),
            );
        })?;
        Ok(Self {
            tracker,
            chunks,
            pending,
            pre_written: 0,
            written_before: BTreeSet::new(),
            passes: 0,
        })
    }

    fn len(&self) -> usize {
        self.tracker.len()
    }

    /// Follows the memory to `len` bytes: the part it grew by is tracked from now on and
    /// pending (its content before now is unknown). Returns that part's chunks.
    ///
    /// # Safety
    /// The memory at the tracker's start must now be at least `len` bytes, mapped for as long
    /// as the tracker lives.
    unsafe fn grow(&mut self, len: usize) -> std::io::Result<std::ops::Range<u32>> {
        let old = self.len();
        let new = (old / SIZE) as u32..len.div_ceil(SIZE) as u32;
        if len > old {
            // SAFETY: the caller's.
            unsafe { self.tracker.grow(len)? };
            self.pending.extend(new.clone());
        }
        Ok(new)
    }

    /// Adds the chunks under pages written since the last look to `pending`, and returns
    /// them. `protect`: their pages are write-protected again, so that what is written next
    /// is seen; else they stay unprotected, and reported, until [`Tracker::protect`].
    fn collect(&mut self, protect: bool) -> std::io::Result<BTreeSet<u32>> {
        let pages = match protect {
            true => self.tracker.take_written()?,
            false => self.tracker.peek_written()?,
        };
        let mut written = BTreeSet::new();
        mark(&mut written, &pages);
        self.pending.extend(&written);
        Ok(written)
    }

    fn image(&self) -> MemoryImage {
        image_of(self.len(), &self.chunks)
    }
}

/// Adds the chunks under the byte ranges `written` to `pending`.
fn mark(pending: &mut BTreeSet<u32>, written: &[(usize, usize)]) {
    for &(off, len) in written {
        if len > 0 {
            pending.extend((off / SIZE) as u32..=((off + len - 1) / SIZE) as u32);
        }
    }
}

fn image_of(len: usize, chunks: &BTreeMap<u32, Kappa>) -> MemoryImage {
    let (kind, v) = ferry_object::header::<MemoryImage>();
    MemoryImage {
        kind,
        v,
        len: len as u64,
        chunk_size: CHUNK_SIZE,
        chunks: chunks.iter().map(|(c, k)| (*c, *k)).collect(),
    }
}

/// Hashes and stores the `pending` chunks of `data` (which the guest is not writing),
/// recording their κ in `chunks` (a zero chunk has none). On failure nothing is recorded and
/// they stay pending.
fn settle(
    store: &dyn Store,
    data: &[u8],
    chunks: &mut BTreeMap<u32, Kappa>,
    pending: &mut BTreeSet<u32>,
) -> Result<(), StoreError> {
    let (indices, new): (Vec<u32>, Vec<&[u8]>) = pending
        .iter()
        .map(|&c| (c, &data[c as usize * SIZE..][..SIZE]))
        .filter(|(_, c)| !is_zero(c))
        .unzip();
    let kappas = store.put_many(&new)?;
    for c in std::mem::take(pending) {
        chunks.remove(&c);
    }
    chunks.extend(indices.into_iter().zip(kappas));
    Ok(())
}

impl Incremental {
    /// After a restore: memory `i` holds exactly `images[i]`; track writes from here.
    pub(crate) fn seed(&mut self, inst: &mut dyn Instance, images: &[MemoryImage]) {
        self.memories = images
            .iter()
            .enumerate()
            .map(|(i, img)| {
                let slot = Slot::default();
                *slot.lock() = Self::track(inst, i, img);
                slot
            })
            .collect();
    }

    /// Memory 0's tracking, for a pre-writer.
    pub(crate) fn first(&mut self) -> Slot {
        self.slot(0)
    }

    fn slot(&mut self, i: usize) -> Slot {
        if self.memories.len() <= i {
            self.memories.resize_with(i + 1, Slot::default);
        }
        self.memories[i].clone()
    }

    fn track(inst: &mut dyn Instance, i: usize, image: &MemoryImage) -> Option<Tracked> {
        if !tracking_enabled() {
            return None;
        }
        let m = inst.memory(&abi::memory_export(i as u32))?;
        if m.len() as u64 != image.len {
            return None;
        }
        // SAFETY: a guest memory stays mapped while its instance lives and never shrinks;
        // it does not move either when it has a reservation of its own (wasmtime's 32-bit
        // memories, the interpreter's memory 0). One that may move (the interpreter's other
        // memories, heap buffers) is only tracked if it happens to start on a page, and a
        // snapshot checks its address before using the tracker again, starting over if it
        // moved (write protection left on freed heap pages is asynchronous: harmless).
        unsafe {
            Tracked::new(
                m.as_ptr(),
                m.len(),
                image.chunks.iter().copied().collect(),
                BTreeSet::new(),
            )
        }
        .ok()
    }

    /// Stores memory `i` (the guest is not running) as an image and returns its κ: only the
    /// changed chunks when tracking allows, else all of them.
    pub(crate) fn write(
        &mut self,
        inst: &mut dyn Instance,
        i: usize,
        store: &dyn Store,
    ) -> Result<Kappa, StoreError> {
        let slot = self.slot(i);
        let mut tracked = slot.take_over();
        let name = abi::memory_export(i as u32);
        let data = inst.memory(&name).expect("checked by the caller");
        let mut kept = None;
        if let Some(mut t) = tracked.take()
            && t.tracker.start() == data.as_ptr() as usize
            && t.len() <= data.len()
            // SAFETY: the same memory (same address), `data.len()` bytes now.
            && unsafe { t.grow(data.len()) }.is_ok()
            && t.collect(true).is_ok()
        {
            settle(store, data, &mut t.chunks, &mut t.pending)?;
            t.pre_written = 0;
            let image = t.image();
            if verifying() {
                verify_image(data, &image)?;
            }
            kept = Some((t, image));
        }
        let (k, t) = match kept {
            // The same tracker goes on: `collect` re-armed it.
            Some((t, image)) => (store.put(&ferry_object::encode(&image))?, Some(t)),
            None => {
                let image = memory_image(store, data)?;
                let k = store.put(&ferry_object::encode(&image))?;
                (k, Self::track(inst, i, &image))
            }
        };
        *tracked = t;
        Ok(k)
    }
}

/// `FERRY_VERIFY_DIRTY`: the incremental image must be the full one.
fn verify_image(data: &[u8], img: &MemoryImage) -> Result<(), StoreError> {
    let full: Vec<(u32, Kappa)> = data
        .chunks(SIZE)
        .enumerate()
        .filter(|(_, c)| !is_zero(c))
        .map(|(i, c)| (i as u32, Kappa::of(c)))
        .collect();
    if full != img.chunks {
        let bad = full
            .iter()
            .zip(&img.chunks)
            .find(|(a, b)| a != b)
            .map_or(0, |(a, _)| a.0);
        return Err(StoreError::Remote(format!(
            "write tracking missed a change (near chunk {bad}): the incremental image differs \
             from the memory"
        )));
    }
    Ok(())
}

/// What wakes a pre-writer: its interval, a checkpoint to prepare, the end of its run.
#[derive(Debug, Default)]
pub struct Waker {
    state: Mutex<Wakes>,
    cv: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct Wakes {
    stopped: bool,
    checkpoint: bool,
}

/// Ends pre-writing when dropped (the run's loop is over, however it ended): checkpoints are
/// no longer handed to the pre-writer, and it stops at its next batch.
pub(crate) struct EndsPreWriting<'a> {
    pub(crate) control: &'a Control,
    pub(crate) waker: &'a Waker,
}

impl Drop for EndsPreWriting<'_> {
    fn drop(&mut self) {
        self.control.attach_pre_writer(None);
        self.waker.stop();
    }
}

/// Why a pre-writer woke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    Stop,
    /// Its interval passed.
    Tick,
    /// A checkpoint is due: one pass, then the checkpoint is requested.
    Checkpoint,
}

impl Waker {
    fn wakes(&self) -> MutexGuard<'_, Wakes> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn stop(&self) {
        self.wakes().stopped = true;
        self.cv.notify_all();
    }

    /// Asks for one pass and then a checkpoint.
    pub(crate) fn checkpoint(&self) {
        self.wakes().checkpoint = true;
        self.cv.notify_all();
    }

    fn stopped(&self) -> bool {
        self.wakes().stopped
    }

    /// Waits until `every` has passed (never, if `None`), a checkpoint is asked for, or the
    /// run ends.
    fn wait(&self, every: Option<Duration>) -> Wake {
        let g = self.wakes();
        let waiting = |w: &mut Wakes| !w.stopped && !w.checkpoint;
        let mut g = match every {
            Some(d) => {
                self.cv
                    .wait_timeout_while(g, d, waiting)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
            None => self
                .cv
                .wait_while(g, waiting)
                .unwrap_or_else(|p| p.into_inner()),
        };
        if g.stopped {
            Wake::Stop
        } else if std::mem::take(&mut g.checkpoint) {
            Wake::Checkpoint
        } else {
            Wake::Tick
        }
    }
}

/// The carried (not host-bound) mounts of `wasi`: host directory and the paths left out.
pub(crate) fn carried_mounts(wasi: &ferry_wasi::WasiCtx) -> Vec<(PathBuf, Vec<PathBuf>)> {
    wasi.mounts()
        .into_iter()
        .zip(wasi.not_carried())
        .filter(|(m, _)| !m.host_bound)
        .map(|(m, skip)| (m.host_dir, skip))
        .collect()
}

/// The mounts whose settled files a run pre-stores ([`pre_store`]), and where what it finds
/// goes: each snapshot takes it.
pub(crate) struct PreStore<'a> {
    pub(crate) mounts: &'a [(PathBuf, Vec<PathBuf>)],
    pub(crate) found: &'a Mutex<ImportCache>,
}

/// Time between two looks at the mounts (each lists every file).
const PRE_STORE_EVERY: Duration = Duration::from_secs(10);

/// Stores the settled files of the mounts ([`ImportCache::pre_store`]) while the guest runs,
/// at once and then every [`PRE_STORE_EVERY`], until `waker` stops: a run that pre-writes
/// its memory (`--pre-write`, the pass before checkpoints) spares its snapshots reading a
/// data set with the guest stopped. A thread of its own, so a long first look never holds
/// up a checkpoint; it gives way to a suspend (between files, and every 16 MiB of one), not
/// to a checkpoint: one that comes while a big file is still being stored reads it itself,
/// the next ones do not.
pub(crate) fn pre_store(store: &dyn Store, control: &Control, waker: &Waker, files: PreStore<'_>) {
    let mut own = ImportCache::default();
    while !waker.stopped() {
        files.pass(&mut own, store, control, waker);
        let t = Instant::now();
        while t.elapsed() < PRE_STORE_EVERY && !waker.stopped() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl PreStore<'_> {
    /// One look at the mounts; `own` is what this run knows it stored.
    fn pass(&self, own: &mut ImportCache, store: &dyn Store, control: &Control, waker: &Waker) {
        let t = Instant::now();
        let stop = || waker.stopped() || control.suspending();
        let mut files = 0;
        for (dir, skip) in self.mounts {
            match own.pre_store(store, dir, skip, &stop) {
                Ok(fresh) => {
                    files += fresh.len();
                    self.found
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .update_from(&fresh);
                }
                // The snapshot reads what was not stored here, and says what fails.
                Err(e) => tracing::debug!("pre-storing {}: {e}", dir.display()),
            }
        }
        if files > 0 {
            let synced = store.sync();
            info!(
                files,
                ms = t.elapsed().as_millis() as u64,
                "mounted files pre-stored"
            );
            if let Err(e) = synced {
                tracing::warn!("pre-store: {e}");
            }
        }
    }
}

/// The pre-writer: a pass over memory 0 (see the module documentation) every `every` (if
/// any) and before each checkpoint asked for through [`Control::request_checkpoint`], until
/// its run ends. Registered with `control` while it runs.
pub(crate) fn pre_write(
    slot: Slot,
    store: &dyn Store,
    control: &Control,
    every: Option<Duration>,
    waker: &Arc<Waker>,
) {
    control.attach_pre_writer(Some(waker.clone()));
    let mut copies = Vec::new();
    let mut said_over = false;
    loop {
        let wake = waker.wait(every);
        let checkpoint = || {
            if wake == Wake::Checkpoint {
                control.request(crate::Request::Checkpoint);
            }
        };
        // Nothing is written from a guest whose snapshot is still being checked.
        if wake == Wake::Stop || control.wait_checked().is_err() {
            break;
        }
        let Some((start, len)) = control.look_at_memory() else {
            checkpoint();
            continue;
        };
        let t = Instant::now();
        // Before a checkpoint every changed chunk is copied: the checkpoint would store the
        // same chunks with the guest stopped.
        let passed = pass(
            &slot,
            store,
            start,
            len,
            &mut copies,
            waker,
            wake == Wake::Tick,
        );
        match passed {
            Ok(p) if p.over_budget => {
                if !std::mem::replace(&mut said_over, true) {
                    info!(
                        budget = PRE_WRITE_BUDGET,
                        "pre-writing waits for the next snapshot: it stored {PRE_WRITE_BUDGET}x \
                         the memory since the last"
                    );
                }
            }
            Ok(p) => {
                said_over = false;
                // The snapshot fsyncs what it names; syncing here leaves it less to do.
                let synced = store.sync();
                info!(
                    chunks = p.hashed,
                    stored = p.stored,
                    hot = p.hot,
                    left = p.left,
                    ms = t.elapsed().as_millis() as u64,
                    before_checkpoint = wake == Wake::Checkpoint,
                    "memory pre-written"
                );
                if let Err(e) = synced {
                    tracing::warn!("pre-write: {e}");
                }
            }
            Err(e) => {
                // Snapshots go on as without pre-writing (a full disk fails them itself).
                tracing::warn!("pre-writing stopped: {e}");
                control.attach_pre_writer(None);
                checkpoint();
                return;
            }
        }
        checkpoint();
    }
    control.attach_pre_writer(None);
}

/// What a pass did.
#[derive(Debug, Default)]
struct Passed {
    /// Chunks copied and hashed.
    hashed: usize,
    /// Bytes handed to the store (non-zero chunks).
    stored: u64,
    /// Chunks left pending (a snapshot wanted the memory).
    left: usize,
    /// Chunks left for later: written in each of the last two intervals.
    hot: usize,
    /// Nothing done: passes stored their budget since the last snapshot.
    over_budget: bool,
}

/// One block-aligned block: copies are written with direct I/O.
#[repr(C, align(4096))]
#[derive(Clone, Copy)]
struct Block([u8; 4096]);

/// One pass over the guest memory at `start`, at least `len` bytes long now: the chunks
/// written since the last pass or snapshot are copied, stored and recorded, [`PASS_BATCH`]
/// at a time, until none is left, a snapshot wants the memory or the run ends. `skip_hot`:
/// chunks that look still in use wait (see below).
fn pass(
    slot: &Slot,
    store: &dyn Store,
    start: usize,
    len: usize,
    copies: &mut Vec<Block>,
    stop: &Waker,
    skip_hot: bool,
) -> Result<Passed, String> {
    let mut tracked = slot.lock();
    // Chunks new to the tracking (all of a fresh run's memory, the part a memory grew by).
    let mut fresh = 0..0;
    let t = match tracked.as_mut() {
        Some(t) if t.tracker.start() != start => {
            return Err("the memory is not the one tracked".into());
        }
        Some(t) => t,
        None if !tracking_enabled() => return Err("write tracking is off".into()),
        None => {
            // A fresh run: every chunk is to be copied, and tracked before it is.
            // SAFETY: the guest's memory, `len` bytes when its host last saw it; it stays
            // mapped while the instance lives, which outlives this thread (`Runtime::run`).
            let t = unsafe {
                Tracked::new(
                    start as *const u8,
                    len,
                    BTreeMap::new(),
                    (0..(len / SIZE) as u32).collect(),
                )
            }
            .map_err(|e| format!("cannot track the memory: {e}"))?;
            fresh = 0..(len / SIZE) as u32;
            tracked.insert(t)
        }
    };
    let mut passed = Passed::default();
    if t.pre_written >= PRE_WRITE_BUDGET * t.len() as u64 {
        passed.over_budget = true;
        return Ok(passed);
    }
    // SAFETY: as above; the memory never shrinks, so `len` bytes are still there.
    let grown =
        unsafe { t.grow(len) }.map_err(|e| format!("cannot track the grown memory: {e}"))?;
    if fresh.is_empty() {
        fresh = grown;
    }
    // Chunks written in each of the last two intervals are left for later: a chunk the guest
    // keeps writing would be stored again and again, each copy soon of no use. Their pages
    // are not protected again either (a write to a protected page costs the guest a fault;
    // a guest rewriting all its memory would pay one per page per pass), except at every
    // `FULL_EVERY`th pass, which sees whether they are still written.
    t.passes += 1;
    let full = t.passes % FULL_EVERY == 1;
    let written = t
        .collect(full)
        .map_err(|e| format!("cannot read the written pages: {e}"))?;
    // Memory new to the tracking is most likely being filled: it counts as written in both.
    let mut hot: BTreeSet<u32> = written.intersection(&t.written_before).copied().collect();
    hot.extend(fresh.clone());
    t.written_before = written;
    t.written_before.extend(fresh);
    if !skip_hot {
        hot.clear();
    }
    let todo: Vec<u32> = t.pending.difference(&hot).copied().collect();
    passed.hot = t.pending.len() - todo.len();
    let blocks = SIZE / std::mem::size_of::<Block>();
    copies.resize(PASS_BATCH * blocks, Block([0; 4096]));
    for (b, batch) in todo.chunks(PASS_BATCH).enumerate() {
        if slot.wanted() || stop.stopped() {
            passed.left = todo.len() - b * PASS_BATCH;
            break;
        }
        // Protected before they are copied: a write from now on is seen by the next look.
        for run in batch.chunk_by(|a, b| a + 1 == *b) {
            t.tracker
                .protect(run[0] as usize * SIZE, run.len() * SIZE)
                .map_err(|e| format!("cannot protect the pages to copy: {e}"))?;
        }
        // Hashed here, as each is copied: the guest keeps the other core.
        let mut nonzero = Vec::new();
        for (&c, copy) in batch.iter().zip(copies.chunks_exact_mut(blocks)) {
            // SAFETY: `Block` is plain bytes without padding.
            let copy: &mut [u8] =
                unsafe { std::slice::from_raw_parts_mut(copy.as_mut_ptr().cast::<u8>(), SIZE) };
            // SAFETY: chunk `c` lies within the first `t.len()` bytes at `start`, mapped (see
            // above); the guest may be writing it meanwhile.
            unsafe { copy_racing((start + c as usize * SIZE) as *const u8, copy) };
            if is_zero(copy) {
                t.chunks.remove(&c);
                t.pending.remove(&c);
            } else {
                nonzero.push((c, ferry_store::Hashed::one(copy)));
            }
        }
        let hashed: Vec<_> = nonzero.iter().map(|(_, h)| *h).collect();
        store.put_hashed(&hashed).map_err(|e| e.to_string())?;
        for (c, h) in &nonzero {
            t.chunks.insert(*c, h.kappa());
            t.pending.remove(c);
        }
        let stored = (hashed.len() * SIZE) as u64;
        passed.hashed += batch.len();
        passed.stored += stored;
        t.pre_written += stored;
    }
    Ok(passed)
}

/// Copies `dst.len()` bytes (a multiple of 8) from `src`, which the guest may be writing
/// meanwhile: each 8-byte word is read once, atomically, so the copy holds for each word
/// either its value before or after a write, never a torn read the copy could not hash.
///
/// # Safety
/// `src` must be 8-byte aligned, and `dst.len()` bytes from it mapped and readable.
unsafe fn copy_racing(src: *const u8, dst: &mut [u8]) {
    for (i, d) in dst.chunks_exact_mut(8).enumerate() {
        // SAFETY: within the caller's range, aligned; read atomically because the guest's
        // thread may write the word at the same time.
        let w = unsafe { AtomicU64::from_ptr(src.add(i * 8).cast::<u64>().cast_mut()) }
            .load(Ordering::Relaxed);
        d.copy_from_slice(&w.to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_incremental_image_equals_the_full_one_and_a_missed_write_is_caught() {
        let store = ferry_store::MemStore::new();
        let mut data = vec![0u8; 8 * SIZE];
        data[SIZE + 5] = 1;
        data[3 * SIZE] = 2;
        let prev = memory_image(&store, &data).expect("full image");
        // Chunk 3 becomes zero, chunk 5 gets data, chunk 1 changes; 6 is written but unchanged.
        data[3 * SIZE] = 0;
        data[5 * SIZE + 9] = 3;
        data[SIZE + 5] = 4;
        let written = [
            (SIZE, 4096),
            (3 * SIZE, 4096),
            (5 * SIZE, 8192),
            (6 * SIZE, 4096),
        ];
        let incremental = |written: &[(usize, usize)]| {
            let mut chunks = prev.chunks.iter().copied().collect();
            let mut pending = BTreeSet::new();
            mark(&mut pending, written);
            settle(&store, &data, &mut chunks, &mut pending).expect("incremental");
            assert!(pending.is_empty());
            image_of(data.len(), &chunks)
        };
        let incr = incremental(&written);
        assert_eq!(incr, memory_image(&store, &data).expect("full"));
        verify_image(&data, &incr).expect("verified");
        // Tracking that missed the write to chunk 5 yields an image the check refuses.
        assert!(verify_image(&data, &incremental(&written[..2])).is_err());
    }

    #[test]
    fn a_racing_copy_copies() {
        let src: Vec<u64> = (0..1024u64).map(|i| i * 0x0101_0101).collect();
        let mut dst = vec![0u8; 8192];
        // SAFETY: `src` is 8192 readable, aligned bytes.
        unsafe { copy_racing(src.as_ptr().cast(), &mut dst) };
        let back: Vec<u64> = dst
            .chunks_exact(8)
            .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
            .collect();
        assert_eq!(back, src);
    }
}
