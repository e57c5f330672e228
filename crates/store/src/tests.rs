//! The store contract, run against every implementation.

use super::*;
use proptest::prelude::*;

fn stores() -> Vec<(Box<dyn Store>, tempfile::TempDir)> {
    let dir = tempfile::tempdir().expect("temp dir");
    let fs = FsStore::open(dir.path().join("store")).expect("open fs store");
    let dir2 = tempfile::tempdir().expect("temp dir");
    vec![(Box::new(MemStore::new()), dir2), (Box::new(fs), dir)]
}

#[test]
fn put_get_is_identity_and_idempotent() {
    for (s, _d) in stores() {
        let k = s.put(b"hello").unwrap();
        assert_eq!(k, Kappa::of(b"hello"));
        assert_eq!(s.put(b"hello").unwrap(), k);
        assert_eq!(s.get(&k).unwrap(), b"hello");
        assert!(s.has(&k).unwrap());
        assert_eq!(s.list().unwrap(), vec![k]);
        let missing = Kappa::of(b"nope");
        assert!(matches!(s.get(&missing), Err(StoreError::NotFound(m)) if m == missing));
        s.remove(&k).unwrap();
        s.remove(&k).unwrap();
        assert!(!s.has(&k).unwrap());
    }
}

#[test]
fn prefix_resolution() {
    for (s, _d) in stores() {
        let k = s.put(b"abc").unwrap();
        assert_eq!(s.resolve(&k.fmt_short()).unwrap(), k);
        assert_eq!(s.resolve(&k.to_string()).unwrap(), k);
        assert!(matches!(s.resolve("xyz"), Err(StoreError::BadPrefix(_))));
        let other = if k.to_hex().starts_with("0000") {
            "ffff"
        } else {
            "0000"
        };
        assert!(matches!(s.resolve(other), Err(StoreError::NoMatch(_))));
    }
}

#[test]
fn refs_compare_and_swap() {
    for (s, _d) in stores() {
        let a = RefValue {
            epoch: 1,
            target: Kappa::of(b"a"),
        };
        let b = RefValue {
            epoch: 2,
            target: Kappa::of(b"b"),
        };
        assert_eq!(s.get_ref("session/x").unwrap(), None);
        s.cas_ref("session/x", None, Some(a)).unwrap();
        assert!(matches!(
            s.cas_ref("session/x", None, Some(b)),
            Err(StoreError::CasMismatch { .. })
        ));
        s.cas_ref("session/x", Some(a), Some(b)).unwrap();
        assert_eq!(s.get_ref("session/x").unwrap(), Some(b));
        assert_eq!(s.list_refs().unwrap(), vec![("session/x".to_owned(), b)]);
        s.cas_ref("session/x", Some(b), None).unwrap();
        assert_eq!(s.get_ref("session/x").unwrap(), None);
        assert!(matches!(
            s.get_ref("../escape"),
            Err(StoreError::BadRefName(_))
        ));
    }
}

#[test]
fn fs_store_detects_corruption_and_truncation() {
    let dir = tempfile::tempdir().unwrap();
    let s = FsStore::open(dir.path()).unwrap();
    let k = s.put(b"precious bytes").unwrap();
    let p = s.object_path(&k);
    std::fs::write(&p, b"precious bytez").unwrap();
    assert!(matches!(s.get(&k), Err(StoreError::Corrupt { .. })));
    std::fs::write(&p, b"precious").unwrap();
    assert!(matches!(s.get(&k), Err(StoreError::Corrupt { .. })));
}

#[test]
fn mem_store_detects_corruption() {
    let s = MemStore::new();
    let k = s.put(b"x").unwrap();
    s.corrupt_for_test(&k, b"y".to_vec());
    assert!(matches!(s.get(&k), Err(StoreError::Corrupt { .. })));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn any_blobs_round_trip(blobs in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..8)) {
        for (s, _d) in stores() {
            let ks: Vec<_> = blobs.iter().map(|b| s.put(b).unwrap()).collect();
            for (k, b) in ks.iter().zip(&blobs) {
                prop_assert_eq!(&s.get(k).unwrap(), b);
            }
            let mut uniq = ks.clone();
            uniq.sort();
            uniq.dedup();
            prop_assert_eq!(s.list().unwrap(), uniq);
        }
    }
}
