//! The sessions a space runs, their output logs, and both sides of the migration protocol
//! (docs/migration.md).
//!
//! Every session has a record (`<space dir>/sessions/<id>.json`, written atomically and
//! synced) and, while its guest runs, a thread of its own. All changes of a running session's
//! state are made by that thread or under the session's `turn` lock, and every change is
//! persisted before anyone is told about it — the record of a move (`moved`) is the commit
//! point of a migration, or, in a fleet with etcd ([`crate::owners`]), the transaction there
//! that moves the session's owner record.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use ferry_engine::{
    Control, EngineError, EngineKind, Outcome, Prepared, Request, Runtime, SnapshotMeta, Start,
    snapshot,
};
use ferry_kappa::Kappa;
use ferry_store::{RefValue, Store, write_durably};
use ferry_wasi::input::StoredInputError;
use ferry_wasi::{HostClock, MountSpec, OutputBuffer, Stdio, StoredInput, WasiCtx};
use tracing::{info, warn};

use crate::api::{
    ApiError, Decision, MIN_CHECKPOINT_MS, MigrateRequest, MigrationReport, MountTree,
    PrepareRequest, ResumeRequest, Round, RunRequest, SessionFiles, SessionInfo, State, session_id,
    valid_id,
};
use crate::client::{RemoteStore, SpaceClient, send_closure, send_objects};
use crate::metrics::Ended;
use crate::owners::{Claim, Commit, Owned, Owner, Owners};
use crate::policy::Policy;

mod input;
mod lend;
mod precopy;
mod standby;
pub use lend::OutputRefusal;

/// Stack of a guest thread: Wasm frames live on it.
const GUEST_STACK: usize = 256 << 20;
/// How long a suspend or checkpoint may take to reach a safe point and be written.
const STOP_TIMEOUT: Duration = Duration::from_secs(120);
/// How often a destination holding a prepared session asks its source for the outcome, and
/// a source retries delivering a commit.
const RESOLVE_EVERY: Duration = Duration::from_secs(1);

/// How a space is set up.
#[derive(Debug, Clone)]
pub struct Config {
    /// The space's own files: session records, logs, backing directories of mounts.
    pub dir: PathBuf,
    pub policy: Policy,
    /// Compiled-code cache (a machine cache).
    pub compiled_cache: Option<PathBuf>,
    /// This space's URL as its peers reach it.
    pub advertise: String,
    /// Bearer token this space presents to other spaces.
    pub peer_token: String,
    /// The fleet's owner records in etcd (`--etcd`), which then decide every move.
    pub owners: Option<Arc<Owners>>,
    /// With `owners`: how long a prepared copy is held while its source does not answer,
    /// before the destination gives the move up (in etcd, so the source cannot commit it).
    pub prepared_timeout: Duration,
    /// With `owners`: the TTL of this space's etcd lease (`--lease-ttl`): a standby takes
    /// this space's sessions over once it has not renewed it for that long.
    pub lease_ttl: Duration,
    /// When the space is asked to stop (SIGTERM, Ctrl-C): how long it waits for its running
    /// sessions to be suspended before it stops anyway (`ferry serve --stop-timeout`).
    pub stop_timeout: Duration,
    /// When asked to stop, first move the running sessions to other spaces of the fleet
    /// (`ferry serve --on-stop move`; needs `owners`).
    pub move_on_stop: bool,
    /// What the space counts for `GET /v1/metrics` (shared with its server).
    pub metrics: Arc<crate::metrics::Metrics>,
}

/// Dies like `kill -9` at `step` when `FERRY_FAULT` names it: the fault-injection tests use
/// this to stop a space at each step of the migration protocol, and a local run while it
/// records a snapshot (`recording-<n>`). `FERRY_FAULT_PAUSE=<step>:<ms>` instead holds the
/// thread there that long ([`ferry_engine::fault_pause`]).
/// Holds a batch of `bytes` received as a link of `FERRY_FAULT_LINK` bytes a second would
/// (batches in turn, as on one link): the tests of moves over a slow network use it (the
/// kernel of the test machine has no netem).
pub fn fault_link(bytes: usize) {
    static FREE_AT: Mutex<Option<Instant>> = Mutex::new(None);
    let Some(rate) = std::env::var("FERRY_FAULT_LINK")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|r| *r > 0.0)
    else {
        return;
    };
    let until = {
        let mut free = lock(&FREE_AT);
        let start = free.map_or_else(Instant::now, |f| f.max(Instant::now()));
        let until = start + Duration::from_secs_f64(bytes as f64 / rate);
        *free = Some(until);
        until
    };
    std::thread::sleep(until.saturating_duration_since(Instant::now()));
}

pub fn fault(step: &str) {
    ferry_engine::fault_pause(step);
    if std::env::var("FERRY_FAULT").is_ok_and(|f| f == step) {
        warn!(step, "fault injection: dying now");
        // SAFETY: sending SIGKILL to ourselves; nothing after this runs.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// What [`Sessions::keep_final_files`] did, into the session's record.
fn set_final_files(i: &mut SessionInfo, files: Option<Result<Vec<MountTree>, String>>) {
    match files {
        Some(Ok(m)) => i.final_files = Some(m),
        Some(Err(e)) => i.final_files_error = Some(e),
        None => {}
    }
}

/// How a guest stopped, into its session's record.
fn record_stop(
    i: &mut SessionInfo,
    outcome: &Result<Outcome, EngineError>,
    killed: bool,
    files: Option<Result<Vec<MountTree>, String>>,
) {
    match outcome {
        Ok(Outcome::Exited(code)) => {
            i.state = State::Exited;
            i.exit_code = Some(*code);
            set_final_files(i, files);
        }
        Ok(Outcome::Suspended(k)) => {
            i.state = if killed {
                State::Killed
            } else {
                State::Suspended
            };
            i.snapshot = Some(k.to_string());
        }
        Err(e) => {
            i.state = match e {
                EngineError::Unsaved(_) if killed => State::Killed,
                _ => State::Failed,
            };
            if matches!(e, EngineError::Trap(_)) {
                i.exit_code = Some(ferry_engine::EXIT_TRAPPED);
            }
            i.reason = Some(e.to_string());
            set_final_files(i, files);
        }
    }
}

/// Writes session record `info` at `p`, atomically and durably.
fn save_record(p: &Path, info: &SessionInfo) -> std::io::Result<()> {
    write_durably(
        p,
        &serde_json::to_vec_pretty(info).expect("session info serializes"),
    )
}

/// The session record at `p`.
fn read_record(p: &Path) -> Result<SessionInfo, String> {
    let b = std::fs::read(p).map_err(|e| e.to_string())?;
    serde_json::from_slice(&b).map_err(|e| e.to_string())
}

/// A mutex's guard, also after a thread panicked holding it (the data stays usable).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn parse_kappa(s: &str, what: &str) -> Result<Kappa, ApiError> {
    s.parse()
        .map_err(|e| ApiError::bad_request(format!("{what} `{s}`: {e}")))
}

fn parse_engine(s: Option<&str>, default: EngineKind) -> Result<EngineKind, ApiError> {
    s.map_or(Ok(default), |e| e.parse().map_err(ApiError::bad_request))
}

/// Maps an engine error to a refusal: what cannot be admitted is 403, a snapshot that does not
/// verify 422, anything else 500.
fn engine_refusal(e: &EngineError) -> ApiError {
    match e {
        EngineError::Refused {
            stage: ferry_engine::Stage::Admitting,
            ..
        } => ApiError::forbidden(e.to_string()),
        EngineError::Refused { .. } | EngineError::Store(_) => {
            ApiError::unprocessable(e.to_string())
        }
        EngineError::Instrument(_) | EngineError::Compile(_) => {
            ApiError::unprocessable(e.to_string())
        }
        _ => ApiError::internal(e),
    }
}

/// One session as this space holds it.
struct Live {
    info: Mutex<SessionInfo>,
    changed: Condvar,
    log: Mutex<OutputBuffer>,
    /// The running guest's control, while one runs.
    control: Mutex<Option<Arc<Control>>>,
    /// A prepared (held) guest takes its orders from this: bring it forward, run, or drop.
    hold: Mutex<Option<mpsc::Sender<HoldCmd>>>,
    /// The current stop was asked for by `kill`.
    kill: AtomicBool,
    /// The session was taken out of this space (an aborted prepare): its thread must not
    /// write its record again.
    gone: AtomicBool,
    /// Serializes resume, migrate, commit and abort of this session.
    turn: Mutex<()>,
    /// Which guest thread owns `control`, `log` and the running state: a thread that ends
    /// after a newer one started (a resume right after a suspend) leaves them alone.
    run: std::sync::atomic::AtomicU64,
    /// While a migration pauses the guest: the guest thread keeps its (suspended) instance
    /// until this is dropped, so tearing a large memory down does not compete with the final
    /// delta and prepare for the CPU.
    defer_teardown: Mutex<Option<mpsc::Receiver<()>>>,
    /// A prepared copy of a session this space had held before (it moved away, and is
    /// moving back): that record, which an abort puts back, so `wait` and `logs` here still
    /// follow the session to where it stayed.
    replaced: Mutex<Option<Arc<Live>>>,
    /// While the session is lent with a lease: when it runs out, unless the client is heard
    /// from before.
    lease_deadline: Mutex<Option<Instant>>,
    /// The thread sending checkpoints to the session's standby, once started.
    standby_tx: Mutex<Option<mpsc::Sender<standby::ToStandby>>>,
    /// A standby copy sent before etcd names this space its standby (`set-standby`): kept
    /// until then, while etcd still names its owner, at most until this instant.
    pending_until: Mutex<Option<Instant>>,
    /// Since when the standby has taken none of the checkpoints sent it (none failed since
    /// the last it took: `None`).
    standby_failing_since: Mutex<Option<Instant>>,
    /// What the standby keeper logged last for this session (said once, not every round).
    keeper_said: Mutex<Option<String>>,
    /// When the guest last had a snapshot written here, or started here.
    snapshot_at: Mutex<Option<Instant>>,
    /// An interactive session's input as its standby holds it (`input.rs`); held while a
    /// piece is forwarded to the standby and while the standby changes, so that the standby
    /// etcd names holds every piece this space answered for.
    input_forwarded: Mutex<Option<input::Forwarded>>,
    /// When input that could not be forwarded (the standby holds no copy yet) last asked
    /// for a checkpoint, which gives the standby one.
    input_asked_checkpoint: Mutex<Option<Instant>>,
}

impl Live {
    fn new(info: SessionInfo, log: OutputBuffer) -> Arc<Self> {
        Arc::new(Self {
            info: Mutex::new(info),
            changed: Condvar::new(),
            log: Mutex::new(log),
            control: Mutex::new(None),
            hold: Mutex::new(None),
            kill: AtomicBool::new(false),
            gone: AtomicBool::new(false),
            turn: Mutex::new(()),
            run: std::sync::atomic::AtomicU64::new(0),
            defer_teardown: Mutex::new(None),
            replaced: Mutex::new(None),
            lease_deadline: Mutex::new(None),
            standby_tx: Mutex::new(None),
            pending_until: Mutex::new(None),
            standby_failing_since: Mutex::new(None),
            keeper_said: Mutex::new(None),
            snapshot_at: Mutex::new(None),
            input_forwarded: Mutex::new(None),
            input_asked_checkpoint: Mutex::new(None),
        })
    }

    fn info(&self) -> SessionInfo {
        lock(&self.info).clone()
    }

    fn log(&self) -> OutputBuffer {
        lock(&self.log).clone()
    }

    /// Waits (at most `timeout`) while `pred` holds; returns the info then.
    fn wait_while(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&SessionInfo) -> bool,
    ) -> SessionInfo {
        let g = lock(&self.info);
        let (g, _) = self
            .changed
            .wait_timeout_while(g, timeout, |i| pred(i))
            .unwrap_or_else(|p| p.into_inner());
        g.clone()
    }
}

/// An order for a held guest (see [`ferry_engine::Hold`]).
enum HoldCmd {
    /// Bring it forward to this later snapshot; the answer says when it is done.
    Patch(Kappa, mpsc::Sender<Result<(), ApiError>>),
    Commit,
    Abort,
}

/// Where a guest starts.
enum Begin {
    Fresh {
        /// The module, in the store.
        module: Kappa,
        args: Vec<String>,
        env: Vec<(String, String)>,
        mounts: Vec<(String, Kappa, bool)>,
        /// A reactor's entry export.
        main: Option<String>,
        /// Stdin as a blob in the store.
        stdin: Option<Kappa>,
        /// Stdin stays open for input sent while the guest runs (after `stdin`).
        interactive: bool,
    },
    Resume(Kappa),
}

/// What a guest thread needs to run.
struct Ready {
    runtime: Runtime,
    prepared: Prepared,
    wasi: WasiCtx,
    start: Start,
    meta: SnapshotMeta,
    log: OutputBuffer,
}

/// The sessions of one space.
pub struct Sessions {
    store: Arc<dyn Store>,
    cfg: Config,
    runtimes: Mutex<HashMap<EngineKind, Runtime>>,
    live: Mutex<HashMap<String, Arc<Live>>>,
    /// The mounts of each session's guest: guest path and the directory backing it here.
    backing: Mutex<HashMap<String, Vec<(String, PathBuf)>>>,
    /// Being drained (`POST /v1/drain`): no new session runs here, none moves in.
    draining: AtomicBool,
    /// Stopping ([`Sessions::suspend_all`]): no guest starts here any more.
    stopping: AtomicBool,
    /// The input of interactive sessions, as their guests read it (`input.rs`).
    inputs: Mutex<HashMap<String, ferry_wasi::InputLog>>,
}

/// What [`Sessions::stop_all`] did.
#[derive(Debug, Default)]
pub struct Stopped {
    /// Sessions moved to other spaces, and where.
    pub moved: Vec<(String, String)>,
    /// Sessions suspended here, to go on when the space starts again.
    pub suspended: Vec<String>,
    /// Sessions neither moved nor suspended, and why: they come back at their last
    /// snapshots.
    pub left: Vec<(String, String)>,
}

/// Rotates `candidates` to start at a place session `id` picks — the same for the same id
/// and number of candidates — so that the sessions of one space spread over the spaces of a
/// fleet (a chosen standby, `drain`'s destinations).
pub fn start_where_id_picks<T>(id: &str, candidates: &mut [T]) {
    use std::hash::{Hash, Hasher};
    if candidates.is_empty() {
        return;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut h);
    let start = (h.finish() % candidates.len() as u64) as usize;
    candidates.rotate_left(start);
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("dir", &self.cfg.dir)
            .finish_non_exhaustive()
    }
}

impl Sessions {
    /// Opens the space's sessions. Sessions that were running when the space stopped are
    /// suspended at their last snapshot (their output log is cut back to it); a session
    /// prepared here by a migration asks its source for the outcome; a move whose commit was
    /// not yet delivered is delivered.
    pub fn open(store: Arc<dyn Store>, cfg: Config) -> Result<Arc<Self>, String> {
        let dir = cfg.dir.join("sessions");
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let me = Arc::new(Self {
            store,
            cfg,
            runtimes: Mutex::new(HashMap::new()),
            live: Mutex::new(HashMap::new()),
            backing: Mutex::new(HashMap::new()),
            draining: Default::default(),
            stopping: Default::default(),
            inputs: Mutex::new(HashMap::new()),
        });
        let rd = std::fs::read_dir(&dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
        let mut to_resume = Vec::new();
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let info = match read_record(&p) {
                Ok(i) => i,
                Err(e) => {
                    warn!(file = %p.display(), error = %e, "unreadable session record skipped");
                    continue;
                }
            };
            if !valid_id(&info.id) {
                continue;
            }
            if info.state == State::Suspended && info.resume_on_start {
                to_resume.push(info.id.clone());
            }
            me.recover(info);
        }
        // A space drained before it stopped comes back drained, until `drain --undo`.
        if me.draining_path().exists() {
            me.draining.store(true, Ordering::SeqCst);
            warn!(
                "this space was being drained when it stopped and still is: it runs no new session and takes none in (`ferry --space {} drain --undo` ends that)",
                me.cfg.advertise
            );
        }
        if let Some(o) = &me.cfg.owners {
            if me.draining.load(Ordering::SeqCst) {
                // Announced so from its first announcement on.
                o.set_draining(true).map_err(|e| e.to_string())?;
            }
            o.keep_announced(me.cfg.lease_ttl);
            me.watch_standbys();
            me.keep_standbys();
        }
        if !to_resume.is_empty() {
            to_resume.sort();
            let again = me.clone();
            let spawned = std::thread::Builder::new()
                .name("resume-on-start".into())
                .spawn(move || again.resume_on_start(&to_resume));
            if let Err(e) = spawned {
                warn!(error = %e, "cannot start the thread resuming sessions; they stay suspended");
            }
        }
        Ok(me)
    }

    /// Resumes the sessions the space suspended when it stopped (`resume_on_start`), one at
    /// a time; one that cannot be resumed stays suspended, its record saying why.
    fn resume_on_start(self: &Arc<Self>, ids: &[String]) {
        for id in ids {
            match self.resume(id, ResumeRequest::default()) {
                Ok(_) => info!(session = %id, "resumed: suspended when the space stopped"),
                Err(e) => {
                    warn!(session = %id, error = %e.msg, "suspended when the space stopped, and cannot be resumed now");
                    if let Ok(live) = self.get(id) {
                        self.update(&live, |i| {
                            if i.state == State::Suspended && i.resume_on_start {
                                i.resume_on_start = false;
                                i.reason = Some(format!(
                                    "suspended when the space stopped; resuming it when the \
                                     space started again failed: {}",
                                    e.msg
                                ));
                            }
                        });
                    }
                }
            }
        }
    }

    /// The space is asked to stop: with `move_on_stop`, each running session first moves to
    /// another live space of the fleet — its standby first, then the others not being
    /// drained, from a place its id picks — as `migrate` moves it, one at a time; then
    /// [`Sessions::suspend_all`] suspends the rest. All within `stop_timeout`. Returns the
    /// sessions moved (and where), suspended, and neither (why).
    pub fn stop_all(self: &Arc<Self>) -> Stopped {
        let deadline = Instant::now() + self.cfg.stop_timeout;
        self.stopping.store(true, Ordering::SeqCst);
        let mut moved = Vec::new();
        // No space chooses this one as a standby or destination meanwhile (not kept: a
        // restart announces it as before).
        if let Some(o) = &self.cfg.owners
            && let Err(e) = o.set_draining(true)
        {
            warn!(error = %e, "cannot announce this space as draining while it stops");
        }
        if self.moves_on_stop()
            && let Some(o) = &self.cfg.owners
        {
            match o.live_spaces() {
                Ok(spaces) => {
                    let others: Vec<String> = spaces
                        .into_iter()
                        .filter(|s| s.space != o.me() && !s.draining)
                        .map(|s| s.space)
                        .collect();
                    moved = self.move_away(&others, deadline);
                }
                Err(e) => {
                    warn!(error = %e, "cannot ask etcd for the fleet's spaces; suspending the sessions here instead of moving them");
                }
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let (suspended, left) = self.suspend_all(left);
        Stopped {
            moved,
            suspended,
            left,
        }
    }

    /// Whether the space moves its running sessions away when asked to stop.
    pub fn moves_on_stop(&self) -> bool {
        self.cfg.move_on_stop && self.cfg.owners.is_some()
    }

    /// Moves each running session to one of `others` (its standby first), until `deadline`.
    fn move_away(self: &Arc<Self>, others: &[String], deadline: Instant) -> Vec<(String, String)> {
        let running: Vec<SessionInfo> = lock(&self.live)
            .values()
            .map(|l| l.info())
            .filter(|i| i.state == State::Running && i.migrating_to.is_none())
            .collect();
        let mut moved = Vec::new();
        if others.is_empty() {
            if !running.is_empty() {
                warn!(
                    "no other live space of the fleet to move the sessions to; suspending them here"
                );
            }
            return moved;
        }
        for s in running {
            let mut order = others.to_vec();
            start_where_id_picks(&s.id, &mut order);
            if let Some(standby) = &s.standby
                && let Some(i) = order.iter().position(|o| o == standby)
            {
                let standby = order.remove(i);
                order.insert(0, standby);
            }
            for to in order {
                if Instant::now() >= deadline {
                    return moved;
                }
                match self.migrate(&s.id, MigrateRequest::to(&to)) {
                    Ok(r) => {
                        info!(session = %s.id, to = %to, downtime_ms = r.downtime_ms, "moved away as the space stops");
                        moved.push((s.id.clone(), to));
                        break;
                    }
                    // The session stays here, running: the next space is tried.
                    Err(e) => {
                        warn!(session = %s.id, to = %to, error = %e.msg, "not moved there as the space stops")
                    }
                }
            }
        }
        moved
    }

    /// Every running session is suspended — a snapshot written, the record saying it is to be resumed when
    /// the space starts again. Waits at most `wait`; returns the sessions suspended and those
    /// that were not (they come back at their last snapshot, as after a crash).
    fn suspend_all(self: &Arc<Self>, wait: Duration) -> (Vec<String>, Vec<(String, String)>) {
        self.stopping.store(true, Ordering::SeqCst);
        let running: Vec<String> = lock(&self.live)
            .values()
            .map(|l| l.info())
            .filter(|i| i.state == State::Running && i.migrating_to.is_none())
            .map(|i| i.id)
            .collect();
        let (mut done, mut left) = (Vec::new(), Vec::new());
        if running.is_empty() {
            return (done, left);
        }
        info!(
            sessions = running.len(),
            "stopping: suspending the running sessions"
        );
        let (tx, rx) = mpsc::channel();
        for id in &running {
            let (me, mine, tx) = (self.clone(), id.clone(), tx.clone());
            let spawned = std::thread::Builder::new()
                .name("suspend-on-stop".into())
                .spawn(move || {
                    let id = mine;
                    let r = me.stop(&id, Request::Suspend, false).and_then(|after| {
                        if after.state != State::Suspended {
                            return Err(ApiError::conflict(format!(
                                "it is {} now",
                                after.state.name()
                            )));
                        }
                        let live = me.get(&id)?;
                        me.update(&live, |i| {
                            if i.state == State::Suspended {
                                i.resume_on_start = true;
                                i.reason = Some(
                                    "suspended when the space stopped; it goes on when the \
                                     space starts again"
                                        .into(),
                                );
                            }
                        });
                        Ok(())
                    });
                    let _ = tx.send((id, r.map_err(|e| e.msg)));
                });
            if let Err(e) = spawned {
                left.push((id.clone(), format!("cannot start a thread: {e}")));
            }
        }
        drop(tx);
        let deadline = Instant::now() + wait;
        while done.len() + left.len() < running.len() {
            let wait = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok((id, Ok(()))) => done.push(id),
                Ok((id, Err(e))) => left.push((id, e)),
                Err(_) => break,
            }
        }
        for id in &running {
            if !done.contains(id) && !left.iter().any(|(l, _)| l == id) {
                left.push((
                    id.clone(),
                    format!(
                        "not suspended within {} s (--stop-timeout)",
                        self.cfg.stop_timeout.as_secs_f64()
                    ),
                ));
            }
        }
        for (id, why) in &left {
            warn!(session = %id, error = %why, "not suspended before the space stops; it comes back at its last snapshot");
        }
        (done, left)
    }

    /// Whether the space takes new sessions now (`GET /v1/ready`): not while it stops or is
    /// drained, nor, in a fleet, while its etcd lease is not known to be alive (not yet
    /// announced, or not renewed for a TTL: standbys may be taking its sessions over).
    pub fn readiness(&self) -> Result<(), String> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err("stopping: suspending its sessions".into());
        }
        if self.draining.load(Ordering::SeqCst) {
            return Err("being drained (`drain --undo` ends that)".into());
        }
        if let Some(o) = &self.cfg.owners {
            match o.lease_renewed_age() {
                None => return Err("not yet announced in etcd".into()),
                Some(age) if age > self.cfg.lease_ttl => {
                    return Err(format!(
                        "its etcd lease was last renewed {} s ago (TTL {} s): cut off from etcd?",
                        age.as_secs(),
                        self.cfg.lease_ttl.as_secs()
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Refuses to start a guest while the space stops.
    fn refuse_if_stopping(&self) -> Result<(), ApiError> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable(
                "this space is stopping: it suspends its sessions and starts none",
            ));
        }
        Ok(())
    }

    fn recover(self: &Arc<Self>, mut info: SessionInfo) {
        let mut changed = false;
        if matches!(info.state, State::Starting | State::Running) {
            changed = true;
            // What its guest wrote into its mounts since the last snapshot is discarded with
            // its output; a resume fills fresh directories from the snapshot's trees.
            self.remove_backing(&info.id);
            if info.snapshot.is_some() {
                info.state = State::Suspended;
                info.reason = Some(
                    "the space stopped while this session ran; it is suspended at its last \
                     snapshot (output after that snapshot was discarded)"
                        .into(),
                );
            } else {
                info.state = State::Failed;
                info.reason = Some("the space stopped before this session's first snapshot".into());
            }
        }
        // Output is held only for a standby; the space stopped while it gave the session a
        // first one (`set-standby`), before it had it: nothing holds it back now.
        if info.released.is_some() && info.standby.is_none() {
            info.released = None;
            changed = true;
        }
        // In a fleet, a move the space stopped in the middle of is settled in etcd.
        let mut settle = None;
        if info.migrating_to.is_some() && info.state != State::Moved {
            // The space stopped in the middle of a migration that had not committed (here).
            settle = info.migrating_to.clone().zip(info.attempt.clone());
            info.attempt = None;
            info.migrating_to = None;
            if let Some(m) = &mut info.migration {
                m.outcome = "aborted: the source space stopped before the move committed".into();
            }
            changed = true;
        }
        let log = match self.read_log(&info) {
            Ok(l) => l,
            Err(e) => {
                warn!(session = %info.id, error = %e, "output log unreadable; starting empty");
                OutputBuffer::default()
            }
        };
        // A lent session's client goes on sending its output (from the snapshot's log on).
        if info.state != State::Lent {
            log.close();
        }
        let state = info.state;
        let pending = info.commit_pending;
        let id = info.id.clone();
        let live = Live::new(info, log);
        if changed && let Err(e) = self.save(&live.info()) {
            warn!(session = %id, error = %e, "cannot rewrite the session record");
        }
        if state == State::Prepared {
            // The record this prepared copy replaced, which an abort puts back.
            let kept = read_record(&self.replaced_path(&id))
                .ok()
                .filter(|p| p.id == id);
            if let Some(p) = kept {
                let log = self.read_log(&p).unwrap_or_default();
                log.close();
                *lock(&live.replaced) = Some(Live::new(p, log));
            }
        }
        lock(&self.live).insert(id.clone(), live.clone());
        info!(session = %id, state = state.name(), "session recovered");
        if state == State::Prepared {
            self.spawn_resolver(live);
        } else if state == State::Lent {
            // The lease counts again from now: the client may have spoken while we were down.
            self.watch_lease(live);
        } else if state == State::Moved && pending {
            self.spawn_committer(live);
        } else if let Some((to, attempt)) = settle
            && self.cfg.owners.is_some()
        {
            self.spawn_settle(live, to, attempt);
        } else if state == State::Suspended
            && let Some(k) = live.info().snapshot.and_then(|k| k.parse().ok())
        {
            // The standby may hold an older checkpoint, taken while the guest ran; one
            // suspended because the space stopped is to go on there if it takes it over.
            self.to_standby(&live, k, live.info().resume_on_start);
        }
    }

    /// The output log of a stopped session: its final log file, else its last snapshot's.
    fn read_log(&self, info: &SessionInfo) -> Result<OutputBuffer, String> {
        let file = self.log_path(&info.id);
        let final_state = matches!(info.state, State::Exited | State::Failed | State::Killed);
        if final_state && let Ok(b) = std::fs::read(&file) {
            ferry_wasi::output::Records::check(&b)?;
            return Ok(OutputBuffer::from_bytes(b));
        }
        let Some(k) = &info.snapshot else {
            return Ok(OutputBuffer::default());
        };
        let k: Kappa = k
            .parse()
            .map_err(|e: ferry_kappa::KappaParseError| e.to_string())?;
        let snap: ferry_object::Snapshot =
            ferry_object::decode(&self.store.get(&k).map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
        match snap.output {
            Some(o) => snapshot::read_output(self.store.as_ref(), &o)
                .map(OutputBuffer::from_bytes)
                .map_err(|e| e.to_string()),
            None => Ok(OutputBuffer::default()),
        }
    }

    fn record_path(&self, id: &str) -> PathBuf {
        self.cfg.dir.join("sessions").join(format!("{id}.json"))
    }

    /// Where the record a prepared copy replaced is kept until the move is decided
    /// ([`Live::replaced`]), so an abort after a restart still puts it back.
    fn replaced_path(&self, id: &str) -> PathBuf {
        self.cfg.dir.join("sessions").join(format!("{id}.replaced"))
    }

    fn log_path(&self, id: &str) -> PathBuf {
        self.cfg.dir.join("sessions").join(format!("{id}.log"))
    }

    /// Writes a record atomically and durably (temp file, fsync, rename, fsync of the dir).
    fn save(&self, info: &SessionInfo) -> std::io::Result<()> {
        save_record(&self.record_path(&info.id), info)
    }

    /// Changes a session's record, persists it, then wakes whoever waits on it.
    fn update(&self, live: &Live, f: impl FnOnce(&mut SessionInfo)) -> SessionInfo {
        let mut g = lock(&live.info);
        f(&mut g);
        let info = g.clone();
        if !live.gone.load(Ordering::SeqCst)
            && let Err(e) = self.save(&info)
        {
            warn!(session = %info.id, error = %e, "cannot write the session record");
        }
        drop(g);
        live.changed.notify_all();
        info
    }

    fn get(&self, id: &str) -> Result<Arc<Live>, ApiError> {
        session_id(id)?;
        lock(&self.live)
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("no session `{id}` in this space")))
    }

    fn runtime(&self, kind: EngineKind) -> Result<Runtime, ApiError> {
        let mut g = lock(&self.runtimes);
        if let Some(r) = g.get(&kind) {
            return Ok(r.clone());
        }
        let r = Runtime::new(kind, self.cfg.compiled_cache.clone()).map_err(ApiError::internal)?;
        g.insert(kind, r.clone());
        Ok(r)
    }

    /// The fresh directory backing mount `index` of session `id` under `root`.
    fn mount_dir(root: &Path, id: &str, index: usize) -> Result<PathBuf, ApiError> {
        let dir = root.join(id).join(index.to_string());
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .map_err(|e| ApiError::internal(format!("clearing {}: {e}", dir.display())))?;
        }
        std::fs::create_dir_all(&dir)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
        Ok(dir)
    }

    /// Session `id`'s standard streams: stdout and stderr into `log`, stdin the blob `input`
    /// (from byte `consumed` on) or nothing — or, when `open`, the session's input log, which
    /// starts with that blob and grows as input is sent.
    fn stdio(
        &self,
        id: &str,
        log: &OutputBuffer,
        input: Option<StoredInput>,
        consumed: u64,
        open: bool,
        control: &Arc<Control>,
    ) -> Result<Stdio, ApiError> {
        let stdio = Stdio::logged(log.clone());
        if open {
            let sent = self.input_log(id, input)?;
            // An answer to the input is shown at once, not a checkpoint interval later.
            if let Ok(live) = self.get(id) {
                sent.on_starving(input::answer_at_once(live, control.clone(), log.clone()));
            }
            return Ok(stdio.with_input_log(sent, input, consumed));
        }
        let Some(k) = input else {
            return Ok(stdio);
        };
        let data = k.read(self.store.as_ref()).map_err(|e| match e {
            StoredInputError::Store(ferry_store::StoreError::NotFound(_)) => {
                ApiError::unprocessable(format!(
                    "stdin {} is not in the store (send it first)",
                    k.kappa
                ))
            }
            StoredInputError::Malformed(..) => ApiError::unprocessable(e.to_string()),
            e => ApiError::internal(e),
        })?;
        Ok(stdio.with_input(data, k, consumed))
    }

    /// Remembers which directories back session `id`'s mounts, for [`Self::keep_final_files`].
    fn note_backing(&self, id: &str, grants: &[MountSpec]) {
        let dirs = grants
            .iter()
            .map(|m| (m.guest_path.clone(), m.host_dir.clone()))
            .collect();
        lock(&self.backing).insert(id.to_owned(), dirs);
    }

    /// Stores what session `id`'s mounts hold as its guest exits or fails — the only copy of
    /// what it wrote since its last snapshot — and removes the backing directories once it
    /// is stored. `None` when no guest of this session ran here.
    fn keep_final_files(&self, id: &str) -> Option<Result<Vec<MountTree>, String>> {
        let mounts = lock(&self.backing).remove(id)?;
        let kept = self.store_final_files(id, &mounts);
        if kept.is_ok() {
            self.remove_backing(id);
        }
        Some(kept)
    }

    /// Imports each mount's directory as a tree and names them with the ref `files/<id>`
    /// (one tree with a directory per mount, so garbage collection keeps them).
    fn store_final_files(
        &self,
        id: &str,
        mounts: &[(String, PathBuf)],
    ) -> Result<Vec<MountTree>, String> {
        let store = self.store.as_ref();
        let mut cache = ferry_wasi::tree::ImportCache::saved_in(store);
        let mut out = Vec::new();
        for (guest, dir) in mounts {
            let k = ferry_wasi::tree::import_cached(store, dir, &mut cache, &[])
                .map_err(|e| format!("mount `{guest}`: {e}"))?;
            out.push(MountTree {
                guest: guest.clone(),
                tree: k.to_string(),
            });
        }
        if out.is_empty() {
            return Ok(out);
        }
        self.name_final_files(id, &out)?;
        Ok(out)
    }

    /// Names the final files of session `id` — one tree with a directory per mount — with
    /// the ref `files/<id>`, so garbage collection keeps them.
    fn name_final_files(&self, id: &str, mounts: &[MountTree]) -> Result<(), String> {
        let store = self.store.as_ref();
        let mut entries = std::collections::BTreeMap::new();
        for (i, m) in mounts.iter().enumerate() {
            let object: Kappa = m.tree.parse().map_err(|e| format!("{e}"))?;
            let entry = ferry_object::TreeEntry {
                mode: "dir".into(),
                object,
                mtime_ns: None,
            };
            entries.insert(i.to_string(), entry);
        }
        let (kind, v) = ferry_object::header::<ferry_object::Tree>();
        let all = ferry_object::Tree { kind, v, entries };
        let all = store
            .put(&ferry_object::encode(&all))
            .map_err(|e| e.to_string())?;
        store.sync().map_err(|e| e.to_string())?;
        let name = format!("{}{id}", ferry_engine::gc::FILES_PREFIX);
        let next = RefValue {
            epoch: 0,
            target: all,
        };
        let cur = store.get_ref(&name).map_err(|e| e.to_string())?;
        store
            .cas_ref(&name, cur, Some(next))
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    /// Forgets and removes the directories backing session `id`'s mounts.
    fn drop_backing(&self, id: &str) {
        lock(&self.backing).remove(id);
        self.remove_backing(id);
    }

    /// Removes the directories that backed session `id`'s mounts (`<root>/<id>` under every
    /// root the policy names): a stopped guest's files live on in its snapshots and final
    /// files, and a resume fills fresh directories from those.
    fn remove_backing(&self, id: &str) {
        for root in self.cfg.policy.roots() {
            let dir = root.join(id);
            if let Err(e) = std::fs::remove_dir_all(&dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                warn!(session = %id, dir = %dir.display(), error = %e, "cannot remove a backing directory");
            }
        }
    }

    /// Mount `index` of session `id`, at `guest` with the content of `tree`, as the policy
    /// grants it: a fresh directory of this space's, filled from the tree.
    fn grant_mount(
        &self,
        id: &str,
        index: usize,
        guest: &str,
        tree: &Kappa,
        read_only: bool,
    ) -> Result<MountSpec, ApiError> {
        let grant = self
            .cfg
            .policy
            .mount(guest, read_only)
            .map_err(ApiError::forbidden)?;
        let dir = Self::mount_dir(&grant.root, id, index)?;
        // The files written are remembered: the session's next snapshot does not read them.
        let store = self.store.as_ref();
        let mut known = ferry_wasi::tree::ImportCache::saved_in(store);
        let started = std::time::Instant::now();
        let written = std::sync::atomic::AtomicU64::new(0);
        ferry_wasi::tree::materialize_counting(store, tree, &dir, &written)
            .and_then(|()| ferry_wasi::tree::remember_tree(store, tree, &dir, &mut known))
            .map_err(|e| ApiError::unprocessable(format!("mount `{guest}`: tree {tree}: {e}")))?;
        info!(
            session = %id,
            mount = guest,
            mib = written.into_inner() >> 20,
            ms = started.elapsed().as_millis() as u64,
            "mounted directory written"
        );
        if let Err(e) = known.save_in(store) {
            warn!(session = %id, error = %e, "could not save the mount import cache");
        }
        Ok(MountSpec {
            guest_path: guest.to_owned(),
            host_dir: dir,
            read_only: grant.read_only,
            host_bound: false,
        })
    }

    /// Resolving, Verifying and Admitting snapshot κ for session `id`: its closure verifies,
    /// the policy grants its env, memory and mounts (re-materialised from its trees), and its
    /// WASI context is rebuilt with a fresh output log holding the snapshot's.
    fn admit(
        &self,
        id: &str,
        k: Kappa,
        control: &Arc<Control>,
    ) -> Result<(Box<snapshot::Loaded>, WasiCtx, OutputBuffer), ApiError> {
        let policy = &self.cfg.policy;
        let store = self.store.as_ref();
        let loaded = snapshot::load(store, k).map_err(|e| engine_refusal(&e))?;
        policy.env(&loaded.wasi.env).map_err(ApiError::forbidden)?;
        policy
            .memory(loaded.memory_bytes())
            .map_err(ApiError::forbidden)?;
        // A space grants mounts from a snapshot's trees; a host-bound mount has none to give.
        if let Some(m) = loaded.wasi.mounts.iter().find(|m| m.host_bound) {
            return Err(ApiError::unprocessable(format!(
                "snapshot {k} is host-bound: `{}` was the host directory {} passed through \
                 (`ferry run --bind`), which the snapshot does not carry; resume it with \
                 `ferry resume` on a machine that has that directory",
                m.guest_path, m.host_hint
            )));
        }
        let grants = loaded
            .wasi
            .mounts
            .iter()
            .enumerate()
            .map(|(i, m)| self.grant_mount(id, i, &m.guest_path, &m.tree, false))
            .collect::<Result<Vec<_>, _>>()?;
        self.note_backing(id, &grants);
        let log = OutputBuffer::from_bytes(loaded.output.clone().unwrap_or_default());
        let stdio = self.stdio(
            id,
            &log,
            StoredInput::of(&loaded.wasi),
            loaded.wasi.stdin_bytes,
            loaded.wasi.stdin_open,
            control,
        )?;
        let wasi = WasiCtx::restore(
            &loaded.wasi,
            grants,
            stdio,
            Box::new(HostClock::default()),
            control.interrupt(),
            store,
        )
        .map_err(ApiError::forbidden)?;
        Ok((Box::new(loaded), wasi, log))
    }

    /// Admits and prepares a guest (on its own thread): policy, mounts, module, WASI state.
    fn setup(
        &self,
        id: &str,
        program: &str,
        begin: Begin,
        engine: EngineKind,
        control: &Arc<Control>,
    ) -> Result<Ready, ApiError> {
        let policy = &self.cfg.policy;
        policy.engine(engine).map_err(ApiError::forbidden)?;
        let runtime = self.runtime(engine)?;
        let store = self.store.as_ref();
        let progress = |msg: &str| info!(session = %id, "{msg}");
        match begin {
            Begin::Fresh {
                module,
                args,
                env,
                mounts,
                main,
                stdin,
                interactive,
            } => {
                policy.env(&env).map_err(ApiError::forbidden)?;
                let grants = mounts
                    .iter()
                    .enumerate()
                    .map(|(i, (g, t, ro))| self.grant_mount(id, i, g, t, *ro))
                    .collect::<Result<Vec<_>, _>>()?;
                self.note_backing(id, &grants);
                let prepared = runtime
                    .prepare_kappa(store, module, &progress)
                    .map_err(|e| engine_refusal(&e))?;
                let log = OutputBuffer::default();
                let stdin = stdin.map(StoredInput::blob);
                let stdio = self.stdio(id, &log, stdin, 0, interactive, control)?;
                let wasi = WasiCtx::new(
                    args,
                    env,
                    grants,
                    stdio,
                    Box::new(HostClock::default()),
                    control.interrupt(),
                )
                .map_err(ApiError::unprocessable)?;
                Ok(Ready {
                    runtime,
                    prepared,
                    wasi,
                    start: Start::Fresh,
                    meta: SnapshotMeta {
                        main,
                        ..SnapshotMeta::fresh(program)
                    },
                    log,
                })
            }
            Begin::Resume(k) => {
                let (loaded, wasi, log) = self.admit(id, k, control)?;
                let prepared = runtime
                    .prepare_snapshot(store, &loaded.snapshot, policy.other_versions(), &progress)
                    .map_err(|e| engine_refusal(&e))?;
                let meta = SnapshotMeta {
                    program: loaded.snapshot.program.clone(),
                    parent: Some(k),
                    generation: loaded.snapshot.generation,
                    main: loaded.snapshot.main.clone(),
                };
                Ok(Ready {
                    runtime,
                    prepared,
                    wasi,
                    start: Start::Restore(loaded),
                    meta,
                    log,
                })
            }
        }
    }

    /// Starts `live`'s guest on a thread of its own and waits until it runs — or, with
    /// `hold`, until it is restored and held for a migration's decision.
    fn start(
        self: &Arc<Self>,
        live: &Arc<Live>,
        begin: Begin,
        engine: EngineKind,
        hold: bool,
    ) -> Result<(), ApiError> {
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), ApiError>>();
        let control = Arc::new(Control::new());
        if let Some(max) = self.cfg.policy.max_memory {
            control.limit_memory(max);
        }
        let info = live.info();
        if info.checkpoint_every_ms.is_some() {
            // As `ferry run --checkpoint-every`: each checkpoint (periodic, asked for, or a
            // migration's pre-copy round) comes after a pass that copies the changed memory
            // while the guest runs, so the guest pauses only for what it wrote meanwhile.
            control.pre_write_before_checkpoints_unless_off();
        }
        if hold {
            let (htx, hrx) = mpsc::channel::<HoldCmd>();
            *lock(&live.hold) = Some(htx);
            let (me, l, rtx) = (self.clone(), live.clone(), ready_tx.clone());
            let c = control.clone();
            let mut first = true;
            let mut answer: Option<mpsc::Sender<Result<(), ApiError>>> = None;
            control.hold_after_restore(move || {
                if std::mem::take(&mut first) {
                    me.update(&l, |i| i.state = State::Prepared);
                    let _ = rtx.send(Ok(()));
                }
                if let Some(a) = answer.take() {
                    // The previous patch is applied.
                    let _ = a.send(Ok(()));
                }
                loop {
                    match hrx.recv() {
                        Ok(HoldCmd::Commit) => {
                            me.update(&l, |i| i.state = State::Running);
                            return ferry_engine::Hold::Run;
                        }
                        Ok(HoldCmd::Abort) | Err(_) => return ferry_engine::Hold::Abort,
                        Ok(HoldCmd::Patch(k, reply)) => {
                            let id = l.info().id;
                            match me.admit(&id, k, &c) {
                                Ok((loaded, wasi, log)) => {
                                    *lock(&l.log) = log;
                                    answer = Some(reply);
                                    return ferry_engine::Hold::Patch(loaded, Box::new(wasi));
                                }
                                Err(e) => {
                                    let _ = reply.send(Err(e));
                                }
                            }
                        }
                    }
                }
            });
        }
        let (me, l) = (self.clone(), live.clone());
        std::thread::Builder::new()
            .name(format!("session-{}", info.id))
            .stack_size(GUEST_STACK)
            .spawn(move || {
                let mine = l.run.fetch_add(1, Ordering::SeqCst) + 1;
                let ready = match me.setup(&info.id, &info.program, begin, engine, &control) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                *lock(&l.log) = ready.log.clone();
                *lock(&l.control) = Some(control.clone());
                if let Some(ms) = info.checkpoint_every_ms {
                    spawn_checkpointer(l.clone(), mine, control.clone(), Duration::from_millis(ms));
                }
                l.kill.store(false, Ordering::SeqCst);
                if !hold {
                    me.update(&l, |i| {
                        i.state = State::Running;
                        i.engine = engine.name().into();
                        i.reason = None;
                        i.exit_code = None;
                        i.resume_on_start = false;
                    });
                    let _ = ready_tx.send(Ok(()));
                }
                *lock(&l.snapshot_at) = Some(Instant::now());
                let metrics = me.cfg.metrics.clone();
                let c = control.clone();
                let mut on_snapshot = |r: Result<Kappa, EngineError>, why: Request| match r {
                    Ok(k) => {
                        if let Some(d) = c.last_write() {
                            metrics.snapshot_write.observe(d);
                        }
                        match why {
                            Request::Suspend => &metrics.suspends,
                            _ => &metrics.checkpoints,
                        }
                        .fetch_add(1, Ordering::Relaxed);
                        me.snapshotted(&l, k);
                        // Suspended because the space stops: it is to go on, here when the
                        // space is back, or at its standby if that takes it over first.
                        let goes_on =
                            why != Request::Suspend || me.stopping.load(Ordering::SeqCst);
                        me.to_standby(&l, k, goes_on);
                        if why == Request::Suspend {
                            // The guest will not run again: say so now, before the engine
                            // tears the instance down (unmapping a large memory takes a while).
                            me.stopped(&l, Ok(Outcome::Suspended(k)));
                            let wait = lock(&l.defer_teardown).take();
                            if let Some(rx) = wait {
                                let _ = rx.recv_timeout(Duration::from_secs(60));
                            }
                        }
                    }
                    Err(e) => {
                        metrics.snapshot_failures.fetch_add(1, Ordering::Relaxed);
                        warn!(session = %l.info().id, error = %e, "snapshot failed; the guest keeps running");
                        me.update(&l, |i| {
                            i.snapshot_error = Some(e.to_string());
                            i.snapshot_failures += 1;
                        });
                    }
                };
                let outcome = ready.runtime.run(
                    &ready.prepared,
                    ready.wasi,
                    control,
                    ready.start,
                    me.store.as_ref(),
                    ready.meta,
                    &mut on_snapshot,
                );
                if let Err(e) = &outcome {
                    // A hold that never got to its decision: the caller hears why.
                    let _ = ready_tx.send(Err(engine_refusal(e)));
                }
                if l.run.load(Ordering::SeqCst) == mine {
                    *lock(&l.control) = None;
                    me.stopped(&l, outcome);
                }
            })
            .map_err(|e| ApiError::internal(format!("cannot start a guest thread: {e}")))?;
        ready_rx
            .recv()
            .unwrap_or_else(|_| Err(ApiError::internal("the guest thread ended unexpectedly")))
    }

    /// A snapshot was written: the record and the session's ref point at it.
    fn snapshotted(&self, live: &Live, k: Kappa) {
        *lock(&live.snapshot_at) = Some(Instant::now());
        let info = self.update(live, |i| {
            i.snapshot = Some(k.to_string());
            i.snapshot_error = None;
        });
        self.point_ref(&info, k);
    }

    /// The guest stopped (or is about to: its final snapshot is written): the record says
    /// how, once — later calls for the same stop change nothing.
    fn stopped(&self, live: &Live, outcome: Result<Outcome, EngineError>) {
        let log = live.log();
        log.close();
        let info = live.info();
        if live.gone.load(Ordering::SeqCst) || info.state != State::Running {
            // Never ran here (an aborted or failed prepare: whoever started it decides), or
            // this stop was already recorded.
            return;
        }
        let killed = live.kill.load(Ordering::SeqCst);
        let ends = !matches!(outcome, Ok(Outcome::Suspended(_))) || killed;
        // A session with a standby: nothing may take it over once its end is recorded.
        let had_standby = live.info().standby.is_some();
        if ends && !self.end_standby(live) {
            return;
        }
        fault("final-files");
        // Before the record says the guest stopped: until then nothing can resume it (into
        // fresh directories at the same paths).
        let files = match &outcome {
            Ok(Outcome::Exited(_)) | Err(_) => self.keep_final_files(&info.id),
            Ok(Outcome::Suspended(_)) => {
                // The snapshot holds what the mounts held; a resume fills fresh directories.
                self.drop_backing(&info.id);
                None
            }
        };
        let shown = log.len();
        let info = self.update(live, |i| {
            if ends && i.released.is_some() {
                // All of its output is shown now.
                i.released = Some(shown);
            }
            record_stop(i, &outcome, killed, files);
        });
        let ended = match info.state {
            State::Exited => Some(Ended::Exited),
            State::Failed => Some(Ended::Failed),
            State::Killed => Some(Ended::Killed),
            _ => None,
        };
        if let Some(how) = ended {
            self.cfg.metrics.ended(how);
        }
        if ends && !had_standby && info.standby.is_some() {
            // A standby given while the guest ended (`set-standby`): its record goes too.
            self.end_standby(live);
        }
        if matches!(info.state, State::Exited | State::Failed | State::Killed)
            && let Err(e) = write_durably(&self.log_path(&info.id), &log.bytes())
        {
            warn!(session = %info.id, error = %e, "cannot write the output log");
        }
        info!(session = %info.id, state = info.state.name(), "guest stopped");
    }

    // ---- the API ----

    pub fn list(&self) -> Vec<SessionInfo> {
        let mut v: Vec<_> = lock(&self.live).values().map(|l| l.info()).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// What the sessions hold now, for `GET /v1/metrics`.
    pub fn gauges(&self) -> crate::metrics::Gauges {
        let now = Instant::now();
        let mut g = crate::metrics::Gauges {
            draining: self.draining.load(Ordering::SeqCst),
            lease_renewed_age: self.cfg.owners.as_ref().and_then(|o| o.lease_renewed_age()),
            ..Default::default()
        };
        let mut states: Vec<(State, u64)> = State::ALL.iter().map(|s| (*s, 0)).collect();
        for l in lock(&self.live).values() {
            let i = l.info();
            if let Some(n) = states.iter_mut().find(|(s, _)| *s == i.state) {
                n.1 += 1;
            }
            if let Some(r) = i.released
                && matches!(i.state, State::Starting | State::Running | State::Suspended)
            {
                g.output_held_bytes += l.log().len().saturating_sub(r);
            }
            let keeps = matches!(i.state, State::Running | State::Suspended);
            if keeps && i.standby_error.is_some() {
                g.standby_failing += 1;
            }
            if i.end_waits.is_some() {
                g.end_waiting += 1;
            }
            if i.state == State::Running
                && i.checkpoint_every_ms.is_some()
                && let Some(at) = *lock(&l.snapshot_at)
            {
                let age = now.saturating_duration_since(at);
                g.oldest_checkpoint_age = g.oldest_checkpoint_age.max(Some(age));
            }
        }
        g.states = states;
        g
    }

    /// `POST /v1/drain`: this space is being drained (`on`), or not any more. While it is,
    /// no new session runs here and none moves in, and (in a fleet) its announcement says
    /// so, so that no space chooses it as a standby.
    /// The mark is kept in the space's directory, so a space restarted while drained stays
    /// drained.
    pub fn set_draining(&self, on: bool) -> Result<crate::api::Draining, ApiError> {
        let path = self.draining_path();
        let kept = if on {
            write_durably(
                &path,
                b"drained with `ferry drain`; `ferry drain --undo` ends it\n",
            )
        } else {
            std::fs::remove_file(&path).or_else(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Ok(()),
                _ => Err(e),
            })
        };
        kept.map_err(|e| {
            ApiError::internal(format!(
                "cannot {} the draining mark {}: {e}",
                if on { "write" } else { "remove" },
                path.display()
            ))
        })?;
        self.draining.store(on, Ordering::SeqCst);
        if let Some(o) = &self.cfg.owners {
            o.set_draining(on).map_err(|e| {
                ApiError::unavailable(format!(
                    "this space is {}draining, but etcd could not be told: {e}",
                    if on { "" } else { "no longer " }
                ))
            })?;
        }
        info!(draining = on, "drain");
        Ok(crate::api::Draining { draining: on })
    }

    /// Where the draining mark is kept while the space is being drained.
    fn draining_path(&self) -> PathBuf {
        self.cfg.dir.join("draining")
    }

    fn refuse_if_draining(&self, what: &str) -> Result<(), ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable(format!(
                "this space is being drained and {what} (`ferry --space {} drain --undo` \
                 ends that)",
                self.cfg.advertise
            )));
        }
        Ok(())
    }

    pub fn info(&self, id: &str) -> Result<SessionInfo, ApiError> {
        Ok(self.get(id)?.info())
    }

    /// `POST /v1/sessions`.
    pub fn run(self: &Arc<Self>, req: RunRequest) -> Result<SessionInfo, ApiError> {
        self.refuse_if_stopping()?;
        self.refuse_if_draining("runs no new session")?;
        let module = parse_kappa(&req.module, "module")?;
        let engine = parse_engine(req.engine.as_deref(), EngineKind::Jit)?;
        if req
            .checkpoint_every_ms
            .is_some_and(|ms| ms < MIN_CHECKPOINT_MS)
        {
            return Err(ApiError::bad_request(format!(
                "checkpoint_every_ms must be at least {MIN_CHECKPOINT_MS}"
            )));
        }
        if !self.store.has(&module).map_err(ApiError::internal)? {
            return Err(ApiError::not_found(format!(
                "module {module} is not in this space's store; send it first"
            )));
        }
        let mut mounts = Vec::new();
        for m in &req.mounts {
            if !(m.guest.starts_with('/') || m.guest == ".") {
                return Err(ApiError::bad_request(format!(
                    "mount `{}`: guest paths are absolute (or `.`)",
                    m.guest
                )));
            }
            mounts.push((m.guest.clone(), parse_kappa(&m.tree, "tree")?, m.read_only));
        }
        let id = req
            .session
            .clone()
            .unwrap_or_else(|| format!("{:08x}", rand::random::<u32>()));
        session_id(&id)?;
        if let Some(m) = &req.main
            && (m.is_empty() || m.len() > 256 || m.starts_with("ferry:"))
        {
            return Err(ApiError::bad_request(format!(
                "`{m}` cannot be an entry export"
            )));
        }
        let stdin = match &req.stdin {
            Some(k) => Some(parse_kappa(k, "stdin")?),
            None => None,
        };
        let standby_auto = req.standby.as_deref() == Some(standby::AUTO);
        let standby = match &req.standby {
            Some(to) => {
                let need = crate::api::AdmissionCheck {
                    engine: Some(engine.name().into()),
                    env: req.env.iter().map(|(k, _)| k.clone()).collect(),
                    mounts: req.mounts.iter().map(|m| m.guest.clone()).collect(),
                    memory_bytes: None,
                };
                Some(if standby_auto {
                    self.choose_standby(&id, req.checkpoint_every_ms, &need, &[], false)?
                } else {
                    self.check_standby(to, req.checkpoint_every_ms, &need)?
                })
            }
            None => None,
        };
        let live = {
            let mut g = lock(&self.live);
            if g.contains_key(&id) {
                return Err(ApiError::conflict(format!(
                    "session `{id}` already exists here"
                )));
            }
            let live = Live::new(
                SessionInfo {
                    checkpoint_every_ms: req.checkpoint_every_ms,
                    released: standby.as_ref().map(|_| 0),
                    standby: standby.clone(),
                    standby_auto,
                    interactive: req.interactive,
                    ..SessionInfo::starting(&id, &req.program, engine.name(), 1)
                },
                OutputBuffer::default(),
            );
            g.insert(id.clone(), live.clone());
            live
        };
        // In a fleet, the session id becomes this space's in etcd first.
        if let Some(o) = &self.cfg.owners {
            let refusal = match o.claim(&id, 1) {
                Ok(Claim::Mine(_)) => match &standby {
                    None => None,
                    Some(to) => match o.set_standby(&id, 1, to) {
                        Ok(true) => None,
                        Ok(false) => Some(ApiError::conflict(format!(
                            "session `{id}` changed owner in etcd while it was started"
                        ))),
                        Err(e) => Some(ApiError::unavailable(format!(
                            "cannot record the standby of session `{id}` in etcd: {e}"
                        ))),
                    },
                },
                Ok(Claim::Taken(t)) => Some(ApiError::conflict(format!(
                    "session `{id}` belongs to {} (epoch {}, in etcd); choose another id",
                    t.owner.space, t.owner.epoch
                ))),
                Err(e) => Some(ApiError::unavailable(format!(
                    "cannot record session `{id}` as this space's in etcd: {e}"
                ))),
            };
            if let Some(e) = refusal {
                live.gone.store(true, Ordering::SeqCst);
                lock(&self.live).remove(&id);
                return Err(e);
            }
        }
        let begin = Begin::Fresh {
            module,
            args: req.args,
            env: req.env,
            mounts,
            main: req.main,
            stdin,
            interactive: req.interactive,
        };
        if let Err(e) = self.start(&live, begin, engine, false) {
            live.gone.store(true, Ordering::SeqCst);
            lock(&self.live).remove(&id);
            self.drop_backing(&id);
            self.drop_input(&id);
            if let Some(o) = &self.cfg.owners
                && let Err(e) = o.release(&id)
            {
                warn!(session = %id, error = %e, "cannot remove the owner record of a session that did not start");
            }
            return Err(e);
        }
        self.cfg
            .metrics
            .sessions_started
            .fetch_add(1, Ordering::Relaxed);
        info!(session = %id, program = %req.program, "session started");
        Ok(live.info())
    }

    /// `POST /v1/sessions/{id}/resume`: continues a suspended session here.
    pub fn resume(self: &Arc<Self>, id: &str, req: ResumeRequest) -> Result<SessionInfo, ApiError> {
        let live = self.get(id)?;
        let _turn = lock(&live.turn);
        let info = live.info();
        match info.state {
            State::Suspended => {}
            State::Lent => return Err(lend::lent_refusal(&info)),
            State::Moved => {
                return Err(ApiError::conflict(format!(
                    "session `{id}` moved to {} (epoch {}); it is resumed there, not here",
                    info.moved_to.unwrap_or_default(),
                    info.epoch
                )));
            }
            s => {
                return Err(ApiError::conflict(format!(
                    "session `{id}` is {}; only a suspended session can be resumed",
                    s.name()
                )));
            }
        }
        self.refuse_if_stopping()?;
        let k = parse_kappa(info.snapshot.as_deref().unwrap_or(""), "snapshot")?;
        let engine = parse_engine(req.engine.as_deref(), engine_of(&live))?;
        self.check_owner(&live)?;
        self.start(&live, Begin::Resume(k), engine, false)?;
        Ok(live.info())
    }

    /// In a fleet (`owners`): that etcd names this space as the session's owner at the epoch
    /// it holds here — a session from before the space used etcd is claimed. A session etcd
    /// says moved on (a move committed there whose record here was never written: this
    /// space stopped in between) is marked moved here, and refused. Without owners: `None`.
    fn check_owner(self: &Arc<Self>, live: &Arc<Live>) -> Result<Option<Owned>, ApiError> {
        let Some(o) = &self.cfg.owners else {
            return Ok(None);
        };
        let info = live.info();
        let unreachable = |e| etcd_unreachable(&info.id, e);
        let found = match o.owner(&info.id).map_err(unreachable)? {
            Some(r) if r.owner.space == o.me() && r.owner.epoch == info.epoch => {
                return Ok(Some(r));
            }
            // A lend and its return or reclaim raised the epoch here, where the session is.
            Some(r) if r.owner.space == o.me() && r.owner.epoch < info.epoch => {
                match o.claim(&info.id, info.epoch).map_err(unreachable)? {
                    Claim::Mine(r) => return Ok(Some(r)),
                    Claim::Taken(r) => r,
                }
            }
            Some(r) => r,
            None => match o.claim(&info.id, info.epoch).map_err(unreachable)? {
                Claim::Mine(r) => return Ok(Some(r)),
                Claim::Taken(r) => r,
            },
        };
        let Owner { space, epoch } = found.owner;
        if space != o.me() && epoch > info.epoch {
            self.update(live, |i| {
                i.state = State::Moved;
                i.moved_to = Some(space.clone());
                i.epoch = epoch;
                i.migrating_to = None;
                i.reason = Some(format!(
                    "etcd records that it moved to {space} (epoch {epoch})"
                ));
            });
            warn!(session = %info.id, to = %space, epoch, "etcd says this session moved on; fenced here");
            return Err(ApiError::conflict(format!(
                "session `{}` moved to {space} (epoch {epoch}, recorded in etcd); it is \
                 resumed there, not here",
                info.id
            )));
        }
        Err(ApiError::conflict(format!(
            "etcd names {space} (epoch {epoch}) as the owner of session `{}`, not this space \
             at epoch {}",
            info.id, info.epoch
        )))
    }

    /// Forgets a finished session (exited, failed, killed, or moved away with the move
    /// delivered) — or, with `force`, a suspended one, which can then no longer be resumed —
    /// so that garbage collection can reclaim its snapshots: its ref, record and output log
    /// go (the ref first: if the space stops halfway, the session is still listed and this can
    /// be asked again). Refused while the session runs, is held by a migration or is moving.
    pub fn forget(&self, id: &str, force: bool) -> Result<(), ApiError> {
        let live = self.get(id)?;
        let _turn = lock(&live.turn);
        let info = live.info();
        match info.state {
            State::Lent => return Err(lend::lent_refusal(&info)),
            State::Starting | State::Running | State::Prepared => {
                return Err(ApiError::conflict(format!(
                    "session `{id}` is {}; suspend or kill it first",
                    info.state.name()
                )));
            }
            State::Standby => {
                return Err(ApiError::conflict(format!(
                    "session `{id}` is a standby copy of {}'s session; it goes when the \
                     session ends or is forgotten there",
                    info.source.as_deref().unwrap_or("another space")
                )));
            }
            // A move under way, or committed but not yet heard of by the destination.
            _ if info.migrating_to.is_some() || info.commit_pending => {
                return Err(ApiError::conflict(format!(
                    "session `{id}` is moving; try again once the move is over"
                )));
            }
            State::Suspended if !force => {
                return Err(ApiError::conflict(format!(
                    "session `{id}` can still be resumed (suspended); forget it with force \
                     (`ferry --space URL rm --force {id}`), and its snapshots go at the next \
                     garbage collection"
                )));
            }
            _ => {}
        }
        if let Some(o) = &self.cfg.owners
            && info.state != State::Moved
        {
            o.release(id).map_err(|e| {
                ApiError::unavailable(format!(
                    "cannot remove session `{id}`'s owner record from etcd: {e}"
                ))
            })?;
        }
        self.remove_traces(&live, id)?;
        info!(session = %id, "session forgotten");
        Ok(())
    }

    /// Removes what this space keeps of session `id` — its refs first (if the space stops
    /// halfway, the session is still listed and this can be asked again), then its live
    /// entry, backing directories, record and output log.
    fn remove_traces(&self, live: &Live, id: &str) -> Result<(), ApiError> {
        let files = format!("{}{id}", ferry_engine::gc::FILES_PREFIX);
        for name in [format!("session/{id}"), files] {
            if let Some(current) = self.store.get_ref(&name).map_err(ApiError::internal)? {
                self.store
                    .cas_ref(&name, Some(current), None)
                    .map_err(ApiError::internal)?;
            }
        }
        live.gone.store(true, Ordering::SeqCst);
        lock(&self.live).remove(id);
        self.drop_backing(id);
        self.drop_input(id);
        for p in [self.record_path(id), self.log_path(id)] {
            match std::fs::remove_file(&p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(ApiError::internal(format!("{}: {e}", p.display())));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// `GET /v1/sessions/{id}/files`: the trees of the session's mounts — kept as its guest
    /// exited or failed, else those of its latest snapshot.
    pub fn files(&self, id: &str) -> Result<SessionFiles, ApiError> {
        let info = self.get(id)?.info();
        let files = |snapshot: Option<String>, mounts| SessionFiles {
            id: id.to_owned(),
            state: info.state,
            snapshot,
            mounts,
        };
        if let Some(m) = &info.final_files {
            return Ok(files(None, m.clone()));
        }
        if let Some(e) = &info.final_files_error {
            return Err(ApiError::unprocessable(format!(
                "the space could not keep the files session `{id}` left: {e}"
            )));
        }
        if info.state == State::Moved {
            return Err(ApiError::conflict(format!(
                "session `{id}` moved to {}; ask that space",
                info.moved_to.as_deref().unwrap_or("another space")
            )));
        }
        let Some(snap) = &info.snapshot else {
            return Err(ApiError::conflict(format!(
                "session `{id}` is {} and has no snapshot yet: checkpoint it first \
                 (`ferry --space URL checkpoint {id}`)",
                info.state.name()
            )));
        };
        let k = parse_kappa(snap, "snapshot")?;
        let read = |k: &Kappa| self.store.get(k).map_err(ApiError::internal);
        let snapshot: ferry_object::Snapshot =
            ferry_object::decode(&read(&k)?).map_err(ApiError::internal)?;
        let wasi: ferry_object::WasiState =
            ferry_object::decode(&read(&snapshot.wasi)?).map_err(ApiError::internal)?;
        let mounts = wasi
            .mounts
            .iter()
            .filter(|m| !m.host_bound)
            .map(|m| MountTree {
                guest: m.guest_path.clone(),
                tree: m.tree.to_string(),
            })
            .collect();
        Ok(files(Some(snap.clone()), mounts))
    }

    /// Asks a running session for a snapshot: `suspend` stops it there, `checkpoint` keeps it
    /// running. Waits until the snapshot is written.
    pub fn stop(&self, id: &str, r: Request, kill: bool) -> Result<SessionInfo, ApiError> {
        let live = self.get(id)?;
        let info = live.info();
        if kill && info.state == State::Suspended {
            if !self.end_standby(&live) {
                return Err(ApiError::conflict(format!(
                    "session `{id}` was taken over by its standby; it is killed there, not here"
                )));
            }
            return Ok(self.update(&live, |i| {
                i.state = State::Killed;
                if i.released.is_some() {
                    i.released = Some(live.log().len());
                }
            }));
        }
        if info.state == State::Lent {
            return Err(lend::lent_refusal(&info));
        }
        if info.state != State::Running {
            return Err(ApiError::conflict(format!(
                "session `{id}` is {}, not running",
                info.state.name()
            )));
        }
        let Some(control) = lock(&live.control).clone() else {
            // The guest has ended and its stop is being recorded (its files are being kept):
            // the answer says how it ended, as the record will.
            let after = live.wait_while(STOP_TIMEOUT, |i| i.state == State::Running);
            return Err(ApiError::conflict(format!(
                "session `{id}` is {}, not running",
                if after.state == State::Running {
                    "ending"
                } else {
                    after.state.name()
                }
            )));
        };
        if kill {
            live.kill.store(true, Ordering::SeqCst);
            // A kill stops the guest even when its snapshot cannot be written.
            control.end_without_snapshot(true);
        }
        let before = info.snapshot.clone();
        let failures = info.snapshot_failures;
        match r {
            // After a pass of the pre-writer where the session has one.
            Request::Checkpoint => control.request_checkpoint(),
            _ => control.request(r),
        }
        let waiting = |i: &SessionInfo| match r {
            Request::Suspend => i.state.is_live(),
            _ => i.snapshot == before && i.state.is_live(),
        };
        let after = live.wait_while(STOP_TIMEOUT, |i| {
            waiting(i) && (kill || i.snapshot_failures == failures)
        });
        if !kill && waiting(&after) && after.snapshot_failures != failures {
            return Err(ApiError::internal(format!(
                "session `{id}` could not write its snapshot and keeps running: {}",
                after
                    .snapshot_error
                    .as_deref()
                    .unwrap_or("no reason recorded")
            )));
        }
        if r == Request::Suspend && after.state.is_live() {
            return Err(ApiError::unavailable(format!(
                "session `{id}` did not reach a safe point within {} s",
                STOP_TIMEOUT.as_secs()
            )));
        }
        Ok(after)
    }

    /// The output log from `from` on (whole records), waiting up to `wait` for more while the
    /// session is live, and where those records start: `from`, unless `from` falls inside a
    /// record — a reader that followed an earlier run of the guest, whose output past its last
    /// snapshot came out otherwise when the guest redid it after a crash —, then the next
    /// record boundary ([`OutputBuffer::read_on`]).
    pub fn logs(
        &self,
        id: &str,
        from: u64,
        wait: Duration,
    ) -> Result<(u64, Vec<u8>, SessionInfo), ApiError> {
        let live = self.get(id)?;
        let log = live.log();
        // Read before the hold is: a hold set meanwhile (`set-standby` giving a session its
        // first standby) then covers all that this call shows.
        let len = log.len();
        let info = live.info();
        if info.state == State::Standby {
            // A standby copy: the output its latest checkpoint holds (read when asked; the
            // copy runs nothing, so there is nothing to wait for).
            let log = self.read_log(&info).map_err(|e| {
                ApiError::internal(format!("the output of standby copy `{id}`: {e}"))
            })?;
            let (start, bytes, _) = log.read_on(from, 1 << 20);
            return Ok((start, bytes, info));
        }
        if let Some(shown) = info.released {
            // With a standby: only what a checkpoint it holds covers.
            let info = if wait.is_zero() || shown > from || !info.state.is_live() {
                info
            } else {
                // A new standby ends the wait too: a reader following the session learns
                // which space would take it over.
                live.wait_while(wait, |i| {
                    i.released.unwrap_or(0) <= from
                        && i.state.is_live()
                        && i.standby == info.standby
                })
            };
            let shown = info.released.unwrap_or(0);
            let (start, mut bytes, _) = log.read_on(from, 1 << 20);
            // `shown` is a record boundary (a snapshot's log length), as `start` is.
            bytes.truncate(usize::try_from(shown.saturating_sub(start)).unwrap_or(usize::MAX));
            return Ok((start, bytes, info));
        }
        if !wait.is_zero() && len <= from && info.state.is_live() {
            // Looking every second whether the session was given a standby meanwhile.
            let deadline = Instant::now() + wait;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                log.wait_beyond(from, left.min(Duration::from_secs(1)));
                if log.len() > from {
                    break;
                }
                let now = live.info();
                if !now.state.is_live() || now.standby.is_some() {
                    break;
                }
            }
            return self.logs(id, from, Duration::ZERO);
        }
        let (start, mut bytes, _) = log.read_on(from, 1 << 20);
        bytes.truncate(usize::try_from(len.saturating_sub(start)).unwrap_or(usize::MAX));
        Ok((start, bytes, info))
    }

    /// Waits (at most `timeout`) until the session is no longer live here (nor a standby
    /// copy).
    pub fn wait(&self, id: &str, timeout: Duration) -> Result<SessionInfo, ApiError> {
        let live = self.get(id)?;
        let standby = live.info().standby;
        Ok(live.wait_while(timeout, |i| {
            // A standby copy: until it is taken over (and then ends here) or dropped. A new
            // standby ends the wait too: a waiter following the session learns which space
            // would take it over. A session this space suspended when it stopped is about
            // to be resumed now that it runs again (unless that fails, which clears the
            // mark); while the space is stopping, the mark ends the wait instead.
            let to_resume = i.state == State::Suspended
                && i.resume_on_start
                && !self.stopping.load(Ordering::SeqCst);
            (i.state.is_live()
                || to_resume
                || i.state == State::Standby
                || (i.migrating_to.is_some() && i.state != State::Moved))
                && i.standby == standby
        }))
    }

    // ---- migration, source side ----

    /// `POST /v1/sessions/{id}/migrate`: pre-copy while the guest runs, pause, final delta,
    /// prepare on the destination, commit (the record of the move), tell the destination.
    /// Any failure before the commit leaves the session here, running as before.
    pub fn migrate(
        self: &Arc<Self>,
        id: &str,
        req: MigrateRequest,
    ) -> Result<MigrationReport, ApiError> {
        let live = self.get(id)?;
        let _turn = lock(&live.turn);
        let info = live.info();
        let was_running = match info.state {
            State::Running => true,
            State::Suspended => false,
            State::Lent => return Err(lend::lent_refusal(&info)),
            s => {
                return Err(ApiError::conflict(format!(
                    "session `{id}` is {}; only a running or suspended session can move",
                    s.name()
                )));
            }
        };
        let to = req.to.trim_end_matches('/').to_owned();
        if to == self.cfg.advertise.trim_end_matches('/') {
            return Err(ApiError::bad_request("the destination is this space"));
        }
        if req.max_pause_ms == Some(0) {
            return Err(ApiError::bad_request("max_pause_ms must be at least 1"));
        }
        let engine = parse_engine(req.engine.as_deref(), engine_of(&live))?;
        let dest = SpaceClient::new(&to, &self.cfg.peer_token);
        let dest_store = dest.store();
        dest.health()
            .map_err(|e| ApiError::unavailable(format!("the destination is unreachable: {e}")))?;
        // In a fleet, only the owner etcd names moves a session; the owner record's revision
        // is what the commit compares.
        let owned = self.check_owner(&live)?;
        let attempt = format!("{:016x}", rand::random::<u64>());
        let started = Instant::now();
        let mut report = MigrationReport {
            to: to.clone(),
            rounds: Vec::new(),
            final_snapshot: None,
            final_objects: 0,
            final_bytes: 0,
            total_bytes: 0,
            memory_bytes: 0,
            downtime_ms: 0,
            steps: String::new(),
            total_ms: 0,
            outcome: "in progress".into(),
            standby: None,
            held_ms: None,
        };
        self.update(&live, |i| {
            i.migrating_to = Some(to.clone());
            i.attempt = Some(attempt.clone());
            i.migration = Some(report.clone());
        });
        let r = self.migrate_steps(
            &live,
            &to,
            &req,
            engine,
            was_running,
            Move {
                attempt: &attempt,
                owned: owned.as_ref(),
                dest_store: &dest_store,
                dest: &dest,
            },
            &mut report,
            started,
        );
        report.total_ms = started.elapsed().as_millis() as u64;
        if let Some(ms) = report.held_ms {
            self.cfg
                .metrics
                .move_held_ms
                .fetch_add(ms, Ordering::Relaxed);
        }
        // The input sealed for the move went with it, or is taken here again.
        if r.is_ok() {
            self.drop_input(id);
        } else if let Some(log) = lock(&self.inputs).get(id) {
            log.unseal();
        }
        match r {
            Ok(()) => {
                let m = &self.cfg.metrics;
                m.moves_committed.fetch_add(1, Ordering::Relaxed);
                m.move_pause
                    .observe(Duration::from_millis(report.downtime_ms));
                report.outcome = "committed".into();
                self.update(&live, |i| i.migration = Some(report.clone()));
                info!(session = %id, to = %to, downtime_ms = report.downtime_ms, "moved");
                Ok(report)
            }
            Err(e) => {
                self.cfg
                    .metrics
                    .moves_aborted
                    .fetch_add(1, Ordering::Relaxed);
                report.outcome = format!("aborted: {}", e.msg);
                self.update(&live, |i| {
                    i.migrating_to = None;
                    i.attempt = None;
                    i.migration = Some(report.clone());
                });
                warn!(session = %id, to = %to, error = %e.msg, "migration aborted; the session stays here");
                Err(ApiError::new(
                    e.status,
                    format!("migration aborted, the session stays here: {}", e.msg),
                ))
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn migrate_steps(
        self: &Arc<Self>,
        live: &Arc<Live>,
        to: &str,
        req: &MigrateRequest,
        engine: EngineKind,
        was_running: bool,
        m: Move<'_>,
        report: &mut MigrationReport,
        started: Instant,
    ) -> Result<(), ApiError> {
        let Move {
            attempt,
            owned,
            dest_store,
            dest,
        } = m;
        let id = live.info().id;
        let unreachable =
            |what: &str, e: &dyn std::fmt::Display| ApiError::unavailable(format!("{what}: {e}"));
        let info = live.info();
        let epoch = info.epoch + 1;
        let prepare_at = |k: Kappa| PrepareRequest {
            session: id.clone(),
            snapshot: k.to_string(),
            epoch,
            source: self.cfg.advertise.clone(),
            to: to.to_owned(),
            program: info.program.clone(),
            engine: engine.name().into(),
            checkpoint_every_ms: info.checkpoint_every_ms,
            attempt: Some(attempt.to_owned()),
            standby: info.standby.clone(),
            standby_auto: info.standby_auto,
            suspended: !was_running,
            // Read at each round: an answer from the standby on its way when the move began
            // may still raise it.
            released: live.info().released,
            interactive: info.interactive,
            input: None,
            input_ended: false,
        };
        // In a fleet: the attempt is recorded aborted (best effort), so the destination
        // drops its copy even if it never hears this space again.
        let abort_in_etcd = || {
            if let Some(o) = &self.cfg.owners
                && let Err(e) = o.abort_move(&id, epoch, attempt)
            {
                warn!(session = %id, error = %e, "cannot record the aborted move in etcd");
            }
        };
        // The destination's name as it gave it (its `--advertise` URL), for the owner record.
        let mut dest_name = None;
        let refused = |e: ApiError| {
            if e.status == 0 {
                ApiError::unavailable(format!("the destination did not answer: {}", e.msg))
            } else {
                ApiError::new(e.status, format!("the destination refused: {}", e.msg))
            }
        };
        // 1. Pre-copy: checkpoints while the guest runs, each sending what the destination
        //    lacks, until a round is small or stops shrinking. After each round the
        //    destination restores it (first round) or brings its held copy forward to it, so
        //    the final prepare only applies the last delta — and a destination that will
        //    refuse the guest says so before the guest is paused.
        let max_pause = req.max_pause_ms.map(Duration::from_millis);
        // With `auto_converge`: the guest's control, to hold it back through (lifted however
        // this ends; a guest paused here and resumed after an abort runs with a new control).
        let throttle = if req.auto_converge && was_running {
            lock(&live.control).clone().map(Unthrottle::new)
        } else {
            None
        };
        if was_running {
            let mut previous = u64::MAX;
            let mut measured = Vec::new();
            // What pausing after the latest round would cost, foreseen from the rounds so far.
            let mut foreseen = None;
            // The share of its time the guest is held now (`auto_converge`), in percent; and
            // as it was held while it wrote what this round sends (since the last checkpoint).
            let mut held = 0;
            let mut held_at_checkpoint = 0;
            for _ in 0..req.max_rounds {
                let t = Instant::now();
                let under = std::mem::replace(&mut held_at_checkpoint, held);
                let info = self.stop(&id, Request::Checkpoint, false)?;
                if info.state != State::Running {
                    return Err(ApiError::conflict(format!(
                        "the session {} before it could move",
                        info.state.name()
                    )));
                }
                let k = parse_kappa(info.snapshot.as_deref().unwrap_or(""), "snapshot")?;
                let at = Instant::now();
                let s = send_closure(self.store.as_ref(), dest_store, k, &mut |_, _| {})
                    .map_err(|e| unreachable("pre-copy", &e))?;
                measured.push(precopy::Measured {
                    at,
                    bytes: s.bytes,
                    send: at.elapsed(),
                });
                report.rounds.push(Round {
                    snapshot: k.to_string(),
                    objects: s.moved,
                    bytes: s.bytes,
                    ms: t.elapsed().as_millis() as u64,
                    foreseen_pause_ms: None,
                    foreseen_bytes: None,
                    held_percent: (under > 0).then_some(under),
                });
                report.total_bytes += s.bytes;
                match dest.prepare(&prepare_at(k)) {
                    Ok(a) => dest_name = a.space.or(dest_name),
                    Err(e) => {
                        abort_in_etcd();
                        let _ = dest.abort(&id, Decision { epoch });
                        return Err(refused(e));
                    }
                }
                let round = report.rounds.last_mut().expect("pushed above");
                round.ms = t.elapsed().as_millis() as u64;
                foreseen = precopy::foresee(&measured, Instant::now());
                if let Some(f) = foreseen {
                    round.foreseen_pause_ms = Some(f.time.as_millis() as u64);
                    round.foreseen_bytes = Some(f.bytes);
                }
                // Converging by holding the guest back: a delta that would not fit (the bound
                // on the pause, with room for the rest of it; else what `stop_bytes` takes)
                // holds the guest more for the next round, and one that fits ends the rounds.
                let mut fits = false;
                if let (Some(t), Some(f)) = (&throttle, foreseen) {
                    let goal = max_pause.map_or_else(
                        || Duration::from_secs_f64(req.stop_bytes as f64 / f.rate),
                        |max| max / 2,
                    );
                    // Fitting is judged by the larger of the foresight and what this round
                    // sent: the rounds shrinking, the final delta is written in less time
                    // than this round's bytes were, so it is no larger — a bound the
                    // foresight (the last round's rate, scaled to the time since) lacks for
                    // a guest that rewrites the same pages, which writes less that is new
                    // per second the longer it is watched.
                    let f = precopy::Foreseen {
                        time: f.time.max(Duration::from_secs_f64(s.bytes as f64 / f.rate)),
                        ..f
                    };
                    fits = f.time <= goal;
                    let next = precopy::next_throttle(&f, goal, under, held);
                    if next != held {
                        info!(session = %id, round = measured.len(), from = held, to = next,
                              foreseen_ms = f.time.as_millis() as u64, goal_ms = goal.as_millis() as u64,
                              "holding the guest back for the move to converge");
                        t.0.throttle(next);
                        held = next;
                    }
                    report.held_ms = t.held_ms();
                }
                self.update(live, |i| i.migration = Some(report.clone()));
                fault("precopy");
                // Held back, the rounds end when the delta is foreseen to fit (a round under
                // `stop_bytes` may still leave one that does not), or stop shrinking though
                // written under the share now in place; else when a round is small or stops
                // shrinking.
                let done = if throttle.is_some() {
                    // (Not before the delta can be foreseen: a second round; nor while the
                    // share now in place has not yet been measured — this round was written
                    // under the one before, `under`; a share only rises, so one raised just
                    // now differs from `under` too.)
                    foreseen.is_some() && (fits || (s.bytes >= previous && under == held))
                } else {
                    s.bytes <= req.stop_bytes || s.bytes >= previous
                };
                if done {
                    break;
                }
                previous = s.bytes;
            }
            // With a bound on the pause: a final delta that sending alone would make longer
            // is not tried (the guest never stops here).
            if let Some(max) = max_pause
                && let Some(f) = foreseen
                && f.time > max
            {
                abort_in_etcd();
                let _ = dest.abort(&id, Decision { epoch });
                // As held while it wrote what the last round sent.
                let even = match report.rounds.last().and_then(|r| r.held_percent) {
                    Some(p) => format!(", even held {p}% of its time"),
                    None => String::new(),
                };
                return Err(ApiError::unavailable(format!(
                    "the guest writes its memory about as fast as the link to the destination \
                     carries it{even}: after {} pre-copy rounds ~{:.1} MiB would be left to send \
                     with the guest paused, ~{} ms at the {:.1} MB/s the rounds reached, past \
                     the --max-pause of {} ms; given up before pausing it (it never stopped)",
                    measured.len(),
                    f.bytes as f64 / (1 << 20) as f64,
                    f.time.as_millis(),
                    f.rate / 1e6,
                    max.as_millis()
                )));
            }
        }
        // 2. Pause at a safe point: the final snapshot. From here until the commit the
        //    guest runs nowhere. An interactive session's input is sealed first (input sent
        //    meanwhile is refused, to be sent again where the session is then), so the
        //    destination gets all that was taken — sent before the pause (the guest reads
        //    on meanwhile; nothing is added to it), so that its bytes add nothing to it.
        let sealed = self.seal_input(live)?;
        if let Some((ik, _)) = &sealed
            && let Err(e) = send_objects(self.store.as_ref(), dest_store, &[*ik], &mut |_, _| {})
        {
            abort_in_etcd();
            let _ = dest.abort(&id, Decision { epoch });
            return Err(unreachable("the session's input", &e));
        }
        let paused = Instant::now();
        // Held until this function returns (commit or abort): see `Live::defer_teardown`.
        let (_teardown, rx) = mpsc::channel::<()>();
        let k = if was_running {
            *lock(&live.defer_teardown) = Some(rx);
            let info = self.stop(&id, Request::Suspend, false)?;
            if info.state != State::Suspended {
                return Err(ApiError::conflict(format!(
                    "the session {} before it could move",
                    info.state.name()
                )));
            }
            parse_kappa(info.snapshot.as_deref().unwrap_or(""), "snapshot")?
        } else {
            parse_kappa(live.info().snapshot.as_deref().unwrap_or(""), "snapshot")?
        };
        let t_paused = paused.elapsed();
        if let Some(t) = &throttle {
            report.held_ms = t.held_ms();
        }
        report.final_snapshot = Some(k.to_string());
        report.memory_bytes = nonzero_memory(self.store.as_ref(), &k);
        fault("suspended");
        // Until the commit, any failure resumes the guest here, and only then tells the
        // destination to drop its copy (which may take until the destination is given up,
        // if it went silent).
        let abort_here = |me: &Arc<Self>, e: ApiError| -> ApiError {
            if was_running && let Err(e2) = me.start(live, Begin::Resume(k), engine_of(live), false)
            {
                warn!(session = %id, error = %e2.msg, "could not resume here after the abort; it stays suspended");
            }
            abort_in_etcd();
            let _ = dest.abort(&id, Decision { epoch });
            e
        };
        // With `max_pause_ms`: what is left of the pause the caller allows after `what`, or
        // the reason to abort once it is spent.
        let pause_left = |what: &str| -> Result<Option<Duration>, ApiError> {
            let Some(max) = max_pause else {
                return Ok(None);
            };
            let spent = paused.elapsed();
            max.checked_sub(spent)
                .filter(|d| !d.is_zero())
                .map(Some)
                .ok_or_else(|| {
                    ApiError::unavailable(format!(
                        "the guest had been paused {} ms by the end of {what}: past the \
                         --max-pause of {} ms",
                        spent.as_millis(),
                        max.as_millis()
                    ))
                })
        };
        if let Err(e) = pause_left("the final snapshot") {
            return Err(abort_here(self, e));
        }
        // 3. Final delta, cut once the pause the caller allows is spent.
        let t = Instant::now();
        let delta_store =
            max_pause.map_or_else(|| dest_store.clone(), |max| dest_store.until(paused + max));
        let s = match send_closure(self.store.as_ref(), &delta_store, k, &mut |_, _| {}) {
            Ok(s) => s,
            Err(e) => {
                let e = match pause_left("the final delta") {
                    Err(spent) => ApiError::unavailable(format!(
                        "the final delta had not reached the destination in time: {}",
                        spent.msg
                    )),
                    Ok(_) => unreachable("final delta", &e),
                };
                return Err(abort_here(self, e));
            }
        };
        report.final_objects = s.moved;
        report.final_bytes = s.bytes;
        report.total_bytes += s.bytes;
        let t_delta = t.elapsed();
        fault("final-delta");
        // 4. Prepare: the destination verifies, admits and restores (or brings its held copy
        //    forward to κ), then holds.
        let within = match pause_left("the final delta") {
            Ok(w) => w,
            Err(e) => return Err(abort_here(self, e)),
        };
        let t = Instant::now();
        let prepared = dest.prepare_within(
            &PrepareRequest {
                input: sealed.map(|(ik, _)| ik.to_string()),
                input_ended: sealed.is_some_and(|(_, ended)| ended),
                ..prepare_at(k)
            },
            within,
        );
        let t_prepare = t.elapsed();
        // The standby the session keeps there (none if the destination was its standby).
        let standby_after = match prepared {
            Ok(a) => {
                dest_name = a.space.or(dest_name);
                a.standby
            }
            Err(e) => {
                // Unanswered once the pause was spent: the bound cut the prepare.
                let e = match pause_left("the prepare") {
                    Err(spent) if e.status == 0 => ApiError::unavailable(format!(
                        "the destination had not prepared in time: {}",
                        spent.msg
                    )),
                    _ => refused(e),
                };
                return Err(abort_here(self, e));
            }
        };
        fault("prepared");
        // 5. Commit point: in a fleet, the transaction in etcd that moves the owner record
        //    (if no one aborted the attempt first); else the record here. From then on the
        //    session belongs to the destination; this copy is fenced. (The report's commit
        //    step runs from here to the destination's answer.)
        let t = Instant::now();
        if let (Some(o), Some(owned)) = (&self.cfg.owners, owned) {
            let to_owner = Owner {
                space: dest_name.unwrap_or_else(|| to.to_owned()),
                epoch,
            };
            loop {
                match o.commit_move(
                    &id,
                    attempt,
                    owned.revision,
                    &to_owner,
                    standby_after.as_deref(),
                ) {
                    Ok(Commit::Decided(crate::owners::Outcome::Committed)) => break,
                    Ok(Commit::Decided(crate::owners::Outcome::Aborted)) => {
                        return Err(abort_here(
                            self,
                            ApiError::conflict(
                                "the destination gave the move up before it committed (it \
                                 could not hear this space; etcd records the attempt aborted)",
                            ),
                        ));
                    }
                    Ok(Commit::Superseded(now)) => {
                        // Someone else changed the owner record: the session is not this
                        // space's to run any more. It stays suspended here.
                        abort_in_etcd();
                        let _ = dest.abort(&id, Decision { epoch });
                        let now = now.map_or("no one".to_owned(), |o| {
                            format!("{} (epoch {})", o.space, o.epoch)
                        });
                        return Err(ApiError::conflict(format!(
                            "the owner record in etcd changed during the move (it names \
                             {now}); the session stays suspended here"
                        )));
                    }
                    Err(e) => {
                        // The outcome is unknown until etcd answers: the guest stays paused.
                        warn!(session = %id, error = %e, "etcd did not answer the commit; asking again");
                        std::thread::sleep(Duration::from_millis(500));
                    }
                }
            }
            fault("owner-moved");
        }
        report.standby = standby_after;
        report.total_ms = started.elapsed().as_millis() as u64;
        self.update(live, |i| {
            i.state = State::Moved;
            i.moved_to = Some(to.to_owned());
            i.migrating_to = None;
            i.epoch = epoch;
            i.commit_pending = true;
            i.migration = Some(report.clone());
        });
        fault("committed");
        // 6. Tell the destination; if it cannot hear it now, keep telling it.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match dest.commit(&id, Decision { epoch }) {
                Ok(_) => {
                    report.downtime_ms = paused.elapsed().as_millis() as u64;
                    report.steps = format!(
                        "{} + {} + {} + {}",
                        t_paused.as_millis(),
                        t_delta.as_millis(),
                        t_prepare.as_millis(),
                        t.elapsed().as_millis()
                    );
                    self.update(live, |i| i.commit_pending = false);
                    return Ok(());
                }
                Err(e) if Instant::now() < deadline => {
                    warn!(session = %id, error = %e.msg, "commit not delivered yet; retrying");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => {
                    warn!(session = %id, error = %e.msg, "commit not delivered; retrying in the background");
                    report.downtime_ms = paused.elapsed().as_millis() as u64;
                    self.spawn_committer(live.clone());
                    return Ok(());
                }
            }
        }
    }

    /// Delivers a recorded commit until the destination confirms it.
    fn spawn_committer(self: &Arc<Self>, live: Arc<Live>) {
        let me = self.clone();
        std::thread::spawn(move || {
            loop {
                let info = live.info();
                if info.state != State::Moved || !info.commit_pending {
                    return;
                }
                let to = info.moved_to.clone().unwrap_or_default();
                let dest = SpaceClient::new(&to, &me.cfg.peer_token);
                match dest.commit(&info.id, Decision { epoch: info.epoch }) {
                    Ok(_) => {
                        me.update(&live, |i| i.commit_pending = false);
                        info!(session = %info.id, to = %to, "commit delivered");
                        return;
                    }
                    Err(e) if e.status == 409 || e.status == 404 => {
                        warn!(session = %info.id, error = %e.msg, "the destination refuses the commit");
                        me.update(&live, |i| {
                            i.commit_pending = false;
                            i.reason =
                                Some(format!("the destination refused the commit: {}", e.msg));
                        });
                        return;
                    }
                    Err(_) => std::thread::sleep(RESOLVE_EVERY),
                }
            }
        });
    }

    // ---- migration, destination side ----

    /// `POST /v1/migrations`: verify, admit and restore the snapshot, then hold the guest
    /// until the source commits or aborts.
    pub fn prepare(self: &Arc<Self>, req: PrepareRequest) -> Result<SessionInfo, ApiError> {
        session_id(&req.session)?;
        self.refuse_if_stopping()?;
        let k = parse_kappa(&req.snapshot, "snapshot")?;
        let engine = parse_engine(Some(&req.engine), EngineKind::Jit)?;
        if let Some(a) = &req.attempt
            && (a.is_empty() || a.len() > 32 || !a.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(ApiError::bad_request("attempt: 1 to 32 hexadecimal digits"));
        }
        fault("dest-prepare");
        self.refuse_if_draining("takes no session moving in")?;
        self.check_move_in_etcd(&req)?;
        let standby = self.standby_after_move(&req)?;
        let previous = lock(&self.live).get(&req.session).cloned();
        if let Some(p) = &previous {
            let _turn = lock(&p.turn);
            let pi = p.info();
            if pi.state == State::Prepared && pi.epoch == req.epoch {
                // A later round of the same move — or a new attempt at it: the source runs
                // one move of a session at a time, so it gave the earlier one up. Bring the
                // held guest forward, now for this attempt.
                self.update(p, |i| {
                    i.attempt.clone_from(&req.attempt);
                    if i.standby.is_some() {
                        i.released = i.released.max(req.released);
                    }
                });
                self.take_moved_input(&req)?;
                return self.bring_forward(p, k).map(|i| self.answer(i));
            }
            if pi.epoch >= req.epoch {
                return Err(ApiError::conflict(format!(
                    "stale move: session `{}` is at epoch {} here, the move brings epoch {}",
                    req.session, pi.epoch, req.epoch
                )));
            }
            if pi.state.is_live() {
                return Err(ApiError::conflict(format!(
                    "session `{}` is {} here",
                    req.session,
                    pi.state.name()
                )));
            }
        }
        let live = Live::new(
            SessionInfo {
                snapshot: Some(k.to_string()),
                source: Some(req.source.clone()),
                checkpoint_every_ms: req
                    .checkpoint_every_ms
                    .filter(|&ms| ms >= MIN_CHECKPOINT_MS),
                attempt: req.attempt.clone(),
                released: standby.as_ref().map(|_| req.released.unwrap_or(0)),
                standby,
                // Chosen again here (`keep_standbys`) where this space is in a fleet.
                standby_auto: req.standby_auto && self.cfg.owners.is_some(),
                held_suspended: req.suspended,
                interactive: req.interactive,
                ..SessionInfo::starting(&req.session, &req.program, engine.name(), req.epoch)
            },
            OutputBuffer::default(),
        );
        if let Some(p) = &previous {
            save_record(&self.replaced_path(&req.session), &p.info()).map_err(|e| {
                ApiError::internal(format!("cannot keep the session's earlier record: {e}"))
            })?;
        }
        self.take_moved_input(&req)?;
        *lock(&live.replaced) = previous.clone();
        lock(&self.live).insert(req.session.clone(), live.clone());
        let put_back = |me: &Self| {
            let _ = std::fs::remove_file(me.replaced_path(&req.session));
            let mut g = lock(&me.live);
            match &previous {
                Some(p) => g.insert(req.session.clone(), p.clone()),
                None => g.remove(&req.session),
            };
        };
        if let Err(e) = self.start(&live, Begin::Resume(k), engine, true) {
            live.gone.store(true, Ordering::SeqCst);
            put_back(self);
            self.drop_input(&req.session);
            if let Some(p) = &previous {
                let _ = self.save(&p.info());
            } else {
                let _ = std::fs::remove_file(self.record_path(&req.session));
            }
            return Err(e);
        }
        self.snapshotted(&live, k);
        info!(session = %req.session, source = %req.source, epoch = req.epoch, "prepared; waiting for the commit");
        self.spawn_resolver(live.clone());
        Ok(self.answer(live.info()))
    }

    /// The standby a moving session keeps here: the one it had, unless that is this space
    /// (the session then runs here without one). Refused where no standby can be kept.
    fn standby_after_move(&self, req: &PrepareRequest) -> Result<Option<String>, ApiError> {
        let Some(to) = &req.standby else {
            return Ok(None);
        };
        let to = to.trim_end_matches('/');
        let Some(o) = &self.cfg.owners else {
            return Err(ApiError::conflict(format!(
                "session `{}` has a standby ({to}), which only a space of its etcd fleet can \
                 keep: this space was started without --etcd",
                req.session
            )));
        };
        if to == o.me() || to == self.cfg.advertise.trim_end_matches('/') {
            return Ok(None);
        }
        Ok(Some(to.to_owned()))
    }

    /// A prepare's answer names this space as its peers reach it (for the owner record).
    fn answer(&self, info: SessionInfo) -> SessionInfo {
        SessionInfo {
            space: Some(self.cfg.advertise.clone()),
            ..info
        }
    }

    /// In a fleet: a move is prepared here only if etcd names its source as the session's
    /// owner at the epoch before the move's, and the attempt is not decided yet.
    fn check_move_in_etcd(&self, req: &PrepareRequest) -> Result<(), ApiError> {
        let Some(o) = &self.cfg.owners else {
            return Ok(());
        };
        let id = &req.session;
        let Some(attempt) = &req.attempt else {
            return Err(ApiError::conflict(
                "this space records session owners in etcd, and the source sent no move \
                 attempt (a ferry that predates them): move it with a newer ferry",
            ));
        };
        let (owner, outcome) = o
            .move_state(id, req.epoch, attempt)
            .map_err(|e| etcd_unreachable(id, e))?;
        match owner {
            Some(r) if r.owner.space == req.source && r.owner.epoch + 1 == req.epoch => {}
            Some(r) => {
                return Err(ApiError::conflict(format!(
                    "stale move: etcd names {} (epoch {}) as the owner of session `{id}`, and \
                     this move comes from {} to epoch {}",
                    r.owner.space, r.owner.epoch, req.source, req.epoch
                )));
            }
            None => {
                return Err(ApiError::conflict(format!(
                    "etcd has no owner record for session `{id}`: is the source {} using the \
                     same etcd (--etcd, --etcd-prefix) as this space?",
                    req.source
                )));
            }
        }
        match outcome {
            None => Ok(()),
            Some(outcome) => Err(ApiError::conflict(format!(
                "this move of session `{id}` is already decided in etcd ({})",
                outcome.name()
            ))),
        }
    }

    /// A held guest moves on to snapshot κ (only the chunks that differ are copied); its record
    /// names κ before the answer, so a restarted space restores κ.
    fn bring_forward(&self, live: &Arc<Live>, k: Kappa) -> Result<SessionInfo, ApiError> {
        let (tx, rx) = mpsc::channel();
        let sent = lock(&live.hold)
            .as_ref()
            .is_some_and(|h| h.send(HoldCmd::Patch(k, tx)).is_ok());
        if !sent {
            return Err(ApiError::conflict(
                "the prepared copy is not held in this process (the space restarted); abort \
                 and prepare again",
            ));
        }
        rx.recv().unwrap_or_else(|_| {
            Err(ApiError::internal(
                "the held guest ended while being brought forward",
            ))
        })?;
        self.snapshotted(live, k);
        Ok(live.info())
    }

    /// `POST /v1/migrations/{id}/commit`: the prepared guest runs (idempotent).
    pub fn commit(self: &Arc<Self>, id: &str, d: Decision) -> Result<SessionInfo, ApiError> {
        fault("dest-commit");
        let live = self.get(id)?;
        let _turn = lock(&live.turn);
        self.commit_locked(&live, d)
    }

    fn commit_locked(
        self: &Arc<Self>,
        live: &Arc<Live>,
        d: Decision,
    ) -> Result<SessionInfo, ApiError> {
        let info = live.info();
        if info.epoch != d.epoch {
            return Err(ApiError::conflict(format!(
                "session `{}` is at epoch {} here, the commit is for epoch {}",
                info.id, info.epoch, d.epoch
            )));
        }
        if info.state != State::Prepared {
            // Already committed (a repeated commit), or it has run since.
            return Ok(info);
        }
        self.cfg.metrics.moves_in.fetch_add(1, Ordering::Relaxed);
        let sender = lock(&live.hold).take();
        // The move is decided: the record it replaced is not put back.
        lock(&live.replaced).take();
        let _ = std::fs::remove_file(self.replaced_path(&info.id));
        if info.held_suspended {
            // Suspended at the source, suspended here: the held guest is let go without
            // running (its run ends refused; the record already says suspended, so that end
            // is not recorded), and its directories go, as a suspend's do — a resume fills
            // fresh ones from the snapshot.
            let info = self.update(live, |i| {
                i.state = State::Suspended;
                i.held_suspended = false;
            });
            if let Some(tx) = sender {
                let _ = tx.send(HoldCmd::Abort);
            }
            self.drop_backing(&info.id);
            info!(session = %info.id, epoch = d.epoch, "move committed; suspended here");
            return Ok(info);
        }
        match sender {
            Some(tx) if tx.send(HoldCmd::Commit).is_ok() => {
                live.wait_while(Duration::from_secs(10), |i| i.state == State::Prepared);
            }
            _ => {
                // Prepared before this space restarted: restore again and run.
                let k = parse_kappa(info.snapshot.as_deref().unwrap_or(""), "snapshot")?;
                self.start(live, Begin::Resume(k), engine_of(live), false)?;
            }
        }
        info!(session = %info.id, epoch = d.epoch, "move committed; running");
        Ok(live.info())
    }

    /// `POST /v1/migrations/{id}/abort`: a prepared guest is dropped (idempotent).
    pub fn abort(&self, id: &str, d: Decision) -> Result<(), ApiError> {
        let Ok(live) = self.get(id) else {
            return Ok(());
        };
        let _turn = lock(&live.turn);
        self.abort_locked(&live, d)
    }

    fn abort_locked(&self, live: &Arc<Live>, d: Decision) -> Result<(), ApiError> {
        let info = live.info();
        if info.epoch != d.epoch || !matches!(info.state, State::Prepared | State::Starting) {
            return Ok(());
        }
        live.gone.store(true, Ordering::SeqCst);
        if let Some(tx) = lock(&live.hold).take() {
            let _ = tx.send(HoldCmd::Abort);
        }
        self.drop_backing(&info.id);
        self.drop_input(&info.id);
        let name = format!("session/{}", info.id);
        let current = self.store.get_ref(&name).ok().flatten();
        // A session that had been here before gets its earlier record back (it says where
        // the session went, so `wait` and `logs` here still find it), and its ref.
        let replaced = lock(&live.replaced).take();
        let _ = std::fs::remove_file(self.replaced_path(&info.id));
        match replaced {
            Some(p) => {
                let pi = p.info();
                lock(&self.live).insert(info.id.clone(), p);
                let _ = self.save(&pi);
                let back = pi
                    .snapshot
                    .as_deref()
                    .and_then(|s| s.parse::<Kappa>().ok())
                    .map(|target| RefValue {
                        epoch: pi.epoch,
                        target,
                    });
                let _ = self.store.cas_ref(&name, current, back);
            }
            None => {
                lock(&self.live).remove(&info.id);
                let _ = std::fs::remove_file(self.record_path(&info.id));
                let _ = self.store.cas_ref(&name, current, None);
            }
        }
        info!(session = %info.id, epoch = d.epoch, "prepared move aborted");
        Ok(())
    }

    /// While a session is held prepared here, asks now and then how the move ended — etcd
    /// (in a fleet), then the source — so the decision is reached even if the source's own
    /// message never arrives.
    fn spawn_resolver(self: &Arc<Self>, live: Arc<Live>) {
        let me = self.clone();
        std::thread::spawn(move || {
            // When the source last answered: in a fleet, a source silent for
            // `prepared_timeout` is given up.
            let mut heard = Instant::now();
            loop {
                std::thread::sleep(RESOLVE_EVERY);
                let info = live.info();
                if info.state != State::Prepared || live.gone.load(Ordering::SeqCst) {
                    return;
                }
                let Some(outcome) = me.resolve_once(&info, &mut heard) else {
                    continue;
                };
                let _turn = lock(&live.turn);
                let now = live.info();
                if now.state != State::Prepared
                    || now.epoch != info.epoch
                    || now.attempt != info.attempt
                {
                    // Decided meanwhile, or a new attempt of the source's took the copy over.
                    continue;
                }
                let d = Decision { epoch: info.epoch };
                match outcome {
                    crate::owners::Outcome::Committed => {
                        if let Err(e) = me.commit_locked(&live, d) {
                            warn!(session = %info.id, error = %e.msg, "commit after asking how the move ended failed");
                        }
                    }
                    crate::owners::Outcome::Aborted => {
                        let _ = me.abort_locked(&live, d);
                    }
                }
                return;
            }
        });
    }

    /// One look at how the move that holds `info` here ended: `None` while undecided. In a
    /// fleet etcd decides, and a source that says it is not moving the session, or stays
    /// silent for `prepared_timeout`, gets the attempt aborted there (unless it committed
    /// first); else the source's record is the outcome.
    fn resolve_once(
        &self,
        info: &SessionInfo,
        heard: &mut Instant,
    ) -> Option<crate::owners::Outcome> {
        use crate::owners::Outcome;
        let fleet = self.cfg.owners.as_ref().zip(info.attempt.as_deref());
        if let Some((o, attempt)) = fleet {
            match o.decided(&info.id, info.epoch, attempt) {
                Ok(Some(outcome)) => return Some(outcome),
                Ok(None) => {}
                Err(e) => {
                    warn!(session = %info.id, error = %e, "cannot ask etcd how the move ended")
                }
            }
        }
        // The source's answer concerns this move only if it names the same attempt (a
        // source or record from before attempts named none).
        let same = |a: &Option<String>| a.is_none() || info.attempt.is_none() || *a == info.attempt;
        let source = info.source.clone().unwrap_or_default();
        let not_moving = match SpaceClient::new(&source, &self.cfg.peer_token).session(&info.id) {
            Ok(s) if s.state == State::Moved && s.epoch == info.epoch && same(&s.attempt) => {
                return Some(Outcome::Committed);
            }
            Ok(s) if s.migrating_to.is_some() && same(&s.attempt) => {
                *heard = Instant::now();
                return None; // still deciding
            }
            Ok(_) => true,
            Err(e) if e.status == 404 => true,
            Err(_) => false, // no answer: keep holding
        };
        let Some((o, attempt)) = fleet else {
            return not_moving.then_some(Outcome::Aborted);
        };
        if not_moving {
            *heard = Instant::now();
        } else if heard.elapsed() < self.cfg.prepared_timeout {
            return None;
        } else {
            warn!(session = %info.id, source = %source, silent_s = heard.elapsed().as_secs(), "the source does not answer; giving the move up in etcd");
        }
        match o.abort_move(&info.id, info.epoch, attempt) {
            Ok(outcome) => Some(outcome),
            Err(e) => {
                warn!(session = %info.id, error = %e, "cannot record the move aborted in etcd; holding on");
                None
            }
        }
    }

    /// After a restart, a move that was under way when this space stopped (its record
    /// names the attempt and the destination) is settled in etcd: aborted unless it had
    /// committed — then the session is marked moved here and the commit delivered.
    fn spawn_settle(self: &Arc<Self>, live: Arc<Live>, to: String, attempt: String) {
        let me = self.clone();
        std::thread::spawn(move || {
            let Some(o) = me.cfg.owners.clone() else {
                return;
            };
            let info = live.info();
            let epoch = info.epoch + 1;
            loop {
                match o.abort_move(&info.id, epoch, &attempt) {
                    Ok(crate::owners::Outcome::Aborted) => return,
                    Ok(crate::owners::Outcome::Committed) => {
                        let _turn = lock(&live.turn);
                        let now = live.info();
                        if now.epoch >= epoch || now.state.is_live() {
                            return;
                        }
                        me.update(&live, |i| {
                            i.state = State::Moved;
                            i.moved_to = Some(to.clone());
                            i.epoch = epoch;
                            i.commit_pending = true;
                            i.reason = Some(
                                "its move committed in etcd just before this space stopped".into(),
                            );
                        });
                        info!(session = %info.id, to = %to, epoch, "etcd says the move committed; fenced here");
                        me.spawn_committer(live.clone());
                        return;
                    }
                    Err(e) => {
                        warn!(session = %info.id, error = %e, "cannot settle an interrupted move in etcd yet");
                        std::thread::sleep(RESOLVE_EVERY);
                    }
                }
            }
        });
    }
}

/// A request that needed etcd's answer about session `id`, which etcd did not give.
fn etcd_unreachable(id: &str, e: crate::owners::EtcdError) -> ApiError {
    ApiError::unavailable(format!("cannot ask etcd who owns session `{id}`: {e}"))
}

/// What one migration attempt works with, besides the session.
struct Move<'a> {
    attempt: &'a str,
    /// The owner record read before the move (in a fleet).
    owned: Option<&'a Owned>,
    dest_store: &'a RemoteStore,
    dest: &'a SpaceClient,
}

/// Lets a guest held back for a move (`auto_converge`) run at full speed again when dropped;
/// with how long it had been held before (by an earlier move), which is not this move's.
struct Unthrottle(Arc<Control>, Duration);

impl Unthrottle {
    fn new(control: Arc<Control>) -> Self {
        let before = control.held();
        Self(control, before)
    }

    /// How long this move has held the guest back, in ms (`None`: not at all).
    fn held_ms(&self) -> Option<u64> {
        Some(self.0.held().saturating_sub(self.1).as_millis() as u64).filter(|&ms| ms > 0)
    }
}

impl Drop for Unthrottle {
    fn drop(&mut self) {
        if self.0.throttled() != 0 {
            self.0.throttle(0);
        }
    }
}

/// Asks run `mine` of a session for a checkpoint every `every` while it runs (not while a
/// migration moves it: its rounds are checkpoints already), until that run stops.
fn spawn_checkpointer(live: Arc<Live>, mine: u64, control: Arc<Control>, every: Duration) {
    let spawned = std::thread::Builder::new()
        .name("checkpointer".into())
        .spawn(move || {
            loop {
                std::thread::sleep(every);
                let info = live.info();
                if live.run.load(Ordering::SeqCst) != mine
                    || live.gone.load(Ordering::SeqCst)
                    || !matches!(
                        info.state,
                        State::Starting | State::Running | State::Prepared
                    )
                {
                    return;
                }
                if info.state == State::Running && info.migrating_to.is_none() {
                    control.request_checkpoint();
                }
            }
        });
    if let Err(e) = spawned {
        warn!(error = %e, "cannot start periodic checkpoints");
    }
}

fn engine_of(live: &Live) -> EngineKind {
    live.info().engine.parse().unwrap_or(EngineKind::Jit)
}

/// Non-zero bytes of a snapshot's memories (the chunks it stores).
fn nonzero_memory(store: &dyn Store, k: &Kappa) -> u64 {
    let Ok(snap) = store.get(k).map_err(|e| e.to_string()).and_then(|b| {
        ferry_object::decode::<ferry_object::Snapshot>(&b).map_err(|e| e.to_string())
    }) else {
        return 0;
    };
    snap.memories
        .iter()
        .filter_map(|m| store.get(m).ok())
        .filter_map(|b| ferry_object::decode::<ferry_object::MemoryImage>(&b).ok())
        .map(|img| img.chunks.len() as u64 * u64::from(img.chunk_size))
        .sum()
}
