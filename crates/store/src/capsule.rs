//! Capsules: a snapshot and every object it needs, in one file, for moving it offline
//! (`ferry export` / `ferry import`). Format (version 1, all integers little-endian):
//!
//! ```text
//! "FERRYCAP"  u32 version = 1  [32] root κ  u64 object count
//! count × ( [32] κ  u8 codec (0 = raw, 1 = zstd)  u64 length  u64 stored length  stored bytes )
//! "FERRYEND"  [32] BLAKE3 of every byte before "FERRYEND"
//! ```
//!
//! A capsule is untrusted input: [`import`] bounds every length before allocating, re-hashes
//! every object against its κ before storing it, refuses duplicates and a count that does not
//! match, and checks the trailer's hash of the whole stream. Objects are stored as they are
//! verified (content addressing makes a half-imported capsule harmless: garbage collection
//! removes what no ref reaches); the caller names the root with a ref only after a complete,
//! verified import.

use std::collections::BTreeSet;
use std::io::{Read, Write};

use ferry_kappa::Kappa;

use crate::fs::Staged;
use crate::{Hashed, Store, StoreError, batch};

const MAGIC: &[u8; 8] = b"FERRYCAP";
const END: &[u8; 8] = b"FERRYEND";
/// Capsule format version this code writes and reads.
pub const CAPSULE_VERSION: u32 = 1;
/// Largest single object a capsule may carry (a big instrumented module is ~100 MB).
pub const MAX_OBJECT: u64 = 1 << 30;
/// Most objects a capsule may carry (4 GiB of memory is 65,536 chunks; a mounted tree adds
/// its files).
pub const MAX_OBJECTS: u64 = 1 << 24;

const CODEC_RAW: u8 = 0;
const CODEC_ZSTD: u8 = 1;

/// Why a capsule could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CapsuleError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("capsule I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a ferry capsule (bad magic)")]
    NotACapsule,
    #[error("capsule format version {0}; this ferry reads version {CAPSULE_VERSION}")]
    Version(u32),
    #[error("capsule is corrupt: {0}")]
    Corrupt(String),
}

/// What an export or import moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CapsuleStats {
    pub objects: u64,
    /// Sum of the objects' sizes.
    pub bytes: u64,
    /// Bytes written to or read from the capsule.
    pub stored_bytes: u64,
    /// On import: objects the store did not have yet.
    pub new_objects: u64,
}

impl std::ops::AddAssign for CapsuleStats {
    /// The counts of two capsules moved together (the layers of an OCI artifact).
    fn add_assign(&mut self, o: Self) {
        self.objects += o.objects;
        self.bytes += o.bytes;
        self.stored_bytes += o.stored_bytes;
        self.new_objects += o.new_objects;
    }
}

/// Counts and hashes what passes through.
struct Hashing<W> {
    inner: W,
    hasher: blake3::Hasher,
    count: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

/// Writes a capsule of `root` and `objects` (which should include `root`, each once) read
/// from `store`, in the order given: an importer stores memory chunks in that order, so
/// chunks listed in memory order land in memory order (a resume maps runs of them at once).
/// Objects are read (straight from the store's packs, in runs), checked against their κ and
/// encoded a batch at a time on a thread of their own while this one writes the batch before.
/// `progress` is called after each batch with the bytes written so far.
pub fn export(
    store: &dyn Store,
    root: Kappa,
    objects: &[Kappa],
    out: impl Write,
    progress: &mut dyn FnMut(u64),
) -> Result<CapsuleStats, CapsuleError> {
    let mut w = Hashing {
        inner: out,
        hasher: blake3::Hasher::new(),
        count: 0,
    };
    w.write_all(MAGIC)?;
    w.write_all(&CAPSULE_VERSION.to_le_bytes())?;
    w.write_all(root.as_bytes())?;
    w.write_all(&(objects.len() as u64).to_le_bytes())?;
    let mut stats = CapsuleStats::default();
    let groups = batch::groups(store, objects, 0);
    std::thread::scope(|s| -> Result<(), CapsuleError> {
        // Worker `i` encodes groups i, i + READERS, …, at most one ahead of the writer, so
        // the disk reads one group while the others are checked and written.
        let mut ready = Vec::new();
        for first in 0..READERS {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            ready.push(rx);
            let groups = &groups;
            s.spawn(move || {
                let mut encoder = batch::Encoder::verifying();
                for group in groups.iter().skip(first).step_by(READERS) {
                    let mut b = batch::buffer();
                    let encoded = encoder
                        .push_many_stored(&mut b, group, store)
                        .map(|bytes| (b, group.len(), bytes));
                    let failed = encoded.is_err();
                    if tx.send(encoded).is_err() || failed {
                        break;
                    }
                }
            });
        }
        // In order; on an error the receivers are dropped, which stops the workers.
        for i in 0..groups.len() {
            let encoded = ready[i % READERS]
                .recv()
                .expect("a worker sends every group it takes or an error");
            let (b, n, bytes) = encoded?;
            w.write_all(&b)?;
            batch::give_back(b);
            stats.objects += n as u64;
            stats.bytes += bytes;
            progress(w.count);
        }
        Ok(())
    })?;
    let digest = w.hasher.finalize();
    w.write_all(END)?;
    w.inner.write_all(digest.as_bytes())?;
    w.flush()?;
    stats.stored_bytes = w.count + 32;
    Ok(stats)
}

/// Threads reading, checking and encoding the objects of an export.
const READERS: usize = 2;

fn read_array<const N: usize>(r: &mut impl Read) -> Result<[u8; N], CapsuleError> {
    let mut b = [0u8; N];
    r.read_exact(&mut b).map_err(truncated)?;
    Ok(b)
}

fn read_u64(r: &mut impl Read) -> Result<u64, CapsuleError> {
    Ok(u64::from_le_bytes(read_array(r)?))
}

/// Memory chunks (objects of 64 KiB) are stored this many bytes at a time, together, as a
/// snapshot stores them: an on-disk store packs them (with direct I/O, block-aligned, so a
/// resume maps them) instead of creating a file for each.
const BATCH_BYTES: usize = 32 << 20;
const CHUNK: usize = 65536;

/// Memory chunks read from a capsule, not yet checked: staged block-aligned (so that the store
/// writes them with direct I/O as they are), checked together on up to four threads, then the
/// new ones stored together.
#[derive(Default)]
struct Chunks {
    staged: Staged,
    claimed: Vec<Kappa>,
    new: Vec<bool>,
}

impl Chunks {
    /// Adds chunk `k` (`new` if the store lacks it) once `stage` has staged its bytes; true
    /// when the batch is full.
    fn push(
        &mut self,
        k: Kappa,
        new: bool,
        stage: impl FnOnce(&mut Staged) -> std::io::Result<()>,
    ) -> Result<bool, CapsuleError> {
        stage(&mut self.staged).map_err(truncated)?;
        self.claimed.push(k);
        self.new.push(new);
        Ok(self.staged.bytes() >= BATCH_BYTES)
    }

    fn put(&mut self, store: &dyn Store) -> Result<(), CapsuleError> {
        let slices = self.staged.slices();
        let claimed: Vec<(Kappa, &[u8])> = self.claimed.iter().copied().zip(slices).collect();
        let checked = Hashed::check_all(&claimed, "the capsule").map_err(mismatch)?;
        let new: Vec<Hashed<'_>> = checked
            .into_iter()
            .zip(&self.new)
            .filter_map(|(h, &new)| new.then_some(h))
            .collect();
        if !new.is_empty() {
            store.put_hashed(&new)?;
        }
        self.staged.clear();
        self.claimed.clear();
        self.new.clear();
        Ok(())
    }
}

/// Checks and stores full batches of chunks on a thread of its own while the next batch is
/// read: the disk writes one while the capsule is read and hashed. Two batches' memory is
/// used in turn. The thread starts with the first full batch (a capsule smaller than a
/// batch starts none).
struct Storer<'s, 'e> {
    scope: &'s std::thread::Scope<'s, 'e>,
    store: &'s dyn Store,
    thread: Option<StorerThread>,
    in_flight: bool,
}

/// The storing thread's two channels: full batches to it, stored (emptied) ones back.
struct StorerThread {
    full: std::sync::mpsc::SyncSender<Chunks>,
    done: std::sync::mpsc::Receiver<Result<Chunks, CapsuleError>>,
}

impl<'s, 'e> Storer<'s, 'e> {
    fn new(scope: &'s std::thread::Scope<'s, 'e>, store: &'s dyn Store) -> Self {
        Self {
            scope,
            store,
            thread: None,
            in_flight: false,
        }
    }

    /// The batch the thread stored last, once it is stored (its error if it was not).
    fn wait(&mut self) -> Result<Option<Chunks>, CapsuleError> {
        if !std::mem::take(&mut self.in_flight) {
            return Ok(None);
        }
        let thread = self
            .thread
            .as_ref()
            .expect("a batch in flight has a thread");
        let done = thread
            .done
            .recv()
            .expect("the storing thread answers every batch");
        done.map(Some)
    }

    /// Hands `chunks` to the thread, leaving an empty batch in its place.
    fn hand_over(&mut self, chunks: &mut Chunks) -> Result<(), CapsuleError> {
        let empty = self.wait()?.unwrap_or_default();
        let full = std::mem::replace(chunks, empty);
        let store = self.store;
        let thread = self.thread.get_or_insert_with(|| {
            let (full, to_store) = std::sync::mpsc::sync_channel::<Chunks>(1);
            let (stored, done) = std::sync::mpsc::channel();
            self.scope.spawn(move || {
                for mut chunks in to_store {
                    let r = chunks.put(store).map(|()| chunks);
                    let failed = r.is_err();
                    if stored.send(r).is_err() || failed {
                        break;
                    }
                }
            });
            StorerThread { full, done }
        });
        thread
            .full
            .send(full)
            .expect("the storing thread takes batches until one fails");
        self.in_flight = true;
        Ok(())
    }

    /// Waits for the batch in flight.
    fn finish(mut self) -> Result<(), CapsuleError> {
        self.wait().map(drop)
    }
}

/// An object whose bytes do not hash to its κ, as a capsule error.
fn mismatch(e: StoreError) -> CapsuleError {
    match e {
        StoreError::Corrupt { kappa, actual, .. } => {
            CapsuleError::Corrupt(format!("object {kappa} hashes to {actual}"))
        }
        e => e.into(),
    }
}

/// A read that ran out of capsule, as a capsule error.
fn truncated(e: std::io::Error) -> CapsuleError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => CapsuleError::Corrupt("truncated".into()),
        _ => CapsuleError::Io(e),
    }
}

/// Reads a capsule into `store`, verifying every object. Returns the root κ. `progress` is
/// called after each object with the bytes read so far.
pub fn import(
    input: impl Read,
    store: &dyn Store,
    progress: &mut dyn FnMut(u64),
) -> Result<(Kappa, CapsuleStats), CapsuleError> {
    let mut r = Hashing {
        inner: input,
        hasher: blake3::Hasher::new(),
        count: 0,
    };
    if &read_array::<8>(&mut r).map_err(|_| CapsuleError::NotACapsule)? != MAGIC {
        return Err(CapsuleError::NotACapsule);
    }
    let version = u32::from_le_bytes(read_array(&mut r)?);
    if version != CAPSULE_VERSION {
        return Err(CapsuleError::Version(version));
    }
    let root = Kappa::from_bytes(read_array(&mut r)?);
    let count = read_u64(&mut r)?;
    if count > MAX_OBJECTS {
        return Err(CapsuleError::Corrupt(format!(
            "{count} objects (at most {MAX_OBJECTS})"
        )));
    }
    let mut seen = BTreeSet::new();
    let mut stats = CapsuleStats::default();
    // Its memory is reused batch after batch.
    let mut chunks = Chunks::default();
    let mut body = Vec::new();
    std::thread::scope(|s| -> Result<(), CapsuleError> {
        let mut storer = Storer::new(s, store);
        for _ in 0..count {
            let k = Kappa::from_bytes(read_array(&mut r)?);
            let [codec] = read_array::<1>(&mut r)?;
            let len = read_u64(&mut r)?;
            let stored = read_u64(&mut r)?;
            if len > MAX_OBJECT || stored > MAX_OBJECT {
                return Err(CapsuleError::Corrupt(format!(
                    "object {k} claims {len} bytes (at most {MAX_OBJECT})"
                )));
            }
            if !seen.insert(k) {
                return Err(CapsuleError::Corrupt(format!("object {k} appears twice")));
            }
            let new = !store.has(&k)?;
            stats.objects += 1;
            stats.bytes += len;
            stats.new_objects += u64::from(new);
            if codec == CODEC_RAW && stored == len && len == CHUNK as u64 {
                // A raw memory chunk (the bulk of a capsule) is read straight into the staging.
                if chunks.push(k, new, |s| s.push_from(&mut r, CHUNK))? {
                    storer.hand_over(&mut chunks)?;
                }
                progress(r.count);
                continue;
            }
            body.clear();
            (&mut r).take(stored).read_to_end(&mut body)?;
            if body.len() as u64 != stored {
                return Err(CapsuleError::Corrupt("truncated".into()));
            }
            let decompressed;
            let bytes = match codec {
                CODEC_RAW if stored == len => &body[..],
                CODEC_ZSTD => {
                    decompressed = zstd::bulk::decompress(&body, len as usize)
                        .map_err(|e| CapsuleError::Corrupt(format!("object {k}: {e}")))?;
                    &decompressed[..]
                }
                _ => {
                    return Err(CapsuleError::Corrupt(format!(
                        "object {k}: codec {codec}, {stored} of {len} bytes"
                    )));
                }
            };
            if bytes.len() as u64 != len {
                return Err(CapsuleError::Corrupt(format!(
                    "object {k} is {} bytes, not {len}",
                    bytes.len()
                )));
            }
            if bytes.len() == CHUNK {
                // Checked with the other chunks of its batch.
                let staged = |s: &mut Staged| {
                    s.push(bytes);
                    Ok(())
                };
                if chunks.push(k, new, staged)? {
                    storer.hand_over(&mut chunks)?;
                }
            } else {
                StoreError::check_hash(&k, bytes, || "the capsule".into()).map_err(mismatch)?;
                if new {
                    // Kept loose, as a snapshot keeps them (a pack of one is no use).
                    store.put(bytes)?;
                }
            }
            progress(r.count);
        }
        storer.finish()
    })?;
    chunks.put(store)?;
    let digest = r.hasher.finalize();
    if &read_array::<8>(&mut r.inner)? != END {
        return Err(CapsuleError::Corrupt(
            "no end marker after the objects".into(),
        ));
    }
    let claimed: [u8; 32] = read_array(&mut r.inner)?;
    if claimed != *digest.as_bytes() {
        return Err(CapsuleError::Corrupt(
            "the capsule's checksum does not match its contents".into(),
        ));
    }
    let mut rest = [0u8; 1];
    if r.inner.read(&mut rest)? != 0 {
        return Err(CapsuleError::Corrupt("bytes after the end marker".into()));
    }
    if !seen.contains(&root) {
        return Err(CapsuleError::Corrupt(format!(
            "the root {root} is not among the objects"
        )));
    }
    store.sync()?;
    stats.stored_bytes = r.count + 40;
    Ok((root, stats))
}

/// Reads `data` as a capsule into a fresh in-memory store (fuzz entry point: must never
/// panic, whatever the bytes).
pub fn fuzz_import(data: &[u8]) {
    let store = crate::MemStore::new();
    let _ = import(data, &store, &mut |_| {});
}
