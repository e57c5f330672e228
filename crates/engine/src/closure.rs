//! The closure of a snapshot: every object it needs, by kind. Used by garbage collection,
//! verification and `inspect`.

use std::collections::BTreeSet;

use ferry_kappa::Kappa;
use ferry_object::{MemoryImage, OutputLog, Snapshot, Tree, WasiState};
use ferry_store::{Store, StoreError};

/// Why a closure walk failed.
#[derive(Debug, thiserror::Error)]
pub enum ClosureError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}: {1}")]
    Object(Kappa, ferry_object::ObjectError),
}

fn decode<T: ferry_object::ObjectKind>(store: &dyn Store, k: &Kappa) -> Result<T, ClosureError> {
    ferry_object::decode(&store.get(k)?).map_err(|e| ClosureError::Object(*k, e))
}

/// The κ of snapshot `k`'s memory chunks in memory order (memory by memory, by address);
/// empty if its snapshot object or memory images cannot be read. An order to move chunks in
/// (see [`moving_order`]), never a check of anything.
pub fn memory_chunks(store: &dyn Store, k: &Kappa) -> Vec<Kappa> {
    let Ok(snapshot) = decode::<Snapshot>(store, k) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for m in &snapshot.memories {
        match decode::<MemoryImage>(store, m) {
            Ok(image) => out.extend(image.chunks.iter().map(|(_, c)| *c)),
            Err(_) => return Vec::new(),
        }
    }
    out
}

/// Orders objects of snapshot `root`'s closure to be moved (push, pull, a capsule): its memory
/// `chunks` first, in the order given — memory order: a receiving store packs them as they
/// come, so a resume there maps long runs of them — then the others by κ, and `root` last (a
/// store never holds a root whose closure is partial). Returns how many chunks lead: batches
/// should not mix them with other objects (chunks alone are packed block-aligned, mappable).
pub fn moving_order(
    root: &Kappa,
    chunks: impl IntoIterator<Item = Kappa>,
    objects: &mut [Kappa],
) -> usize {
    let at: std::collections::HashMap<Kappa, usize> = chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c, i))
        .collect();
    objects.sort_by_key(|m| (m == root, at.get(m).copied().unwrap_or(usize::MAX), *m));
    objects.iter().take_while(|m| at.contains_key(m)).count()
}

/// Adds the closure of snapshot κ to `out` (its parents too when `with_history`).
pub fn snapshot_closure(
    store: &dyn Store,
    k: &Kappa,
    with_history: bool,
    out: &mut BTreeSet<Kappa>,
) -> Result<(), ClosureError> {
    let snapshots = if with_history { usize::MAX } else { 1 };
    snapshots_closure(store, k, snapshots, out)
}

/// Adds the closure of snapshot κ and of its ancestors to `out`, `snapshots` snapshots in all
/// (1: κ alone). History already pruned ends the walk: a parent no longer stored, or one
/// stored without all of its objects (a collection that spared the snapshot object, written
/// or asked about recently, but not its chunks) — only κ's own closure must be whole.
pub fn snapshots_closure(
    store: &dyn Store,
    k: &Kappa,
    snapshots: usize,
    out: &mut BTreeSet<Kappa>,
) -> Result<(), ClosureError> {
    let mut next = one_closure(store, k, out)?;
    let mut left = snapshots.saturating_sub(1);
    while let Some(p) = next.take() {
        if left == 0 || out.contains(&p) {
            break;
        }
        left -= 1;
        let mut theirs = BTreeSet::new();
        match one_closure(store, &p, &mut theirs) {
            Ok(parent) => next = parent,
            Err(_) => break,
        }
        out.extend(theirs);
    }
    Ok(())
}

/// Adds the closure of snapshot κ alone (no ancestors) to `out`; returns its parent if that
/// is still stored.
fn one_closure(
    store: &dyn Store,
    k: &Kappa,
    out: &mut BTreeSet<Kappa>,
) -> Result<Option<Kappa>, ClosureError> {
    out.insert(*k);
    let s: Snapshot = decode(store, k)?;
    out.extend([s.module, s.instrumented, s.stack, s.wasi]);
    for m in &s.memories {
        out.insert(*m);
        let img: MemoryImage = decode(store, m)?;
        out.extend(img.chunks.iter().map(|(_, c)| *c));
    }
    if let Some(o) = &s.output {
        out.insert(*o);
        let log: OutputLog = decode(store, o)?;
        out.extend(log.chunks.iter().copied());
    }
    let w: WasiState = decode(store, &s.wasi)?;
    for m in &w.mounts {
        tree_closure(store, &m.tree, out, 0)?;
    }
    // Files (and directories) the guest held open after no path named them.
    for (_, f) in &w.fds {
        if let Some(t) = &f.unnamed {
            tree_closure(store, t, out, 0)?;
        }
    }
    if let Some(k) = w.stdin_input {
        out.insert(k);
        // Input over 1 MiB, in pieces.
        if w.stdin_chunked {
            let f: ferry_object::FileChunks = decode(store, &k)?;
            out.extend(f.chunks);
        }
    }
    Ok(s.parent.filter(|p| store.has(p).unwrap_or(false)))
}

pub fn tree_closure(
    store: &dyn Store,
    k: &Kappa,
    out: &mut BTreeSet<Kappa>,
    depth: usize,
) -> Result<(), ClosureError> {
    if !out.insert(*k) || depth > ferry_wasi::tree::MAX_DEPTH {
        return Ok(());
    }
    let t: Tree = decode(store, k)?;
    for e in t.entries.values() {
        if e.mode == ferry_object::MODE_DIR {
            tree_closure(store, &e.object, out, depth + 1)?;
        } else if e.chunked() && out.insert(e.object) {
            let f: ferry_object::FileChunks = decode(store, &e.object)?;
            out.extend(f.chunks);
        } else {
            out.insert(e.object);
        }
    }
    Ok(())
}
