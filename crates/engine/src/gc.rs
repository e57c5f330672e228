//! Garbage collection: every object no ref reaches is deleted, then packs shared between
//! deleted and live objects are compacted. `ferry store gc` and `--keep` run it alone with
//! the store; a space runs it while it serves, sparing what was written or asked about
//! recently ([`Sweep`]).

use std::collections::BTreeSet;

use ferry_kappa::Kappa;
use ferry_store::{Compacted, Store, StoreError};

use crate::closure::{ClosureError, snapshots_closure};
use crate::prepare::{DERIVED_PREFIX, EXCEPTIONS_PREFIX};

/// How many snapshots of each history a `--keep N` keeps (absent: all of them).
pub fn snapshots_kept(keep: Option<u64>) -> usize {
    keep.map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX))
}

/// What [`collect`] did (or, dry, would do).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Collected {
    /// Objects deleted (or that would be).
    pub removed: usize,
    /// Objects kept because a ref reaches them.
    pub kept: usize,
    /// Objects no ref reaches, kept because [`Sweep::spare`] said so.
    pub spared: usize,
    /// What the compaction did.
    pub compacted: Compacted,
}

/// How [`collect`] deletes, for a store others write to meanwhile.
pub struct Sweep<'a> {
    /// Whether an object no ref reaches stays anyway (a space: written or asked about
    /// recently, so that a snapshot being written or pushed may soon name it).
    pub spare: &'a dyn Fn(&Kappa) -> bool,
    /// Deletes one object, unless something has come to need it since `spare` was asked
    /// (then `Ok(false)`); atomic with respect to whatever would make it needed.
    pub remove: &'a dyn Fn(&Kappa) -> Result<bool, StoreError>,
}

impl std::fmt::Debug for Sweep<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sweep").finish_non_exhaustive()
    }
}

/// Refs `<this><session id>`: a `ferry.tree` (a space's record of what a session's mounts held
/// when its guest stopped), kept with everything under it.
pub const FILES_PREFIX: &str = "files/";

/// Deletes (unless `dry_run`) every object no ref reaches, keeping of each session's and
/// imported snapshot's history the newest `keep(ref name)` snapshots, and modules other
/// versions of ferry instrumented (with their refs) unless a kept snapshot names them, then
/// reclaims the space deleted objects held in packs shared with live ones
/// ([`Store::compact`], copying at most about `compact_budget` bytes). Without a `sweep`,
/// the caller must be alone with the store (objects another process wrote may not be named
/// yet).
pub fn collect(
    store: &dyn Store,
    dry_run: bool,
    keep: &dyn Fn(&str) -> usize,
    compact_budget: u64,
    sweep: Option<&Sweep<'_>>,
) -> Result<Collected, ClosureError> {
    let mut live = BTreeSet::new();
    let current = format!("{DERIVED_PREFIX}{}/", ferry_instrument::INSTRUMENT_VERSION);
    // Refs that go unless the object they name is kept.
    let mut stale = Vec::new();
    for (name, r) in store.list_refs()? {
        if name.starts_with("session/") || name.starts_with("snapshot/") {
            snapshots_closure(store, &r.target, keep(&name), &mut live)?;
        } else if name.starts_with(FILES_PREFIX) {
            // What a space session's mounts held when its guest stopped: a tree.
            crate::closure::tree_closure(store, &r.target, &mut live, 0)?;
        } else if name.starts_with(DERIVED_PREFIX) && !name.starts_with(&current) {
            // A module instrumented by another version of ferry: only a snapshot of that
            // version needs it (which keeps the module), and the ref then vouches for it
            // (`OtherVersions::Derived`), so the ref goes only with the module.
            stale.push((name, r));
        } else if name.starts_with(EXCEPTIONS_PREFIX) {
            // A mark on an instrumented module, which it does not keep.
            stale.push((name, r));
        } else {
            live.insert(r.target);
        }
    }
    let spare = |k: &Kappa| sweep.is_some_and(|s| (s.spare)(k));
    stale.retain(|(_, r)| !live.contains(&r.target) && !spare(&r.target));
    if !dry_run {
        for (name, r) in stale {
            store.cas_ref(&name, Some(r), None)?;
        }
    }
    let mut out = Collected {
        kept: live.len(),
        ..Collected::default()
    };
    for k in store.list()? {
        if live.contains(&k) {
            continue;
        }
        if spare(&k) {
            out.spared += 1;
            continue;
        }
        let gone = match (dry_run, sweep) {
            (true, _) => true,
            (false, Some(s)) => (s.remove)(&k)?,
            (false, None) => {
                store.remove(&k)?;
                true
            }
        };
        if gone {
            out.removed += 1;
        } else {
            out.spared += 1;
        }
    }
    if !dry_run {
        out.compacted = store.compact(compact_budget)?;
    }
    Ok(out)
}
