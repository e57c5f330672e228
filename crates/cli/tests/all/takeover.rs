//! Taking a space's session over from V8 (Node, a browser tab): the space lends the session,
//! the guest goes on there with its output in the session's log, and the session comes back
//! — suspended, ended, or reclaimed (which fences the copy it was lent to). In every case the
//! session's whole output and files are an uninterrupted run's, with nothing repeated.

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use ferry_space::SpaceClient;
use ferry_space::api::{ReturnRequest, State};

use crate::harness::{
    Env, SPACE_TOKEN, Seen, SpaceProc, dir_contents, guest, repo, suspended_kappa,
};
use crate::web::node;

/// `ferry --space URL run --session ID ARGS…` on the space, which must start it.
pub(crate) fn run_on(here: &Env, space: &SpaceProc, id: &str, args: &[&str]) {
    let mut all = vec!["--space", &space.url, "run", "--session", id];
    all.extend_from_slice(args);
    let (_, err, code) = here.output(&all);
    assert_eq!(code, 0, "{err}");
}

/// `node web/ferry-resume.mjs --session ID`, running.
fn take_over_in_v8(space: &SpaceProc, id: &str) -> Child {
    take_over_in_v8_with(space, id, &[])
}

fn take_over_in_v8_with(space: &SpaceProc, id: &str, extra: &[&str]) -> Child {
    take_over_by(Command::new(node()), space, id, extra)
}

/// `NODE web/ferry-resume.mjs --session ID EXTRA…`, running, its stdout and stderr piped.
pub(crate) fn take_over_by(
    mut node: Command,
    space: &SpaceProc,
    id: &str,
    extra: &[&str],
) -> Child {
    node.arg(repo().join("web/ferry-resume.mjs"))
        .args(["--space", &space.url, "--session", id])
        .args(extra)
        .env("FERRY_TOKEN", SPACE_TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn node")
}

pub(crate) fn interrupt(child: &Child) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
}

/// Waits until `pred` holds of the session's record (at most 30 s).
pub(crate) fn until(
    space: &SpaceProc,
    id: &str,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) {
    for _ in 0..600 {
        if space.session(id).as_ref().is_some_and(&pred) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("session {id} never {what}: {:?}", space.session(id));
}

/// The session's whole output, as `ferry --space URL logs` prints it: (stdout, stderr).
pub(crate) fn logs(here: &Env, space: &SpaceProc, id: &str) -> (String, String) {
    let (out, err, code) = here.output(&["--space", &space.url, "logs", id]);
    assert_eq!(code, 0, "{err}");
    (out, err)
}

/// Resumes a suspended session on its space and waits for its end: the exit code.
fn resume_and_wait(here: &Env, space: &SpaceProc, id: &str) -> i32 {
    let (_, err, code) = here.output(&["--space", &space.url, "resume", id]);
    assert_eq!(code, 0, "{err}");
    here.output(&["--space", &space.url, "wait", id]).2
}

/// The session's whole log is `plain`'s output: stdout and stderr, each line once.
fn same_log(here: &Env, space: &SpaceProc, id: &str, plain: &Seen) {
    let (stdout, stderr) = logs(here, space, id);
    assert_eq!(stdout, String::from_utf8_lossy(&plain.stdout), "{id}");
    assert_eq!(stderr, plain.stderr, "{id}");
}

/// Resumes the suspended session on its space: it ends as `plain` did (exit code and log).
pub(crate) fn resumed_ends_as(here: &Env, space: &SpaceProc, id: &str, plain: &Seen) {
    assert_eq!(resume_and_wait(here, space, id), plain.code, "{id}");
    same_log(here, space, id, plain);
}

pub(crate) fn check_files(
    here: &Env,
    space: &SpaceProc,
    id: &str,
    plain: &std::path::Path,
    what: &str,
) {
    let out = here.path(&format!("{id}-files"));
    let (_, err, code) = here.output(&[
        "--space",
        &space.url,
        "files",
        id,
        "--dir",
        &format!("{}::/data", out.display()),
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        dir_contents(&out),
        dir_contents(plain),
        "{what}: files differ"
    );
}

/// A session taken over while it runs and suspended in V8 (Ctrl-C) is given back suspended,
/// and goes on on its space: its log holds all it printed, once, and its files are an
/// uninterrupted run's. The second guest is checkpointed in V8 too, so what it gives back
/// goes on from its last checkpoint.
#[test]
fn a_session_taken_over_by_v8_and_suspended_there_goes_on_on_its_space() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let files = guest("wasm/files.wasm");
    let sleepy = guest("wasm/sleepy.wasm");
    for (id, args, ms, checkpoints) in [
        (
            "files",
            vec![files.to_str().unwrap(), "--", "/data", "600"],
            700,
            &[][..],
        ),
        (
            "sleepy",
            vec![sleepy.to_str().unwrap(), "--", "60", "3"],
            700,
            &["--checkpoint-every", "200", "-v"][..],
        ),
    ] {
        let (plain_dir, pd) = here.data_dir(&format!("{id}-plain"));
        let (_, sd) = here.data_dir(&format!("{id}-sent"));
        let plain = here.plain(&[&["--dir", &pd][..], &args].concat());
        run_on(&here, &space, id, &[&["--dir", &sd][..], &args].concat());
        std::thread::sleep(Duration::from_millis(300));
        let node = take_over_in_v8_with(&space, id, checkpoints);
        until(&space, id, "was lent", |s| s["state"] == "lent");
        let lent = space.session(id).unwrap();
        assert_eq!(lent["epoch"], 2, "{lent}");
        assert!(
            lent["lent_to"].as_str().unwrap().starts_with("node v24"),
            "{lent}"
        );
        std::thread::sleep(Duration::from_millis(ms));
        interrupt(&node);
        let out = node.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(75), "{id}: {err}");
        let k = suspended_kappa(&out);
        assert_eq!(
            err.contains("ferry: checkpoint blake3:"),
            !checkpoints.is_empty(),
            "{id}: {err}"
        );
        // It ran on the space while a checkpoint of it was pre-copied (-v says so).
        assert!(
            checkpoints.is_empty() || err.contains("ferry: pre-copied checkpoint blake3:"),
            "{id}: {err}"
        );
        let back = space.session(id).unwrap();
        assert_eq!(back["state"], "suspended", "{back}");
        assert_eq!(back["snapshot"], k.as_str());
        assert_eq!(back["epoch"], 2);
        assert!(back.get("lent_to").is_none(), "{back}");

        resumed_ends_as(&here, &space, id, &plain);
        check_files(&here, &space, id, &plain_dir, id);
    }
}

/// A session taken over runs to its end in V8: the space records its exit code, its whole
/// output and the files it left, as for a run that never left.
#[test]
fn a_session_taken_over_by_v8_ends_there_with_its_output_and_files() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let files = guest("wasm/files.wasm");
    let args = [files.to_str().unwrap(), "--", "/data", "300"];
    let (plain_dir, pd) = here.data_dir("plain");
    let (_, sd) = here.data_dir("sent");
    let plain = here.plain(&[&["--dir", &pd][..], &args].concat());
    run_on(&here, &space, "t", &[&["--dir", &sd][..], &args].concat());
    std::thread::sleep(Duration::from_millis(200));
    let out = take_over_in_v8(&space, "t").wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(plain.code),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = space.session("t").unwrap();
    assert_eq!(s["state"], "exited", "{s}");
    assert_eq!(s["exit_code"], plain.code);
    assert_eq!(s["epoch"], 2);
    let (stdout, _) = logs(&here, &space, "t");
    assert_eq!(stdout, String::from_utf8_lossy(&plain.stdout));
    // What V8 printed after the take-over is the end of it.
    assert!(stdout.ends_with(&*String::from_utf8_lossy(&out.stdout)));
    assert!(!out.stdout.is_empty());
    check_files(&here, &space, "t", &plain_dir, "ended in V8");
    // An ended session cannot be taken over.
    let again = take_over_in_v8(&space, "t").wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(65), "{err}");
    assert!(
        err.contains("is exited; only a running or suspended session can be taken over"),
        "{err}"
    );
}

/// While a session is lent the space neither runs, moves nor forgets it, and says where it
/// is; a reclaim brings it back at its last snapshot and fences the copy it was lent to,
/// which stops: the session's log then holds each line once.
#[test]
fn a_reclaimed_session_fences_the_copy_it_was_lent_to() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let other = SpaceProc::start(&[]);
    let sleepy = guest("wasm/sleepy.wasm");
    let args = [sleepy.to_str().unwrap(), "--", "400", "3"];
    let plain = here.plain(&args);
    run_on(&here, &space, "r", &args);
    std::thread::sleep(Duration::from_millis(200));
    let streamed = {
        let node = take_over_in_v8(&space, "r");
        until(&space, "r", "was lent", |s| s["state"] == "lent");
        let lent_log = logs(&here, &space, "r").1;
        // Its stderr goes on arriving from V8 (`logs` shows it).
        let mut streamed = lent_log.clone();
        for _ in 0..200 {
            streamed = logs(&here, &space, "r").1;
            if streamed.len() > lent_log.len() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(streamed.len() > lent_log.len(), "{streamed}");
        let (ps, _, _) = here.output(&["--space", &space.url, "ps"]);
        assert!(
            ps.lines()
                .any(|l| l.starts_with("r ") && l.contains(" lent ") && l.contains("lent to node")),
            "{ps}"
        );
        for cmd in [
            vec!["resume", "r"],
            vec!["suspend", "r"],
            vec!["kill", "r"],
            vec!["migrate", "r", "--to", &other.url],
            vec!["rm", "--force", "r"],
        ] {
            let (_, err, code) =
                here.output(&[&["--space", space.url.as_str()][..], &cmd].concat());
            assert_ne!(code, 0, "{cmd:?}");
            assert!(
                err.contains("is lent to node") && err.contains("reclaim r"),
                "{cmd:?}: {err}"
            );
        }
        let (out, err, code) = here.output(&["--space", &space.url, "reclaim", "r"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.starts_with("blake3:"), "{out}");
        let fenced = node.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&fenced.stderr);
        assert_eq!(fenced.status.code(), Some(69), "{err}");
        assert!(err.contains("is not lent at epoch 2"), "{err}");
        streamed
    };
    let s = space.session("r").unwrap();
    assert_eq!(s["state"], "suspended", "{s}");
    assert_eq!(s["epoch"], 3);
    assert!(
        s["reason"]
            .as_str()
            .unwrap()
            .contains("taken back from node")
    );
    // Cut back to the snapshot it was lent at: what V8 sent is gone.
    let cut = logs(&here, &space, "r").1;
    assert!(cut.len() < streamed.len(), "{cut}");
    assert!(plain.stderr.starts_with(&cut), "{cut}");
    let (_, err, code) = here.output(&["--space", &space.url, "reclaim", "r"]);
    assert_ne!(code, 0);
    assert!(err.contains("is suspended, not lent"), "{err}");

    resumed_ends_as(&here, &space, "r", &plain);
}

/// A space that restarts while its session is lent keeps it lent (it cut its log back to the
/// snapshot the session was lent at); the client sends its output again from there, and the
/// session comes back whole.
#[test]
fn a_lent_session_outlives_a_restart_of_its_space() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let mut space = SpaceProc::start(&[]);
    let sleepy = guest("wasm/sleepy.wasm");
    let args = [sleepy.to_str().unwrap(), "--", "150", "4"];
    let plain = here.plain(&args);
    run_on(&here, &space, "x", &args);
    std::thread::sleep(Duration::from_millis(200));
    let node = take_over_in_v8(&space, "x");
    until(&space, "x", "was lent", |s| s["state"] == "lent");
    std::thread::sleep(Duration::from_millis(700));
    space.stop();
    std::thread::sleep(Duration::from_millis(700));
    space.spawn(None);
    assert_eq!(space.state("x").as_deref(), Some("lent"));
    let out = node.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    same_log(&here, &space, "x", &plain);
}

/// The same move into a browser tab: the console's "Take over", then its Suspend button.
#[test]
fn a_session_taken_over_by_a_browser_tab_goes_on_on_its_space() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let sleepy = guest("wasm/sleepy.wasm");
    // Long enough (150 steps of 30 ms) that the guest is still running in the tab when the
    // suspend comes, even when a loaded machine makes the pre-copy and the tab slow.
    let args = [sleepy.to_str().unwrap(), "--", "150", "5"];
    let plain = here.plain(&args);
    run_on(&here, &space, "b", &args);
    std::thread::sleep(Duration::from_millis(200));
    let out: Output = Command::new(node())
        .arg(repo().join("web/browser.mjs"))
        .args([
            "--space",
            &space.url,
            "--session",
            "b",
            "--suspend-after",
            "300",
        ])
        .env("FERRY_TOKEN", SPACE_TOKEN)
        .output()
        .expect("spawn node");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{err}");
    let s = space.session("b").unwrap();
    assert_eq!(s["state"], "suspended", "{s}");
    assert_eq!(s["snapshot"], suspended_kappa(&out).as_str());
    resumed_ends_as(&here, &space, "b", &plain);
}

/// The protocol's checks, spoken directly: a holder's calls name its epoch; output goes on
/// from the log's end, once; what comes back must go on from what was lent.
#[test]
fn the_lending_protocol_checks_every_call() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let sleepy = guest("wasm/sleepy.wasm");
    run_on(
        &here,
        &space,
        "p",
        &[sleepy.to_str().unwrap(), "--", "400", "3"],
    );
    std::thread::sleep(Duration::from_millis(200));
    let c = SpaceClient::new(&space.url, SPACE_TOKEN);
    let lent = c.lend("p", "a test").unwrap();
    assert_eq!(lent.epoch, 2);
    assert_eq!(lent.session.state, State::Lent);
    assert_eq!(lent.session.lent_to.as_deref(), Some("a test"));
    let before = logs(&here, &space, "p");
    let e = c.lend("p", "another").unwrap_err();
    assert_eq!(e.status, 409);
    assert!(e.msg.contains("is lent to a test"), "{e}");

    let record = |s: &[u8]| {
        let mut v = vec![1u8];
        v.extend_from_slice(&(s.len() as u32).to_le_bytes());
        v.extend_from_slice(s);
        v
    };
    let hello = record(b"hello\n");
    let at = lent.log_len;
    let e = c.send_output("p", 1, at, &hello).unwrap_err();
    assert_eq!(e.status, 409);
    assert!(e.msg.contains("not lent at epoch 1"), "{e}");
    let e = c.send_output("p", 2, at + 10, &hello).unwrap_err();
    assert_eq!(e.status, 409);
    assert!(e.msg.contains(&format!("holds {at} bytes")), "{e}");
    let e = c.send_output("p", 2, at, &hello[..4]).unwrap_err();
    assert_eq!(e.status, 400, "{e}");
    let end = at + hello.len() as u64;
    assert_eq!(c.send_output("p", 2, at, &hello).unwrap(), end);
    // A retry appends nothing twice; other bytes at the same place are refused.
    assert_eq!(c.send_output("p", 2, at, &hello).unwrap(), end);
    assert_eq!(c.send_output("p", 2, at, &[]).unwrap(), end);
    let e = c.send_output("p", 2, at, &record(b"olleh\n")).unwrap_err();
    assert_eq!(e.status, 409);
    assert_eq!(logs(&here, &space, "p").0, format!("{}hello\n", before.0));

    let give = |r: ReturnRequest| c.give_back("p", &r);
    let e = give(ReturnRequest {
        epoch: 2,
        exit_code: Some(0),
        trap: Some("unreachable".into()),
        ..Default::default()
    })
    .unwrap_err();
    assert_eq!(e.status, 400, "{e}");
    let e = give(ReturnRequest {
        epoch: 2,
        exit_code: Some(0),
        log_len: Some(at),
        ..Default::default()
    })
    .unwrap_err();
    assert_eq!(e.status, 409);
    assert!(e.msg.contains("send the rest first"), "{e}");
    // The snapshot it was lent at does not go on from itself.
    let e = give(ReturnRequest {
        epoch: 2,
        snapshot: Some(lent.snapshot.clone()),
        ..Default::default()
    })
    .unwrap_err();
    assert_eq!(e.status, 422);
    assert!(e.msg.contains("does not go on from"), "{e}");
    // One that goes on from it but is of another program (here: its module replaced by the
    // instrumented one, a module the store has) is not the session's continuation.
    use ferry_store::Store as _;
    let store = ferry_space::RemoteStore::new(&space.url, SPACE_TOKEN);
    let lent_k: ferry_kappa::Kappa = lent.snapshot.parse().unwrap();
    let mut other: ferry_object::Snapshot =
        ferry_object::decode(&store.get(&lent_k).unwrap()).unwrap();
    other.parent = Some(lent_k);
    other.module = other.instrumented;
    let other = store.put(&ferry_object::encode(&other)).unwrap();
    for snapshot in [Some(other.to_string()), None] {
        let e = match snapshot {
            Some(s) => give(ReturnRequest {
                epoch: 2,
                snapshot: Some(s),
                ..Default::default()
            }),
            None => c.checkpointed(
                "p",
                &ferry_space::api::CheckpointedRequest {
                    epoch: 2,
                    snapshot: other.to_string(),
                },
            ),
        }
        .unwrap_err();
        assert_eq!(e.status, 422);
        assert!(
            e.msg.contains("is of another module than session `p`"),
            "{e}"
        );
    }
    // A checkpoint must go on from the session's last snapshot too, and name the epoch.
    let checkpoint = |epoch| {
        let req = ferry_space::api::CheckpointedRequest {
            epoch,
            snapshot: lent.snapshot.clone(),
        };
        c.checkpointed("p", &req).unwrap_err()
    };
    let e = checkpoint(2);
    assert_eq!(e.status, 422);
    assert!(e.msg.contains("does not go on from"), "{e}");
    assert_eq!(checkpoint(1).status, 409);
    // Never run there: back as it was lent, the output sent since gone.
    let s = give(ReturnRequest {
        epoch: 2,
        refused: Some("no engine here".into()),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(s.state, State::Suspended);
    assert_eq!(s.snapshot.as_deref(), Some(lent.snapshot.as_str()));
    assert!(
        s.reason
            .as_deref()
            .unwrap()
            .contains("a test could not resume it: no engine here"),
        "{s:?}"
    );
    assert_eq!(logs(&here, &space, "p"), before);

    // Lent again (epoch 3) and reclaimed (epoch 4): the old holder is fenced.
    assert_eq!(c.lend("p", "").unwrap().epoch, 3);
    assert_eq!(c.reclaim("p").unwrap().epoch, 4);
    let e = give(ReturnRequest {
        epoch: 3,
        exit_code: Some(0),
        log_len: Some(at),
        ..Default::default()
    })
    .unwrap_err();
    assert_eq!(e.status, 409);
    assert!(e.msg.contains("fenced"), "{e}");
    assert_eq!(resume_and_wait(&here, &space, "p"), 3);
}

/// A client checkpoints the session it holds (`--checkpoint-every`): the space's last
/// snapshot moves on while it is lent, so a reclaim after the client died loses only what
/// came after the last checkpoint — and the output is still an uninterrupted run's.
#[test]
fn a_reclaim_goes_back_to_the_holders_last_checkpoint() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let sleepy = guest("wasm/sleepy.wasm");
    let args = [sleepy.to_str().unwrap(), "--", "300", "3"];
    let plain = here.plain(&args);
    run_on(&here, &space, "c", &args);
    std::thread::sleep(Duration::from_millis(200));
    let mut node = Command::new(node())
        .arg(repo().join("web/ferry-resume.mjs"))
        .args([
            "--space",
            &space.url,
            "--session",
            "c",
            "--checkpoint-every",
            "300",
        ])
        .env("FERRY_TOKEN", SPACE_TOKEN)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn node");
    until(&space, "c", "was lent", |s| s["state"] == "lent");
    let lent = space.session("c").unwrap()["snapshot"].clone();
    let lent_log = logs(&here, &space, "c").1;
    // Two checkpoints on from the lent snapshot, each recorded while it stays lent.
    let mut seen = vec![lent.clone()];
    for _ in 0..400 {
        let s = space.session("c").unwrap();
        assert_eq!(s["state"], "lent", "{s}");
        if !seen.contains(&s["snapshot"]) {
            seen.push(s["snapshot"].clone());
        }
        if seen.len() >= 3 {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert!(seen.len() >= 3, "no checkpoints: {seen:?}");
    node.kill().unwrap();
    node.wait().unwrap();
    let (out, err, code) = here.output(&["--space", &space.url, "reclaim", "c"]);
    assert_eq!(code, 0, "{err}");
    let back = space.session("c").unwrap();
    assert_eq!(out.trim(), back["snapshot"].as_str().unwrap());
    assert_ne!(
        back["snapshot"], lent,
        "back at the lent snapshot: the checkpoints were lost"
    );
    let cut = logs(&here, &space, "c").1;
    assert!(cut.len() > lent_log.len(), "{cut}");
    resumed_ends_as(&here, &space, "c", &plain);
}

/// Taken with a lease, a session stays lent while its client speaks — here a guest that prints
/// nothing, so only the client's keep-alive speaks — and comes back by itself once the
/// client is gone for longer than the lease.
#[test]
fn a_session_comes_back_when_its_lease_runs_out() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let spin = here.path("spin.wat");
    std::fs::write(
        &spin,
        r#"(module
  (memory (export "memory") 1)
  (global $n (mut i64) (i64.const 0))
  (func (export "_start")
    (loop $again
      (global.set $n (i64.add (global.get $n) (i64.const 1)))
      (br_if $again (i64.lt_u (global.get $n) (i64.const 100000000000))))))"#,
    )
    .unwrap();
    run_on(&here, &space, "l", &[spin.to_str().unwrap()]);
    let mut node = take_over_in_v8_with(&space, "l", &["--lease", "1"]);
    until(&space, "l", "was lent", |s| s["state"] == "lent");
    assert_eq!(space.session("l").unwrap()["lease_ms"], 1000);
    std::thread::sleep(Duration::from_millis(3000));
    let s = space.session("l").unwrap();
    assert_eq!(
        s["state"], "lent",
        "the lease ran out while the client spoke: {s}"
    );
    node.kill().unwrap();
    node.wait().unwrap();
    until(&space, "l", "came back", |s| s["state"] == "suspended");
    let s = space.session("l").unwrap();
    assert_eq!(s["epoch"], 3, "{s}");
    assert!(
        s["reason"]
            .as_str()
            .unwrap()
            .starts_with("the lease of node"),
        "{s}"
    );
    assert!(s.get("lease_ms").is_none(), "{s}");
    // Resumable where it is.
    let (_, err, code) = here.output(&["--space", &space.url, "resume", "l"]);
    assert_eq!(code, 0, "{err}");
    let (_, err, code) = here.output(&["--space", &space.url, "kill", "l"]);
    assert_eq!(code, 0, "{err}");
}

/// A space whose policy file does not say `lend = true` keeps its sessions: taking one over
/// is refused with the reason, and the session runs on.
#[test]
fn a_space_lends_only_where_its_policy_says_so() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let policy = here.path("policy.toml");
    std::fs::write(&policy, "version = 1\n").unwrap();
    let space = SpaceProc::start(&["--policy", policy.to_str().unwrap()]);
    let sleepy = guest("wasm/sleepy.wasm");
    run_on(
        &here,
        &space,
        "n",
        &[sleepy.to_str().unwrap(), "--", "100", "3"],
    );
    let out = take_over_in_v8(&space, "n").wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(65), "{err}");
    assert!(
        err.contains("does not let sessions be taken over") && err.contains("lend = true"),
        "{err}"
    );
    // Refused before any pre-copy: no checkpoint was taken.
    let s = space.session("n").unwrap();
    assert_eq!(s["state"], "running", "{s}");
    assert!(s.get("snapshot").is_none(), "{s}");
    assert_eq!(here.output(&["--space", &space.url, "wait", "n"]).2, 3);
}
