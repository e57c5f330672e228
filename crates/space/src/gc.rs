//! Garbage collection while a space serves.
//!
//! `ferry store gc` needs the store to itself because an object written a moment ago may not
//! be named by a ref yet: a snapshot's chunks are stored before the snapshot is named, and a
//! push stores its objects (after asking which are missing) before it names the snapshot. A
//! space sees every such write and question, so it can collect while it serves: its store is
//! a [`Recording`] store, which notes every object stored, found present or asked about;
//! collection spares what was noted, or written to disk, within the grace period, and deletes
//! each other object only while no such note can be taken ([`Recording::remove_unless_noted`]),
//! so an object is never deleted between the moment a writer learns it is there and the
//! moment the writer names it — as long as that takes less than the grace period.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use ferry_engine::gc::{Collected, Sweep, collect};
use ferry_kappa::Kappa;
use ferry_store::{Compacted, FsStore, Location, RefValue, Store, StoreError};

/// Notes kept before old ones are dropped (outside a collection, which drops them too).
const MAX_NOTES: usize = 1 << 20;

/// A space's store: an [`FsStore`] that notes when each object was last stored, found
/// present or asked about (see the module documentation).
#[derive(Debug)]
pub struct Recording {
    inner: Arc<FsStore>,
    grace: Duration,
    /// Taken shared by every call that notes, exclusive to delete one object.
    gate: RwLock<()>,
    notes: Mutex<HashMap<Kappa, Instant>>,
}

impl Recording {
    pub fn new(inner: Arc<FsStore>, grace: Duration) -> Self {
        Self {
            inner,
            grace,
            gate: RwLock::new(()),
            notes: Mutex::new(HashMap::new()),
        }
    }

    fn notes(&self) -> std::sync::MutexGuard<'_, HashMap<Kappa, Instant>> {
        self.notes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops the notes older than the grace period.
    fn forget_old(&self, notes: &mut HashMap<Kappa, Instant>) {
        notes.retain(|_, t| t.elapsed() < self.grace);
    }

    fn note(&self, ks: &[Kappa]) {
        let now = Instant::now();
        let mut notes = self.notes();
        if notes.len() >= MAX_NOTES {
            self.forget_old(&mut notes);
        }
        for k in ks {
            notes.insert(*k, now);
        }
    }

    fn noted(&self, k: &Kappa) -> bool {
        self.notes()
            .get(k)
            .is_some_and(|t| t.elapsed() < self.grace)
    }

    /// Whether `k` was noted, or written to disk, within the grace period.
    fn recent(&self, k: &Kappa) -> bool {
        self.noted(k)
            || self.inner.written_at(k).is_some_and(|t| {
                SystemTime::now()
                    .duration_since(t)
                    .map_or(true, |age| age < self.grace)
            })
    }

    /// Deletes `k` unless it was noted within the grace period; no note can be taken
    /// meanwhile (a writer that found `k` present has noted it before this looks).
    fn remove_unless_noted(&self, k: &Kappa) -> Result<bool, StoreError> {
        let _alone = self.gate.write().unwrap_or_else(|p| p.into_inner());
        if self.noted(k) {
            return Ok(false);
        }
        self.inner.remove(k)?;
        Ok(true)
    }

    /// Collects garbage while the space serves: what no ref reaches, keeping the newest
    /// `keep` snapshots of each session's and named snapshot's history (all: `usize::MAX`),
    /// and sparing what was written or asked about within the grace period. `None` when
    /// another process has the store open (`ferry store gc` there).
    pub fn collect(&self, dry_run: bool, keep: usize) -> Result<Option<Collected>, String> {
        self.forget_old(&mut self.notes());
        let sweep = Sweep {
            spare: &|k| self.recent(k),
            remove: &|k| self.remove_unless_noted(k),
        };
        match self
            .inner
            // Walked through the inner store: the walk's own questions are not notes.
            .alone(|| {
                collect(
                    self.inner.as_ref(),
                    dry_run,
                    &|_| keep,
                    u64::MAX,
                    Some(&sweep),
                )
            }) {
            Ok(Some(Ok(c))) => Ok(Some(c)),
            Ok(Some(Err(e))) => Err(e.to_string()),
            Ok(None) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl Store for Recording {
    fn put(&self, bytes: &[u8]) -> Result<Kappa, StoreError> {
        let _g = self.gate.read().unwrap_or_else(|p| p.into_inner());
        let k = self.inner.put(bytes)?;
        self.note(&[k]);
        Ok(k)
    }

    fn put_many(&self, blobs: &[&[u8]]) -> Result<Vec<Kappa>, StoreError> {
        let _g = self.gate.read().unwrap_or_else(|p| p.into_inner());
        let ks = self.inner.put_many(blobs)?;
        self.note(&ks);
        Ok(ks)
    }

    fn put_hashed(&self, objects: &[ferry_store::Hashed<'_>]) -> Result<(), StoreError> {
        let _g = self.gate.read().unwrap_or_else(|p| p.into_inner());
        self.inner.put_hashed(objects)?;
        let ks: Vec<Kappa> = objects.iter().map(ferry_store::Hashed::kappa).collect();
        self.note(&ks);
        Ok(())
    }

    fn has(&self, kappa: &Kappa) -> Result<bool, StoreError> {
        let _g = self.gate.read().unwrap_or_else(|p| p.into_inner());
        let there = self.inner.has(kappa)?;
        if there {
            self.note(&[*kappa]);
        }
        Ok(there)
    }

    fn get(&self, kappa: &Kappa) -> Result<Vec<u8>, StoreError> {
        self.inner.get(kappa)
    }

    fn list(&self) -> Result<Vec<Kappa>, StoreError> {
        self.inner.list()
    }

    fn remove(&self, kappa: &Kappa) -> Result<(), StoreError> {
        self.remove_unless_noted(kappa).map(drop)
    }

    fn get_ref(&self, name: &str) -> Result<Option<RefValue>, StoreError> {
        self.inner.get_ref(name)
    }

    fn cas_ref(
        &self,
        name: &str,
        expected: Option<RefValue>,
        new: Option<RefValue>,
    ) -> Result<(), StoreError> {
        self.inner.cas_ref(name, expected, new)
    }

    fn list_refs(&self) -> Result<Vec<(String, RefValue)>, StoreError> {
        self.inner.list_refs()
    }

    fn read_into(&self, kappa: &Kappa, out: &mut [u8]) -> Result<(), StoreError> {
        self.inner.read_into(kappa, out)
    }

    fn stored_at(&self, kappa: &Kappa) -> Option<Location> {
        self.inner.stored_at(kappa)
    }

    fn check(&self, kappa: &Kappa) -> Result<(), StoreError> {
        self.inner.check(kappa)
    }

    fn problems(&self) -> Vec<String> {
        self.inner.problems()
    }

    fn load_cache(&self, name: &str) -> Option<Vec<u8>> {
        self.inner.load_cache(name)
    }

    fn save_cache(&self, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
        self.inner.save_cache(name, bytes)
    }

    fn compact(&self, budget: u64) -> Result<Compacted, StoreError> {
        self.inner.compact(budget)
    }

    fn sync(&self) -> Result<(), StoreError> {
        self.inner.sync()
    }

    fn resolve(&self, prefix: &str) -> Result<Kappa, StoreError> {
        self.inner.resolve(prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_millis(400);

    fn recording(dir: &std::path::Path) -> Recording {
        Recording::new(Arc::new(FsStore::open(dir).unwrap()), GRACE)
    }

    fn name(store: &Recording, k: Kappa) {
        store
            .cas_ref(
                &format!("derived/test/{}", k.to_hex()),
                None,
                Some(RefValue {
                    epoch: 0,
                    target: k,
                }),
            )
            .unwrap();
    }

    /// What no ref reaches goes once the grace period is over, unless it was written, found
    /// present or asked about within it; what a ref reaches stays.
    #[test]
    fn spares_what_was_written_or_asked_about_within_the_grace_period() {
        let dir = tempfile::tempdir().unwrap();
        let store = recording(dir.path());
        let named = store.put(b"named").unwrap();
        name(&store, named);
        let old = store.put(b"old").unwrap();
        let asked = store.put(b"asked about").unwrap();
        let stored_again = store.put(b"stored again").unwrap();
        // Written just now: spared.
        let c = store.collect(false, usize::MAX).unwrap().unwrap();
        assert_eq!((c.removed, c.spared), (0, 3), "{c:?}");
        std::thread::sleep(GRACE + Duration::from_millis(100));
        // A push asks which objects are missing, a snapshot stores chunks it already has.
        assert!(store.has(&asked).unwrap());
        assert_eq!(store.put(b"stored again").unwrap(), stored_again);
        let dry = store.collect(true, usize::MAX).unwrap().unwrap();
        assert_eq!((dry.removed, dry.spared), (1, 2), "{dry:?}");
        assert!(store.inner.has(&old).unwrap(), "a dry run deletes nothing");
        let c = store.collect(false, usize::MAX).unwrap().unwrap();
        assert_eq!((c.removed, c.kept, c.spared), (1, 1, 2), "{c:?}");
        assert!(!store.inner.has(&old).unwrap());
        for k in [named, asked, stored_again] {
            assert!(store.inner.has(&k).unwrap(), "{k}");
        }
        std::thread::sleep(GRACE + Duration::from_millis(100));
        let c = store.collect(false, usize::MAX).unwrap().unwrap();
        assert_eq!((c.removed, c.kept, c.spared), (2, 1, 0), "{c:?}");
    }

    /// An object noted after collection decided it was garbage, but before it was deleted,
    /// stays: the deletion looks again while no note can be taken.
    #[test]
    fn a_note_taken_during_the_sweep_wins() {
        let dir = tempfile::tempdir().unwrap();
        let store = recording(dir.path());
        let k = store.put(b"contended").unwrap();
        std::thread::sleep(GRACE + Duration::from_millis(100));
        assert!(!store.recent(&k), "old enough to go");
        assert!(store.has(&k).unwrap(), "a writer finds it present");
        assert!(!store.remove_unless_noted(&k).unwrap(), "so it stays");
        assert!(store.inner.has(&k).unwrap());
    }

    /// Collection needs the store to itself among processes, as `ferry store gc` does.
    #[test]
    fn refused_while_another_handle_has_the_store_open() {
        let dir = tempfile::tempdir().unwrap();
        let store = recording(dir.path());
        let other = FsStore::open(dir.path()).unwrap();
        assert_eq!(store.collect(false, usize::MAX).unwrap(), None);
        drop(other);
        assert!(store.collect(false, usize::MAX).unwrap().is_some());
    }
}
