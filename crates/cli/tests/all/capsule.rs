//! `ferry export` / `ferry import`: a suspended guest moved to a store that shares nothing
//! with the first one continues byte-identically; damaged capsules are refused.

use crate::harness::{
    Env, dir_contents, guest, resume_to_end, resume_to_end_with, run_and_suspend, session_of,
};

/// A CPU guest suspended in a new environment: the environment, what an uninterrupted run
/// prints, what this one printed before it was suspended, and its snapshot.
fn suspended_cpu_guest() -> (Env, Vec<u8>, Vec<u8>, String) {
    let here = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "120"];
    let plain = here.plain(&args);
    let (seen, k) = run_and_suspend(&here, &args, 300);
    (here, plain.stdout, seen, k)
}

#[test]
fn a_snapshot_moves_to_another_store_through_a_capsule() {
    let (here, plain, mut seen, k) = suspended_cpu_guest();
    let there = Env::new();
    let capsule = here.path("moved.ferry");
    let (_, err, code) = here.output(&["export", &k, "-o", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("ferry: exported "), "{err}");
    // A session stands for its last snapshot, as for `resume` and `inspect`.
    let session = session_of(&here, &k);
    let by_session = here.path("by-session.ferry");
    let (_, err, code) = here.output(&["export", &session, "-o", by_session.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(std::fs::read(&by_session).unwrap() == std::fs::read(&capsule).unwrap());
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
        String::from_utf8_lossy(&plain)
    );
}

/// A guest writing files in a mount moves through a capsule to a store (and a directory)
/// that share nothing with the first: `import` says which directory to grant, the resume
/// fills the empty one from the snapshot, and the guest ends with the files and output of an
/// uninterrupted run.
#[test]
fn a_guest_with_a_mount_moves_through_a_capsule() {
    let here = Env::new();
    let g = guest("wasm/files.wasm");
    let (plain_dir, pd) = here.data_dir("plain-data");
    let (_, cd) = here.data_dir("data");
    let plain = here.plain(&["--dir", &pd, g.to_str().unwrap(), "/data", "2000"]);
    let (mut seen, k) = run_and_suspend(
        &here,
        &["--dir", &cd, g.to_str().unwrap(), "/data", "2000"],
        400,
    );
    let capsule = here.path("moved.ferry");
    let (_, err, code) = here.output(&["export", &k, "-o", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let there = Env::new();
    let (out, err, code) = there.output(&["import", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("imported {k}"));
    let short = &k[..19];
    assert!(
        err.contains(&format!(
            "resume it with `ferry resume --dir HOST::/data {short}`"
        )),
        "{err}"
    );
    let (there_dir, td) = there.data_dir("data");
    seen.extend(resume_to_end_with(&there, &["--dir", &td], &k));
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain.stdout)
    );
    assert_eq!(dir_contents(&there_dir), dir_contents(&plain_dir));
}

/// `ferry export κ -o - | ferry import -`: the capsule streams through a pipe (as through
/// `ssh`); a capsule cut short in the pipe is refused.
#[test]
fn a_capsule_goes_through_a_pipe() {
    use std::io::Write;
    use std::process::Stdio;
    let (here, plain, mut seen, k) = suspended_cpu_guest();
    let there = Env::new();
    let mut export = here
        .ferry()
        .args(["export", &k, "-o", "-"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let import = there
        .ferry()
        .args(["import", "-"])
        .stdin(export.stdout.take().unwrap())
        .output()
        .unwrap();
    let exported = export.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&exported.stderr);
    assert_eq!(exported.status.code(), Some(0), "{err}");
    assert!(err.contains("to stdout"), "{err}");
    let stderr = String::from_utf8_lossy(&import.stderr);
    assert_eq!(import.status.code(), Some(0), "{stderr}");
    assert_eq!(
        String::from_utf8_lossy(&import.stdout).trim(),
        format!("imported {k}")
    );
    seen.extend(resume_to_end(&there, &k));
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain)
    );

    // Cut short on the way.
    let capsule = here
        .ferry()
        .args(["export", &k, "-o", "-"])
        .output()
        .unwrap()
        .stdout;
    assert!(
        capsule.starts_with(b"FERRYCAP"),
        "the capsule itself is on stdout"
    );
    let other = Env::new();
    let mut import = other
        .ferry()
        .args(["import", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = import.stdin.take().unwrap();
    stdin.write_all(&capsule[..capsule.len() / 2]).unwrap();
    drop(stdin);
    let out = import.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot import the capsule on stdin"), "{err}");
    assert!(err.contains("truncated"), "{err}");
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

    // A directory is not a capsule's name: refused before anything is written.
    let dir = env.path("a-directory");
    std::fs::create_dir(&dir).unwrap();
    let (_, err, code) = env.output(&["export", &k, "-o", dir.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("is a directory: give the capsule a file name"),
        "{err}"
    );
    assert!(!env.path("a-directory.ferry-partial").exists());
}
