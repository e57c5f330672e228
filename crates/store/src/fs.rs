//! The embedded on-disk store.
//!
//! Layout under the root: `objects/<first 2 hex>/<other 62 hex>` (one file per object),
//! `packs/<id>.{pack,idx}` (objects written together by `put_many`, see [`crate::pack`]),
//! `refs/<name>` (text: `<epoch> blake3:<hex>`), `tmp/` for writes in progress, `refs.lock`,
//! `gc.lock` (every open store holds a shared `flock` on it; garbage collection needs it
//! exclusively, see [`FsStore::open_exclusive`]), `cache/` (host-local cache files, see
//! [`Store::load_cache`]).
//! Writes go to a temp file in `tmp/` and are renamed into place, so a failed write (a full
//! disk) never leaves a partial object under its κ. Durability is batched: [`Store::sync`]
//! (`syncfs`) runs once per snapshot before its ref is updated; an object torn by a power loss
//! before that would fail verification on read (its bytes no longer hash to κ) and is never
//! used. Refs are written and synced individually. Objects are immutable once written.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_kappa::Kappa;

use crate::pack::{self, Slot};
use crate::{RefValue, Store, StoreError, check_cas, check_ref_name, copy_exact, hash_all};

/// On-disk store rooted at a directory.
#[derive(Debug)]
pub struct FsStore {
    root: PathBuf,
    /// Objects written since the last [`Store::sync`].
    unsynced: std::sync::Mutex<Vec<PathBuf>>,
    /// Fault injection: new objects that may still be written before every write fails
    /// with "no space left on device" (`u64::MAX` = no fault).
    writes_left: AtomicU64,
    /// Whether `sync` makes writes durable (always, except in benchmarks).
    durable: bool,
    /// zstd level for new objects (`None`: stored raw). Never changes a κ.
    zstd: Option<i32>,
    /// Set once the file system refused direct I/O (or by `FERRY_DIRECT_IO=off`): packs are
    /// then written through the page cache.
    no_direct: std::sync::atomic::AtomicBool,
    /// Objects held in packs, and how many live objects each pack still holds.
    packed: std::sync::RwLock<Packed>,
    /// `gc.lock`, held shared (or, for garbage collection, exclusively) while this is open.
    in_use: File,
    /// How far garbage collection has come ([`FsStore::housekeeping`]).
    removed: AtomicU64,
    compact_copied: AtomicU64,
    compact_total: AtomicU64,
}

/// How far this process's garbage collection in a store has come
/// ([`FsStore::housekeeping`]): what a long `store gc` shows while it works.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Housekeeping {
    /// Objects removed.
    pub removed: u64,
    /// Bytes of live objects copied out of half-empty packs by the compaction under way.
    pub compact_copied: u64,
    /// Bytes that compaction copies in all (0 before it has started).
    pub compact_total: u64,
}

#[derive(Debug, Default)]
struct Packed {
    slots: HashMap<Kappa, Slot>,
    live: HashMap<PathBuf, usize>,
    /// Packs kept whose index still names objects no longer read from them (removed, or
    /// held by a newer pack too): [`Store::compact`] rewrites those indexes.
    pruned: BTreeSet<PathBuf>,
    damaged: Vec<String>,
}

impl Packed {
    /// Makes `entries` of `pack` readable. An object another pack holds too (a compaction's
    /// new pack beside the old one it replaces, or both left by one cut short) is read from
    /// `pack` from now on, and counts as live only there.
    fn add(&mut self, pack: &Path, entries: Vec<pack::Entry>) {
        *self.live.entry(pack.to_path_buf()).or_default() += entries.len();
        for (k, offset, stored, len, zstd) in entries {
            let old = self.slots.insert(
                k,
                Slot {
                    pack: pack.to_path_buf(),
                    offset,
                    stored,
                    len,
                    zstd,
                },
            );
            if let Some(old) = old
                && let Some(n) = self.live.get_mut(&old.pack)
            {
                *n = n.saturating_sub(1);
                self.pruned.insert(old.pack);
            }
        }
    }
}

/// Copies `len` bytes of `src` at `from` to `dst` at `to`, inside the kernel where it can.
fn copy_range(
    src: &File,
    mut from: u64,
    dst: &File,
    mut to: u64,
    mut len: u64,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    while len > 0 {
        let (mut off_in, mut off_out) = (from as libc::loff_t, to as libc::loff_t);
        let want = usize::try_from(len.min(1 << 30)).unwrap_or(1 << 30);
        // SAFETY: copy_file_range between descriptors we own, with offsets of our own.
        let n = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                want,
                0,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EXDEV | libc::ENOSYS | libc::EINVAL | libc::EOPNOTSUPP) => break,
                _ => return Err(e),
            }
        }
        if n == 0 {
            return Err(ErrorKind::UnexpectedEof.into());
        }
        let n = n as u64;
        (from, to, len) = (from + n, to + n, len - n);
    }
    // By hand, where the file system has no copy_file_range.
    let mut buf = vec![0; len.min(1 << 20) as usize];
    while len > 0 {
        let n = len.min(buf.len() as u64) as usize;
        src.read_exact_at(&mut buf[..n], from)?;
        dst.write_all_at(&buf[..n], to)?;
        let n = n as u64;
        (from, to, len) = (from + n, to + n, len - n);
    }
    Ok(())
}

/// Live bytes [`FsStore::compact`] gathers into one new pack at most (an object larger than
/// this gets a pack of its own).
const COMPACT_BATCH: u64 = 256 << 20;

/// Largest loose object ferry decompresses (a zstd bomb stops here and fails verification).
const MAX_LOOSE: u64 = 1 << 31;

fn zst_path(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".zst");
    PathBuf::from(s)
}

fn remove_if_present(p: &Path) -> Result<(), StoreError> {
    match fs::remove_file(p) {
        Err(e) if e.kind() != ErrorKind::NotFound => Err(StoreError::io("remove", p)(e)),
        _ => Ok(()),
    }
}

/// Up to this many new objects, `sync` fsyncs each one (and its directory); beyond, one
/// `syncfs` of the whole file system is cheaper.
const FSYNC_EACH_MAX: usize = 64;

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Block size for direct I/O: objects of packs written with it start at multiples of this.
const DIRECT_ALIGN: usize = 4096;
/// Smallest batch written with direct I/O (below, the page cache is as fast).
const DIRECT_MIN: usize = 4 << 20;
/// Objects hashed, then handed to a writer, at a time (64 memory chunks: 4 MiB).
const DIRECT_SEGMENT: usize = 64;
/// Most staging memory a thread keeps between batches (a batch is about 16 MiB).
const STAGED_KEPT: usize = 64 << 20;
/// Threads writing a direct-I/O pack (requests in flight).
const DIRECT_WRITERS: usize = 2;

/// One block-aligned block (the header of a pack written with direct I/O).
#[repr(C, align(4096))]
struct Block([u8; DIRECT_ALIGN]);

/// Copies of blobs (each a whole number of blocks) back to back in block-aligned memory, so
/// that direct I/O can write them. Cleared, it keeps its memory for the next batch.
#[derive(Default)]
pub(crate) struct Staged {
    blocks: Vec<Block>,
    lens: Vec<usize>,
}

impl Staged {
    /// Holds copies of `blobs` (each a whole number of blocks) instead of what it held.
    pub(crate) fn refill(&mut self, blobs: &[&[u8]]) {
        self.clear();
        self.blocks
            .reserve(blobs.iter().map(|b| b.len() / DIRECT_ALIGN).sum());
        for b in blobs {
            self.push(b);
        }
    }

    /// Appends a copy of `blob`, whose length must be a multiple of the block size.
    pub(crate) fn push(&mut self, blob: &[u8]) {
        assert!(blob.len().is_multiple_of(DIRECT_ALIGN), "not whole blocks");
        self.blocks.extend(
            blob.chunks_exact(DIRECT_ALIGN)
                .map(|c| Block(c.try_into().expect("a whole block"))),
        );
        self.lens.push(blob.len());
    }

    /// Appends `len` bytes (a multiple of the block size) read from `r`.
    pub(crate) fn push_from(
        &mut self,
        r: &mut impl std::io::Read,
        len: usize,
    ) -> std::io::Result<()> {
        assert!(len.is_multiple_of(DIRECT_ALIGN), "not whole blocks");
        let start = self.blocks.len();
        self.blocks
            .resize_with(start + len / DIRECT_ALIGN, || Block([0; DIRECT_ALIGN]));
        // SAFETY: `Block` is `repr(C)` bytes without padding, so the blocks from `start` on
        // are `len` initialised bytes, borrowed mutably for the read only.
        let new = unsafe {
            std::slice::from_raw_parts_mut(self.blocks[start..].as_mut_ptr().cast::<u8>(), len)
        };
        match r.read_exact(new) {
            Ok(()) => {
                self.lens.push(len);
                Ok(())
            }
            Err(e) => {
                self.blocks.truncate(start);
                Err(e)
            }
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        self.blocks.len() * DIRECT_ALIGN
    }

    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.lens.clear();
    }

    /// The copies, in the order they were pushed.
    pub(crate) fn slices(&self) -> Vec<&[u8]> {
        let mut out = Vec::with_capacity(self.lens.len());
        let mut at = 0;
        for &len in &self.lens {
            let n = len / DIRECT_ALIGN;
            let blocks = &self.blocks[at..at + n];
            // SAFETY: `Block` is `repr(C)` bytes without padding, so `n` adjacent blocks are
            // `len` initialised bytes, borrowed for as long as `self`.
            out.push(unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), len) });
            at += n;
        }
        out
    }
}

/// Writes `bufs` back to back from offset `at` with one `pwritev` (finishing a short write
/// piece by piece).
fn write_at_vectored(f: &File, bufs: &[&[u8]], at: u64) -> std::io::Result<()> {
    let iov: Vec<libc::iovec> = bufs
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: every iovec points at a live slice of its stated length, which is only read.
    let n = unsafe {
        libc::pwritev(
            f.as_raw_fd(),
            iov.as_ptr(),
            iov.len() as libc::c_int,
            at as libc::off_t,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (mut done, mut buf_at) = (n as u64, at);
    for b in bufs {
        let len = b.len() as u64;
        if done < len {
            std::os::unix::fs::FileExt::write_all_at(f, &b[done as usize..], buf_at + done)?;
        }
        done = done.saturating_sub(len);
        buf_at += len;
    }
    Ok(())
}

/// A cache file name: `[a-z-]+`, so it names a file in `cache/` and nothing else.
fn cache_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
}

/// Opens (creating if needed) a file that is only ever locked, never read.
fn lock_file(p: &Path) -> Result<File, StoreError> {
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(p)
        .map_err(StoreError::io("open", p))
}

/// `root/gc.lock`, locked with `how` (`LOCK_SH` or `LOCK_EX`, with `LOCK_NB` not to wait):
/// `Ok(None)` when it would have to wait for another process's conflicting lock.
fn lock_in_use(root: &Path, how: libc::c_int) -> Result<Option<File>, StoreError> {
    let p = root.join("gc.lock");
    let f = lock_file(&p)?;
    // SAFETY: flock on a file descriptor we own; released when `f` is closed.
    if unsafe { libc::flock(f.as_raw_fd(), how) } == 0 {
        return Ok(Some(f));
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Ok(None);
    }
    Err(StoreError::io("lock", &p)(e))
}

impl FsStore {
    /// Opens (creating if needed) a store at `root`, waiting while a garbage collection runs.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, StoreError> {
        Self::open_waiting(root, &|| {})
    }

    /// [`FsStore::open`], calling `on_wait` first if it must wait for a garbage collection.
    ///
    /// An open store holds a shared lock on `gc.lock` for as long as it lives, so a
    /// collection never deletes an object this process has written and not yet named with a
    /// ref (a snapshot's chunks are written before its ref).
    pub fn open_waiting(root: impl Into<PathBuf>, on_wait: &dyn Fn()) -> Result<Self, StoreError> {
        let root = Self::create(root.into())?;
        let in_use = match lock_in_use(&root, libc::LOCK_SH | libc::LOCK_NB)? {
            Some(f) => f,
            None => {
                on_wait();
                // Without LOCK_NB the lock is taken or fails: never `None`.
                lock_in_use(&root, libc::LOCK_SH)?.ok_or(StoreError::InUse(root.clone()))?
            }
        };
        Self::with_lock(root, in_use)
    }

    /// Opens the store at `root` for garbage collection: only when no other process has it
    /// open ([`StoreError::InUse`] otherwise), and no other process can open it meanwhile
    /// (they wait).
    pub fn open_exclusive(root: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let root = Self::create(root.into())?;
        match lock_in_use(&root, libc::LOCK_EX | libc::LOCK_NB)? {
            Some(f) => Self::with_lock(root, f),
            None => Err(StoreError::InUse(root)),
        }
    }

    /// Runs `f` only while no other process has this store open — the shared lock this store
    /// holds on `gc.lock` is made exclusive for the time, then shared again — so that `f` may
    /// collect garbage: no other process can have written objects it has not named yet.
    /// `Ok(None)`: another process uses the store, and `f` did not run.
    pub fn alone<T>(&self, f: impl FnOnce() -> T) -> Result<Option<T>, StoreError> {
        let fd = self.in_use.as_raw_fd();
        // SAFETY: flock on a descriptor this store owns.
        let out = (unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0).then(f);
        // Shared again. A conversion that failed may have dropped the lock on the way (flock(2)
        // converts by unlocking first): this takes it back, after a `store gc` that slipped
        // in, if one did — this process names everything it wrote before it gets here.
        // SAFETY: as above.
        if unsafe { libc::flock(fd, libc::LOCK_SH) } != 0 {
            return Err(StoreError::io("lock", &self.root.join("gc.lock"))(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(out)
    }

    fn create(root: PathBuf) -> Result<PathBuf, StoreError> {
        for sub in ["objects", "refs", "tmp", "packs"] {
            let p = root.join(sub);
            fs::create_dir_all(&p).map_err(StoreError::io("create store directory", &p))?;
        }
        Ok(root)
    }

    fn with_lock(root: PathBuf, in_use: File) -> Result<Self, StoreError> {
        Ok(Self {
            in_use,
            root,
            unsynced: Default::default(),
            writes_left: AtomicU64::new(u64::MAX),
            packed: Default::default(),
            durable: true,
            zstd: None,
            no_direct: std::env::var_os("FERRY_DIRECT_IO")
                .is_some_and(|v| v == "off")
                .into(),
            removed: AtomicU64::new(0),
            compact_copied: AtomicU64::new(0),
            compact_total: AtomicU64::new(0),
        })
        .and_then(|s| {
            s.load_packs()?;
            Ok(s)
        })
    }

    fn load_packs(&self) -> Result<(), StoreError> {
        let mut packed = self.packed_mut();
        for (idx, pack_path) in pack::list(&self.root.join("packs"))? {
            // A damaged pack must not make the rest of the store unusable: its objects count
            // as missing (a resume needing them is refused) and `verify` reports it.
            let loaded = fs::metadata(&pack_path)
                .map_err(StoreError::io("open", &pack_path))
                .and_then(|meta| {
                    let bytes = fs::read(&idx).map_err(StoreError::io("read", &idx))?;
                    pack::decode_index(&idx, &bytes, meta.len())
                });
            let entries = match loaded {
                Ok(e) => e,
                Err(e) => {
                    packed.damaged.push(e.to_string());
                    continue;
                }
            };
            packed.add(&pack_path, entries);
        }
        Ok(())
    }

    /// Reads κ's bytes from `slot` into `out` (see `pack::read`) and returns the slot they
    /// came from. A pack that [`Store::compact`] replaced between the caller's lookup and
    /// this read is gone; its objects are in the new pack, so κ is looked up again.
    fn read_slot(&self, kappa: &Kappa, slot: Slot, out: &mut [u8]) -> Result<Slot, StoreError> {
        match pack::read(&slot, out) {
            Err(StoreError::Io { source, op, path }) if source.kind() == ErrorKind::NotFound => {
                match self.packed().slots.get(kappa).cloned() {
                    Some(moved) if moved.pack != slot.pack && moved.len == slot.len => {
                        pack::read(&moved, out).map(|()| moved)
                    }
                    _ => Err(StoreError::Io { op, path, source }),
                }
            }
            r => r.map(|()| slot),
        }
    }

    /// A new file in `tmp/` holding `header`, then the stored bytes of `objects` back to
    /// back, copied from their packs inside the kernel (`copy_file_range`: no buffer, no
    /// fresh pages; read and written where the file system cannot), made durable when the
    /// store is. `open` keeps the packs read from open.
    fn copy_into_tmp(
        &self,
        header: &[u8],
        objects: &[(Kappa, Slot)],
        open: &mut HashMap<PathBuf, File>,
    ) -> Result<PathBuf, StoreError> {
        self.new_tmp(self.durable, |out, tmp| {
            std::os::unix::fs::FileExt::write_all_at(out, header, 0)
                .map_err(StoreError::io("write", tmp))?;
            let mut at = header.len() as u64;
            let mut i = 0;
            while i < objects.len() {
                // A run: objects adjacent in one pack, copied at once.
                let first = &objects[i].1;
                let mut len = u64::from(first.stored);
                let mut j = i + 1;
                while j < objects.len()
                    && objects[j].1.pack == first.pack
                    && objects[j].1.offset == first.offset + len
                {
                    len += u64::from(objects[j].1.stored);
                    j += 1;
                }
                let src = match open.entry(first.pack.clone()) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => e.insert(
                        File::open(&first.pack).map_err(StoreError::io("open", &first.pack))?,
                    ),
                };
                copy_range(src, first.offset, out, at, len)
                    .map_err(StoreError::io("copy into", tmp))?;
                at += len;
                i = j;
            }
            Ok(())
        })
    }

    /// Rewrites the index of every kept pack that still names objects no longer read from it,
    /// so that a store opened later does not find removed objects again (the pack itself is
    /// never written again: a resume may have it mapped). Each index is replaced atomically.
    /// Returns the bytes the indexes shrank by.
    fn rewrite_pruned_indexes(&self) -> Result<u64, StoreError> {
        let mut packed = self.packed_mut();
        let pruned = std::mem::take(&mut packed.pruned);
        if pruned.is_empty() {
            return Ok(0);
        }
        let mut entries: HashMap<&Path, Vec<pack::Entry>> = pruned
            .iter()
            .filter(|p| packed.live.contains_key(*p))
            .map(|p| (p.as_path(), Vec::new()))
            .collect();
        for (k, s) in &packed.slots {
            if let Some(e) = entries.get_mut(s.pack.as_path()) {
                e.push((*k, s.offset, s.stored, s.len, s.zstd));
            }
        }
        let mut shrunk = 0;
        for (pack, e) in entries {
            let idx = pack.with_extension("idx");
            let bytes = pack::encode_index(e);
            let was = fs::metadata(&idx).map_or(0, |m| m.len());
            shrunk += was.saturating_sub(bytes.len() as u64);
            self.write_atomic(&idx, &bytes, false)?;
            self.unsynced
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(idx);
        }
        drop(packed);
        self.sync()?;
        Ok(shrunk)
    }

    fn packed(&self) -> std::sync::RwLockReadGuard<'_, Packed> {
        self.packed.read().unwrap_or_else(|p| p.into_inner())
    }

    fn packed_mut(&self) -> std::sync::RwLockWriteGuard<'_, Packed> {
        self.packed.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Fault injection: takes `n` writes from the budget, or fails as a full disk would.
    fn take_writes(&self, n: u64, dest: &Path) -> Result<(), StoreError> {
        let left = self.writes_left.load(Ordering::SeqCst);
        if left == u64::MAX {
            return Ok(());
        }
        if left < n {
            self.writes_left.store(0, Ordering::SeqCst);
            return Err(StoreError::io("write", dest)(
                std::io::Error::from_raw_os_error(libc::ENOSPC),
            ));
        }
        self.writes_left.store(left - n, Ordering::SeqCst);
        Ok(())
    }

    /// [`Self::verify`] over a stream (`zstd`: read errors mean a damaged zstd stream).
    fn verify_stream(
        kappa: &Kappa,
        mut r: impl Read,
        where_: &Path,
        zstd: bool,
    ) -> Result<(), StoreError> {
        let mut hasher = blake3::Hasher::new();
        let mut buf = vec![0; 1 << 20];
        loop {
            let n = match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) if zstd => {
                    return Err(StoreError::Corrupt {
                        kappa: *kappa,
                        actual: Kappa::of(b""),
                        where_: format!("{} (not a valid zstd stream)", where_.display()),
                    });
                }
                Err(e) => return Err(StoreError::io("read", where_)(e)),
            };
            hasher.update(&buf[..n]);
        }
        StoreError::check_actual(
            kappa,
            Kappa::from_bytes(*hasher.finalize().as_bytes()),
            || where_.display().to_string(),
        )
    }

    fn verify(kappa: &Kappa, bytes: &[u8], where_: &Path) -> Result<(), StoreError> {
        StoreError::check_hash(kappa, bytes, || where_.display().to_string())
    }

    /// Compresses new objects with zstd at `level` when that saves at least a tenth of their
    /// size. κ stays the hash of the uncompressed bytes; reads decompress transparently.
    pub fn with_zstd(mut self, level: i32) -> Self {
        self.zstd = Some(level);
        self
    }

    fn compress(&self, bytes: &[u8]) -> Option<Vec<u8>> {
        let level = self.zstd?;
        let z = zstd::bulk::compress(bytes, level).ok()?;
        (z.len() < bytes.len() - bytes.len() / 10).then_some(z)
    }

    /// Turns [`Store::sync`] into a no-op: writes then reach the page cache only, as CRIU's
    /// and DMTCP's dumps do. For benchmarks that compare like with like; never the default.
    pub fn without_durability(mut self) -> Self {
        self.durable = false;
        self
    }

    /// Writes every pack through the page cache, as when the file system refuses direct I/O
    /// (also set by `FERRY_DIRECT_IO=off`).
    pub fn without_direct_io(self) -> Self {
        self.no_direct.store(true, Ordering::Relaxed);
        self
    }

    /// Whether large batches of block-aligned objects are still written with direct I/O
    /// (false once the file system refused it).
    pub fn direct_io(&self) -> bool {
        !self.no_direct.load(Ordering::Relaxed)
    }

    /// Fault injection for tests: after `n` more new objects, every write fails as if the disk
    /// were full.
    pub fn fail_writes_after(&self, n: u64) {
        self.writes_left.store(n, Ordering::SeqCst);
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// When the file holding κ (its pack, or its own file) was last written, if κ is here:
    /// a space's garbage collection spares what was stored recently.
    pub fn written_at(&self, kappa: &Kappa) -> Option<std::time::SystemTime> {
        let path = match self.packed().slots.get(kappa) {
            Some(slot) => slot.pack.clone(),
            None => {
                let p = self.object_path(kappa);
                if p.exists() { p } else { zst_path(&p) }
            }
        };
        fs::metadata(path).ok()?.modified().ok()
    }

    /// Where the object κ lives.
    pub fn object_path(&self, kappa: &Kappa) -> PathBuf {
        let hex = kappa.to_hex();
        self.root.join("objects").join(&hex[..2]).join(&hex[2..])
    }

    fn ref_path(&self, name: &str) -> PathBuf {
        self.root.join("refs").join(name)
    }

    /// How far this process's garbage collection in the store has come: objects removed,
    /// and the bytes the current (or last) compaction has copied, of how many.
    pub fn housekeeping(&self) -> Housekeeping {
        Housekeeping {
            removed: self.removed.load(Ordering::Relaxed),
            compact_copied: self.compact_copied.load(Ordering::Relaxed),
            compact_total: self.compact_total.load(Ordering::Relaxed),
        }
    }

    /// Removes (unless `dry_run`) what `tmp/` holds — writes a process never finished because
    /// it died in the middle (`kill -9`, a power cut): a pack of a 1 GiB snapshot cut short
    /// would otherwise stay there for good. Returns how many files and bytes. Only for a
    /// store opened with [`FsStore::open_exclusive`] and not writing itself (`store gc`):
    /// then no write is in progress anywhere.
    pub fn remove_unfinished(&self, dry_run: bool) -> Result<(u64, u64), StoreError> {
        let dir = self.root.join("tmp");
        let (mut files, mut bytes) = (0, 0);
        for e in fs::read_dir(&dir).map_err(StoreError::io("list", &dir))? {
            let e = e.map_err(StoreError::io("list", &dir))?;
            let p = e.path();
            let md = fs::symlink_metadata(&p).map_err(StoreError::io("look at", &p))?;
            if !md.is_file() {
                continue;
            }
            if !dry_run {
                fs::remove_file(&p).map_err(StoreError::io("remove", &p))?;
            }
            files += 1;
            bytes += md.len();
        }
        Ok((files, bytes))
    }

    fn tmp_path(&self) -> PathBuf {
        self.root.join("tmp").join(format!(
            "{}-{}.tmp",
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// Whether `put_many` writes `blobs` with direct I/O: a durable store without
    /// compression, a file system that takes it, at least [`DIRECT_MIN`] bytes, every blob
    /// block-aligned in memory and a whole number of blocks long (memory chunks are).
    fn direct_candidate(&self, blobs: &[&[u8]]) -> bool {
        self.durable
            && self.zstd.is_none()
            && !self.no_direct.load(Ordering::Relaxed)
            && blobs.iter().map(|b| b.len()).sum::<usize>() >= DIRECT_MIN
            && blobs.iter().all(|b| b.len().is_multiple_of(DIRECT_ALIGN))
    }

    /// `put_many` with direct I/O (`O_DIRECT`: from the blobs' memory straight to the disk —
    /// no copy into the page cache, no dirty pages for `sync` to wait on), hashing and writing
    /// at once: blobs are hashed [`DIRECT_SEGMENT`] at a time on every core, and the new ones
    /// of each segment go to [`DIRECT_WRITERS`] threads that write them into one pack while
    /// the next segment is hashed. A blob counts as stored when a pack holds it (loose objects
    /// are not looked up: a copy in a pack as well costs space, never correctness).
    /// `Ok(None)`: the file system refused direct I/O; nothing was stored.
    /// `known`: the blobs' κ, when the caller hashed them already.
    fn put_many_direct(
        &self,
        blobs: &[&[u8]],
        known: Option<&[Kappa]>,
    ) -> Result<Option<Vec<Kappa>>, StoreError> {
        use std::os::unix::fs::OpenOptionsExt;
        let refused = |e: &std::io::Error| e.raw_os_error() == Some(libc::EINVAL);
        let tmp = self.tmp_path();
        let f = match OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_DIRECT)
            .open(&tmp)
        {
            Ok(f) => f,
            Err(e) if refused(&e) => {
                self.no_direct.store(true, Ordering::Relaxed);
                return Ok(None);
            }
            Err(e) => return Err(StoreError::io("create", &tmp)(e)),
        };
        let mut ks = Vec::with_capacity(blobs.len());
        let mut objects: Vec<pack::Packable<'_>> = Vec::new();
        let refused_late = std::cell::Cell::new(false);
        let result = (|| -> Result<(), StoreError> {
            let io = |e| StoreError::io("write", &tmp)(e);
            // Reserving the most the pack can take lets the writers proceed without extending
            // the file (it is cut to its length at the end); a file system without
            // `fallocate` allocates as they write.
            let most = DIRECT_ALIGN as u64 + blobs.iter().map(|b| b.len() as u64).sum::<u64>();
            // SAFETY: fallocate on a descriptor we own.
            let _ = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, most as libc::off_t) };
            let mut head = Box::new(Block([0; DIRECT_ALIGN]));
            head.0.copy_from_slice(&pack::header(DIRECT_ALIGN as u64));
            std::os::unix::fs::FileExt::write_all_at(&f, &head.0, 0).map_err(io)?;
            let mut at = DIRECT_ALIGN as u64;
            let mut seen = BTreeSet::new();
            let (tx, rx) = std::sync::mpsc::sync_channel::<(u64, Vec<&[u8]>)>(DIRECT_WRITERS);
            let rx = std::sync::Mutex::new(rx);
            std::thread::scope(|s| {
                let writers: Vec<_> = (0..DIRECT_WRITERS)
                    .map(|_| {
                        let (f, rx) = (&f, &rx);
                        s.spawn(move || {
                            // After a failure, keep taking jobs so the sender never blocks.
                            let mut failed = None;
                            while let Ok((at, bufs)) = rx
                                .lock()
                                .map_or_else(|p| p.into_inner().recv(), |r| r.recv())
                            {
                                if failed.is_none() {
                                    failed = write_at_vectored(f, &bufs, at).err();
                                }
                            }
                            failed.map_or(Ok(()), Err)
                        })
                    })
                    .collect();
                let mut hashed = Ok(());
                for (i, segment) in blobs.chunks(DIRECT_SEGMENT).enumerate() {
                    let segment_ks = match known {
                        Some(ks) => ks[i * DIRECT_SEGMENT..][..segment.len()].to_vec(),
                        None => hash_all(segment),
                    };
                    let mut job = Vec::new();
                    let job_at = at;
                    for (k, b) in segment_ks.iter().zip(segment) {
                        if !self.packed().slots.contains_key(k) && seen.insert(*k) {
                            objects.push((*k, *b, b.len() as u32, false));
                            job.push(*b);
                            at += b.len() as u64;
                        }
                    }
                    ks.extend(segment_ks);
                    if job.is_empty() {
                        continue;
                    }
                    if let Err(e) = self.take_writes(job.len() as u64, &tmp) {
                        hashed = Err(e);
                        break;
                    }
                    if tx.send((job_at, job)).is_err() {
                        break;
                    }
                }
                drop(tx);
                let mut written = Ok(());
                for w in writers {
                    if let Err(e) = w.join().expect("pack writer thread") {
                        written = written.and(Err(e));
                    }
                }
                hashed?;
                written.map_err(|e| {
                    refused_late.set(refused(&e));
                    io(e)
                })
            })?;
            f.set_len(at).map_err(io)
        })();
        drop(f);
        if result.is_err() || objects.is_empty() {
            let _ = fs::remove_file(&tmp);
        }
        if refused_late.get() {
            self.no_direct.store(true, Ordering::Relaxed);
            return Ok(None);
        }
        result?;
        if objects.is_empty() {
            return Ok(Some(ks));
        }
        let (_, idx_bytes, pack_len) = pack::layout(&objects, DIRECT_ALIGN as u64);
        self.finish_pack(&tmp, &idx_bytes, pack_len)?;
        Ok(Some(ks))
    }

    /// `put_many` through [`Self::put_many_direct`] when the store writes these blobs with
    /// direct I/O (copied into block-aligned memory first if need be); `None` when it does
    /// not (or the file system refused it) and nothing was stored.
    fn try_direct(
        &self,
        blobs: &[&[u8]],
        known: Option<&[Kappa]>,
    ) -> Result<Option<Vec<Kappa>>, StoreError> {
        if !self.direct_candidate(blobs) {
            return Ok(None);
        }
        let aligned = blobs
            .iter()
            .all(|b| (b.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN));
        if aligned {
            return self.put_many_direct(blobs, known);
        }
        // Batches a pull, push or import received arrive in ordinary buffers: copied into
        // block-aligned memory first (cheap beside the write), they are packed block-aligned
        // like a snapshot's, so a resume can map them. The staging memory is kept for the
        // thread's next batch: memory the process has not touched before costs far more
        // than the copy (on some VMs ~3 s per GiB to fault in).
        thread_local! {
            static STAGED: std::cell::RefCell<Staged> = std::cell::RefCell::default();
        }
        STAGED.with(|cell| {
            let mut staged = cell.take();
            staged.refill(blobs);
            let r = self.put_many_direct(&staged.slices(), known);
            if staged.bytes() <= STAGED_KEPT {
                cell.replace(staged);
            }
            r
        })
    }

    /// Writes the new ones of `objects` into one pack through the page cache (compressed
    /// if the store compresses).
    fn put_packed(&self, objects: &[crate::Hashed<'_>]) -> Result<(), StoreError> {
        let mut seen = BTreeSet::new();
        let new: Vec<(Kappa, &[u8])> = objects
            .iter()
            .filter(|o| !self.has(&o.kappa()).unwrap_or(false))
            .filter(|o| seen.insert(o.kappa()))
            .map(|o| (o.kappa(), o.bytes()))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        let compressed: Vec<Option<Vec<u8>>> = match self.zstd {
            None => vec![None; new.len()],
            Some(_) => {
                let per = new.len().div_ceil(2).max(1);
                std::thread::scope(|s| {
                    let parts: Vec<_> = new
                        .chunks(per)
                        .map(|part| {
                            s.spawn(move || {
                                part.iter()
                                    .map(|(_, b)| self.compress(b))
                                    .collect::<Vec<_>>()
                            })
                        })
                        .collect();
                    parts
                        .into_iter()
                        .flat_map(|h| h.join().expect("compression thread"))
                        .collect()
                })
            }
        };
        let objects: Vec<pack::Packable<'_>> = new
            .iter()
            .zip(&compressed)
            .map(|((k, b), z)| match z {
                Some(z) => (*k, z.as_slice(), b.len() as u32, true),
                None => (*k, *b, b.len() as u32, false),
            })
            .collect();
        let (header, idx_bytes, pack_len) = pack::layout(&objects, pack::PACK_HEADER);
        self.take_writes(new.len() as u64, &self.root.join("packs"))?;
        let parts: Vec<&[u8]> = std::iter::once(header.as_slice())
            .chain(objects.iter().map(|o| o.1))
            .collect();
        let tmp = self.write_tmp(&parts, false)?;
        self.finish_pack(&tmp, &idx_bytes, pack_len)?;
        Ok(())
    }

    /// Moves a written pack from `tmp` into `packs/` (named after its index), writes the
    /// index beside it and makes its objects readable.
    fn finish_pack(&self, tmp: &Path, idx_bytes: &[u8], pack_len: u64) -> Result<(), StoreError> {
        let id = Kappa::of(idx_bytes).to_hex();
        let dir = self.root.join("packs");
        let pack_path = dir.join(format!("{}.pack", &id[..24]));
        let idx_path = dir.join(format!("{}.idx", &id[..24]));
        if let Err(e) = fs::rename(tmp, &pack_path) {
            let _ = fs::remove_file(tmp);
            return Err(StoreError::io("rename into", &pack_path)(e));
        }
        self.write_atomic(&idx_path, idx_bytes, false)?;
        self.unsynced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend([pack_path.clone(), idx_path]);
        let entries = pack::decode_index(&dir, idx_bytes, pack_len)?;
        self.packed_mut().add(&pack_path, entries);
        Ok(())
    }

    fn write_atomic(&self, dest: &Path, bytes: &[u8], sync: bool) -> Result<(), StoreError> {
        self.write_parts_atomic(dest, &[bytes], sync)
    }

    /// Writes the concatenation of `parts` to `dest` via a temp file and a rename.
    fn write_parts_atomic(
        &self,
        dest: &Path,
        parts: &[&[u8]],
        sync: bool,
    ) -> Result<(), StoreError> {
        let tmp = self.write_tmp(parts, sync)?;
        let result = (|| {
            if let Some(parent) = dest.parent() {
                fs::create_dir_all(parent).map_err(StoreError::io("create directory", parent))?;
            }
            fs::rename(&tmp, dest).map_err(StoreError::io("rename into", dest))
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    /// Writes the concatenation of `parts` to a new file in `tmp/` (removed again if that
    /// fails) and returns its path.
    fn write_tmp(&self, parts: &[&[u8]], sync: bool) -> Result<PathBuf, StoreError> {
        self.new_tmp(sync, |mut f, tmp| {
            for part in parts {
                f.write_all(part).map_err(StoreError::io("write", tmp))?;
            }
            Ok(())
        })
    }

    /// A new file in `tmp/`, filled by `fill` (given the file and its path) and, if `sync`,
    /// made durable; removed again if either fails.
    fn new_tmp(
        &self,
        sync: bool,
        fill: impl FnOnce(&File, &Path) -> Result<(), StoreError>,
    ) -> Result<PathBuf, StoreError> {
        let tmp = self.tmp_path();
        let result = (|| {
            let f = File::create(&tmp).map_err(StoreError::io("create", &tmp))?;
            fill(&f, &tmp)?;
            if sync {
                f.sync_data().map_err(StoreError::io("sync", &tmp))?;
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok(tmp),
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    fn lock_refs(&self) -> Result<File, StoreError> {
        let p = self.root.join("refs.lock");
        let f = lock_file(&p)?;
        // SAFETY: flock on a file descriptor we own; released when `f` is closed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(StoreError::io("lock", &p)(std::io::Error::last_os_error()));
        }
        Ok(f)
    }

    fn read_ref(&self, name: &str) -> Result<Option<RefValue>, StoreError> {
        let p = self.ref_path(name);
        let text = match fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::io("read", &p)(e)),
        };
        let bad = || StoreError::BadRef(p.display().to_string());
        let (epoch, target) = text.trim().split_once(' ').ok_or_else(bad)?;
        Ok(Some(RefValue {
            epoch: epoch.parse().map_err(|_| bad())?,
            target: target.parse().map_err(|_| bad())?,
        }))
    }
}

impl Store for FsStore {
    fn put(&self, bytes: &[u8]) -> Result<Kappa, StoreError> {
        let k = Kappa::of(bytes);
        if self.has(&k)? {
            return Ok(k);
        }
        let dest = self.object_path(&k);
        self.take_writes(1, &dest)?;
        let dest = match self.compress(bytes) {
            Some(z) => {
                let dest = zst_path(&dest);
                self.write_atomic(&dest, &z, false)?;
                dest
            }
            None => {
                self.write_atomic(&dest, bytes, false)?;
                dest
            }
        };
        self.unsynced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(dest);
        Ok(k)
    }

    fn get(&self, kappa: &Kappa) -> Result<Vec<u8>, StoreError> {
        // Packs first: most objects are packed, and looking for a loose file first cost two
        // failed opens per object. A pack gone since (compacted by another process) leaves
        // the loose copy, if there is one.
        let slot = self.packed().slots.get(kappa).cloned();
        if let Some(slot) = slot {
            let mut b = vec![0; slot.len as usize];
            match self.read_slot(kappa, slot, &mut b) {
                Ok(slot) => {
                    Self::verify(kappa, &b, &slot.pack)?;
                    return Ok(b);
                }
                Err(StoreError::Io { source, .. }) if source.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        let p = self.object_path(kappa);
        match fs::read(&p) {
            Ok(bytes) => {
                Self::verify(kappa, &bytes, &p)?;
                return Ok(bytes);
            }
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(StoreError::io("read", &p)(e)),
            Err(_) => {}
        }
        let z = zst_path(&p);
        match fs::File::open(&z) {
            Ok(f) => {
                let mut bytes = Vec::new();
                let decoder =
                    zstd::stream::read::Decoder::new(f).map_err(StoreError::io("read", &z))?;
                let corrupt = |_| StoreError::Corrupt {
                    kappa: *kappa,
                    actual: Kappa::of(b""),
                    where_: format!("{} (not a valid zstd stream)", z.display()),
                };
                std::io::Read::take(decoder, MAX_LOOSE + 1)
                    .read_to_end(&mut bytes)
                    .map_err(corrupt)?;
                Self::verify(kappa, &bytes, &z)?;
                return Ok(bytes);
            }
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(StoreError::io("read", &z)(e)),
            Err(_) => {}
        }
        Err(StoreError::NotFound(*kappa))
    }

    /// Loose objects are hashed as they are read, a MiB at a time (a 100 MB module is checked
    /// without a 100 MB buffer); packed ones are small and read whole.
    fn check(&self, kappa: &Kappa) -> Result<(), StoreError> {
        let p = self.object_path(kappa);
        match File::open(&p) {
            Ok(f) => return Self::verify_stream(kappa, f, &p, false),
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(StoreError::io("read", &p)(e)),
            Err(_) => {}
        }
        let z = zst_path(&p);
        match File::open(&z) {
            Ok(f) => {
                let decoder =
                    zstd::stream::read::Decoder::new(f).map_err(StoreError::io("read", &z))?;
                return Self::verify_stream(kappa, decoder.take(MAX_LOOSE + 1), &z, true);
            }
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(StoreError::io("read", &z)(e)),
            Err(_) => {}
        }
        self.get(kappa).map(drop)
    }

    fn stored_at(&self, kappa: &Kappa) -> Option<crate::Location> {
        let packed = self.packed();
        let slot = packed.slots.get(kappa)?;
        (!slot.zstd && slot.stored == slot.len).then(|| crate::Location {
            file: slot.pack.clone(),
            offset: slot.offset,
            len: slot.len,
        })
    }

    fn read_into(&self, kappa: &Kappa, out: &mut [u8]) -> Result<(), StoreError> {
        let slot = self.packed().slots.get(kappa).cloned();
        let Some(slot) = slot else {
            return copy_exact(kappa, &self.get(kappa)?, out);
        };
        if slot.len as usize != out.len() {
            return Err(StoreError::WrongLength {
                kappa: *kappa,
                expected: out.len(),
                actual: slot.len as usize,
            });
        }
        let slot = self.read_slot(kappa, slot, out)?;
        Self::verify(kappa, out, &slot.pack)
    }

    fn put_many(&self, blobs: &[&[u8]]) -> Result<Vec<Kappa>, StoreError> {
        if let Some(ks) = self.try_direct(blobs, None)? {
            return Ok(ks);
        }
        let hashed = crate::Hashed::all(blobs);
        self.put_packed(&hashed)?;
        Ok(hashed.iter().map(crate::Hashed::kappa).collect())
    }

    fn put_hashed(&self, objects: &[crate::Hashed<'_>]) -> Result<(), StoreError> {
        let blobs: Vec<&[u8]> = objects.iter().map(|o| o.bytes()).collect();
        let ks: Vec<Kappa> = objects.iter().map(crate::Hashed::kappa).collect();
        if self.try_direct(&blobs, Some(&ks))?.is_none() {
            self.put_packed(objects)?;
        }
        Ok(())
    }
    fn len_of(&self, kappa: &Kappa) -> Option<u64> {
        if let Some(slot) = self.packed().slots.get(kappa) {
            return Some(u64::from(slot.len));
        }
        // A loose object stored raw is as long as its file (a compressed one is not).
        fs::metadata(self.object_path(kappa)).ok().map(|m| m.len())
    }

    fn has(&self, kappa: &Kappa) -> Result<bool, StoreError> {
        if self.packed().slots.contains_key(kappa) {
            return Ok(true);
        }
        let p = self.object_path(kappa);
        Ok(p.exists() || zst_path(&p).exists())
    }

    fn list(&self) -> Result<Vec<Kappa>, StoreError> {
        let objects = self.root.join("objects");
        let mut out = Vec::new();
        for dir in fs::read_dir(&objects).map_err(StoreError::io("list", &objects))? {
            let dir = dir.map_err(StoreError::io("list", &objects))?;
            let prefix = dir.file_name().to_string_lossy().into_owned();
            for f in fs::read_dir(dir.path()).map_err(StoreError::io("list", dir.path()))? {
                let f = f.map_err(StoreError::io("list", dir.path()))?;
                let file = f.file_name().to_string_lossy().into_owned();
                let rest = file.strip_suffix(".zst").unwrap_or(&file);
                if let Ok(k) = format!("{}{prefix}{rest}", Kappa::PREFIX).parse() {
                    out.push(k);
                }
            }
        }
        out.extend(self.packed().slots.keys().copied());
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Removing a packed object forgets it; its pack file is deleted once none of its objects
    /// is left. (A pack with some live objects keeps its space until all are removed.)
    fn remove(&self, kappa: &Kappa) -> Result<(), StoreError> {
        let mut packed = self.packed_mut();
        if let Some(slot) = packed.slots.remove(kappa) {
            let live = packed.live.entry(slot.pack.clone()).or_default();
            *live = live.saturating_sub(1);
            if *live == 0 {
                packed.live.remove(&slot.pack);
                packed.pruned.remove(&slot.pack);
                // The index first: an index never names a missing pack.
                remove_if_present(&slot.pack.with_extension("idx"))?;
                remove_if_present(&slot.pack)?;
            } else {
                packed.pruned.insert(slot.pack);
            }
        }
        drop(packed);
        let p = self.object_path(kappa);
        remove_if_present(&p)?;
        remove_if_present(&zst_path(&p))?;
        self.removed.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Packs at least half of whose bytes belong to removed objects are rewritten: their
    /// live objects go into new packs (several old packs into one, in their order, objects
    /// of whole blocks first and block-aligned, so chunks adjacent in memory stay adjacent
    /// and a resume can still map them), and the old packs are deleted once the new ones are
    /// durable. A pack all of whose objects another pack holds (a compaction cut short) is
    /// just deleted. Damaged packs are left for `verify` to report. Objects are copied as
    /// stored, not re-hashed: a damaged one stays detectable where it lands. Packs with the
    /// fewest live bytes go first; once `budget` bytes are copied the rest waits for the next
    /// call (a pack copied in part stays, its index without what was copied, until then).
    fn compact(&self, budget: u64) -> Result<crate::Compacted, StoreError> {
        let dir = self.root.join("packs");
        let mut held: HashMap<PathBuf, Vec<(Kappa, Slot)>> = HashMap::new();
        let loaded: BTreeSet<PathBuf> = {
            let packed = self.packed();
            for (k, slot) in &packed.slots {
                held.entry(slot.pack.clone())
                    .or_default()
                    .push((*k, slot.clone()));
            }
            packed.live.keys().cloned().collect()
        };
        let mut packs = pack::list(&dir)?;
        packs.sort();
        // Packs at least half unreachable, the least live first (the quickest to delete).
        let mut candidates = Vec::new();
        for (idx, pack) in packs {
            let Ok(meta) = fs::metadata(&pack) else {
                continue;
            };
            if !loaded.contains(&pack) {
                continue;
            }
            let mut objects = held.remove(&pack).unwrap_or_default();
            let live: u64 = objects.iter().map(|(_, s)| u64::from(s.stored)).sum();
            if meta.len().saturating_sub(live) * 2 < meta.len() {
                continue;
            }
            let idx_len = fs::metadata(&idx).map_or(0, |m| m.len());
            objects.sort_by_key(|(_, s)| s.offset);
            candidates.push((live, idx, pack, meta.len() + idx_len, objects));
        }
        candidates.sort_by_key(|c| c.0);
        let (mut old, mut moving) = (Vec::new(), Vec::new());
        let mut copied = 0u64;
        for (_, idx, pack, len, objects) in candidates {
            if copied >= budget {
                break;
            }
            for o in objects {
                if copied >= budget {
                    break;
                }
                copied += u64::from(o.1.stored);
                moving.push(o);
            }
            old.push((idx, pack, len));
        }
        if old.is_empty() {
            let freed = self.rewrite_pruned_indexes()?;
            return Ok(crate::Compacted { files: 0, freed });
        }
        self.compact_copied.store(0, Ordering::Relaxed);
        self.compact_total.store(copied, Ordering::Relaxed);
        let (mut moving, rest): (Vec<_>, Vec<_>) = moving
            .into_iter()
            .partition(|(_, s)| !s.zstd && (s.stored as usize).is_multiple_of(DIRECT_ALIGN));
        moving.extend(rest);
        let mut written = 0u64;
        let mut open: HashMap<PathBuf, File> = HashMap::new();
        let mut batch_start = 0;
        while batch_start < moving.len() {
            let mut end = batch_start;
            let mut size = 0u64;
            while end < moving.len() && (end == batch_start || size < COMPACT_BATCH) {
                size += u64::from(moving[end].1.stored);
                end += 1;
            }
            let batch = &moving[batch_start..end];
            batch_start = end;
            let mut entries = Vec::with_capacity(batch.len());
            let mut at = DIRECT_ALIGN as u64;
            for (k, slot) in batch {
                entries.push((*k, at, slot.stored, slot.len, slot.zstd));
                at += u64::from(slot.stored);
            }
            let idx_bytes = pack::encode_index(entries);
            self.take_writes(batch.len() as u64, &dir)?;
            let tmp = self.copy_into_tmp(&pack::header(DIRECT_ALIGN as u64), batch, &mut open)?;
            self.finish_pack(&tmp, &idx_bytes, at)?;
            written += at + idx_bytes.len() as u64;
            self.compact_copied.fetch_add(size, Ordering::Relaxed);
        }
        drop(open);
        // The new packs durable before the old ones go.
        self.sync()?;
        let mut done = crate::Compacted::default();
        let mut packed = self.packed_mut();
        for (idx, pack, len) in old {
            // Every object it held is read from a new pack now.
            if packed.live.get(&pack).is_some_and(|&n| n == 0) {
                packed.live.remove(&pack);
                packed.pruned.remove(&pack);
                remove_if_present(&idx)?;
                remove_if_present(&pack)?;
                done.files += 1;
                done.freed += len;
            }
        }
        done.freed = done.freed.saturating_sub(written);
        drop(packed);
        done.freed += self.rewrite_pruned_indexes()?;
        Ok(done)
    }

    fn get_ref(&self, name: &str) -> Result<Option<RefValue>, StoreError> {
        check_ref_name(name)?;
        self.read_ref(name)
    }

    fn cas_ref(
        &self,
        name: &str,
        expected: Option<RefValue>,
        new: Option<RefValue>,
    ) -> Result<(), StoreError> {
        check_ref_name(name)?;
        let _lock = self.lock_refs()?;
        let current = self.read_ref(name)?;
        check_cas(name, expected, current)?;
        let p = self.ref_path(name);
        match new {
            Some(v) => {
                self.write_atomic(&p, format!("{} {}\n", v.epoch, v.target).as_bytes(), true)
            }
            None => match fs::remove_file(&p) {
                Err(e) if e.kind() != ErrorKind::NotFound => Err(StoreError::io("remove", &p)(e)),
                _ => Ok(()),
            },
        }
    }

    fn load_cache(&self, name: &str) -> Option<Vec<u8>> {
        if !cache_name(name) {
            return None;
        }
        fs::read(self.root.join("cache").join(name)).ok()
    }

    fn save_cache(&self, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
        if !cache_name(name) {
            return Err(StoreError::BadRefName(name.to_owned()));
        }
        let dir = self.root.join("cache");
        fs::create_dir_all(&dir).map_err(StoreError::io("create", &dir))?;
        // Each write its own temporary file (threads of one process too: two writes into one
        // file could interleave into something that still decodes); the rename makes the new
        // file whole at once.
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let tmp = dir.join(format!(
            ".{name}.{}.{}",
            std::process::id(),
            WRITES.fetch_add(1, Ordering::Relaxed)
        ));
        fs::write(&tmp, bytes).map_err(StoreError::io("write", &tmp))?;
        let p = dir.join(name);
        fs::rename(&tmp, &p).map_err(StoreError::io("rename", &p))
    }

    fn problems(&self) -> Vec<String> {
        self.packed().damaged.clone()
    }

    fn sync(&self) -> Result<(), StoreError> {
        if !self.durable {
            return Ok(());
        }
        let pending = std::mem::take(&mut *self.unsynced.lock().unwrap_or_else(|p| p.into_inner()));
        if pending.is_empty() {
            return Ok(());
        }
        if pending.len() <= FSYNC_EACH_MAX {
            let mut dirs: Vec<&Path> = pending.iter().filter_map(|p| p.parent()).collect();
            dirs.sort();
            dirs.dedup();
            for p in pending.iter().map(PathBuf::as_path).chain(dirs) {
                File::open(p)
                    .and_then(|f| f.sync_all())
                    .map_err(StoreError::io("sync", p))?;
            }
            return Ok(());
        }
        let f = File::open(&self.root).map_err(StoreError::io("open", &self.root))?;
        // SAFETY: syncfs on a descriptor we own.
        if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
            return Err(StoreError::io("sync", &self.root)(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    fn list_refs(&self) -> Result<Vec<(String, RefValue)>, StoreError> {
        let mut out = Vec::new();
        let refs = self.root.join("refs");
        let mut stack = vec![refs.clone()];
        while let Some(dir) = stack.pop() {
            for e in fs::read_dir(&dir).map_err(StoreError::io("list", &dir))? {
                let e = e.map_err(StoreError::io("list", &dir))?;
                let path = e.path();
                if path.is_dir() {
                    stack.push(path);
                } else if let Ok(rel) = path.strip_prefix(&refs) {
                    let name = rel.to_string_lossy().into_owned();
                    if let Some(v) = self.read_ref(&name)? {
                        out.push((name, v));
                    }
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_that_looked_up_a_pack_compaction_then_replaced_finds_the_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let s = FsStore::open(dir.path()).unwrap();
        let chunks: Vec<Vec<u8>> = (0..64u32)
            .map(|i| i.to_le_bytes().repeat(1 << 14))
            .collect();
        let ks = s
            .put_many(&chunks.iter().map(Vec::as_slice).collect::<Vec<_>>())
            .unwrap();
        for k in &ks[1..] {
            s.remove(k).unwrap();
        }
        // Looked up before the compaction, read after it: the pack it names is gone.
        let slot = s.packed().slots.get(&ks[0]).cloned().unwrap();
        assert_eq!(s.compact(u64::MAX).unwrap().files, 1);
        assert!(!slot.pack.exists());
        let mut out = vec![0; chunks[0].len()];
        let moved = s.read_slot(&ks[0], slot.clone(), &mut out).unwrap();
        assert_eq!(out, chunks[0]);
        assert_ne!(moved.pack, slot.pack);
    }
}
