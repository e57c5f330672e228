//! The store contract, run against every implementation.

use super::*;
use proptest::prelude::*;

/// Every implementation: the reference, the on-disk store, and the on-disk store with zstd.
fn stores() -> Vec<(Box<dyn Store>, tempfile::TempDir)> {
    let dir = tempfile::tempdir().expect("temp dir");
    let fs = FsStore::open(dir.path().join("store")).expect("open fs store");
    let dir2 = tempfile::tempdir().expect("temp dir");
    let dir3 = tempfile::tempdir().expect("temp dir");
    let zst = FsStore::open(dir3.path().join("store"))
        .expect("open fs store")
        .with_zstd(3);
    vec![
        (Box::new(MemStore::new()), dir2),
        (Box::new(fs), dir),
        (Box::new(zst), dir3),
    ]
}

/// A process that has the store open can collect garbage only while no other has it open;
/// either way it keeps its own shared hold, so an exclusive open stays refused after.
#[test]
fn alone_runs_only_without_other_handles() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let mine = FsStore::open(&root).unwrap();
    let other = FsStore::open(&root).unwrap();
    assert_eq!(mine.alone(|| 1).unwrap(), None, "another handle is open");
    drop(other);
    assert_eq!(mine.alone(|| 2).unwrap(), Some(2));
    assert!(matches!(
        FsStore::open_exclusive(&root),
        Err(StoreError::InUse(_))
    ));
}

/// Garbage collection opens the store alone: refused while another handle is open, and a
/// handle opened meanwhile waits (saying so) until the collection is done.
#[test]
fn an_exclusive_open_excludes_every_other() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let shared = FsStore::open(&root).unwrap();
    let also = FsStore::open(&root).unwrap();
    assert!(matches!(
        FsStore::open_exclusive(&root),
        Err(StoreError::InUse(_))
    ));
    drop((shared, also));
    let gc = FsStore::open_exclusive(&root).unwrap();
    let waited = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let opener = s.spawn(|| {
            FsStore::open_waiting(&root, &|| {
                waited.store(true, std::sync::atomic::Ordering::SeqCst)
            })
            .map(|_| ())
        });
        while !waited.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!opener.is_finished(), "opened while the collection ran");
        drop(gc);
        opener.join().unwrap().unwrap();
    });
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
fn check_agrees_with_get() {
    for (s, _d) in stores() {
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        for bytes in [&b"small"[..], &big] {
            let k = s.put(bytes).unwrap();
            s.check(&k).unwrap();
        }
        let missing = Kappa::of(b"absent");
        assert!(matches!(s.check(&missing), Err(StoreError::NotFound(m)) if m == missing));
    }
    // Damaged loose objects, raw and compressed: refused as `get` refuses them.
    let dir = tempfile::tempdir().unwrap();
    for s in [
        FsStore::open(dir.path().join("raw")).unwrap(),
        FsStore::open(dir.path().join("zst")).unwrap().with_zstd(3),
    ] {
        let bytes = vec![42u8; 2_000_000];
        let k = s.put(&bytes).unwrap();
        let p = s.object_path(&k);
        let p = if p.exists() {
            p
        } else {
            p.with_file_name(format!("{}.zst", p.file_name().unwrap().to_string_lossy()))
        };
        let mut stored = std::fs::read(&p).unwrap();
        let n = stored.len();
        stored[n / 2] ^= 1;
        std::fs::write(&p, &stored).unwrap();
        assert!(matches!(s.get(&k), Err(StoreError::Corrupt { .. })));
        assert!(
            matches!(s.check(&k), Err(StoreError::Corrupt { .. })),
            "{p:?}"
        );
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

#[test]
fn put_many_and_read_into_follow_the_contract() {
    for (s, _d) in stores() {
        let blobs: Vec<Vec<u8>> = (0..200u32).map(|i| vec![(i % 50) as u8; 1000]).collect();
        let refs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
        let ks = s.put_many(&refs).unwrap();
        assert_eq!(ks.len(), 200);
        for (k, b) in ks.iter().zip(&blobs) {
            assert_eq!(*k, Kappa::of(b));
            let mut out = vec![0; b.len()];
            s.read_into(k, &mut out).unwrap();
            assert_eq!(&out, b);
            assert_eq!(&s.get(k).unwrap(), b);
        }
        let mut wrong = vec![0; 10];
        assert!(matches!(
            s.read_into(&ks[0], &mut wrong),
            Err(StoreError::WrongLength { .. })
        ));
        assert_eq!(s.list().unwrap().len(), 50, "duplicates stored once");
        // A second batch of the same blobs writes nothing new.
        assert_eq!(s.put_many(&refs).unwrap(), ks);
        assert_eq!(s.list().unwrap().len(), 50);
        for k in &ks {
            s.remove(k).unwrap();
        }
        assert!(s.list().unwrap().is_empty());
    }
}

/// A store says an object's length without reading it where it can (a pack's index, a raw
/// loose file); a compressed loose object's it may not know, and it never makes one up.
#[test]
fn len_of_is_the_length_or_nothing() {
    for (s, _d) in stores() {
        let loose = s.put(&[7u8; 3000]).unwrap();
        let packed = s.put_many(&[&[8u8; 5000][..], &[9u8; 70_000][..]]).unwrap();
        for (k, len) in [(loose, 3000), (packed[0], 5000), (packed[1], 70_000)] {
            if let Some(n) = s.len_of(&k) {
                assert_eq!(n, len);
            }
        }
        assert_eq!(s.len_of(&packed[1]), Some(70_000), "a packed object");
        assert_eq!(s.len_of(&Kappa::of(b"absent")), None);
    }
}

/// Objects received with their κ are checked once ([`Hashed::check_all`]) and stored without
/// hashing again; one that does not hash to its κ is refused before anything is stored.
#[test]
fn hashed_objects_are_checked_once_and_stored_as_put_many_would() {
    // 100 chunks of 64 KiB (above the direct-I/O threshold), in an ordinary buffer: an
    // on-disk store stages them into block-aligned memory, with the κ it was given.
    let blobs: Vec<Vec<u8>> = (0..100u32)
        .map(|i| {
            (0..65536u32)
                .map(|j| (i.wrapping_mul(31) ^ j.wrapping_mul(7)) as u8)
                .collect()
        })
        .collect();
    let claimed: Vec<(Kappa, &[u8])> = blobs.iter().map(|b| (Kappa::of(b), b.as_slice())).collect();
    let mut forged = claimed.clone();
    forged[57].0 = Kappa::of(b"something else");
    match Hashed::check_all(&forged, "test") {
        Err(StoreError::Corrupt { kappa, actual, .. }) => {
            assert_eq!((kappa, actual), (forged[57].0, claimed[57].0));
        }
        other => panic!("{other:?}"),
    }
    let checked = Hashed::check_all(&claimed, "test").unwrap();
    for (s, _d) in stores() {
        s.put_hashed(&checked).unwrap();
        s.put_hashed(&checked[..3]).unwrap();
        let mut listed = s.list().unwrap();
        listed.sort();
        let mut want: Vec<Kappa> = claimed.iter().map(|c| c.0).collect();
        want.sort();
        assert_eq!(listed, want, "{s:?}");
        for (k, b) in &claimed {
            assert_eq!(&s.get(k).unwrap(), b);
        }
    }
}

/// 64 KiB of block-aligned memory, as a guest's memory chunk is.
#[repr(C, align(4096))]
struct Chunk([u8; 65536]);

#[test]
fn large_aligned_batches_go_to_disk_directly_and_read_back_the_same() {
    // 96 chunks (6 MiB, above the direct-I/O threshold), 80 distinct.
    let chunks: Vec<Chunk> = (0..96u32)
        .map(|i| {
            let mut c = Chunk([0; 65536]);
            for (j, w) in c.0.chunks_mut(4).enumerate() {
                w.copy_from_slice(&((i % 80) * 7919 + j as u32).to_le_bytes());
            }
            c
        })
        .collect();
    let refs: Vec<&[u8]> = chunks.iter().map(|c| c.0.as_slice()).collect();
    let dir = tempfile::tempdir().unwrap();
    let direct = FsStore::open(dir.path().join("direct")).unwrap();
    let buffered = FsStore::open(dir.path().join("buffered"))
        .unwrap()
        .without_direct_io();
    let ks = direct.put_many(&refs).unwrap();
    assert!(
        direct.direct_io(),
        "the file system under {} refused O_DIRECT",
        dir.path().display()
    );
    assert_eq!(buffered.put_many(&refs).unwrap(), ks, "same κ either way");
    for (k, b) in ks.iter().zip(&refs) {
        assert_eq!(*k, Kappa::of(b));
    }
    assert_eq!(direct.list().unwrap(), buffered.list().unwrap());
    assert_eq!(direct.list().unwrap().len(), 80, "duplicates stored once");

    // One pack: a 4 KiB header, then the 80 distinct chunks, each on a block boundary (the
    // file reserved up front is cut to that length).
    let packs = dir.path().join("direct/packs");
    let files: Vec<_> = std::fs::read_dir(&packs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 2, "{files:?}");
    let pack = files
        .iter()
        .find(|p| p.extension().unwrap() == "pack")
        .unwrap();
    let bytes = std::fs::read(pack).unwrap();
    assert_eq!(bytes.len(), 4096 + 80 * 65536);
    assert_eq!(&bytes[..8], b"FERRYPCK");
    let idx = std::fs::read(pack.with_extension("idx")).unwrap();
    let entries = pack::decode_index(pack, &idx, bytes.len() as u64).unwrap();
    assert!(entries.iter().all(|e| e.1 % 4096 == 0 && e.2 == 65536));
    assert!(
        dir.path()
            .join("direct/tmp")
            .read_dir()
            .unwrap()
            .next()
            .is_none()
    );

    // Read back, also after reopening; a second batch of the same chunks writes nothing.
    let reopened = FsStore::open(dir.path().join("direct")).unwrap();
    for (k, b) in ks.iter().zip(&refs) {
        let mut out = vec![0; 65536];
        reopened.read_into(k, &mut out).unwrap();
        assert_eq!(&out, b);
    }
    assert_eq!(reopened.put_many(&refs).unwrap(), ks);
    assert_eq!(std::fs::read_dir(&packs).unwrap().count(), 2);

    // Where each chunk lies, for a resume to map: block-aligned in the pack, exactly its
    // bytes. The page-cache pack has them at unaligned offsets (the 12-byte header); a store
    // without packs (memory) says nothing.
    for (k, b) in ks.iter().zip(&refs) {
        let l = reopened.stored_at(k).expect("packed as it is");
        assert_eq!((l.file.as_path(), l.len), (pack.as_path(), 65536));
        assert_eq!(l.offset % 4096, 0);
        assert_eq!(&bytes[l.offset as usize..][..65536], *b);
        let l = buffered.stored_at(k).expect("packed as it is");
        assert_eq!(l.offset % 65536, 12);
    }
    // Blobs in ordinary, unaligned buffers (a pull's batch) are packed block-aligned too.
    let mut unaligned = vec![0u8; 1 + 80 * 65536];
    for (i, c) in chunks[..80].iter().enumerate() {
        unaligned[1 + i * 65536..][..65536].copy_from_slice(&c.0);
    }
    let uref: Vec<&[u8]> = unaligned[1..].chunks(65536).collect();
    let other = FsStore::open(dir.path().join("other")).unwrap();
    assert_eq!(other.put_many(&uref).unwrap(), ks[..80]);
    for (k, b) in ks[..80].iter().zip(&uref) {
        let l = other.stored_at(k).expect("packed");
        assert_eq!(l.offset % 4096, 0);
        assert_eq!(&other.get(k).unwrap(), b);
    }
    let mem = MemStore::new();
    mem.put_many(&refs).unwrap();
    assert_eq!(mem.stored_at(&ks[0]), None);
    assert_eq!(reopened.stored_at(&Kappa::of(b"absent")), None);
}

#[test]
fn a_full_disk_during_a_direct_batch_stores_nothing() {
    let chunks: Vec<Chunk> = (0..128u8).map(|i| Chunk([i; 65536])).collect();
    let refs: Vec<&[u8]> = chunks.iter().map(|c| c.0.as_slice()).collect();
    let dir = tempfile::tempdir().unwrap();
    let s = FsStore::open(dir.path()).unwrap();
    s.fail_writes_after(100);
    let e = s.put_many(&refs).unwrap_err();
    assert!(e.to_string().contains("No space left"), "{e}");
    assert!(s.list().unwrap().is_empty());
    assert!(
        dir.path()
            .join("packs")
            .read_dir()
            .unwrap()
            .next()
            .is_none()
    );
    assert!(dir.path().join("tmp").read_dir().unwrap().next().is_none());
    assert!(s.direct_io(), "a full disk is not a refusal of direct I/O");
    s.fail_writes_after(u64::MAX);
    let ks = s.put_many(&refs).unwrap();
    assert_eq!(s.get(&ks[127]).unwrap(), refs[127]);
}

#[test]
fn packs_survive_reopening_and_corruption_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let blobs: Vec<Vec<u8>> = (0..100u32).map(|i| i.to_le_bytes().repeat(100)).collect();
    let refs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
    let ks = FsStore::open(dir.path()).unwrap().put_many(&refs).unwrap();
    let s = FsStore::open(dir.path()).unwrap();
    assert_eq!(s.get(&ks[7]).unwrap(), blobs[7]);
    let pack = std::fs::read_dir(dir.path().join("packs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "pack"))
        .unwrap();
    let mut bytes = std::fs::read(&pack).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    std::fs::write(&pack, &bytes).unwrap();
    assert!(matches!(s.get(&ks[99]), Err(StoreError::Corrupt { .. })));
    assert_eq!(s.get(&ks[0]).unwrap(), blobs[0], "other objects still read");
    // A truncated pack: its objects count as missing and the damage is reported.
    std::fs::write(&pack, &bytes[..n / 2]).unwrap();
    let s = FsStore::open(dir.path()).unwrap();
    assert!(matches!(s.get(&ks[0]), Err(StoreError::NotFound(_))));
    assert_eq!(s.problems().len(), 1, "{:?}", s.problems());
}

/// Bytes of every pack and index under `dir`.
fn pack_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir.join("packs"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// `n` distinct 64 KiB chunks (memory-chunk sized: packed block-aligned).
fn chunks(n: u32, seed: u32) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| (i + seed * 1000).to_le_bytes().repeat(1 << 14))
        .collect()
}

/// `blobs` stored together (one pack).
fn put_batch(s: &FsStore, blobs: &[Vec<u8>]) -> Vec<Kappa> {
    s.put_many(&blobs.iter().map(Vec::as_slice).collect::<Vec<_>>())
        .unwrap()
}

#[test]
fn compaction_frees_what_removed_objects_held_in_shared_packs() {
    let dir = tempfile::tempdir().unwrap();
    let s = FsStore::open(dir.path()).unwrap();
    // Two batches, two packs; most of the first batch and a few of the second removed.
    let (a, b) = (chunks(64, 1), chunks(64, 2));
    let (ka, kb) = (put_batch(&s, &a), put_batch(&s, &b));
    for k in ka.iter().skip(8).chain(kb.iter().take(4)) {
        s.remove(k).unwrap();
    }
    let before = pack_bytes(dir.path());
    assert!(
        before > 128 << 16,
        "removing some objects frees nothing yet"
    );
    let done = s.compact(u64::MAX).unwrap();
    assert_eq!(done.files, 1, "only the mostly dead pack is rewritten");
    let after = pack_bytes(dir.path());
    assert!(after < before - (50 << 16), "{before} -> {after}");
    assert_eq!(before - after, done.freed);
    let check = |s: &FsStore| {
        for (k, bytes) in ka.iter().zip(&a).take(8).chain(kb.iter().zip(&b).skip(4)) {
            assert_eq!(&s.get(k).unwrap(), bytes);
            let at = s.stored_at(k).expect("still mappable");
            assert!(at.offset.is_multiple_of(4096), "block-aligned: {at:?}");
        }
        // Those removed from the pack kept whole too: its index was rewritten without them.
        for k in ka.iter().skip(8).chain(kb.iter().take(4)) {
            assert!(matches!(s.get(k), Err(StoreError::NotFound(_))));
        }
    };
    check(&s);
    // The chunks kept from the first pack stay adjacent, in their order.
    let offsets: Vec<u64> = ka[..8]
        .iter()
        .map(|k| s.stored_at(k).unwrap().offset)
        .collect();
    assert!(
        offsets.windows(2).all(|w| w[1] == w[0] + (1 << 16)),
        "{offsets:?}"
    );
    let again = FsStore::open(dir.path()).unwrap();
    check(&again);
    assert_eq!(
        again.compact(u64::MAX).unwrap(),
        Compacted::default(),
        "nothing left to do"
    );
    assert!(again.problems().is_empty(), "{:?}", again.problems());
}

#[test]
fn a_compaction_within_a_budget_goes_on_where_the_last_one_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let s = FsStore::open(dir.path()).unwrap();
    let (a, b) = (chunks(64, 4), chunks(64, 5));
    let (ka, kb) = (put_batch(&s, &a), put_batch(&s, &b));
    for k in ka.iter().skip(8).chain(kb.iter().skip(16)) {
        s.remove(k).unwrap();
    }
    let live: Vec<(&Kappa, &Vec<u8>)> = ka
        .iter()
        .zip(&a)
        .take(8)
        .chain(kb.iter().zip(&b).take(16))
        .collect();
    let packs = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir.path().join("packs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "pack"))
            .collect()
    };
    let original = packs();
    let before = pack_bytes(dir.path());
    // Four chunks at a time: the pack with the fewest live chunks goes first, in parts.
    let first = s.compact(4 << 16).unwrap();
    assert_eq!(
        first.files, 0,
        "no pack is emptied by the first four chunks"
    );
    assert_eq!(packs().len(), 3);
    let mut calls = 1;
    while original.iter().any(|p| p.exists()) {
        s.compact(4 << 16).unwrap();
        for (k, bytes) in &live {
            assert_eq!(&&s.get(k).unwrap(), bytes);
        }
        // A store opened between two calls sees every live object once.
        let other = FsStore::open(dir.path()).unwrap();
        assert_eq!(other.list().unwrap().len(), live.len());
        drop(other);
        calls += 1;
        assert!(calls <= 8, "24 live chunks, 4 per call");
    }
    assert_eq!(calls, 6);
    assert!(pack_bytes(dir.path()) < before / 2);
    assert_eq!(
        s.compact(4 << 16).unwrap(),
        Compacted::default(),
        "nothing left"
    );
}

#[test]
fn a_pack_a_compaction_left_behind_is_dropped_and_nothing_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let a = chunks(16, 3);
    let ks = put_batch(&FsStore::open(dir.path()).unwrap(), &a);
    // A compaction cut short after its new pack was written: the same objects in two packs.
    let packs = dir.path().join("packs");
    for e in std::fs::read_dir(&packs).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_owned();
        std::fs::copy(&p, packs.join(format!("copy{name}"))).unwrap();
    }
    let before = pack_bytes(dir.path());
    let s = FsStore::open(dir.path()).unwrap();
    let done = s.compact(u64::MAX).unwrap();
    assert_eq!(done.files, 1, "one of the twins goes");
    assert_eq!(pack_bytes(dir.path()) * 2, before);
    for (k, bytes) in ks.iter().zip(&a) {
        assert_eq!(&s.get(k).unwrap(), bytes);
    }
    // Removing every object deletes the pack left, as before.
    for k in &ks {
        s.remove(k).unwrap();
    }
    assert_eq!(pack_bytes(dir.path()), 0);
}

#[test]
fn zstd_shrinks_files_and_never_changes_kappa() {
    let compressible: Vec<u8> = b"ferry ".repeat(20_000);
    let chunks: Vec<Vec<u8>> = (0..100u8).map(|i| vec![i; 65536]).collect();
    let refs: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
    let size_of_dir = |d: &std::path::Path| -> u64 {
        let mut total = 0;
        let mut stack = vec![d.to_path_buf()];
        while let Some(p) = stack.pop() {
            for e in std::fs::read_dir(&p).unwrap().flatten() {
                let m = e.metadata().unwrap();
                if m.is_dir() {
                    stack.push(e.path())
                } else {
                    total += m.len()
                }
            }
        }
        total
    };
    let (plain_dir, zst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let plain = FsStore::open(plain_dir.path()).unwrap();
    let zst = FsStore::open(zst_dir.path()).unwrap().with_zstd(3);
    assert_eq!(
        plain.put(&compressible).unwrap(),
        zst.put(&compressible).unwrap()
    );
    assert_eq!(plain.put_many(&refs).unwrap(), zst.put_many(&refs).unwrap());
    assert!(size_of_dir(zst_dir.path()) * 10 < size_of_dir(plain_dir.path()));
    let reopened = FsStore::open(zst_dir.path()).unwrap();
    assert_eq!(
        reopened.get(&Kappa::of(&compressible)).unwrap(),
        compressible
    );
    let mut out = vec![0; 65536];
    reopened
        .read_into(&Kappa::of(&chunks[42]), &mut out)
        .unwrap();
    assert_eq!(out, chunks[42]);
    assert_eq!(reopened.list().unwrap().len(), 101);
    // Compressed chunks cannot be mapped; a loose object is not in a pack.
    assert_eq!(reopened.stored_at(&Kappa::of(&chunks[42])), None);
    assert_eq!(reopened.stored_at(&Kappa::of(&compressible)), None);
}

mod capsules {
    use std::collections::BTreeSet;

    use super::*;
    use crate::capsule::{self, CapsuleError};

    /// A store with a "root" and some objects, one compressible, one not.
    fn source() -> (MemStore, Kappa, BTreeSet<Kappa>) {
        let s = MemStore::new();
        let mut all = BTreeSet::new();
        let root = s.put(b"root object").unwrap();
        all.insert(root);
        all.insert(s.put(&vec![7u8; 65536]).unwrap());
        let noise: Vec<u8> = (0..65536u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        all.insert(s.put(&noise).unwrap());
        all.insert(s.put(b"").unwrap());
        (s, root, all)
    }

    fn capsule_bytes() -> (Vec<u8>, Kappa, BTreeSet<Kappa>) {
        let (s, root, all) = source();
        let mut out = Vec::new();
        let stats = capsule::export(
            &s,
            root,
            &all.iter().copied().collect::<Vec<_>>(),
            &mut out,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(stats.objects, 4);
        assert_eq!(stats.stored_bytes, out.len() as u64);
        assert!(
            out.len() < 2 * 65536 + 1000,
            "the repetitive object was not compressed"
        );
        (out, root, all)
    }

    /// Memory chunks are imported as a snapshot stores them: packed together (with direct I/O,
    /// block-aligned) in the order the capsule lists them, not as a file each.
    #[test]
    fn chunks_are_packed_in_the_capsules_order() {
        let s = MemStore::new();
        let root = s.put(b"root object").unwrap();
        let mut order = vec![root];
        for i in 0..96u32 {
            let chunk: Vec<u8> = (0..65536u32)
                .map(|j| (j.wrapping_add(i * 7919).wrapping_mul(2654435761) >> 11) as u8)
                .collect();
            order.push(s.put(&chunk).unwrap());
        }
        order[1..].reverse();
        let mut out = Vec::new();
        capsule::export(&s, root, &order, &mut out, &mut |_| {}).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let dest = FsStore::open(dir.path()).unwrap();
        let (got, stats) = capsule::import(&out[..], &dest, &mut |_| {}).unwrap();
        assert_eq!((got, stats.new_objects), (root, 97));
        let at: Vec<u64> = order[1..]
            .iter()
            .map(|k| dest.stored_at(k).expect("packed").offset)
            .collect();
        assert!(at.windows(2).all(|w| w[1] == w[0] + 65536), "{at:?}");
        assert_eq!(at[0] % 4096, 0, "written with direct I/O");
        assert_eq!(dest.get(&order[5]).unwrap(), s.get(&order[5]).unwrap());
        assert_eq!(dest.stored_at(&root), None, "small objects stay loose");
    }

    /// 64 KiB chunk `i` of pseudo-random bytes (nothing for zstd to save).
    fn noise_chunk(i: u32) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(i).wrapping_mul(0x2545_f491_4f6c_dd1d);
        let mut c = vec![0u8; 65536];
        for w in c.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        c
    }

    /// More chunks than one batch: the batches are checked and stored on a thread of their
    /// own while the next is read. A chunk whose bytes do not match its κ is refused there,
    /// by name, and so is a damaged one in the last batch (checked on the importing thread).
    #[test]
    fn batches_of_chunks_are_stored_while_the_next_is_read() {
        let s = MemStore::new();
        let root = s.put(b"root object").unwrap();
        let mut order = vec![root];
        for i in 0..1100 {
            order.push(s.put(&noise_chunk(i)).unwrap());
        }
        let mut out = Vec::new();
        capsule::export(&s, root, &order, &mut out, &mut |_| {}).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let dest = FsStore::open(dir.path()).unwrap();
        let (got, stats) = capsule::import(&out[..], &dest, &mut |_| {}).unwrap();
        assert_eq!((got, stats.new_objects), (root, 1101));
        for k in [order[1], order[600], order[1100]] {
            assert_eq!(dest.get(&k).unwrap(), s.get(&k).unwrap());
        }
        // Damaged: chunk 3 (in the first batch) and chunk 1090 (in the last).
        let header = 8 + 4 + 32 + 8;
        let entry = 49 + 65536;
        let first_entry = header + 49 + 11;
        for (i, k) in [(3, order[4]), (1090, order[1091])] {
            let mut bad = out.clone();
            bad[first_entry + i * entry + 49 + 100] ^= 1;
            let e = capsule::import(&bad[..], &MemStore::new(), &mut |_| {}).unwrap_err();
            assert!(
                e.to_string().contains(&format!("object {k} hashes to")),
                "{e}"
            );
        }
    }

    /// An export checks every object it reads straight from a pack: a damaged one fails the
    /// export by name, rather than a capsule that only another machine would refuse.
    #[test]
    fn an_export_refuses_a_damaged_chunk() {
        let dir = tempfile::tempdir().unwrap();
        let s = FsStore::open(dir.path()).unwrap();
        let root = s.put(b"root object").unwrap();
        // Three batches' worth: the damaged chunk is in the second, which the second of the
        // two reading threads encodes.
        let chunks: Vec<Vec<u8>> = (0..600).map(noise_chunk).collect();
        let slices: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
        let ks = s.put_many(&slices).unwrap();
        let at = s.stored_at(&ks[300]).expect("packed");
        let mut pack = std::fs::read(&at.file).unwrap();
        pack[at.offset as usize + 10] ^= 0x40;
        std::fs::write(&at.file, &pack).unwrap();
        let s = FsStore::open(dir.path()).unwrap();
        let mut order = vec![root];
        order.extend(&ks);
        let e = capsule::export(&s, root, &order, &mut Vec::new(), &mut |_| {}).unwrap_err();
        assert!(
            matches!(e, CapsuleError::Store(StoreError::Corrupt { kappa, .. }) if kappa == ks[300]),
            "{e}"
        );
    }

    #[test]
    fn round_trip_into_every_store() {
        let (bytes, root, all) = capsule_bytes();
        for (dest, _d) in stores() {
            let (got, stats) = capsule::import(&bytes[..], dest.as_ref(), &mut |_| {}).unwrap();
            assert_eq!(got, root);
            assert_eq!(stats.new_objects, 4);
            let have: BTreeSet<Kappa> = dest.list().unwrap().into_iter().collect();
            assert_eq!(have, all);
            // Again: nothing new.
            let (_, again) = capsule::import(&bytes[..], dest.as_ref(), &mut |_| {}).unwrap();
            assert_eq!(again.new_objects, 0);
        }
    }

    #[test]
    fn every_single_byte_flip_is_refused() {
        let (bytes, _, _) = capsule_bytes();
        // Flip each byte of the header, a sample of the body, and the trailer.
        let positions: Vec<usize> = (0..60)
            .chain((60..bytes.len()).step_by(997))
            .chain(bytes.len() - 40..bytes.len())
            .collect();
        for i in positions {
            let mut bad = bytes.clone();
            bad[i] ^= 0x20;
            let r = capsule::import(&bad[..], &MemStore::new(), &mut |_| {});
            assert!(r.is_err(), "flipping byte {i} was not noticed");
        }
    }

    #[test]
    fn truncation_trailing_bytes_and_versions_are_refused_with_reasons() {
        let (bytes, _, _) = capsule_bytes();
        for cut in [0, 7, 20, 60, bytes.len() / 2, bytes.len() - 1] {
            let r = capsule::import(&bytes[..cut], &MemStore::new(), &mut |_| {});
            assert!(r.is_err(), "a capsule cut at {cut} was accepted");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        let e = capsule::import(&longer[..], &MemStore::new(), &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("bytes after the end marker"), "{e}");
        let mut v2 = bytes.clone();
        v2[8] = 2;
        let e = capsule::import(&v2[..], &MemStore::new(), &mut |_| {}).unwrap_err();
        assert!(matches!(e, CapsuleError::Version(2)), "{e}");
        let e = capsule::import(&b"GIF89a......"[..], &MemStore::new(), &mut |_| {}).unwrap_err();
        assert!(matches!(e, CapsuleError::NotACapsule), "{e}");
    }

    #[test]
    fn huge_claimed_sizes_are_refused_before_allocating() {
        let mut b = Vec::new();
        b.extend_from_slice(b"FERRYCAP");
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&[0u8; 32]);
        b.extend_from_slice(&u64::MAX.to_le_bytes());
        let e = capsule::import(&b[..], &MemStore::new(), &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("objects (at most"), "{e}");
        let mut b2 = b[..44].to_vec();
        b2.extend_from_slice(&1u64.to_le_bytes());
        b2.extend_from_slice(&[0u8; 32]);
        b2.push(0);
        b2.extend_from_slice(&(1u64 << 40).to_le_bytes());
        b2.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let e = capsule::import(&b2[..], &MemStore::new(), &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("claims"), "{e}");
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..300)) {
            capsule::fuzz_import(&data);
            let mut framed = b"FERRYCAP\x01\x00\x00\x00".to_vec();
            framed.extend_from_slice(&data);
            capsule::fuzz_import(&framed);
        }
    }
}
