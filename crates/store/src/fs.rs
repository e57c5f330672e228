//! The embedded on-disk store.
//!
//! Layout under the root: `objects/<first 2 hex>/<other 62 hex>` (one file per object),
//! `packs/<id>.{pack,idx}` (objects written together by `put_many`, see [`crate::pack`]),
//! `refs/<name>` (text: `<epoch> blake3:<hex>`), `tmp/` for writes in progress, `refs.lock`.
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
    /// Objects held in packs, and how many live objects each pack still holds.
    packed: std::sync::RwLock<Packed>,
}

#[derive(Debug, Default)]
struct Packed {
    slots: HashMap<Kappa, Slot>,
    live: HashMap<PathBuf, usize>,
    damaged: Vec<String>,
}

impl Packed {
    fn add(&mut self, pack: &Path, entries: Vec<pack::Entry>) {
        *self.live.entry(pack.to_path_buf()).or_default() += entries.len();
        for (k, offset, stored, len, zstd) in entries {
            self.slots.insert(
                k,
                Slot {
                    pack: pack.to_path_buf(),
                    offset,
                    stored,
                    len,
                    zstd,
                },
            );
        }
    }
}

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

impl FsStore {
    /// Opens (creating if needed) a store at `root`.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let root = root.into();
        for sub in ["objects", "refs", "tmp", "packs"] {
            let p = root.join(sub);
            fs::create_dir_all(&p).map_err(StoreError::io("create store directory", &p))?;
        }
        Ok(Self {
            root,
            unsynced: Default::default(),
            writes_left: AtomicU64::new(u64::MAX),
            packed: Default::default(),
            durable: true,
            zstd: None,
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

    fn verify(kappa: &Kappa, bytes: &[u8], where_: &Path) -> Result<(), StoreError> {
        let actual = Kappa::of(bytes);
        if actual != *kappa {
            return Err(StoreError::Corrupt {
                kappa: *kappa,
                actual,
                where_: where_.display().to_string(),
            });
        }
        Ok(())
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

    /// Fault injection for tests: after `n` more new objects, every write fails as if the disk
    /// were full.
    pub fn fail_writes_after(&self, n: u64) {
        self.writes_left.store(n, Ordering::SeqCst);
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the object κ lives.
    pub fn object_path(&self, kappa: &Kappa) -> PathBuf {
        let hex = kappa.to_hex();
        self.root.join("objects").join(&hex[..2]).join(&hex[2..])
    }

    fn ref_path(&self, name: &str) -> PathBuf {
        self.root.join("refs").join(name)
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
        let tmp = self.root.join("tmp").join(format!(
            "{}-{}.tmp",
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let result = (|| {
            let mut f = File::create(&tmp).map_err(StoreError::io("create", &tmp))?;
            for part in parts {
                f.write_all(part).map_err(StoreError::io("write", &tmp))?;
            }
            if sync {
                f.sync_data().map_err(StoreError::io("sync", &tmp))?;
            }
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

    fn lock_refs(&self) -> Result<File, StoreError> {
        let p = self.root.join("refs.lock");
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(StoreError::io("open", &p))?;
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
        let slot = self
            .packed()
            .slots
            .get(kappa)
            .cloned()
            .ok_or(StoreError::NotFound(*kappa))?;
        let mut b = vec![0; slot.len as usize];
        pack::read(&slot, &mut b)?;
        Self::verify(kappa, &b, &slot.pack)?;
        Ok(b)
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
        pack::read(&slot, out)?;
        Self::verify(kappa, out, &slot.pack)
    }

    fn put_many(&self, blobs: &[&[u8]]) -> Result<Vec<Kappa>, StoreError> {
        let ks = hash_all(blobs);
        let mut seen = BTreeSet::new();
        let new: Vec<(Kappa, &[u8])> = ks
            .iter()
            .zip(blobs)
            .filter(|(k, _)| !self.has(k).unwrap_or(false))
            .filter(|(k, _)| seen.insert(**k))
            .map(|(k, b)| (*k, *b))
            .collect();
        if new.is_empty() {
            return Ok(ks);
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
        let (header, idx_bytes, pack_len) = pack::layout(&objects);
        let id = Kappa::of(&idx_bytes).to_hex();
        let dir = self.root.join("packs");
        let pack_path = dir.join(format!("{}.pack", &id[..24]));
        let idx_path = dir.join(format!("{}.idx", &id[..24]));
        self.take_writes(new.len() as u64, &pack_path)?;
        let parts: Vec<&[u8]> = std::iter::once(header.as_slice())
            .chain(objects.iter().map(|o| o.1))
            .collect();
        self.write_parts_atomic(&pack_path, &parts, false)?;
        self.write_atomic(&idx_path, &idx_bytes, false)?;
        self.unsynced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend([pack_path.clone(), idx_path]);
        let entries = pack::decode_index(&dir, &idx_bytes, pack_len)?;
        self.packed_mut().add(&pack_path, entries);
        Ok(ks)
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
                remove_if_present(&slot.pack)?;
                remove_if_present(&slot.pack.with_extension("idx"))?;
            }
        }
        drop(packed);
        let p = self.object_path(kappa);
        remove_if_present(&p)?;
        remove_if_present(&zst_path(&p))
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
