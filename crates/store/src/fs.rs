//! The embedded on-disk store.
//!
//! Layout under the root: `objects/<first 2 hex>/<other 62 hex>` (one file per object),
//! `refs/<name>` (text: `<epoch> blake3:<hex>`), `tmp/` for writes in progress, `refs.lock`.
//! Writes go to a temp file in `tmp/` and are renamed into place, so a failed write (a full
//! disk) never leaves a partial object under its κ. Durability is batched: [`Store::sync`]
//! (`syncfs`) runs once per snapshot before its ref is updated; an object torn by a power loss
//! before that would fail verification on read (its bytes no longer hash to κ) and is never
//! used. Refs are written and synced individually. Objects are immutable once written.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_kappa::Kappa;

use crate::{RefValue, Store, StoreError, check_ref_name};

/// On-disk store rooted at a directory.
#[derive(Debug)]
pub struct FsStore {
    root: PathBuf,
    /// Objects written since the last [`Store::sync`].
    unsynced: std::sync::Mutex<Vec<PathBuf>>,
    /// Fault injection: new objects that may still be written before every write fails
    /// with "no space left on device" (`u64::MAX` = no fault).
    writes_left: AtomicU64,
}

/// Up to this many new objects, `sync` fsyncs each one (and its directory); beyond, one
/// `syncfs` of the whole file system is cheaper.
const FSYNC_EACH_MAX: usize = 64;

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl FsStore {
    /// Opens (creating if needed) a store at `root`.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let root = root.into();
        for sub in ["objects", "refs", "tmp"] {
            let p = root.join(sub);
            fs::create_dir_all(&p).map_err(StoreError::io("create store directory", &p))?;
        }
        Ok(Self {
            root,
            unsynced: Default::default(),
            writes_left: AtomicU64::new(u64::MAX),
        })
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
        let tmp = self.root.join("tmp").join(format!(
            "{}-{}.tmp",
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let result = (|| {
            let mut f = File::create(&tmp).map_err(StoreError::io("create", &tmp))?;
            f.write_all(bytes).map_err(StoreError::io("write", &tmp))?;
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
        let dest = self.object_path(&k);
        if dest.exists() {
            return Ok(k);
        }
        let left = self.writes_left.load(Ordering::SeqCst);
        if left == 0 {
            return Err(StoreError::io("write", &dest)(
                std::io::Error::from_raw_os_error(libc::ENOSPC),
            ));
        }
        if left != u64::MAX {
            self.writes_left.store(left - 1, Ordering::SeqCst);
        }
        self.write_atomic(&dest, bytes, false)?;
        self.unsynced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(dest);
        Ok(k)
    }

    fn get(&self, kappa: &Kappa) -> Result<Vec<u8>, StoreError> {
        let p = self.object_path(kappa);
        let bytes = match fs::read(&p) {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::NotFound => return Err(StoreError::NotFound(*kappa)),
            Err(e) => return Err(StoreError::io("read", &p)(e)),
        };
        let actual = Kappa::of(&bytes);
        if actual != *kappa {
            return Err(StoreError::Corrupt {
                kappa: *kappa,
                actual,
                where_: p.display().to_string(),
            });
        }
        Ok(bytes)
    }

    fn has(&self, kappa: &Kappa) -> Result<bool, StoreError> {
        Ok(self.object_path(kappa).exists())
    }

    fn list(&self) -> Result<Vec<Kappa>, StoreError> {
        let objects = self.root.join("objects");
        let mut out = Vec::new();
        for dir in fs::read_dir(&objects).map_err(StoreError::io("list", &objects))? {
            let dir = dir.map_err(StoreError::io("list", &objects))?;
            let prefix = dir.file_name().to_string_lossy().into_owned();
            for f in fs::read_dir(dir.path()).map_err(StoreError::io("list", dir.path()))? {
                let f = f.map_err(StoreError::io("list", dir.path()))?;
                let name = format!(
                    "{}{prefix}{}",
                    Kappa::PREFIX,
                    f.file_name().to_string_lossy()
                );
                if let Ok(k) = name.parse() {
                    out.push(k);
                }
            }
        }
        out.sort();
        Ok(out)
    }

    fn remove(&self, kappa: &Kappa) -> Result<(), StoreError> {
        let p = self.object_path(kappa);
        match fs::remove_file(&p) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(StoreError::io("remove", &p)(e)),
            _ => Ok(()),
        }
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
        if current != expected {
            return Err(StoreError::CasMismatch {
                name: name.to_owned(),
                expected: format!("{expected:?}"),
                found: format!("{current:?}"),
            });
        }
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

    fn sync(&self) -> Result<(), StoreError> {
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
