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
use crate::{Store, StoreError};

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
/// `progress` is called after each object with the bytes written so far.
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
    for k in objects {
        let bytes = store.get(k)?;
        // Compress when it saves at least an eighth (memory is often sparse or repetitive).
        let packed = zstd::bulk::compress(&bytes, 1)?;
        let (codec, body) = if packed.len() < bytes.len() - bytes.len() / 8 {
            (CODEC_ZSTD, packed.as_slice())
        } else {
            (CODEC_RAW, bytes.as_slice())
        };
        w.write_all(k.as_bytes())?;
        w.write_all(&[codec])?;
        w.write_all(&(bytes.len() as u64).to_le_bytes())?;
        w.write_all(&(body.len() as u64).to_le_bytes())?;
        w.write_all(body)?;
        stats.objects += 1;
        stats.bytes += bytes.len() as u64;
        progress(w.count);
    }
    let digest = w.hasher.finalize();
    w.write_all(END)?;
    w.inner.write_all(digest.as_bytes())?;
    w.flush()?;
    stats.stored_bytes = w.count + 32;
    Ok(stats)
}

fn read_array<const N: usize>(r: &mut impl Read) -> Result<[u8; N], CapsuleError> {
    let mut b = [0u8; N];
    r.read_exact(&mut b).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => CapsuleError::Corrupt("truncated".into()),
        _ => CapsuleError::Io(e),
    })?;
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

fn put_batch(store: &dyn Store, batch: &mut Staged) -> Result<(), StoreError> {
    if batch.bytes() > 0 {
        store.put_many(&batch.slices())?;
        batch.clear();
    }
    Ok(())
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
    // Block-aligned, so that the store writes it with direct I/O without copying it again;
    // its memory is reused batch after batch.
    let mut batch = Staged::default();
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
        let mut body = Vec::new();
        (&mut r).take(stored).read_to_end(&mut body)?;
        if body.len() as u64 != stored {
            return Err(CapsuleError::Corrupt("truncated".into()));
        }
        let bytes = match codec {
            CODEC_RAW if stored == len => body,
            CODEC_ZSTD => zstd::bulk::decompress(&body, len as usize)
                .map_err(|e| CapsuleError::Corrupt(format!("object {k}: {e}")))?,
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
        let actual = Kappa::of(&bytes);
        if actual != k {
            return Err(CapsuleError::Corrupt(format!(
                "object {k} hashes to {actual}"
            )));
        }
        if !store.has(&k)? {
            if bytes.len() == CHUNK {
                batch.push(&bytes);
                if batch.bytes() >= BATCH_BYTES {
                    put_batch(store, &mut batch)?;
                }
            } else {
                store.put(&bytes)?;
            }
            stats.new_objects += 1;
        }
        stats.objects += 1;
        stats.bytes += len;
        progress(r.count);
    }
    put_batch(store, &mut batch)?;
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
