//! Sessions in spaces and live migration (docs/migration.md): guests run by `ferry serve`,
//! moved between spaces while they print, with the combined output byte-identical to an
//! uninterrupted run; the destination's policy re-admits what a snapshot asks for; and a space
//! killed (`kill -9`) at each step of the protocol leaves exactly one copy, nothing lost or
//! repeated.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{Blackhole, Env, SPACE_TOKEN, Seen, SpaceProc, TestCa, dir_contents, guest};

/// `cli`, which must succeed.
pub(crate) fn ok(here: &Env, space: &str, args: &[&str]) {
    let (_, err, code) = cli(here, space, args);
    assert_eq!(code, 0, "ferry --space {space} {args:?}: {err}");
}

/// `cli`, which must fail: its stderr.
pub(crate) fn refused(here: &Env, space: &str, args: &[&str]) -> String {
    let (_, err, code) = cli(here, space, args);
    assert_ne!(code, 0, "ferry --space {space} {args:?} was not refused");
    err
}

/// The CLI, driving sessions on `space`.
pub(crate) fn cli(here: &Env, space: &str, args: &[&str]) -> (String, String, i32) {
    let mut all = vec!["--space", space];
    all.extend_from_slice(args);
    here.output(&all)
}

pub(crate) fn client() -> Env {
    Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN)
}

/// Waits until `f` holds (or panics after 60 s).
pub(crate) fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `ferry --space URL logs ID`, with and without `--follow` (both follow moves), must equal
/// `expected`, and `wait` must report exit code 0.
pub(crate) fn assert_finished_like(here: &Env, first: &str, id: &str, expected: &[u8]) {
    let (_, err, code) = cli(here, first, &["wait", id]);
    assert_eq!(code, 0, "wait: {err}");
    for follow in [true, false] {
        let mut args = vec!["--space", first, "logs", id];
        if follow {
            args.push("--follow");
        }
        let out = here.ferry().args(&args).output().unwrap();
        assert!(out.status.success());
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(expected),
            "combined output (logs, follow: {follow}) differs from an uninterrupted run"
        );
    }
}

/// Runs `wasm/cpu.wasm ROUNDS` on `space` as session `id` and lets it run for 300 ms;
/// returns what an uninterrupted run of it shows.
pub(crate) fn run_cpu_guest(here: &Env, space: &str, id: &str, rounds: &str) -> Seen {
    let g = guest("wasm/cpu.wasm");
    let plain = here.plain(&[g.to_str().unwrap(), "--", rounds]);
    ok(
        here,
        space,
        &["run", "--session", id, g.to_str().unwrap(), "--", rounds],
    );
    std::thread::sleep(Duration::from_millis(300));
    plain
}

/// `ferry --space FROM migrate ID --to TO --max-rounds 1` (the guest paused after one
/// pre-copy round) on a thread of its own, by a client with `vars` set: its stdout, stderr
/// and exit code arrive on the receiver.
pub(crate) fn migrate_in_background(
    vars: &[(&str, &str)],
    from: &str,
    id: &str,
    to: &str,
) -> std::sync::mpsc::Receiver<(String, String, i32)> {
    cli_in_background(
        vars,
        from,
        &["migrate", id, "--to", to, "--max-rounds", "1"],
    )
}

/// `ferry --space SPACE ARGS` on a thread of its own, by a client with `vars` set: its
/// stdout, stderr and exit code arrive on the receiver.
pub(crate) fn cli_in_background(
    vars: &[(&str, &str)],
    space: &str,
    args: &[&str],
) -> std::sync::mpsc::Receiver<(String, String, i32)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let (space, args) = (space.to_owned(), owned(args));
    std::thread::spawn(move || {
        let asker = vars.iter().fold(client(), |e, (k, v)| e.with_var(k, v));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let _ = tx.send(cli(&asker, &space, &args));
    });
    rx
}

/// `ferry store verify` succeeds on each space's store.
pub(crate) fn stores_verify(spaces: &[&SpaceProc]) {
    for s in spaces {
        let (out, err, code) = s.env.output(&["store", "verify"]);
        assert_eq!(code, 0, "store of {}: {out}{err}", s.url);
    }
}

/// Moves session `id` from `spaces[0]` to `spaces[1]` and back, up to `times` moves, each
/// after `before` has waited on the space that holds it; stops early once the guest no
/// longer runs there, and requires at least two moves.
fn move_back_and_forth(
    here: &Env,
    spaces: &[SpaceProc; 2],
    id: &str,
    times: usize,
    mut before: impl FnMut(&SpaceProc),
) {
    let mut moves = 0;
    for i in 0..times {
        let (from, to) = (&spaces[i % 2], &spaces[(i + 1) % 2]);
        before(from);
        let (_, err, code) = cli(here, &from.url, &["migrate", id, "--to", &to.url]);
        // The guest ended just before (`exited`, or `is not running` when it ended while
        // the request was on its way): no move is owed.
        if code != 0 && from.state(id).as_deref() != Some("running") {
            break;
        }
        assert_eq!(code, 0, "move {i}: {err}");
        moves += 1;
    }
    assert!(moves >= 2, "only {moves} moves");
}

#[test]
fn a_c_guest_moves_between_three_spaces_while_it_prints_and_its_output_is_unchanged() {
    let here = client();
    let spaces = [
        SpaceProc::start(&[]),
        SpaceProc::start(&[]),
        SpaceProc::start(&[]),
    ];
    let g = guest("wasm/cpu.wasm");
    let plain = here.plain(&[g.to_str().unwrap(), "--", "450"]);
    assert_eq!(plain.code, 0);

    let (out, err, code) = cli(
        &here,
        &spaces[0].url,
        &[
            "run",
            "--session",
            "mover",
            g.to_str().unwrap(),
            "--",
            "450",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), "mover");

    let mut moves = 0;
    for i in 0..6 {
        std::thread::sleep(Duration::from_millis(250));
        let (from, to) = (&spaces[i % 3], &spaces[(i + 1) % 3]);
        // Every other move also changes engine.
        let engine = if i % 2 == 1 { "interp" } else { "jit" };
        let (out, err, code) = cli(
            &here,
            &from.url,
            &[
                "migrate",
                "mover",
                "--to",
                &to.url,
                "--engine",
                engine,
                "--progress",
            ],
        );
        if code != 0 && err.contains("exited") {
            break;
        }
        assert_eq!(code, 0, "move {i}: {err}");
        let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(report["outcome"], "committed");
        assert!(err.contains("moved to"), "{err}");
        // --progress shows every pre-copy round, also those that ended before it looked.
        let rounds = report["rounds"].as_array().unwrap().len();
        assert!(rounds >= 1, "{report}");
        for r in 1..=rounds {
            assert_eq!(
                err.matches(&format!("ferry: pre-copy round {r}: ")).count(),
                1,
                "{err}"
            );
        }
        moves += 1;
        // The source is fenced: it cannot resume the session.
        let (_, err, code) = cli(&here, &from.url, &["resume", "mover"]);
        assert_ne!(code, 0);
        assert!(err.contains("moved to"), "{err}");
    }
    assert!(
        moves >= 3,
        "only {moves} moves happened before the guest exited"
    );
    assert_finished_like(&here, &spaces[0].url, "mover", &plain.stdout);
    // Every space's store verifies.
    stores_verify(&spaces.iter().collect::<Vec<_>>());
}

#[test]
fn a_cpython_program_moves_back_and_forth_with_its_files() {
    let py = crate::python::python312();
    let here = client();
    let spaces = [SpaceProc::start(&[]), SpaceProc::start(&[])];
    let mount = crate::harness::loop_py_app(&here);
    let args = [
        "--dir",
        mount.as_str(),
        py.to_str().unwrap(),
        "--",
        "/app/loop.py",
        "40",
    ];
    let plain = here.plain(&args);
    assert_eq!(plain.code, 0, "{}", plain.stderr);

    let mut run = vec!["run", "--session", "py"];
    run.extend_from_slice(&args);
    let (_, err, code) = cli(&here, &spaces[0].url, &run);
    assert_eq!(code, 0, "{err}");
    move_back_and_forth(&here, &spaces, "py", 4, |at| {
        // Let it get going (the first run prepares CPython in the space).
        eventually("the session prints", || {
            let (out, _, _) = cli(&here, &at.url, &["logs", "py"]);
            !out.is_empty() || at.state("py").as_deref() != Some("running")
        });
        std::thread::sleep(Duration::from_millis(400));
    });
    assert_finished_like(&here, &spaces[0].url, "py", &plain.stdout);
}

/// A guest holding descriptors whose names changed (`guests/c/handles.c`: files renamed,
/// replaced and deleted while open, a directory renamed while open) moves between spaces
/// while it runs: the files no path names travel in its snapshots, and it prints what an
/// uninterrupted run prints.
#[test]
fn descriptors_whose_names_changed_move_between_spaces() {
    let here = client();
    let spaces = [SpaceProc::start(&[]), SpaceProc::start(&[])];
    let g = guest("wasm/handles.wasm");
    let (data, mount) = here.data_dir("data");
    let args = [
        "--dir",
        mount.as_str(),
        g.to_str().unwrap(),
        "--",
        "/data",
        // ~1 s of spinning on the JIT: several moves 150 ms apart land before the end.
        "120000000",
    ];
    let plain = here.plain(&args);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    for e in std::fs::read_dir(&data).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            std::fs::remove_dir_all(p).unwrap();
        } else {
            std::fs::remove_file(p).unwrap();
        }
    }

    let mut run = vec!["run", "--session", "h"];
    run.extend_from_slice(&args);
    let (_, err, code) = cli(&here, &spaces[0].url, &run);
    assert_eq!(code, 0, "{err}");
    move_back_and_forth(&here, &spaces, "h", 8, |_| {
        std::thread::sleep(Duration::from_millis(150));
    });
    assert_finished_like(&here, &spaces[0].url, "h", &plain.stdout);
}

/// A snapshot or a move asked for just as the guest ends (while the space records how it
/// ended and keeps its files: `FERRY_FAULT_PAUSE` holds that window open) hears how the
/// guest ended, and the record says so by then. It used to hear "is not running" while the
/// record still said running.
#[test]
fn a_request_as_the_guest_ends_hears_how_it_ended() {
    let here = client();
    let a = SpaceProc::start_with_vars(&[("FERRY_FAULT_PAUSE", "final-files:3000")], &[]);
    let b = SpaceProc::start(&[]);
    let g = guest("wasm/cpu.wasm");
    let g = g.to_str().unwrap();
    let plain = here.plain(&[g, "--", "2"]);
    assert_eq!(plain.code, 0);
    ok(&here, &a.url, &["run", "--session", "e", g, "--", "2"]);
    eventually("the guest printed everything", || {
        cli(&here, &a.url, &["logs", "e"]).0.as_bytes() == plain.stdout
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        a.state("e").as_deref(),
        Some("running"),
        "the end is being recorded"
    );
    let err = refused(&here, &a.url, &["checkpoint", "e"]);
    assert!(err.contains("session `e` is exited, not running"), "{err}");
    assert_eq!(a.state("e").as_deref(), Some("exited"));
    let err = refused(&here, &a.url, &["migrate", "e", "--to", &b.url]);
    assert!(
        err.contains("session `e` is exited; only a running or suspended session can move"),
        "{err}"
    );
}

/// A file with several names (hard links) moves as one file: in the destination's fresh
/// directory, a write through one name still shows through the others (`handles.c`, step
/// 8; the move lands after the links are made, before the writes through them).
#[test]
fn a_file_with_several_names_moves_as_one_file() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let b = SpaceProc::start(&[]);
    let g = guest("wasm/handles.wasm");
    let (_, mount) = here.data_dir("data");
    let args = [
        "--dir",
        &mount,
        g.to_str().unwrap(),
        "--",
        "/data",
        "500000000",
        "8",
    ];
    let mut run = vec!["run", "--session", "l"];
    run.extend_from_slice(&args);
    ok(&here, &a.url, &run);
    eventually("the links are made", || {
        cli(&here, &a.url, &["logs", "l"]).0.contains("  linked\n")
    });
    ok(&here, &a.url, &["migrate", "l", "--to", &b.url]);
    let (_, err, code) = cli(&here, &a.url, &["wait", "l"]);
    assert_eq!(code, 0, "wait: {err}");
    let (out, _, _) = cli(&here, &a.url, &["logs", "l"]);
    for line in [
        "  first: \"through first|through second|through third|\"",
        "  one file: yes, 3 links",
        "  the same device and inode numbers as before: yes",
    ] {
        assert!(out.lines().any(|l| l == line), "`{line}` not in\n{out}");
    }
}

#[test]
fn the_destination_policy_refuses_what_it_does_not_grant_and_attenuates_mounts() {
    let here = client();
    let policy = here.path("policy.toml");
    std::fs::write(
        &policy,
        "version = 1\nenv = [\"LANG\"]\nmax_memory_mib = 48\n[[mount]]\nguest = \"/data\"\nread_only = true\n",
    )
    .unwrap();
    let strict = SpaceProc::start(&["--policy", policy.to_str().unwrap()]);
    let open = SpaceProc::start(&[]);
    let files = guest("wasm/files.wasm");
    let data = here.path("data");
    std::fs::create_dir_all(&data).unwrap();
    let other = format!("{}::/other", data.display());
    let at_data = format!("{}::/data", data.display());

    // Run: a mount or a variable the policy does not grant is refused, with the reason.
    let (_, err, code) = cli(
        &here,
        &strict.url,
        &[
            "run",
            "--dir",
            &other,
            files.to_str().unwrap(),
            "--",
            "/other",
        ],
    );
    assert_ne!(code, 0);
    assert!(
        err.contains("`/other`") && err.contains("grants no such mount"),
        "{err}"
    );
    let (_, err, code) = cli(
        &here,
        &strict.url,
        &[
            "run",
            "--env",
            "SECRET=1",
            guest("wasm/cpu.wasm").to_str().unwrap(),
        ],
    );
    assert_ne!(code, 0);
    assert!(err.contains("`SECRET`"), "{err}");

    // The memory cap: a guest that wants more than 48 MiB sees its allocation fail there.
    let heap = guest("wasm/heap.wasm");
    ok(
        &here,
        &strict.url,
        &[
            "run",
            "--session",
            "big",
            heap.to_str().unwrap(),
            "--",
            "96",
            "1",
        ],
    );
    let (_, _, code) = cli(&here, &strict.url, &["wait", "big"]);
    assert_eq!(code, 2, "heap exits 2 when malloc fails");
    let (_, err, _) = cli(&here, &strict.url, &["logs", "big"]);
    assert!(err.contains("out of memory at"), "{err}");
    // ... and a session already bigger than that is refused when it would move there.
    ok(
        &here,
        &open.url,
        &[
            "run",
            "--session",
            "big",
            heap.to_str().unwrap(),
            "--",
            "96",
            "400",
        ],
    );
    eventually("the heap is allocated", || {
        let (out, _, _) = cli(&here, &open.url, &["logs", "big"]);
        out.contains("allocated 96 MiB")
    });
    let (_, err, code) = cli(&here, &open.url, &["migrate", "big", "--to", &strict.url]);
    assert_ne!(code, 0);
    assert!(err.contains("admits at most 48 MiB"), "{err}");
    let (_, _, code) = cli(&here, &open.url, &["kill", "big"]);
    assert_eq!(code, 0);

    // Migration: a session with a variable the destination refuses stays where it is and
    // finishes there unchanged.
    let cpu = guest("wasm/cpu.wasm");
    let plain = here.plain(&["--env", "SECRET=1", cpu.to_str().unwrap(), "--", "150"]);
    ok(
        &here,
        &open.url,
        &[
            "run",
            "--session",
            "sec",
            "--env",
            "SECRET=1",
            cpu.to_str().unwrap(),
            "--",
            "150",
        ],
    );
    std::thread::sleep(Duration::from_millis(200));
    let (_, err, code) = cli(&here, &open.url, &["migrate", "sec", "--to", &strict.url]);
    assert_ne!(code, 0);
    assert!(
        err.contains("migration aborted") && err.contains("`SECRET`"),
        "{err}"
    );
    assert_finished_like(&here, &open.url, "sec", &plain.stdout);
    assert_eq!(strict.session("sec"), None);

    // An attenuated grant is honoured: /data arrives read-only, so the guest's next write
    // fails there (it reports the error and exits 1).
    ok(
        &here,
        &open.url,
        &[
            "run",
            "--session",
            "ro",
            "--dir",
            &at_data,
            files.to_str().unwrap(),
            "--",
            "/data",
            "3000",
        ],
    );
    std::thread::sleep(Duration::from_millis(300));
    ok(&here, &open.url, &["migrate", "ro", "--to", &strict.url]);
    let (_, _, code) = cli(&here, &open.url, &["wait", "ro"]);
    assert_eq!(
        code, 1,
        "the guest should fail writing to a read-only mount"
    );
    let out = here
        .ferry()
        .args(["--space", &open.url, "logs", "ro"])
        .output()
        .unwrap();
    let (_, err, _) = cli(&here, &strict.url, &["logs", "ro"]);
    assert!(
        err.contains("open") && err.to_lowercase().contains("read-only"),
        "stderr: {err} / {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Kills the source (or the destination) at `step` of a migration, restarts it, and checks
/// that exactly one copy of the session finishes, with output identical to a plain run.
fn survive_fault(step: &str, at_source: bool) {
    let here = client();
    let mut a = SpaceProc::start(&[]);
    let mut b = SpaceProc::start(&[]);
    let g = guest("wasm/cpu.wasm");
    let plain = here.plain(&[g.to_str().unwrap(), "--", "400"]);
    let faulty = if at_source { &mut a } else { &mut b };
    faulty.stop();
    faulty.spawn(Some(step));

    ok(
        &here,
        &a.url,
        &["run", "--session", "f", g.to_str().unwrap(), "--", "400"],
    );
    std::thread::sleep(Duration::from_millis(300));
    let (_, err, code) = cli(&here, &a.url, &["migrate", "f", "--to", &b.url]);
    if step == "dest-prepare" {
        assert_ne!(code, 0);
        assert!(err.contains("migration aborted"), "{err}");
    }
    let faulty = if at_source { &mut a } else { &mut b };
    faulty.wait_dead();
    // The dead space comes back (without the fault) on the same address.
    faulty.spawn(None);

    // Resolution: either the move committed (the source says moved, the destination runs
    // it) or it did not (the source has it, suspended or running; the destination not).
    eventually("the move is resolved", || {
        match (a.state("f").as_deref(), b.state("f").as_deref()) {
            (Some("moved"), Some(s)) => s != "prepared",
            (Some(_), None) => true,
            _ => false,
        }
    });
    if a.state("f").as_deref() == Some("suspended") {
        ok(&here, &a.url, &["resume", "f"]);
    }
    assert_finished_like(&here, &a.url, "f", &plain.stdout);
    // Exactly one copy ran to the end.
    let finished: Vec<_> = [&a, &b]
        .iter()
        .filter(|s| s.state("f").as_deref() == Some("exited"))
        .map(|s| s.url.clone())
        .collect();
    assert_eq!(finished.len(), 1, "finished on {finished:?}");
    stores_verify(&[&a, &b]);
}

#[test]
fn killing_the_source_during_pre_copy_leaves_it_resumable_there() {
    survive_fault("precopy", true);
}

#[test]
fn killing_the_source_after_the_pause_leaves_it_resumable_there() {
    survive_fault("suspended", true);
}

#[test]
fn killing_the_source_after_the_final_delta_leaves_it_resumable_there() {
    survive_fault("final-delta", true);
}

#[test]
fn killing_the_source_after_prepare_aborts_the_held_copy() {
    survive_fault("prepared", true);
}

/// A session moves from space A to B, then back towards A, and B dies once A has prepared
/// its copy: A aborts that copy and puts back the record it replaced, which says the session
/// went to B. (A used to drop its record altogether: `wait` on A then found no session.)
#[test]
fn an_aborted_move_back_leaves_the_first_space_pointing_onwards() {
    aborted_move_back(false);
}

/// The same when the first space restarts while it holds the prepared copy: the record it
/// replaced is kept on disk until the move is decided, so the abort after the restart still
/// puts it back.
#[test]
fn an_aborted_move_back_across_a_restart_leaves_the_first_space_pointing_onwards() {
    aborted_move_back(true);
}

/// A session moves from A to B and back towards A; B dies once A has prepared its copy (A
/// restarting then too with `restart_a`); A must abort the copy and point onwards to B,
/// where the session finishes as an uninterrupted run does.
fn aborted_move_back(restart_a: bool) {
    let here = client();
    let mut a = SpaceProc::start(&[]);
    let mut b = SpaceProc::start(&[]);
    let plain = run_cpu_guest(&here, &a.url, "f", "400");
    ok(&here, &a.url, &["migrate", "f", "--to", &b.url]);
    assert_eq!(a.state("f").as_deref(), Some("moved"));
    // B now dies right after A has prepared the move back.
    b.stop();
    b.spawn(Some("prepared"));
    eventually("B has the session back", || b.state("f").is_some());
    if b.state("f").as_deref() == Some("suspended") {
        ok(&here, &b.url, &["resume", "f"]);
    }
    let _ = cli(&here, &b.url, &["migrate", "f", "--to", &a.url]);
    b.wait_dead();
    if restart_a {
        assert_eq!(a.state("f").as_deref(), Some("prepared"));
        a.stop();
        a.spawn(None);
        assert_eq!(
            a.state("f").as_deref(),
            Some("prepared"),
            "after the restart"
        );
    }
    b.spawn(None);
    eventually("A's copy is aborted and its record back", || {
        a.state("f").as_deref() == Some("moved")
    });
    if b.state("f").as_deref() == Some("suspended") {
        ok(&here, &b.url, &["resume", "f"]);
    }
    assert_finished_like(&here, &a.url, "f", &plain.stdout);
}

#[test]
fn killing_the_source_right_after_commit_still_moves_it() {
    survive_fault("committed", true);
}

#[test]
fn killing_the_destination_on_prepare_keeps_the_source_running() {
    survive_fault("dest-prepare", false);
}

#[test]
fn killing_the_destination_on_commit_runs_it_there_once_it_is_back() {
    survive_fault("dest-commit", false);
}

/// A TCP proxy to `target` that forwards at most `limit` bytes towards it, then cuts every
/// connection (and refuses new ones): a network that fails in the middle of a transfer.
fn cutting_proxy(target: &str, limit: usize) -> String {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let target = target.trim_start_matches("http://").to_owned();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let sent = Arc::new(AtomicUsize::new(0));
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            if sent.load(Ordering::SeqCst) >= limit {
                let _ = client.shutdown(Shutdown::Both);
                continue;
            }
            let Ok(server) = TcpStream::connect(&target) else {
                continue;
            };
            let pipe = |mut from: TcpStream, mut to: TcpStream, count: Option<Arc<AtomicUsize>>| {
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 << 10];
                    loop {
                        let n = match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if let Some(c) = &count
                            && c.fetch_add(n, Ordering::SeqCst) + n >= limit
                        {
                            break;
                        }
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = from.shutdown(Shutdown::Both);
                    let _ = to.shutdown(Shutdown::Both);
                })
            };
            pipe(
                client.try_clone().unwrap(),
                server.try_clone().unwrap(),
                Some(sent.clone()),
            );
            pipe(server, client, None);
        }
    });
    url
}

#[test]
fn a_connection_cut_during_pre_copy_leaves_the_source_running_and_a_retry_moves_it() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let b = SpaceProc::start(&[]);
    let plain = run_cpu_guest(&here, &a.url, "cut", "400");
    // The link to the destination dies after 16 KiB, in the middle of the first round.
    let flaky = cutting_proxy(&b.url, 16 << 10);
    let (_, err, code) = cli(&here, &a.url, &["migrate", "cut", "--to", &flaky]);
    assert_ne!(code, 0);
    assert!(err.contains("migration aborted"), "{err}");
    assert_eq!(a.state("cut").as_deref(), Some("running"));
    assert_eq!(b.state("cut"), None);
    // Over a working link the move completes; what already arrived is not sent again.
    let (out, err, code) = cli(&here, &a.url, &["migrate", "cut", "--to", &b.url]);
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["outcome"], "committed");
    assert_finished_like(&here, &a.url, "cut", &plain.stdout);
}

/// A move from A to B in which B goes silent at `step` — every packet to and from it dropped,
/// as when its machine is powered off or cut off — while A holds there (`FERRY_FAULT_PAUSE`).
/// A gives B up after its peer silence (3 s here) instead of the kernel's ~15 minutes.
/// Returns the two spaces (B heard again), the guest's plain output, and what `migrate`
/// printed: stdout, stderr, exit code. `None` where nftables cannot be used.
#[allow(clippy::type_complexity)]
fn move_to_a_destination_that_goes_silent(
    step: &str,
) -> Option<(SpaceProc, SpaceProc, Vec<u8>, (String, String, i32))> {
    let here = client();
    let a = SpaceProc::start_with_vars(
        &[
            ("FERRY_FAULT_PAUSE", &format!("{step}:3000")),
            ("FERRY_PEER_SILENCE_MS", "3000"),
        ],
        &[],
    );
    let b = SpaceProc::start(&[]);
    let plain = run_cpu_guest(&here, &a.url, "bh", "400");
    let rx = migrate_in_background(&[], &a.url, "bh", &b.url);
    let held = if step == "committed" {
        "moved"
    } else {
        "suspended"
    };
    eventually("the source holds at the step", || {
        a.state("bh").as_deref() == Some(held)
    });
    let silent = Blackhole::port(b.port())?;
    let t = Instant::now();
    let done = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("migrate still waits on a silent destination after 60 s");
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "migrate took {:?} to give the destination up",
        t.elapsed()
    );
    drop(silent);
    Some((a, b, plain.stdout, done))
}

/// After a move of session `id` from `a` to `b` that aborted once the guest was paused: the
/// guest runs on at `a` (or has ended there), `b` drops any copy it held, and the session
/// ends once, at `a`, with the output `plain` of an uninterrupted run; both stores verify.
fn stayed_at_the_source(here: &Env, a: &SpaceProc, b: &SpaceProc, id: &str, plain: &[u8]) {
    let at_a = a.state(id);
    assert!(
        matches!(at_a.as_deref(), Some("running" | "exited")),
        "{at_a:?}"
    );
    eventually("the destination drops its copy", || b.state(id).is_none());
    assert_finished_like(here, &a.url, id, plain);
    assert_eq!(a.state(id).as_deref(), Some("exited"));
    stores_verify(&[a, b]);
}

/// B goes silent once A has paused the guest (the final delta and prepare then get no
/// answer): A gives B up, the guest runs on at A, and B, heard again, drops the copy it was
/// holding from the pre-copy rounds. One copy finishes, as an uninterrupted run does.
#[test]
fn a_destination_that_goes_silent_after_the_pause_is_given_up_and_the_guest_runs_on() {
    let Some((a, b, plain, (_, err, code))) = move_to_a_destination_that_goes_silent("suspended")
    else {
        return;
    };
    assert_ne!(code, 0);
    assert!(err.contains("migration aborted"), "{err}");
    assert!(err.contains("silent") || err.contains("timeout"), "{err}");
    eprintln!("migrate: {err}");
    stayed_at_the_source(&client(), &a, &b, "bh", &plain);
}

/// B's process hangs once A has paused the guest (SIGSTOP: its kernel still answers probes
/// and takes the final delta in, so the connection never goes silent). A gives B up after
/// the peer stall (twice the silence) — the final delta's answer or the prepare's progress
/// stops — and the guest runs on at A; B, going on, drops what it prepared. One copy
/// finishes, as an uninterrupted run does.
#[test]
fn a_destination_whose_process_hangs_after_the_pause_is_given_up_and_the_guest_runs_on() {
    let here = client();
    let a = SpaceProc::start_with_vars(
        &[
            ("FERRY_FAULT_PAUSE", "suspended:2000"),
            ("FERRY_PEER_SILENCE_MS", "2000"),
        ],
        &[],
    );
    let b = SpaceProc::start(&[]);
    let plain = run_cpu_guest(&here, &a.url, "hung", "400");
    let rx = migrate_in_background(&[], &a.url, "hung", &b.url);
    eventually("the source holds after the pause", || {
        a.state("hung").as_deref() == Some("suspended")
    });
    b.signal(libc::SIGSTOP);
    let t = Instant::now();
    let done = rx.recv_timeout(Duration::from_secs(60));
    let took = t.elapsed();
    b.signal(libc::SIGCONT);
    let (_, err, code) = done.expect("migrate still waits on a hung destination after 60 s");
    assert!(
        took < Duration::from_secs(20),
        "migrate took {took:?} to give the destination up"
    );
    assert_ne!(code, 0);
    assert!(err.contains("migration aborted"), "{err}");
    assert!(err.contains("stopped answering"), "{err}");
    stayed_at_the_source(&here, &a, &b, "hung", &plain.stdout);
}

/// B takes longer to prepare each round than A's peer stall (held 5 s at the start of each
/// prepare; A gives a peer up after 2 s without a byte): B's progress bytes keep A waiting,
/// and the move commits — a slow destination is not mistaken for a hung one.
#[test]
fn a_destination_slow_to_prepare_is_waited_for_while_it_sends_progress() {
    let here = client();
    let a = SpaceProc::start_with_vars(&[("FERRY_PEER_SILENCE_MS", "1000")], &[]);
    let b = SpaceProc::start_with_vars(&[("FERRY_FAULT_PAUSE", "dest-prepare:5000")], &[]);
    let plain = run_cpu_guest(&here, &a.url, "slow", "1200");
    let (out, err, code) = migrate_in_background(&[], &a.url, "slow", &b.url)
        .recv_timeout(Duration::from_secs(90))
        .expect("migrate still waits after 90 s");
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["outcome"], "committed", "{report}");
    assert!(report["downtime_ms"].as_u64().unwrap() >= 5000, "{report}");
    assert_finished_like(&here, &a.url, "slow", &plain.stdout);
    assert_eq!(b.state("slow").as_deref(), Some("exited"));
    stores_verify(&[&a, &b]);
}

/// The space asked to move a session hangs (SIGSTOP) in the middle of the move: `migrate`,
/// which asks it for progress, gives it up after the peer stall, saying that the move may
/// still be going on there, instead of waiting for ever; once the space goes on, the move
/// ends there as it would have, and the guest finishes once, as an uninterrupted run.
#[test]
fn a_migrate_whose_source_hangs_mid_move_gives_it_up() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let b = SpaceProc::start_with_vars(&[("FERRY_FAULT_PAUSE", "dest-prepare:3000")], &[]);
    let plain = run_cpu_guest(&here, &a.url, "hs", "1200");
    let rx = migrate_in_background(&[("FERRY_PEER_SILENCE_MS", "1000")], &a.url, "hs", &b.url);
    // A is then waiting on B's first prepare (3 s).
    std::thread::sleep(Duration::from_millis(1000));
    a.signal(libc::SIGSTOP);
    let answer = rx.recv_timeout(Duration::from_secs(30));
    a.signal(libc::SIGCONT);
    let (_, err, code) = answer.expect("migrate still waits on the hung source after 30 s");
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("stopped answering") && err.contains("may still be going on"),
        "{err}"
    );
    assert_finished_like(&here, &a.url, "hs", &plain.stdout);
    stores_verify(&[&a, &b]);
}

/// `migrate ID --max-pause 1s` of a `cpu` guest from a fresh space A to a fresh space B held
/// by `FERRY_FAULT_PAUSE=<b_fault>`: the move must abort on the bound, the guest running on at
/// A ([`stayed_at_the_source`]). Returns the client, A, B and `migrate`'s stderr.
fn aborted_past_max_pause(b_fault: &str, id: &str) -> (Env, SpaceProc, SpaceProc, String) {
    let here = client();
    let a = SpaceProc::start(&[]);
    let b = SpaceProc::start_with_vars(&[("FERRY_FAULT_PAUSE", b_fault)], &[]);
    let plain = run_cpu_guest(&here, &a.url, id, "1200");
    let args = [
        "migrate",
        id,
        "--to",
        &b.url,
        "--max-rounds",
        "1",
        "--max-pause",
        "1s",
    ];
    let (_, err, code) = cli(&here, &a.url, &args);
    assert_ne!(code, 0);
    assert!(err.contains("migration aborted"), "{err}");
    assert!(err.contains("--max-pause of 1000 ms"), "{err}");
    stayed_at_the_source(&here, &a, &b, id, &plain.stdout);
    (here, a, b, err)
}

/// `migrate --max-pause 1s` to a destination that takes 4 s over each prepare (held at its
/// start): the pre-copy round is waited for (the guest runs meanwhile), the final prepare is
/// cut once the guest has been paused 1 s — the move aborts and the guest runs on here; the
/// destination, done later, drops the copy it prepared.
#[test]
fn a_move_that_would_pause_the_guest_past_max_pause_is_aborted_and_the_guest_runs_on() {
    let (here, a, b, err) = aborted_past_max_pause("dest-prepare:4000", "mp");
    assert!(err.contains("had not prepared in time"), "{err}");
    // A bound of nothing is refused before anything moves.
    let args = [
        "migrate",
        "mp",
        "--to",
        &b.url,
        "--max-rounds",
        "1",
        "--max-pause",
        "0s",
    ];
    let (_, err, code) = cli(&here, &a.url, &args);
    assert_ne!(code, 0);
    assert!(err.contains("must be positive"), "{err}");
}

/// `migrate --max-pause 1s` to a destination that holds every batch of objects it is sent
/// 4 s before it stores it: the pre-copy round is waited for (the guest runs meanwhile), but
/// the final delta, sent while the guest is paused, is cut once the pause reaches 1 s — not
/// when the batch is stored at last — and the guest runs on here.
#[test]
fn a_final_delta_slower_than_max_pause_is_cut_and_the_guest_runs_on() {
    let (_, _, _, err) = aborted_past_max_pause("store-objects:4000", "md");
    assert!(
        err.contains("the final delta had not reached the destination in time"),
        "{err}"
    );
    // Cut at the bound: the error names a pause of about 1 s, not the 4 s the batch took.
    let ms = crate::harness::number_after(&err, "paused ")
        .unwrap_or_else(|| panic!("no pause named: {err}"));
    assert!((1000..2500).contains(&ms), "paused {ms} ms: {err}");
}

/// `migrate --max-pause 300ms` of a guest that rewrites its memory about as fast as the link
/// carries it (a destination that holds every batch of objects 1.5 s before it stores it):
/// after the pre-copy rounds the move foresees a final delta far past the bound and is given
/// up without pausing the guest — no final snapshot is taken — and the guest runs on here to
/// an uninterrupted run's end.
#[test]
fn a_move_whose_final_delta_would_outlast_max_pause_is_given_up_before_the_pause() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let b = SpaceProc::start_with_vars(&[("FERRY_FAULT_PAUSE", "store-objects:1500")], &[]);
    // 32 MiB, a tenth of its pages rewritten every 100 ms, for 12 s.
    let g = guest("wasm/dirty.wasm");
    let args = [g.to_str().unwrap(), "--", "32", "120", "100"];
    let plain = here.plain(&args);
    ok(
        &here,
        &a.url,
        &[&["run", "--session", "dw"][..], &args].concat(),
    );
    eventually("the guest fills its memory", || {
        cli(&here, &a.url, &["logs", "dw"]).0.contains("ready")
    });
    let (_, err, code) = cli(
        &here,
        &a.url,
        &[
            "migrate",
            "dw",
            "--to",
            &b.url,
            "--max-rounds",
            "2",
            "--max-pause",
            "300ms",
            "--progress",
        ],
    );
    assert_ne!(code, 0);
    assert!(err.contains("migration aborted"), "{err}");
    assert!(err.contains("given up before pausing it"), "{err}");
    assert!(err.contains("past the --max-pause of 300 ms"), "{err}");
    let report = &a.session("dw").unwrap()["migration"];
    assert_eq!(
        report["rounds"].as_array().map(Vec::len),
        Some(2),
        "{report}"
    );
    assert!(
        report["final_snapshot"].is_null(),
        "paused after all: {report}"
    );
    // `--progress` shows what a pause would have cost after each round from the second on.
    let second = &report["rounds"][1];
    assert!(
        second["foreseen_pause_ms"].as_u64().unwrap() > 300,
        "{report}"
    );
    assert!(
        report["rounds"][0].get("foreseen_pause_ms").is_none(),
        "{report}"
    );
    assert!(
        err.lines()
            .any(|l| l.starts_with("ferry: pre-copy round 2: ")
                && l.contains("(paused now, ~")
                && l.contains(" would be left to send: ~")),
        "{err}"
    );
    stayed_at_the_source(&here, &a, &b, "dw", &plain.stdout);
}

/// A guest that writes its memory about as fast as the link to the destination carries it
/// (B takes objects at 2 MB/s, `FERRY_FAULT_LINK`; a 4 MiB guest rewriting 8% of its pages
/// every 100 ms): with `--max-pause 600ms` its move is given up before the pause; with
/// `--auto-converge` as well the guest is held back more each round until the final delta
/// fits, the move commits within the bound, and the guest ends at B as an uninterrupted run.
#[test]
fn auto_converge_holds_back_a_guest_too_fast_for_the_link_until_its_move_fits_max_pause() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let b = SpaceProc::start_with_vars(&[("FERRY_FAULT_LINK", "2000000")], &[]);
    let g = guest("wasm/dirty.wasm");
    let args = [g.to_str().unwrap(), "--", "4", "250", "80"];
    let plain = here.plain(&args);
    ok(
        &here,
        &a.url,
        &[&["run", "--session", "ac"][..], &args].concat(),
    );
    eventually("the guest fills its memory", || {
        cli(&here, &a.url, &["logs", "ac"]).0.contains("ready")
    });
    let migrate = ["migrate", "ac", "--to", &b.url, "--max-pause", "600ms"];
    let err = refused(&here, &a.url, &migrate);
    assert!(err.contains("given up before pausing it"), "{err}");
    assert!(!err.contains("even held"), "{err}");
    eventually("the destination drops its copy", || b.state("ac").is_none());
    let (out, err, code) = cli(
        &here,
        &a.url,
        &[&migrate[..], &["--auto-converge", "--progress"]].concat(),
    );
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(
        report["downtime_ms"].as_u64().unwrap() <= 600,
        "paused past the bound: {report}"
    );
    let rounds = report["rounds"].as_array().unwrap();
    // Not held in the first two rounds (the first foresight comes after the second; what a
    // round sends was written while the one before it was sent), then held at least 20%.
    assert!(
        rounds[..2].iter().all(|r| r.get("held_percent").is_none()),
        "{report}"
    );
    assert!(
        rounds
            .iter()
            .any(|r| r["held_percent"].as_u64().is_some_and(|p| p >= 20)),
        "{report}"
    );
    assert!(report["held_ms"].as_u64().unwrap() > 0, "{report}");
    assert!(
        err.lines().any(|l| l.starts_with("ferry: pre-copy round ")
            && l.contains(", the guest held ")
            && l.contains("% of its time")),
        "{err}"
    );
    // The last move's rounds (given up) are not shown as this one's.
    assert_eq!(
        err.lines()
            .filter(|l| l.starts_with("ferry: pre-copy round 1: "))
            .count(),
        1,
        "{err}"
    );
    assert!(err.contains("the guest was held back "), "{err}");
    let (metrics, _, _) = cli(&here, &a.url, &["metrics"]);
    let held = metric(&metrics, "ferry_migration_held_seconds_total");
    assert!(
        (held * 1000.0 - report["held_ms"].as_f64().unwrap()).abs() < 1.0,
        "{held} s held by the metrics: {report}"
    );
    assert_eq!(b.state("ac").as_deref(), Some("running"));
    assert_finished_like(&here, &a.url, "ac", &plain.stdout);
    stores_verify(&[&a, &b]);
}

/// CPython 3.12 rewriting a 24 MiB buffer at one place per step of pure-Python work
/// (`guests/python/churn.py`) moves to a space that takes objects at 32 MB/s with
/// `--auto-converge` and no bound on the pause: it is held back (its interpreter unwound and
/// rewound at every tick while held) until its final delta is foreseen within 4 MiB, and it
/// ends at B as an uninterrupted run.
#[test]
fn a_cpython_program_held_back_while_it_moves_ends_as_an_uninterrupted_run() {
    let py = crate::python::python312();
    let here = client();
    let a = SpaceProc::start(&[]);
    let b = SpaceProc::start_with_vars(&[("FERRY_FAULT_LINK", "32000000")], &[]);
    let app = here.path("app");
    std::fs::create_dir_all(&app).unwrap();
    std::fs::copy(
        crate::harness::repo().join("guests/python/churn.py"),
        app.join("churn.py"),
    )
    .unwrap();
    let mount = format!("{}::/app", app.display());
    let args = [
        "--dir",
        mount.as_str(),
        py.to_str().unwrap(),
        "--",
        "/app/churn.py",
        "12000",
    ];
    let plain = here.plain(&args);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    ok(
        &here,
        &a.url,
        &[&["run", "--session", "cp"][..], &args].concat(),
    );
    eventually("the guest has filled its buffer", || {
        cli(&here, &a.url, &["logs", "cp"]).0.contains("\n")
    });
    let (out, err, code) = cli(
        &here,
        &a.url,
        &[
            "migrate",
            "cp",
            "--to",
            &b.url,
            "--auto-converge",
            "--progress",
        ],
    );
    assert_eq!(code, 0, "{err}");
    eprintln!("{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(
        report["rounds"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["held_percent"].as_u64().is_some_and(|p| p >= 20)),
        "never held: {report}"
    );
    assert!(report["held_ms"].as_u64().unwrap() > 0, "{report}");
    assert_finished_like(&here, &a.url, "cp", &plain.stdout);
}

/// A space whose process hangs (SIGSTOP: its kernel still answers) while a client waits on
/// one of its sessions: `wait` and `logs --follow` give it up — their long poll, no longer
/// than the peer silence, plus the peer stall after they asked — saying it stopped answering,
/// instead of waiting for ever, and so do `checkpoint`, `fleet` and `store gc` (which ask for
/// progress) and `files` after the stall; once the space goes on, the session ends as an
/// uninterrupted run.
#[test]
fn waiting_on_a_space_whose_process_hangs_gives_it_up() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let plain = run_cpu_guest(&here, &a.url, "hw", "1200");
    a.signal(libc::SIGSTOP);
    for args in [
        &["wait", "hw"][..],
        &["logs", "hw", "--follow"],
        &["checkpoint", "hw"],
        &["files", "hw"],
        &["fleet"],
        &["store", "gc"],
    ] {
        let rx = cli_in_background(&[("FERRY_PEER_SILENCE_MS", "1000")], &a.url, args);
        // A session record (2 s), then one long poll of 1 s and the stall of 2 s.
        let (_, err, code) = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("{args:?} still waits on the hung space after 30 s"));
        assert_ne!(code, 0, "{args:?}: {err}");
        assert!(err.contains("stopped answering"), "{args:?}: {err}");
        if matches!(args[0], "wait" | "logs") {
            assert!(err.contains("may have hung"), "{args:?}: {err}");
        }
    }
    a.signal(libc::SIGCONT);
    assert_finished_like(&here, &a.url, "hw", &plain.stdout);
}

/// B goes silent right after A recorded the move (A cannot deliver the commit): `migrate`
/// still returns, the move committed; B learns the outcome by asking A and runs the guest —
/// once, its output continuing A's.
#[test]
fn a_destination_that_goes_silent_after_the_commit_runs_the_guest_once() {
    let Some((a, b, plain, (out, err, code))) = move_to_a_destination_that_goes_silent("committed")
    else {
        return;
    };
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["outcome"], "committed");
    assert_finished_like(&client(), &a.url, "bh", &plain);
    assert_eq!(a.state("bh").as_deref(), Some("moved"));
    assert_eq!(b.state("bh").as_deref(), Some("exited"));
}

/// A partition: A and B cut off from each other (every packet to and from either dropped)
/// while B prepares the final round — B has the request and is holding at its start
/// (`FERRY_FAULT_PAUSE`), so its answer goes nowhere. A gives B up and runs the guest on; B
/// ends up holding a prepared copy it cannot ask A about. Once the network heals, B asks A,
/// hears that A kept the session, and drops its copy: the guest ran once, at A.
#[test]
fn a_partition_while_the_destination_prepares_leaves_one_copy_running() {
    let here = client();
    let silence = ("FERRY_PEER_SILENCE_MS", "3000");
    let a = SpaceProc::start_with_vars(&[silence], &[]);
    let b = SpaceProc::start_with_vars(&[silence, ("FERRY_FAULT_PAUSE", "dest-prepare:4000")], &[]);
    let g = guest("wasm/cpu.wasm");
    let plain = here.plain(&[g.to_str().unwrap(), "--", "1200"]);
    ok(
        &here,
        &a.url,
        &[
            "run",
            "--session",
            "part",
            g.to_str().unwrap(),
            "--",
            "1200",
        ],
    );
    std::thread::sleep(Duration::from_millis(300));
    // The client asking for the move is cut off from A too; it gives up on its own.
    let rx = migrate_in_background(&[silence], &a.url, "part", &b.url);
    // The pause, then the final delta and the prepare request (B holds it for 4 s).
    eventually("the source pauses the guest", || {
        a.state("part").as_deref() == Some("suspended")
    });
    std::thread::sleep(Duration::from_millis(500));
    let Some(partition) = Blackhole::ports(&[a.port(), b.port()]) else {
        return;
    };
    let (_, err, code) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the client still waits after 60 s");
    assert_ne!(code, 0, "{err}");
    // A gives B up after 3 s and its abort after 3–5 s more; B, cut off, holds its copy
    // meanwhile — and must not run it.
    std::thread::sleep(Duration::from_secs(6));
    drop(partition);
    // B held its copy through the partition (or has just dropped it), never ran it.
    let at_b = b.state("part");
    assert!(
        matches!(at_b.as_deref(), Some("prepared") | None),
        "{at_b:?}"
    );
    let outcome = a.session("part").unwrap()["migration"]["outcome"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        outcome.starts_with("aborted") && outcome.contains("silent"),
        "{outcome}"
    );
    eventually("the destination drops its held copy", || {
        b.state("part").is_none()
    });
    assert_finished_like(&here, &a.url, "part", &plain.stdout);
    assert_eq!(a.state("part").as_deref(), Some("exited"));
    stores_verify(&[&a, &b]);
}

/// B holds a prepared copy from the pre-copy round while B and A are cut off from each other
/// (B's port, and A's peer address 127.0.0.2; clients still reach A) — A holds right after
/// the pause (`FERRY_FAULT_PAUSE`) until the cut is in place: A gives B up and runs
/// on, and while B still cannot ask, the session moves from A to C — at the same epoch B's
/// copy has. Once the network heals B asks A, which says `moved` at that epoch: but by
/// another attempt, so B drops its copy instead of running a second one.
#[test]
fn a_copy_held_through_a_partition_is_dropped_when_the_session_moved_elsewhere() {
    let here = client();
    let silence = ("FERRY_PEER_SILENCE_MS", "2000");
    let a = SpaceProc::start_for_peers_at_127_0_0_2(
        &[silence, ("FERRY_FAULT_PAUSE", "suspended:3000")],
        &[],
    );
    let b = SpaceProc::start(&[]);
    let c = SpaceProc::start(&[]);
    let plain = run_cpu_guest(&here, &a.url, "el", "1200");
    let rx = migrate_in_background(&[], &a.url, "el", &b.url);
    eventually(
        "B holds a prepared copy and A holds after the pause",
        || {
            b.state("el").as_deref() == Some("prepared")
                && a.state("el").as_deref() == Some("suspended")
        },
    );
    let Some(cut_b) = Blackhole::port(b.port()) else {
        return;
    };
    let cut_a = Blackhole::address("127.0.0.2", a.port()).unwrap();
    let (_, err, code) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("migrate still waits after 60 s");
    assert_ne!(code, 0, "{err}");
    ok(&here, &a.url, &["migrate", "el", "--to", &c.url]);
    drop((cut_a, cut_b));
    eventually("B drops its held copy", || b.state("el").is_none());
    assert_finished_like(&here, &a.url, "el", &plain.stdout);
    assert_eq!(c.state("el").as_deref(), Some("exited"));
    stores_verify(&[&a, &b, &c]);
}

/// A private CA and a certificate it signed for 127.0.0.1, made with `openssl` in `dir`:
/// (the CA's certificate, the space's certificate, its key).
fn tls_files(dir: &std::path::Path) -> (String, String, String) {
    let ca = TestCa::new(dir);
    let (cert, key) = ca.issue("space", "subjectAltName=IP:127.0.0.1");
    (ca.cert, cert, key)
}

/// Spaces serving HTTPS (`--tls-cert`, `--tls-key`): the CLI and the spaces trust a private
/// CA through `FERRY_TLS_CA`, and a session moves between two of them with its output intact.
/// A client that does not trust the CA is refused by its own TLS check, a plain-HTTP request
/// is told to use HTTPS, and a client that never starts its handshake does not hold up the
/// others.
#[test]
fn spaces_serving_https_move_a_session_between_them() {
    let files = tempfile::tempdir().unwrap();
    let (ca, cert, key) = tls_files(files.path());
    let tls = ["--tls-cert", cert.as_str(), "--tls-key", key.as_str()];
    let a = SpaceProc::start_with_vars(&[("FERRY_TLS_CA", &ca)], &tls);
    let b = SpaceProc::start_with_vars(&[("FERRY_TLS_CA", &ca)], &tls);
    assert!(a.url.starts_with("https://127.0.0.1:"), "{}", a.url);
    let here = client().with_var("FERRY_TLS_CA", &ca);
    // A client that connects and never starts its handshake holds up no one else.
    let _mute = std::net::TcpStream::connect(a.url.trim_start_matches("https://")).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    ok(&here, &a.url, &["ps"]);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let plain = run_cpu_guest(&here, &a.url, "tls", "300");
    let (out, err, code) = cli(&here, &a.url, &["migrate", "tls", "--to", &b.url]);
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["outcome"], "committed");
    assert_finished_like(&here, &a.url, "tls", &plain.stdout);

    // Without the CA, Mozilla's roots do not vouch for this space.
    let err = refused(&client(), &a.url, &["ps"]);
    assert!(err.contains("UnknownIssuer"), "{err}");
    // Plain HTTP to an HTTPS space.
    let http = a.url.replace("https://", "http://");
    let err = refused(&here, &http, &["ps"]);
    assert!(
        err.contains(&format!("this space speaks HTTPS: use {}", a.url)),
        "{err}"
    );
}

#[test]
fn bad_input_to_a_space_is_refused_with_the_reason() {
    let here = client();
    let space = SpaceProc::start(&[]);
    let junk = here.path("junk.wasm");
    std::fs::write(&junk, b"not a module").unwrap();
    let (_, err, code) = cli(&here, &space.url, &["run", junk.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("not a WebAssembly module"), "{err}");
    assert!(
        !err.contains("sent "),
        "nothing is sent for a bad module: {err}"
    );
    for verb in ["resume", "logs", "wait", "kill"] {
        let (_, err, code) = cli(&here, &space.url, &[verb, "no/such id"]);
        assert_ne!(code, 0);
        assert!(err.contains("is not a session id"), "{verb}: {err}");
    }
    let (_, err, code) = cli(&here, &space.url, &["wait", "nosuch"]);
    assert_ne!(code, 0);
    assert!(err.contains("no session `nosuch`"), "{err}");
}

/// Spaces collect garbage while they serve: one every 100 ms (keeping one snapshot per
/// session), one on demand, while a guest checkpoints and moves between them; the output is
/// unchanged, older checkpoints are deleted, and both stores verify afterwards.
#[test]
fn spaces_collect_garbage_while_guests_checkpoint_and_move() {
    let here = client();
    let grace = ["--gc-grace", "3s"];
    let mut a =
        SpaceProc::start(&[&grace[..], &["--gc-every", "100ms", "--gc-keep", "1"]].concat());
    let mut b = SpaceProc::start(&grace);
    let g = guest("wasm/cpu.wasm");
    let plain = here.plain(&[g.to_str().unwrap(), "--", "700"]);
    ok(
        &here,
        &b.url,
        &["run", "--session", "gc", g.to_str().unwrap(), "--", "700"],
    );
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(100));
        ok(&here, &b.url, &["checkpoint", "gc"]);
    }
    // The older checkpoints are garbage once the grace period is over.
    std::thread::sleep(Duration::from_millis(3100));
    let (out, err, code) = cli(&here, &b.url, &["store", "gc", "--keep", "1", "--dry-run"]);
    assert_eq!(code, 0, "{err}");
    let would: usize = out
        .strip_prefix("would delete ")
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    assert!(would > 0, "{out}");
    let (out, err, code) = cli(&here, &b.url, &["store", "gc", "--keep", "1"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("deleted "), "{out}");
    // Moves while `a` collects every 100 ms.
    for (from, to) in [(&b, &a), (&a, &b), (&b, &a)] {
        std::thread::sleep(Duration::from_millis(200));
        let (_, err, code) = cli(&here, &from.url, &["migrate", "gc", "--to", &to.url]);
        if code != 0 && err.contains("exited") {
            break;
        }
        assert_eq!(code, 0, "{err}");
    }
    assert_finished_like(&here, &b.url, "gc", &plain.stdout);
    // Once the grace period is over, `--keep 1` leaves one snapshot of the session's history
    // on each side: the collection's own walk through that history is not a question that
    // spares what it walks.
    std::thread::sleep(Duration::from_millis(3100));
    for s in [&a, &b] {
        for _ in 0..2 {
            let (out, err, code) = cli(&here, &s.url, &["store", "gc", "--keep", "1"]);
            assert_eq!(code, 0, "{err}");
            assert!(out.starts_with("deleted "), "{out}");
        }
        let last = s.snapshot("gc");
        let (out, err, code) = s.env.output(&["inspect", "--history", "--json", &last]);
        assert_eq!(code, 0, "{err}");
        let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
        assert_eq!(rows.len(), 1, "{}: {out}", s.url);
    }
    a.stop();
    b.stop();
    stores_verify(&[&a, &b]);
}

/// `ferry --space URL rm` forgets a space's finished sessions (a suspended one only with
/// --force; a running one not at all), after which its garbage collection reclaims their
/// snapshots.
#[test]
fn a_space_forgets_finished_sessions_and_then_reclaims_their_snapshots() {
    let here = client();
    let mut s = SpaceProc::start(&["--gc-grace", "1s"]);
    let g = guest("wasm/cpu.wasm");
    let g = g.to_str().unwrap();
    ok(&here, &s.url, &["run", "--session", "done", g, "--", "2"]);
    ok(&here, &s.url, &["wait", "done"]);
    ok(
        &here,
        &s.url,
        &["run", "--session", "paused", g, "--", "5000"],
    );
    eventually("it runs", || {
        s.state("paused").as_deref() == Some("running")
    });
    let (_, err, code) = cli(&here, &s.url, &["rm", "paused"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("is running; suspend or kill it first"),
        "{err}"
    );
    ok(&here, &s.url, &["suspend", "paused"]);
    let (_, err, code) = cli(&here, &s.url, &["rm", "paused"]);
    assert_ne!(code, 0);
    assert!(err.contains("can still be resumed"), "{err}");
    let (out, err, code) = cli(&here, &s.url, &["rm", "--exited"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "removed done\n");
    assert_eq!(s.state("done"), None, "forgotten");
    ok(&here, &s.url, &["rm", "--force", "paused"]);
    assert_eq!(s.state("paused"), None);
    let (_, err, code) = cli(&here, &s.url, &["rm", "paused"]);
    assert_ne!(code, 0);
    assert!(err.contains("no session `paused`"), "{err}");
    // Their snapshots go once the grace period is over; the module stays (a derived ref).
    std::thread::sleep(Duration::from_millis(1100));
    let (out, err, code) = cli(&here, &s.url, &["store", "gc"]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.starts_with("deleted 0 "), "{out}");
    // Forgotten for good: not back after a restart.
    s.stop();
    s.spawn(None);
    assert_eq!(s.state("done"), None);
    stores_verify(&[&s]);
}

/// `ferry --space URL run --checkpoint-every D`: the space checkpoints the session while it
/// runs, and goes on doing so where it moves, so a space killed (`kill -9`) loses only the
/// progress since the last checkpoint: the session comes back suspended there and finishes
/// with the output of an uninterrupted run.
#[test]
fn a_space_checkpoints_periodically_so_a_killed_space_loses_little() {
    let here = client();
    let mut a = SpaceProc::start(&[]);
    let b = SpaceProc::start(&[]);
    let g = guest("wasm/cpu.wasm");
    let plain = here.plain(&[g.to_str().unwrap(), "--", "700"]);
    let (_, err, code) = cli(
        &here,
        &a.url,
        &[
            "run",
            "--checkpoint-every",
            "50ms",
            g.to_str().unwrap(),
            "--",
            "700",
        ],
    );
    assert_ne!(code, 0);
    assert!(err.contains("at least 100ms"), "{err}");
    ok(
        &here,
        &a.url,
        &[
            "run",
            "--session",
            "p",
            "--checkpoint-every",
            "150ms",
            g.to_str().unwrap(),
            "--",
            "700",
        ],
    );
    let snapshot = |s: &SpaceProc| {
        s.session("p")
            .and_then(|i| i["snapshot"].as_str().map(str::to_owned))
    };
    // Checkpoints come without being asked for, on both sides of a move.
    let mut seen = std::collections::BTreeSet::new();
    eventually("two checkpoints on a", || {
        seen.extend(snapshot(&a));
        seen.len() >= 2
    });
    ok(&here, &a.url, &["migrate", "p", "--to", &b.url]);
    let moved_at = snapshot(&b);
    eventually("a checkpoint on b", || snapshot(&b) != moved_at);
    ok(&here, &b.url, &["migrate", "p", "--to", &a.url]);
    let back_at = snapshot(&a);
    eventually("a checkpoint on a again", || snapshot(&a) != back_at);
    a.stop();
    a.spawn(None);
    assert_eq!(a.state("p").as_deref(), Some("suspended"));
    ok(&here, &a.url, &["resume", "p"]);
    assert_finished_like(&here, &a.url, "p", &plain.stdout);
}

/// The `files` guest (writing `rounds` rounds into `/data`) run here into a fresh `local`
/// directory, for what a space run must end with: (the guest's path, that directory, the
/// run, a mount of an empty `input` directory at `/data` for the space run).
fn files_guest(
    here: &Env,
    rounds: &str,
) -> (String, std::path::PathBuf, crate::harness::Seen, String) {
    let g = guest("wasm/files.wasm").to_str().unwrap().to_owned();
    let (local, at_local) = here.data_dir("local");
    let plain = here.plain(&["--dir", &at_local, &g, "--", "/data", rounds]);
    assert_eq!(plain.code, 0);
    let (_, at_input) = here.data_dir("input");
    (g, local, plain, at_input)
}

/// Starting a session on a space with a big mounted directory says what takes the time:
/// reading the directory, sending it, and the space writing it out before the guest starts
/// (after `FERRY_PROGRESS_AFTER_MS`, at once here); and `files` writing them back here.
#[test]
fn a_run_on_a_space_with_a_big_directory_shows_its_progress() {
    let here = client().with_var("FERRY_PROGRESS_AFTER_MS", "0");
    let a = SpaceProc::start(&[]);
    let (data, at_data) = here.data_dir("data");
    let big = crate::harness::varied_bytes(64 << 20, 7);
    std::fs::write(data.join("big.bin"), &big).unwrap();
    let g = guest("wasm/files.wasm");
    let (_, err, code) = cli(
        &here,
        &a.url,
        &[
            "run",
            "--session",
            "big",
            "--dir",
            &at_data,
            g.to_str().unwrap(),
            "--",
            "/data",
            "3",
        ],
    );
    assert_eq!(code, 0, "{err}");
    for said in [
        format!("ferry: reading {} to send it: ", data.display()),
        "ferry: sent ".to_owned(),
        format!(" objects (64.0 MiB) to {}\n", a.url),
        format!(
            "ferry: waiting for {} to start the session (it writes the mounted directories out \
             and prepares the program first)",
            a.url
        ),
    ] {
        assert!(err.contains(&said), "`{said}` not in:\n{err}");
    }
    let (out, err, code) = cli(&here, &a.url, &["wait", "big"]);
    assert_eq!(code, 0, "{out}{err}");
    // Its files come back the same way.
    let out_dir = here.path("out");
    let into = format!("{}::/data", out_dir.display());
    let (_, err, code) = cli(&here, &a.url, &["files", "big", "--dir", &into]);
    assert_eq!(code, 0, "{err}");
    let said = format!("ferry: writing `/data` into {}: ", out_dir.display());
    assert!(err.contains(&said), "`{said}` not in:\n{err}");
    // With the total: 64 MiB of big.bin, and the guest's few small files.
    let line = err.lines().find(|l| l.starts_with(&said)).unwrap();
    assert!(line.ends_with(" of 64.0 MiB"), "{line}");
    assert_eq!(std::fs::read(out_dir.join("big.bin")).unwrap(), big);
}

/// A space killed (`kill -9`) while a session writes files in a mount drops what the guest
/// wrote after its last snapshot — files as well as output: the directory backing the mount
/// is gone when the space starts again, and the resumed guest works in a fresh one filled
/// from the snapshot, ending with the files and output of an uninterrupted run.
#[test]
fn a_killed_space_drops_the_files_written_after_the_last_snapshot() {
    let here = client();
    let mut a = SpaceProc::start(&[]);
    let (g, local, plain, at_input) = files_guest(&here, "600");
    let g = g.as_str();
    ok(
        &here,
        &a.url,
        &[
            "run",
            "--session",
            "f",
            "--checkpoint-every",
            "150ms",
            "--dir",
            &at_input,
            g,
            "--",
            "/data",
            "600",
        ],
    );
    let backing = a.env.store().join("space/mounts/f");
    let mut seen = std::collections::BTreeSet::new();
    eventually("two checkpoints while it writes", || {
        seen.extend(
            a.session("f")
                .and_then(|i| i["snapshot"].as_str().map(str::to_owned)),
        );
        seen.len() >= 2
    });
    a.stop();
    assert!(
        backing.join("0").is_dir(),
        "killed mid-run, {} stays",
        backing.display()
    );
    a.spawn(None);
    assert_eq!(a.state("f").as_deref(), Some("suspended"));
    assert!(
        !backing.exists(),
        "{} is left after the restart",
        backing.display()
    );
    ok(&here, &a.url, &["resume", "f"]);
    assert_finished_like(&here, &a.url, "f", &plain.stdout);
    let out_dir = here.path("out");
    let into = format!("{}::/data", out_dir.display());
    let (_, err, code) = cli(&here, &a.url, &["files", "f", "--dir", &into]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(dir_contents(&out_dir), dir_contents(&local));
}

/// A guest that makes `/data/huge.bin` one byte larger than a snapshot can carry (sparse),
/// says `grown`, then computes until it is stopped.
const GROWS_A_HUGE_FILE: &str = r#"(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_filestat_set_size" (func $set_size (param i32 i64) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "huge.bin")
  (data (i32.const 32) "grown\n")
  (func (export "_start") (local $i i32)
    (if (call $path_open (i32.const 3) (i32.const 0) (i32.const 16) (i32.const 8) (i32.const 1)
          (i64.const -1) (i64.const -1) (i32.const 0) (i32.const 8))
      (then (call $exit (i32.const 2))))
    (if (call $set_size (i32.load (i32.const 8)) (i64.const 1099511627777))
      (then (call $exit (i32.const 3))))
    (i32.store (i32.const 0) (i32.const 32))
    (i32.store (i32.const 4) (i32.const 6))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 12)))
    (loop $l (local.set $i (i32.add (local.get $i) (i32.const 1))) (br $l))))"#;

/// A snapshot a space cannot write is reported at once to whoever asked for it — `checkpoint`
/// and `suspend` fail with the reason instead of waiting (or answering with the previous
/// snapshot), the session says why — and the guest keeps running: once the cause is gone,
/// asking again suspends it. `kill` stops such a guest all the same, without a snapshot.
#[test]
fn a_snapshot_a_space_cannot_write_is_reported_and_the_guest_keeps_running() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let g = here.path("grows.wat");
    std::fs::write(&g, GROWS_A_HUGE_FILE).unwrap();
    // Session `id` runs the guest until its file has grown; the file, on the space.
    let start = |id: &str| {
        let (_, at_input) = here.data_dir(&format!("input-{id}"));
        let args = [
            "run",
            "--session",
            id,
            "--dir",
            &at_input,
            g.to_str().unwrap(),
        ];
        ok(&here, &a.url, &args);
        let huge = a.env.store().join(format!("space/mounts/{id}/0/huge.bin"));
        eventually("the guest grew its file", || {
            std::fs::metadata(&huge).is_ok_and(|m| m.len() == 1 << 40 | 1)
        });
        huge
    };
    let huge = start("h");
    for verb in ["checkpoint", "suspend"] {
        let err = refused(&here, &a.url, &[verb, "h"]);
        assert!(
            err.contains("session `h` could not write its snapshot and keeps running")
                && err.contains("a 1099511627777-byte file"),
            "{verb}: {err}"
        );
    }
    let (_, err, code) = cli(&here, &a.url, &["ps"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("h: its last snapshot failed, it keeps running"),
        "{err}"
    );
    let info = a.session("h").unwrap();
    assert_eq!(info["state"], "running", "{info}");
    assert_eq!(info["snapshot_failures"], 2, "{info}");
    assert!(
        info["snapshot_error"]
            .as_str()
            .is_some_and(|e| e.contains("huge.bin")),
        "{info}"
    );
    // The cause gone, the same request succeeds.
    std::fs::File::options()
        .write(true)
        .open(&huge)
        .unwrap()
        .set_len(10)
        .unwrap();
    ok(&here, &a.url, &["suspend", "h"]);
    let info = a.session("h").unwrap();
    assert_eq!(info["state"], "suspended", "{info}");
    assert!(info.get("snapshot_error").is_none(), "{info}");

    // A kill ends the guest even when no snapshot can be written.
    start("k");
    ok(&here, &a.url, &["kill", "k"]);
    let info = a.session("k").unwrap();
    assert_eq!(info["state"], "killed", "{info}");
    assert!(
        info["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("stopped without a snapshot")),
        "{info}"
    );
}

/// The files a session's guest wrote come back from the space where it ended, as they would
/// from a local run: `files` follows the session's move, writes only into new or empty
/// directories, with the modification times they had, and the space keeps them (not its
/// backing directories) through garbage collection until the session is forgotten.
#[test]
fn a_sessions_files_come_back_from_the_space_where_it_ended() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let b = SpaceProc::start(&["--gc-grace", "1s"]);
    let (g, local, plain, at_input) = files_guest(&here, "400");
    let g = g.as_str();
    // A file the guest leaves alone keeps its modification time through the move and back.
    let old = std::time::UNIX_EPOCH + Duration::new(1_000_000_000, 42);
    for d in [&local, &here.path("input")] {
        std::fs::write(d.join("keep.txt"), "kept").unwrap();
        std::fs::File::options()
            .write(true)
            .open(d.join("keep.txt"))
            .unwrap()
            .set_times(std::fs::FileTimes::new().set_modified(old))
            .unwrap();
    }
    ok(
        &here,
        &a.url,
        &[
            "run",
            "--session",
            "f",
            "--dir",
            &at_input,
            g,
            "--",
            "/data",
            "400",
        ],
    );
    eventually("it runs", || a.state("f").as_deref() == Some("running"));
    let backing_a = a.env.store().join("space/mounts/f");
    assert!(
        backing_a.join("0").is_dir(),
        "the guest works in {}",
        backing_a.display()
    );
    ok(&here, &a.url, &["checkpoint", "f"]);
    let (out, err, code) = cli(&here, &a.url, &["files", "f"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("/data\tblake3:"), "{out}");
    assert!(err.contains("as of its snapshot blake3:"), "{err}");
    ok(&here, &a.url, &["migrate", "f", "--to", &b.url]);
    assert!(
        !backing_a.exists(),
        "the source's {} is left",
        backing_a.display()
    );
    assert_finished_like(&here, &a.url, "f", &plain.stdout);

    // Asked of the space it left, `files` follows the move.
    let out_dir = here.path("out");
    let into = format!("{}::/data", out_dir.display());
    let (_, err, code) = cli(&here, &a.url, &["files", "f", "--dir", &into]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("as its guest left them (exited)"), "{err}");
    assert_eq!(dir_contents(&out_dir), dir_contents(&local));
    assert!(!dir_contents(&local).is_empty());
    let kept = std::fs::metadata(out_dir.join("keep.txt")).unwrap();
    assert_eq!(kept.modified().unwrap(), old, "the time it had");
    // Nothing is written over, and a mount the session did not have is named.
    let err = refused(&here, &b.url, &["files", "f", "--dir", &into]);
    assert!(err.contains("is not empty"), "{err}");
    let elsewhere = format!("{}::/nope", here.path("nope").display());
    let err = refused(&here, &b.url, &["files", "f", "--dir", &elsewhere]);
    assert!(
        err.contains("no mount at `/nope` (its mounts: /data)"),
        "{err}"
    );
    assert!(!here.path("nope").exists());

    // The space keeps the files in its store, not in the directory that backed the mount.
    let backing = b.env.store().join("space/mounts/f");
    assert!(!backing.exists(), "{} is left", backing.display());
    std::thread::sleep(Duration::from_millis(1100));
    let (out, err, code) = cli(&here, &b.url, &["store", "gc"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("deleted "), "{out}");
    let again = here.path("again");
    let into = format!("{}::/data", again.display());
    let (_, err, code) = cli(&here, &b.url, &["files", "f", "--dir", &into]);
    assert_eq!(code, 0, "after gc: {err}");
    assert_eq!(dir_contents(&again), dir_contents(&local));

    // Forgotten, the session's files go with it.
    ok(&here, &b.url, &["rm", "f"]);
    let err = refused(&here, &b.url, &["files", "f"]);
    assert!(err.contains("no session `f`"), "{err}");
}

/// A session run on a space with `--stdin FILE` reads that input wherever it goes: across a
/// move, and resumed on this machine from a pulled snapshot (not from ferry's own stdin) —
/// every line read once, the output that of a local run fed the same file.
#[test]
fn a_sessions_stdin_goes_with_it() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let b = SpaceProc::start(&[]);
    let g = guest("wasm/lines.wasm");
    let g = g.to_str().unwrap();
    let input = here.path("input.txt");
    // 12 KB: the guest's libc reads stdin 4 KB at a time into its own buffer (which
    // snapshots carry), so reads happen before the move, on the other space and after the
    // local resume.
    let text: String = (0..48)
        .map(|i| format!("{i:02} {}\n", "x".repeat(200 + i)))
        .collect();
    std::fs::write(&input, &text).unwrap();
    let plain = client().with_stdin(input.clone()).plain(&[g]);
    assert_eq!(plain.code, 0);
    assert!(String::from_utf8_lossy(&plain.stdout).ends_with("done 48 lines\n"));

    let (_, err, code) = here.output(&["run", "--stdin", input.to_str().unwrap(), g]);
    assert_ne!(code, 0);
    assert!(err.contains("redirect stdin"), "{err}");
    let stdin = input.to_str().unwrap();
    ok(
        &here,
        &a.url,
        &["run", "--session", "in", "--stdin", stdin, g],
    );
    let printed = |s: &SpaceProc, what: &str| {
        let (out, _, _) = cli(&here, &s.url, &["logs", "in"]);
        out.contains(what)
    };
    eventually("it reads", || printed(&a, "line 3:"));
    ok(&here, &a.url, &["migrate", "in", "--to", &b.url]);
    eventually("it reads on there", || printed(&b, "line 24:"));
    ok(&here, &b.url, &["suspend", "in"]);
    let (before, _, _) = cli(&here, &b.url, &["logs", "in"]);
    assert!(
        !before.contains("done"),
        "it finished before the suspend: {before}"
    );
    let k = b.snapshot("in");
    let (_, err, code) = here.output(&["pull", &k, "--from", &b.url]);
    assert_eq!(code, 0, "{err}");
    let (out, err, code) = here.output(&["inspect", &k]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("stdin is the stored input blake3:"), "{out}");
    // This ferry's own stdin is empty: the guest reads on in the input it was given.
    let (after, err, code) = here.output(&["resume", &k]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        format!("{before}{after}"),
        String::from_utf8_lossy(&plain.stdout),
        "each line read once"
    );
}

/// A guest that traps in a space fails there with exit code 134 in its record, and `wait`
/// ends with it, as a local run does.
#[test]
fn a_guest_that_traps_in_a_space_fails_with_134() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let g = here.path("abort.wat");
    std::fs::write(&g, crate::harness::ABORTING_GUEST).unwrap();
    ok(
        &here,
        &a.url,
        &["run", "--session", "t", g.to_str().unwrap()],
    );
    let (_, err, code) = cli(&here, &a.url, &["wait", "t"]);
    assert_eq!(code, 134, "{err}");
    assert!(err.contains("session t failed: guest trapped: "), "{err}");
    // The trap's call stack included: every line is ferry's, and says so.
    assert!(
        err.contains("ferry: guest call stack, innermost first:"),
        "{err}"
    );
    assert!(err.lines().all(|l| l.starts_with("ferry: ")), "{err}");
    let info = a.session("t").unwrap();
    assert_eq!(
        (&info["state"], &info["exit_code"]),
        (&serde_json::json!("failed"), &serde_json::json!(134)),
        "{info}"
    );
    let (out, _, _) = cli(&here, &a.url, &["logs", "t"]);
    assert_eq!(out, "before\n");
}

/// The value of `series` (name and labels, exactly as written) in the text of `ferry --space
/// URL metrics`.
pub(crate) fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
        .parse()
        .unwrap()
}

/// `ferry --space URL metrics` (`GET /v1/metrics`) counts what a space did: sessions started
/// and how they ended, checkpoints and their write times, a move out (committed, with its
/// pause) at the source and in at the destination, the objects the destination received,
/// and the sessions by state. Without the token it is refused.
#[test]
fn a_space_counts_sessions_snapshots_and_moves_in_its_metrics() {
    let here = client();
    let (a, b) = (SpaceProc::start(&[]), SpaceProc::start(&[]));
    let g = guest("wasm/cpu.wasm");
    let g = g.to_str().unwrap();
    let plain = here.plain(&[g, "--", "600"]);
    let every = ["--checkpoint-every", "100ms"];
    let run = |id: &str, rounds: &str| {
        let args = [&["run", "--session", id][..], &every, &[g, "--", rounds]].concat();
        ok(&here, &a.url, &args);
    };
    run("counted", "600");
    run("stopped", "100000");
    eventually("a checkpoint of each", || {
        ["counted", "stopped"]
            .iter()
            .all(|id| a.session(id).unwrap().get("snapshot").is_some())
    });
    ok(&here, &a.url, &["kill", "stopped"]);
    ok(&here, &a.url, &["migrate", "counted", "--to", &b.url]);
    assert_finished_like(&here, &a.url, "counted", &plain.stdout);

    let (at_a, err, code) = cli(&here, &a.url, &["metrics"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(metric(&at_a, "ferry_sessions_started_total"), 2.0);
    assert_eq!(
        metric(&at_a, "ferry_sessions_ended_total{how=\"killed\"}"),
        1.0
    );
    assert_eq!(
        metric(&at_a, "ferry_sessions_ended_total{how=\"exited\"}"),
        0.0
    );
    assert_eq!(metric(&at_a, "ferry_sessions{state=\"moved\"}"), 1.0);
    assert_eq!(metric(&at_a, "ferry_sessions{state=\"killed\"}"), 1.0);
    assert_eq!(metric(&at_a, "ferry_sessions{state=\"running\"}"), 0.0);
    assert_eq!(
        metric(&at_a, "ferry_migrations_total{outcome=\"committed\"}"),
        1.0
    );
    assert_eq!(metric(&at_a, "ferry_migration_pause_seconds_count"), 1.0);
    // Periodic checkpoints and the move's pre-copy rounds, a suspend for its pause and one
    // for the kill: each timed.
    let checkpoints = metric(&at_a, "ferry_snapshots_total{why=\"checkpoint\"}");
    let suspends = metric(&at_a, "ferry_snapshots_total{why=\"suspend\"}");
    assert!(checkpoints >= 2.0, "{at_a}");
    assert!(suspends >= 1.0, "{at_a}");
    assert_eq!(
        metric(&at_a, "ferry_snapshot_write_seconds_count"),
        checkpoints + suspends
    );
    assert_eq!(
        metric(&at_a, "ferry_snapshot_write_seconds_bucket{le=\"+Inf\"}"),
        checkpoints + suspends
    );
    assert!(
        metric(&at_a, "ferry_objects_received_total") >= 1.0,
        "the module"
    );

    let (at_b, err, code) = cli(&here, &b.url, &["metrics"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(metric(&at_b, "ferry_migrations_in_total"), 1.0);
    assert_eq!(metric(&at_b, "ferry_sessions_started_total"), 0.0);
    assert_eq!(
        metric(&at_b, "ferry_sessions_ended_total{how=\"exited\"}"),
        1.0
    );
    assert_eq!(metric(&at_b, "ferry_sessions{state=\"exited\"}"), 1.0);
    assert!(
        metric(&at_b, "ferry_objects_received_total") >= 2.0,
        "{at_b}"
    );
    assert!(metric(&at_b, "ferry_object_bytes_received_total") > 0.0);

    let stranger = Env::new().with_var("FERRY_TOKEN", "not-the-token");
    let err = refused(&stranger, &a.url, &["metrics"]);
    assert!(err.contains("401") || err.contains("token"), "{err}");
}

/// A space asked to stop (SIGTERM, as systemd or Kubernetes stop it) first suspends its
/// running sessions — one without any checkpoint too — and exits 0; started again, it resumes
/// them, and each ends with an uninterrupted run's output. A session suspended by its user
/// stays suspended, and one that ended stays ended.
#[test]
fn a_space_asked_to_stop_suspends_its_sessions_and_resumes_them_when_it_starts_again() {
    let here = client();
    let mut a = SpaceProc::start(&[]);
    let g = guest("wasm/cpu.wasm");
    let g = g.to_str().unwrap();
    let plain = here.plain(&[g, "--", "600"]);
    let short = here.plain(&[g, "--", "5"]);
    ok(&here, &a.url, &["run", "--session", "bare", g, "--", "600"]);
    let every = ["--checkpoint-every", "100ms"];
    let args = [&["run", "--session", "kept"][..], &every, &[g, "--", "600"]].concat();
    ok(&here, &a.url, &args);
    ok(&here, &a.url, &["run", "--session", "held", g, "--", "600"]);
    ok(&here, &a.url, &["suspend", "held"]);
    ok(&here, &a.url, &["run", "--session", "done", g, "--", "5"]);
    assert_finished_like(&here, &a.url, "done", &short.stdout);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(a.state("bare").as_deref(), Some("running"));

    let status = a.terminate();
    assert!(status.success(), "{status}");
    let record = |id: &str| -> serde_json::Value {
        let p = a.env.store().join(format!("space/sessions/{id}.json"));
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    for id in ["bare", "kept"] {
        let r = record(id);
        assert_eq!(
            (&r["state"], &r["resume_on_start"]),
            (&json!("suspended"), &json!(true)),
            "{r}"
        );
    }
    assert_eq!(record("held")["resume_on_start"], json!(null));
    assert_eq!(record("done")["state"], json!("exited"));

    a.spawn(None);
    for id in ["bare", "kept"] {
        assert_finished_like(&here, &a.url, id, &plain.stdout);
    }
    assert_eq!(a.state("held").as_deref(), Some("suspended"));
    assert_eq!(a.state("done").as_deref(), Some("exited"));
    ok(&here, &a.url, &["resume", "held"]);
    assert_finished_like(&here, &a.url, "held", &plain.stdout);
    stores_verify(&[&a]);
}
