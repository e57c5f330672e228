//! Snapshots outlive the ferry that made them: one made by another version of the transform
//! resumes with its own instrumented module when that speaks this host's contract and
//! something vouches for its code (this store derived it, or the user trusts it).
//!
//! The snapshots here are this version's, relabelled as another's (the module is the same,
//! so the runs can be compared byte for byte); the check with a real v16 ferry's snapshot is
//! described in docs/limits.md.

use ferry_instrument::{INSTRUMENT_VERSION, abi};
use ferry_kappa::Kappa;
use ferry_object::Snapshot;
use ferry_store::{FsStore, RefValue, Store};

use crate::harness::{Env, guest, resume_and_suspend, run_and_suspend};

/// Snapshot `k` of `store` claiming to have been made by transform version `v`.
fn relabelled(store: &FsStore, k: &str, v: u32) -> String {
    let k: Kappa = k.parse().unwrap();
    let mut snap: Snapshot = ferry_object::decode(&store.get(&k).unwrap()).unwrap();
    snap.instrument_version = v;
    store
        .put(&ferry_kappa::encode(&snap).unwrap())
        .unwrap()
        .to_string()
}

#[test]
fn a_snapshot_of_another_transform_version_runs_its_own_module() {
    let env = Env::new();
    let g = guest("wasm/recurse.wasm");
    let args = [g.to_str().unwrap(), "--", "20000", "150"];
    let plain = env.plain(&args);
    let (mut seen, k) = run_and_suspend(&env, &args, 300);
    let older = INSTRUMENT_VERSION - 1;
    assert!(older >= abi::OLDEST_COMPATIBLE);
    let store = FsStore::open(env.store()).unwrap();
    let old = relabelled(&store, &k, older);

    // Nothing here derived its module under that version: refused, saying what to do.
    let (_, err, code) = env.output(&["resume", &old]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("refused while admitting")
            && err.contains(&format!("made by instrumentation v{older}"))
            && err.contains("did not derive its instrumented module")
            && err.contains("--trust-instrumented"),
        "{err}"
    );
    // Exporting it needs no admission.
    let capsule = env.path("old.ferry");
    let (_, err, code) = env.output(&["export", &old, "-o", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");

    // Trusted: it runs with its own module, to the same output as an uninterrupted run.
    let out = env
        .ferry()
        .args(["resume", "--trust-instrumented", &old])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("runs with its own instrumented module"),
        "{err}"
    );
    assert_eq!([&seen[..], &out.stdout].concat(), plain.stdout);

    // Derived here: what the older ferry that instrumented the program in this store wrote.
    let v = env.inspect_json(&old);
    let module: Kappa = v["module"].as_str().unwrap().parse().unwrap();
    let instrumented: Kappa = v["instrumented"].as_str().unwrap().parse().unwrap();
    store
        .cas_ref(
            &format!("derived/instrument-v{older}/{}", module.to_hex()),
            None,
            Some(RefValue {
                epoch: 0,
                target: instrumented,
            }),
        )
        .unwrap();
    drop(store);
    let (more, next) = resume_and_suspend(&env, &[&old], 300);
    seen.extend(more);
    assert_eq!(
        env.inspect_json(&next)["instrument_version"],
        older,
        "its later snapshots keep the version of the code that runs"
    );
    // `store gc` keeps what vouches for the module of a snapshot it keeps.
    let (out, err, code) = env.output(&["store", "gc"]);
    assert_eq!(code, 0, "{out}{err}");
    let out = env.ferry().args(["resume", &next]).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    seen.extend(out.stdout);
    assert_eq!(seen, plain.stdout);
}

#[test]
fn versions_whose_contract_this_ferry_does_not_speak_are_refused() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let k = env.suspend_once(&[g.to_str().unwrap(), "--", "1000"], 100);
    let store = FsStore::open(env.store()).unwrap();
    for (v, which) in [
        (abi::OLDEST_COMPATIBLE - 1, "an older ferry"),
        (INSTRUMENT_VERSION + 1, "a newer ferry"),
    ] {
        let other = relabelled(&store, &k, v);
        let (_, err, code) = env.output(&["resume", "--trust-instrumented", &other]);
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("refused while admitting")
                && err.contains(&format!("made by instrumentation v{v}"))
                && err.contains(which),
            "{err}"
        );
    }
}
