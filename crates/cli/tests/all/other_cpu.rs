//! Another CPU: snapshots ferry takes on this x86-64 machine resume in V8 built for arm64 (Node
//! 24 for arm64 under qemu-user, `scripts/setup.sh`), and a session taken over there, suspended
//! and given back goes on here — the same snapshot format, the same output, byte for byte.
//! (V8 compiles the guest to arm64 code; qemu runs that code instruction by instruction as an
//! arm64 machine would, so these tests are slow, not different.)

use std::io::{BufRead, BufReader, Read};
use std::process::Child;
use std::sync::mpsc;
use std::time::Duration;

use crate::harness::{Env, SPACE_TOKEN, SpaceProc, guest};
use crate::migrate::eventually;
use crate::takeover::{check_files, interrupt, resumed_ends_as, run_on, take_over_by, until};
use crate::web::{all_passed, command, kit_in, node_arm64};

#[test]
fn the_conformance_kit_taken_on_x86_64_resumes_in_v8_on_arm64() {
    let table = kit_in("jit", "node", Some(&node_arm64()));
    let first = table.lines().next().unwrap();
    assert!(first.ends_with(" on arm64"), "{table}");
    all_passed(&table, 25);
    for case in [
        "deep-recursion",
        "cpython",
        "open-files",
        "after-memory-grow",
    ] {
        assert!(
            table
                .lines()
                .any(|l| l.starts_with(case) && l.ends_with(" pass")),
            "{case}:\n{table}"
        );
    }
}

/// Takes the suspended session `id` over in V8 on arm64, lets its guest run there for a
/// while (with `printed`, until it printed on stdout there), and suspends it (Ctrl-C), which
/// gives it back to the space suspended at a new snapshot: what the Node process wrote on
/// stderr.
fn a_trip_to_arm64(space: &SpaceProc, id: &str, printed: bool) -> String {
    let before = space.session(id).unwrap()["snapshot"].clone();
    let mut node = take_over_by(command(&node_arm64()), space, id, &["-v"]);
    until(space, id, "was lent", |s| s["state"] == "lent");
    let lent = space.session(id).unwrap();
    assert!(
        lent["lent_to"].as_str().unwrap().contains("(arm64, pid"),
        "{lent}"
    );
    // The guest's stdout reaches a pipe, which its C library writes only when a buffer
    // fills: `-v`'s line on stderr says when the guest runs there.
    let (tx, rx) = mpsc::channel();
    let stderr = node.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines() {
            let line = line.unwrap();
            if line.contains("the guest runs") {
                let _ = tx.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let mut stdout = node.stdout.take().unwrap();
    let (out_tx, out_rx) = mpsc::channel();
    let out = std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut b = [0u8; 4096];
        loop {
            match stdout.read(&mut b).unwrap() {
                0 => return all,
                n => {
                    all.extend_from_slice(&b[..n]);
                    let _ = out_tx.send(());
                }
            }
        }
    });
    if rx.recv_timeout(Duration::from_secs(120)).is_err() {
        let _ = node.kill();
        panic!(
            "{id}: the guest never ran on arm64: {}",
            reader.join().unwrap()
        );
    }
    if printed && out_rx.recv_timeout(Duration::from_secs(120)).is_err() {
        let _ = node.kill();
        panic!(
            "{id}: the guest printed nothing on arm64: {}",
            reader.join().unwrap()
        );
    }
    std::thread::sleep(Duration::from_millis(if printed { 300 } else { 1500 }));
    interrupt(&node);
    let code = wait(&mut node);
    let err = reader.join().unwrap();
    out.join().unwrap();
    assert_eq!(code, Some(75), "{id}: {err}");
    assert!(err.contains("suspended blake3:"), "{id}: {err}");
    let back = space.session(id).unwrap();
    assert_eq!(back["state"], "suspended", "{back}");
    assert!(back.get("lent_to").is_none(), "{back}");
    assert_ne!(
        back["snapshot"], before,
        "{id}: nothing came back from arm64"
    );
    err
}

/// The exit code of `child`, waited for at most 2 minutes.
fn wait(child: &mut Child) -> Option<i32> {
    for _ in 0..1200 {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    panic!("the Node process did not end within 2 minutes of Ctrl-C");
}

/// A session started on this machine's space goes to arm64 and back twice (suspended here,
/// taken over by V8 on arm64, run there, suspended there, resumed here): its log, exit code
/// and files are an uninterrupted run's. The guests: one that sleeps between lines (checking
/// that its monotonic clock never runs back across the moves) and one that writes files in
/// a mount.
#[test]
fn a_session_goes_from_x86_64_to_arm64_and_back_and_ends_as_an_uninterrupted_run() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let sleepy = guest("wasm/sleepy.wasm");
    let files = guest("wasm/files.wasm");
    for (id, args) in [
        ("sleepy", vec![sleepy.to_str().unwrap(), "--", "300", "3"]),
        (
            "files",
            vec![files.to_str().unwrap(), "--", "/data", "1200"],
        ),
    ] {
        let (plain_dir, pd) = here.data_dir(&format!("{id}-plain"));
        let (_, sd) = here.data_dir(&format!("{id}-sent"));
        let plain = here.plain(&[&["--dir", &pd][..], &args].concat());
        run_on(&here, &space, id, &[&["--dir", &sd][..], &args].concat());
        for trip in 0..2 {
            std::thread::sleep(Duration::from_millis(300));
            let (_, err, code) = here.output(&["--space", &space.url, "suspend", id]);
            assert_eq!(code, 0, "{id}, trip {trip}: {err}");
            let err = a_trip_to_arm64(&space, id, false);
            // The sleeper's stderr is unbuffered: it said something while on arm64.
            assert!(id != "sleepy" || err.contains("\nwarn "), "{err}");
            if trip == 0 {
                let (_, err, code) = here.output(&["--space", &space.url, "resume", id]);
                assert_eq!(code, 0, "{id}, trip {trip}: {err}");
            }
        }
        resumed_ends_as(&here, &space, id, &plain);
        check_files(&here, &space, id, &plain_dir, id);
    }
}

/// CPython 3.12 running a pure-Python loop on this machine's space is suspended here, taken
/// over by V8 on arm64, suspended there mid-loop, and resumed here: the session's log is an
/// uninterrupted run's.
#[test]
fn a_cpython_session_suspended_on_arm64_goes_on_on_x86_64() {
    let py = crate::python::python312();
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let mount = crate::harness::loop_py_app(&here);
    let args = [
        "--dir",
        mount.as_str(),
        py.to_str().unwrap(),
        "--",
        "/app/loop.py",
        "30",
    ];
    let plain = here.plain(&args);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    run_on(&here, &space, "py", &args);
    // Let it get going (the space prepares CPython first): its first line in the log.
    eventually("the session prints", || {
        !here
            .output(&["--space", &space.url, "logs", "py"])
            .0
            .is_empty()
    });
    std::thread::sleep(Duration::from_millis(300));
    let (_, err, code) = here.output(&["--space", &space.url, "suspend", "py"]);
    assert_eq!(code, 0, "{err}");
    // It prints a line a step (flushed): it ran Python on arm64 before it was suspended.
    a_trip_to_arm64(&space, "py", true);
    resumed_ends_as(&here, &space, "py", &plain);
}
