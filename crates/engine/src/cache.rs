//! The machine-local cache of compiled code: one `<key>-ferry<version>.cwasm` file per
//! module the JIT compiled, and one `<key>-ferry<version>-guard<n>.iwasm` per module the
//! interpreter loaded (the module as it hands it to wasmi, see `interp.rs`), in one
//! directory. A cache, never the contract — any file may go at any time — so it is bounded:
//! a hit marks its file used (its modification time), and each new file evicts the least
//! recently used ones until the directory holds at most [`limit`] bytes.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// The extension of the interpreter's files.
pub(crate) const INTERP_EXT: &str = "iwasm";

/// Bytes of compiled code kept when `FERRY_CACHE_MAX_MB` does not say: 8 GiB (CPython 3.15
/// with numpy compiles to ~1.5 GB).
const DEFAULT_LIMIT: u64 = 8 << 30;

/// A temporary file this old was left by a compile that did not finish.
const STALE_TMP: Duration = Duration::from_secs(3600);

/// The most compiled code the cache keeps, in bytes: `FERRY_CACHE_MAX_MB`, else 8 GiB.
pub(crate) fn limit() -> u64 {
    std::env::var("FERRY_CACHE_MAX_MB")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_LIMIT, |mb| mb.saturating_mul(1 << 20))
}

/// Marks a cache file used now, so that eviction keeps it longest. A file that cannot be
/// touched is evicted earlier, nothing worse.
pub(crate) fn touch(p: &Path) {
    if let Ok(f) = std::fs::File::options().write(true).open(p) {
        let _ = f.set_modified(SystemTime::now());
    }
}

/// Writes `bytes` as the cache file `path` (through a temporary file and a rename, so a
/// reader never sees half of it), then evicts what is over [`limit`].
pub(crate) fn insert(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)?;
    if let Some(d) = path.parent() {
        evict(d, path, limit());
    }
    Ok(())
}

/// Deletes the least recently used `.cwasm` and `.iwasm` files of `dir` until the rest take
/// at most `limit` bytes — never `keep`, the file just written — and temporary files older
/// than an hour. A process still running code from a deleted file keeps its mapping.
fn evict(dir: &Path, keep: &Path, limit: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let now = SystemTime::now();
    let mut files: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        let Ok(meta) = e.metadata() else { continue };
        let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        let ext = p.extension().and_then(|x| x.to_str()).unwrap_or("");
        if ext == "cwasm" || ext == INTERP_EXT {
            files.push((modified, meta.len(), p));
        } else if ext.starts_with("tmp")
            && now.duration_since(modified).unwrap_or_default() > STALE_TMP
        {
            let _ = std::fs::remove_file(&p);
        }
    }
    let mut total: u64 = files.iter().map(|f| f.1).sum();
    files.sort();
    for (_, len, p) in files {
        if total <= limit {
            break;
        }
        if p != keep && std::fs::remove_file(&p).is_ok() {
            total -= len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_go_first_and_the_new_one_stays() {
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str, secs: u64, len: usize| {
            let p = dir.path().join(name);
            std::fs::write(&p, vec![0u8; len]).unwrap();
            let f = std::fs::File::options().write(true).open(&p).unwrap();
            f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
                .unwrap();
            p
        };
        let oldest = at("a-ferry0.1.0.cwasm", 1_000, 400);
        let used = at("b-ferry0.1.0.cwasm", 2_000, 400);
        let newer = at("c-ferry0.1.0.cwasm", 3_000, 400);
        let stale_tmp = at("d-ferry0.1.0.tmp77", 10, 10);
        let other = at("notes.txt", 10, 10_000);
        touch(&used);
        // The file just written is the oldest by its time, and still stays.
        let keep = at("e-ferry0.1.0.cwasm", 500, 400);
        evict(dir.path(), &keep, 1_000);
        let left = |p: &PathBuf| p.exists();
        assert!(left(&keep), "the new file stays");
        assert!(left(&used), "a file just used stays");
        assert!(
            !left(&oldest) && !left(&newer),
            "the least recently used go"
        );
        assert!(!left(&stale_tmp), "an old temporary file goes");
        assert!(left(&other), "only compiled code is counted and deleted");
        // Under the limit, nothing goes.
        evict(dir.path(), &keep, 1 << 20);
        assert!(left(&used) && left(&keep));
    }
}
