//! Batches of object entries, each `[32] κ, u8 codec (0 raw, 1 zstd), u64 length, u64 stored
//! length, stored bytes` (little-endian): the body of a space's `POST /v1/objects` and of its
//! answer to `POST /v1/objects/fetch` (docs/api.md), and the objects of a capsule
//! ([`crate::capsule`]). [`Encoder`] writes entries, reading objects straight from a store's
//! packs; [`decode`] and [`Batch::verify`] read a batch received.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;

use crate::{Hashed, Store, StoreError};
use ferry_kappa::Kappa;

/// Largest object a batch carries (as a capsule: a big instrumented module is ~100 MB).
pub const MAX_OBJECT: usize = 1 << 30;
/// Objects are sent in batches of about this many bytes (before compression).
pub const BATCH_BYTES: usize = 16 << 20;

/// Batch buffers kept for reuse: at most this many (what two batches in flight use at each
/// end), each of at most [`KEPT`] bytes.
const POOLED: usize = 6;
const KEPT: usize = 64 << 20;

static POOL: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

/// An empty buffer for a batch, one used before when there is one: memory the process has
/// not touched before costs far more than filling it (on some VMs ~3 s per GiB to fault
/// in), and a batch is 16 MiB.
pub fn buffer() -> Vec<u8> {
    POOL.lock()
        .unwrap_or_else(|p| p.into_inner())
        .pop()
        .unwrap_or_default()
}

/// Returns a buffer from [`buffer`] for the next batch.
pub fn give_back(mut b: Vec<u8>) {
    if b.capacity() == 0 || b.capacity() > KEPT {
        return;
    }
    b.clear();
    let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
    if pool.len() < POOLED {
        pool.push(b);
    }
}

/// A buffer that goes back to the pool when dropped: the body of an answer, given back once
/// it is sent.
pub struct Pooled(pub Vec<u8>);

impl std::fmt::Debug for Pooled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pooled({} bytes)", self.0.len())
    }
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.0));
    }
}

/// Objects of at most this size are compressed whole; larger ones only when a sample of
/// theirs compresses (random memory, the bulk of many snapshots, does not: compressing a GiB
/// of it only to find that took as long as hashing it).
const WHOLE: usize = 16 << 10;
/// The sample: this many windows of [`WINDOW`] bytes spread evenly over the object.
const WINDOWS: usize = 8;
const WINDOW: usize = 512;

/// `todo` cut into batches of about [`BATCH_BYTES`] by the objects' stored lengths (an object
/// not in a pack counted as a 64 KiB chunk), the first `leading` in batches of their own.
pub fn groups<'a>(local: &dyn Store, todo: &'a [Kappa], leading: usize) -> Vec<&'a [Kappa]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, k) in todo.iter().enumerate() {
        bytes += local.stored_at(k).map_or(64 << 10, |l| l.len as usize);
        if bytes >= BATCH_BYTES || i + 1 == todo.len() || i + 1 == leading {
            out.push(&todo[start..=i]);
            (start, bytes) = (i + 1, 0);
        }
    }
    out
}

/// Builds batches, keeping one compression context (making one per object took a tenth of a
/// push's time) and the pack files it reads open.
pub struct Encoder {
    zstd: zstd::bulk::Compressor<'static>,
    sample: Vec<u8>,
    files: HashMap<PathBuf, std::fs::File>,
    /// The same packs opened for direct I/O, and the memory runs are read into.
    direct_files: HashMap<PathBuf, std::fs::File>,
    scratch: Vec<u8>,
    /// Whether to read runs with direct I/O (until a file system refuses it).
    direct: bool,
    /// Whether objects read straight from packs are hashed and checked too.
    verify: bool,
    /// Whether objects may be compressed (not for a client that cannot decompress zstd).
    compress: bool,
}

impl Default for Encoder {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("direct", &self.direct)
            .field("verify", &self.verify)
            .finish_non_exhaustive()
    }
}

impl Encoder {
    pub fn new() -> Self {
        Self {
            zstd: zstd::bulk::Compressor::new(1).expect("zstd level 1"),
            sample: Vec::with_capacity(WINDOWS * WINDOW),
            files: HashMap::new(),
            direct_files: HashMap::new(),
            scratch: buffer(),
            direct: true,
            verify: false,
            compress: true,
        }
    }

    /// This encoder, writing every object raw (codec 0): for a reader without zstd (the
    /// JavaScript space in a browser or Node).
    pub fn uncompressed(mut self) -> Self {
        self.compress = false;
        self
    }

    /// An encoder that also checks every object it reads straight from a pack against its κ
    /// ([`StoreError::Corrupt`] if one does not match): for entries nobody re-hashes on
    /// receipt before it matters (a capsule is checked only on another machine, perhaps much
    /// later).
    pub fn verifying() -> Self {
        let mut e = Self::new();
        e.verify = true;
        e
    }

    /// Appends objects `ks` of `store` to a batch, as [`Encoder::push_stored`] would one by
    /// one, but reading each run of them that lies back to back in a pack written with
    /// direct I/O (a snapshot's memory chunks, in memory order) with one direct read: no page
    /// cache to fill (fresh memory is what costs most on some VMs), and reads of up to
    /// [`RUN`] bytes instead of 64 KiB ones. Returns the objects' bytes in all.
    pub fn push_many_stored(
        &mut self,
        out: &mut Vec<u8>,
        ks: &[Kappa],
        store: &dyn Store,
    ) -> Result<u64, StoreError> {
        let locs: Vec<Option<crate::Location>> = ks.iter().map(|k| store.stored_at(k)).collect();
        let mut total = 0;
        let mut i = 0;
        while i < ks.len() {
            let run = if self.direct {
                direct_run(&locs[i..])
            } else {
                0
            };
            if run > 0 {
                let first = locs[i].as_ref().expect("a run starts at a packed object");
                let len: usize = locs[i..i + run]
                    .iter()
                    .map(|l| l.as_ref().map_or(0, |l| l.len as usize))
                    .sum();
                let mut scratch = std::mem::take(&mut self.scratch);
                let read = self.read_direct(&first.file, first.offset, len, &mut scratch);
                if let Some(range) = read {
                    let data = &scratch[range];
                    if self.verify {
                        // On this thread: an export reads on two of them already.
                        let mut at = 0;
                        for (k, l) in ks[i..i + run].iter().zip(&locs[i..i + run]) {
                            let l = l.as_ref().map_or(0, |l| l.len as usize);
                            let checked = StoreError::check_hash(k, &data[at..at + l], || {
                                format!(
                                    "{}, offset {}",
                                    first.file.display(),
                                    first.offset + at as u64
                                )
                            });
                            if let Err(e) = checked {
                                self.scratch = scratch;
                                return Err(e);
                            }
                            at += l;
                        }
                    }
                    let mut at = 0;
                    for (k, l) in ks[i..i + run].iter().zip(&locs[i..i + run]) {
                        let l = l.as_ref().map_or(0, |l| l.len as usize);
                        self.push(out, k, &data[at..at + l]);
                        at += l;
                    }
                    self.scratch = scratch;
                    total += len as u64;
                    i += run;
                    continue;
                }
                self.scratch = scratch;
            }
            total += self.push_stored(out, &ks[i], locs[i].as_ref(), store)?;
            i += 1;
        }
        Ok(total)
    }

    /// Pack `file`, opened for ordinary reads (kept open).
    fn opened(&mut self, file: &std::path::Path) -> std::io::Result<&std::fs::File> {
        kept_open(&mut self.files, file, 0)
    }

    /// Reads `len` bytes at `offset` of `file` into block-aligned memory in `scratch` — copied
    /// from the page cache if all are there, else with direct I/O — returning where they
    /// are; `None` when that did not work (the objects are then read one by one the ordinary
    /// way; a file system that refuses direct I/O is not asked again).
    fn read_direct(
        &mut self,
        file: &std::path::Path,
        offset: u64,
        len: usize,
        scratch: &mut Vec<u8>,
    ) -> Option<std::ops::Range<usize>> {
        let refused = |e: &std::io::Error| e.raw_os_error() == Some(libc::EINVAL);
        if scratch.len() < len + ALIGN {
            scratch.resize(len + ALIGN, 0);
        }
        let start = scratch.as_ptr().align_offset(ALIGN);
        let range = start..start + len;
        // Already in the page cache (read lately): copied from there, the disk left alone.
        if let Ok(f) = self.opened(file)
            && all_cached(f, offset, len)
            && std::os::unix::fs::FileExt::read_exact_at(f, &mut scratch[range.clone()], offset)
                .is_ok()
        {
            return Some(range);
        }
        let f = match kept_open(&mut self.direct_files, file, libc::O_DIRECT) {
            Ok(f) => f,
            Err(e) => {
                self.direct &= !refused(&e);
                return None;
            }
        };
        match std::os::unix::fs::FileExt::read_exact_at(f, &mut scratch[range.clone()], offset) {
            Ok(()) => Some(range),
            Err(e) => {
                self.direct &= !refused(&e);
                self.direct_files.remove(file);
                None
            }
        }
    }

    /// Whether compressing `bytes` looks worth it: small objects are tried whole, larger
    /// ones by a sample of evenly spread windows.
    fn worth_trying(&mut self, bytes: &[u8]) -> bool {
        if bytes.len() <= WHOLE {
            return true;
        }
        self.sample.clear();
        let step = bytes.len() / WINDOWS;
        for i in 0..WINDOWS {
            self.sample
                .extend_from_slice(&bytes[i * step..][..WINDOW.min(step)]);
        }
        let sample = std::mem::take(&mut self.sample);
        let packed = self.zstd.compress(&sample).unwrap_or_default();
        let worth = !packed.is_empty() && packed.len() < sample.len() - sample.len() / 8;
        self.sample = sample;
        worth
    }

    /// `bytes` compressed, if that saves at least an eighth.
    fn compressed(&mut self, bytes: &[u8]) -> Option<Vec<u8>> {
        if !self.compress || !self.worth_trying(bytes) {
            return None;
        }
        let packed = self.zstd.compress(bytes).ok()?;
        (packed.len() < bytes.len() - bytes.len() / 8).then_some(packed)
    }

    /// Appends object `k` (`bytes`, which the caller read under κ `k`) to a batch,
    /// compressed when that saves at least an eighth.
    pub fn push(&mut self, out: &mut Vec<u8>, k: &Kappa, bytes: &[u8]) {
        match self.compressed(bytes) {
            Some(z) => entry(out, k, 1, bytes.len(), &z),
            None => entry(out, k, 0, bytes.len(), bytes),
        }
    }

    /// Appends object `k` of `store`, stored `at` ([`Store::stored_at`]), to a batch. An
    /// object stored as it is in a pack is read from there straight into the batch and not
    /// hashed here: whoever receives the batch
    /// re-hashes every object anyway (a corrupt one is refused there; see
    /// `ferry_space`'s push for the message then). Others are read through
    /// [`Store::get`], verified.
    fn push_stored(
        &mut self,
        out: &mut Vec<u8>,
        k: &Kappa,
        at: Option<&crate::Location>,
        store: &dyn Store,
    ) -> Result<u64, StoreError> {
        let through_get = |this: &mut Self, out: &mut Vec<u8>| {
            let bytes = store.get(k)?;
            this.push(out, k, &bytes);
            Ok(bytes.len() as u64)
        };
        let Some(at) = at else {
            return through_get(self, out);
        };
        // A pack compacted away since it was looked up: the object is read where it is now.
        let gone = |e: &std::io::Error| {
            matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::UnexpectedEof
            )
        };
        let file = match self.opened(&at.file) {
            Ok(f) => f,
            Err(e) if gone(&e) => return through_get(self, out),
            Err(e) => return Err(StoreError::io("open", &at.file)(e)),
        };
        let len = at.len as usize;
        let start = out.len();
        out.resize(start + HEADER + len, 0);
        let read =
            std::os::unix::fs::FileExt::read_exact_at(file, &mut out[start + HEADER..], at.offset);
        if let Err(e) = read {
            out.truncate(start);
            if gone(&e) {
                self.files.remove(&at.file);
                return through_get(self, out);
            }
            return Err(StoreError::io("read", &at.file)(e));
        }
        if self.verify {
            let checked = StoreError::check_hash(k, &out[start + HEADER..], || {
                format!("{}, offset {}", at.file.display(), at.offset)
            });
            if let Err(e) = checked {
                out.truncate(start);
                return Err(e);
            }
        }
        match self.compressed(&out[start + HEADER..]) {
            Some(z) => {
                out.truncate(start);
                entry(out, k, 1, len, &z);
            }
            None => header(&mut out[start..start + HEADER], k, 0, len, len),
        }
        Ok(len as u64)
    }
}

impl Drop for Encoder {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.scratch));
    }
}

/// Block size of direct I/O.
const ALIGN: usize = 4096;
/// Most bytes read at once with direct I/O.
const RUN: usize = 4 << 20;

/// Whether all `len` bytes from `offset` of `f` are in the page cache (Linux's `cachestat`,
/// 6.5 and later; asks nothing of the disk, unlike a `RWF_NOWAIT` read, which starts
/// readahead). `false` where it cannot be told.
fn all_cached(f: &std::fs::File, offset: u64, len: usize) -> bool {
    use std::os::fd::AsRawFd;
    /// `SYS_cachestat` on x86_64 and in the generic table (aarch64, riscv64).
    const CACHESTAT: libc::c_long = 451;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        cache: u64,
        dirty: u64,
        writeback: u64,
        evicted: u64,
        recently_evicted: u64,
    }
    let range = Range {
        off: offset,
        len: len as u64,
    };
    let mut stat = Stat::default();
    // SAFETY: `cachestat(fd, &range, &mut stat, 0)` reads `range` and writes `stat`, both
    // live and laid out as the kernel's `struct cachestat_range` / `struct cachestat`.
    let rc = unsafe {
        libc::syscall(
            CACHESTAT,
            f.as_raw_fd(),
            &range as *const Range,
            &mut stat as *mut Stat,
            0,
        )
    };
    rc == 0 && stat.cache * ALIGN as u64 >= len as u64
}

/// How many of `locs` from the first on lie back to back in one pack, block-aligned, within
/// [`RUN`] bytes (0: the first is not such an object).
fn direct_run(locs: &[Option<crate::Location>]) -> usize {
    let aligned = |l: &crate::Location| {
        l.offset.is_multiple_of(ALIGN as u64) && (l.len as usize).is_multiple_of(ALIGN)
    };
    let Some(first) = locs.first().and_then(Option::as_ref).filter(|l| aligned(l)) else {
        return 0;
    };
    let mut end = first.offset + u64::from(first.len);
    let mut n = 1;
    for l in locs[1..].iter() {
        match l {
            Some(l)
                if l.file == first.file
                    && l.offset == end
                    && aligned(l)
                    && end + u64::from(l.len) - first.offset <= RUN as u64 =>
            {
                end += u64::from(l.len);
                n += 1;
            }
            _ => break,
        }
    }
    n
}

/// `file` from `files`, opened (with `flags`) and kept there if it was not (all are closed
/// once [`FILES_KEPT`] are open).
fn kept_open<'a>(
    files: &'a mut HashMap<PathBuf, std::fs::File>,
    file: &std::path::Path,
    flags: libc::c_int,
) -> std::io::Result<&'a std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    if !files.contains_key(file) {
        if files.len() >= FILES_KEPT {
            files.clear();
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(flags)
            .open(file)?;
        files.insert(file.to_owned(), f);
    }
    Ok(&files[file])
}

/// Pack files an [`Encoder`] keeps open at most (a GiB of memory chunks is about 64 packs).
const FILES_KEPT: usize = 256;
/// An entry's header: κ, codec, length, stored length.
const HEADER: usize = 49;

fn header(h: &mut [u8], k: &Kappa, codec: u8, len: usize, stored: usize) {
    h[..32].copy_from_slice(k.as_bytes());
    h[32] = codec;
    h[33..41].copy_from_slice(&(len as u64).to_le_bytes());
    h[41..49].copy_from_slice(&(stored as u64).to_le_bytes());
}

fn entry(out: &mut Vec<u8>, k: &Kappa, codec: u8, len: usize, body: &[u8]) {
    let mut h = [0; HEADER];
    header(&mut h, k, codec, len, body.len());
    out.extend_from_slice(&h);
    out.extend_from_slice(body);
}

/// The entries of a received batch, as claimed: each κ with its bytes (raw ones borrowed from
/// the body). [`Batch::verify`] checks them.
pub struct Batch<'a> {
    entries: Vec<(Kappa, Cow<'a, [u8]>)>,
}

impl std::fmt::Debug for Batch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Batch({} entries)", self.entries.len())
    }
}

impl Batch<'_> {
    /// Every object re-hashed against its κ (on up to four threads); any that does not match
    /// refuses the whole batch.
    pub fn verify(&self) -> Result<Vec<Hashed<'_>>, Refused> {
        let claimed: Vec<(Kappa, &[u8])> = self.entries.iter().map(|(k, b)| (*k, &**b)).collect();
        Hashed::check_all(&claimed, "the batch received").map_err(|e| match e {
            crate::StoreError::Corrupt { kappa, actual, .. } => Refused::mismatch(kappa, actual),
            e => Refused {
                object: None,
                reason: e.to_string(),
            },
        })
    }
}

/// Why a received batch was refused: its reason, and the object whose bytes did not hash to
/// the κ it came with, when that was why.
#[derive(Debug)]
pub struct Refused {
    pub object: Option<Kappa>,
    pub reason: String,
}

impl Refused {
    /// Object `kappa` received with bytes that hash to `actual`.
    pub fn mismatch(kappa: Kappa, actual: Kappa) -> Self {
        Self {
            object: Some(kappa),
            reason: format!("object {kappa} hashes to {actual}: refused"),
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// Parses a batch (nothing is hashed yet: see [`Batch::verify`]). A malformed entry, or
/// entries claiming more than [`MAX_OBJECT`] + [`BATCH_BYTES`] bytes in all, refuse the whole
/// batch — the latter before anything is decompressed.
pub fn decode(mut b: &[u8]) -> Result<Batch<'_>, String> {
    let mut headers = Vec::new();
    let mut total = 0u64;
    while !b.is_empty() {
        if b.len() < HEADER {
            return Err("truncated entry header".into());
        }
        let k = Kappa::from_bytes(b[..32].try_into().expect("32 bytes"));
        let codec = b[32];
        let len = u64::from_le_bytes(b[33..41].try_into().expect("8 bytes"));
        let stored = u64::from_le_bytes(b[41..49].try_into().expect("8 bytes"));
        if len > MAX_OBJECT as u64 || stored > (b.len() - 49) as u64 {
            return Err(format!(
                "object {k}: {len} bytes claimed, {stored} stored: out of bounds"
            ));
        }
        total += len;
        if total > (MAX_OBJECT + BATCH_BYTES) as u64 {
            return Err(format!(
                "more than {} bytes in all once decompressed: refused",
                MAX_OBJECT + BATCH_BYTES
            ));
        }
        let (body, rest) = b[49..].split_at(stored as usize);
        headers.push((k, codec, len, body));
        b = rest;
    }
    let mut entries = Vec::with_capacity(headers.len());
    for (k, codec, len, body) in headers {
        let bytes = match codec {
            0 if body.len() as u64 == len => Cow::Borrowed(body),
            1 => {
                let bytes = zstd::bulk::decompress(body, len as usize)
                    .map_err(|e| format!("object {k}: {e}"))?;
                if bytes.len() as u64 != len {
                    return Err(format!(
                        "object {k}: {len} bytes claimed, {} decompressed",
                        bytes.len()
                    ));
                }
                Cow::Owned(bytes)
            }
            _ => {
                return Err(format!(
                    "object {k}: codec {codec}, {} of {len} bytes",
                    body.len()
                ));
            }
        };
        entries.push((k, bytes));
    }
    Ok(Batch { entries })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn encode(objects: &[&[u8]]) -> Vec<u8> {
        let mut e = Encoder::new();
        let mut b = Vec::new();
        for o in objects {
            e.push(&mut b, &Kappa::of(o), o);
        }
        b
    }

    /// 64 KiB of pseudo-random bytes (xorshift): nothing for zstd to save.
    fn random_chunk() -> Vec<u8> {
        let mut random = vec![0u8; 64 << 10];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for w in random.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        random
    }

    fn decoded(b: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        let batch = decode(b)?;
        let hashed = batch.verify().map_err(|m| m.to_string())?;
        Ok(hashed.iter().map(|h| h.bytes().to_vec()).collect())
    }

    #[test]
    fn round_trip_and_refusals() {
        let b = encode(&[b"one", &vec![0u8; 100_000]]);
        assert_eq!(
            decoded(&b).unwrap(),
            vec![b"one".to_vec(), vec![0u8; 100_000]]
        );
        for i in [0, 20, 32, 40, 48, 50, b.len() - 1] {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            assert!(decoded(&bad).is_err(), "flipping byte {i} was not noticed");
        }
        assert!(decoded(&b[..b.len() - 1]).is_err());
        let mut huge = b[..49].to_vec();
        huge[33..41].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decoded(&huge).unwrap_err().contains("out of bounds"));
    }

    /// Random bytes travel raw, zeros and text compressed; a large object is sampled, so one
    /// whose sample is random travels raw whatever the rest holds.
    #[test]
    fn what_is_compressed() {
        let random = random_chunk();
        let text = b"a line of text that repeats\n".repeat(3000);
        let codec = |o: &[u8]| encode(&[o])[32];
        assert_eq!(codec(&random), 0);
        assert_eq!(codec(&random[..1000]), 0);
        assert_eq!(codec(&vec![0u8; 64 << 10]), 1);
        assert_eq!(codec(&text), 1);
        assert_eq!(codec(b"short"), 0);
        let b = encode(&[&random, &text, &vec![7u8; 1 << 20]]);
        assert!(b.len() < random.len() + 10_000, "{}", b.len());
        assert_eq!(decoded(&b).unwrap()[2], vec![7u8; 1 << 20]);
    }

    /// Objects read straight from a store's packs travel as `get` would return them:
    /// random ones raw, compressible ones compressed; loose ones through `get`.
    #[test]
    fn stored_objects_are_read_from_their_packs() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::FsStore::open(dir.path().join("s")).unwrap();
        let random = random_chunk();
        let text = b"some text, again and again; ".repeat(2000);
        let ks = store.put_many(&[&random, &text]).unwrap();
        let loose = store.put(b"a small loose object").unwrap();
        assert!(ks.iter().all(|k| store.stored_at(k).is_some()));
        assert!(store.stored_at(&loose).is_none());
        let mut e = Encoder::new();
        let mut b = Vec::new();
        for k in ks.iter().chain([&loose]) {
            e.push_stored(&mut b, k, store.stored_at(k).as_ref(), &store)
                .unwrap();
        }
        let batch = decode(&b).unwrap();
        assert_eq!(batch.entries[0].1.as_ref(), random.as_slice());
        assert!(
            matches!(batch.entries[0].1, Cow::Borrowed(_)),
            "random travels raw"
        );
        assert!(
            matches!(batch.entries[1].1, Cow::Owned(_)),
            "text travels compressed"
        );
        let got: Vec<Vec<u8>> = batch
            .verify()
            .unwrap()
            .iter()
            .map(|h| h.bytes().to_vec())
            .collect();
        assert_eq!(got, vec![random, text, b"a small loose object".to_vec()]);
    }

    /// Chunks packed with direct I/O are read in runs: with direct I/O while they are not in
    /// the page cache, copied from it once they are; either way the batch holds them as
    /// they were stored.
    #[test]
    fn runs_of_packed_chunks_are_read_directly_or_from_the_page_cache() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::FsStore::open(dir.path().join("s")).unwrap();
        // 96 distinct 64 KiB chunks in block-aligned memory, as a guest's are: one direct pack.
        let mut mem = vec![0u8; 96 * 65536 + ALIGN];
        let at = mem.as_ptr().align_offset(ALIGN);
        let mem = &mut mem[at..at + 96 * 65536];
        for (i, w) in mem.chunks_exact_mut(4).enumerate() {
            w.copy_from_slice(&(i as u32).wrapping_mul(2_654_435_761).to_le_bytes());
        }
        let chunks: Vec<&[u8]> = mem.chunks(65536).collect();
        let ks = store.put_many(&chunks).unwrap();
        if !store.direct_io() {
            eprintln!(
                "{} takes no direct I/O: nothing to test",
                dir.path().display()
            );
            return;
        }
        let loose = store.put(b"not in a pack").unwrap();
        let mut asked = ks.clone();
        asked.insert(40, loose);
        let check = |b: &[u8]| {
            let batch = decode(b).unwrap();
            let got = batch.verify().unwrap();
            assert_eq!(got.len(), 97);
            assert_eq!(got[40].bytes(), b"not in a pack");
            assert_eq!(got[97 - 1].bytes(), chunks[95]);
            assert!(got.iter().map(|h| h.kappa()).eq(asked.iter().copied()));
        };
        let mut e = Encoder::new();
        let mut b = Vec::new();
        assert_eq!(
            e.push_many_stored(&mut b, &asked, &store).unwrap(),
            96 * 65536 + 13
        );
        check(&b);
        assert_eq!(e.direct_files.len(), 1, "read with direct I/O");
        // Once the pack is in the page cache, it is copied from there.
        let pack = store.stored_at(&ks[0]).unwrap().file;
        std::fs::read(&pack).unwrap();
        let mut e = Encoder::new();
        let mut b = Vec::new();
        e.push_many_stored(&mut b, &asked, &store).unwrap();
        check(&b);
        assert!(e.direct_files.is_empty(), "read from the page cache");
    }

    /// A batch that would decompress to more than a batch may hold is refused before
    /// anything is decompressed (the entries claim 600 MiB each; their bodies are not even
    /// valid zstd, which would be the error if they were looked at).
    #[test]
    fn a_decompression_bomb_is_refused() {
        let mut one = Kappa::of(b"x").as_bytes().to_vec();
        one.push(1);
        one.extend_from_slice(&(600u64 << 20).to_le_bytes());
        one.extend_from_slice(&4u64.to_le_bytes());
        one.extend_from_slice(b"junk");
        assert!(decode(&one).err().unwrap().contains("object"));
        let two = one.repeat(2);
        assert!(decode(&two).err().unwrap().contains("once decompressed"));
    }
}
