//! `ferry export` / `ferry import`: a suspended guest moved to a store that shares nothing
//! with the first one continues byte-identically; damaged capsules are refused.

use crate::harness::{Env, guest, resume_to_end, run_and_suspend};

#[test]
fn a_snapshot_moves_to_another_store_through_a_capsule() {
    let here = Env::new();
    let there = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "120"];
    let plain = here.plain(&args);
    let (mut seen, k) = run_and_suspend(&here, &args, 300);
    let capsule = here.path("moved.ferry");
    let (_, err, code) = here.output(&["export", &k, "-o", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("ferry: exported "), "{err}");
    // The other store has never seen the program.
    let (_, err, code) = there.output(&["resume", &k]);
    assert_eq!(code, 1);
    assert!(err.contains("resume refused while resolving"), "{err}");
    let (out, err, code) = there.output(&["import", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("imported {k}"));
    // Garbage collection keeps an imported snapshot; the store verifies.
    let (_, err, code) = there.output(&["store", "gc"]);
    assert_eq!(code, 0, "{err}");
    let (out, _, code) = there.output(&["store", "verify"]);
    assert_eq!(code, 0, "{out}");
    seen.extend(resume_to_end(&there, &k));
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain.stdout)
    );
}

#[test]
fn damaged_capsules_and_unknown_snapshots_are_refused() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let (_, k) = run_and_suspend(&env, &[g.to_str().unwrap(), "--", "120"], 200);
    let capsule = env.path("c.ferry");
    let (_, err, code) = env.output(&["export", &k, "-o", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let good = std::fs::read(&capsule).unwrap();

    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 1;
    let bad = env.path("bad.ferry");
    std::fs::write(&bad, &flipped).unwrap();
    let other = Env::new();
    let (_, err, code) = other.output(&["import", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("capsule is corrupt"), "{err}");

    std::fs::write(&bad, &good[..good.len() - 10]).unwrap();
    let (_, err, code) = other.output(&["import", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("capsule is corrupt: truncated"), "{err}");

    std::fs::write(&bad, b"not a capsule").unwrap();
    let (_, err, code) = other.output(&["import", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("not a ferry capsule"), "{err}");

    let unknown = "blake3:0000000000000000000000000000000000000000000000000000000000000000";
    let (_, err, code) = env.output(&["export", unknown, "-o", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("is missing from the store"), "{err}");
}
