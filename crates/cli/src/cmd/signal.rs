//! `ferry checkpoint SESSION` and `ferry suspend SESSION`: signal a running session and wait
//! for its snapshot.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::session;
use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Session id (see `ferry ps`).
    pub session: String,
    /// How long to wait for the snapshot, in seconds.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Checkpoint,
    Suspend,
}

pub fn run(settings: &Settings, a: Args, kind: Kind) -> Result<ExitCode> {
    let s = session::load(settings, session::checked_id(&a.session)?)?;
    // The process holding the session's lease, not the pid on record: a recorded pid may
    // since belong to another program.
    let pid = match session::holder(settings, &s.id) {
        Some(pid) if pid != 0 => pid,
        Some(_) => bail!(
            "session `{}` is running in another pid namespace; signal it from there",
            s.id
        ),
        None => bail!(
            "session `{}` is not running (state: {}); see `ferry ps`",
            s.id,
            s.shown_state(false)
        ),
    };
    let before = s.last_snapshot.clone();
    let failures = s.snapshot_failures;
    let sig = if kind == Kind::Checkpoint {
        libc::SIGUSR1
    } else {
        libc::SIGTERM
    };
    // SAFETY: sending a signal to a process id read from our own session file.
    if unsafe { libc::kill(pid as i32, sig) } != 0 {
        bail!(
            "cannot signal session `{}` (pid {}): {}",
            s.id,
            pid,
            std::io::Error::last_os_error()
        );
    }
    let started = Instant::now();
    let deadline = started + Duration::from_secs(a.timeout);
    // A snapshot that takes long (a first one of a big mounted directory) is said to be
    // awaited, after 2 s (`FERRY_PROGRESS_AFTER_MS` × 2) and every 5 s then, so the wait is
    // not taken for a hang.
    let mut pace =
        crate::guest::Pace::new(crate::guest::progress_after() * 2, Duration::from_secs(5));
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        if pace.due(started.elapsed()) {
            eprintln!(
                "ferry: waiting for session `{}` to write its snapshot ({:.0} s; at most {} s, \
                 --timeout)",
                s.id,
                started.elapsed().as_secs_f64(),
                a.timeout
            );
        }
        // Asked before reading the record: a holder gone by then has written its last word.
        let gone = session::holder(settings, &s.id).is_none();
        let now = session::load(settings, &s.id)?;
        let new_snapshot = now.last_snapshot.is_some() && now.last_snapshot != before;
        let done = match kind {
            Kind::Checkpoint => new_snapshot,
            Kind::Suspend => now.state == "suspended" && new_snapshot,
        };
        if done {
            let k = now.last_snapshot.unwrap_or_default();
            println!("{k}");
            return Ok(ExitCode::SUCCESS);
        }
        if now.snapshot_failures > failures && !new_snapshot {
            bail!(
                "session `{}` could not write its snapshot and keeps running: {}{}",
                now.id,
                now.snapshot_error
                    .as_deref()
                    .unwrap_or("no reason recorded"),
                match &now.last_snapshot {
                    Some(k) => format!(" (its last snapshot stays {k})"),
                    None => String::new(),
                }
            );
        }
        if gone || now.exited() {
            bail!(
                "session `{}` ended ({}) before writing a snapshot",
                now.id,
                now.state
            );
        }
    }
    bail!(
        "session `{}` wrote no snapshot within {} s; it may still be writing one (a first \
         snapshot of a big mounted directory reads all of it; the session's own terminal says \
         how far it is): see `ferry ps`, or wait longer with --timeout",
        s.id,
        a.timeout
    )
}
