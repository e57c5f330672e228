//! Content stores: `κ → bytes`, plus a small table of refs updated by compare-and-swap.
//!
//! # Contract (every implementation, checked by the same tests for each)
//! * `put` stores bytes under `κ = BLAKE3(bytes)` and returns κ; storing what is already there
//!   is a success and changes nothing. A `put` either completes or leaves no trace under κ.
//! * `get` returns exactly the bytes whose hash is κ, or an error: bytes that do not re-hash to
//!   κ are reported as [`StoreError::Corrupt`], never returned.
//! * Refs name a current root (`session/<id>`) with an epoch; `cas_ref` replaces a ref only if
//!   it still has the expected value, so two writers can never both win.
//!
//! [`MemStore`] is the reference implementation; [`FsStore`] is the embedded on-disk default.

pub mod batch;
pub mod capsule;
mod error;
mod fs;
mod mem;
mod pack;

pub use error::StoreError;
pub use fs::{FsStore, Housekeeping};
pub use mem::MemStore;

use std::path::{Path, PathBuf};

use ferry_kappa::Kappa;

/// Writes `bytes` at `path` atomically and durably: a temporary file beside it (`path` with
/// the extension `tmp`), `fsync`, rename over `path`, `fsync` of the directory. A crash
/// leaves the old file or the new one, never a torn one.
pub fn write_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// What [`Store::compact`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Compacted {
    /// Files rewritten without their removed objects, or deleted.
    pub files: usize,
    /// Bytes the store takes less on disk.
    pub freed: u64,
}

/// A ref's value: which root is current, and the epoch that fences older writers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefValue {
    pub epoch: u64,
    pub target: Kappa,
}

/// An object's bytes in a file: see [`Store::stored_at`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub file: PathBuf,
    pub offset: u64,
    pub len: u32,
}

/// A content-addressed object store with refs.
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Stores `bytes`, returning their κ.
    fn put(&self, bytes: &[u8]) -> Result<Kappa, StoreError>;
    /// Returns the bytes of κ, verified.
    fn get(&self, kappa: &Kappa) -> Result<Vec<u8>, StoreError>;
    /// Whether κ is present (not verified).
    fn has(&self, kappa: &Kappa) -> Result<bool, StoreError>;
    /// Every κ present.
    fn list(&self) -> Result<Vec<Kappa>, StoreError>;
    /// Deletes κ (used by garbage collection). Deleting an absent κ is a success.
    fn remove(&self, kappa: &Kappa) -> Result<(), StoreError>;
    /// Reads a ref.
    fn get_ref(&self, name: &str) -> Result<Option<RefValue>, StoreError>;
    /// Sets a ref to `new` (or deletes it) if it currently equals `expected`.
    fn cas_ref(
        &self,
        name: &str,
        expected: Option<RefValue>,
        new: Option<RefValue>,
    ) -> Result<(), StoreError>;
    /// Every ref.
    fn list_refs(&self) -> Result<Vec<(String, RefValue)>, StoreError>;
    /// Stores many blobs at once (memory chunks); same contract as [`Store::put`] for each.
    /// Stores may hash in parallel and write the new ones together.
    fn put_many(&self, blobs: &[&[u8]]) -> Result<Vec<Kappa>, StoreError> {
        blobs.iter().map(|b| self.put(b)).collect()
    }
    /// [`Store::put_many`] for objects already hashed (received ones, checked against the
    /// κ they were sent under): stores need not hash them again.
    fn put_hashed(&self, objects: &[Hashed<'_>]) -> Result<(), StoreError> {
        let blobs: Vec<&[u8]> = objects.iter().map(|o| o.bytes).collect();
        self.put_many(&blobs).map(drop)
    }
    /// Reads κ into `out`, verified; `out` must have the object's exact length.
    fn read_into(&self, kappa: &Kappa, out: &mut [u8]) -> Result<(), StoreError> {
        copy_exact(kappa, &self.get(kappa)?, out)
    }
    /// Where κ's bytes lie as they are (not compressed) in a file the store never writes
    /// again, so a reader may map them instead of copying them. `None` when they are stored
    /// otherwise (or not at all). Nothing is verified: whoever maps the bytes must hash them.
    fn stored_at(&self, kappa: &Kappa) -> Option<Location> {
        let _ = kappa;
        None
    }
    /// The length of κ's bytes, if the store knows it without reading them. Not verified:
    /// for progress, never for a decision.
    fn len_of(&self, kappa: &Kappa) -> Option<u64> {
        let _ = kappa;
        None
    }
    /// Re-hashes κ's stored bytes without keeping them: `Ok` exactly when [`Store::get`] would
    /// succeed (the same `NotFound` and `Corrupt` errors otherwise).
    fn check(&self, kappa: &Kappa) -> Result<(), StoreError> {
        self.get(kappa).map(drop)
    }
    /// Damage found while opening the store (unreadable pack files), for `verify`.
    fn problems(&self) -> Vec<String> {
        Vec::new()
    }
    /// A host-local cache file kept beside the store (never an object, never sent anywhere):
    /// its bytes, if there is one named `name` (`[a-z-]+`). Stores without a place for such
    /// files have none.
    fn load_cache(&self, name: &str) -> Option<Vec<u8>> {
        let _ = name;
        None
    }
    /// Replaces cache file `name` (see [`Store::load_cache`]); not made durable — losing it
    /// only costs a re-read.
    fn save_cache(&self, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
        let _ = (name, bytes);
        Ok(())
    }
    /// Reclaims the space of removed objects that share a file with live ones (an
    /// [`FsStore`]'s packs), after [`Store::remove`]s, copying at most about `budget` bytes
    /// of live objects (at least one object) — what is left waits for a later call. Like
    /// `remove`, for a caller that has the store to itself. Stores that keep each object on
    /// its own have nothing to do.
    fn compact(&self, budget: u64) -> Result<Compacted, StoreError> {
        let _ = budget;
        Ok(Compacted::default())
    }
    /// Makes every completed `put` durable (objects are written without a sync each, so a
    /// snapshot of many chunks pays for one sync, not thousands).
    fn sync(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Finds the one κ that starts with `prefix` (hex digits, `blake3:` optional).
    fn resolve(&self, prefix: &str) -> Result<Kappa, StoreError> {
        if let Ok(k) = prefix.parse::<Kappa>() {
            return Ok(k);
        }
        let hex = prefix.strip_prefix(Kappa::PREFIX).unwrap_or(prefix);
        if hex.len() < 4 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(StoreError::BadPrefix(prefix.to_owned()));
        }
        let found: Vec<Kappa> = self
            .list()?
            .into_iter()
            .filter(|k| k.matches_prefix(hex))
            .collect();
        match found.as_slice() {
            [k] => Ok(*k),
            [] => Err(StoreError::NoMatch(prefix.to_owned())),
            _ => Err(StoreError::Ambiguous(prefix.to_owned(), found.len())),
        }
    }
}

/// Hashes blobs on up to four threads, keeping their order.
pub fn hash_all(blobs: &[&[u8]]) -> Vec<Kappa> {
    in_parallel(blobs, |b| Kappa::of(b))
}

/// `f` of each item on up to four threads (one for fewer than 64 items), keeping the order.
fn in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(4);
    if threads < 2 || items.len() < 64 {
        return items.iter().map(f).collect();
    }
    let per = items.len().div_ceil(threads);
    let f = &f;
    std::thread::scope(|s| {
        let parts: Vec<_> = items
            .chunks(per)
            .map(|part| s.spawn(move || part.iter().map(f).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .flat_map(|h| h.join().expect("hashing thread"))
            .collect()
    })
}

/// Bytes together with their κ, which can only be had by hashing them ([`Hashed::all`],
/// [`Hashed::check_all`]): a store given these ([`Store::put_hashed`]) need not hash again.
#[derive(Debug, Clone, Copy)]
pub struct Hashed<'a> {
    kappa: Kappa,
    bytes: &'a [u8],
}

impl<'a> Hashed<'a> {
    pub fn kappa(&self) -> Kappa {
        self.kappa
    }

    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Hashes one blob, on this thread.
    pub fn one(bytes: &'a [u8]) -> Self {
        Self {
            kappa: Kappa::of(bytes),
            bytes,
        }
    }

    /// Hashes each blob (on up to four threads).
    pub fn all(blobs: &[&'a [u8]]) -> Vec<Self> {
        in_parallel(blobs, |b| Self {
            kappa: Kappa::of(b),
            bytes: b,
        })
    }

    /// Checks that each object hashes to the κ it came with (on up to four threads); the
    /// first that does not is [`StoreError::Corrupt`], found at `where_`.
    pub fn check_all(claimed: &[(Kappa, &'a [u8])], where_: &str) -> Result<Vec<Self>, StoreError> {
        in_parallel(claimed, |(k, b)| {
            StoreError::check_actual(k, Kappa::of(b), || where_.to_owned()).map(|()| Self {
                kappa: *k,
                bytes: b,
            })
        })
        .into_iter()
        .collect()
    }
}

/// Copies an object's bytes into `out`, which must have exactly their length.
pub(crate) fn copy_exact(kappa: &Kappa, bytes: &[u8], out: &mut [u8]) -> Result<(), StoreError> {
    if bytes.len() != out.len() {
        return Err(StoreError::WrongLength {
            kappa: *kappa,
            expected: out.len(),
            actual: bytes.len(),
        });
    }
    out.copy_from_slice(bytes);
    Ok(())
}

/// The compare of compare-and-swap, shared by every store.
pub(crate) fn check_cas(
    name: &str,
    expected: Option<RefValue>,
    current: Option<RefValue>,
) -> Result<(), StoreError> {
    if current != expected {
        return Err(StoreError::CasMismatch {
            name: name.to_owned(),
            expected: format!("{expected:?}"),
            found: format!("{current:?}"),
        });
    }
    Ok(())
}

/// Checks a ref name: `[A-Za-z0-9._-]` segments separated by `/`, no `..`.
pub fn check_ref_name(name: &str) -> Result<(), StoreError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name.split('/').all(|seg| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        });
    if ok {
        Ok(())
    } else {
        Err(StoreError::BadRefName(name.to_owned()))
    }
}

#[cfg(test)]
mod tests;
