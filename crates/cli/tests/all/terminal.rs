//! ferry on a terminal: a pseudo-terminal that is the controlling terminal of a new session,
//! with ferry's stdin, stdout and stderr on it — as in a terminal window or over ssh.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Child;
use std::time::{Duration, Instant};

use crate::harness::{Env, guest};

/// `ferry ARGS` on a fresh pseudo-terminal; `term` is the other end (what a terminal window
/// shows and types).
struct OnTerminal {
    child: Child,
    term: File,
}

impl OnTerminal {
    fn spawn(env: &Env, args: &[&str]) -> Self {
        let (mut master, mut slave) = (0, 0);
        // SAFETY: openpty fills in two descriptors we then own.
        let r = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "openpty");
        for fd in [master, slave] {
            // Not inherited (ferry holding the other end open would keep the terminal from
            // ever hanging up), and the terminal end is read without blocking.
            // SAFETY: flags on descriptors we own.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        // SAFETY: as above.
        unsafe { libc::fcntl(master, libc::F_SETFL, libc::O_NONBLOCK) };
        // SAFETY: both are open descriptors owned from here on.
        let (master, slave) =
            unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        let mut cmd = env.ferry();
        cmd.args(args)
            .stdin(slave.try_clone().unwrap())
            .stdout(slave.try_clone().unwrap())
            .stderr(slave.try_clone().unwrap());
        // SAFETY: between fork and exec only async-signal-safe calls: a new session whose
        // controlling terminal is the pty.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        Self {
            child,
            term: File::from(master),
        }
    }

    /// What the terminal shows for `d` (reading keeps a guest that writes from blocking).
    fn read_for(&mut self, d: Duration) -> Vec<u8> {
        self.read_while(|_| true, d)
    }

    /// What the terminal shows until it ends with `want` (or 30 s pass: then it panics).
    fn read_until(&mut self, want: &[u8]) -> Vec<u8> {
        let seen = self.read_while(|seen| !seen.ends_with(want), Duration::from_secs(30));
        assert!(
            seen.ends_with(want),
            "waited for {:?}, the terminal shows {:?}",
            String::from_utf8_lossy(want),
            String::from_utf8_lossy(&seen)
        );
        seen
    }

    fn read_while(&mut self, mut more: impl FnMut(&[u8]) -> bool, d: Duration) -> Vec<u8> {
        let until = Instant::now() + d;
        let mut seen = Vec::new();
        while Instant::now() < until && more(&seen) {
            let mut buf = [0u8; 4096];
            match self.term.read(&mut buf) {
                Ok(n) if n > 0 => seen.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => break,
            }
        }
        seen
    }

    fn type_in(&mut self, keys: &[u8]) {
        self.term.write_all(keys).unwrap();
    }

    fn interrupt(&self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
    }

    /// Closes the terminal (a closed window, a dropped connection) and waits for ferry.
    fn hang_up(mut self) -> std::process::ExitStatus {
        drop(self.term);
        self.child.wait().unwrap()
    }

    fn wait(mut self) -> std::process::ExitStatus {
        self.child.wait().unwrap()
    }
}

/// A hangup (the terminal closed, the ssh connection dropped) suspends the session instead of
/// losing it, and `ferry resume SESSION` goes on from there: the resume's output is the rest
/// of an uninterrupted run's, what the guest printed into the closed terminal before the
/// suspend landed included.
#[test]
fn a_hangup_suspends_the_session() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "200"];
    let plain = env.plain(&args);
    let mut on = OnTerminal::spawn(&env, &[&["run", "--session", "hup"][..], &args].concat());
    crate::harness::wait_until_running(&env);
    on.read_for(Duration::from_millis(300));
    let status = on.hang_up();
    assert_eq!(status.code(), Some(75), "suspended, not killed: {status}");
    let rec = env.session_record("hup");
    assert_eq!(rec["state"], "suspended", "{rec}");
    let k = rec["last_snapshot"].as_str().unwrap();
    let at = env.inspect_json(k)["stdio"]["stdout_bytes"]
        .as_u64()
        .unwrap() as usize;
    let rest = env.ferry().args(["resume", "hup"]).output().unwrap();
    assert_eq!(rest.status.code(), Some(0));
    // What the guest printed between the hangup and the suspend was refused by the closed
    // terminal; the snapshot carries it and the resume shows it first: nothing is lost.
    assert_eq!(
        String::from_utf8_lossy(&rest.stdout),
        String::from_utf8_lossy(&plain.stdout[at..])
    );
}

/// A prompt-and-read loop: writes `> `, reads a line, answers `got LINE`, until end of input.
const PROMPTER: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_read" (func $r (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "> ")
  (data (i32.const 8) "got ")
  (func (export "_start")
    (loop $again
      (i32.store (i32.const 100) (i32.const 0))
      (i32.store (i32.const 104) (i32.const 2))
      (drop (call $w (i32.const 1) (i32.const 100) (i32.const 1) (i32.const 200)))
      (i32.store (i32.const 100) (i32.const 300))
      (i32.store (i32.const 104) (i32.const 64))
      (drop (call $r (i32.const 0) (i32.const 100) (i32.const 1) (i32.const 200)))
      (if (i32.eqz (i32.load (i32.const 200))) (then (return)))
      (i32.store (i32.const 100) (i32.const 8))
      (i32.store (i32.const 104) (i32.const 4))
      (i32.store (i32.const 108) (i32.const 300))
      (i32.store (i32.const 112) (i32.load (i32.const 200)))
      (drop (call $w (i32.const 1) (i32.const 100) (i32.const 2) (i32.const 204)))
      (br $again))))"#;

/// [`PROMPTER`] written into `env`'s scratch directory: its path.
fn prompter(env: &Env) -> String {
    let prog = env.path("prompter.wat");
    std::fs::write(&prog, PROMPTER).unwrap();
    prog.to_str().unwrap().to_owned()
}

/// A session suspended while it waits at its prompt shows that prompt again when it is
/// resumed on a terminal (it will not print it again itself), and goes on from there: what
/// was typed before is not read twice. A hangup while it waits is a suspend too, not the end
/// of its input (a hung-up terminal reads as end of file).
#[test]
fn a_resumed_session_shows_its_prompt_again() {
    let env = Env::new();
    let prog = prompter(&env);
    let prog = prog.as_str();
    let mut on = OnTerminal::spawn(&env, &["run", "--session", "rep", prog]);
    on.read_until(b"> ");
    on.type_in(b"one\n");
    on.read_until(b"got one\r\n> ");
    on.interrupt();
    assert_eq!(on.wait().code(), Some(75));

    let mut on = OnTerminal::spawn(&env, &["resume", "rep"]);
    let first = on.read_until(b"> ");
    assert_eq!(first, b"> ", "the prompt first, before any input");
    on.type_in(b"two\n");
    on.read_until(b"got two\r\n> ");
    assert_eq!(
        on.hang_up().code(),
        Some(75),
        "a hangup at the prompt suspends"
    );

    let mut on = OnTerminal::spawn(&env, &["resume", "rep"]);
    on.read_until(b"> ");
    on.type_in(b"three\n");
    on.read_until(b"got three\r\n> ");
    on.type_in(b"\x04"); // end of input
    assert_eq!(on.wait().code(), Some(0));
}

/// Periodic checkpoints of a session waiting at its prompt on a terminal: they do not write
/// over the screen (no `ferry: checkpoint` lines between the prompt and what is typed), and
/// after them — each rewinds into the wait for input — Ctrl-C still suspends at once.
#[test]
fn checkpoints_at_a_prompt_keep_quiet_and_ctrl_c_still_suspends() {
    let env = Env::new();
    let prog = prompter(&env);
    let prog = prog.as_str();
    let mut on = OnTerminal::spawn(
        &env,
        &[
            "run",
            "--session",
            "cp",
            "--checkpoint-every",
            "100ms",
            prog,
        ],
    );
    on.read_until(b"> ");
    on.type_in(b"one\n");
    let mut shown = on.read_until(b"got one\r\n> ");
    shown.extend(on.read_for(Duration::from_millis(800)));
    let shown = String::from_utf8_lossy(&shown);
    assert!(!shown.contains("ferry:"), "{shown}");
    let asked = Instant::now();
    on.interrupt();
    let status = on.wait();
    assert_eq!(status.code(), Some(75));
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "Ctrl-C took {:?}",
        asked.elapsed()
    );
    let rec = env.session_record("cp");
    let k = rec["last_snapshot"].as_str().unwrap();
    let (out, err, code) = env.output(&["inspect", "--history", "--json", k]);
    assert_eq!(code, 0, "{err}");
    let history: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert!(history.len() >= 3, "checkpoints were taken: {out}");
}
