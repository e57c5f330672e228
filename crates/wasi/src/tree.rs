//! Mounted directories as content-addressed trees: import a host directory into the store,
//! materialize a tree back into an empty directory.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ferry_kappa::Kappa;
use ferry_object::{
    FILE_CHUNK_SIZE, FileChunks, MODE_DIR, MODE_EXEC, MODE_EXEC_CHUNKS, MODE_FILE,
    MODE_FILE_CHUNKS, MODE_LINK, MODE_SYMLINK, Tree, TreeEntry, UNNAMED_ENTRY,
};
use ferry_store::Store;

use crate::written::{GuestWrites, Written};

/// Deepest directory nesting imported or materialized.
pub const MAX_DEPTH: usize = 64;
/// Largest file stored as one blob (1 MiB, one piece); a larger one is stored as a
/// [`FileChunks`], read and stored 1 MiB at a time, so a snapshot of a big file changed in
/// a few places stores only the pieces that changed.
pub const MAX_BLOB_FILE: u64 = FILE_CHUNK_SIZE as u64;
/// Largest file stored as one blob by ferry before 2026-12-03 (1 GiB): a resume of such a
/// snapshot compares a mount in that form too ([`matches_tree`]).
pub const LEGACY_MAX_BLOB_FILE: u64 = 1 << 30;
/// Largest file a snapshot carries from a mount (1 TiB).
pub const MAX_FILE: u64 = ferry_object::MAX_CHUNKED_FILE;
/// Pieces of a chunked file read and stored at a time (16 MiB).
const PIECES_AT_ONCE: usize = 16;

/// Why a tree could not be imported or materialized.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error(transparent)]
    Store(#[from] ferry_store::StoreError),
    #[error(transparent)]
    Object(#[from] ferry_object::ObjectError),
    #[error("{0}: nested deeper than {MAX_DEPTH} directories")]
    TooDeep(String),
    #[error("tree entry name `{0}` is not a plain file name")]
    BadName(String),
    #[error(
        "{0}: a {1}-byte file; snapshots store mounted files of up to {MAX_FILE} bytes: pass \
         its directory through with --bind instead of --dir (snapshots then leave it on this \
         host)"
    )]
    TooLarge(String, u64),
    #[error("{0}")]
    Malformed(String),
    /// [`ImportCache::pre_store`] was told to stop in the middle of a file.
    #[error("stopped")]
    Stopped,
}

fn io(p: &Path) -> impl FnOnce(std::io::Error) -> TreeError + '_ {
    move |e| TreeError::Io(p.display().to_string(), e)
}

/// The tree with no entries, encoded.
fn empty_tree() -> Vec<u8> {
    let (kind, v) = ferry_object::header::<Tree>();
    ferry_object::encode(&Tree {
        kind,
        v,
        entries: Default::default(),
    })
}

/// Stores the tree with no entries (what a host-bound mount records) and returns its κ.
pub fn empty(store: &dyn Store) -> Result<Kappa, TreeError> {
    Ok(store.put(&empty_tree())?)
}

/// The κ of the tree with no entries ([`empty`]), storing nothing.
pub fn empty_kappa() -> Kappa {
    Kappa::of(&empty_tree())
}

/// Stores the content of `dir` and returns the κ of its tree.
pub fn import(store: &dyn Store, dir: &Path) -> Result<Kappa, TreeError> {
    import_cached(store, dir, &mut ImportCache::default(), &[])
}

/// [`import`] that skips reading files `cache` has seen unchanged, and remembers the files it
/// reads. A session's snapshots import its mounts again each time; a 50 MB standard library
/// is then read and hashed once, not at every snapshot. Paths in `skip` (`dir` joined with a
/// relative path) are left out of the tree.
pub fn import_cached(
    store: &dyn Store,
    dir: &Path,
    cache: &mut ImportCache,
    skip: &[PathBuf],
) -> Result<Kappa, TreeError> {
    import_at(
        Sink::Store(store),
        dir,
        "",
        cache,
        skip,
        &mut HashMap::new(),
    )
}

/// The κ of the tree [`import_cached`] would store for `dir`, storing nothing: what a resume
/// compares with a snapshot's tree. Files `cache` has seen unchanged, whose κ `store` holds,
/// are not read; paths in `skip` are left out as by [`import_cached`].
pub fn tree_kappa(
    store: &dyn Store,
    dir: &Path,
    cache: &mut ImportCache,
    skip: &[PathBuf],
) -> Result<Kappa, TreeError> {
    import_at(
        Sink::HashOnly(store),
        dir,
        "",
        cache,
        skip,
        &mut HashMap::new(),
    )
}

/// Whether `dir` (paths in `skip` aside) holds what tree `want` holds: its κ as
/// [`tree_kappa`] computes it, or its κ in an older form, so a snapshot taken then still
/// finds its unchanged directory unchanged: without files' times (trees before version 3,
/// 2026-12-04), and — when a file of `dir` is one that ferry before 2026-12-03 stored as a
/// blob and ferry now stores in pieces — in that form. Equal κ in any form means equal
/// content (and, in today's form, equal times).
pub fn matches_tree(
    store: &dyn Store,
    dir: &Path,
    cache: &mut ImportCache,
    skip: &[PathBuf],
    want: &Kappa,
) -> Result<bool, TreeError> {
    if tree_kappa(store, dir, cache, skip)? == *want {
        return Ok(true);
    }
    cache.no_times = true;
    let without_times = tree_kappa(store, dir, cache, skip);
    cache.no_times = false;
    if without_times? == *want {
        return Ok(true);
    }
    let legacy = |len| len > MAX_BLOB_FILE && len <= LEGACY_MAX_BLOB_FILE;
    if first_file(dir, skip, legacy).is_none() {
        return Ok(false);
    }
    let mut older = cache.in_legacy_form();
    let same = tree_kappa(store, dir, &mut older, skip)? == *want;
    cache.reads += older.reads;
    Ok(same)
}

/// How `dir` (paths in `skip` aside) differs from tree `want`, for a user: at most `limit`
/// entries, each a path relative to `dir` and `changed`, `added` or `missing`, in path order
/// within each directory; and how many differences were found in all. A file is compared in
/// the form `want` holds it (an older snapshot's blob over 1 MiB as a blob), read only when
/// `cache` does not know it unchanged; nothing is stored.
pub fn differences(
    store: &dyn Store,
    dir: &Path,
    want: &Kappa,
    cache: &mut ImportCache,
    skip: &[PathBuf],
    limit: usize,
) -> Result<(Vec<String>, usize), TreeError> {
    let mut older = cache.in_legacy_form();
    let mut found = (Vec::new(), 0);
    diff_at(
        store,
        dir,
        Path::new(""),
        want,
        (cache, &mut older),
        skip,
        limit,
        &mut found,
    )?;
    Ok(found)
}

#[allow(clippy::too_many_arguments)]
fn diff_at(
    store: &dyn Store,
    dir: &Path,
    rel: &Path,
    want: &Kappa,
    caches: (&mut ImportCache, &mut ImportCache),
    skip: &[PathBuf],
    limit: usize,
    found: &mut (Vec<String>, usize),
) -> Result<(), TreeError> {
    let (cache, older) = caches;
    if rel.components().count() > MAX_DEPTH {
        return Err(TreeError::TooDeep(dir.display().to_string()));
    }
    let tree: Tree = ferry_object::decode(&store.get(want)?)?;
    let note = |found: &mut (Vec<String>, usize), name: &str, what: &str| {
        found.1 += 1;
        if found.0.len() < limit {
            found
                .0
                .push(format!("`{}` {what}", rel.join(name).display()));
        }
    };
    let mut here = std::collections::BTreeMap::new();
    for e in fs::read_dir(dir).map_err(io(dir))? {
        let e = e.map_err(io(dir))?;
        if !skip.contains(&e.path()) {
            here.insert(e.file_name().to_string_lossy().into_owned(), e.path());
        }
    }
    for (name, e) in &tree.entries {
        let Some(p) = here.remove(name) else {
            note(found, name, "missing");
            continue;
        };
        let md = fs::symlink_metadata(&p).map_err(io(&p))?;
        let same = match e.mode.as_str() {
            MODE_DIR if md.is_dir() => {
                let sub = rel.join(name);
                diff_at(
                    store,
                    &p,
                    &sub,
                    &e.object,
                    (cache, older),
                    skip,
                    limit,
                    found,
                )?;
                true
            }
            MODE_SYMLINK if md.file_type().is_symlink() => {
                let t = fs::read_link(&p).map_err(io(&p))?;
                Kappa::of(t.to_string_lossy().as_bytes()) == e.object
            }
            MODE_LINK if md.is_file() => {
                // Another name of the file at `first` (from the root of `dir`).
                let first = String::from_utf8_lossy(&store.get(&e.object)?).into_owned();
                let root = dir.ancestors().nth(rel.components().count());
                let same = root
                    .and_then(|r| fs::symlink_metadata(r.join(&first)).ok())
                    .is_some_and(|f| f.is_file() && (f.dev(), f.ino()) == (md.dev(), md.ino()));
                if !same {
                    let why = format!("changed (no longer another name of `{first}`)");
                    note(found, name, &why);
                    continue;
                }
                true
            }
            MODE_FILE | MODE_EXEC | MODE_FILE_CHUNKS | MODE_EXEC_CHUNKS if md.is_file() => {
                let exec = md.permissions().mode() & 0o111 != 0;
                // The form `want` holds the file in: today's, or an older snapshot's blob.
                let form = if e.chunked() == (md.len() > MAX_BLOB_FILE) {
                    &mut *cache
                } else {
                    &mut *older
                };
                let (k, _) = form.file(Sink::HashOnly(store), &p, &md, None)?;
                let same =
                    k == e.object && exec == (e.mode == MODE_EXEC || e.mode == MODE_EXEC_CHUNKS);
                if same && e.mtime_ns.is_some_and(|t| t != mtime_ns(&md)) {
                    note(
                        found,
                        name,
                        "touched (same content, another modification time)",
                    );
                    continue;
                }
                same
            }
            _ => false,
        };
        if !same {
            note(found, name, "changed");
        }
    }
    for name in here.keys() {
        note(found, name, "added");
    }
    Ok(())
}

/// The first file under `dir` (paths in `skip` aside) too large for a snapshot to carry
/// ([`MAX_FILE`]), with its length. Only looks at metadata, never reads a file; a directory
/// it cannot list, or nesting past [`MAX_DEPTH`], ends the search quietly (an import would
/// report it).
pub fn first_too_large(dir: &Path, skip: &[PathBuf]) -> Option<(PathBuf, u64)> {
    first_file(dir, skip, |len| len > MAX_FILE)
}

/// The first file under `dir` (paths in `skip` aside) whose length `pick` picks, as
/// [`first_too_large`] looks.
fn first_file(dir: &Path, skip: &[PathBuf], pick: impl Fn(u64) -> bool) -> Option<(PathBuf, u64)> {
    let mut todo = vec![(dir.to_path_buf(), 0)];
    while let Some((d, depth)) = todo.pop() {
        for e in fs::read_dir(&d).ok()?.flatten() {
            let p = e.path();
            if skip.contains(&p) {
                continue;
            }
            let Ok(md) = fs::symlink_metadata(&p) else {
                continue;
            };
            if md.is_dir() && depth < MAX_DEPTH {
                todo.push((p, depth + 1));
            } else if md.is_file() && pick(md.len()) {
                return Some((p, md.len()));
            }
        }
    }
    None
}

/// Where an import puts what it reads.
#[derive(Clone, Copy)]
pub(crate) enum Sink<'a> {
    /// Into the store.
    Store(&'a dyn Store),
    /// Nowhere: only the κ are wanted (the store is asked what it holds).
    HashOnly(&'a dyn Store),
}

impl Sink<'_> {
    fn put(self, bytes: &[u8]) -> Result<Kappa, ferry_store::StoreError> {
        match self {
            Sink::Store(s) => s.put(bytes),
            Sink::HashOnly(_) => Ok(Kappa::of(bytes)),
        }
    }

    fn put_many(self, blobs: &[&[u8]]) -> Result<Vec<Kappa>, ferry_store::StoreError> {
        match self {
            Sink::Store(s) => s.put_many(blobs),
            Sink::HashOnly(_) => Ok(ferry_store::hash_all(blobs)),
        }
    }

    fn has(self, k: &Kappa) -> Result<bool, ferry_store::StoreError> {
        match self {
            Sink::Store(s) | Sink::HashOnly(s) => s.has(k),
        }
    }

    /// Object `k` from the store, if it is there and whole.
    fn get(self, k: &Kappa) -> Option<Vec<u8>> {
        match self {
            Sink::Store(s) | Sink::HashOnly(s) => s.get(k).ok(),
        }
    }
}

/// Files an import stored, by path, with what identified their content then: device, inode,
/// length, modification and status-change times (nanoseconds). A file is taken as unchanged
/// while all of these are; the status-change time cannot be set back by a program, and a
/// file is only remembered once its times are [`SETTLED`] old, or at once where the kernel
/// gives any change after a `stat` a later time ([`fine_grained_times`]), so a write in the
/// same timestamp tick as the read cannot go unseen.
#[derive(Debug, Default)]
pub struct ImportCache {
    files: HashMap<PathBuf, (Stamp, Kappa)>,
    /// Files read so far (for tests and diagnostics).
    reads: u64,
    /// How old files must be to be remembered ([`SETTLED`] unless a test says otherwise).
    settled: Option<Duration>,
    /// Largest file stored as one blob ([`MAX_BLOB_FILE`] unless this cache computes the
    /// form of older snapshots, [`ImportCache::in_legacy_form`]).
    blob_limit: Option<u64>,
    /// Where the bytes of files read are counted, if anywhere
    /// ([`ImportCache::count_bytes_into`]).
    bytes_read: Option<Arc<AtomicU64>>,
    /// The guest's changes since the last snapshot ([`ImportCache::use_guest_writes`]).
    guest_writes: GuestWrites,
    /// Files read again only in the pieces the guest changed (for tests and diagnostics).
    patched: u64,
    /// The files (device, inode) stored in pieces since [`ImportCache::use_guest_writes`].
    in_pieces: std::collections::HashSet<(u64, u64)>,
    /// Trees are computed in the form before version 3: without files' times, and each of a
    /// file's names its own file (no [`MODE_LINK`]).
    no_times: bool,
}

/// How old a file's times must be before [`ImportCache`] trusts them.
pub const SETTLED: Duration = Duration::from_secs(2);

/// What identifies a file's content while it is unchanged: device, inode, length,
/// modification and status-change times (nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub dev: u64,
    pub ino: u64,
    pub len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    /// The stamp of the open file `f` (`None` if it cannot be had).
    pub(crate) fn of_file(f: &fs::File) -> Option<Self> {
        f.metadata().ok().map(|md| Self::of(&md))
    }

    pub(crate) fn of(md: &fs::Metadata) -> Self {
        Self {
            dev: md.dev(),
            ino: md.ino(),
            len: md.len(),
            mtime: (md.mtime(), md.mtime_nsec()),
            ctime: (md.ctime(), md.ctime_nsec()),
        }
    }

    /// Whether both times lie at least `age` in the past.
    pub(crate) fn older_than(&self, age: Duration) -> bool {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let limit = now.saturating_sub(age);
        [self.mtime, self.ctime].iter().all(|&(s, ns)| {
            u64::try_from(s)
                .is_ok_and(|s| Duration::new(s, ns.clamp(0, 999_999_999) as u32) <= limit)
        })
    }
}

/// The name of the store's cache file holding an [`ImportCache`] ([`Store::load_cache`]).
pub const IMPORT_CACHE_FILE: &str = "import-cache";

/// Most files a saved [`ImportCache`] keeps (the rest are read again when next seen).
pub const MAX_SAVED: usize = 200_000;
const CACHE_MAGIC: &[u8; 8] = b"FERRYIMC";
/// Version 2 since files over 1 MiB are pieces: a version 1 cache names blobs of files
/// up to 1 GiB, so it is dropped.
const CACHE_VERSION: u32 = 2;
const MAX_PATH: usize = 4096;

/// Calls `each` with every file a saved [`ImportCache`] ([`ImportCache::encode`]'s bytes)
/// holds, in order; `None` as soon as the bytes are not such a cache (every entry seen before
/// then is to be dropped).
fn each_saved(bytes: &[u8], mut each: impl FnMut(&Path, Stamp, Kappa)) -> Option<()> {
    let mut r = bytes;
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, rest) = r.split_at_checked(n)?;
        r = rest;
        Some(head)
    };
    if take(8)? != CACHE_MAGIC || u32::from_le_bytes(take(4)?.try_into().ok()?) != CACHE_VERSION {
        return None;
    }
    let count = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
    if count > MAX_SAVED {
        return None;
    }
    for _ in 0..count {
        let len = u16::from_le_bytes(take(2)?.try_into().ok()?) as usize;
        if len > MAX_PATH {
            return None;
        }
        let path =
            Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(take(len)?));
        if !path.is_absolute() {
            return None;
        }
        let mut u = [0u64; 3];
        for v in &mut u {
            *v = u64::from_le_bytes(take(8)?.try_into().ok()?);
        }
        let mut t = [0i64; 4];
        for v in &mut t {
            *v = i64::from_le_bytes(take(8)?.try_into().ok()?);
        }
        let k = Kappa::from_bytes(take(32)?.try_into().ok()?);
        let stamp = Stamp {
            dev: u[0],
            ino: u[1],
            len: u[2],
            mtime: (t[0], t[1]),
            ctime: (t[2], t[3]),
        };
        each(path, stamp, k);
    }
    r.is_empty().then_some(())
}

impl ImportCache {
    /// The files remembered, as bytes for [`ImportCache::decode`] (at most [`MAX_SAVED`]):
    /// `"FERRYIMC"`, u32 version 2, u32 count, then per file u16 path length, the absolute
    /// path's bytes, u64 device, inode and length, i64 seconds and nanoseconds of the
    /// modification and status-change times, the 32-byte κ; little-endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut files: Vec<_> = self
            .files
            .iter()
            .filter(|(p, _)| p.is_absolute() && p.as_os_str().len() <= MAX_PATH)
            .take(MAX_SAVED)
            .collect();
        files.sort_by(|a, b| a.0.cmp(b.0));
        let mut out = Vec::with_capacity(16 + files.len() * 120);
        out.extend_from_slice(CACHE_MAGIC);
        out.extend_from_slice(&CACHE_VERSION.to_le_bytes());
        out.extend_from_slice(&(files.len() as u32).to_le_bytes());
        for (p, (st, k)) in files {
            let path = std::os::unix::ffi::OsStrExt::as_bytes(p.as_os_str());
            out.extend_from_slice(&(path.len() as u16).to_le_bytes());
            out.extend_from_slice(path);
            for v in [st.dev, st.ino, st.len] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            for v in [st.mtime.0, st.mtime.1, st.ctime.0, st.ctime.1] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(k.as_bytes());
        }
        out
    }

    /// A cache from [`ImportCache::encode`]'s bytes; `None` for anything else (another
    /// version, a torn or altered file): a cache only ever saves reading, so doubt drops it.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let mut files = HashMap::new();
        each_saved(bytes, |path, stamp, k| {
            files.insert(path.to_path_buf(), (stamp, k));
        })?;
        Some(Self {
            files,
            ..Self::default()
        })
    }

    /// The files (device, inode) under `roots` that the cache `store` keeps
    /// ([`IMPORT_CACHE_FILE`]) knows stored in pieces, at most [`MAX_SAVED`]: whose changes
    /// are worth recording from a run's start ([`crate::WasiCtx::record_writes_to`]). Reads
    /// the saved cache without building it (a run's start should not wait for that).
    pub fn saved_in_pieces_under(
        store: &dyn Store,
        roots: &[&Path],
    ) -> std::collections::HashSet<(u64, u64)> {
        let mut found = std::collections::HashSet::new();
        if roots.is_empty() {
            return found;
        }
        if let Some(bytes) = store.load_cache(IMPORT_CACHE_FILE) {
            let all = each_saved(&bytes, |path, stamp, _| {
                if stamp.len > MAX_BLOB_FILE && roots.iter().any(|r| path.starts_with(r)) {
                    found.insert((stamp.dev, stamp.ino));
                }
            });
            if all.is_none() {
                found.clear();
            }
        }
        found
    }

    /// The cache `store` keeps ([`IMPORT_CACHE_FILE`]), or an empty one.
    pub fn saved_in(store: &dyn Store) -> Self {
        store
            .load_cache(IMPORT_CACHE_FILE)
            .and_then(|b| Self::decode(&b))
            .unwrap_or_default()
    }

    /// Keeps this cache in `store` ([`IMPORT_CACHE_FILE`]) for later runs.
    pub fn save_in(&self, store: &dyn Store) -> Result<(), ferry_store::StoreError> {
        store.save_cache(IMPORT_CACHE_FILE, &self.encode())
    }

    /// Adds what `other` remembers of files this cache has no word on.
    pub fn absorb(&mut self, other: Self) {
        for (p, v) in other.files {
            self.files.entry(p).or_insert(v);
        }
    }

    /// Takes what `other` remembers, over what this cache remembers of the same files (read
    /// more recently: [`ImportCache::pre_store`]'s findings).
    pub fn update_from(&mut self, other: &Self) {
        for (p, v) in &other.files {
            self.files.insert(p.clone(), *v);
        }
    }

    /// [`ImportCache::update_from`], taking only the files whose objects `store` holds whole
    /// (a [`FileChunks`] and every piece of it): a `--keep` prune, which deletes what no
    /// snapshot names, may have deleted what [`ImportCache::pre_store`] stored meanwhile.
    pub fn update_from_stored(&mut self, other: &Self, store: &dyn Store) {
        let limit = self.blob_limit();
        for (p, (stamp, k)) in &other.files {
            let whole = if stamp.len > limit {
                store
                    .get(k)
                    .ok()
                    .and_then(|b| ferry_object::decode::<FileChunks>(&b).ok())
                    .is_some_and(|f| f.chunks.iter().all(|c| store.has(c).unwrap_or(false)))
            } else {
                store.has(k).unwrap_or(false)
            };
            if whole {
                self.files.insert(p.clone(), (*stamp, *k));
            }
        }
    }

    /// Stores every file under `dir` (paths in `skip` aside) that this cache does not know
    /// unchanged and whose times are [`SETTLED`] old, as an import would, and remembers it:
    /// what a later import then need not read. `--pre-write` and the pass before a
    /// checkpoint run this while the guest runs, so that a snapshot's pause is not spent
    /// reading a data set. Files modified more recently are left to the import (one being
    /// written would only be read again), as are files too large to carry; `stop` is asked
    /// between files and every 16 MiB of one. What it stored and remembered, as a cache of
    /// its own.
    pub fn pre_store(
        &mut self,
        store: &dyn Store,
        dir: &Path,
        skip: &[PathBuf],
        stop: &dyn Fn() -> bool,
    ) -> Result<ImportCache, TreeError> {
        let mut fresh = ImportCache::default();
        let settled = self.settled.unwrap_or(SETTLED);
        let mut todo = vec![(dir.to_path_buf(), 0)];
        while let Some((d, depth)) = todo.pop() {
            for e in fs::read_dir(&d).map_err(io(&d))? {
                if stop() {
                    return Ok(fresh);
                }
                let p = e.map_err(io(&d))?.path();
                if skip.contains(&p) {
                    continue;
                }
                let md = fs::symlink_metadata(&p).map_err(io(&p))?;
                if md.is_dir() && depth < MAX_DEPTH {
                    todo.push((p, depth + 1));
                    continue;
                }
                let stamp = Stamp::of(&md);
                let known = self.files.get(&p).is_some_and(|(seen, _)| *seen == stamp);
                if !md.is_file() || known || md.len() > MAX_FILE || !stamp.older_than(settled) {
                    continue;
                }
                let k = match self.file(Sink::Store(store), &p, &md, Some(stop)) {
                    Ok((k, _)) => k,
                    Err(TreeError::Stopped) => return Ok(fresh),
                    Err(e) => return Err(e),
                };
                if let Some(v) = self.files.get(&p).filter(|(_, kept)| *kept == k) {
                    fresh.files.insert(p, *v);
                }
            }
        }
        Ok(fresh)
    }

    /// A cache that also trusts files modified less than [`SETTLED`] ago.
    #[cfg(test)]
    pub(crate) fn trusting_recent_files() -> Self {
        Self {
            settled: Some(Duration::ZERO),
            ..Self::default()
        }
    }

    /// Stores `bytes` in the form an import stores a file (a blob, or pieces over
    /// [`MAX_BLOB_FILE`]) and remembers the file at `p` as holding them at once, without
    /// waiting for its times to settle: for a file ferry itself has just written whole with
    /// `bytes`, in a directory of its own that nothing else writes (a Python runtime's
    /// standard library under `<store>/runtimes/`), so even the first snapshot that mounts it
    /// need not read it.
    pub fn remember_written(
        &mut self,
        store: &dyn Store,
        p: &Path,
        bytes: &[u8],
    ) -> Result<(), TreeError> {
        let p = p.canonicalize().map_err(io(p))?;
        let md = fs::symlink_metadata(&p).map_err(io(&p))?;
        let sink = Sink::Store(store);
        let k = if bytes.len() as u64 <= self.blob_limit() {
            sink.put(bytes)?
        } else {
            let pieces: Vec<&[u8]> = bytes.chunks(FILE_CHUNK_SIZE as usize).collect();
            put_file_chunks(sink, bytes.len() as u64, sink.put_many(&pieces)?)?
        };
        self.files.insert(p, (Stamp::of(&md), k));
        Ok(())
    }

    /// Remembers the file at `p`, just written whole from object `k` with modification time
    /// `mtime` (none: dating it [`SETTLED`] back first; see [`remember_tree`]); whether it
    /// did.
    /// A file in another form than this cache's ([`LEGACY_MAX_BLOB_FILE`]: a blob over
    /// 1 MiB, from an older snapshot) is left to be read: its κ is not what an import gives.
    fn remember_materialized(
        &mut self,
        p: &Path,
        k: Kappa,
        chunked: bool,
        mtime: Option<i64>,
    ) -> Result<bool, TreeError> {
        let len = fs::symlink_metadata(p).map_err(io(p))?.len();
        if chunked != (len > self.blob_limit()) {
            return Ok(false);
        }
        if mtime.is_none() {
            let back = SystemTime::now() - SETTLED;
            fs::File::options()
                .write(true)
                .open(p)
                .and_then(|f| f.set_times(fs::FileTimes::new().set_modified(back)))
                .map_err(io(p))?;
        }
        let md = fs::symlink_metadata(p).map_err(io(p))?;
        let settled = mtime.is_none()
            || (mtime_ns(&md) as i128) <= (unix_ns(SystemTime::now()) - SETTLED.as_nanos() as i128)
            || fine_grained_times(p);
        if !settled {
            return Ok(false);
        }
        self.files.insert(p.to_path_buf(), (Stamp::of(&md), k));
        Ok(true)
    }

    /// How many files this cache remembers.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether this cache remembers no file.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Files read (not taken from the cache) so far.
    pub fn files_read(&self) -> u64 {
        self.reads
    }

    /// Files read again so far only in the pieces the guest changed
    /// ([`ImportCache::use_guest_writes`]).
    pub fn files_patched(&self) -> u64 {
        self.patched
    }

    /// Tells the next imports what the guest changed in its mounted files since the last
    /// snapshot ([`crate::WasiCtx::take_guest_writes`]): a big file it changed in a few
    /// places, which this cache stored before, is then read again only there. Taken back by
    /// [`ImportCache::forget_guest_writes`] after the snapshot's import.
    pub fn use_guest_writes(&mut self, writes: GuestWrites) {
        self.guest_writes = writes;
        self.in_pieces.clear();
    }

    /// The files (device, inode) the imports since [`ImportCache::use_guest_writes`] found
    /// stored in pieces, at most [`MAX_SAVED`]: whose changes are worth recording for the
    /// next snapshot ([`crate::WasiCtx::record_writes_to`]).
    pub fn stored_in_pieces(&mut self) -> std::collections::HashSet<(u64, u64)> {
        std::mem::take(&mut self.in_pieces)
    }

    /// Drops what [`ImportCache::use_guest_writes`] told it.
    pub fn forget_guest_writes(&mut self) {
        self.guest_writes = GuestWrites::default();
    }

    /// A cache computing trees in the form of ferry before 2026-12-03 (files up to
    /// [`LEGACY_MAX_BLOB_FILE`] one blob), knowing the files this one knows whose form is
    /// the same in both (up to [`MAX_BLOB_FILE`]).
    pub(crate) fn in_legacy_form(&self) -> Self {
        Self {
            files: self
                .files
                .iter()
                .filter(|(_, (stamp, _))| stamp.len <= MAX_BLOB_FILE)
                .map(|(p, v)| (p.clone(), *v))
                .collect(),
            reads: 0,
            settled: self.settled,
            blob_limit: Some(LEGACY_MAX_BLOB_FILE),
            bytes_read: self.bytes_read.clone(),
            no_times: true,
            ..Self::default()
        }
    }

    /// Adds the bytes of every file this cache reads from now on to `counter` (none: stop),
    /// as it reads them: progress a long import can show.
    pub fn count_bytes_into(&mut self, counter: Option<Arc<AtomicU64>>) {
        self.bytes_read = counter;
    }

    /// A cache computing trees in the form before version 3 (without files' times and links).
    #[cfg(test)]
    pub(crate) fn without_times(&self) -> Self {
        Self {
            files: self.files.clone(),
            no_times: true,
            ..Self::default()
        }
    }

    fn blob_limit(&self) -> u64 {
        self.blob_limit.unwrap_or(MAX_BLOB_FILE)
    }

    /// The κ of the file at `p`, reading it only when it may have changed, and whether it is
    /// a [`FileChunks`] (else a blob); one in pieces is noted for
    /// [`ImportCache::stored_in_pieces`].
    fn file(
        &mut self,
        store: Sink<'_>,
        p: &Path,
        md: &fs::Metadata,
        stop: Option<&dyn Fn() -> bool>,
    ) -> Result<(Kappa, bool), TreeError> {
        let (k, chunked) = self.file_kappa(store, p, md, stop)?;
        if chunked && self.in_pieces.len() < MAX_SAVED {
            self.in_pieces.insert((md.dev(), md.ino()));
        }
        Ok((k, chunked))
    }

    /// [`ImportCache::file`], short of noting what is stored in pieces.
    fn file_kappa(
        &mut self,
        store: Sink<'_>,
        p: &Path,
        md: &fs::Metadata,
        stop: Option<&dyn Fn() -> bool>,
    ) -> Result<(Kappa, bool), TreeError> {
        let stamp = Stamp::of(md);
        let limit = self.blob_limit();
        if let Some((seen, k)) = self.files.get(p)
            && *seen == stamp
            && store.has(k)?
        {
            // Unchanged since it was stored: the same length, so the same form.
            return Ok((*k, seen.len > limit));
        }
        if md.len() > MAX_FILE {
            return Err(TreeError::TooLarge(p.display().to_string(), md.len()));
        }
        let counter = self.bytes_read.as_deref();
        let patched = match self.patch_base(p, &stamp, limit) {
            Some((base, chain)) => patch_chunked(store, p, &stamp, base, chain, counter)?,
            None => None,
        };
        let (k, chunked) = match patched {
            Some(k) => {
                self.patched += 1;
                (k, true)
            }
            None if md.len() > limit => {
                self.reads += 1;
                let f = fs::File::open(p).map_err(io(p))?;
                put_chunked(store, &f, p, limit, counter, stop)?
            }
            None => {
                self.reads += 1;
                let bytes = fs::read(p).map_err(io(p))?;
                if let Some(c) = counter {
                    c.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                }
                (store.put(&bytes)?, false)
            }
        };
        let after = fs::symlink_metadata(p).map(|m| Stamp::of(&m)).ok();
        if after == Some(stamp) && self.trusts(p, &stamp) {
            self.files.insert(p.to_path_buf(), (stamp, k));
        } else {
            self.files.remove(p);
        }
        Ok((k, chunked))
    }

    /// Whether a file seen with `stamp` before and after it was read can be taken as
    /// unchanged while its stamp is: its times are [`SETTLED`] old, or any later change is
    /// sure to give it a later time ([`fine_grained_times`]).
    fn trusts(&self, p: &Path, stamp: &Stamp) -> bool {
        match self.settled {
            Some(age) => stamp.older_than(age),
            None => stamp.older_than(SETTLED) || fine_grained_times(p),
        }
    }

    /// The stored [`FileChunks`] of the file at `p` (stamp `now`, over `limit`) that the
    /// guest's changes since lead to it from, and those changes: a file this cache
    /// remembers, at the stamp the unbroken chain of changes begins at.
    fn patch_base(&self, p: &Path, now: &Stamp, limit: u64) -> Option<(Kappa, &Written)> {
        let chain = self.guest_writes.chain_to(now)?;
        let (seen, k) = self
            .files
            .get(p)
            .filter(|(seen, _)| *seen == chain.before)?;
        (seen.len > limit && now.len > limit && fine_grained_times(p)).then_some((*k, chain))
    }
}

/// Stores the open file `f` (`p` names it in errors; over `limit` when it was looked at) as a
/// [`FileChunks`], 1 MiB
/// at a time, adding the bytes read to `counter` as it goes and asking `stop` before each
/// 16 MiB ([`TreeError::Stopped`]); its κ. A file that shrank to
/// `limit` or less meanwhile is stored as one blob after all (each content has one form, so
/// one κ), and the caller's check of its times then finds it changed. Whether it was stored
/// chunked. `f` is read at offsets, so a descriptor the guest holds keeps its own
/// ([`import_unnamed`]).
fn put_chunked(
    store: Sink<'_>,
    f: &fs::File,
    p: &Path,
    limit: u64,
    counter: Option<&AtomicU64>,
    stop: Option<&dyn Fn() -> bool>,
) -> Result<(Kappa, bool), TreeError> {
    use std::os::unix::fs::FileExt;
    let mut chunks = Vec::new();
    let mut len = 0u64;
    // Pieces go to the store a batch at a time (hashed in parallel, written together: one
    // pack, not a file and an fsync each).
    let mut buf = vec![0u8; PIECES_AT_ONCE * FILE_CHUNK_SIZE as usize];
    loop {
        if stop.is_some_and(|stop| stop()) {
            return Err(TreeError::Stopped);
        }
        let mut filled = 0;
        while filled < buf.len() {
            match f
                .read_at(&mut buf[filled..], len + filled as u64)
                .map_err(io(p))?
            {
                0 => break,
                n => filled += n,
            }
        }
        len += filled as u64;
        if len > MAX_FILE {
            return Err(TreeError::TooLarge(p.display().to_string(), len));
        }
        let pieces: Vec<&[u8]> = buf[..filled].chunks(FILE_CHUNK_SIZE as usize).collect();
        chunks.extend(store.put_many(&pieces)?);
        if let Some(c) = counter {
            c.fetch_add(filled as u64, Ordering::Relaxed);
        }
        if filled < buf.len() {
            break;
        }
    }
    if len <= limit {
        let mut bytes = vec![0u8; len as usize];
        f.read_exact_at(&mut bytes, 0).map_err(io(p))?;
        return Ok((store.put(&bytes)?, false));
    }
    Ok((put_file_chunks(store, len, chunks)?, true))
}

/// Whether any change to the file at `p` after a `stat` of it gives it a later timestamp
/// than that `stat` saw, even within the same clock tick: multigrain timestamps, Linux
/// ≥ 6.13 on ext4, xfs, btrfs and tmpfs. Only then is a stamp taken moments ago trusted
/// ([`ImportCache`]): elsewhere another program's write in the same tick as ferry's read of
/// the file could leave its stamp as it was, so a file must be [`SETTLED`] first.
pub(crate) fn fine_grained_times(p: &Path) -> bool {
    static KERNEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let kernel = *KERNEL.get_or_init(|| {
        // SAFETY: uname fills the struct it is given.
        let mut u: libc::utsname = unsafe { std::mem::zeroed() };
        if unsafe { libc::uname(&mut u) } != 0 {
            return false;
        }
        // SAFETY: uname NUL-terminates the release.
        let release = unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) };
        let mut parts = release
            .to_string_lossy()
            .split(['.', '-'])
            .map(|n| n.parse::<u32>().unwrap_or(0))
            .collect::<Vec<_>>()
            .into_iter();
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (6, 13)
    });
    if !kernel {
        return false;
    }
    let Ok(c) = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(p.as_os_str()))
    else {
        return false;
    };
    // SAFETY: a NUL-terminated path and a struct statfs fills.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut fs) } != 0 {
        return false;
    }
    const EXT4: i64 = 0xEF53;
    const XFS: i64 = 0x5846_5342;
    const BTRFS: i64 = 0x9123_683E;
    const TMPFS: i64 = 0x0102_1994;
    matches!(fs.f_type as i64, EXT4 | XFS | BTRFS | TMPFS)
}

/// Stores the file at `p` (stamp `now`) as a [`FileChunks`] made from `base`'s pieces, the
/// pieces `chain` touched read again from the file (and, if the length changed, every piece
/// from the shorter length on), adding the bytes read to `counter`; its κ. `None` when `base`
/// or one of the pieces it keeps is no longer whole in the store (a prune may have deleted
/// it), or the file turns out shorter than `now` says: the caller then reads it whole.
pub(crate) fn patch_chunked(
    store: Sink<'_>,
    p: &Path,
    now: &Stamp,
    base: Kappa,
    chain: &Written,
    counter: Option<&AtomicU64>,
) -> Result<Option<Kappa>, TreeError> {
    use std::os::unix::fs::FileExt;
    let Some(old) = store
        .get(&base)
        .and_then(|b| ferry_object::decode::<FileChunks>(&b).ok())
        .filter(|f| f.chunk_size == FILE_CHUNK_SIZE && f.len == chain.before.len)
    else {
        return Ok(None);
    };
    let piece = u64::from(FILE_CHUNK_SIZE);
    let count = now.len.div_ceil(piece);
    // The chain marks what a change of length touches; this keeps a piece whose end moved
    // from being taken whatever the chain says.
    let kept_below = match old.len == now.len {
        true => count,
        false => old.len.min(now.len) / piece,
    };
    let mut chunks: Vec<Option<Kappa>> = Vec::with_capacity(count as usize);
    for i in 0..count {
        let keep = (i < kept_below && !chain.touched(i))
            .then(|| old.chunks.get(i as usize).copied())
            .flatten();
        match keep {
            Some(c) if !store.has(&c)? => return Ok(None),
            keep => chunks.push(keep),
        }
    }
    let f = fs::File::open(p).map_err(io(p))?;
    let mut buf = vec![0u8; PIECES_AT_ONCE * FILE_CHUNK_SIZE as usize];
    let mut i = 0;
    while i < count {
        if chunks[i as usize].is_some() {
            i += 1;
            continue;
        }
        // A run of pieces to read, at most PIECES_AT_ONCE.
        let first = i;
        while i < count && i - first < PIECES_AT_ONCE as u64 && chunks[i as usize].is_none() {
            i += 1;
        }
        let start = first * piece;
        let len = (i * piece).min(now.len) - start;
        let bytes = &mut buf[..len as usize];
        match f.read_exact_at(bytes, start) {
            Ok(()) => {}
            // Shorter than its stamp said: another program cut it meanwhile (the caller's
            // check of its times then finds it changed); read whole instead.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(io(p)(e)),
        }
        if let Some(c) = counter {
            c.fetch_add(len, Ordering::Relaxed);
        }
        let pieces: Vec<&[u8]> = bytes.chunks(FILE_CHUNK_SIZE as usize).collect();
        for (j, k) in store.put_many(&pieces)?.into_iter().enumerate() {
            chunks[first as usize + j] = Some(k);
        }
    }
    let chunks = chunks
        .into_iter()
        .map(|c| c.expect("every piece"))
        .collect();
    Ok(Some(put_file_chunks(store, now.len, chunks)?))
}

/// Stores the [`FileChunks`] of a `len`-byte file whose pieces are `chunks`; its κ.
fn put_file_chunks(store: Sink<'_>, len: u64, chunks: Vec<Kappa>) -> Result<Kappa, TreeError> {
    Ok(store.put(&ferry_object::encode(&FileChunks::new(len, chunks)))?)
}

/// Imports `dir`, at path `rel` from the tree's root (`""` at the root, names joined by
/// `/`). Entries are taken in name order, depth first, so that of a file's names in the
/// tree the first in that order holds it and the others ([`MODE_LINK`]) name that path:
/// `links` holds the first name of each file with more than one (device, inode).
fn import_at(
    store: Sink<'_>,
    dir: &Path,
    rel: &str,
    cache: &mut ImportCache,
    skip: &[PathBuf],
    links: &mut HashMap<(u64, u64), String>,
) -> Result<Kappa, TreeError> {
    if depth(rel) > MAX_DEPTH {
        return Err(TreeError::TooDeep(dir.display().to_string()));
    }
    let (kind, v) = ferry_object::header::<Tree>();
    let mut tree = Tree {
        kind,
        v,
        entries: Default::default(),
    };
    let mut listed = Vec::new();
    for e in fs::read_dir(dir).map_err(io(dir))? {
        let e = e.map_err(io(dir))?;
        let p = e.path();
        if !skip.contains(&p) {
            listed.push((e.file_name().to_string_lossy().into_owned(), p));
        }
    }
    listed.sort();
    for (name, p) in listed {
        let md = fs::symlink_metadata(&p).map_err(io(&p))?;
        let path = below(rel, &name);
        let entry = if md.is_dir() {
            TreeEntry {
                mode: MODE_DIR.into(),
                object: import_at(store, &p, &path, cache, skip, links)?,
                mtime_ns: None,
            }
        } else if md.file_type().is_symlink() {
            let t = fs::read_link(&p).map_err(io(&p))?;
            TreeEntry {
                mode: MODE_SYMLINK.into(),
                object: store.put(t.to_string_lossy().as_bytes())?,
                mtime_ns: None,
            }
        } else if md.is_file()
            && md.nlink() > 1
            && !cache.no_times
            && let Some(first) = links.get(&(md.dev(), md.ino()))
        {
            TreeEntry {
                mode: MODE_LINK.into(),
                object: store.put(first.as_bytes())?,
                mtime_ns: None,
            }
        } else if md.is_file() {
            if md.nlink() > 1 {
                links.insert((md.dev(), md.ino()), path);
            }
            let (object, chunked) = cache.file(store, &p, &md, None)?;
            let mode = match (md.permissions().mode() & 0o111 != 0, chunked) {
                (true, false) => MODE_EXEC,
                (false, false) => MODE_FILE,
                (true, true) => MODE_EXEC_CHUNKS,
                (false, true) => MODE_FILE_CHUNKS,
            };
            TreeEntry {
                mode: mode.into(),
                object,
                mtime_ns: (!cache.no_times).then(|| mtime_ns(&md)),
            }
        } else {
            continue;
        };
        tree.entries.insert(name, entry);
    }
    tree.v = Tree::version_for(&tree.entries);
    Ok(store.put(&ferry_object::encode(&tree))?)
}

/// Writes tree κ into `dir` (created if missing; existing files are overwritten).
pub fn materialize(store: &dyn Store, kappa: &Kappa, dir: &Path) -> Result<(), TreeError> {
    materialize_with(store, kappa, dir, None)
}

/// [`materialize`] that adds the bytes of each file to `written` as it writes them: progress
/// a long write-back can show.
pub fn materialize_counting(
    store: &dyn Store,
    kappa: &Kappa,
    dir: &Path,
    written: &AtomicU64,
) -> Result<(), TreeError> {
    materialize_with(store, kappa, dir, Some(written))
}

/// What [`materialize_at`] keeps across a tree: the files it wrote, by path from the root
/// (what a [`MODE_LINK`] may name), and the links to make once they are all written.
#[derive(Default)]
struct Materialized {
    files: HashMap<String, PathBuf>,
    links: Vec<(PathBuf, String)>,
}

fn materialize_with(
    store: &dyn Store,
    kappa: &Kappa,
    dir: &Path,
    written: Option<&AtomicU64>,
) -> Result<(), TreeError> {
    let mut done = Materialized::default();
    materialize_at(store, kappa, dir, "", written, &mut done)?;
    for (p, first) in done.links {
        let Some(file) = done.files.get(&first) else {
            return Err(TreeError::Malformed(format!(
                "{} is another name of `{first}`, which is not a file of the tree",
                p.display()
            )));
        };
        match fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(TreeError::Io(p.display().to_string(), e)),
        }
        fs::hard_link(file, &p).map_err(io(&p))?;
    }
    Ok(())
}

/// How many bytes writing tree κ out writes (the files' lengths), if `store` knows each
/// without reading it ([`Store::len_of`]): the total a long write-back's progress shows.
pub fn tree_len(store: &dyn Store, kappa: &Kappa) -> Option<u64> {
    tree_len_at(store, kappa, 0)
}

fn tree_len_at(store: &dyn Store, kappa: &Kappa, depth: usize) -> Option<u64> {
    if depth > MAX_DEPTH {
        return None;
    }
    let tree: Tree = ferry_object::decode(&store.get(kappa).ok()?).ok()?;
    let mut total = 0u64;
    for e in tree.entries.values() {
        let len = match e.mode.as_str() {
            MODE_DIR => tree_len_at(store, &e.object, depth + 1)?,
            MODE_SYMLINK | MODE_LINK => 0,
            MODE_FILE | MODE_EXEC => store.len_of(&e.object)?,
            _ => {
                ferry_object::decode::<FileChunks>(&store.get(&e.object).ok()?)
                    .ok()?
                    .len
            }
        };
        total = total.checked_add(len)?;
    }
    Some(total)
}

/// Tells `cache` what each file of `dir`, just written from tree κ by [`materialize`] (and
/// perhaps moved there whole since), holds, so that the next snapshot of `dir` does not read
/// them again (a resume into an empty directory writes a data set back; its first snapshot
/// would otherwise read it all); the number of files remembered. A file must bear a time
/// [`SETTLED`] old: any later write to it, even in the same coarse timestamp tick, then sets
/// another modification time, so the stamp remembered can be trusted at once. (Kernels with
/// multigrain timestamps, Linux ≥ 6.13 on ext4, xfs, btrfs and tmpfs, already give a change
/// after a `stat` a later time.) A file the tree gives a time keeps it, and is left to be
/// read when that time is more recent (on kernels without multigrain timestamps); a file of
/// an older tree, without times, is dated [`SETTLED`] back. A file whose κ is not what an
/// import gives now (a blob over 1 MiB, from an older snapshot) is left to be read.
pub fn remember_tree(
    store: &dyn Store,
    kappa: &Kappa,
    dir: &Path,
    cache: &mut ImportCache,
) -> Result<u64, TreeError> {
    let root = dir.canonicalize().map_err(io(dir))?;
    let mut todo = vec![(*kappa, root, 0)];
    let mut remembered = 0;
    while let Some((k, d, depth)) = todo.pop() {
        if depth > MAX_DEPTH {
            return Err(TreeError::TooDeep(d.display().to_string()));
        }
        let tree: Tree = ferry_object::decode(&store.get(&k)?)?;
        for (name, e) in &tree.entries {
            let p = d.join(name);
            match e.mode.as_str() {
                MODE_DIR => todo.push((e.object, p, depth + 1)),
                MODE_SYMLINK | MODE_LINK => {}
                _ => {
                    remembered += u64::from(cache.remember_materialized(
                        &p,
                        e.object,
                        e.chunked(),
                        e.mtime_ns,
                    )?)
                }
            }
        }
    }
    Ok(remembered)
}

/// Writes tree κ into `dir`, at path `rel` from the root (as [`import_at`] names them);
/// its links are left to the caller, in `done`.
fn materialize_at(
    store: &dyn Store,
    kappa: &Kappa,
    dir: &Path,
    rel: &str,
    written: Option<&AtomicU64>,
    done: &mut Materialized,
) -> Result<(), TreeError> {
    if depth(rel) > MAX_DEPTH {
        return Err(TreeError::TooDeep(dir.display().to_string()));
    }
    let tree: Tree = ferry_object::decode(&store.get(kappa)?)?;
    tree.check().map_err(TreeError::Malformed)?;
    fs::create_dir_all(dir).map_err(io(dir))?;
    for (name, e) in &tree.entries {
        if name.is_empty()
            || name == "."
            || name == ".."
            || name.contains('/')
            || name.contains('\0')
        {
            return Err(TreeError::BadName(name.clone()));
        }
        let p = dir.join(name);
        let path = below(rel, name);
        match e.mode.as_str() {
            MODE_DIR => materialize_at(store, &e.object, &p, &path, written, done)?,
            MODE_LINK => {
                let first = String::from_utf8_lossy(&store.get(&e.object)?).into_owned();
                done.links.push((p, first));
                continue;
            }
            MODE_SYMLINK => {
                let t = String::from_utf8_lossy(&store.get(&e.object)?).into_owned();
                let _ = fs::remove_file(&p);
                std::os::unix::fs::symlink(t, &p).map_err(io(&p))?;
            }
            // A file (`check` left no other mode), made through one handle.
            _ => {
                use std::io::Write;
                let f = fs::File::create(&p).map_err(io(&p))?;
                if e.chunked() {
                    // The chunks of zeros as holes: the file is sparse where it likely was.
                    write_chunks_into(store, &e.object, &f, &p, written)?;
                } else {
                    let bytes = store.get(&e.object)?;
                    (&f).write_all(&bytes).map_err(io(&p))?;
                    if let Some(w) = written {
                        w.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    }
                }
                if e.mode == MODE_EXEC || e.mode == MODE_EXEC_CHUNKS {
                    f.set_permissions(fs::Permissions::from_mode(0o755))
                        .map_err(io(&p))?;
                }
                if let Some(t) = e.mtime_ns {
                    set_mtime(&f, t).map_err(io(&p))?;
                }
                done.files.insert(path, p);
            }
        }
    }
    Ok(())
}

/// Path `name` below `rel` (names joined by `/` from a tree's root, `""` being the root).
fn below(rel: &str, name: &str) -> String {
    if rel.is_empty() {
        name.to_owned()
    } else {
        format!("{rel}/{name}")
    }
}

/// How many directories below a tree's root path `rel` ([`below`]) lies.
fn depth(rel: &str) -> usize {
    if rel.is_empty() {
        0
    } else {
        rel.split('/').count()
    }
}

/// A file's modification time as a tree holds it: nanoseconds since the Unix epoch.
pub(crate) fn mtime_ns(md: &fs::Metadata) -> i64 {
    md.mtime()
        .saturating_mul(1_000_000_000)
        .saturating_add(md.mtime_nsec())
}

/// Nanoseconds since the Unix epoch (negative before it).
fn unix_ns(t: SystemTime) -> i128 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    }
}

/// Gives the open file `f` the modification time `ns` ([`mtime_ns`]); its access time stays.
fn set_mtime(f: &fs::File, ns: i64) -> std::io::Result<()> {
    let d = Duration::from_nanos(ns.unsigned_abs());
    let t = if ns >= 0 {
        UNIX_EPOCH + d
    } else {
        UNIX_EPOCH - d
    };
    f.set_times(fs::FileTimes::new().set_modified(t))
}

/// Writes the chunked file `k` into the open, empty file `f` (`p` names it in errors): the
/// chunks of zeros as holes, the others as they are.
fn write_chunks_into(
    store: &dyn Store,
    k: &Kappa,
    f: &fs::File,
    p: &Path,
    written: Option<&AtomicU64>,
) -> Result<(), TreeError> {
    use std::os::unix::fs::FileExt;
    let file: FileChunks = ferry_object::decode(&store.get(k)?)?;
    file.check()
        .map_err(|why| TreeError::Malformed(format!("{}: {why}", p.display())))?;
    let zeros = Kappa::of(&vec![0u8; FILE_CHUNK_SIZE as usize]);
    for (i, c) in file.chunks.iter().enumerate() {
        let len = file.chunk_len(i);
        if *c == zeros && len == u64::from(FILE_CHUNK_SIZE) {
            continue;
        }
        let bytes = store.get(c)?;
        if bytes.len() as u64 != len {
            return Err(TreeError::Malformed(format!(
                "{}: chunk {i} holds {} bytes, not {len}",
                p.display(),
                bytes.len()
            )));
        }
        f.write_all_at(&bytes, i as u64 * u64::from(FILE_CHUNK_SIZE))
            .map_err(io(p))?;
        if let Some(w) = written {
            w.fetch_add(len, Ordering::Relaxed);
        }
    }
    f.set_len(file.len).map_err(io(p))?;
    Ok(())
}

/// Stores the content of the open file `f`, which no path in the mounts names any more (the
/// guest deleted it, or renamed another file over it, while holding it open), as a tree with
/// the one entry [`UNNAMED_ENTRY`]: what [`ferry_object::FdState::unnamed`] holds. `what`
/// names the file in errors. Read through the handle, as stored files are: one blob up to
/// [`MAX_BLOB_FILE`], pieces beyond.
pub fn import_unnamed(store: &dyn Store, f: &fs::File, what: &str) -> Result<Kappa, TreeError> {
    use std::os::unix::fs::FileExt;
    let err = |e| TreeError::Io(what.to_owned(), e);
    let md = f.metadata().map_err(err)?;
    let len = md.len();
    if len > MAX_FILE {
        return Err(TreeError::TooLarge(what.to_owned(), len));
    }
    let (mode, object) = if len <= MAX_BLOB_FILE {
        let mut bytes = vec![0u8; len as usize];
        f.read_exact_at(&mut bytes, 0).map_err(err)?;
        (MODE_FILE, store.put(&bytes)?)
    } else {
        let sink = Sink::Store(store);
        match put_chunked(sink, f, Path::new(what), MAX_BLOB_FILE, None, None)? {
            (k, true) => (MODE_FILE_CHUNKS, k),
            (k, false) => (MODE_FILE, k),
        }
    };
    let (kind, v) = ferry_object::header::<Tree>();
    let mut tree = Tree {
        kind,
        v,
        entries: Default::default(),
    };
    tree.entries.insert(
        UNNAMED_ENTRY.to_owned(),
        TreeEntry {
            mode: mode.into(),
            object,
            mtime_ns: Some(mtime_ns(&md)),
        },
    );
    tree.v = Tree::version_for(&tree.entries);
    Ok(store.put(&ferry_object::encode(&tree))?)
}

/// A file no path names (`O_TMPFILE` in `dir`, else in the host's temporary directory),
/// open for reading and writing, holding the content [`import_unnamed`] stored as `k`.
pub fn open_unnamed(store: &dyn Store, k: &Kappa, dir: &Path) -> Result<fs::File, TreeError> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let what = Path::new("(a file deleted while open)");
    let tree: Tree = ferry_object::decode(&store.get(k)?)?;
    tree.check().map_err(TreeError::Malformed)?;
    let entry = match (tree.entries.len(), tree.entries.get(UNNAMED_ENTRY)) {
        (1, Some(e)) => e,
        _ => {
            return Err(TreeError::Malformed(format!(
                "the content of a file deleted while open is a tree of one entry \
                 `{UNNAMED_ENTRY}`, not of {:?}",
                tree.entries.keys().collect::<Vec<_>>()
            )));
        }
    };
    let open = |d: &Path| {
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE)
            .open(d)
    };
    let f = open(dir)
        .or_else(|_| open(&std::env::temp_dir()))
        .map_err(io(what))?;
    match entry.mode.as_str() {
        MODE_FILE | MODE_EXEC => {
            f.write_all_at(&store.get(&entry.object)?, 0)
                .map_err(io(what))?;
        }
        MODE_FILE_CHUNKS | MODE_EXEC_CHUNKS => {
            write_chunks_into(store, &entry.object, &f, what, None)?;
        }
        other => {
            return Err(TreeError::Malformed(format!(
                "the content of a file deleted while open is a `{other}` entry, not a file"
            )));
        }
    }
    if let Some(t) = entry.mtime_ns {
        set_mtime(&f, t).map_err(io(what))?;
    }
    Ok(f)
}
