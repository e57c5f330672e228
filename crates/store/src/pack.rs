//! Pack files: many small objects (memory chunks) written as one file per batch.
//!
//! A snapshot of a 1 GiB guest has 16,384 chunks; one file each costs seconds of file-system
//! metadata work. [`crate::Store::put_many`] on an [`crate::FsStore`] instead appends the new
//! objects of a batch to one pack and writes an index beside it:
//!
//! * `packs/<id>.pack` — `FERRYPCK` + `u32` version (1), then the stored bytes back to back
//!   (a pack written with direct I/O pads its header with zeros to 4096 bytes, so every
//!   object of 4 KiB multiples starts on a block boundary; readers only follow the index);
//! * `packs/<id>.idx`  — `FERRYIDX` + `u32` version (1) + `u32` count, then `count` entries
//!   sorted by κ: `[32-byte κ][u64 offset][u32 stored length][u32 length][u8 codec]`
//!   (little-endian; codec 0 = raw, 1 = zstd — compression never changes κ, which is the hash
//!   of the uncompressed bytes).
//!
//! Both are written to `tmp/` and renamed, the pack before its index, so an index never names
//! a missing pack. Every object read from a pack is re-hashed like a loose object. Index
//! files are bounded when read (count must match the file size; offsets must lie within the
//! pack; lengths are limited).

use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ferry_kappa::Kappa;

use crate::StoreError;

const PACK_MAGIC: &[u8; 8] = b"FERRYPCK";
const IDX_MAGIC: &[u8; 8] = b"FERRYIDX";
const VERSION: u32 = 1;
const ENTRY: usize = 32 + 8 + 4 + 4 + 1;
/// Largest object a pack entry may describe (uncompressed).
const MAX_OBJECT: u32 = 1 << 30;
/// Header of a pack: magic + version.
pub(crate) const PACK_HEADER: u64 = 12;

/// One object's place in a pack.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    pub pack: PathBuf,
    pub offset: u64,
    /// Bytes in the pack.
    pub stored: u32,
    /// Bytes of the object.
    pub len: u32,
    pub zstd: bool,
}

/// An object to pack: κ, the bytes to store, the object's length, whether they are zstd.
pub(crate) type Packable<'a> = (Kappa, &'a [u8], u32, bool);

/// One entry of an index: κ, offset, stored length, object length, zstd.
pub(crate) type Entry = (Kappa, u64, u32, u32, bool);

/// A pack's header: magic and version, zero-padded to `data_start` bytes (at least
/// [`PACK_HEADER`]), where its first object starts.
pub(crate) fn header(data_start: u64) -> Vec<u8> {
    debug_assert!(data_start >= PACK_HEADER);
    let mut header = vec![0; data_start as usize];
    header[..8].copy_from_slice(PACK_MAGIC);
    header[8..12].copy_from_slice(&VERSION.to_le_bytes());
    header
}

/// Lays out a pack for `objects` (κ unique) whose first object starts at `data_start` (at
/// least [`PACK_HEADER`]; the bytes between are zero): returns the pack's header (padding
/// included), its index bytes and its total length. The pack file is the header followed by
/// the stored bytes in the given order, so large batches are written without being copied
/// into one buffer.
pub(crate) fn layout(objects: &[Packable<'_>], data_start: u64) -> (Vec<u8>, Vec<u8>, u64) {
    let header = header(data_start);
    let mut entries: Vec<Entry> = Vec::with_capacity(objects.len());
    let mut at = data_start;
    for (k, b, len, zstd) in objects {
        entries.push((*k, at, b.len() as u32, *len, *zstd));
        at += b.len() as u64;
    }
    (header, encode_index(entries), at)
}

/// An index listing `entries` (κ unique), sorted by κ.
pub(crate) fn encode_index(mut entries: Vec<Entry>) -> Vec<u8> {
    entries.sort_by_key(|e| e.0);
    let mut idx = Vec::with_capacity(16 + entries.len() * ENTRY);
    idx.extend_from_slice(IDX_MAGIC);
    idx.extend_from_slice(&VERSION.to_le_bytes());
    idx.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (k, off, stored, len, zstd) in entries {
        idx.extend_from_slice(k.as_bytes());
        idx.extend_from_slice(&off.to_le_bytes());
        idx.extend_from_slice(&stored.to_le_bytes());
        idx.extend_from_slice(&len.to_le_bytes());
        idx.push(u8::from(zstd));
    }
    idx
}

/// Reads an index; `pack_len` bounds every entry.
pub(crate) fn decode_index(
    idx_path: &Path,
    bytes: &[u8],
    pack_len: u64,
) -> Result<Vec<Entry>, StoreError> {
    let bad = |why: &str| StoreError::BadPack(format!("{}: {why}", idx_path.display()));
    if bytes.len() < 16 || &bytes[..8] != IDX_MAGIC {
        return Err(bad("not a ferry pack index"));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(bad(&format!(
            "index version {version}, this ferry reads {VERSION}"
        )));
    }
    let count = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
    if bytes.len() != 16 + count * ENTRY {
        return Err(bad("length does not match its entry count"));
    }
    let mut out = Vec::with_capacity(count);
    for e in bytes[16..].chunks_exact(ENTRY) {
        let k = Kappa::from_bytes(e[..32].try_into().expect("32 bytes"));
        let off = u64::from_le_bytes(e[32..40].try_into().expect("8 bytes"));
        let stored = u32::from_le_bytes(e[40..44].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(e[44..48].try_into().expect("4 bytes"));
        let zstd = match e[48] {
            0 => false,
            1 => true,
            c => return Err(bad(&format!("unknown codec {c}"))),
        };
        if off < PACK_HEADER
            || off
                .checked_add(u64::from(stored))
                .is_none_or(|end| end > pack_len)
        {
            return Err(bad("entry outside its pack"));
        }
        if len > MAX_OBJECT || (!zstd && stored != len) {
            return Err(bad("entry length is inconsistent"));
        }
        out.push((k, off, stored, len, zstd));
    }
    Ok(out)
}

/// Reads one slot into `out` (which must be `slot.len` long), decompressing if needed.
pub(crate) fn read(slot: &Slot, out: &mut [u8]) -> Result<(), StoreError> {
    let f = File::open(&slot.pack).map_err(StoreError::io("open", &slot.pack))?;
    if !slot.zstd {
        return f
            .read_exact_at(out, slot.offset)
            .map_err(StoreError::io("read", &slot.pack));
    }
    let mut stored = vec![0; slot.stored as usize];
    f.read_exact_at(&mut stored, slot.offset)
        .map_err(StoreError::io("read", &slot.pack))?;
    let damaged = |why: String| StoreError::BadPack(format!("{}: {why}", slot.pack.display()));
    let n = zstd::bulk::decompress_to_buffer(&stored, out).map_err(|e| damaged(e.to_string()))?;
    if n != out.len() {
        return Err(damaged(format!(
            "object decompressed to {n} bytes, not {}",
            out.len()
        )));
    }
    Ok(())
}

/// Every `(index path, pack path)` under `dir`.
pub(crate) fn list(dir: &Path) -> Result<Vec<(PathBuf, PathBuf)>, StoreError> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).map_err(StoreError::io("list", dir))? {
        let p = e.map_err(StoreError::io("list", dir))?.path();
        if p.extension().is_some_and(|x| x == "idx") {
            let pack = p.with_extension("pack");
            out.push((p, pack));
        }
    }
    out.sort();
    Ok(out)
}
