//! Snapshot objects ↔ a guest's state.
//!
//! [`write`] turns a guest unwound at a safe point into objects: memory chunks (only non-zero
//! ones, each stored once), the saved stack, the WASI state with its mounts imported as trees,
//! and the snapshot itself. [`load`] is the first part of the verified resume transition
//! (Resolving → Verifying → Admitting); [`restore_into`] is Restoring, where every chunk is
//! re-hashed as it is copied and any mismatch refuses the resume before the guest runs.

use ferry_instrument::abi;
use ferry_kappa::Kappa;
use ferry_object::{
    CHUNK_SIZE, GlobalValue, LOG_CHUNK_SIZE, MemoryImage, ObjectKind, OutputLog, Profile, Snapshot,
    WasiState,
};
use ferry_store::{Store, StoreError};
use tracing::info;

use crate::HOST_CONTRACT;
use crate::error::{EngineError, Stage};
use crate::prepare::Prepared;
use crate::run::{SnapshotMeta, global_i32};
use crate::seam::{Instance, Value};

/// Largest memory ferry restores (4 GiB, the wasm32 limit).
const MAX_MEMORY: u64 = 1 << 32;

/// Whether a chunk is all zero bytes (OR-folded in blocks, which vectorizes).
pub(crate) fn is_zero(chunk: &[u8]) -> bool {
    chunk
        .chunks(256)
        .all(|c| c.iter().fold(0u8, |a, &b| a | b) == 0)
}

/// Stores a memory as chunks and returns the κ of its image. Non-zero chunks go to the store
/// in one batch (hashed in parallel; on disk, the new ones land in one pack file).
pub fn write_memory(store: &dyn Store, data: &[u8]) -> Result<Kappa, StoreError> {
    let image = memory_image(store, data)?;
    store.put(&ferry_object::encode(&image))
}

/// Stores the non-zero chunks of `data` and returns its image (not yet stored).
pub(crate) fn memory_image(store: &dyn Store, data: &[u8]) -> Result<MemoryImage, StoreError> {
    let (indices, chunks): (Vec<u32>, Vec<&[u8]>) = data
        .chunks(CHUNK_SIZE as usize)
        .enumerate()
        .filter(|(_, c)| !is_zero(c))
        .map(|(i, c)| (i as u32, c))
        .unzip();
    let kappas = store.put_many(&chunks)?;
    let (kind, v) = ferry_object::header::<MemoryImage>();
    Ok(MemoryImage {
        kind,
        v,
        len: data.len() as u64,
        chunk_size: CHUNK_SIZE,
        chunks: indices.into_iter().zip(kappas).collect(),
    })
}

/// Stores an output log (the record encoding of `ferry_wasi::output`) as chunks and returns
/// the κ of its `ferry.log` object. Every chunk but the last is full, so consecutive
/// snapshots of one session share all but the tail.
pub fn write_output(store: &dyn Store, log: &[u8]) -> Result<Kappa, StoreError> {
    let chunks: Vec<&[u8]> = log.chunks(LOG_CHUNK_SIZE as usize).collect();
    let kappas = store.put_many(&chunks)?;
    let (kind, v) = ferry_object::header::<OutputLog>();
    store.put(&ferry_object::encode(&OutputLog {
        kind,
        v,
        len: log.len() as u64,
        chunk_size: LOG_CHUNK_SIZE,
        chunks: kappas,
    }))
}

/// Reads the output log `k` back, checking its shape, every chunk's hash and the record
/// encoding.
pub fn read_output(store: &dyn Store, k: &Kappa) -> Result<Vec<u8>, EngineError> {
    let log: OutputLog = get_object(store, k, "output log")?;
    let refuse =
        |why: String| EngineError::refused(Stage::Verifying, format!("output log {k}: {why}"));
    if log.chunk_size != LOG_CHUNK_SIZE
        || log.len > ferry_wasi::output::MAX_LOG
        || log.chunks.len() as u64 != log.len.div_ceil(u64::from(LOG_CHUNK_SIZE))
    {
        return Err(refuse(format!(
            "{} bytes in {} chunks of {} is not a well-formed log",
            log.len,
            log.chunks.len(),
            log.chunk_size
        )));
    }
    let mut out = Vec::with_capacity(log.len as usize);
    for (i, c) in log.chunks.iter().enumerate() {
        let bytes = match store.get(c) {
            Ok(b) => b,
            Err(StoreError::NotFound(_)) => {
                return Err(EngineError::missing(Stage::Resolving, "output chunk", c));
            }
            Err(e) => return Err(EngineError::refused(Stage::Verifying, e)),
        };
        let last = i + 1 == log.chunks.len();
        if (!last && bytes.len() != LOG_CHUNK_SIZE as usize) || bytes.is_empty() {
            return Err(refuse(format!("chunk {i} has {} bytes", bytes.len())));
        }
        out.extend_from_slice(&bytes);
    }
    if out.len() as u64 != log.len {
        return Err(refuse("chunk sizes do not add up to its length".into()));
    }
    ferry_wasi::output::Records::check(&out).map_err(refuse)?;
    Ok(out)
}

fn global_value(index: u32, v: Value) -> GlobalValue {
    let (ty, bits) = match v {
        Value::I32(x) => ("i32", x.to_le_bytes().to_vec()),
        Value::I64(x) => ("i64", x.to_le_bytes().to_vec()),
        Value::F32(x) => ("f32", x.to_le_bytes().to_vec()),
        Value::F64(x) => ("f64", x.to_le_bytes().to_vec()),
        Value::V128(x) => ("v128", x.to_le_bytes().to_vec()),
    };
    GlobalValue {
        index,
        ty: ty.into(),
        bits,
    }
}

fn to_value(g: &GlobalValue) -> Option<Value> {
    let b = &g.bits;
    Some(match (g.ty.as_str(), b.len()) {
        ("i32", 4) => Value::I32(i32::from_le_bytes(b[..].try_into().ok()?)),
        ("i64", 8) => Value::I64(i64::from_le_bytes(b[..].try_into().ok()?)),
        ("f32", 4) => Value::F32(u32::from_le_bytes(b[..].try_into().ok()?)),
        ("f64", 8) => Value::F64(u64::from_le_bytes(b[..].try_into().ok()?)),
        ("v128", 16) => Value::V128(u128::from_le_bytes(b[..].try_into().ok()?)),
        _ => return None,
    })
}

/// Writes the snapshot of a guest that has just unwound.
pub(crate) fn write(
    inst: &mut dyn Instance,
    store: &dyn Store,
    meta: &SnapshotMeta,
    prepared: &Prepared,
    entry: &str,
    dirty: &mut crate::incremental::Incremental,
    files_read: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> Result<Kappa, EngineError> {
    let fail =
        |step: &str, e: &dyn std::fmt::Display| EngineError::Capture(step.into(), e.to_string());
    let sp = global_i32(inst, abi::SP_GLOBAL)? as u32 as usize;
    let stack = inst
        .memory(abi::STACK_MEMORY)
        .ok_or_else(|| fail("stack", &"no saved-stack memory"))?
        .get(..sp)
        .ok_or_else(|| fail("stack", &"saved stack pointer out of bounds"))?
        .to_vec();

    let host = inst.host();
    host.wasi.flush();
    host.wasi.sync_files();
    let mounts = host.wasi.mounts();
    // A host-bound mount asks for the host's directory itself (`bind:`), not for its content.
    let mut caps: Vec<String> = mounts
        .iter()
        .map(|m| {
            let how = if m.host_bound { "bind" } else { "mount" };
            format!("{how}:{}", m.guest_path)
        })
        .collect();
    let host_bound = mounts.iter().any(|m| m.host_bound);
    let not_carried = host.wasi.not_carried();

    // Mounted directories are imported on another thread while the memories are written: the
    // one reads and hashes files, the other mostly waits for the disk.
    let started = std::time::Instant::now();
    let mut tree_cache = std::mem::take(&mut dirty.trees);
    tree_cache.count_bytes_into(Some(files_read));
    // A big file the guest changed in a few places is read again only there.
    tree_cache.use_guest_writes(host.wasi.take_guest_writes());
    let patched_before = tree_cache.files_patched();
    let load_saved = !std::mem::replace(&mut dirty.trees_loaded, true);
    let mut read_before = 0;
    let (trees, memories) = std::thread::scope(|s| {
        let importer = s.spawn(|| {
            // What earlier runs stored (a 50 MB standard library, a data set) is not read
            // again at this run's first snapshot either, while unchanged.
            if load_saved && !mounts.is_empty() {
                tree_cache.absorb(ferry_wasi::tree::ImportCache::saved_in(store));
            }
            read_before = tree_cache.files_read();
            let trees = mounts
                .iter()
                .zip(&not_carried)
                .map(|(m, skip)| match m.host_bound {
                    true => ferry_wasi::tree::empty(store),
                    false => {
                        ferry_wasi::tree::import_cached(store, &m.host_dir, &mut tree_cache, skip)
                    }
                })
                .collect::<Result<Vec<_>, _>>();
            // Saved when it learnt something: a file read, or patched (a resume, and the
            // run after it, then know the file as the snapshot holds it).
            let learnt = tree_cache.files_read() > read_before
                || tree_cache.files_patched() > patched_before;
            if trees.is_ok()
                && learnt
                && let Err(e) = tree_cache.save_in(store)
            {
                tracing::warn!("could not save the mount import cache: {e}");
            }
            trees
        });
        let mut memories = Vec::new();
        for i in 0.. {
            let name = abi::memory_export(i);
            if inst.memory(&name).is_none() {
                break;
            }
            match dirty.write(inst, i as usize, store) {
                Ok(k) => memories.push(k),
                Err(e) => {
                    let _ = importer.join();
                    return (Ok(Vec::new()), Err(fail("memory", &e)));
                }
            }
        }
        let trees = importer.join().expect("mount import thread");
        (trees.map_err(|e| fail("mount", &e)), Ok(memories))
    });
    tree_cache.count_bytes_into(None);
    tree_cache.forget_guest_writes();
    let files_read = tree_cache.files_read() - read_before;
    let files_patched = tree_cache.files_patched() - patched_before;
    dirty.trees = tree_cache;
    let (trees, memories) = (trees?, memories?);

    let host = inst.host();
    // The big files just stored in pieces: their changes until the next snapshot are worth
    // recording.
    host.wasi.record_writes_to(dirty.trees.stored_in_pieces());
    let wasi: WasiState = host
        .wasi
        .capture(&trees, store)
        .map_err(|e| fail("wasi", &e))?;
    let output = match host.wasi.output_log() {
        Some(log) => Some(write_output(store, &log.bytes()).map_err(|e| fail("output", &e))?),
        None => None,
    };
    if !wasi.env.is_empty() {
        caps.push("env".into());
    }

    let mut globals = Vec::new();
    for name in inst.export_names() {
        if let Some(idx) = name
            .strip_prefix(abi::GLOBAL_PREFIX)
            .and_then(|i| i.parse::<u32>().ok())
        {
            let v = inst
                .global(&name)
                .ok_or_else(|| fail("globals", &format!("global {idx} has a reference type")))?;
            globals.push(global_value(idx, v));
        }
    }
    globals.sort_by_key(|g| g.index);

    let (kind, v) = ferry_object::header::<Snapshot>();
    let snap = Snapshot {
        kind,
        v,
        program: meta.program.clone(),
        module: prepared.module,
        instrumented: prepared.instrumented,
        instrument_version: prepared.instrument_version,
        memories,
        globals,
        stack: store.put(&stack).map_err(|e| fail("stack", &e))?,
        entry: entry.to_owned(),
        wasi: store
            .put(&ferry_object::encode(&wasi))
            .map_err(|e| fail("wasi", &e))?,
        profile: Profile {
            runtime: HOST_CONTRACT.into(),
            engine_class: prepared.engine_class.into(),
            capabilities: caps,
            host_bound,
        },
        parent: meta.parent,
        generation: meta.generation + 1,
        output,
        main: meta.main.clone(),
    };
    let k = store
        .put(&ferry_object::encode(&snap))
        .map_err(|e| fail("snapshot", &e))?;
    let stored = started.elapsed();
    store.sync().map_err(|e| fail("sync", &e))?;
    info!(snapshot = %k, written_ms = stored.as_millis(), total_ms = started.elapsed().as_millis(), files_read, files_patched, "snapshot written");
    Ok(k)
}

/// A snapshot that passed Resolving and Verifying, ready for Admitting and Restoring.
#[derive(Debug)]
pub struct Loaded {
    pub kappa: Kappa,
    pub snapshot: Snapshot,
    pub wasi: WasiState,
    pub(crate) memories: Vec<MemoryImage>,
    pub(crate) stack: Vec<u8>,
    /// The output log the snapshot carries (verified), if any.
    pub output: Option<Vec<u8>>,
}

impl Loaded {
    /// Bytes of all the guest's memories (what a memory limit is checked against).
    pub fn memory_bytes(&self) -> u64 {
        self.memories.iter().map(|m| m.len).sum()
    }

    /// The κ of every non-zero memory chunk, memory by memory, in address order.
    pub fn chunks(&self) -> impl Iterator<Item = &Kappa> {
        self.chunks_at().map(|(_, _, k)| k)
    }

    /// [`Self::chunks`] with where each is: (memory, byte offset in it, κ).
    pub fn chunks_at(&self) -> impl Iterator<Item = (usize, u64, &Kappa)> {
        self.memories.iter().enumerate().flat_map(|(i, m)| {
            m.chunks
                .iter()
                .map(move |(at, k)| (i, u64::from(*at) * u64::from(m.chunk_size), k))
        })
    }
}

fn get_object<T: ObjectKind>(store: &dyn Store, k: &Kappa, what: &str) -> Result<T, EngineError> {
    let bytes = match store.get(k) {
        Ok(b) => b,
        Err(StoreError::NotFound(_)) => {
            return Err(EngineError::missing(Stage::Resolving, what, k));
        }
        Err(e) => return Err(EngineError::refused(Stage::Verifying, e)),
    };
    ferry_object::decode(&bytes)
        .map_err(|e| EngineError::refused(Stage::Verifying, format!("{what} {k}: {e}")))
}

/// Resolving and Verifying: every object of the closure is present; every structured object
/// re-hashes to its κ and decodes as its kind and version; memory images are well-formed.
/// Chunk contents are re-hashed while they are copied in [`restore_into`].
pub fn load(store: &dyn Store, k: Kappa) -> Result<Loaded, EngineError> {
    let loaded = load_leaving_module(store, k)?;
    check_module(store, &loaded.snapshot.module)?;
    Ok(loaded)
}

/// [`load`] without re-hashing the module, which the caller must do with [`check_module`]
/// before the guest runs — `ferry resume` does it on another thread while the guest is
/// restored (reading a 100 MB interpreter from the disk to hash it took up to ~110 ms).
pub fn load_leaving_module(store: &dyn Store, k: Kappa) -> Result<Loaded, EngineError> {
    info!(snapshot = %k, "resolving");
    let snapshot: Snapshot = get_object(store, &k, "snapshot")?;
    for (what, kk) in [
        ("module", snapshot.module),
        ("instrumented module", snapshot.instrumented),
        ("saved stack", snapshot.stack),
    ] {
        if !store.has(&kk)? {
            return Err(EngineError::missing(Stage::Resolving, what, &kk));
        }
    }
    let wasi: WasiState = get_object(store, &snapshot.wasi, "WASI state")?;
    let mut memories = Vec::new();
    for m in &snapshot.memories {
        let image: MemoryImage = get_object(store, m, "memory image")?;
        check_image(&image).map_err(|e| {
            EngineError::refused(Stage::Verifying, format!("memory image {m}: {e}"))
        })?;
        for (_, c) in &image.chunks {
            if !store.has(c)? {
                return Err(EngineError::missing(Stage::Resolving, "memory chunk", c));
            }
        }
        memories.push(image);
    }
    for mount in &wasi.mounts {
        check_tree(store, &mount.tree, 0)?;
    }
    for (_, f) in &wasi.fds {
        if let Some(t) = &f.unnamed {
            check_tree(store, t, 0)?;
        }
    }
    if let Some(i) = &wasi.stdin_input {
        if !store.has(i)? {
            return Err(EngineError::missing(Stage::Resolving, "stdin input", i));
        }
        if wasi.stdin_chunked {
            let f = check_pieces(store, i, "stdin input")?;
            if f.len > ferry_wasi::input::MAX_INPUT {
                return Err(EngineError::refused(
                    Stage::Verifying,
                    format!(
                        "stdin input {i} holds {} bytes, more than ferry takes ({})",
                        f.len,
                        ferry_wasi::input::MAX_INPUT
                    ),
                ));
            }
        }
    }
    let output = match &snapshot.output {
        Some(o) => {
            let log = read_output(store, o)?;
            let (out, err) = ferry_wasi::output::Records::check(&log).expect("checked on read");
            // A log can start after the guest's first output (a snapshot taken by a terminal
            // run, then resumed by a space), never hold more than the guest wrote.
            if out > wasi.stdout_bytes || err > wasi.stderr_bytes {
                return Err(EngineError::refused(
                    Stage::Verifying,
                    format!(
                        "output log {o} holds {out}/{err} bytes of stdout/stderr, more than the \
                         guest wrote ({}/{})",
                        wasi.stdout_bytes, wasi.stderr_bytes
                    ),
                ));
            }
            Some(log)
        }
        None => None,
    };
    info!(snapshot = %k, "verifying");
    let stack = store
        .get(&snapshot.stack)
        .map_err(|e| EngineError::refused(Stage::Verifying, e))?;
    // The instrumentation version is admitted with the module (`Runtime::prepare_snapshot`);
    // the engine class is admitted by the engine that will run it (`Runtime::run`).
    if snapshot.profile.runtime != HOST_CONTRACT {
        return Err(EngineError::refused(
            Stage::Admitting,
            format!(
                "snapshot needs host contract {}; this host provides {HOST_CONTRACT}",
                snapshot.profile.runtime
            ),
        ));
    }
    Ok(Loaded {
        kappa: k,
        snapshot,
        wasi,
        memories,
        stack,
        output,
    })
}

/// Verifying the snapshot's module: it must re-hash to its κ like every object of the
/// closure. Re-hashed without being kept: a resume with the compiled code cached runs without
/// the module's bytes (reading a 100 MB interpreter into memory only to hash it took ~90 ms of
/// every CPython resume).
pub fn check_module(store: &dyn Store, module: &Kappa) -> Result<(), EngineError> {
    store
        .check(module)
        .map_err(|e| EngineError::refused(Stage::Verifying, e))
}

/// Runs `f` — which restores a snapshot of `module` under `control` and runs it — while
/// [`check_module`] re-hashes the module on another thread: the restored guest is held until
/// the check has passed, and refused (at Verifying) if it fails. For a snapshot loaded with
/// [`load_leaving_module`].
pub fn with_module_check<T>(
    store: &dyn Store,
    module: Kappa,
    control: &crate::Control,
    f: impl FnOnce() -> T,
) -> T {
    let (checked, result) = std::sync::mpsc::channel();
    // Post-copy: the guest may run before the check ends, and shows nothing until it has.
    let deferred = control.runs_while_checking();
    if deferred {
        control.begin_check();
    } else {
        control.hold_after_restore(move || match result.recv() {
            Ok(Ok(())) => crate::Hold::Run,
            Ok(Err(why)) => crate::Hold::Refuse(Stage::Verifying, why),
            Err(_) => {
                crate::Hold::Refuse(Stage::Verifying, "the module's check did not finish".into())
            }
        });
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            let r = check_module(store, &module).map_err(|e| match e {
                EngineError::Refused { reason, .. } => reason,
                other => other.to_string(),
            });
            match deferred {
                true => control.end_check(r.map_err(|why| (Stage::Verifying, why))),
                false => {
                    let _ = checked.send(r);
                }
            }
        });
        f()
    })
}

fn check_tree(store: &dyn Store, k: &Kappa, depth: usize) -> Result<(), EngineError> {
    if depth > ferry_wasi::tree::MAX_DEPTH {
        return Err(EngineError::refused(
            Stage::Verifying,
            format!("tree {k} is nested too deeply"),
        ));
    }
    let tree: ferry_object::Tree = get_object(store, k, "directory tree")?;
    tree.check()
        .map_err(|why| EngineError::refused(Stage::Verifying, format!("tree {k}: {why}")))?;
    for (name, e) in &tree.entries {
        if e.mode == ferry_object::MODE_DIR {
            check_tree(store, &e.object, depth + 1)?;
            continue;
        }
        let what = format!("file `{name}`");
        if !store.has(&e.object)? {
            return Err(EngineError::missing(Stage::Resolving, &what, &e.object));
        }
        if e.chunked() {
            check_pieces(store, &e.object, &what)?;
        }
    }
    Ok(())
}

/// Verifying a [`ferry_object::FileChunks`] (`what`, for the messages): its list adds up and
/// every piece is in the store. Returns it.
fn check_pieces(
    store: &dyn Store,
    k: &Kappa,
    what: &str,
) -> Result<ferry_object::FileChunks, EngineError> {
    let f: ferry_object::FileChunks = get_object(store, k, what)?;
    f.check()
        .map_err(|why| EngineError::refused(Stage::Verifying, format!("{what}: {why}")))?;
    for c in &f.chunks {
        if !store.has(c)? {
            return Err(EngineError::missing(Stage::Resolving, what, c));
        }
    }
    Ok(f)
}

fn check_image(m: &MemoryImage) -> Result<(), String> {
    if m.chunk_size != CHUNK_SIZE {
        return Err(format!(
            "chunk size {} (expected {CHUNK_SIZE})",
            m.chunk_size
        ));
    }
    if m.len > MAX_MEMORY || !m.len.is_multiple_of(u64::from(CHUNK_SIZE)) {
        return Err(format!(
            "length {} is not a whole number of pages up to 4 GiB",
            m.len
        ));
    }
    let n = (m.len / u64::from(CHUNK_SIZE)) as u32;
    let mut prev = None;
    for (i, _) in &m.chunks {
        if *i >= n || prev.is_some_and(|p| p >= *i) {
            return Err(format!("chunk index {i} out of order or out of range"));
        }
        prev = Some(*i);
    }
    Ok(())
}

fn mapping_enabled() -> bool {
    std::env::var("FERRY_MAP_CHUNKS").map_or(true, |v| v != "off")
}

/// Most mappings one restore makes (the kernel allows ~65,000 per process; runs of chunks
/// adjacent in memory and in a pack take one each).
const MAX_MAPPINGS: usize = 16_384;

/// Where a mapped chunk lies: a pack (an index into [`Mapped::files`]) and an offset in it.
#[derive(Debug, Clone, Copy)]
struct MappedFrom {
    file: usize,
    offset: u64,
}

/// Which chunks of a memory [`map_chunks`] mapped, and from where.
#[derive(Debug, Default)]
struct Mapped {
    files: Vec<(std::fs::File, std::path::PathBuf)>,
    /// Per chunk: `None` to be read.
    from: Vec<Option<MappedFrom>>,
}

impl Mapped {
    fn none(n: usize) -> Self {
        Self {
            files: Vec::new(),
            from: vec![None; n],
        }
    }
}

/// Chunks read and hashed at a time when checking mapped ones (256 KiB).
const CHECK_BLOCK: usize = 4;

/// Maps the chunks the store keeps as they are in its pack files straight into memory `name`
/// — one mapping per run of chunks adjacent both in memory and in a pack — instead of
/// copying them: no fresh page is allocated and cleared for them, and none is copied (a page
/// is copied only when the guest first writes it). Mapped chunks are checked by
/// [`read_chunks`] before the guest runs, like read ones.
fn map_chunks(
    inst: &mut dyn Instance,
    name: &str,
    chunks: &[(u32, Kappa)],
    store: &dyn Store,
) -> Result<Mapped, EngineError> {
    let mut mapped = Mapped::none(chunks.len());
    if !mapping_enabled() {
        return Ok(mapped);
    }
    let size = CHUNK_SIZE as u64;
    let locs: Vec<_> = chunks
        .iter()
        .map(|(_, k)| {
            store
                .stored_at(k)
                .filter(|l| l.len == CHUNK_SIZE && l.offset.is_multiple_of(4096))
        })
        .collect();
    // Each pack opened once: its index in `mapped.files` and length (`None`: unusable).
    let mut opened: std::collections::HashMap<std::path::PathBuf, Option<(usize, u64)>> =
        std::collections::HashMap::new();
    let (mut i, mut runs, mut n) = (0, 0, 0);
    while i < chunks.len() && runs < MAX_MAPPINGS {
        let Some(first) = &locs[i] else {
            i += 1;
            continue;
        };
        let mut j = i + 1;
        while j < chunks.len()
            && chunks[j].0 == chunks[j - 1].0 + 1
            && locs[j].as_ref().is_some_and(|l| {
                l.file == first.file && l.offset == first.offset + (j - i) as u64 * size
            })
        {
            j += 1;
        }
        let len = (j - i) as u64 * size;
        let file = *opened.entry(first.file.clone()).or_insert_with(|| {
            let f = std::fs::File::open(&first.file).ok()?;
            let file_len = f.metadata().ok()?.len();
            mapped.files.push((f, first.file.clone()));
            Some((mapped.files.len() - 1, file_len))
        });
        if let Some((fi, file_len)) = file
            && first.offset + len <= file_len
        {
            let at = chunks[i].0 as usize * CHUNK_SIZE as usize;
            let done = inst
                .map_file(name, at, &mapped.files[fi].0, first.offset, len as usize)
                .map_err(|e| EngineError::refused(Stage::Restoring, e))?;
            if !done {
                break;
            }
            for (q, m) in mapped.from[i..j].iter_mut().enumerate() {
                *m = Some(MappedFrom {
                    file: fi,
                    offset: first.offset + q as u64 * size,
                });
            }
            runs += 1;
            n += j - i;
        }
        i = j;
    }
    if n > 0 {
        info!(
            memory = name,
            chunks = n,
            of = chunks.len(),
            runs,
            "mapped from packs"
        );
    }
    Ok(mapped)
}

/// Threads that read or check a memory's chunks.
fn chunk_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4)
}

/// Threads that check the chunks mapped from packs while the guest runs: they mostly wait
/// for the disk, and a snapshot whose chunks are scattered through many packs (pre-written)
/// is read 64 KiB at a time, so more reads in flight is what helps. A pre-written 1 GiB
/// snapshot from the cold disk: 1.58–1.73 s with 2 threads, 1.32–1.41 s with 8 (16: no
/// better); one written at the suspend: ~0.6–0.7 s either way.
const DEFERRED_CHECK_THREADS: usize = 8;

/// Splits `chunks` (and their `from` entries) into one run per thread, up to `threads`, and
/// runs `f` on each on a thread of its own with what `piece` gives for it (called in order,
/// on this thread); the first error.
fn in_parts<'c, P: Send>(
    chunks: &'c [(u32, Kappa)],
    from: &'c [Option<MappedFrom>],
    threads: usize,
    mut piece: impl FnMut(&[(u32, Kappa)]) -> P,
    f: impl Fn(&'c [(u32, Kappa)], &'c [Option<MappedFrom>], P) -> Result<(), StoreError> + Sync,
) -> Result<(), StoreError> {
    let per = chunks.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = chunks
            .chunks(per)
            .zip(from.chunks(per))
            .map(|(part, from)| {
                let p = piece(part);
                s.spawn(move || f(part, from, p))
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("chunk thread"))
    })
}

/// Fills `memory` with `chunks` on up to four threads (chunks are sorted by index, so each
/// thread gets a disjoint stretch of memory): each is read and re-hashed — or, if it was
/// mapped, its bytes in the pack are read into a scratch buffer a block at a time and hashed
/// (the same page-cache pages the mapping shows; reading them in large requests is faster
/// from the disk than faulting the mapping in), unless `skip_mapped` leaves that to a
/// [`DeferredCheck`].
fn read_chunks(
    store: &dyn Store,
    chunks: &[(u32, Kappa)],
    mapped: &Mapped,
    memory: &mut [u8],
    skip_mapped: bool,
) -> Result<(), StoreError> {
    let size = CHUNK_SIZE as usize;
    let mut rest = memory;
    let mut base = 0usize;
    // Each thread's stretch of memory and where it starts.
    let stretch = |part: &[(u32, Kappa)]| {
        let end = part.last().map_or(base, |(i, _)| (*i as usize + 1) * size);
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(end - base);
        let start = base;
        (rest, base) = (tail, end);
        (mine, start)
    };
    in_parts(
        chunks,
        &mapped.from,
        chunk_threads(),
        stretch,
        |part, from, (mine, start)| {
            let mut scratch = Vec::new();
            let mut n = 0;
            while n < part.len() {
                n = match from[n] {
                    None => {
                        let (i, k) = &part[n];
                        let at = *i as usize * size - start;
                        store.read_into(k, &mut mine[at..at + size])?;
                        n + 1
                    }
                    Some(_) if skip_mapped => n + 1,
                    Some(m) => check_mapped_block(mapped, part, from, n, m, &mut scratch)?,
                };
            }
            Ok(())
        },
    )
}

/// Checks the mapped chunk `part[n]` (from `m`) and those after it in the same pack, up to
/// [`CHECK_BLOCK`]: their bytes in the pack are read into `scratch` and hashed. Returns the
/// index after the last one checked.
fn check_mapped_block(
    mapped: &Mapped,
    part: &[(u32, Kappa)],
    from: &[Option<MappedFrom>],
    n: usize,
    m: MappedFrom,
    scratch: &mut Vec<u8>,
) -> Result<usize, StoreError> {
    use std::os::unix::fs::FileExt;
    let size = CHUNK_SIZE as usize;
    let mut e = n + 1;
    while e < part.len()
        && e - n < CHECK_BLOCK
        && from[e]
            .is_some_and(|x| x.file == m.file && x.offset == m.offset + ((e - n) * size) as u64)
    {
        e += 1;
    }
    let (mapped_file, path) = &mapped.files[m.file];
    // A fresh handle for each block, as `Store::read_into` opens one per chunk: from the
    // disk, 1 GiB came in 0.60-0.73 s that way, in 0.85-1.3 s through one long-lived handle
    // per thread (the kernel's readahead). On the file that was mapped, not on whatever its
    // path names now.
    let fresh = std::fs::File::open(format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(mapped_file)
    ));
    let file = fresh.as_ref().unwrap_or(mapped_file);
    scratch.resize((e - n) * size, 0);
    file.read_exact_at(scratch, m.offset)
        .map_err(|source| StoreError::Io {
            op: "read",
            path: path.clone(),
            source,
        })?;
    for ((_, k), bytes) in part[n..e].iter().zip(scratch.chunks(size)) {
        StoreError::check_hash(k, bytes, || path.display().to_string())?;
    }
    Ok(e)
}

/// The check of the chunks a restore mapped from the store's packs, left to run while the
/// guest runs (see `Control::check_while_running`): it owns the packs it mapped, so it reads
/// the very files the guest's memory shows.
#[derive(Debug)]
pub(crate) struct DeferredCheck {
    memories: Vec<(Vec<(u32, Kappa)>, Mapped)>,
}

impl DeferredCheck {
    /// Chunks to check.
    pub(crate) fn chunks(&self) -> usize {
        self.memories
            .iter()
            .map(|(_, m)| m.from.iter().flatten().count())
            .sum()
    }

    /// Reads and hashes every mapped chunk, on up to [`DEFERRED_CHECK_THREADS`] threads; the
    /// first that fails.
    pub(crate) fn run(&self) -> Result<(), StoreError> {
        for (chunks, mapped) in &self.memories {
            // In the packs' order, not the memory's: a memory whose chunks were stored over
            // many snapshots (or pre-write passes) has them scattered through many packs,
            // and reading each pack front to back is what the disk does fast.
            let mut order: Vec<usize> = (0..chunks.len())
                .filter(|&i| mapped.from[i].is_some())
                .collect();
            order.sort_by_key(|&i| mapped.from[i].map(|m| (m.file, m.offset)));
            let chunks: Vec<(u32, Kappa)> = order.iter().map(|&i| chunks[i]).collect();
            let from: Vec<Option<MappedFrom>> = order.iter().map(|&i| mapped.from[i]).collect();
            in_parts(
                &chunks,
                &from,
                DEFERRED_CHECK_THREADS,
                |_| (),
                |part, from, ()| {
                    let mut scratch = Vec::new();
                    let mut n = 0;
                    while n < part.len() {
                        n = match from[n] {
                            None => n + 1,
                            Some(m) => check_mapped_block(mapped, part, from, n, m, &mut scratch)?,
                        };
                    }
                    Ok(())
                },
            )?;
        }
        Ok(())
    }
}

/// Restoring: memories, globals and the saved stack into a fresh instance. With `defer`, the
/// chunks mapped from packs are not checked here: the check is returned, to run while the
/// guest runs (chunks read into memory are always checked as they are read).
pub(crate) fn restore_into(
    inst: &mut dyn Instance,
    loaded: &Loaded,
    store: &dyn Store,
    defer: bool,
) -> Result<Option<DeferredCheck>, EngineError> {
    let mut deferred = DeferredCheck {
        memories: Vec::new(),
    };
    let refuse = |why: String| EngineError::refused(Stage::Restoring, why);
    info!(snapshot = %loaded.kappa, "restoring");
    for (i, image) in loaded.memories.iter().enumerate() {
        let (data, cur) = grow_memory(inst, i, image.len)?;
        // Data segments were applied at instantiation: clear what the snapshot says is zero.
        let mut listed = image.chunks.iter().map(|(i, _)| *i).peekable();
        for idx in 0..(cur / u64::from(CHUNK_SIZE)) as u32 {
            while listed.peek().is_some_and(|&j| j < idx) {
                listed.next();
            }
            if listed.peek() != Some(&idx) {
                let s = idx as usize * CHUNK_SIZE as usize;
                data[s..s + CHUNK_SIZE as usize].fill(0);
            }
        }
        let name = abi::memory_export(i as u32);
        let mapped = map_chunks(inst, &name, &image.chunks, store)?;
        let data = inst.memory_mut(&name).expect("grown above");
        read_chunks(store, &image.chunks, &mapped, data, defer)
            .map_err(|e| refuse(e.to_string()))?;
        if defer && mapped.from.iter().any(Option::is_some) {
            deferred.memories.push((image.chunks.clone(), mapped));
        }
    }
    restore_globals_and_stack(inst, loaded)?;
    Ok((!deferred.memories.is_empty()).then_some(deferred))
}

/// Memory `i` of the instance grown to `len` bytes, and the length it had; refused if it is
/// larger already (a snapshot's memory is never smaller than the instance's: memories only
/// grow, from the module's minimum).
fn grow_memory(
    inst: &mut dyn Instance,
    i: usize,
    len: u64,
) -> Result<(&mut [u8], u64), EngineError> {
    let refuse = |why: String| EngineError::refused(Stage::Restoring, why);
    let name = abi::memory_export(i as u32);
    let cur = inst
        .memory(&name)
        .ok_or_else(|| refuse(format!("module has no memory {i}")))?
        .len() as u64;
    if len < cur {
        return Err(refuse(format!(
            "memory {i} of the snapshot is smaller ({len}) than the instance's ({cur})"
        )));
    }
    inst.grow(&name, (len - cur) / 65536)
        .map_err(|e| refuse(format!("memory {i}: {e}")))?;
    Ok((inst.memory_mut(&name).expect("present above"), cur))
}

fn restore_globals_and_stack(inst: &mut dyn Instance, loaded: &Loaded) -> Result<(), EngineError> {
    let refuse = |why: String| EngineError::refused(Stage::Restoring, why);
    for g in &loaded.snapshot.globals {
        let name = abi::global_export(g.index);
        let v = to_value(g)
            .ok_or_else(|| refuse(format!("global {} has a malformed value", g.index)))?;
        inst.set_global(&name, v)
            .map_err(|e| refuse(format!("global {}: {e}", g.index)))?;
    }
    let need = loaded.stack.len() as u64;
    let have = inst
        .memory(abi::STACK_MEMORY)
        .ok_or_else(|| refuse("module has no saved-stack memory".into()))?
        .len() as u64;
    if need > have {
        inst.grow(abi::STACK_MEMORY, (need - have).div_ceil(65536))
            .map_err(|e| refuse(format!("saved stack: {e}")))?;
    }
    inst.memory_mut(abi::STACK_MEMORY).expect("present above")[..loaded.stack.len()]
        .copy_from_slice(&loaded.stack);
    inst.set_global(abi::SP_GLOBAL, Value::I32(loaded.stack.len() as i32))
        .map_err(refuse)?;
    Ok(())
}

/// Brings an instance restored from `old` forward to `new`, a later snapshot of the same run:
/// only memory chunks whose κ differ are copied (each re-hashed), chunks that became zero are
/// cleared; globals and the saved stack are set as [`restore_into`] does.
pub(crate) fn patch_into(
    inst: &mut dyn Instance,
    old: &Loaded,
    new: &Loaded,
    store: &dyn Store,
) -> Result<(), EngineError> {
    let refuse = |why: String| EngineError::refused(Stage::Restoring, why);
    info!(from = %old.kappa, to = %new.kappa, "bringing the held guest forward");
    if old.memories.len() != new.memories.len() {
        return Err(refuse(
            "the snapshots have different numbers of memories".into(),
        ));
    }
    for (i, (a, b)) in old.memories.iter().zip(&new.memories).enumerate() {
        let (data, _) = grow_memory(inst, i, b.len)?;
        let old_chunks: std::collections::HashMap<u32, Kappa> = a.chunks.iter().copied().collect();
        let changed: Vec<(u32, Kappa)> = b
            .chunks
            .iter()
            .filter(|(idx, k)| old_chunks.get(idx) != Some(k))
            .copied()
            .collect();
        let now: std::collections::HashSet<u32> = b.chunks.iter().map(|(i, _)| *i).collect();
        for (idx, _) in &a.chunks {
            if !now.contains(idx) {
                let s = *idx as usize * CHUNK_SIZE as usize;
                data[s..s + CHUNK_SIZE as usize].fill(0);
            }
        }
        read_chunks(store, &changed, &Mapped::none(changed.len()), data, false)
            .map_err(|e| refuse(e.to_string()))?;
    }
    restore_globals_and_stack(inst, new)
}

/// Names snapshot κ with the ref `snapshot/<hex>` (kept by garbage collection), unless it
/// already is. For snapshots that arrived from elsewhere, once their closure verified.
pub fn name(store: &dyn Store, k: Kappa) -> Result<(), StoreError> {
    let name = format!("snapshot/{}", k.to_hex());
    let current = store.get_ref(&name)?;
    if current.map(|r| r.target) == Some(k) {
        return Ok(());
    }
    store.cas_ref(
        &name,
        current,
        Some(ferry_store::RefValue {
            epoch: 0,
            target: k,
        }),
    )
}
