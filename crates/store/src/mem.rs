//! The reference store: everything in memory behind one lock.

use std::collections::BTreeMap;
use std::sync::Mutex;

use ferry_kappa::Kappa;

use crate::{RefValue, Store, StoreError, check_cas, check_ref_name};

/// In-memory store; the simplest correct implementation of the [`Store`] contract.
#[derive(Debug, Default)]
pub struct MemStore {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    objects: BTreeMap<Kappa, Vec<u8>>,
    refs: BTreeMap<String, RefValue>,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the bytes under κ without checking them: for corruption tests only.
    pub fn corrupt_for_test(&self, kappa: &Kappa, bytes: Vec<u8>) {
        self.lock().objects.insert(*kappa, bytes);
    }
}

impl Store for MemStore {
    fn put(&self, bytes: &[u8]) -> Result<Kappa, StoreError> {
        let k = Kappa::of(bytes);
        self.lock()
            .objects
            .entry(k)
            .or_insert_with(|| bytes.to_vec());
        Ok(k)
    }

    fn get(&self, kappa: &Kappa) -> Result<Vec<u8>, StoreError> {
        let bytes = self
            .lock()
            .objects
            .get(kappa)
            .cloned()
            .ok_or(StoreError::NotFound(*kappa))?;
        StoreError::check_hash(kappa, &bytes, || "memory".into())?;
        Ok(bytes)
    }

    fn put_hashed(&self, objects: &[crate::Hashed<'_>]) -> Result<(), StoreError> {
        let mut inner = self.lock();
        for o in objects {
            inner
                .objects
                .entry(o.kappa())
                .or_insert_with(|| o.bytes().to_vec());
        }
        Ok(())
    }

    fn has(&self, kappa: &Kappa) -> Result<bool, StoreError> {
        Ok(self.lock().objects.contains_key(kappa))
    }

    fn len_of(&self, kappa: &Kappa) -> Option<u64> {
        self.lock().objects.get(kappa).map(|b| b.len() as u64)
    }

    fn list(&self) -> Result<Vec<Kappa>, StoreError> {
        Ok(self.lock().objects.keys().copied().collect())
    }

    fn remove(&self, kappa: &Kappa) -> Result<(), StoreError> {
        self.lock().objects.remove(kappa);
        Ok(())
    }

    fn get_ref(&self, name: &str) -> Result<Option<RefValue>, StoreError> {
        check_ref_name(name)?;
        Ok(self.lock().refs.get(name).copied())
    }

    fn cas_ref(
        &self,
        name: &str,
        expected: Option<RefValue>,
        new: Option<RefValue>,
    ) -> Result<(), StoreError> {
        check_ref_name(name)?;
        let mut inner = self.lock();
        let current = inner.refs.get(name).copied();
        check_cas(name, expected, current)?;
        match new {
            Some(v) => inner.refs.insert(name.to_owned(), v),
            None => inner.refs.remove(name),
        };
        Ok(())
    }

    fn list_refs(&self) -> Result<Vec<(String, RefValue)>, StoreError> {
        Ok(self
            .lock()
            .refs
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect())
    }
}
