//! Churn tests: suspend and resume guests at random points, each resume in a new process, and
//! require exactly what an uninterrupted run shows: stdout bytes, stderr, exit code, files.

use crate::harness::{
    Env, assert_same_run, check_churn, dir_contents, guest, suspend_after_output,
};

fn check(run_args: &[&str], suspends: usize, delay_ms: (u64, u64), seed: u64) {
    check_churn(&[], run_args, suspends, delay_ms, seed);
}

#[test]
fn wat_counter_survives_many_suspends() {
    let g = guest("wat/count-long.wat");
    check(&[g.to_str().unwrap()], 8, (20, 60), 1);
}

/// A data segment the guest dropped stays dropped across resumes (a resume instantiates the
/// module afresh, every passive segment whole again): the guest's last `memory.init` traps,
/// exit 134, as in the uninterrupted run — on either engine, moved between them.
#[test]
fn a_dropped_data_segment_stays_dropped() {
    let g = guest("wat/data-drop.wat");
    check(&[g.to_str().unwrap()], 5, (20, 60), 11);
    check_churn(&["jit", "interp"], &[g.to_str().unwrap()], 4, (20, 60), 12);
}

#[test]
fn c_cpu_loop() {
    let g = guest("wasm/cpu.wasm");
    check(&[g.to_str().unwrap(), "--", "200"], 6, (40, 250), 2);
}

#[test]
fn c_deep_recursion() {
    let g = guest("wasm/recurse.wasm");
    check(&[g.to_str().unwrap(), "--", "20000", "30"], 6, (40, 200), 3);
}

#[test]
fn c_sleeps_stderr_and_exit_code() {
    let g = guest("wasm/sleepy.wasm");
    check(&[g.to_str().unwrap(), "--", "25", "3"], 5, (50, 150), 4);
}

#[test]
fn c_heap_of_256_mib() {
    // Also the path with zstd-compressed objects: κ and behaviour must not change.
    let env = Env::new().with_var("FERRY_ZSTD", "1");
    let g = guest("wasm/heap.wasm");
    let args = [g.to_str().unwrap(), "--", "256", "30"];
    let plain = env.plain(&args);
    assert_eq!(plain.code, 0);
    // Suspends late enough that the heap is full at the last one even on a loaded machine
    // (allocating and filling 256 MiB takes ~0.3 s alone, several times that under load).
    let churned = env.churn(&args, &[], 3, 5, (600, 1200));
    assert!(
        churned.snapshots.len() >= 2,
        "snapshots: {:?}",
        churned.snapshots
    );
    assert_eq!(churned.stdout, plain.stdout);
    assert_eq!(churned.code, plain.code);
    // The last snapshot holds the whole heap.
    let v = env.inspect_json(churned.snapshots.last().unwrap());
    let bytes = v["memories"][0]["bytes"].as_u64().unwrap();
    assert!(bytes >= 256 << 20, "memory image is only {bytes} bytes");
}

/// The heap guest suspended at random points while its memory is pre-written in every run
/// and resume (growing, then rewritten again and again): the same output as an uninterrupted
/// run, every snapshot checked against a full hash of the memory.
#[test]
fn c_heap_churned_while_pre_writing() {
    let env = Env::new();
    let g = guest("wasm/heap.wasm");
    let args = [g.to_str().unwrap(), "--", "64", "60"];
    let plain = env.plain(&args);
    assert_eq!(plain.code, 0);
    let mut run = vec!["--pre-write", "10ms"];
    run.extend(args);
    let churned = env.churn(&run, &["--pre-write", "10ms"], 6, 7, (100, 400));
    assert_same_run(&churned, &plain, 2);
}

#[test]
fn c_file_io_in_a_mount() {
    let env = Env::new();
    let g = guest("wasm/files.wasm");
    let (plain_dir, pd) = env.data_dir("plain-data");
    let (churn_dir, cd) = env.data_dir("churn-data");
    let plain = env.plain(&["--dir", &pd, g.to_str().unwrap(), "--", "/data", "500"]);
    let churned = env.churn(
        &["--dir", &cd, g.to_str().unwrap(), "--", "/data", "500"],
        &["--dir", &cd],
        5,
        6,
        (40, 200),
    );
    assert!(churned.snapshots.len() >= 2);
    assert_eq!(churned.stdout, plain.stdout);
    assert_eq!(churned.code, 0);
    assert_eq!(
        dir_contents(&churn_dir),
        dir_contents(&plain_dir),
        "files written differ"
    );
}

/// Descriptors that outlive the names they were opened by (`guests/c/handles.c`): a file
/// renamed while open, log rotation, a file replaced by a rename, a directory renamed while
/// open, a directory listed in pieces, files deleted while open. An uninterrupted run
/// behaves as on Linux; suspended and resumed in new processes, alternating engines, it
/// prints the same and leaves the same files.
#[test]
fn descriptors_that_outlive_their_names() {
    let env = Env::new();
    let g = guest("wasm/handles.wasm");
    let g = g.to_str().unwrap();
    let (plain_dir, pd) = env.data_dir("plain-data");
    let (churn_dir, cd) = env.data_dir("churn-data");
    // Spins long enough (~0.6 s on the JIT) that nine suspends 20–90 ms into each step land
    // before the end, however fast this machine starts a resumed guest.
    let plain = env.plain(&["--dir", &pd, g, "--", "/data", "60000000"]);
    let text = String::from_utf8_lossy(&plain.stdout);
    for line in [
        "  b.txt: \"one|two|\"",
        "  log.1: \"x|z|\"",
        "  log: \"y|w|\"",
        "  old descriptor reads \"old config|\"",
        "  e/inside: \"in e|\"",
        "  60 entries, sum 1770",
        "  tmp: \"another file|\"",
        "  3145728 bytes, hash 5c9c1505",
        "  first: \"through first|through second|through third|\"",
        "  one file: yes, 3 links",
        "  the same device and inode numbers as before: yes",
    ] {
        assert!(text.lines().any(|l| l == line), "`{line}` not in\n{text}");
    }
    let churned = env.churn_on(
        &["jit", "jit", "interp"],
        &["--dir", &cd, g, "--", "/data", "60000000"],
        &["--dir", &cd],
        9,
        13,
        (20, 90),
    );
    assert!(churned.snapshots.len() >= 5, "{churned:?}");
    assert_eq!(String::from_utf8_lossy(&churned.stdout), text);
    assert_eq!(churned.code, 0);
    assert_eq!(dir_contents(&churn_dir), dir_contents(&plain_dir));
}

/// `ferry run prog > out.txt 2> err.txt` inside the program's own mount, then each resume
/// appending to the same files (`>>`): ferry writes to them after every snapshot, so the
/// snapshots leave them out (and say so) and a resume does not count them as a change to the
/// directory. The output file ends up as an uninterrupted run's stdout; the other files too.
#[test]
fn output_redirected_into_a_mount_does_not_stop_the_resume() {
    use std::os::unix::process::ExitStatusExt;
    let env = Env::new();
    let g = guest("wasm/files.wasm");
    let (plain_dir, pd) = env.data_dir("plain-data");
    let (churn_dir, cd) = env.data_dir("churn-data");
    let plain = env.plain(&["--dir", &pd, g.to_str().unwrap(), "/data", "400"]);
    let append = |name: &str| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(churn_dir.join(name))
            .unwrap()
    };
    let mut args = vec!["run", "--dir", &cd, g.to_str().unwrap(), "/data", "400"];
    let mut snapshots = Vec::new();
    let mut delay = 150;
    let code = loop {
        let mut child = env
            .ferry()
            .args(&args)
            .stdout(append("out.txt"))
            .stderr(append("err.txt"))
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay));
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let status = child.wait().unwrap();
        if status.signal() == Some(libc::SIGINT) {
            delay *= 2; // interrupted before the guest started: nothing ran
            continue;
        }
        let err = std::fs::read_to_string(churn_dir.join("err.txt")).unwrap();
        assert!(!err.contains("refused"), "{err}");
        if status.code() != Some(75) {
            break status.code();
        }
        let k = err
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("suspended "))
            .unwrap()
            .to_owned();
        snapshots.push(k);
        args = vec!["resume", "--dir", &cd, snapshots.last().unwrap()];
        delay = 200;
    };
    assert_eq!(code, Some(0));
    assert!(snapshots.len() >= 2, "{snapshots:?}");
    assert_eq!(
        std::fs::read(churn_dir.join("out.txt")).unwrap(),
        plain.stdout
    );
    let files = |d: &std::path::Path| {
        let mut v = dir_contents(d);
        v.retain(|(name, _)| name != "out.txt" && name != "err.txt");
        v
    };
    assert_eq!(files(&churn_dir), files(&plain_dir), "files written differ");
    let v = env.inspect_json(&snapshots[0]);
    assert_eq!(
        v["capability_request"]["mounts"][0]["not_carried"],
        serde_json::json!(["err.txt", "out.txt"]),
        "{v}"
    );
    // A snapshot resumed into an empty directory brings the program's files, not ferry's
    // output; a change to any other file is still refused.
    let fresh = env.path("fresh");
    let fd = format!("{}::/data", fresh.display());
    let (_, err, code) = env.output(&["resume", "--dir", &fd, &snapshots[0]]);
    assert_eq!(code, 0, "{err}");
    assert!(!fresh.join("out.txt").exists() && !fresh.join("err.txt").exists());
    std::fs::write(churn_dir.join("intruder.txt"), "x").unwrap();
    let (_, err, code) = env.output(&["resume", "--dir", &cd, &snapshots[0]]);
    assert_eq!(code, 1);
    assert!(err.contains("changed since the snapshot"), "{err}");
}

/// `--bind` passes a host directory through: the guest's files are the same as with an
/// imported mount across suspends, but snapshots do not carry the directory (they say they
/// are host-bound), so a change to it does not stop a resume; a space, which can only give a
/// session the directories it is sent, refuses it.
#[test]
fn a_bound_directory_is_passed_through_and_not_carried() {
    let env = Env::new().with_var("FERRY_TOKEN", crate::harness::SPACE_TOKEN);
    let g = guest("wasm/files.wasm");
    let (plain_dir, pd) = env.data_dir("plain-data");
    let (bound_dir, bd) = env.data_dir("bound-data");
    let plain = env.plain(&["--dir", &pd, g.to_str().unwrap(), "/data", "300"]);
    let churned = env.churn(
        &["--bind", &bd, g.to_str().unwrap(), "/data", "300"],
        &["--dir", &bd],
        3,
        9,
        (100, 300),
    );
    assert_eq!(churned.stdout, plain.stdout);
    assert_eq!(dir_contents(&bound_dir), dir_contents(&plain_dir));

    let k = env.suspend_once(&["--bind", &bd, g.to_str().unwrap(), "/data", "300"], 400);
    let v = env.inspect_json(&k);
    assert_eq!(v["profile"]["host_bound"], true, "{v}");
    assert_eq!(
        v["profile"]["capabilities"],
        serde_json::json!(["bind:/data"])
    );
    assert_eq!(v["capability_request"]["mounts"][0]["host_bound"], true);
    // Changed under the suspended guest: an imported mount would refuse this resume.
    std::fs::write(bound_dir.join("added-later.txt"), "x").unwrap();
    let (_, err, code) = env.output(&["resume", &k]);
    assert_eq!(code, 1);
    assert!(
        err.contains("passed through: the snapshot does not carry its content"),
        "{err}"
    );
    let (_, err, code) = env.output(&["resume", "--dir", &bd, &k]);
    assert_eq!(code, 0, "{err}");

    // A space can only give a session the directories it is sent.
    let server = crate::harness::SpaceProc::start(&[]);
    let (_, err, code) = env.output(&["--space", &server.url, "run", "--bind", &bd, "x.wasm"]);
    assert_eq!(code, 1);
    assert!(err.contains("--bind is for local runs"), "{err}");
}

#[test]
fn periodic_checkpoints_leave_output_alone_and_each_resumes_to_the_rest() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "200"];
    let plain = env.plain(&args);
    let out = env
        .ferry()
        .args(["run", "--checkpoint-every", "250ms"])
        .args(args)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(out.stdout, plain.stdout, "checkpointing changed the output");
    let err = String::from_utf8_lossy(&out.stderr);
    let ks: Vec<&str> = err
        .lines()
        .filter_map(|l| l.strip_prefix("ferry: checkpoint "))
        .collect();
    assert!(
        ks.len() >= 2,
        "expected periodic checkpoints, stderr:\n{err}"
    );
    // A checkpoint resumes to exactly the output that followed it.
    let k = ks[ks.len() / 2];
    let (info, _, _) = env.output(&["inspect", "--json", k]);
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    let at = v["stdio"]["stdout_bytes"].as_u64().unwrap() as usize;
    let resumed = env.ferry().args(["resume", k]).output().unwrap();
    assert_eq!(resumed.status.code(), Some(0));
    assert_eq!(
        resumed.stdout,
        plain.stdout[at..],
        "resume from a checkpoint"
    );
}

#[test]
fn suspend_from_another_terminal() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "200"];
    let plain = env.plain(&args);
    let child = env
        .ferry()
        .args(["run", "--session", "job1"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(400));
    let (ps, _, _) = env.output(&["ps"]);
    assert!(ps.contains("job1") && ps.contains("running"), "{ps}");
    let (k, err, code) = env.output(&["suspend", "job1"]);
    assert_eq!(code, 0, "{err}");
    let first = child.wait_with_output().unwrap();
    assert_eq!(first.status.code(), Some(75));
    let k = k.trim();
    assert!(String::from_utf8_lossy(&first.stderr).contains(&format!("suspended {k}")));
    // Resumed by the session's name: its last snapshot.
    let rest = env.ferry().args(["resume", "job1"]).output().unwrap();
    assert_eq!(rest.status.code(), Some(0));
    let mut all = first.stdout;
    all.extend(rest.stdout);
    assert_eq!(all, plain.stdout);
    let (_, err, code) = env.output(&["resume", "job1"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("session `job1` ran to its end (exited(0)); nothing to continue"),
        "{err}"
    );
}

/// One process at a time continues a session: a second `resume` of the snapshot a running
/// session continues from, or a `run` taking a live or resumable session's name, is refused
/// before the guest runs (two copies would both write its output), and the first copy's
/// output is still whole.
#[test]
fn a_session_runs_in_one_process_at_a_time() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "300"];
    let plain = env.plain(&args);
    let (_, err, code) = env.output(&["run", "--session", "../job", g.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("`../job` is not a session id"), "{err}");

    let (first, k) = crate::harness::run_and_suspend(
        &env,
        &[&["--session", "job"][..], &args[..]].concat(),
        300,
    );
    let (_, err, code) = env.output(&[&["run", "--session", "job"][..], &args[..]].concat());
    assert_eq!(code, 1);
    assert!(err.contains("session `job` exists (suspended"), "{err}");

    let resumed = env
        .ferry()
        .args(["resume", &k])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    crate::harness::wait_until_running(&env);
    let (ps, _, _) = env.output(&["ps", "--json"]);
    let ps: Vec<serde_json::Value> = serde_json::from_str(&ps).unwrap();
    let job = ps
        .iter()
        .find(|s| s["id"] == "job")
        .expect("job in ps --json");
    assert_eq!(job["state"], "running");
    assert_eq!(job["pid"], resumed.id());
    assert_eq!(job["last_snapshot"], k.as_str());
    let (out, err, code) = env.output(&["resume", &k]);
    assert_eq!(code, 1, "{out}");
    assert!(
        err.contains("refused while admitting")
            && err.contains(&format!(
                "session `job` is already running from this snapshot (pid {})",
                resumed.id()
            )),
        "{err}"
    );
    let (_, err, code) = env.output(&[&["run", "--session", "job"][..], &args[..]].concat());
    assert_eq!(code, 1);
    assert!(
        err.contains(&format!("session `job` is running (pid {})", resumed.id())),
        "{err}"
    );

    let (_, err, code) = env.output(&["rm", "--force", "job"]);
    assert_eq!(code, 1);
    assert!(err.contains("session `job` is running (pid"), "{err}");
    let (k2, err, code) = env.output(&["suspend", "job"]);
    assert_eq!(code, 0, "{err}");
    let second = resumed.wait_with_output().unwrap();
    assert_eq!(second.status.code(), Some(75));
    let (_, err, code) = env.output(&["suspend", "job"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("session `job` is not running (state: suspended)"),
        "{err}"
    );
    let mut all = first;
    all.extend(second.stdout);
    all.extend(crate::harness::resume_to_end(&env, k2.trim()));
    assert_eq!(all, plain.stdout);
    // Exited sessions are listed only with --all, and `rm --exited` forgets them.
    let (ps, err, _) = env.output(&["ps"]);
    assert!(!ps.contains("job "), "{ps}");
    assert!(
        err.contains("exited session") && err.contains("not shown"),
        "{err}"
    );
    let (ps, _, _) = env.output(&["ps", "--all"]);
    assert!(
        ps.lines()
            .any(|l| l.starts_with("job ") && l.contains("exited(0)")),
        "{ps}"
    );
    let (out, err, code) = env.output(&["rm", "--exited"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.lines().any(|l| l == "removed job"), "{out}");
    let (ps, err, _) = env.output(&["ps", "--all"]);
    assert_eq!(ps.lines().count(), 1, "only the header: {ps}");
    assert!(err.is_empty(), "{err}");
}

/// `ferry run --session job` with stdout appended to `out.txt`, checkpointed once, then killed
/// (SIGKILL: no snapshot, no last word) once the file holds output written after the
/// checkpoint: (the checkpoint's κ, the file, how long the file was at the checkpoint).
fn lost_after_a_checkpoint(env: &Env, args: &[&str]) -> (String, std::path::PathBuf, u64) {
    lost_after_a_checkpoint_with(env, args, 1, false)
}

/// [`lost_after_a_checkpoint`], killed once at least `tail` bytes follow the checkpoint;
/// `merged`: stderr goes to the same file (`> out 2>&1`).
fn lost_after_a_checkpoint_with(
    env: &Env,
    args: &[&str],
    tail: u64,
    merged: bool,
) -> (String, std::path::PathBuf, u64) {
    let out = env.path("out.txt");
    let (stdout, stderr) = appending(&out, merged);
    let mut child = env
        .ferry()
        .args(["run", "--session", "job"])
        .args(args)
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .unwrap();
    crate::harness::wait_until_running(env);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let (k, err, code) = env.output(&["checkpoint", "job"]);
    assert_eq!(code, 0, "{err}");
    let end = stdout_mark(&env.session_record("job"))["end"]
        .as_u64()
        .unwrap();
    while std::fs::metadata(&out).unwrap().len() < end + tail {
        assert!(
            std::time::Instant::now() < deadline,
            "no output after the checkpoint"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let (ps, _, _) = env.output(&["ps"]);
    assert!(ps.contains("lost"), "{ps}");
    (k.trim().to_owned(), out, end)
}

/// The stdout (fd 1) entry of a session record's output marks.
fn stdout_mark(record: &serde_json::Value) -> serde_json::Value {
    record["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["fd"] == 1)
        .expect("stdout's end noted with the snapshot")
        .clone()
}

/// Stdout appended to `out` (created if missing), and stderr: the same open file when
/// `merged`, else nowhere.
fn appending(out: &std::path::Path, merged: bool) -> (std::process::Stdio, std::process::Stdio) {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out)
        .unwrap();
    let err = if merged {
        std::process::Stdio::from(file.try_clone().unwrap())
    } else {
        std::process::Stdio::null()
    };
    (file.into(), err)
}

/// `text` without ferry's own lines (`ferry: …\n`, wherever they start): what the guest wrote
/// into a file that had stderr in it too.
fn without_ferry_lines(text: &str) -> String {
    let mut seen = text.to_owned();
    while let Some(at) = seen.find("ferry: ") {
        let end = seen[at..].find('\n').map_or(seen.len(), |e| at + e + 1);
        seen.replace_range(at..end, "");
    }
    seen
}

/// Lines of ferry's own in what a lost run left are stepped over: a resume of a lost session
/// says so on stderr (here the same file), writes on, and is lost in turn before any
/// checkpoint; the next resume finds that line between the guest's bytes and still writes
/// nothing twice.
#[test]
fn ferry_lines_in_a_lost_runs_output_are_stepped_over() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "300"];
    let plain = env.plain(&args);
    let (k, out, _) = lost_after_a_checkpoint_with(&env, &args, 1, true);
    let (stdout, stderr) = appending(&out, true);
    let mut again = env
        .ferry()
        .args(["resume", &k])
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let said = |f: &std::path::Path| {
        String::from_utf8_lossy(&std::fs::read(f).unwrap()).contains("are not written again")
    };
    while !said(&out) {
        assert!(
            std::time::Instant::now() < deadline,
            "the resume said nothing"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // Let it write on past its message, then lose it too (no checkpoint: the record still
    // names the same snapshot).
    std::thread::sleep(std::time::Duration::from_millis(800));
    again.kill().unwrap();
    again.wait().unwrap();
    let (stdout, stderr) = appending(&out, true);
    let last = env
        .ferry()
        .args(["resume", &k])
        .stdout(stdout)
        .stderr(stderr)
        .status()
        .unwrap();
    assert_eq!(last.code(), Some(0));
    let seen = String::from_utf8(std::fs::read(&out).unwrap()).unwrap();
    assert!(!seen.contains("output differs"), "{seen}");
    assert_eq!(
        without_ferry_lines(&seen),
        String::from_utf8_lossy(&plain.stdout)
    );
}

/// `ferry resume κ >> out` to the guest's exit (code 0): ferry's stderr.
fn resume_appending(env: &Env, k: &str, out: &std::path::Path) -> String {
    let file = std::fs::OpenOptions::new().append(true).open(out).unwrap();
    let resumed = env
        .ferry()
        .args(["resume", k])
        .stdout(file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&resumed.stderr).into_owned();
    assert_eq!(resumed.status.code(), Some(0), "{err}");
    err
}

/// After a crash, resuming the lost session's last snapshot with stdout appended to the same
/// file (`>>`) writes nothing twice: the output the lost run wrote after the snapshot is
/// matched, not repeated, and the file ends up as an uninterrupted run's output.
#[test]
fn output_a_lost_run_wrote_after_its_last_snapshot_is_not_written_twice() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "300"];
    let plain = env.plain(&args);
    let (k, out, _) = lost_after_a_checkpoint(&env, &args);
    let err = resume_appending(&env, &k, &out);
    assert!(
        err.contains("a lost run of session `job` wrote past this snapshot"),
        "{err}"
    );
    assert_eq!(
        String::from_utf8_lossy(&std::fs::read(&out).unwrap()),
        String::from_utf8_lossy(&plain.stdout)
    );
}

/// A resume of a lost session that is itself suspended before its guest has written again
/// all the lost run wrote leaves the rest to be matched by the next resume: nothing twice.
#[test]
fn a_replay_cut_short_by_a_suspend_goes_on_at_the_next_resume() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "300"];
    let plain = env.plain(&args);
    // ~6 KB is ~2 s of this guest's output: the resume is suspended well before it is matched.
    let (k, out, _) = lost_after_a_checkpoint_with(&env, &args, 6000, false);
    let file = std::fs::OpenOptions::new().append(true).open(&out).unwrap();
    let child = env
        .ferry()
        .args(["resume", &k])
        .stdout(file)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let first = child.wait_with_output().unwrap();
    let k2 = crate::harness::suspended_kappa(&first);
    let mark = stdout_mark(&env.session_record("job"));
    assert!(
        mark["tail"].as_u64().unwrap() > 0,
        "suspended after the replay had ended: {mark}"
    );
    let err = resume_appending(&env, &k2, &out);
    assert!(err.contains("are not written again"), "{err}");
    assert_eq!(
        String::from_utf8_lossy(&std::fs::read(&out).unwrap()),
        String::from_utf8_lossy(&plain.stdout)
    );
}

/// Crash churn: a guest checkpointing every 100 ms is killed (SIGKILL: no last snapshot) at
/// random moments, five times, each time resumed from its session's last snapshot in a new
/// process with stdout appended to the same file — during a replay too. The file ends up
/// byte for byte an uninterrupted run's output.
#[test]
fn killed_again_and_again_the_output_is_still_whole_and_once() {
    crash_churn(false);
}

/// The same with stderr in the same file (`> out 2>&1`): ferry's own lines (each checkpoint
/// says so) sit between the guest's bytes, mid-line too; the guest's output is still whole
/// and once, and only ferry's lines come between.
#[test]
fn killed_again_and_again_with_stderr_in_the_same_file() {
    crash_churn(true);
}

fn crash_churn(merged: bool) {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "400"];
    let plain = env.plain(&args);
    let out = env.path("out.txt");
    let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut step: Vec<String> = ["run", "--session", "job", "--checkpoint-every", "100ms"]
        .iter()
        .map(|s| s.to_string())
        .chain(args.iter().map(|s| s.to_string()))
        .collect();
    let mut kills = 0;
    loop {
        let (stdout, stderr) = appending(&out, merged);
        let mut child = env
            .ferry()
            .args(&step)
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .unwrap();
        if kills < 5 {
            if kills == 0 {
                // The first run must have a snapshot to come back to.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
                while !env.store().join("sessions/job.json").exists()
                    || !env.session_record("job")["last_snapshot"].is_string()
                {
                    assert!(std::time::Instant::now() < deadline, "no checkpoint");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            std::thread::sleep(std::time::Duration::from_millis(150 + rng % 500));
            child.kill().unwrap();
            let status = child.wait().unwrap();
            if status.code() == Some(0) {
                break; // it finished first
            }
            kills += 1;
            let k = env.session_record("job")["last_snapshot"]
                .as_str()
                .unwrap()
                .to_owned();
            step = vec!["resume".into(), k];
            continue;
        }
        assert_eq!(child.wait().unwrap().code(), Some(0));
        break;
    }
    assert!(kills >= 3, "only {kills} kills landed");
    let seen = String::from_utf8(std::fs::read(&out).unwrap()).unwrap();
    let seen = if merged {
        without_ferry_lines(&seen)
    } else {
        seen
    };
    assert_eq!(seen, String::from_utf8_lossy(&plain.stdout));
}

/// A run killed while it records a checkpoint (between the session's file and its ref, the
/// two writes that name the new snapshot) resumes from what the session's record says, as
/// the same session, with its output whole and once. (When the ref was written first, the
/// record still named the checkpoint before, whose resume started a new session and wrote
/// again all the lost run had written since.)
#[test]
fn killed_while_recording_a_checkpoint_the_output_is_still_whole_and_once() {
    use std::os::unix::process::ExitStatusExt;
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "400"];
    let plain = env.plain(&args);
    let out = env.path("out.txt");
    let (stdout, stderr) = appending(&out, false);
    // ~100 rounds a second, flushed every ~28: output follows the first checkpoint.
    let status = env
        .ferry()
        .env("FERRY_FAULT", "recording-2")
        .args(["run", "--session", "job", "--checkpoint-every", "1s"])
        .args(args)
        .stdout(stdout)
        .stderr(stderr)
        .status()
        .unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    let k = env.session_record("job")["last_snapshot"]
        .as_str()
        .unwrap()
        .to_owned();
    resume_appending(&env, &k, &out);
    let seen = String::from_utf8(std::fs::read(&out).unwrap()).unwrap();
    assert!(
        seen == String::from_utf8_lossy(&plain.stdout),
        "{} bytes written, {} expected",
        seen.len(),
        plain.stdout.len()
    );
    // It went on as the same session, not as a new one.
    assert_eq!(env.session_record("job")["state"], "exited(0)");
}

/// What a lost run wrote is never overwritten: where the resumed guest writes something else
/// (here the file was edited), ferry says so and appends from there on.
#[test]
fn output_that_differs_from_the_lost_run_is_appended_with_a_warning() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "300"];
    let plain = env.plain(&args);
    let (k, out, end) = lost_after_a_checkpoint(&env, &args);
    let mut before = std::fs::read(&out).unwrap();
    before[end as usize] ^= 0x20;
    std::fs::write(&out, &before).unwrap();
    let err = resume_appending(&env, &k, &out);
    assert!(
        err.contains("output differs from what the lost run wrote"),
        "{err}"
    );
    let after = std::fs::read(&out).unwrap();
    assert!(
        after.starts_with(&before),
        "the lost run's output was changed"
    );
    assert_eq!(after[before.len()..], plain.stdout[end as usize..]);
}

/// Checkpoints that cannot be written (the disk is full) leave the guest running to the
/// output of an uninterrupted run, the store intact, and one line on stderr saying why.
#[test]
fn disk_full_during_snapshots_keeps_the_guest_running() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "200"];
    let plain = env.plain(&args);
    // The module objects are already stored by the plain run; nothing new can be written.
    let out = env
        .ferry()
        .env("FERRY_FAULT_STORE_FULL_AFTER", "0")
        .args(["run", "--checkpoint-every", "200ms"])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("snapshot failed, the program keeps running"),
        "{err}"
    );
    assert!(err.contains("No space left on device"), "{err}");
    // Said once, not at every interval: the same failure again within a minute is not.
    assert_eq!(err.matches("snapshot failed").count(), 1, "{err}");
    assert_eq!(out.stdout, plain.stdout);
    let (o, e, code) = env.output(&["store", "verify"]);
    assert_eq!(code, 0, "{o}{e}");
}

/// A suspend that cannot be written (the disk is full) is reported at once to whoever asked
/// for it — `ferry suspend` fails saying why instead of waiting for a snapshot that will not
/// come, `ferry ps` says so — and the guest keeps running: asked again and again, it is not
/// ended unsaved, and it finishes as an uninterrupted run.
#[test]
fn a_suspend_that_cannot_be_written_is_reported_and_the_guest_keeps_running() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "400"];
    let plain = env.plain(&args);
    // The module objects are already stored by the plain run; nothing new can be written.
    let child = env
        .ferry()
        .env("FERRY_FAULT_STORE_FULL_AFTER", "0")
        .args(["run", "--session", "full"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !env.output(&["ps", "--json"]).0.contains("\"running\"") {
        assert!(std::time::Instant::now() < deadline, "it never ran");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for _ in 0..3 {
        let (_, err, code) = env.output(&["suspend", "full"]);
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("session `full` could not write its snapshot and keeps running")
                && err.contains("No space left on device"),
            "{err}"
        );
    }
    let (_, err, _) = env.output(&["ps"]);
    assert!(
        err.contains("full: its last snapshot failed, it keeps running"),
        "{err}"
    );
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("ferry: suspend failed, the program keeps running"),
        "{err}"
    );
    assert_eq!(out.stdout, plain.stdout);
}

#[test]
fn stdin_from_a_file_is_read_once_across_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input.txt");
    let text: String = (0..60)
        .map(|i| format!("input line number {i} {}\n", "x".repeat(i % 17)))
        .collect();
    std::fs::write(&input, text).unwrap();
    let env = Env::new().with_stdin(input);
    let g = guest("wasm/lines.wasm");
    let plain = env.plain(&[g.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&plain.stdout).contains("done 60 lines"));
    let churned = env.churn(&[g.to_str().unwrap()], &[], 5, 8, (60, 200));
    assert!(churned.snapshots.len() >= 2, "{:?}", churned.snapshots);
    assert_eq!(
        String::from_utf8_lossy(&churned.stdout),
        String::from_utf8_lossy(&plain.stdout)
    );
}

/// The zstd library (built by scripts/fetch-zstd.sh, which scripts/setup.sh runs) compressing
/// and decompressing at three levels: a real library nobody here wrote.
#[test]
fn zstd_compression_workload() {
    let g = cached_guest("zstd-bench.wasm", "scripts/fetch-zstd.sh");
    check(&[g.to_str().unwrap(), "--", "4", "2"], 5, (60, 300), 42);
}

/// A guest that `scripts/setup.sh` builds into the guest cache (not committed).
fn cached_guest(file: &str, script: &str) -> std::path::PathBuf {
    let cache = std::env::var_os("FERRY_GUEST_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/ferry/guests")
        });
    let p = cache.join(file);
    assert!(
        p.exists(),
        "{} is missing: run {script} (scripts/setup.sh does)",
        p.display()
    );
    p
}

/// Ctrl-C while ferry prepares a program (compiling the instrumented SQLite shell into an empty
/// cache takes a second or two; a big interpreter's first compile, minutes) ends ferry then and there: the
/// program has not run, so there is nothing to save, and no session is left behind.
#[test]
fn an_interrupt_before_the_program_starts_ends_ferry_at_once() {
    use std::io::BufRead;
    let sqlite = cached_guest("sqlite3-3.52.0.wasm", "scripts/fetch-sqlite.sh");
    let cache = tempfile::tempdir().unwrap();
    let env = Env::new().with_var("FERRY_CACHE", cache.path().to_str().unwrap());
    let mut child = env
        .ferry()
        .args(["run", sqlite.to_str().unwrap(), ":memory:"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut lines = String::new();
    while !lines.contains("compiling") {
        assert!(err.read_line(&mut lines).unwrap() > 0, "{lines}");
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    std::io::Read::read_to_string(&mut err, &mut lines).unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGINT),
        "{lines}"
    );
    assert!(
        lines.contains("ferry: interrupted before the program started: nothing ran"),
        "{lines}"
    );
    let (ps, _, _) = env.output(&["ps", "--all"]);
    assert_eq!(ps.lines().count(), 1, "no session: {ps}");
}

/// The SQLite shell (built by scripts/fetch-sqlite.sh, which scripts/setup.sh runs) running a
/// SQL workload on an in-memory database: a real program nobody here wrote.
#[test]
fn sqlite_shell_running_a_sql_workload() {
    let sqlite = cached_guest("sqlite3-3.52.0.wasm", "scripts/fetch-sqlite.sh");
    let env = Env::new();
    let w = env.path("w");
    std::fs::create_dir_all(&w).unwrap();
    std::fs::copy(
        crate::harness::repo().join("guests/sqlite/work.sql"),
        w.join("work.sql"),
    )
    .unwrap();
    let mount = format!("{}::/w", w.display());
    let args = [
        "--dir",
        &mount,
        "--env",
        "HOME=/w",
        sqlite.to_str().unwrap(),
        "--",
        ":memory:",
        ".read /w/work.sql",
    ];
    let plain = env.plain(&args);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    assert!(
        String::from_utf8_lossy(&plain.stdout).starts_with("300000|1500910795|19\n"),
        "{}",
        String::from_utf8_lossy(&plain.stdout)
    );
    let churned = env.churn(&args, &["--dir", &mount], 4, 41, (60, 300));
    assert_same_run(&churned, &plain, 2);
}

/// The LZ4 library (scripts/fetch-programs.sh): fast and HC compression and decompression.
#[test]
fn lz4_compression_workload() {
    let g = cached_guest("lz4-bench.wasm", "scripts/fetch-programs.sh");
    check(&[g.to_str().unwrap(), "--", "8", "2"], 4, (60, 300), 43);
}

/// The Brotli library (scripts/fetch-programs.sh) at three qualities.
#[test]
fn brotli_compression_workload() {
    let g = cached_guest("brotli-bench.wasm", "scripts/fetch-programs.sh");
    check(&[g.to_str().unwrap(), "--", "2048", "4"], 4, (60, 250), 44);
}

/// The Lua 5.4 interpreter (scripts/fetch-programs.sh) running guests/lua/bench.lua: another
/// language runtime, suspended between and inside its bytecode loops.
#[test]
fn lua_interpreter_workload() {
    let g = cached_guest("lua.wasm", "scripts/fetch-programs.sh");
    let env = Env::new();
    let dir = env.path("lua");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        crate::harness::repo().join("guests/lua/bench.lua"),
        dir.join("bench.lua"),
    )
    .unwrap();
    let mount = format!("{}::/lua", dir.display());
    let args = [
        "--dir",
        &mount,
        g.to_str().unwrap(),
        "--",
        "/lua/bench.lua",
        "40",
    ];
    let plain = env.plain(&args);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    assert!(String::from_utf8_lossy(&plain.stdout).ends_with("done\n"));
    let churned = env.churn(&args, &["--dir", &mount], 5, 45, (60, 300));
    crate::harness::assert_same_run(&churned, &plain, 2);
}

/// `ferry -v COMMAND ARGS`, interrupted once its log has shown `n` pre-write passes that
/// stored chunks: (its stdout, its stderr, the snapshot κ).
fn suspend_after_pre_writes(env: &Env, command: &[&str], n: usize) -> (Vec<u8>, String, String) {
    use std::io::{BufRead, Read};
    let mut child = env
        .ferry()
        .arg("-v")
        .args(command)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn ferry");
    let mut stdout = child.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        stdout.read_to_end(&mut v).expect("read stdout");
        v
    });
    let mut lines = std::io::BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut err = String::new();
    let mut passes = 0;
    while passes < n {
        let Some(Ok(line)) = lines.next() else {
            panic!("the run ended after {passes} pre-write passes:\n{err}");
        };
        if line.contains("memory pre-written") && !line.contains(" stored=0 ") {
            passes += 1;
        }
        err.push_str(&line);
        err.push('\n');
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    for line in lines {
        err.push_str(&line.expect("stderr"));
        err.push('\n');
    }
    let status = child.wait().expect("wait ferry");
    assert_eq!(status.code(), Some(75), "not suspended:\n{err}");
    let k = err
        .lines()
        .find_map(|l| l.strip_prefix("suspended "))
        .expect("a `suspended κ` line")
        .to_owned();
    (reader.join().expect("stdout reader"), err, k)
}

/// Memory copied out of a running guest (`--pre-write`) and the writes made meanwhile make
/// snapshots that resume to exactly what an uninterrupted run prints — the fresh run's
/// memory, a restored one's, and one that grew. Every snapshot is checked against a full
/// hash of the memory (`FERRY_VERIFY_DIRTY`), so a missed write fails the suspend itself.
#[test]
fn pre_written_memory_resumes_to_the_same_output() {
    let env = Env::new();
    let g = guest("wasm/dirty.wasm");
    let args = [g.to_str().unwrap(), "--", "24", "30", "100"];
    let plain = env.plain(&args);
    assert_eq!(plain.code, 0);

    let mut run = vec!["run", "--pre-write", "20ms"];
    run.extend(args);
    let (mut stdout, err, k) = suspend_after_pre_writes(&env, &run, 3);
    assert!(err.contains("snapshot written"), "{err}");
    let (more, err, k) = suspend_after_pre_writes(&env, &["resume", "--pre-write", "20ms", &k], 3);
    stdout.extend(more);
    assert!(err.contains("snapshot written"), "{err}");
    // The interpreter keeps memory 0 in a reservation of ferry's own, which never moves: it
    // pre-writes too.
    let interp = ["resume", "--engine", "interp", "--pre-write", "20ms", &k];
    let (more, err, k) = suspend_after_pre_writes(&env, &interp, 3);
    stdout.extend(more);
    assert!(err.contains("snapshot written"), "{err}");
    let out = env
        .ferry()
        .args(["resume", &k])
        .output()
        .expect("spawn ferry");
    assert_eq!(out.status.code(), Some(0));
    stdout.extend(out.stdout);
    assert_eq!(
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&plain.stdout)
    );
}

/// With `--checkpoint-every`, a run copies the changed memory just before each checkpoint
/// while the guest runs (the guest then pauses only for what it wrote meanwhile), on either
/// engine; with `FERRY_PRE_WRITE_CHECKPOINTS=off` it checkpoints without. Every way every
/// checkpoint is taken and the output is the uninterrupted run's.
#[test]
fn checkpoints_are_pre_written_and_none_is_lost() {
    let env = Env::new();
    let g = guest("wasm/heap.wasm");
    let args = [g.to_str().unwrap(), "--", "16", "100"];
    let plain = env.plain(&args);
    for (engine, passes) in [
        ("jit", "on"),
        ("jit", "off"),
        ("interp", "on"),
        ("interp", "off"),
    ] {
        let out = env
            .ferry()
            .env("FERRY_PRE_WRITE_CHECKPOINTS", passes)
            .args([
                "-v",
                "run",
                "--engine",
                engine,
                "--checkpoint-every",
                "100ms",
            ])
            .args(args)
            .output()
            .expect("spawn ferry");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert_eq!(out.stdout, plain.stdout, "{engine}");
        let checkpoints = err
            .lines()
            .filter(|l| l.starts_with("ferry: checkpoint "))
            .count();
        assert!(
            checkpoints >= 2,
            "{engine}: {checkpoints} checkpoints\n{err}"
        );
        let pre_written = err
            .lines()
            .filter(|l| l.contains("memory pre-written") && l.contains("before_checkpoint=true"))
            .count();
        match passes {
            "on" => assert!(pre_written >= checkpoints, "{engine}: {err}"),
            _ => assert_eq!(pre_written, 0, "{engine}, passes {passes}: {err}"),
        }
    }
}

/// `--keep` deletes what no snapshot names right after each checkpoint, while pre-write
/// passes keep storing chunks: none the run still counts as the memory's is deleted, so every
/// snapshot's closure stays whole and the last one resumes.
#[test]
fn keep_and_pre_writing_leave_every_snapshot_whole() {
    let env = Env::new();
    let g = guest("wasm/dirty.wasm");
    let args = [g.to_str().unwrap(), "--", "16", "30", "200"];
    let plain = env.plain(&args);
    let mut run = vec![
        "run",
        "--pre-write",
        "2ms",
        "--checkpoint-every",
        "40ms",
        "--keep",
        "1",
    ];
    run.extend(args);
    let (stdout, k) = crate::harness::run_and_suspend_after_checkpoints(&env, &run[1..], 12);
    let (verified, err, code) = env.output(&["store", "verify"]);
    assert_eq!(code, 0, "{verified}{err}");
    let rest = crate::harness::resume_to_end(&env, &k);
    assert_eq!([stdout, rest].concat(), plain.stdout);
}

/// `--keep` prunes after each checkpoint while the mounts' settled files are being stored in
/// the background: a file whose objects a prune deleted before a snapshot named them is read
/// by the snapshot instead, so every snapshot's closure stays whole, and the last one,
/// resumed into an empty directory, gives back the files and finishes.
#[test]
fn keep_and_pre_stored_files_leave_every_snapshot_whole() {
    let env = Env::new();
    let g = guest("wasm/files.wasm");
    let (d, dir) = env.data_dir("data");
    for i in 0..6u32 {
        let data = crate::harness::varied_bytes((6 << 20) + i, i);
        std::fs::write(d.join(format!("big-{i}.bin")), data).unwrap();
    }
    // Settled, so the background store takes them.
    std::thread::sleep(std::time::Duration::from_millis(2100));
    let run = [
        "--checkpoint-every",
        "40ms",
        "--keep",
        "1",
        "--dir",
        &dir,
        g.to_str().unwrap(),
        "--",
        "/data",
        "300",
    ];
    let (_, k) = crate::harness::run_and_suspend_after_checkpoints(&env, &run, 8);
    let (verified, err, code) = env.output(&["store", "verify"]);
    assert_eq!(code, 0, "{verified}{err}");
    let fresh = env.path("fresh");
    let fresh_dir = format!("{}::/data", fresh.display());
    let (out, err, code) = env.output(&["resume", "--dir", &fresh_dir, &k]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("done "), "{out}");
    for i in 0..6 {
        let name = format!("big-{i}.bin");
        assert!(
            std::fs::read(fresh.join(&name)).unwrap() == std::fs::read(d.join(&name)).unwrap(),
            "{name} differs"
        );
    }
}

/// A guest updating pages of a big file in its mount, checkpointed every 100 ms: once a
/// snapshot has stored the file, the next ones read it again only in the pieces the guest
/// changed (`files_patched=1`, `files_read=0`), also those of the resumed run. The run,
/// suspended and resumed twice with checkpoints on, ends with the stdout and the file of an
/// uninterrupted run.
#[test]
fn a_big_file_updated_in_place_is_read_again_only_where_it_changed() {
    let env = Env::new();
    let g = guest("wasm/pages.wasm");
    let g = g.to_str().unwrap();
    let (plain_dir, pd) = env.data_dir("plain-data");
    let (churn_dir, cd) = env.data_dir("churn-data");
    let plain = env.plain(&["--dir", &pd, g, "--", "/data/db.bin", "16", "1500"]);
    assert_eq!(plain.code, 0);
    let every = ["-v", "--checkpoint-every", "100ms", "--dir", &cd];
    let mut run = every.to_vec();
    run.extend([g, "--", "/data/db.bin", "16", "1500"]);
    let (first, k) = suspend_after_output(&env, "run", &run, 900);
    let mut resume = every.to_vec();
    resume.push(&k);
    let (second, k) = suspend_after_output(&env, "resume", &resume, 900);
    let (rest, err, code) = env.output(&["resume", "--dir", &cd, &k]);
    assert_eq!(code, 0, "{err}");
    let mut seen = first.stdout.clone();
    seen.extend_from_slice(&second.stdout);
    seen.extend_from_slice(rest.as_bytes());
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain.stdout)
    );
    assert_eq!(dir_contents(&churn_dir), dir_contents(&plain_dir));
    // Only the run's first snapshot reads the file whole; the resumed run records the
    // guest's changes from its start (the store's import cache knows the file).
    for (out, whole) in [(&first, 1), (&second, 0)] {
        let log = String::from_utf8_lossy(&out.stderr);
        let written: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("snapshot written"))
            .collect();
        let read = written
            .iter()
            .filter(|l| l.contains("files_read=1"))
            .count();
        let patched = written
            .iter()
            .filter(|l| l.contains("files_patched=1"))
            .count();
        assert!(read == whole && patched >= 1, "{log}");
    }
}
