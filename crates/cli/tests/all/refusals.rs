//! Bad input gets a clear error and changes nothing.

use crate::harness::{Env, dir_contents, guest, run_and_suspend, suspend_after_output};

#[test]
fn not_wasm_is_refused() {
    let env = Env::new();
    let p = env.path("hello.txt");
    std::fs::write(&p, "hello").unwrap();
    let (_, err, code) = env.output(&["run", p.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("not a WebAssembly module"), "{err}");
}

/// A mount holding ferry's own store would be copied into every snapshot (and the guest could
/// rewrite the objects it resumes from): refused for `--dir`, a script's directory, a resume's
/// grant — and for a store not created yet.
#[test]
fn a_mount_holding_the_store_is_refused() {
    let env = Env::new().with_var("FERRY_CACHE", "/nonexistent/ferry-cache");
    let g = guest("wasm/cpu.wasm");
    let root = env.path("");
    let around = format!("{}::/data", root.display());
    let (_, err, code) = env.output(&["run", "--dir", &around, g.to_str().unwrap(), "1"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("--dir for `/data`): ferry's store") && err.contains("is inside it"),
        "{err}"
    );
    assert!(!env.store().exists(), "nothing was made");
    let script = env.path("s.py");
    std::fs::write(&script, "print(1)\n").unwrap();
    let (_, err, code) = env.output(&["run", script.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("put the script in a directory of its own"),
        "{err}"
    );
    let inside = format!("{}::/data", env.store().join("x").display());
    let (_, err, code) = env.output(&["resume", "--dir", &inside, "blake3:0000"]);
    assert_eq!(code, 1);
    assert!(err.contains("is around it"), "{err}");
}

#[test]
fn component_and_missing_start_are_refused() {
    let env = Env::new();
    let comp = env.path("c.wasm");
    std::fs::write(&comp, b"\0asm\x0d\0\x01\0").unwrap();
    let (_, err, code) = env.output(&["run", comp.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("component"), "{err}");
    let lib = env.path("lib.wat");
    std::fs::write(&lib, "(module (func (export \"f\")))").unwrap();
    let (_, err, code) = env.output(&["run", lib.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("no `_start`"), "{err}");
}

#[test]
fn unsupported_proposal_is_named() {
    let env = Env::new();
    let m = env.path("tail.wat");
    std::fs::write(
        &m,
        r#"(module (func $f) (func (export "_start") (return_call $f)))"#,
    )
    .unwrap();
    let (_, err, code) = env.output(&["run", m.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("cannot suspend yet") && err.contains("tail call"),
        "{err}"
    );
}

/// A program that needs functions ferry does not give it (a C program linked with undefined
/// symbols, one built for another host) is refused before it is made suspendable — a big
/// module is not instrumented and compiled for minutes first — in the same words on both
/// engines, and nothing is stored (not even a lock file for the session it did not start).
#[test]
fn imports_ferry_does_not_provide_are_refused_before_anything_runs() {
    let env = Env::new();
    let m = env.path("env.wat");
    std::fs::write(
        &m,
        r#"(module (import "env" "js_now" (func (result f64)))
             (import "wasi_snapshot_preview1" "fd_write" (func (param i32 i32 i32 i32) (result i32)))
             (memory (export "memory") 1) (func (export "_start")))"#,
    )
    .unwrap();
    let typed = env.path("typed.wat");
    std::fs::write(
        &typed,
        r#"(module (import "wasi_snapshot_preview1" "fd_write" (func (param i32 i64) (result i32)))
             (memory (export "memory") 1) (func (export "_start")))"#,
    )
    .unwrap();
    for engine in ["jit", "interp"] {
        let (out, err, code) = env.output(&["run", "--engine", engine, m.to_str().unwrap()]);
        assert_eq!((out.as_str(), code), ("", 1), "{err}");
        assert_eq!(
            err,
            "ferry: cannot run env.wat\nferry:   caused by: the module imports a function ferry \
                 does not provide: `env.js_now`; ferry gives a program the functions of WASI \
                 preview 1 (`wasi_snapshot_preview1`) and nothing else (build it for \
                 wasm32-wasip1 with every symbol defined)\n"
        );
        let (_, err, code) = env.output(&["run", "--engine", engine, typed.to_str().unwrap()]);
        assert_eq!(code, 1);
        assert!(
            err.contains(
                "imports `wasi_snapshot_preview1.fd_write` as (i32, i64) -> (i32), but ferry \
                 provides it as (i32, i32, i32, i32) -> (i32)"
            ),
            "{err}"
        );
    }
    assert!(
        dir_contents(&env.store().join("objects")).is_empty(),
        "nothing was stored"
    );
    // Nor is a session left behind: no record, no lock file.
    assert_eq!(dir_contents(&env.store().join("sessions")), vec![]);
}

/// Exception handling runs on the JIT; the interpreter (wasmi) lacks the proposal and says so
/// before running anything.
#[test]
fn exceptions_run_on_the_jit_and_are_refused_by_the_interpreter() {
    let env = Env::new();
    let m = env.path("eh.wat");
    std::fs::write(
        &m,
        r#"(module (tag $t (param i32))
             (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
             (memory (export "memory") 1)
             (func (export "_start")
               (call $exit
                 (block $h (result i32)
                   (try_table (catch $t $h) (throw $t (i32.const 7)))
                   (i32.const 0)))))"#,
    )
    .unwrap();
    let (_, err, code) = env.output(&["run", m.to_str().unwrap()]);
    assert_eq!(code, 7, "{err}");
    let (_, err, code) = env.output(&["run", "--engine", "interp", m.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("exception-handling") && err.contains("--engine jit"),
        "{err}"
    );
}

#[test]
fn unknown_snapshot_is_refused_while_resolving() {
    let env = Env::new();
    let (_, err, code) = env.output(&["resume", "blake3:00000000"]);
    assert_eq!(code, 1);
    assert!(err.contains("refused while resolving"), "{err}");
    let fake = format!("blake3:{}", "ab".repeat(32));
    let (_, err, code) = env.output(&["resume", &fake]);
    assert_eq!(code, 1);
    assert!(
        err.contains("refused while resolving") && err.contains("missing"),
        "{err}"
    );
    // A word that could be a session id is named as one: a mistyped session is not just a
    // bad κ.
    for (what, then) in [
        ("nosuch", "`nosuch` is not a κ or a κ prefix"),
        ("abcd1234", "no object in the store starts with `abcd1234`"),
    ] {
        for verb in ["resume", "inspect"] {
            let (_, err, code) = env.output(&[verb, what]);
            assert_eq!(code, 1, "{err}");
            let said = format!("no session `{what}` (`ferry ps --all` lists them), and {then}");
            assert!(err.contains(&said), "{verb}: {err}");
        }
    }
}

/// Suspends a counter and returns (env, κ).
fn suspended_counter() -> (Env, String) {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let k = env.suspend_once(&[g.to_str().unwrap(), "--", "1000"], 100);
    (env, k)
}

/// Given the κ of something that is not a snapshot (here its module), resume says what it is.
#[test]
fn a_kappa_that_is_not_a_snapshot_is_named() {
    let (env, k) = suspended_counter();
    let v = env.inspect_json(&k);
    let module = v["module"].as_str().unwrap().to_owned();
    let (_, err, code) = env.output(&["resume", &module]);
    assert_eq!(code, 1);
    assert!(
        err.contains("refused while verifying")
            && err.contains("a WebAssembly module, not a ferry object"),
        "{err}"
    );
}

#[test]
fn corrupted_or_truncated_objects_are_detected_not_resumed() {
    let (env, k) = suspended_counter();
    let v = env.inspect_json(&k);
    let mem = v["memories"][0]["kappa"].as_str().unwrap().to_owned();
    // Corrupt the memory image object on disk.
    let hex = &mem["blake3:".len()..];
    let p = env.store().join("objects").join(&hex[..2]).join(&hex[2..]);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&p, bytes).unwrap();
    let (_, err, code) = env.output(&["resume", &k]);
    assert_eq!(code, 1);
    assert!(
        err.contains("refused while verifying") && err.contains("corrupt"),
        "{err}"
    );
    let (out, err, code) = env.output(&["store", "verify"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("corrupt"), "{err}");
}

/// The module is re-hashed while the guest is restored (`check_module` beside the restore):
/// a corrupt one still stops the resume before the guest runs, and the session stays
/// resumable once the store is repaired.
#[test]
fn a_corrupt_module_stops_the_resume_before_the_guest_runs() {
    let (env, k) = suspended_counter();
    let v = env.inspect_json(&k);
    let module = v["module"].as_str().unwrap().to_owned();
    let hex = &module["blake3:".len()..];
    let p = env.store().join("objects").join(&hex[..2]).join(&hex[2..]);
    let good = std::fs::read(&p).unwrap();
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 1;
    std::fs::write(&p, &bad).unwrap();
    let (out, err, code) = env.output(&["resume", &k]);
    assert_eq!(code, 1);
    assert!(
        err.contains("refused while verifying") && err.contains("corrupt"),
        "{err}"
    );
    assert!(out.is_empty(), "the guest ran: {out}");
    let (ps, _, _) = env.output(&["ps", "--json"]);
    assert!(ps.contains("\"suspended\""), "{ps}");
    std::fs::write(&p, &good).unwrap();
    let (out, err, code) = env.output(&["resume", &k]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.is_empty());
}

/// A file in a carried mount too large for a snapshot is reported when the run starts, not
/// first at a suspend; the suspend that cannot carry it says what to do, and the program goes
/// on to its end.
#[test]
fn a_file_too_large_to_carry_is_reported_at_start() {
    let env = Env::new();
    let g = guest("wasm/files.wasm");
    let (d, dir) = env.data_dir("data");
    // Sparse: no disk space used, never read.
    std::fs::File::create(d.join("huge.bin"))
        .unwrap()
        .set_len(ferry_wasi::tree::MAX_FILE + 1)
        .unwrap();
    let mut delay = 300;
    let out = loop {
        let child = env
            .ferry()
            .args(["run", "--dir", &dir, g.to_str().unwrap(), "/data", "400"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay));
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let out = child.wait_with_output().unwrap();
        match std::os::unix::process::ExitStatusExt::signal(&out.status) {
            Some(libc::SIGINT) => delay *= 2, // before the guest started
            _ => break out,
        }
    };
    let err = String::from_utf8_lossy(&out.stderr);
    let huge = d.join("huge.bin").canonicalize().unwrap();
    assert!(
        err.contains(&format!(
            "ferry: warning: {} ({} bytes) is larger than a snapshot can carry",
            huge.display(),
            ferry_wasi::tree::MAX_FILE + 1
        )) && err.contains("--bind"),
        "{err}"
    );
    assert!(
        err.contains("suspend failed, the program keeps running")
            && err.contains("pass its directory through with --bind instead of --dir"),
        "{err}"
    );
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("done "));
}

/// A big file in a carried mount (over 1 MiB: stored as 1 MiB chunks, never read whole) goes
/// with the snapshot: resumed into an empty directory, it comes back byte for byte, sparse
/// where it was, and the program finishes.
#[test]
fn a_big_file_in_a_mount_is_carried_in_chunks() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let env = Env::new();
    let g = guest("wasm/files.wasm");
    let (d, dir) = env.data_dir("data");
    let len = (24 << 20) + 5;
    let marks: [(u64, &[u8]); 3] = [(0, b"start"), (len / 2, b"middle"), (len - 3, b"end")];
    let big = std::fs::File::create(d.join("big.bin")).unwrap();
    big.set_len(len).unwrap();
    for (at, bytes) in marks {
        big.write_all_at(bytes, at).unwrap();
    }
    let k = env.suspend_once(
        &["--dir", &dir, g.to_str().unwrap(), "--", "/data", "400"],
        150,
    );
    // The snapshot's closure holds the pieces: `store gc` keeps them.
    let (_, err, code) = env.output(&["store", "gc"]);
    assert_eq!(code, 0, "{err}");
    let fresh = env.path("fresh");
    let fresh_dir = format!("{}::/data", fresh.display());
    let (out, err, code) = env.output(&["resume", "--dir", &fresh_dir, &k]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("done "), "{out}");
    let back = std::fs::File::open(fresh.join("big.bin")).unwrap();
    assert_eq!(back.metadata().unwrap().len(), len);
    assert!(
        back.metadata().unwrap().blocks() * 512 < 8 << 20,
        "holes kept"
    );
    for (at, bytes) in marks {
        let mut got = vec![0u8; bytes.len()];
        back.read_exact_at(&mut got, at).unwrap();
        assert_eq!(got, bytes);
    }
}

/// A write-back into an empty directory that dies half-way leaves only its staging, which the
/// next resume removes instead of taking the directory for changed; the files written back
/// are not read again by the resumed run's first snapshot; the run ends as an uninterrupted
/// one, with the directory as it was.
#[test]
fn a_write_back_that_dies_is_redone_and_its_files_are_not_read_again() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let (d, dir) = env.data_dir("data");
    let big: Vec<u8> = (0..(3u32 << 20) + 7).map(|i| (i % 251) as u8).collect();
    std::fs::write(d.join("big.bin"), &big).unwrap();
    std::fs::create_dir(d.join("sub")).unwrap();
    std::fs::write(d.join("sub/note.txt"), "note").unwrap();
    let plain = env.plain(&["--dir", &dir, g.to_str().unwrap(), "--", "120"]);
    let (mut seen, k) = run_and_suspend(
        &env,
        &["--dir", &dir, g.to_str().unwrap(), "--", "120"],
        300,
    );
    let fresh = env.path("fresh");
    let fresh_dir = format!("{}::/data", fresh.display());
    let died = env
        .ferry()
        .env("FERRY_FAULT", "write-back")
        .args(["resume", "--dir", &fresh_dir, &k])
        .output()
        .unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&died.status),
        Some(libc::SIGKILL)
    );
    let left: Vec<String> = std::fs::read_dir(&fresh)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.len() == 1 && left[0].starts_with(".ferry-partial-"),
        "{left:?}"
    );
    let (out, k) = suspend_after_output(&env, "resume", &["-v", "--dir", &fresh_dir, &k], 300);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("files_read=0"), "{err}");
    seen.extend_from_slice(&out.stdout);
    let (rest, err, code) = env.output(&["resume", "--dir", &fresh_dir, &k]);
    assert_eq!(code, 0, "{err}");
    seen.extend_from_slice(rest.as_bytes());
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain.stdout)
    );
    assert_eq!(dir_contents(&fresh), dir_contents(&d));
}

/// With `--pre-write`, the mounted files that have settled are stored while the guest runs:
/// the suspend reads none of them.
#[test]
fn pre_writing_stores_settled_mounted_files_before_the_suspend() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let (d, dir) = env.data_dir("data");
    let big = crate::harness::varied_bytes(64 << 20, 0);
    std::fs::write(d.join("big.bin"), &big).unwrap();
    std::fs::create_dir(d.join("sub")).unwrap();
    std::fs::write(d.join("sub/note.txt"), "note").unwrap();
    // Settled: files modified in the last 2 s are left to the snapshot.
    std::thread::sleep(std::time::Duration::from_millis(2100));
    let (out, _) = suspend_after_output(
        &env,
        "run",
        &[
            "-v",
            "--pre-write",
            "200ms",
            "--dir",
            &dir,
            g.to_str().unwrap(),
            "--",
            "400",
        ],
        1500,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mounted files pre-stored files=2"), "{err}");
    let written = err
        .lines()
        .find(|l| l.contains("snapshot written"))
        .unwrap_or_default();
    assert!(written.contains("files_read=0"), "{err}");
}

/// `ferry suspend SESSION` from another terminal says it is waiting while the session writes
/// a snapshot that takes a while (after 2 s; at once here, `FERRY_PROGRESS_AFTER_MS=0`).
#[test]
fn ferry_suspend_says_it_is_waiting_for_a_long_snapshot() {
    let env = Env::new().with_var("FERRY_PROGRESS_AFTER_MS", "0");
    let g = guest("wasm/cpu.wasm");
    let (d, dir) = env.data_dir("data");
    let big = crate::harness::varied_bytes(128 << 20, 0);
    std::fs::write(d.join("big.bin"), &big).unwrap();
    let mut run = env
        .ferry()
        .args(["run", "--session", "slow", "--dir", &dir])
        .arg(&g)
        .args(["--", "100000"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    crate::harness::wait_until_running(&env);
    let (out, err, code) = env.output(&["suspend", "slow"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("blake3:"), "{out}");
    assert!(
        err.contains("ferry: waiting for session `slow` to write its snapshot ("),
        "{err}"
    );
    assert_eq!(run.wait().unwrap().code(), Some(75));
}

/// A first suspend that takes a while (a big mounted file to store) says it is still writing
/// the snapshot (after `FERRY_PROGRESS_AFTER_MS`, 1 s unless set).
#[test]
fn a_long_suspend_says_it_is_still_writing() {
    let env = Env::new().with_var("FERRY_PROGRESS_AFTER_MS", "0");
    let g = guest("wasm/cpu.wasm");
    let (d, dir) = env.data_dir("data");
    let big = crate::harness::varied_bytes(128 << 20, 0);
    std::fs::write(d.join("big.bin"), &big).unwrap();
    let (out, _) = suspend_after_output(
        &env,
        "run",
        &["--dir", &dir, g.to_str().unwrap(), "--", "400"],
        300,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ferry: still writing the snapshot ("), "{err}");
    assert_eq!(out.status.code(), Some(75), "{err}");
}

#[test]
fn changed_mount_is_refused_unless_allowed() {
    let env = Env::new();
    let g = guest("wasm/files.wasm");
    let (d, dir) = env.data_dir("data");
    let k = &env.suspend_once(
        &["--dir", &dir, g.to_str().unwrap(), "--", "/data", "400"],
        150,
    );
    // Not granted: the refusal says which flag to pass.
    let (_, err, code) = env.output(&["resume", k]);
    assert_eq!(code, 1);
    assert!(
        err.contains("refused while admitting") && err.contains("--dir HOST::/data"),
        "{err}"
    );
    // Changed under the suspended guest.
    std::fs::write(d.join("intruder.txt"), "surprise").unwrap();
    let (_, err, code) = env.output(&["resume", "--dir", &dir, k]);
    assert_eq!(code, 1);
    assert!(
        err.contains("changed since the snapshot was taken: `intruder.txt` added;"),
        "{err}"
    );
    // An empty directory receives the snapshot's copy and the guest finishes.
    let fresh = env.path("fresh");
    let fresh_dir = format!("{}::/data", fresh.display());
    let (out, err, code) = env.output(&["resume", "--dir", &fresh_dir, k]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("done "), "{out}");
    assert!(fresh.join("log-final.txt").exists());
}

#[test]
fn wrong_format_version_is_refused() {
    let (env, k) = suspended_counter();
    let store = ferry_store::FsStore::open(env.store()).unwrap();
    use ferry_store::Store;
    let kk: ferry_kappa::Kappa = k.parse().unwrap();
    let mut snap: ferry_object::Snapshot = ferry_object::decode(&store.get(&kk).unwrap()).unwrap();
    snap.v = 99;
    let bad = store.put(&ferry_kappa::encode(&snap).unwrap()).unwrap();
    let (_, err, code) = env.output(&["resume", &bad.to_string()]);
    assert_eq!(code, 1);
    assert!(err.contains("format version 99"), "{err}");
}

#[test]
fn inspect_and_ps_describe_a_suspended_session() {
    let (env, k) = suspended_counter();
    let (out, _, code) = env.output(&["inspect", &k[..20]]);
    assert_eq!(code, 0);
    assert!(
        out.contains("cpu.wasm") && out.contains("ferry-host/1"),
        "{out}"
    );
    let (out, _, code) = env.output(&["ps"]);
    assert_eq!(code, 0);
    assert!(out.contains("suspended") && out.contains(&k[..19]), "{out}");
    let (out, _, code) = env.output(&["store", "verify"]);
    assert_eq!(code, 0, "{out}");
}

#[test]
fn unusable_store_is_a_clear_error() {
    let env = Env::new();
    let file = env.path("not-a-dir");
    std::fs::write(&file, "x").unwrap();
    let g = guest("wasm/cpu.wasm");
    let out = env
        .ferry()
        .env("FERRY_STORE", &file)
        .args(["run", g.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot use the store at"), "{err}");
}

#[test]
fn module_mismatch_is_refused_while_admitting() {
    let (env, k) = suspended_counter();
    let store = ferry_store::FsStore::open(env.store()).unwrap();
    use ferry_store::Store;
    let kk: ferry_kappa::Kappa = k.parse().unwrap();
    let mut snap: ferry_object::Snapshot = ferry_object::decode(&store.get(&kk).unwrap()).unwrap();
    // Claim the stack blob is the instrumented module: it cannot be what the module derives to.
    snap.instrumented = snap.stack;
    let bad = store.put(&ferry_kappa::encode(&snap).unwrap()).unwrap();
    let (_, err, code) = env.output(&["resume", &bad.to_string()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("refused while admitting") && err.contains("module mismatch"),
        "{err}"
    );
}

/// `ferry rm` forgets finished sessions; a resumable one only with --force, after which
/// `store gc` reclaims its snapshot.
#[test]
fn rm_forgets_sessions_and_gc_reclaims_their_snapshots() {
    let (env, k) = suspended_counter();
    let g = guest("wasm/cpu.wasm");
    let (_, err, code) = env.output(&["run", "--session", "done", g.to_str().unwrap(), "--", "2"]);
    assert_eq!(code, 0, "{err}");
    let (ps, _, _) = env.output(&["ps"]);
    let suspended = ps
        .lines()
        .find(|l| l.contains("suspended"))
        .and_then(|l| l.split_whitespace().next())
        .expect("the suspended session")
        .to_owned();
    let (out, err, code) = env.output(&["rm", "done"]);
    assert_eq!((code, out.as_str()), (0, "removed done\n"), "{err}");
    let (_, err, code) = env.output(&["rm", &suspended]);
    assert_eq!(code, 1);
    assert!(
        err.contains(&format!(
            "session `{suspended}` can still be resumed (suspended"
        )),
        "{err}"
    );
    let (_, err, code) = env.output(&["rm", "../x"]);
    assert_eq!(code, 1);
    assert!(err.contains("is not a session id"), "{err}");
    // Still resumable until forced.
    let (_, _, code) = env.output(&["store", "gc"]);
    assert_eq!(code, 0);
    let (_, err, code) = env.output(&["inspect", &k]);
    assert_eq!(code, 0, "{err}");
    let (_, err, code) = env.output(&["rm", "--force", &suspended]);
    assert_eq!(code, 0, "{err}");
    let (ps, _, _) = env.output(&["ps"]);
    assert!(!ps.contains(&suspended) && !ps.contains("done"), "{ps}");
    let (out, _, code) = env.output(&["store", "gc"]);
    assert_eq!(code, 0);
    assert!(!out.starts_with("deleted 0 "), "{out}");
    let (_, err, code) = env.output(&["resume", &k]);
    assert_eq!(code, 1);
    assert!(err.contains("refused while resolving"), "{err}");
}

/// A command that prints ends quietly when its reader goes away (`ferry inspect … | head`),
/// as Unix tools do: no panic about a broken pipe.
#[test]
fn printing_into_a_closed_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let (env, k) = suspended_counter();
    // The reader is gone before ferry starts (closing it after the spawn raced ferry, which
    // could write everything into the pipe's buffer and exit first).
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = env
        .ferry()
        .args(["inspect", &k])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{err}");
}

/// The snapshots `inspect --history` lists for `k`, newest first.
fn history(env: &Env, k: &str) -> Vec<String> {
    let (out, err, code) = env.output(&["inspect", "--history", "--json", k]);
    assert_eq!(code, 0, "{err}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    rows.iter()
        .map(|r| r["snapshot"].as_str().unwrap().to_owned())
        .collect()
}

/// The counter run uninterrupted, then run with a checkpoint every 100 ms and suspended after
/// its fourth: (the uninterrupted run, what the suspended run printed, its last snapshot,
/// with a history of at least five).
fn checkpointed_counter(env: &Env) -> (crate::harness::Seen, Vec<u8>, String) {
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "300"];
    let plain = env.plain(&args);
    let (first, k) = crate::harness::run_and_suspend_after_checkpoints(
        env,
        &[&["--checkpoint-every", "100ms"][..], &args[..]].concat(),
        4,
    );
    (plain, first, k)
}

/// The store verifies, and `k` resumed to its end continues `first` (what the run showed
/// before it was suspended) into `expected`.
fn verifies_and_finishes(env: &Env, first: Vec<u8>, k: &str, expected: &[u8]) {
    let (o, e, code) = env.output(&["store", "verify"]);
    assert_eq!(code, 0, "{o}{e}");
    let mut all = first;
    all.extend(crate::harness::resume_to_end(env, k));
    assert_eq!(all, expected);
}

/// What a ferry that died while writing left in the store's `tmp/` (a pack cut short) is
/// removed by `store gc` (`--dry-run` only says so); the snapshots stay whole.
#[test]
fn gc_removes_what_a_dead_writer_left() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let k = env.suspend_once(&[g.to_str().unwrap(), "--", "120"], 300);
    let (out, err, code) = env.output(&["store", "gc"]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("unfinished"), "{out}");
    let left = env.store().join("tmp").join("4242-0.tmp");
    std::fs::write(&left, vec![1u8; 3 << 20]).unwrap();
    let (out, err, code) = env.output(&["store", "gc", "--dry-run"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("would remove 1 unfinished write (3.0 MiB)"),
        "{out}"
    );
    assert!(left.exists());
    let (out, err, code) = env.output(&["store", "gc"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("removed 1 unfinished write (3.0 MiB)"),
        "{out}"
    );
    assert!(!left.exists());
    let (_, err, code) = env.output(&["store", "verify"]);
    assert_eq!(code, 0, "{err}");
    let (_, err, code) = env.output(&["resume", &k]);
    assert_eq!(code, 0, "{err}");
}

/// `store gc --keep N` keeps the newest N snapshots of each session: older checkpoints go,
/// and the session still resumes to an uninterrupted run's output.
#[test]
fn gc_keep_prunes_old_checkpoints() {
    let env = Env::new();
    let (plain, first, k) = checkpointed_counter(&env);
    let mut chain = vec![k.clone()];
    loop {
        let v = env.inspect_json(chain.last().unwrap());
        match v["parent"].as_str() {
            Some(p) => chain.push(p.to_owned()),
            None => break,
        }
    }
    assert!(chain.len() >= 4, "{chain:?}");
    let history = |k: &str| history(&env, k);
    assert_eq!(history(&k), chain, "--history walks the parents");
    let (_, err, code) = env.output(&["store", "gc", "--keep", "0"]);
    assert_eq!(code, 2, "{err}");
    let (out, err, code) = env.output(&["store", "gc", "--keep", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.starts_with("deleted 0 "), "{out}");
    for (i, s) in chain.iter().enumerate() {
        let (_, err, code) = env.output(&["inspect", s]);
        assert_eq!(
            code,
            if i < 2 { 0 } else { 1 },
            "snapshot {i} of the chain: {err}"
        );
    }
    assert_eq!(history(&k), chain[..2]);
    let (out, _, _) = env.output(&["inspect", "--history", &k]);
    assert!(
        out.contains(&format!(
            "(older snapshots, from {}, were pruned",
            &chain[2][..19]
        )),
        "{out}"
    );
    verifies_and_finishes(&env, first, &k, &plain.stdout);
}

/// History pruned only in part — an ancestor's snapshot object still stored without its
/// memory image (a space's collection can spare one it was asked about recently) — ends the
/// history walk instead of failing `store gc`.
///
/// The damaged ancestor is the newest whose memory image no newer snapshot shares: the
/// counter leaves its memory unchanged for stretches of its hash loop, so two snapshots in a
/// row can name the same image (the suspend right after a checkpoint, on a slow machine).
#[test]
fn a_partly_pruned_ancestor_ends_the_history() {
    let env = Env::new();
    let (plain, first, k) = checkpointed_counter(&env);
    let chain = history(&env, &k);
    assert!(chain.len() >= 3, "{chain:?}");
    let images: Vec<String> = chain
        .iter()
        .map(|s| {
            env.inspect_json(s)["memories"][0]["kappa"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    let i = (1..chain.len() - 1)
        .find(|&i| !images[..i].contains(&images[i]))
        .unwrap_or_else(|| panic!("no ancestor with an image of its own: {images:?}"));
    let hex = &images[i]["blake3:".len()..];
    std::fs::remove_file(env.store().join("objects").join(&hex[..2]).join(&hex[2..])).unwrap();
    let (out, err, code) = env.output(&["store", "gc"]);
    assert_eq!(code, 0, "{out}{err}");
    let (_, err, code) = env.output(&["inspect", &chain[i + 1]]);
    assert_eq!(code, 1, "the rest of that history went: {err}");
    verifies_and_finishes(&env, first, &k, &plain.stdout);
}

/// `run --keep N` prunes the session's own history as it goes (ferry alone with the store):
/// only its newest N snapshots are left, another session's history is untouched, the store
/// verifies and the newest snapshot resumes to the uninterrupted run's output.
#[test]
fn run_keep_prunes_the_sessions_own_history_as_it_goes() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "300"];
    let plain = env.plain(&args);
    let history = |k: &str| history(&env, k).len();
    let every = ["--checkpoint-every", "100ms"];
    let (_, other) = crate::harness::run_and_suspend_after_checkpoints(
        &env,
        &[&every[..], &args[..]].concat(),
        4,
    );
    let other_history = history(&other);
    assert!(other_history >= 4, "{other_history}");
    let keep = ["--keep", "2"];
    let (first, k) = crate::harness::run_and_suspend_after_checkpoints(
        &env,
        &[&every[..], &keep[..], &args[..]].concat(),
        4,
    );
    assert_eq!(history(&k), 2, "only the newest two are left");
    assert_eq!(
        history(&other),
        other_history,
        "another session is not pruned"
    );
    verifies_and_finishes(&env, first, &k, &plain.stdout);
    let (_, err, code) = env.output(&["run", "--keep", "0", g.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
}

/// With `--keep`, a long run's checkpoints do not pile up on disk: packs that mostly hold
/// chunks of pruned snapshots are rewritten with only their live chunks, so the packs stay
/// within about twice the guest's memory (without that, 30 checkpoints of this 16 MiB guest,
/// a tenth of it rewritten between each, left 62 MiB of packs); the newest snapshot still
/// verifies and resumes to the output of an uninterrupted run.
#[test]
fn checkpoints_pruned_with_keep_leave_the_store_bounded() {
    let env = Env::new();
    let g = guest("wasm/dirty.wasm");
    let args = [g.to_str().unwrap(), "--", "16", "30", "100"];
    let plain = env.plain(&args);
    let every = ["--checkpoint-every", "100ms", "--keep", "1"];
    let (first, k) = crate::harness::run_and_suspend(&env, &[&every[..], &args[..]].concat(), 2500);
    assert!(history(&env, &k).len() == 1, "only the newest is kept");
    let packs: u64 = std::fs::read_dir(env.store().join("packs"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(
        packs < 36 << 20,
        "{packs} bytes of packs for 16 MiB of memory"
    );
    verifies_and_finishes(&env, first, &k, &plain.stdout);
}

/// The compiled-code cache stays within `FERRY_CACHE_MAX_MB`: compiling one module evicts
/// the least recently used others (here, with a limit of 0, all of them), and an evicted
/// module is simply compiled again.
#[test]
fn the_compiled_code_cache_is_bounded() {
    let cache = tempfile::tempdir().unwrap();
    let env = Env::new()
        .with_var("FERRY_CACHE", cache.path().to_str().unwrap())
        .with_var("FERRY_CACHE_MAX_MB", "0");
    let cached = || -> Vec<String> {
        std::fs::read_dir(cache.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cwasm"))
            .collect()
    };
    let run = |g: &str, args: &[&str]| {
        let g = guest(g);
        let (_, err, code) = env.output(&[&["run", g.to_str().unwrap(), "--"], args].concat());
        assert_eq!(code, 0, "{err}");
    };
    run("wasm/cpu.wasm", &["1"]);
    let first = cached();
    assert_eq!(first.len(), 1, "{first:?}");
    run("wasm/lines.wasm", &[]);
    let second = cached();
    assert_eq!(second.len(), 1, "{second:?}");
    assert_ne!(first, second, "the other module's code was evicted");
    run("wasm/cpu.wasm", &["1"]);
    assert_eq!(cached(), first, "compiled again");
}

/// A tuning variable that does not parse is refused, naming it, rather than ignored.
#[test]
fn tuning_variables_that_do_not_parse_are_refused() {
    for (name, value) in [
        ("FERRY_CACHE_MAX_MB", "8GiB"),
        ("FERRY_ZSTD", "max"),
        ("FERRY_ZSTD", "0"),
        ("FERRY_PEER_SILENCE_MS", "15s"),
        ("FERRY_PEER_SILENCE_MS", "500"),
    ] {
        let env = Env::new().with_var(name, value);
        let (_, err, code) = env.output(&["ps"]);
        assert_eq!(code, 1, "{name}={value}: {err}");
        assert!(
            err.contains(&format!("{name}={value} is not")),
            "{name}={value}: {err}"
        );
    }
}

#[test]
fn gc_deletes_only_what_no_session_reaches() {
    let (env, k) = suspended_counter();
    let orphan = {
        use ferry_store::Store;
        let store = ferry_store::FsStore::open(env.store()).unwrap();
        let orphan = store.put(b"nobody refers to me").unwrap();
        // Another process has the store open (it may be about to name that object).
        let (_, err, code) = env.output(&["store", "gc"]);
        assert_eq!(code, 1);
        assert!(err.contains("is in use by another ferry process"), "{err}");
        orphan
    };
    // A module an older ferry instrumented, named by its `derived` ref (a cache of that
    // version: nothing here needs it).
    let old_ref = format!("derived/instrument-v1/{}", "ab".repeat(32));
    let old_module = {
        use ferry_store::Store;
        let store = ferry_store::FsStore::open(env.store()).unwrap();
        let m = store.put(b"instrumented by ferry long ago").unwrap();
        let r = ferry_store::RefValue {
            epoch: 0,
            target: m,
        };
        store.cas_ref(&old_ref, None, Some(r)).unwrap();
        // Marked as using exceptions, as prepare marks such a module.
        let mark = format!("derived/exceptions/{}", m.to_hex());
        store.cas_ref(&mark, None, Some(r)).unwrap();
        m
    };
    let (out, _, code) = env.output(&["store", "gc", "--dry-run"]);
    assert_eq!(code, 0);
    assert!(out.contains("would delete 2 objects"), "{out}");
    let (out, _, code) = env.output(&["store", "gc"]);
    assert_eq!(code, 0);
    assert!(out.contains("deleted 2 objects"), "{out}");
    {
        use ferry_store::Store;
        let store = ferry_store::FsStore::open(env.store()).unwrap();
        assert!(!store.has(&orphan).unwrap());
        assert!(!store.has(&old_module).unwrap());
        assert!(
            store.get_ref(&old_ref).unwrap().is_none(),
            "its ref goes too"
        );
        let mark = format!("derived/exceptions/{}", old_module.to_hex());
        assert!(store.get_ref(&mark).unwrap().is_none(), "and its mark");
        let current = format!(
            "derived/instrument-v{}/",
            ferry_instrument::INSTRUMENT_VERSION
        );
        assert!(
            store
                .list_refs()
                .unwrap()
                .iter()
                .any(|(name, _)| name.starts_with(&current)),
            "this version's prepared module is kept"
        );
    }
    let (o, e, code) = env.output(&["store", "verify"]);
    assert_eq!(code, 0, "{o}{e}");
    let (_, err, code) = env.output(&["resume", &k]);
    assert_eq!(code, 0, "the snapshot still resumes after gc: {err}");
}

/// The largest pack of `env`'s store (a guest memory's, written with direct I/O) and its
/// bytes, then flips one bit in its fourth chunk (objects start at 4096): write the bytes
/// back to repair it.
fn damage_memory_pack(env: &Env, at_least: usize) -> (std::path::PathBuf, Vec<u8>) {
    let packs = env.store().join("packs");
    let pack = std::fs::read_dir(&packs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "pack"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let good = std::fs::read(&pack).unwrap();
    assert!(
        good.len() >= at_least,
        "the memory's pack: {} bytes",
        good.len()
    );
    let mut bad = good.clone();
    bad[4096 + 3 * 65536 + 1000] ^= 1;
    std::fs::write(&pack, &bad).unwrap();
    (pack, good)
}

/// A resume maps the memory chunks a durable store wrote with direct I/O (block-aligned in
/// their pack) instead of copying them, and lets the guest run while a thread re-hashes them
/// (post-copy); the guest's first host call waits for that check, so damage in the pack
/// refuses the resume with nothing shown and changes nothing. Repaired, the same snapshot
/// resumes, mapped, to the output of an uninterrupted run (and, with `FERRY_VERIFY_DIRTY`,
/// every later incremental snapshot of the mapped memory is checked). With
/// `FERRY_CHECK_WHILE_RUNNING=off` the check ends before the guest runs, with the same
/// refusal.
#[test]
fn chunks_mapped_from_a_pack_are_verified_before_the_guest_shows_anything() {
    let env = Env::new();
    let g = guest("wasm/dirty.wasm");
    // 16 MiB of random bytes, then 40 ticks of 100 ms rewriting 1% of the pages each.
    let args = [g.to_str().unwrap(), "--", "16", "40", "10"];
    let plain = env.plain(&args);
    let (before, k) = crate::harness::run_and_suspend(&env, &args, 1500);
    assert!(
        String::from_utf8_lossy(&before).starts_with("ready\n"),
        "suspended before the memory was filled"
    );
    let (pack, good) = damage_memory_pack(&env, 16 << 20);
    for while_running in [true, false] {
        let out = env
            .ferry()
            .env(
                "FERRY_CHECK_WHILE_RUNNING",
                if while_running { "on" } else { "off" },
            )
            .args(["-v", "resume", &k])
            .output()
            .expect("spawn ferry");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(out.stdout.is_empty(), "the guest showed output");
        assert!(err.contains("mapped from packs"), "{err}");
        assert!(
            err.contains("refused while restoring") && err.contains("is corrupt"),
            "{err}"
        );
        assert_eq!(
            err.contains("a mapped chunk failed its check"),
            while_running,
            "{err}"
        );
    }
    std::fs::write(&pack, &good).unwrap();
    // Resumed (mapped), suspended again a second later (an incremental snapshot of memory
    // mapped from the pack), then resumed to the end.
    let child = env
        .ferry()
        .args(["-v", "resume", &k])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn ferry");
    std::thread::sleep(std::time::Duration::from_millis(1000));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let middle = child.wait_with_output().expect("wait ferry");
    let err = String::from_utf8_lossy(&middle.stderr);
    assert_eq!(middle.status.code(), Some(75), "{err}");
    assert!(err.contains("mapped from packs"), "{err}");
    let k = crate::harness::suspended_kappa(&middle);
    let last = crate::harness::resume_to_end(&env, &k);
    assert_eq!(
        String::from_utf8_lossy(&[before, middle.stdout, last].concat()),
        String::from_utf8_lossy(&plain.stdout)
    );
}

/// A guest that makes no host call after its resume — it fills 10 MiB, prints `ready`, then
/// sums its memory for ever — is stopped at its next safe point when a mapped chunk fails
/// the check that runs beside it: the resume ends refused, with nothing shown, instead of
/// running on corrupt memory. Repaired, the same snapshot resumes and suspends again.
#[test]
fn a_guest_running_while_its_chunks_are_checked_is_stopped_if_one_fails() {
    let env = Env::new();
    let m = env.path("spin.wat");
    std::fs::write(
        &m,
        r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 161)
  (data (i32.const 16) "ready\n")
  (func (export "_start") (local $i i32) (local $s i32)
    (i32.store (i32.const 0) (i32.const 16))
    (i32.store (i32.const 4) (i32.const 6))
    (local.set $i (i32.const 65536))
    (loop $fill
      (i32.store (local.get $i) (i32.mul (local.get $i) (i32.const -1640531535)))
      (local.set $i (i32.add (local.get $i) (i32.const 4)))
      (br_if $fill (i32.lt_u (local.get $i) (i32.const 10551296))))
    (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))
    (loop $spin
      (local.set $i (i32.const 65536))
      (loop $sum
        (local.set $s (i32.add (local.get $s) (i32.load (local.get $i))))
        (local.set $i (i32.add (local.get $i) (i32.const 4)))
        (br_if $sum (i32.lt_u (local.get $i) (i32.const 10551296))))
      (i32.store (i32.const 8) (local.get $s))
      (br $spin))))"#,
    )
    .unwrap();
    let (before, k) = crate::harness::run_and_suspend(&env, &[m.to_str().unwrap()], 1500);
    assert_eq!(String::from_utf8_lossy(&before), "ready\n");
    let (pack, good) = damage_memory_pack(&env, 8 << 20);
    // The check starts 300 ms after the restore, so the guest surely runs before it fails.
    let child = env
        .ferry()
        .env("FERRY_FAULT_PAUSE", "check-mapped:300")
        .args(["-v", "resume", &k])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn ferry");
    let pid = child.id();
    let watchdog = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(60));
        // SAFETY: signalling our own child (gone by then if the test passes).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    });
    let out = child.wait_with_output().expect("wait ferry");
    drop(watchdog);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty(), "the guest showed output");
    assert!(err.contains("checking=true"), "it ran while checked: {err}");
    assert!(
        err.contains("refused while restoring") && err.contains("is corrupt"),
        "{err}"
    );
    std::fs::write(&pack, &good).unwrap();
    let (more, k2) = crate::harness::resume_and_suspend(&env, &["-v", &k], 1000);
    assert!(more.is_empty());
    assert_ne!(k2, k);
}

/// `ferry bench` outside the source checkout says where it must run, not just that a file is
/// missing.
#[test]
fn bench_outside_the_checkout_says_where_to_run_it() {
    let env = Env::new();
    let out = env
        .ferry()
        .current_dir(env.path(""))
        .args([
            "bench",
            "--only",
            "steady",
            "--pairs",
            "1",
            "--workloads",
            "cpu",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no directory `guests/wasm` here")
            && err.contains("run it from the checkout's root"),
        "{err}"
    );
}

/// A guest that traps (here `unreachable`, as C's `abort()` compiles) ends with 134, as
/// `wasmtime run` ends it (128 + SIGABRT), on either engine: what it printed first is shown,
/// and the exit code tells a crash of the program from ferry failing (1). The cause reads the
/// same on both engines; the JIT adds the call stack by function name; every line of the
/// report is ferry's and starts with `ferry: ` (the guest's own stderr is told from it so).
#[test]
fn a_guest_that_traps_exits_134_as_under_wasmtime() {
    let env = Env::new();
    let m = env.path("abort.wat");
    let named = crate::harness::ABORTING_GUEST.replace(
        "    unreachable))",
        "    (call $crash))\n  (func $crash unreachable))",
    );
    std::fs::write(&m, named).unwrap();
    for engine in ["jit", "interp"] {
        let out = env
            .ferry()
            .args(["run", "--engine", engine, m.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(134), "{engine}: {err}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "before\n");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(
            lines[0], "ferry: guest trapped: wasm `unreachable` instruction executed",
            "{engine}: {err}"
        );
        assert!(lines.iter().all(|l| l.starts_with("ferry: ")), "{err}");
        if engine == "jit" {
            assert_eq!(
                lines[1..],
                [
                    "ferry: guest call stack, innermost first:",
                    "ferry:   0: crash",
                    "ferry:   1: (no name: function 2 of the instrumented module)",
                ],
                "{err}"
            );
        } else {
            assert_eq!(lines.len(), 1, "{err}");
        }
    }
}

/// After a resume, the frames that were on the stack at the suspend run in their rewind
/// copies until they return; a trap there is reported with the call stack an uninterrupted
/// run reports, byte for byte — the functions' own names, not unnamed functions of the
/// instrumented module.
#[test]
fn a_trap_after_a_resume_reports_the_call_stack_of_an_uninterrupted_run() {
    let env = Env::new();
    let m = env.path("late-crash.wat");
    let wat = crate::harness::ABORTING_GUEST.replace(
        "    unreachable))",
        "    (call $work))
  (func $work (call $spin (i32.const 1500000000)) (call $crash))
  (func $spin (param $n i32)
    (loop $l
      (local.set $n (i32.sub (local.get $n) (i32.const 1)))
      (br_if $l (local.get $n))))
  (func $crash unreachable))",
    );
    std::fs::write(&m, wat).unwrap();
    let m = m.to_str().unwrap();
    let plain = env.ferry().args(["run", m]).output().unwrap();
    assert_eq!(plain.status.code(), Some(134));
    let plain_err = String::from_utf8_lossy(&plain.stderr).into_owned();
    assert!(
        plain_err.contains("ferry:   1: work\n"),
        "uninterrupted: {plain_err}"
    );
    let (_, k) = crate::harness::suspend_after_output(&env, "run", &[m], 300);
    let resumed = env.ferry().args(["resume", &k]).output().unwrap();
    assert_eq!(resumed.status.code(), Some(134));
    assert_eq!(String::from_utf8_lossy(&resumed.stderr), plain_err);
}

/// Each kind of trap is reported with the same cause on both engines (the WebAssembly
/// specification's wording), and a deep call stack is cut to its innermost frames.
#[test]
fn trap_causes_read_the_same_on_both_engines() {
    let env = Env::new();
    let cases = [
        (
            "(i32.store (i32.const 70000) (i32.const 1))",
            "out of bounds memory access",
        ),
        (
            "(drop (i32.div_s (i32.const 1) (i32.const 0)))",
            "integer divide by zero",
        ),
        (
            "(drop (i32.trunc_f32_s (f32.const nan)))",
            "invalid conversion to integer",
        ),
        ("(call_indirect (i32.const 1))", "uninitialized element"),
        ("(call $down (i32.const 0))", "call stack exhausted"),
    ];
    for (i, (body, cause)) in cases.iter().enumerate() {
        let m = env.path(&format!("trap{i}.wat"));
        let wat = format!(
            "(module (memory 1) (table 2 funcref)
               (func $down (param i32) (call $down (i32.add (local.get 0) (i32.const 1))))
               (func (export \"_start\") {body}))"
        );
        std::fs::write(&m, wat).unwrap();
        for engine in ["jit", "interp"] {
            let (_, err, code) = env.output(&["run", "--engine", engine, m.to_str().unwrap()]);
            assert_eq!(code, 134, "{engine} {body}: {err}");
            assert_eq!(
                err.lines().next(),
                Some(format!("ferry: guest trapped: {cause}").as_str()),
                "{engine} {body}"
            );
            assert!(err.lines().all(|l| l.starts_with("ferry: ")), "{err}");
        }
    }
    // The unbounded recursion on the JIT: eight frames, then how many more.
    let m = env.path("trap4.wat");
    let (_, err, _) = env.output(&["run", m.to_str().unwrap()]);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 11, "{err}");
    assert!(lines[2..10].iter().all(|l| l.ends_with(": down")), "{err}");
    assert!(
        lines[10].starts_with("ferry:   ... and ") && lines[10].ends_with(" outer frames"),
        "{err}"
    );
}

/// `store gc` on a store with much to delete and packs to rewrite says how far it has come
/// (after 1 s, every 2 s; at once here, `FERRY_PROGRESS_AFTER_MS=0`), and the snapshot it
/// keeps still resumes.
#[test]
fn store_gc_says_how_far_it_has_come() {
    let env = Env::new().with_var("FERRY_PROGRESS_AFTER_MS", "0");
    let g = guest("wasm/dirty.wasm");
    // Every 100 ms tick rewrites half of 64 MiB: the older checkpoints' chunks become
    // garbage, their packs half-empty or empty.
    let args = [
        "--checkpoint-every",
        "150ms",
        g.to_str().unwrap(),
        "--",
        "64",
        "1000",
        "500",
    ];
    let (_, k) = crate::harness::run_and_suspend_after_checkpoints(&env, &args, 8);
    let (out, err, code) = env.output(&["store", "gc", "--keep", "1"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("rewrote "), "{out}");
    assert!(err.contains("ferry: collecting garbage: "), "{err}");
    let (_, err, code) = env.output(&["inspect", &k]);
    assert_eq!(code, 0, "{err}");
}

/// A resume that writes a snapshot's mount back into an empty directory says how far it has
/// come, of how many MiB (after 1 s, every 2 s; at once here, `FERRY_PROGRESS_AFTER_MS=0`),
/// and the file comes back whole.
#[test]
fn a_write_back_says_how_far_it_has_come_of_how_much() {
    let env = Env::new().with_var("FERRY_PROGRESS_AFTER_MS", "0");
    let g = guest("wasm/cpu.wasm");
    let (d, dir) = env.data_dir("data");
    let big = crate::harness::varied_bytes(64 << 20, 3);
    std::fs::write(d.join("big.bin"), &big).unwrap();
    std::fs::write(d.join("small.txt"), "small").unwrap();
    let (_, k) = run_and_suspend(
        &env,
        &["--dir", &dir, g.to_str().unwrap(), "--", "400"],
        500,
    );
    let fresh = env.path("fresh");
    let fresh_dir = format!("{}::/data", fresh.display());
    let (out, k) = suspend_after_output(&env, "resume", &["--dir", &fresh_dir, &k], 300);
    let err = String::from_utf8_lossy(&out.stderr);
    let said = format!(
        "ferry: writing the snapshot's `/data` into {}: ",
        fresh.display()
    );
    let line = err
        .lines()
        .find(|l| l.starts_with(&said))
        .unwrap_or_default();
    assert!(line.ends_with(" of 64.0 MiB"), "{err}");
    assert_eq!(std::fs::read(fresh.join("big.bin")).unwrap(), big);
    let (_, err, code) = env.output(&["inspect", &k]);
    assert_eq!(code, 0, "{err}");
}
