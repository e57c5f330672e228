//! Interactive sessions of a space (`ferry --space URL run --interactive`, `attach`;
//! docs/migration.md, "Interactive sessions"): input typed while the guest runs reaches it
//! once and in order, whatever happens to the session meanwhile — a move to another space,
//! a suspend (input sent while it is suspended is kept), a crash of its space — and the
//! output shown is an uninterrupted run's.

use std::io::{Read, Write};
use std::process::{Child, Stdio};

use crate::harness::{Env, SpaceProc, guest};
use crate::migrate::{cli, client, eventually, ok, refused};

/// Lines for the `lines` guest, `from..to`.
fn lines(from: usize, to: usize) -> String {
    (from..to)
        .map(|i| format!("{i:02} {}\n", "y".repeat(i % 17)))
        .collect()
}

/// What a local run of the `lines` guest (`g`) prints fed lines `0..n` (it must exit 0).
fn plain_run(here: &Env, g: &str, n: usize) -> Vec<u8> {
    let all = here.path("all.txt");
    std::fs::write(&all, lines(0, n)).unwrap();
    let plain = client().with_stdin(all).plain(&[g]);
    assert_eq!(plain.code, 0);
    plain.stdout
}

/// `ferry --space URL run --interactive ARGS`, its stdin a pipe the test writes to and its
/// stdout read on a thread of its own.
fn attached(here: &Env, space: &str, args: &[&str]) -> (Child, std::thread::JoinHandle<Vec<u8>>) {
    let mut c = here.ferry();
    c.args(["--space", space]).args(args);
    c.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = c.spawn().unwrap();
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        out.read_to_end(&mut all).unwrap();
        all
    });
    (child, reader)
}

/// Whether session `id`'s output on `space` shows `what`.
fn shows(here: &Env, space: &str, id: &str, what: &str) -> bool {
    let (out, _, _) = cli(here, space, &["logs", id]);
    out.contains(what)
}

/// Input typed into `run --interactive` reaches the guest once and in order while the
/// session moves to another space (input in flight is sent again there), is suspended
/// (input sent meanwhile waits for the resume) and its space crashes (input the space took
/// is kept on its disk and read after the resume); ending the input ends the guest, and what
/// `run --interactive` printed, like `logs`, is what a local run fed the same lines prints.
#[test]
fn input_typed_into_an_interactive_session_reaches_it_once_through_moves_suspends_and_crashes() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let mut b = SpaceProc::start(&[]);
    let g = guest("wasm/lines.wasm");
    let g = g.to_str().unwrap();
    let plain = plain_run(&here, g, 50);
    assert!(String::from_utf8_lossy(&plain).ends_with("done 50 lines\n"));

    let (mut child, reader) = attached(&here, &a.url, &["run", "-i", "--session", "i", g]);
    let mut typed = child.stdin.take().unwrap();
    typed.write_all(lines(0, 10).as_bytes()).unwrap();
    eventually("it reads the first lines", || {
        shows(&here, &a.url, "i", "line 10:")
    });
    let info = a.session("i").unwrap();
    assert_eq!(info["interactive"], true, "{info}");

    // Typed just before a move: whatever A had not taken is sent again to B.
    typed.write_all(lines(10, 20).as_bytes()).unwrap();
    ok(&here, &a.url, &["migrate", "i", "--to", &b.url]);
    typed.write_all(lines(20, 30).as_bytes()).unwrap();
    eventually("it reads on at B", || shows(&here, &b.url, "i", "line 30:"));

    // Suspended: what is typed meanwhile is taken, and read once it runs again.
    ok(&here, &b.url, &["suspend", "i"]);
    typed.write_all(lines(30, 40).as_bytes()).unwrap();
    eventually("B has taken the input sent while suspended", || {
        std::fs::read(b.env.store().join("space/stdin/i"))
            .is_ok_and(|d| d.ends_with(lines(39, 40).as_bytes()))
    });
    assert!(!shows(&here, &b.url, "i", "line 31:"));
    ok(&here, &b.url, &["resume", "i"]);
    eventually("it reads what was sent while it was suspended", || {
        shows(&here, &b.url, "i", "line 40:")
    });

    // B crashes after taking more input: its disk kept it.
    typed.write_all(lines(40, 45).as_bytes()).unwrap();
    eventually("B has taken the input", || {
        std::fs::read(b.env.store().join("space/stdin/i"))
            .is_ok_and(|d| d.ends_with(lines(44, 45).as_bytes()))
    });
    b.stop();
    b.spawn(None);
    assert_eq!(b.state("i").as_deref(), Some("suspended"));
    ok(&here, &b.url, &["resume", "i"]);
    typed.write_all(lines(45, 50).as_bytes()).unwrap();
    // The end of the typed input ends the guest's.
    drop(typed);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    let shown = reader.join().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&shown),
        String::from_utf8_lossy(&plain),
        "each line read once, in order"
    );
    let (out, _, _) = cli(&here, &b.url, &["logs", "i"]);
    assert_eq!(out.as_bytes(), &plain[..]);
    let (out, _, _) = cli(&here, &a.url, &["logs", "i"]);
    assert_eq!(out.as_bytes(), &plain[..], "read on where it moved");
    // Ended: no more input is taken, and `attach` says why.
    let err = refused(&here, &b.url, &["attach", "i"]);
    assert!(err.contains("has ended (exited)"), "{err}");
}

/// Ctrl-C detaches `run --interactive` and leaves the session running with its input open;
/// `attach --keep-open` sends more and leaves it open when its own input ends; a last
/// `attach` ends it, and the guest ends as a local run fed the same lines does.
#[test]
fn detached_and_attached_again_the_input_goes_on_where_it_was() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let g = guest("wasm/lines.wasm");
    let g = g.to_str().unwrap();
    let plain = plain_run(&here, g, 15);

    let (mut child, reader) = attached(&here, &a.url, &["run", "-i", "--session", "d", g]);
    let mut typed = child.stdin.take().unwrap();
    typed.write_all(lines(0, 5).as_bytes()).unwrap();
    eventually("it reads them", || shows(&here, &a.url, "d", "line 5:"));
    // SAFETY: kill(2) on the pid of a child this test started and has not waited for.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    child.wait().unwrap();
    drop(typed);
    reader.join().unwrap();
    assert_eq!(
        a.state("d").as_deref(),
        Some("running"),
        "detaching ends nothing"
    );

    // Its own input ends, the session's stays open: the guest waits, and so does `attach`.
    let (mut child, reader) = attached(&here, &a.url, &["attach", "d", "--keep-open"]);
    let mut typed = child.stdin.take().unwrap();
    typed.write_all(lines(5, 10).as_bytes()).unwrap();
    drop(typed);
    eventually("it reads them", || shows(&here, &a.url, "d", "line 10:"));
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the session's input was ended"
    );
    assert_eq!(a.state("d").as_deref(), Some("running"));
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    child.wait().unwrap();
    reader.join().unwrap();

    // The last attach ends the input; it shows the whole output and exits with the guest.
    let (mut child, reader) = attached(&here, &a.url, &["attach", "d"]);
    let mut typed = child.stdin.take().unwrap();
    typed.write_all(lines(10, 15).as_bytes()).unwrap();
    drop(typed);
    assert_eq!(child.wait().unwrap().code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&reader.join().unwrap()),
        String::from_utf8_lossy(&plain)
    );
}

/// An interactive session with a standby (`run -i --standby`): its space answers for each
/// piece of input only once the standby holds it too — the first piece, finding no copy
/// there yet, has a checkpoint taken that gives it one; after a move the new owner forwards
/// to the standby that followed; a new standby (`standby --to`) is given all the input
/// before etcd names it. Answers are shown at once: a guest waiting for input after writing
/// output has a checkpoint taken. The owner killed after taking input that no snapshot
/// holds (while suspended), the standby takes the session over and reads on in that input,
/// the rest typed goes there, and `run -i` prints what a local run fed the same lines
/// prints.
#[test]
fn an_interactive_session_with_a_standby_loses_no_input_when_its_space_dies() {
    let Some(etcd) = crate::harness::Etcd::start() else {
        return;
    };
    let here = client();
    let fleet = ["--etcd", etcd.url.as_str(), "--lease-ttl", "2s"];
    let a = SpaceProc::start(&fleet);
    let b = SpaceProc::start(&fleet);
    let mut c = SpaceProc::start(&fleet);
    let g = guest("wasm/lines.wasm");
    let g = g.to_str().unwrap();
    let plain = plain_run(&here, g, 40);
    // Checkpoints only when asked for: input typed after the last one is in none.
    let (mut child, reader) = attached(
        &here,
        &a.url,
        &[
            "run",
            "-i",
            "--session",
            "s",
            "--checkpoint-every",
            "600s",
            "--standby",
            &b.url,
            g,
        ],
    );
    let holds = |s: &SpaceProc, upto: usize| {
        std::fs::read(s.env.store().join("space/stdin/s"))
            .is_ok_and(|d| d == lines(0, upto).as_bytes())
    };
    let mut typed = child.stdin.take().unwrap();
    typed.write_all(lines(0, 10).as_bytes()).unwrap();
    eventually("the standby holds the input", || holds(&b, 10));
    assert_eq!(b.state("s").as_deref(), Some("standby"));
    // Its output is shown once the standby holds a checkpoint covering it: the guest
    // waiting for more input after writing it has one taken at once.
    eventually(
        "the answers are shown long before a periodic checkpoint",
        || shows(&here, &a.url, "s", "line 10:"),
    );

    // Moved to C, the standby following: C forwards the input to it.
    ok(&here, &a.url, &["migrate", "s", "--to", &c.url]);
    typed.write_all(lines(10, 20).as_bytes()).unwrap();
    eventually("the standby holds the input C took", || holds(&b, 20));
    eventually("C shows the answers", || {
        shows(&here, &c.url, "s", "line 20:")
    });

    // Another standby, A (which the session moved away from): it holds all the input before
    // etcd names it; the old one lets go.
    ok(&here, &c.url, &["standby", "s", "--to", &a.url]);
    assert!(holds(&a, 20));
    eventually("the old standby drops its copy", || b.state("s").is_none());

    // Suspended, it takes input that no snapshot holds: the standby holds it too.
    ok(&here, &c.url, &["suspend", "s"]);
    let suspended = c.session("s").unwrap()["snapshot"].clone();
    eventually("the standby holds the suspended session", || {
        a.session("s").unwrap()["snapshot"] == suspended
    });
    typed.write_all(lines(20, 30).as_bytes()).unwrap();
    eventually("the new standby holds the input", || holds(&a, 30));
    assert_eq!(a.session("s").unwrap()["snapshot"], suspended);

    // The owner dies: the standby takes the session over (suspended, as it was) and, once
    // resumed, reads on in all of it; the rest typed goes there.
    c.stop();
    eventually("the standby takes the session over", || {
        a.state("s").as_deref() == Some("suspended")
    });
    ok(&here, &a.url, &["resume", "s"]);
    typed.write_all(lines(30, 40).as_bytes()).unwrap();
    drop(typed);
    let end = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > end {
            child.kill().unwrap();
            panic!(
                "run -i did not end; the session at its standby: {}",
                a.session("s").unwrap()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&reader.join().unwrap()),
        String::from_utf8_lossy(&plain),
        "each line read once, in order"
    );
    assert_eq!(
        etcd.owner("s"),
        Some(serde_json::json!({"space": a.url, "epoch": 3}))
    );
    assert_eq!(a.state("s").as_deref(), Some("exited"));
    let (out, _, _) = cli(&here, &a.url, &["logs", "s"]);
    assert_eq!(out.as_bytes(), &plain[..]);
}

/// Lines of 150 to 200 bytes for the `lines` guest, `from..to`.
fn long_lines(from: usize, to: usize) -> String {
    (from..to)
        .map(|i| format!("{i:05} {}\n", "z".repeat(144 + i % 50)))
        .collect()
}

/// Writes what is sent on the channel to `stdin`, in order, on a thread of its own (closing
/// it when the sender is dropped): a megabyte of input fills the pipe, and a session that
/// stopped taking it must make the test time out in `eventually`, not block in a write.
fn typist(mut stdin: std::process::ChildStdin) -> std::sync::mpsc::Sender<String> {
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for s in rx {
            if stdin.write_all(s.as_bytes()).is_err() {
                return;
            }
        }
    });
    tx
}

/// The stdin the snapshot of session `id` at `space` carries, as `inspect --json` tells it
/// (the snapshot pulled into `here`'s store).
fn carried_stdin(here: &Env, space: &crate::harness::SpaceProc, id: &str) -> serde_json::Value {
    let k = space.snapshot(id);
    let (_, err, code) = here.output(&["pull", &k, "--from", &space.url]);
    assert_eq!(code, 0, "{err}");
    here.inspect_json(&k)["stdio"].clone()
}

/// Input over 1 MiB is carried in 1 MiB pieces (`stdin_chunked`), so each snapshot stores
/// only what is new: the guest reads on in it, line by line and once, through a checkpoint,
/// a move, a suspend, and a local `ferry resume` of the pulled snapshot that reads the rest
/// from its own stdin — what it prints, after what the session printed, is a plain run's.
#[test]
fn input_over_1_mib_travels_in_pieces_and_is_read_once() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let b = SpaceProc::start(&[]);
    let g = guest("wasm/lines.wasm");
    let g = g.to_str().unwrap();
    let all = here.path("all.txt");
    std::fs::write(&all, long_lines(0, 24_000)).unwrap();
    let plain = client().with_stdin(all).plain(&[g, "0"]);
    assert_eq!(plain.code, 0);
    assert!(String::from_utf8_lossy(&plain.stdout).ends_with("done 24000 lines\n"));

    let (mut child, reader) = attached(
        &here,
        &a.url,
        &["run", "-i", "--session", "big", g, "--", "0"],
    );
    let typed = typist(child.stdin.take().unwrap());
    typed.send(long_lines(0, 4_000)).unwrap();
    eventually("it reads the first lines", || {
        shows(&here, &a.url, "big", "line 4000:")
    });
    // Under 1 MiB: one blob.
    ok(&here, &a.url, &["checkpoint", "big"]);
    let wasi = carried_stdin(&here, &a, "big");
    assert_eq!(wasi["stdin_open"], true, "{wasi}");
    assert_eq!(wasi["stdin_chunked"], false, "{wasi}");

    typed.send(long_lines(4_000, 10_000)).unwrap();
    eventually("it reads on", || shows(&here, &a.url, "big", "line 10000:"));
    ok(&here, &a.url, &["checkpoint", "big"]);
    let wasi = carried_stdin(&here, &a, "big");
    assert_eq!(wasi["stdin_chunked"], true, "{wasi}");

    typed.send(long_lines(10_000, 14_000)).unwrap();
    ok(&here, &a.url, &["migrate", "big", "--to", &b.url]);
    typed.send(long_lines(14_000, 18_000)).unwrap();
    eventually("it reads on at B", || {
        shows(&here, &b.url, "big", "line 18000:")
    });
    ok(&here, &b.url, &["suspend", "big"]);
    // SAFETY: kill(2) on the pid of a child this test started and has not waited for.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    child.wait().unwrap();
    drop(typed);
    let shown = reader.join().unwrap();
    let wasi = carried_stdin(&here, &b, "big");
    assert_eq!(wasi["stdin_chunked"], true, "{wasi}");
    assert_eq!(wasi["stdin_open"], true, "{wasi}");

    // Resumed here (`carried_stdin` pulled the suspended snapshot): what was sent is read on
    // from where the guest was, then this ferry's own stdin.
    let k = b.snapshot("big");
    let (before, _, _) = cli(&here, &b.url, &["logs", "big"]);
    let rest = here.path("rest.txt");
    std::fs::write(&rest, long_lines(18_000, 24_000)).unwrap();
    let local = here.with_stdin(rest);
    let (after, err, code) = local.output(&["resume", &k]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        format!("{before}{after}"),
        String::from_utf8_lossy(&plain.stdout),
        "each line read once, in order"
    );
    assert!(
        String::from_utf8_lossy(&plain.stdout).starts_with(&*String::from_utf8_lossy(&shown)),
        "run -i showed the session's output"
    );
}

/// What is refused: `--interactive` locally and with a standby outside a fleet, attaching to
/// a session that takes no input, and input to an unknown session.
#[test]
fn interactive_refusals_say_why() {
    let here = client();
    let a = SpaceProc::start(&[]);
    let g = guest("wasm/lines.wasm");
    let g = g.to_str().unwrap();
    let (_, err, code) = here.output(&["run", "-i", g]);
    assert_eq!(code, 1);
    assert!(
        err.contains("--interactive is for runs on a space"),
        "{err}"
    );
    let err = refused(
        &here,
        &a.url,
        &[
            "run",
            "-i",
            "--checkpoint-every",
            "1s",
            "--standby",
            "auto",
            g,
        ],
    );
    assert!(err.contains("needs a fleet"), "{err}");
    ok(&here, &a.url, &["run", "--session", "plain", g]);
    let err = refused(&here, &a.url, &["attach", "plain"]);
    assert!(err.contains("takes no input"), "{err}");
    let err = refused(&here, &a.url, &["attach", "nosuch"]);
    assert!(err.contains("no session `nosuch`"), "{err}");
}

/// A guest that prints ten lines `NN xxx…` of random lengths (0–255 `x`), then reads a line
/// of input, and again until its input ends.
const RANDOM_LINES: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_read" (func $r (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "random_get" (func $rand (param i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func $line (param $i i32) (local $n i32) (local $p i32)
    (drop (call $rand (i32.const 16) (i32.const 1)))
    (local.set $n (i32.load8_u (i32.const 16)))
    (i32.store8 (i32.const 1024) (i32.add (i32.const 48) (i32.div_u (local.get $i) (i32.const 10))))
    (i32.store8 (i32.const 1025) (i32.add (i32.const 48) (i32.rem_u (local.get $i) (i32.const 10))))
    (i32.store8 (i32.const 1026) (i32.const 32))
    (local.set $p (i32.const 1027))
    (block $done
      (loop $fill
        (br_if $done (i32.ge_u (local.get $p) (i32.add (i32.const 1027) (local.get $n))))
        (i32.store8 (local.get $p) (i32.const 120))
        (local.set $p (i32.add (local.get $p) (i32.const 1)))
        (br $fill)))
    (i32.store8 (local.get $p) (i32.const 10))
    (i32.store (i32.const 0) (i32.const 1024))
    (i32.store (i32.const 4) (i32.sub (i32.add (local.get $p) (i32.const 1)) (i32.const 1024)))
    (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8))))
  (func $wait (result i32)
    (i32.store (i32.const 0) (i32.const 32))
    (i32.store (i32.const 4) (i32.const 1))
    (block $eof
      (loop $more
        (drop (call $r (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 8)))
        (br_if $eof (i32.eqz (i32.load (i32.const 8))))
        (br_if $more (i32.ne (i32.load8_u (i32.const 32)) (i32.const 10)))
        (return (i32.const 1))))
    (i32.const 0))
  (func (export "_start") (local $i i32) (local $end i32)
    (loop $batches
      (local.set $end (i32.add (local.get $i) (i32.const 10)))
      (loop $ten
        (call $line (local.get $i))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br_if $ten (i32.lt_u (local.get $i) (local.get $end))))
      (br_if $batches (call $wait)))))"#;

/// Bytes of the output log that hold `lines` (one record of 5 header bytes per line).
fn log_bytes(lines: &[&str]) -> usize {
    lines.iter().map(|l| 5 + l.len() + 1).sum()
}

/// The output a session showed past its last snapshot is redone after its space crashes, and
/// a guest that does not repeat itself (here: lines of random lengths) redoes it otherwise.
/// The attached `run -i` had shown the first run's lines, so where it stands may fall inside
/// a record of the new run: it then goes on at the next whole record of the redone log,
/// saying so — never a piece of a record — and ends with the guest. (Before, a reader placed
/// inside a record was answered nothing at once, over and over, and showed nothing more.)
#[test]
fn output_redone_otherwise_after_a_crash_is_followed_from_its_next_record() {
    let here = client();
    let mut a = SpaceProc::start(&[]);
    let m = here.path("random-lines.wat");
    std::fs::write(&m, RANDOM_LINES).unwrap();
    let mut child = here
        .ferry()
        .args(["--space", &a.url, "run", "-i", "--session", "rl"])
        .arg(&m)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut typed = child.stdin.take().unwrap();
    let shown = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let reader = {
        let (mut out, shown) = (child.stdout.take().unwrap(), shown.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = out.read(&mut buf) {
                shown.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        })
    };
    let err_reader = {
        let mut err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut all = String::new();
            err.read_to_string(&mut all).unwrap();
            all
        })
    };
    let shown_lines = |n: usize| {
        let s = shown.clone();
        move || s.lock().unwrap().iter().filter(|&&b| b == b'\n').count() >= n
    };
    let url = a.url.clone();
    let log = |here: &Env| cli(here, &url, &["logs", "rl"]).0;
    eventually("it shows the first ten lines", shown_lines(10));
    ok(&here, &a.url, &["checkpoint", "rl"]);
    typed.write_all(b"go\n").unwrap();
    eventually("it shows ten more, past the checkpoint", shown_lines(20));
    let first_run = log(&here);
    assert_eq!(first_run.lines().count(), 20, "{first_run}");
    // Where the attached reader stands in the log.
    let at = log_bytes(&first_run.lines().collect::<Vec<_>>());

    a.stop();
    a.spawn(None);
    assert_eq!(a.state("rl").as_deref(), Some("suspended"));
    ok(&here, &a.url, &["resume", "rl"]);
    typed.write_all(b"go\n").unwrap();
    drop(typed);
    let status = child.wait().unwrap();
    reader.join().unwrap();
    let err = err_reader.join().unwrap();
    assert_eq!(status.code(), Some(0), "{err}");

    // The log holds the second run: ten lines from the snapshot, ten redone, ten new.
    let second_run = log(&here);
    let lines: Vec<&str> = second_run.lines().collect();
    assert_eq!(lines.len(), 30, "{second_run}");
    assert_eq!(lines[..10], first_run.lines().collect::<Vec<_>>()[..10]);
    // The reader goes on at the first record boundary of the new log at or past `at` (if
    // the new log ends before, it shows nothing more).
    let k = (0..=lines.len()).find(|&k| log_bytes(&lines[..k]) >= at);
    let mut expected = first_run.clone();
    for l in &lines[k.unwrap_or(lines.len())..] {
        expected.push_str(l);
        expected.push('\n');
    }
    let shown = String::from_utf8(shown.lock().unwrap().clone()).unwrap();
    assert_eq!(shown, expected, "{err}");
    // Unless the redone lines happen to end exactly there, the reader says it skipped.
    assert_eq!(
        err.contains("came out otherwise when the guest redid it"),
        k.is_some_and(|k| log_bytes(&lines[..k]) != at),
        "{err}"
    );
}
