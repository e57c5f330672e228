//! What `run` and `resume` share: signals, the guest thread, snapshots reported to the user.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use ferry_engine::{Control, EngineKind, Outcome, Prepared, Request, Runtime, SnapshotMeta, Start};
use ferry_kappa::Kappa;
use ferry_store::{FsStore, RefValue, Store};
use ferry_wasi::{HostClock, MountSpec, Stdio, WasiCtx};

use crate::replay::Replays;
use crate::session::{self, Session};
use crate::settings::Settings;

/// Exit code of `ferry run`/`resume` when the guest was suspended (EX_TEMPFAIL).
pub const EXIT_SUSPENDED: u8 = 75;

/// `--export-to`: an `s3://` or `oci:` place.
fn parse_export_to(s: &str) -> Result<crate::cmd::oci::OciRef, String> {
    crate::cmd::oci::OciRef::parse(std::ffi::OsStr::new(s))
        .ok_or_else(|| format!("`{s}` is neither s3://BUCKET/PREFIX[:TAG] nor oci:DIR[:TAG]"))?
        .map_err(|e| format!("{e:#}"))
}

/// `--export-lease`: a time to live, or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportLease {
    Off,
    Ttl(Duration),
}

/// The time to live of a run's lease on its tag unless `--export-lease` says otherwise.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

fn parse_lease(s: &str) -> Result<ExportLease, String> {
    if s == "off" {
        return Ok(ExportLease::Off);
    }
    let d = crate::cmd::run::parse_duration(s)?;
    if d < crate::cmd::oci::lease::MIN_TTL {
        return Err(format!(
            "`{s}`: a lease lives at least {} s (or `off`)",
            crate::cmd::oci::lease::MIN_TTL.as_secs()
        ));
    }
    Ok(ExportLease::Ttl(d))
}

/// Stack of the thread the guest runs on: Wasm frames live on it.
pub const GUEST_THREAD_STACK: usize = 256 << 20;

/// What `run` and `resume` both take: mounts, environment, periodic checkpoints.
#[derive(Debug, Default, clap::Args)]
pub struct GuestArgs {
    /// Mount a host directory: HOST::GUEST (or DIR, same path in the guest). On resume: grant
    /// a directory for one of the snapshot's mounts.
    #[arg(long = "dir", value_name = "HOST::GUEST")]
    dirs: Vec<String>,
    /// Set an environment variable for the guest (on resume: from now on). A bare KEY passes
    /// ferry's own value of KEY (as `wasmtime run --env KEY` does).
    #[arg(long = "env", value_name = "KEY[=VALUE]")]
    envs: Vec<String>,
    /// Write a snapshot this often while running (e.g. 500ms, 10s, 5m).
    #[arg(long, value_name = "DURATION", value_parser = crate::cmd::run::parse_duration)]
    pub checkpoint_every: Option<std::time::Duration>,
    /// Copy the guest's memory to the store in the background this often (e.g. 1s), so that
    /// a suspend or checkpoint has only what changed since to write: a much shorter pause for
    /// a large guest, paid for with disk writes of memory that may change again (jit engine
    /// only).
    #[arg(long, value_name = "DURATION", value_parser = crate::cmd::run::parse_duration)]
    pub pre_write: Option<std::time::Duration>,
    /// Keep only this session's newest N snapshots: after each snapshot the older ones are
    /// deleted from the store — when no other ferry process is using it; otherwise at a later
    /// snapshot, or by `ferry store gc --keep N`.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub keep: Option<u64>,
    /// After each snapshot (checkpoint or suspend), also export it in the background as an OCI
    /// layout — into an S3-compatible bucket (`s3://BUCKET/PREFIX[:TAG]`) or a directory
    /// (`oci:DIR[:TAG]`), the tag by default the session's name — so that if this machine is
    /// lost, another one goes on from it (`ferry resume s3://BUCKET/PREFIX:NAME`). A suspend
    /// ends once its snapshot is exported too.
    #[arg(long, value_name = "s3://BUCKET/PREFIX[:TAG]|oci:DIR[:TAG]", value_parser = parse_export_to)]
    pub export_to: Option<crate::cmd::oci::OciRef>,
    /// With --export-to: after an export (every 10 minutes at most, or every GRACE if that is
    /// shorter), also delete from that layout what no tag needs and was written over GRACE
    /// ago — the layers of the checkpoints each export replaced — as `ferry prune --grace
    /// GRACE` does. 1h is safe beside other exports to the same layout.
    #[arg(long, value_name = "GRACE", requires = "export_to", value_parser = crate::cmd::run::parse_duration)]
    pub export_prune: Option<Duration>,
    /// With --export-to: how long the run's lease on its tag outlives its last renewal
    /// (renewed every quarter of it; at least 2s), or `off`. A run resumed from the tag
    /// elsewhere waits for the lease to lapse (or to be given up at a suspend or exit), and a
    /// run that cannot renew it for half of it suspends itself, so that the session never
    /// runs in two places.
    #[arg(long, value_name = "TTL|off", requires = "export_to", value_parser = parse_lease)]
    pub export_lease: Option<ExportLease>,
    /// Engine to run the guest on: `jit` (wasmtime, the default) or `interp` (wasmi, a
    /// pure-Rust interpreter). A snapshot taken on one resumes on the other. (With --space,
    /// `resume` keeps the session's engine unless this is given.)
    #[arg(long, value_name = "ENGINE", env = "FERRY_ENGINE")]
    pub engine: Option<EngineKind>,
}

impl GuestArgs {
    /// Whether none of these options was given on the command line (the engine may come
    /// from `$FERRY_ENGINE`, so it does not count).
    pub fn is_default(&self) -> bool {
        self.dirs.is_empty()
            && self.envs.is_empty()
            && self.checkpoint_every.is_none()
            && self.pre_write.is_none()
            && self.keep.is_none()
            && self.export_to.is_none()
            && self.export_prune.is_none()
            && self.export_lease.is_none()
    }

    /// `--export-lease`'s time to live: [`DEFAULT_LEASE`] unless given; `None`: off.
    pub fn export_lease(&self) -> Option<Duration> {
        match self.export_lease {
            None => Some(DEFAULT_LEASE),
            Some(ExportLease::Off) => None,
            Some(ExportLease::Ttl(d)) => Some(d),
        }
    }

    /// The engine asked for, else the JIT.
    pub fn engine(&self) -> EngineKind {
        self.engine.unwrap_or(EngineKind::Jit)
    }

    pub fn mounts(&self) -> Result<Vec<MountSpec>> {
        self.dirs.iter().map(|d| parse_dir(d)).collect()
    }

    pub fn env(&self) -> Result<Vec<(String, String)>> {
        self.envs
            .iter()
            .map(|e| match e.split_once('=') {
                Some(_) => parse_env(e),
                None => inherit_env(e),
            })
            .collect()
    }
}

/// Parses `HOST::GUEST` (or `DIR`, mounted at the same path).
pub fn parse_dir(s: &str) -> Result<MountSpec> {
    let (host, guest) = match s.split_once("::") {
        Some((h, g)) => (h, g.to_owned()),
        None => (s, s.to_owned()),
    };
    anyhow::ensure!(
        !host.is_empty() && !guest.is_empty(),
        "--dir `{s}`: expected HOST::GUEST"
    );
    let guest = if guest.starts_with('/') || guest == "." {
        guest
    } else {
        format!("/{guest}")
    };
    Ok(MountSpec {
        guest_path: guest,
        host_dir: host.into(),
        read_only: false,
        host_bound: false,
    })
}

/// Parses `K=V`.
pub fn parse_env(s: &str) -> Result<(String, String)> {
    let (k, v) = s
        .split_once('=')
        .with_context(|| format!("--env `{s}`: expected KEY=VALUE"))?;
    anyhow::ensure!(!k.is_empty(), "--env `{s}`: empty name");
    Ok((k.to_owned(), v.to_owned()))
}

/// `--env KEY`: ferry's own value of KEY.
fn inherit_env(k: &str) -> Result<(String, String)> {
    anyhow::ensure!(!k.is_empty(), "--env: empty name");
    let v = std::env::var_os(k).with_context(|| {
        format!("--env `{k}` passes ferry's own `{k}`, which is not set (give --env {k}=VALUE)")
    })?;
    let v = v
        .into_string()
        .map_err(|_| anyhow::anyhow!("--env `{k}`: ferry's own `{k}` is not UTF-8"))?;
    Ok((k.to_owned(), v))
}

/// The files ferry's own stdout and stderr are (`ferry run … > out.txt 2> err.txt`), by
/// their canonical paths: a mount leaves them out of its snapshots
/// ([`WasiCtx::leave_out`]), since ferry writes to them after each snapshot.
pub fn own_output_files() -> Vec<std::path::PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    for fd in [1, 2] {
        let Ok(path) = std::fs::read_link(format!("/proc/self/fd/{fd}")) else {
            continue;
        };
        // The open file itself, and the path that names it now (a file deleted or replaced
        // since it was opened is no one's concern).
        let (Ok(open), Ok(named)) = (
            std::fs::metadata(format!("/proc/self/fd/{fd}")),
            std::fs::metadata(&path),
        ) else {
            continue;
        };
        if open.is_file() && (open.dev(), open.ino()) == (named.dev(), named.ino()) {
            let path = path.canonicalize().unwrap_or(path);
            if !out.contains(&path) {
                out.push(path);
            }
        }
    }
    out
}

/// Warns, from a thread of its own (a big directory takes a while to walk, and the guest need
/// not wait), about a file in a carried mount too large for a snapshot: otherwise the first
/// suspend, perhaps hours later, is when the user would learn it.
pub fn warn_uncarriable(wasi: &WasiCtx) {
    let mut mounts: Vec<(std::path::PathBuf, Vec<std::path::PathBuf>, String)> = Vec::new();
    for (m, skip) in wasi.mounts().into_iter().zip(wasi.not_carried()) {
        if !m.host_bound && !mounts.iter().any(|(d, _, _)| *d == m.host_dir) {
            mounts.push((m.host_dir, skip, m.guest_path));
        }
    }
    if mounts.is_empty() {
        return;
    }
    std::thread::spawn(move || {
        for (dir, skip, guest) in mounts {
            if let Some((file, len)) = ferry_wasi::tree::first_too_large(&dir, &skip) {
                eprintln!(
                    "ferry: warning: {} ({len} bytes) is larger than a snapshot can carry \
                     ({} bytes): suspending fails while it is there; pass its directory \
                     through instead (--bind {}::{guest}; snapshots then leave it on this host)",
                    file.display(),
                    ferry_wasi::tree::MAX_FILE,
                    dir.display()
                );
            }
        }
    });
}

pub fn host_clock() -> Box<HostClock> {
    Box::new(HostClock::default())
}

pub fn stdio() -> Stdio {
    Stdio::inherit()
}

/// Spawns `f` on a scoped thread whose stack is deep enough for guests (Wasm frames live on
/// it).
pub fn spawn_guest<'scope, T: Send + 'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    f: impl FnOnce() -> T + Send + 'scope,
) -> std::thread::ScopedJoinHandle<'scope, T> {
    std::thread::Builder::new()
        .name("guest".into())
        .stack_size(GUEST_THREAD_STACK)
        .spawn_scoped(scope, || {
            block_control_signals();
            f()
        })
        .expect("spawning the guest thread")
}

/// Keeps ferry's control signals (suspend, checkpoint) off the calling thread: the kernel
/// hands them to another thread, so the guest's blocking calls are not interrupted by them.
fn block_control_signals() {
    // SAFETY: builds a signal set we own and changes only this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in CONTROL_SIGNALS {
            libc::sigaddset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Runs `f` on a guest thread (see [`spawn_guest`]) and waits for it.
pub fn on_guest_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| spawn_guest(s, f).join().expect("guest thread panicked"))
}

/// Everything about one guest execution.
pub struct Execution<'a> {
    pub settings: &'a Settings,
    pub store: &'a FsStore,
    pub runtime: &'a Runtime,
    pub prepared: &'a Prepared,
    pub control: Arc<Control>,
    pub session: Session,
    /// The session's lease, held until the guest exits or is suspended.
    pub lease: session::Lease,
    /// Output a lost run already wrote (resuming a lost session), skipped as it is written.
    pub replays: Replays,
    pub meta: SnapshotMeta,
    pub checkpoint_every: Option<Duration>,
    /// `--keep N`: after each snapshot, older ones of this session are deleted.
    pub keep: Option<u64>,
    /// `--export-to`: each snapshot also exported there, in the background.
    pub export_to: Option<crate::cmd::oci::OciRef>,
    /// `--export-prune GRACE`: the export thread also prunes the layout.
    pub export_prune: Option<Duration>,
    /// The epoch to write the export's tag with (`oci::Claim`): the one after the tag's, for a
    /// run resumed from it; else that of the session's last run exporting there, or (`None`)
    /// the one after the tag's at the first export.
    pub export_epoch: Option<u64>,
    /// `--export-lease`: the tag's lease's time to live (`None`: no lease).
    pub export_lease: Option<Duration>,
    /// `--take-over`: the tag's lease is taken even while another run holds it.
    pub take_over: bool,
    /// The line the guest has begun on its terminal and not ended (recorded with each snapshot).
    pub open_line: OpenLine,
}

/// The line a guest has begun on its terminal and not ended yet — a prompt waiting for
/// input (CPython writes its `>>> ` to stderr, a C program's `printf("> ")` goes to stdout) —
/// at most [`OpenLine::MAX`] bytes (its end), and the stream (1 or 2) that wrote last.
/// Recorded with each snapshot so that a resume on a terminal can show it again: the terminal
/// that showed it may be gone, and the guest, waiting for input, will not print it again.
#[derive(Debug, Clone, Default)]
pub struct OpenLine(Arc<std::sync::Mutex<(i32, Vec<u8>)>>);

impl OpenLine {
    pub const MAX: usize = 256;

    /// One that starts as `line`, last written by `fd` (the prompt recorded with the snapshot
    /// being resumed).
    pub fn new(fd: i32, line: &str) -> Self {
        let l = Self::default();
        l.note(fd, line.as_bytes());
        l
    }

    /// Notes what the guest writes to `stdio`'s stdout and stderr, and ends the line when it
    /// reads a line from stdin (a terminal echoed it, newline and all).
    pub fn attach(&self, stdio: &mut ferry_wasi::Stdio) {
        for (fd, out) in [(1, &mut stdio.stdout), (2, &mut stdio.stderr)] {
            let inner = std::mem::replace(out, Box::new(std::io::sink()));
            *out = Box::new(Noting {
                out: inner,
                fd,
                line: self.clone(),
            });
        }
        let input = std::mem::replace(&mut stdio.stdin, Box::new(std::io::empty()));
        stdio.stdin = Box::new(Reading {
            input,
            line: self.clone(),
        });
    }

    /// Shows the line again on the terminal its stream is, if it is one (a file or a pipe
    /// holds it already): a resumed guest waiting at its prompt will not print it again.
    pub fn show_again(&self) {
        match self.get() {
            (_, line) if line.is_empty() => {}
            (2, line) if std::io::stderr().is_terminal() => eprint!("{line}"),
            (1, line) if std::io::stdout().is_terminal() => {
                print!("{line}");
                let _ = std::io::stdout().flush();
            }
            _ => {}
        }
    }

    /// The stream that wrote last, and the line so far (lossy UTF-8).
    pub fn get(&self) -> (i32, String) {
        let g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        (g.0, String::from_utf8_lossy(&g.1).into_owned())
    }

    fn note(&self, fd: i32, written: &[u8]) {
        if written.is_empty() {
            return;
        }
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        g.0 = fd;
        let line = &mut g.1;
        match written.iter().rposition(|&b| b == b'\n') {
            Some(end) => {
                line.clear();
                line.extend_from_slice(&written[end + 1..]);
            }
            None => line.extend_from_slice(written),
        }
        let over = line.len().saturating_sub(Self::MAX);
        line.drain(..over);
    }
}

struct Reading {
    input: Box<dyn std::io::Read + Send>,
    line: OpenLine,
}

impl std::io::Read for Reading {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.input.read(buf)?;
        if buf[..n].contains(&b'\n') {
            // The terminal echoed the line: the one on it has ended.
            self.line.note(0, b"\n");
        }
        Ok(n)
    }
}

struct Noting {
    out: Box<dyn Write + Send>,
    fd: i32,
    line: OpenLine,
}

impl Write for Noting {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(buf)?;
        self.line.note(self.fd, &buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

impl Execution<'_> {
    /// Runs the guest to exit or suspension and returns ferry's exit code.
    pub fn execute(mut self, wasi: WasiCtx, start: Start) -> Result<ExitCode> {
        // Released on return, after the session's last record is written.
        let _lease = self.lease;
        // What `ferry resume` must be given again (a Python runtime's standard library is
        // granted by resume itself).
        // (`.` comes with the script's directory granted at its own path.)
        let mounts = wasi.mounts();
        let grants: String = mounts
            .iter()
            .filter(|m| m.guest_path != crate::cmd::python::STDLIB_GUEST)
            .filter(|m| {
                m.guest_path != "."
                    || !mounts
                        .iter()
                        .any(|o| o.guest_path != "." && o.host_dir == m.host_dir)
            })
            .map(|m| {
                let host = m.host_dir.display().to_string();
                match std::path::Path::new(&m.guest_path) == m.host_dir {
                    true => format!("--dir {} ", shell_word(&host)),
                    false => format!(
                        "--dir {} ",
                        shell_word(&format!("{host}::{}", m.guest_path))
                    ),
                }
            })
            .collect();
        if let Some(every) = self.checkpoint_every {
            // Each comes after a pass that copies the changed memory while the guest runs,
            // so it pauses only for what the guest wrote meanwhile
            // (`FERRY_PRE_WRITE_CHECKPOINTS=off`: for all of it).
            self.control.pre_write_before_checkpoints_unless_off();
            let c = self.control.clone();
            std::thread::spawn(move || {
                loop {
                    std::thread::sleep(every);
                    c.request_checkpoint();
                }
            });
        }
        // `--export-to`: a thread exporting each snapshot recorded (the latest of those
        // waiting), joined once the guest stops, so that a suspend ends exported too.
        let export_to = self.export_to.clone().map(|mut to| {
            if to.tag.is_none() {
                to.tag = Some(crate::cmd::oci::tag_for(&self.session.id));
            }
            to
        });
        let (export_tx, export_rx) = std::sync::mpsc::channel::<Kappa>();
        let export_prune = self.export_prune;
        // A session resumed here goes on with the epoch (and as the writer) its last run
        // here exported with; one taken over from its tag, with the epoch after it.
        let fresh = || format!("{:016x}", rand::random::<u64>());
        let previous = export_to.as_ref().and_then(|to| {
            session::load_export(self.settings, &self.session.id).filter(|e| e.to == to.name())
        });
        let mut claim = match (self.export_epoch, previous) {
            (Some(epoch), _) => crate::cmd::oci::Claim {
                writer: fresh(),
                epoch: Some(epoch),
            },
            (
                None,
                Some(session::ExportStatus {
                    epoch: Some(epoch),
                    writer,
                    ..
                }),
            ) => crate::cmd::oci::Claim {
                writer: writer.unwrap_or_else(fresh),
                epoch: Some(epoch),
            },
            (None, _) => crate::cmd::oci::Claim {
                writer: fresh(),
                epoch: None,
            },
        };
        // The tag's lease, taken before the guest runs: refused while a run elsewhere holds it.
        let taken_at = std::time::Instant::now();
        let tag_lease = match (&export_to, self.export_lease) {
            (Some(to), Some(ttl)) => Some(
                crate::cmd::oci::TagLease::take(to, &mut claim, ttl, self.take_over)
                    .with_context(|| format!("cannot export to {}", to.name()))?,
            ),
            _ => None,
        };
        starting();
        self.session.pid = std::process::id();
        self.session.state = "running".into();
        session::save(self.settings, &self.session)?;

        let (runtime, prepared, store, control) = (
            self.runtime,
            self.prepared,
            self.store,
            self.control.clone(),
        );
        let settings = self.settings;
        let meta = self.meta.clone();
        let mut sess = self.session.clone();
        let replays = self.replays.clone();
        let keep = self.keep;
        let open_line = self.open_line.clone();
        let export_control = self.control.clone();
        let lease_lost = Arc::new(LeaseFate::default());
        let leasing = tag_lease.map(|lease| {
            keep_lease(
                lease,
                taken_at,
                self.control.clone(),
                lease_lost.clone(),
                &self.session.id,
            )
        });
        let export_lost = lease_lost.clone();
        let exporter = export_to.clone().map(|to| {
            std::thread::Builder::new()
                .name("export".into())
                .spawn({
                    let dir = settings.store_dir.clone();
                    let (settings, id) = (settings.clone(), sess.id.clone());
                    move || {
                        // The tag taken over at an export: noted as for the lease.
                        let taken_over = || {
                            if export_lost.lose(true) {
                                export_control.request(Request::Suspend);
                            }
                        };
                        export_each(
                            &dir,
                            &to,
                            (export_prune, claim),
                            export_rx,
                            &mut |status| {
                                if let Err(e) = session::save_export(&settings, &id, status) {
                                    tracing::warn!("{e:#}");
                                }
                            },
                            &taken_over,
                            &export_lost,
                        )
                    }
                })
                .expect("a thread")
        });
        let outcome = on_guest_thread(move || {
            let mut failures = Failures::default();
            let mut on_snapshot = |r: Result<Kappa, ferry_engine::EngineError>, why: Request| {
                match r {
                    Ok(k) => {
                        if failures.ended() {
                            eprintln!("ferry: snapshots are written again ({k})");
                        }
                        // Said before the output files' ends are noted: with stderr in the
                        // same file as stdout, the note then follows this line. Not on a
                        // terminal: there it would cut into the guest's screen (a prompt and
                        // what is being typed at it) every interval; `ps` and `-v` show it.
                        if why == Request::Checkpoint && !std::io::stderr().is_terminal() {
                            eprintln!("ferry: checkpoint {k}");
                        }
                        sess.outputs = replays.marks();
                        (sess.prompt_fd, sess.prompt) = open_line.get();
                        if let Err(e) = record(settings, store, &mut sess, k, why) {
                            eprintln!("ferry: snapshot {k} written but not recorded: {e:#}");
                        } else {
                            if let Some(n) = keep {
                                prune(store, &sess.id, n);
                            }
                            let _ = export_tx.send(k);
                        }
                    }
                    Err(e) => {
                        let what = match why {
                            Request::Suspend => "suspend",
                            _ => "snapshot",
                        };
                        let msg = e.to_string();
                        if let Some(more) = failures.note(&msg, why == Request::Checkpoint) {
                            eprintln!(
                                "ferry: {what} failed, the program keeps running (earlier \
                                 snapshots are intact): {msg}{more}"
                            );
                        }
                        if why == Request::Suspend {
                            eprintln!(
                                "ferry: ask again (Ctrl-C, `ferry suspend {}`) once the cause is \
                                 fixed; a third Ctrl-C exits without a snapshot",
                                sess.id
                            );
                        }
                        // Told to `ferry suspend` / `ferry checkpoint`, which wait for it.
                        sess.snapshot_error = Some(msg);
                        sess.snapshot_failures += 1;
                        let _ = session::save(settings, &sess);
                    }
                }
            };
            runtime.run(
                prepared,
                wasi,
                control,
                start,
                store,
                meta,
                &mut on_snapshot,
            )
        });
        self.session = session::load(self.settings, &self.session.id).unwrap_or(self.session);
        let mut taken_over = false;
        let mut exported_last = None;
        if let (Some(exporter), Some(to)) = (exporter, &export_to) {
            if let Ok(Outcome::Suspended(k)) = &outcome
                && !exporter.is_finished()
            {
                eprintln!("ferry: exporting {k} to {} before ending", to.name());
            }
            let done = exporter.join().expect("the export thread panicked");
            exported_last = done.last;
            taken_over = lease_lost.taken();
            if let Ok(Outcome::Suspended(k)) = &outcome {
                match done.last {
                    _ if taken_over => eprintln!(
                        "ferry: {k} is not the session's latest: it goes on from {} elsewhere \
                         (a resume of {k} here runs it a second time)",
                        to.name()
                    ),
                    Some(last) if last == *k => eprintln!(
                        "ferry: exported {k} to {}: `ferry resume {} --export-to {}` on another \
                         machine goes on from it",
                        to.describe(to.tag.as_deref().unwrap_or_default()),
                        to.name(),
                        to.layout_name()
                    ),
                    _ => eprintln!(
                        "ferry: {k} was not exported to {} ({}); it is in this store",
                        to.name(),
                        match (&done.error, lease_lost.lost()) {
                            (_, true) => LEASE_LOST.to_owned(),
                            (Some(why), false) => format!("the last export failed: {why}"),
                            (None, false) => "see above".to_owned(),
                        }
                    ),
                }
            }
        }
        // The lease, kept until the last export was made, is given up saying how the run
        // ended — unless it was lost, or the last snapshot is not in the tag: then it lapses.
        if let Some(leasing) = leasing {
            let mut lease = leasing.stop();
            let how = match &outcome {
                Ok(Outcome::Exited(code)) => Some(format!("exited({code})")),
                Ok(Outcome::Suspended(k)) if exported_last == Some(*k) => Some("suspended".into()),
                _ => None,
            };
            if let Some(how) = how.filter(|_| !lease_lost.lost())
                && let Err(e) = lease.end(&how)
            {
                eprintln!(
                    "ferry: could not give up the lease of {}: it lapses {} s after its \
                     last renewal ({e:#})",
                    lease.describe(),
                    lease.ttl().as_secs()
                );
            }
        }
        match outcome {
            Ok(Outcome::Exited(code)) => {
                self.session.state = format!("exited({code})");
                session::save(self.settings, &self.session)?;
                Ok(ExitCode::from(code as u8))
            }
            Ok(Outcome::Suspended(k)) => {
                self.session.state = "suspended".into();
                session::save(self.settings, &self.session)?;
                eprintln!("suspended {k}");
                if !taken_over {
                    // A run that exported goes on exporting there (and holding the tag).
                    let export = export_to
                        .as_ref()
                        .map(|to| format!("--export-to {} ", shell_word(&to.name())))
                        .unwrap_or_default();
                    eprintln!(
                        "ferry: resume it with `ferry resume {grants}{export}{}`",
                        k.fmt_short()
                    );
                }
                Ok(ExitCode::from(EXIT_SUSPENDED))
            }
            Err(e) => {
                // Refused before the guest ran (a check that went on while it was restored):
                // its snapshot is as it was, to be resumed again.
                let refused = matches!(e, ferry_engine::EngineError::Refused { .. });
                self.session.state = match self.session.last_snapshot {
                    Some(_) if refused => "suspended".into(),
                    _ => "failed".into(),
                };
                let _ = session::save(self.settings, &self.session);
                Err(e.into())
            }
        }
    }
}

/// `--export-to`: exports each snapshot `rx` brings (the latest of those waiting) to `to`,
/// through a store of its own at `dir` (opened for each export, so that a `--keep` prune finds
/// the store to itself in between), telling `note` how it goes (for `ferry ps`); with
/// `prune` (`--export-prune GRACE`), deleting from the layout after an export what no tag
/// needs and is older than GRACE, every [`EXPORT_PRUNE_EVERY`] (or GRACE) at most. The tag
/// is written under `claim` ([`crate::cmd::oci::Claim`]): once another run has taken it
/// over, nothing more is exported and `taken_over` is called (it notes that in `lease` and
/// suspends the guest: the session goes on there); nor once `lease` says the tag's lease was
/// lost.
fn export_each(
    dir: &std::path::Path,
    to: &crate::cmd::oci::OciRef,
    (prune, mut claim): (Option<Duration>, crate::cmd::oci::Claim),
    rx: std::sync::mpsc::Receiver<Kappa>,
    note: &mut dyn FnMut(&session::ExportStatus),
    taken_over: &dyn Fn(),
    lease: &LeaseFate,
) -> ExportsDone {
    // The claim, noted from the start: a local resume after a crash before the first export
    // goes on with it too.
    let mut status = session::ExportStatus {
        to: to.name(),
        epoch: claim.epoch,
        writer: claim.epoch.map(|_| claim.writer.clone()),
        ..Default::default()
    };
    let mut last = None;
    let mut pruned: Option<std::time::Instant> = None;
    // Whether `status` says why exports stopped.
    let mut stopped = false;
    // A layout that does not answer fails every export alike: said once a minute.
    let mut failures = Failures::default();
    while let Ok(mut k) = rx.recv() {
        while let Ok(newer) = rx.try_recv() {
            k = newer;
        }
        // Once the tag is lost, the session may go on elsewhere from it.
        if lease.lost() {
            if !stopped {
                status.error = Some(LEASE_LOST.into());
                stopped = true;
                note(&status);
            }
            continue;
        }
        status.exporting = Some(session::Stamped::now(k.to_string()));
        note(&status);
        let exported = FsStore::open(dir)
            .map_err(anyhow::Error::from)
            .and_then(|store| {
                crate::cmd::capsule::export_layout(&store, k, false, to, false, Some(&mut claim))
            });
        status.exporting = None;
        match exported {
            Ok(said) => {
                tracing::info!("{said}");
                last = Some(k);
                if failures.ended() {
                    eprintln!(
                        "ferry: exported {k} to {}: exports go through again",
                        to.name()
                    );
                }
                status.exported = Some(session::Stamped::now(k.to_string()));
                status.error = None;
                status.epoch = claim.epoch;
                status.writer = Some(claim.writer.clone());
                if let Some(grace) = prune
                    && pruned.is_none_or(|t| t.elapsed() >= grace.min(EXPORT_PRUNE_EVERY))
                {
                    pruned = Some(std::time::Instant::now());
                    match crate::cmd::oci::prune(&to.place, &[], grace, false, &mut |_| {}) {
                        Ok(p) => tracing::info!(
                            deleted = p.deleted.0,
                            bytes = p.deleted.1,
                            "--export-prune: pruned {}",
                            to.name()
                        ),
                        Err(e) => eprintln!(
                            "ferry: --export-prune: could not prune {} (tried again later): {e:#}",
                            to.name()
                        ),
                    }
                }
            }
            Err(e) if e.downcast_ref::<crate::cmd::oci::TakenOver>().is_some() => {
                eprintln!(
                    "ferry: {} of {}: the session goes on there; this run exports no more and \
                     suspends, so that it does not run in two places ({k} and the snapshots \
                     before it stay in this store)",
                    e, to.place
                );
                status.error = Some(e.to_string());
                stopped = true;
                taken_over();
            }
            Err(e) => {
                if let Some(more) = failures.note(&format!("{e:#}"), true) {
                    eprintln!(
                        "ferry: could not export {k} to {} (the next snapshot will be): {e:#}{more}",
                        to.name()
                    );
                }
                status.error = Some(format!("{k}: {e:#}"));
            }
        }
        note(&status);
    }
    ExportsDone {
        last,
        error: status.error,
    }
}

/// Why a run whose lease on its tag was lost exports no more (`ferry ps`).
const LEASE_LOST: &str = "this run lost its lease on the tag";

/// What [`export_each`] did: the last snapshot exported, and why the last export failed if
/// it did.
struct ExportsDone {
    last: Option<Kappa>,
    error: Option<String>,
}

/// What became of a run's hold on its tag: its lease ([`keep_lease`]), or at an export its
/// epoch ([`crate::cmd::oci::TakenOver`]).
#[derive(Debug, Default)]
pub struct LeaseFate(std::sync::atomic::AtomicU8);

impl LeaseFate {
    const HELD: u8 = 0;
    const CUT_OFF: u8 = 1;
    const TAKEN: u8 = 2;

    /// Notes the lease lost (`taken`: by another run); whether it was held until now.
    fn lose(&self, taken: bool) -> bool {
        let to = if taken { Self::TAKEN } else { Self::CUT_OFF };
        self.0
            .compare_exchange(Self::HELD, to, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Whether the lease was lost (the run suspends).
    pub fn lost(&self) -> bool {
        self.0.load(Ordering::SeqCst) != Self::HELD
    }

    /// Whether another run took it.
    pub fn taken(&self) -> bool {
        self.0.load(Ordering::SeqCst) == Self::TAKEN
    }
}

/// The threads keeping a run's lease on its tag ([`keep_lease`]).
struct Leasing {
    done: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    renewer: std::thread::JoinHandle<crate::cmd::oci::TagLease>,
    watcher: std::thread::JoinHandle<()>,
}

impl Leasing {
    /// Stops renewing; the lease, to be given up.
    fn stop(self) -> crate::cmd::oci::TagLease {
        *self.done.0.lock().expect("lease lock") = true;
        self.done.1.notify_all();
        self.watcher.join().expect("the lease watcher panicked");
        self.renewer.join().expect("the lease thread panicked")
    }
}

/// Keeps `lease` (taken at `taken_at`) while the guest runs: renewed every quarter of its
/// time to live. When another run has taken it, or when it could not be renewed for half its
/// time to live (the layout does not answer: this machine may be cut off, and a run resumed
/// from the tag elsewhere takes the session over once the lease lapses), `fate` notes it and
/// the guest is suspended, so that the session never runs in two places.
fn keep_lease(
    mut lease: crate::cmd::oci::TagLease,
    taken_at: std::time::Instant,
    control: Arc<Control>,
    fate: Arc<LeaseFate>,
    session: &str,
) -> Leasing {
    let ttl = lease.ttl();
    let done = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
    let renewed = Arc::new(std::sync::Mutex::new(taken_at));
    // Waits `d` or until told to stop; whether told.
    let wait = |done: &(std::sync::Mutex<bool>, std::sync::Condvar), d: Duration| {
        let g = done.0.lock().expect("lease lock");
        let (g, _) = done
            .1
            .wait_timeout_while(g, d, |stop| !*stop)
            .expect("lease lock");
        *g
    };
    let lose = {
        let (fate, control) = (fate.clone(), control.clone());
        move |taken: bool, why: String| {
            if fate.lose(taken) {
                eprintln!("ferry: {why}");
                control.request(Request::Suspend);
            }
        }
    };
    let renewer = std::thread::Builder::new()
        .name("lease".into())
        .spawn({
            let (done, renewed, lose, fate) =
                (done.clone(), renewed.clone(), lose.clone(), fate.clone());
            move || {
                while !wait(&done, ttl / 4) && !fate.lost() {
                    let sent = std::time::Instant::now();
                    match lease.renew() {
                        Ok(()) => *renewed.lock().expect("lease lock") = sent,
                        Err(e) if e.downcast_ref::<crate::cmd::oci::TakenOver>().is_some() => {
                            lose(
                                true,
                                format!(
                                    "{e} of {}: the session goes on there; this run exports \
                                     no more and suspends, so that it does not run in two places",
                                    lease.place()
                                ),
                            );
                            break;
                        }
                        Err(e) => tracing::warn!(
                            "could not renew the lease of {}: {e:#}",
                            lease.describe()
                        ),
                    }
                }
                lease
            }
        })
        .expect("a thread");
    let watcher = std::thread::Builder::new()
        .name("lease-watch".into())
        .spawn({
            let (done, session) = (done.clone(), session.to_owned());
            move || {
                while !wait(&done, Duration::from_millis(100)) && !fate.lost() {
                    let since = renewed.lock().expect("lease lock").elapsed();
                    if since >= ttl / 2 {
                        lose(
                            false,
                            format!(
                                "the lease of the session's tag could not be renewed for {} s \
                                 (its layout does not answer): this run exports no more and \
                                 suspends, so that the session cannot run in two places — a run \
                                 resumed from the tag elsewhere takes it over once the lease \
                                 lapses, {} s after its last renewal; `ferry resume {session} \
                                 --export-to …` here goes on once the layout answers, unless \
                                 one did",
                                since.as_secs(),
                                ttl.as_secs()
                            ),
                        );
                    }
                }
            }
        })
        .expect("a thread");
    Leasing {
        done,
        renewer,
        watcher,
    }
}

/// How often at most `--export-prune` prunes the layout (a listing of it and a read of every
/// manifest each time).
const EXPORT_PRUNE_EVERY: Duration = Duration::from_secs(600);

/// Bytes of live chunks a `--keep` prune copies at most when it compacts packs (the guest
/// waits for it): a 1 GiB first snapshot's pack, half unreachable, is then compacted over
/// several checkpoints instead of in one long pause.
const PRUNE_COMPACT_BUDGET: u64 = 32 << 20;

/// `--keep N`: deletes what only this session's snapshots older than its newest `n` held, if
/// no other process uses the store (else a later snapshot tries again).
fn prune(store: &FsStore, id: &str, n: u64) {
    let name = format!("session/{id}");
    let n = ferry_engine::gc::snapshots_kept(Some(n));
    let keep = |r: &str| if r == name { n } else { usize::MAX };
    let t = std::time::Instant::now();
    match store.alone(|| ferry_engine::gc::collect(store, false, &keep, PRUNE_COMPACT_BUDGET, None))
    {
        Ok(Some(Ok(ferry_engine::gc::Collected {
            removed,
            kept,
            compacted,
            ..
        }))) => {
            let ms = t.elapsed().as_millis() as u64;
            tracing::info!(
                removed,
                kept,
                packs_rewritten = compacted.files,
                freed = compacted.freed,
                ms,
                "older snapshots of the session deleted (--keep)"
            );
        }
        Ok(None) => tracing::info!("--keep: another ferry process uses the store; not pruned now"),
        Ok(Some(Err(e))) => eprintln!("ferry: --keep: could not delete older snapshots: {e:#}"),
        Err(e) => eprintln!("ferry: --keep: {e}"),
    }
}

/// Points the session's file and ref at a new snapshot, in that order: the file is what a
/// resume reads (where the output files ended at this snapshot, for a lost run's replay), so
/// a process dying between the two leaves a file naming the new snapshot with its marks, and
/// a resume of it finds the session by its file (`cmd::resume`). The other order left a ref
/// at the new snapshot and a file at the old one, whose resume then started a new session
/// and wrote again what the lost run had written.
fn record(
    settings: &Settings,
    store: &FsStore,
    s: &mut Session,
    k: Kappa,
    why: Request,
) -> Result<()> {
    let name = format!("session/{}", s.id);
    let current = store.get_ref(&name)?;
    let epoch = current.map_or(1, |c| c.epoch + 1);
    let before = s.clone();
    s.last_snapshot = Some(k.to_string());
    s.snapshot_error = None;
    if why == Request::Suspend {
        s.state = "suspended".into();
    }
    if let Ok(snap) = ferry_object::decode::<ferry_object::Snapshot>(&store.get(&k)?) {
        s.memory = crate::cmd::inspect::memory_len(store, &snap)?;
    }
    session::save(settings, s)?;
    fault_while_recording();
    if let Err(e) = store.cas_ref(&name, current, Some(RefValue { epoch, target: k })) {
        // The file goes back to the snapshot the ref still names.
        *s = before;
        let _ = session::save(settings, s);
        return Err(e.into());
    }
    Ok(())
}

/// Dies like `kill -9` between the two writes of the `n`th snapshot this process records,
/// when `FERRY_FAULT` is `recording-<n>`: the crash tests stop a run there.
fn fault_while_recording() {
    static RECORDED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = RECORDED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    ferry_space::sessions::fault(&format!("recording-{n}"));
}

/// The snapshot failures a run has reported, so that a checkpoint failing the same way again
/// and again (a full disk under `--checkpoint-every 1s`) is said once a minute, not each time.
#[derive(Default)]
struct Failures {
    /// The last failure said (its digits left out: temporary files, sizes vary), when, and
    /// how many like it were not said since.
    last: Option<(String, std::time::Instant, u64)>,
}

impl Failures {
    /// A snapshot failed with `msg`: `None` when it need not be said (`repeatable`, as a
    /// checkpoint is, and like the last one said within a minute), else what to add to it.
    fn note(&mut self, msg: &str, repeatable: bool) -> Option<String> {
        let kind: String = msg.chars().filter(|c| !c.is_ascii_digit()).collect();
        match self.last.take() {
            Some((m, at, n))
                if repeatable && m == kind && at.elapsed() < Duration::from_secs(60) =>
            {
                self.last = Some((m, at, n + 1));
                None
            }
            said => {
                let more = match said {
                    Some((m, _, n)) if m == kind && n > 0 => {
                        format!(" ({n} more like it since it was last shown)")
                    }
                    _ => String::new(),
                };
                self.last = Some((kind, std::time::Instant::now(), 0));
                Some(more)
            }
        }
    }

    /// A snapshot was written: whether failures were said since the last one.
    fn ended(&mut self) -> bool {
        self.last.take().is_some()
    }
}

/// The signals that control a guest: SIGINT, SIGTERM and SIGHUP ask for a suspend, SIGUSR1
/// for a checkpoint ([`install_signals`]); the guest thread blocks them all.
const CONTROL_SIGNALS: [libc::c_int; 4] =
    [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGUSR1];

/// Until the guest starts (a run) or continues (a resume), what an interrupt stops: there is
/// nothing to save yet, and preparing a big module for the first time takes minutes, so
/// Ctrl-C then ends ferry at once, saying this. `None` once the guest is under way.
static BEFORE_START: std::sync::Mutex<Option<&'static str>> = std::sync::Mutex::new(None);

/// The guest is about to run: from now on an interrupt suspends it.
pub fn starting() {
    *BEFORE_START.lock().unwrap_or_else(|p| p.into_inner()) = None;
}

/// SIGINT, SIGTERM and SIGHUP ask `control` for a suspend (a third SIGINT exits at once);
/// SIGUSR1 for a checkpoint. Before [`starting`], any of the first three ends ferry straight
/// away, printing `before_start` ("interrupted before …; nothing to resume").
///
/// SIGHUP is a terminal going away (a closed window, a dropped ssh connection): the session
/// is suspended rather than lost, and `ferry resume SESSION` continues it later.
pub fn install_signals(control: &Arc<Control>, before_start: &'static str) -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGUSR1};
    *BEFORE_START.lock().unwrap_or_else(|p| p.into_inner()) = Some(before_start);
    let mut signals = signal_hook::iterator::Signals::new(CONTROL_SIGNALS)
        .context("installing signal handlers")?;
    // Asked now: once the terminal hangs up it no longer answers as one.
    // SAFETY: isatty only inspects descriptors 1 and 2.
    let terminals: Vec<i32> = [1, 2]
        .into_iter()
        .filter(|&fd| unsafe { libc::isatty(fd) } == 1)
        .collect();
    let c = control.clone();
    std::thread::spawn(move || {
        let mut interrupts = 0;
        let watching = Arc::new(AtomicBool::new(false));
        for sig in signals.forever() {
            match sig {
                SIGUSR1 => c.request(Request::Checkpoint),
                _ => {
                    if sig == SIGHUP {
                        terminal_gone(&terminals);
                    }
                    // Held while exiting, so the guest cannot start meanwhile.
                    let before = BEFORE_START.lock().unwrap_or_else(|p| p.into_inner());
                    if let Some(note) = *before {
                        eprintln!("ferry: interrupted {note}");
                        // Ended by the signal, as a shell expects of an interrupted program.
                        let _ = signal_hook::low_level::emulate_default_handler(sig);
                        std::process::exit(128 + sig);
                    }
                    drop(before);
                    // Only a keyboard's: `ferry suspend` (SIGTERM) asked again after a failed
                    // snapshot retries, it never ends the guest unsaved.
                    if sig == libc::SIGINT {
                        interrupts += 1;
                    }
                    if interrupts >= 3 {
                        eprintln!("ferry: interrupted again; exiting without a snapshot");
                        std::process::exit(130);
                    }
                    if interrupts == 2 && c.writing().is_some() {
                        eprintln!(
                            "ferry: still writing the snapshot; interrupt once more to exit \
                             without it (the run's last snapshot, if any, stays resumable)"
                        );
                    }
                    c.request(Request::Suspend);
                    if !watching.swap(true, Ordering::SeqCst) {
                        watch_suspend(c.clone(), watching.clone());
                    }
                }
            }
        }
    });
    Ok(())
}

/// How long a suspend's snapshot may take before [`watch_suspend`] says what it is doing:
/// `FERRY_PROGRESS_AFTER_MS`, 1000 unless set (tests set 0).
pub fn progress_after() -> Duration {
    let ms = std::env::var("FERRY_PROGRESS_AFTER_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    Duration::from_millis(ms)
}

/// When long work says how far it got: once `first` has passed, then every `every`.
pub struct Pace {
    next: Duration,
    every: Duration,
}

impl Pace {
    pub fn new(first: Duration, every: Duration) -> Self {
        Self { next: first, every }
    }

    /// Whether to say so now, `took` into the work.
    pub fn due(&mut self, took: Duration) -> bool {
        let due = took >= self.next;
        if due {
            self.next = took + self.every;
        }
        due
    }
}

/// Says on stderr, every 2 s once a suspend's snapshot has taken [`progress_after`], that it
/// is still being written and how much of the mounted directories it has read (a first
/// snapshot of a big data set reads it all), so that a long suspend is not taken for a hung
/// one and interrupted unsaved. Ends, clearing `watching`, once no snapshot is being written
/// or asked for (the suspend failed: the guest runs on).
fn watch_suspend(c: Arc<Control>, watching: Arc<AtomicBool>) {
    let after = progress_after();
    let poll = progress_poll(after);
    std::thread::spawn(move || {
        let mut seen = false;
        let mut pace = Pace::new(after, Duration::from_secs(2));
        loop {
            std::thread::sleep(poll);
            match c.writing() {
                Some((took, read)) => {
                    seen = true;
                    if pace.due(took) {
                        let files = match read {
                            0 => String::new(),
                            b => format!("; {} MiB of mounted files read", b >> 20),
                        };
                        eprintln!(
                            "ferry: still writing the snapshot ({:.0} s{files})",
                            took.as_secs_f64()
                        );
                    }
                }
                None if seen && c.pending() == Request::None => {
                    watching.store(false, Ordering::SeqCst);
                    return;
                }
                None => {}
            }
        }
    });
}

/// How often a progress watcher looks: often enough, when tests ask for progress at once
/// (`FERRY_PROGRESS_AFTER_MS=0`), to catch work that lasts a few milliseconds.
fn progress_poll(after: Duration) -> Duration {
    Duration::from_millis(if after.is_zero() { 5 } else { 50 })
}

/// Says `msg` on stderr as ferry's: every line of it (a trap's call stack, a cause) starts
/// with `ferry: `, so the guest's own stderr is told from ferry's by the prefix alone.
pub fn say(msg: &str) {
    let mut out = String::new();
    for line in msg.lines() {
        out.push_str("ferry: ");
        out.push_str(line);
        out.push('\n');
    }
    eprint!("{out}");
}

/// Runs `work`, saying `what()` on stderr once [`progress_after`] has passed and every 2 s
/// after, until it ends: long work before a guest runs (a write-back, sending a data set to
/// a space) is not taken for a hung ferry.
pub fn saying_progress<T>(what: impl Fn() -> String + Sync, work: impl FnOnce() -> T) -> T {
    let done = AtomicBool::new(false);
    let (done, what) = (&done, &what);
    std::thread::scope(|s| {
        s.spawn(move || {
            let started = std::time::Instant::now();
            let after = progress_after();
            let mut pace = Pace::new(after, Duration::from_secs(2));
            while !done.load(Ordering::SeqCst) {
                std::thread::sleep(progress_poll(after));
                if pace.due(started.elapsed()) && !done.load(Ordering::SeqCst) {
                    eprintln!("ferry: {}", what());
                }
            }
        });
        let r = work();
        done.store(true, Ordering::SeqCst);
        r
    })
}

/// After a hangup, those of stdout and stderr that were the terminal (`terminals`) go to
/// /dev/null: writing to a hung-up terminal fails (the guest would see EIO on its way to the
/// safe point, and ferry's own last lines would panic), and nothing written there can be seen
/// any more. Files and pipes are left alone.
fn terminal_gone(terminals: &[i32]) {
    // SAFETY: opening /dev/null and duplicating it over descriptors 1 and 2, which this
    // process owns for its whole life; the descriptor opened here is closed again.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
        if null < 0 {
            return;
        }
        for &fd in terminals {
            libc::dup2(null, fd);
        }
        libc::close(null);
    }
}

/// `w` as one shell word (quoted when it holds anything but plain path characters).
pub(crate) fn shell_word(w: &str) -> String {
    if !w.is_empty()
        && w.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-:+=,@%".contains(c))
    {
        w.to_owned()
    } else {
        format!("'{}'", w.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::shell_word;

    #[test]
    fn resume_hints_quote_what_a_shell_would_split() {
        assert_eq!(shell_word("/data/app::/app"), "/data/app::/app");
        assert_eq!(shell_word("/my app::."), "'/my app::.'");
        assert_eq!(shell_word("/it's::/x"), "'/it'\\''s::/x'");
    }
}
