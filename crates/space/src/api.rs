//! The JSON bodies of the sessions and migration API (docs/api.md), shared by the space and
//! its clients.

use ferry_engine::gc::Collected;
use serde::{Deserialize, Serialize};

/// Where a session is in its life, as a space sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Being prepared (module compiled, snapshot restored) before it runs.
    Starting,
    Running,
    /// Stopped at a snapshot; `resume` continues it.
    Suspended,
    /// The guest exited (`exit_code`).
    Exited,
    /// The guest trapped or could not continue (`reason`).
    Failed,
    /// Stopped by `kill` (its last snapshot is kept).
    Killed,
    /// Restored here by a migration and held until the source commits the move.
    Prepared,
    /// Moved to another space (`moved_to`): this copy is fenced — it can neither resume nor
    /// emit output.
    Moved,
    /// Taken over by a client outside the space — a browser tab, Node — at `epoch`
    /// (`lent_to` says which): it runs there and sends its output here; this space neither
    /// runs nor moves it until the client gives it back, or it is reclaimed (which raises the
    /// epoch, fencing the client).
    Lent,
    /// A copy of another space's session (`source`), kept here at its checkpoints: this
    /// space takes it over — resumes it from its latest checkpoint — if the owner's etcd
    /// lease runs out (docs/migration.md, "Standby").
    Standby,
}

impl State {
    /// Every state, in the order of their declaration.
    pub const ALL: [State; 10] = [
        State::Starting,
        State::Running,
        State::Suspended,
        State::Exited,
        State::Failed,
        State::Killed,
        State::Prepared,
        State::Moved,
        State::Lent,
        State::Standby,
    ];

    /// Whether the session may still produce output here.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            State::Starting | State::Running | State::Prepared | State::Lent
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Running => "running",
            State::Suspended => "suspended",
            State::Exited => "exited",
            State::Failed => "failed",
            State::Killed => "killed",
            State::Prepared => "prepared",
            State::Moved => "moved",
            State::Lent => "lent",
            State::Standby => "standby",
        }
    }
}

/// A session as `GET /v1/sessions/{id}` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub id: String,
    pub program: String,
    /// `jit` or `interp`.
    pub engine: String,
    pub state: State,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The latest snapshot (`blake3:…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// Fencing epoch: raised by one at every move; a space refuses a move that does not
    /// raise it.
    pub epoch: u64,
    /// Set while a migration of this session is under way (the destination's URL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrating_to: Option<String>,
    /// Where the session went (state `moved`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_to: Option<String>,
    /// The client running the session (state `lent`), as it described itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lent_to: Option<String>,
    /// The lease it was lent with (ms): the space takes it back after that long without word
    /// from the client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// For a session that arrived by migration: the space it came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Why it failed, or what the space did about it (e.g. restarted from a snapshot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The moved state is committed but the destination has not yet confirmed it heard so.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub commit_pending: bool,
    /// The last (or current) migration's statistics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<MigrationReport>,
    /// A checkpoint is taken this often (ms) while the session runs, here and wherever it
    /// moves, so a space that stops loses at most that much of its progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every_ms: Option<u64>,
    /// What the session's mounts held when its guest exited or failed, kept by the space
    /// (`GET /v1/sessions/{id}/files`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_files: Option<Vec<MountTree>>,
    /// Why the space could not keep them (its backing directories are then left in place).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_files_error: Option<String>,
    /// Why the last snapshot asked for failed (a full disk, a file too large to carry), until
    /// one succeeds; the guest kept running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_error: Option<String>,
    /// How many snapshots of this session failed here: a `suspend` or `checkpoint` waiting
    /// for its snapshot watches it, and answers with the failure instead of waiting on.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub snapshot_failures: u64,
    /// The migration attempt under way (source), held (destination), or that moved the
    /// session last (a random id each `migrate`): a destination asking the source how its
    /// move ended compares it, so a later move of the same session at the same epoch is
    /// never taken for its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
    /// The space that answers, as its peers reach it (`--advertise`): in the answer to a
    /// prepare, where the source learns the name to record as the session's owner in etcd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub space: Option<String>,
    /// The space that holds a standby copy of this session (`run --standby`), at its owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby: Option<String>,
    /// Why the standby could not be brought up to date last time (until it is): output is
    /// held back meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby_error: Option<String>,
    /// The guest has stopped, but its end waits for etcd (why it cannot be asked): a session
    /// with a standby ends only once its standby record is removed, so that nothing takes
    /// it over afterwards. Its state says `running` meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_waits: Option<String>,
    /// A prepared copy of a session that was suspended at its source: it stays suspended
    /// here once the move commits.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub held_suspended: bool,
    /// The standby is chosen by the space (`--standby auto`) among the live spaces of the
    /// fleet, and chosen again when it is gone, refuses checkpoints for long, or took the
    /// session over (on a standby copy: the owner chose so).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub standby_auto: bool,
    /// With a standby: how much of the output log (bytes) is shown — what a checkpoint the
    /// standby holds covers, or all of it once the session ended here. The rest is held
    /// back, so that nothing shown is ever shown differently by a standby that takes over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<u64>,
    /// On a standby copy: the owner's guest was running at that checkpoint, so a take-over
    /// resumes it (else it is taken over suspended).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resume_on_takeover: bool,
    /// Suspended because its space stopped (SIGTERM, Ctrl-C) while the guest ran: the space
    /// resumes it when it starts again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resume_on_start: bool,
    /// Its guest reads input sent while it runs (`run --interactive`,
    /// `POST /v1/sessions/{id}/stdin`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub interactive: bool,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl SessionInfo {
    /// A session about to start here at `epoch`: nothing else known yet.
    pub fn starting(id: &str, program: &str, engine: &str, epoch: u64) -> Self {
        Self {
            id: id.to_owned(),
            program: program.to_owned(),
            engine: engine.to_owned(),
            state: State::Starting,
            exit_code: None,
            snapshot: None,
            epoch,
            migrating_to: None,
            moved_to: None,
            lent_to: None,
            lease_ms: None,
            source: None,
            reason: None,
            commit_pending: false,
            checkpoint_every_ms: None,
            migration: None,
            final_files: None,
            final_files_error: None,
            snapshot_error: None,
            snapshot_failures: 0,
            attempt: None,
            space: None,
            standby: None,
            standby_error: None,
            end_waits: None,
            held_suspended: false,
            standby_auto: false,
            released: None,
            resume_on_takeover: false,
            resume_on_start: false,
            interactive: false,
        }
    }
}

/// One mount's content: the guest path and the κ of its tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountTree {
    pub guest: String,
    pub tree: String,
}

/// `GET /v1/sessions/{id}/files`: the files of a session's mounts — as its guest left them
/// when it exited or failed, else as of its latest snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionFiles {
    pub id: String,
    pub state: State,
    /// The snapshot the trees come from; absent when they were taken as the guest stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    pub mounts: Vec<MountTree>,
}

/// Shortest interval between a session's periodic checkpoints (ms): `RunRequest`'s
/// `checkpoint_every_ms`.
pub const MIN_CHECKPOINT_MS: u64 = 100;

/// `POST /v1/sessions`: run a module that is already in the space's store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunRequest {
    /// The module (a blob in the store).
    pub module: String,
    /// Name shown by `ps` (and `argv[0]` unless `args` says otherwise).
    pub program: String,
    /// Full argv, program name first.
    pub args: Vec<String>,
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Directories the guest wants, each as a tree in the store.
    #[serde(default)]
    pub mounts: Vec<MountRequest>,
    /// `jit` (default) or `interp`.
    #[serde(default)]
    pub engine: Option<String>,
    /// Session id to use (default: a fresh one).
    #[serde(default)]
    pub session: Option<String>,
    /// For a WASI reactor: the export called after `_initialize` (default: `_start`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main: Option<String>,
    /// Take a checkpoint this often (ms, at least 100) while the session runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every_ms: Option<u64>,
    /// The guest's stdin: a blob in the store, read to its end (default: none, end of file at
    /// once). Snapshots carry it, so the guest reads on wherever it moves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// A space of the same etcd fleet to keep a standby copy of the session at each
    /// checkpoint (needs `checkpoint_every_ms` and `--etcd`): it takes the session over if
    /// this space's lease runs out. Output is shown once the standby holds it. `auto`: the
    /// space chooses one among the live spaces of the fleet that would admit the guest, and
    /// another whenever it is gone ([`SessionInfo::standby_auto`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby: Option<String>,
    /// The guest's stdin stays open for input sent while it runs
    /// (`POST /v1/sessions/{id}/stdin`), after `stdin` if that is given too; reads wait for
    /// it. Not with a standby.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub interactive: bool,
}

/// `POST /v1/sessions/{id}/stdin[?end=true]`'s answer: the input was kept (synced to the
/// space's disk) and the guest reads it in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StdinAnswer {
    /// Bytes of input the session has received in all.
    pub received: u64,
    /// The input has ended: the guest reads end of file after it.
    pub ended: bool,
}

/// `POST /v1/sessions/{id}/set-standby`: the owner gives the session another standby or a
/// first one (a space of the same etcd fleet), or none (`to` absent: its whole output is then
/// shown). `to: "auto"`: the space chooses (another) one, as [`RunRequest::standby`] does.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetStandby {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
}

/// `GET /v1/fleet`: the spaces of this space's etcd fleet that are alive (announced under a
/// lease), as etcd says now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fleet {
    /// This space's URL, as the fleet knows it (`--advertise`).
    pub me: String,
    /// This space's zone (`ferry serve --zone`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// The live spaces, sorted by URL (this one among them while its lease is alive).
    pub spaces: Vec<FleetSpace>,
}

/// `POST /v1/drain`: the space is being drained, or not any more.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Draining {
    pub draining: bool,
}

/// One live space of a [`Fleet`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSpace {
    pub space: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// How many sessions run or suspended here it stands by for.
    pub standby_for: u64,
    /// It is being drained (`ferry --space URL drain`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
}

/// `POST /v1/admission`: whether this space's policy would admit a guest with these needs;
/// nothing is started. A space asks a session's standby before it runs the session.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionCheck {
    /// `jit` or `interp` (absent: not asked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// The names of the guest's environment variables (their values are not sent).
    #[serde(default)]
    pub env: Vec<String>,
    /// The guest paths of its mounts.
    #[serde(default)]
    pub mounts: Vec<String>,
    /// Its memory (absent: not asked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
}

/// The answer to an [`AdmissionCheck`] this space's policy passes (a refusal is `403` with
/// the policy's reason).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admitted {
    pub admitted: bool,
}

/// `POST /v1/sessions/{id}/standby` (space to space): keep this checkpoint of a session the
/// sending space owns, as its standby. The snapshot's closure is sent first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StandbyRequest {
    /// The owner (its advertised URL), as etcd's owner record names it.
    pub owner: String,
    pub epoch: u64,
    pub snapshot: String,
    pub program: String,
    pub engine: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every_ms: Option<u64>,
    /// Whether the guest runs at the owner (a take-over then resumes it).
    pub running: bool,
    /// Sent before etcd names the receiver the standby (`set-standby` gives it a copy
    /// first, so that some standby holding one is named at every moment): kept while etcd
    /// names `owner` the owner at `epoch`, dropped if it is not named soon.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pending: bool,
    /// The owner chooses the session's standby itself ([`SessionInfo::standby_auto`]): after
    /// a take-over, the receiver chooses the next one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto: bool,
    /// The session takes input as it runs ([`RunRequest::interactive`]): the owner forwards
    /// each piece to the standby before it answers for it
    /// (`POST /v1/sessions/{id}/standby/stdin`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub interactive: bool,
}

/// A directory requested at `guest`, with the content of tree `tree`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountRequest {
    pub guest: String,
    pub tree: String,
    #[serde(default)]
    pub read_only: bool,
}

/// `POST /v1/sessions/{id}/resume`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResumeRequest {
    /// Engine to continue on (default: the one it ran on).
    #[serde(default)]
    pub engine: Option<String>,
}

/// `POST /v1/sessions/{id}/migrate`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    /// The destination space, e.g. `http://127.0.0.1:7071`.
    pub to: String,
    /// Most pre-copy rounds before the guest is paused.
    #[serde(default = "default_rounds")]
    pub max_rounds: u32,
    /// Pre-copy stops once a round sends at most this many bytes.
    #[serde(default = "default_stop_bytes")]
    pub stop_bytes: u64,
    /// Engine on the destination (default: the same).
    #[serde(default)]
    pub engine: Option<String>,
    /// The longest the guest may stay paused, in ms: a move whose final snapshot, final
    /// delta and prepare have not ended by then is aborted, and the guest runs on here — or
    /// not paused at all, when the pre-copy rounds foresee a final delta longer than that
    /// (default: no bound).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pause_ms: Option<u64>,
    /// Hold the guest back to a share of its time while it is copied when the pre-copy
    /// rounds foresee a final delta that would not fit (`max_pause_ms`, else `stop_bytes`):
    /// from 20% of its time up to 99%, more each round that still does not fit (QEMU's
    /// auto-converge). The guest runs at full speed again once paused here or when the move
    /// is given up (docs/migration.md, "Converging by holding the guest back").
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_converge: bool,
}

fn default_rounds() -> u32 {
    8
}

fn default_stop_bytes() -> u64 {
    4 << 20
}

impl MigrateRequest {
    pub fn to(to: &str) -> Self {
        Self {
            to: to.to_owned(),
            max_rounds: default_rounds(),
            stop_bytes: default_stop_bytes(),
            engine: None,
            max_pause_ms: None,
            auto_converge: false,
        }
    }
}

/// One pre-copy round: a checkpoint taken while the guest ran, and what of it had to move.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Round {
    pub snapshot: String,
    /// Objects sent (the destination had the others).
    pub objects: usize,
    /// Bytes sent, before compression.
    pub bytes: u64,
    pub ms: u64,
    /// How long sending the final delta would have kept the guest paused had it been paused
    /// right after this round, as foreseen from the rounds so far (from the second round on;
    /// docs/migration.md, "A bound on the pause").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub foreseen_pause_ms: Option<u64>,
    /// The final delta so foreseen, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub foreseen_bytes: Option<u64>,
    /// With `auto_converge`: the share of its time (percent) the guest was held while it
    /// wrote what this round sent (absent: not held).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_percent: Option<u32>,
}

/// What a migration did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationReport {
    pub to: String,
    pub rounds: Vec<Round>,
    /// The final snapshot (taken with the guest paused) and its delta.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_snapshot: Option<String>,
    pub final_objects: usize,
    pub final_bytes: u64,
    /// Bytes sent over all rounds and the final delta, before compression.
    pub total_bytes: u64,
    /// Non-zero guest memory at the final snapshot.
    pub memory_bytes: u64,
    /// From the pause request to the destination running (ms).
    pub downtime_ms: u64,
    /// Where the downtime went, in ms: `pause` (reach a safe point, write the final
    /// snapshot), `final delta`, `prepare` (the destination verifies, admits, restores),
    /// `commit`.
    #[serde(default)]
    pub steps: String,
    pub total_ms: u64,
    /// `in progress`, `committed`, or `aborted: <reason>`.
    pub outcome: String,
    /// With `auto_converge`: how long the guest was held back in all while it was copied
    /// (ms; absent: it never was).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_ms: Option<u64>,
    /// The session's standby, which follows it to the destination (absent when it had none,
    /// or when the destination was its standby: the session runs there without one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby: Option<String>,
}

/// `POST /v1/sessions/{id}/lend`: a client outside the space (a browser tab, Node) takes a
/// running or suspended session over (docs/browser.md, "Taking a session over").
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LendRequest {
    /// How the client describes itself (shown by `ps`; at most 200 characters are kept).
    #[serde(default)]
    pub client: String,
    /// The session comes back (as by a reclaim) once the space has heard nothing from the
    /// client for this long (ms, [`MIN_LEASE_MS`] to [`MAX_LEASE_MS`]); the client's output,
    /// checkpoints and empty appends renew it. Absent: lent until given back or reclaimed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// Only check that the session could be lent now (this space's policy, its state): nothing
    /// is lent, and the answer's epoch and snapshot are the session's as they are.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
}

/// Shortest lease a client may take a session with (ms).
pub const MIN_LEASE_MS: u64 = 1000;
/// Longest lease (ms): a day.
pub const MAX_LEASE_MS: u64 = 86_400_000;

/// What a client that took a session over holds: the snapshot to resume, the epoch it holds
/// the session at (every later call names it), and the length of the output log it continues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lent {
    pub session: SessionInfo,
    pub snapshot: String,
    pub epoch: u64,
    pub log_len: u64,
}

/// `POST /v1/sessions/{id}/return`: the client gives a session it took over back, saying how
/// its guest ended there — exactly one of `snapshot`, `exit_code`, `trap`, `refused`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReturnRequest {
    /// The epoch the session was lent at.
    pub epoch: u64,
    /// Suspended there: the snapshot it wrote to this space (its parent is the snapshot it
    /// was lent at, its output log continues the session's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// The guest exited with this code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The guest trapped (the cause, in the specification's words).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trap: Option<String>,
    /// The client could not resume the snapshot (why); the guest never ran there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// With `exit_code` or `trap`: the whole output log's length, as the client sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_len: Option<u64>,
    /// With `exit_code` or `trap`: what the guest's mounts held as it ended, as trees the
    /// client sent to this space.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<Vec<MountTree>>,
}

/// `POST /v1/sessions/{id}/checkpointed`: the holder of a lent session wrote a checkpoint of
/// its guest (which goes on there) to this space.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointedRequest {
    pub epoch: u64,
    /// The checkpoint: sent and named here already; its parent is the session's last
    /// snapshot, its output log agrees with the session's.
    pub snapshot: String,
}

/// `POST /v1/sessions/{id}/output`: how long the session's output log is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLength {
    pub len: u64,
}

/// The header of a `409` to `POST /v1/sessions/{id}/output` that names the log's length, when
/// the client's bytes start past it (the client sends again from there).
pub const LOG_LEN_HEADER: &str = "ferry-log-len";

/// `POST /v1/gc`: collect garbage while the space serves.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GcRequest {
    /// Only report what would be deleted.
    #[serde(default)]
    pub dry_run: bool,
    /// Keep only the newest N snapshots of each session's and named snapshot's history
    /// (absent: all of it).
    #[serde(default)]
    pub keep: Option<u64>,
}

/// What `POST /v1/gc` did: a [`Collected`] as JSON.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcReport {
    /// Objects deleted (with `dry_run`: that would be).
    pub removed: usize,
    /// Objects a ref reaches.
    pub kept: usize,
    /// Objects no ref reaches, spared because they were written or asked about within the
    /// space's grace period (a snapshot being written or pushed may name them yet).
    pub spared: usize,
    /// Pack files rewritten without their deleted objects, or deleted.
    pub packs_rewritten: usize,
    /// Bytes the store takes less on disk.
    pub freed_bytes: u64,
}

impl From<Collected> for GcReport {
    fn from(c: Collected) -> Self {
        Self {
            removed: c.removed,
            kept: c.kept,
            spared: c.spared,
            packs_rewritten: c.compacted.files,
            freed_bytes: c.compacted.freed,
        }
    }
}

impl From<GcReport> for Collected {
    fn from(r: GcReport) -> Self {
        Self {
            removed: r.removed,
            kept: r.kept,
            spared: r.spared,
            compacted: ferry_store::Compacted {
                files: r.packs_rewritten,
                freed: r.freed_bytes,
            },
        }
    }
}

/// `POST /v1/migrations`: from the source space to the destination, after each pre-copy
/// round and the final delta. Fields this version does not know are ignored: a newer source
/// may send them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrepareRequest {
    pub session: String,
    pub snapshot: String,
    /// The epoch the session takes here; must exceed any epoch this space knows for it.
    pub epoch: u64,
    /// The source space's URL (asked for the outcome if the source goes quiet).
    pub source: String,
    /// This space's URL as the source knows it.
    pub to: String,
    pub program: String,
    pub engine: String,
    /// The session's periodic checkpoints, which go on here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every_ms: Option<u64>,
    /// This move's attempt id ([`SessionInfo::attempt`]; 1 to 32 of `[0-9a-f]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
    /// The session's standby ([`SessionInfo::standby`]), which follows it here — unless it is
    /// this space: the session then runs here without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby: Option<String>,
    /// With a standby: how much of the output log the source shows ([`SessionInfo::released`]);
    /// this space shows no less, and no more until the standby holds a newer checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<u64>,
    /// The session is suspended at the source: once the move commits it stays suspended
    /// here (resumed by `resume`), rather than running.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspended: bool,
    /// The source chose the standby itself ([`SessionInfo::standby_auto`]): this space goes
    /// on choosing it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub standby_auto: bool,
    /// The session is interactive ([`SessionInfo::interactive`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub interactive: bool,
    /// At the final prepare of an interactive session: its input as the source sealed it
    /// (a blob already sent; it starts with what the snapshot carries and may hold more).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// That input has ended.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub input_ended: bool,
}

/// The request header with which a caller asks for progress on a call that may work long — a
/// migration's prepare (`POST /v1/migrations`), a `migrate`, a `run` or a `resume`: the space
/// then answers `200` with this header at once, sends a space (`0x20`) every
/// [`crate::net::PROGRESS_EVERY`] while it works, and ends with a [`Progressed`] — so the
/// caller can tell a call that takes long from a process that hung.
pub const PROGRESS: &str = "ferry-progress";

/// How a call answered with progress ([`PROGRESS`]) ended, after its spaces:
/// `{"ok": <the answer>}` or `{"error": {"status": 409, "message": "…"}}` (the status and
/// reason the call answers without progress).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Progressed<T> {
    Ok(Box<T>),
    Error { status: u16, message: String },
}

/// How a prepare answered with progress ended.
pub type Prepared = Progressed<SessionInfo>;

/// `POST /v1/migrations/{id}/commit` and `/abort`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    pub epoch: u64,
}

/// A refusal or failure: an HTTP status and a reason a user can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct ApiError {
    pub status: u16,
    pub msg: String,
}

impl ApiError {
    pub fn new(status: u16, msg: impl Into<String>) -> Self {
        Self {
            status,
            msg: msg.into(),
        }
    }

    pub fn bad_request(msg: impl Into<String>) -> Self {
        Self::new(400, msg)
    }

    pub fn forbidden(msg: impl Into<String>) -> Self {
        Self::new(403, msg)
    }

    pub fn not_found(msg: impl Into<String>) -> Self {
        Self::new(404, msg)
    }

    pub fn conflict(msg: impl Into<String>) -> Self {
        Self::new(409, msg)
    }

    pub fn unprocessable(msg: impl Into<String>) -> Self {
        Self::new(422, msg)
    }

    pub fn internal(msg: impl std::fmt::Display) -> Self {
        Self::new(500, msg.to_string())
    }

    pub fn unavailable(msg: impl Into<String>) -> Self {
        Self::new(503, msg)
    }
}

/// `id` as a session id, or the refusal that names the rule.
pub fn session_id(id: &str) -> Result<&str, ApiError> {
    if valid_id(id) {
        Ok(id)
    } else {
        Err(ApiError::bad_request(format!(
            "`{id}` is not a session id (1-64 of A-Z a-z 0-9 _ -)"
        )))
    }
}

/// Whether `id` is a usable session id: 1–64 of `[A-Za-z0-9_-]` (it names files).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
