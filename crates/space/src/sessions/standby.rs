//! Standby copies: a session run with `--standby URL` is kept at each of its checkpoints by
//! another space of the same etcd fleet, which takes it over when its owner's lease runs out
//! (docs/migration.md, "Standby").
//!
//! The owner sends each checkpoint's closure to the standby and then names the checkpoint
//! (`POST /v1/sessions/{id}/standby`); the standby records it durably before it answers. The
//! owner shows the session's output only up to what an answered checkpoint covers (its
//! `released` length) — the output-commit rule: whatever a reader saw is in the copy a
//! standby would resume, so a take-over never shows anything differently. The guest itself
//! runs on meanwhile.
//!
//! Who goes on is decided in etcd ([`crate::owners`]): the standby takes the session over only
//! by a transaction that holds while the owner's lease key is gone and neither the owner nor
//! the standby record changed; an owner whose session ends (exits, fails, is killed) removes
//! the standby record first, by a transaction that holds only while it still owns the
//! session. An owner that finds it no longer owns the session (the standby took it over while
//! this space was cut off or stopped) is fenced: its guest stops, and nothing more of its
//! output is shown.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use ferry_engine::Request;
use ferry_kappa::Kappa;
use tracing::{info, warn};

use super::{Begin, Live, Sessions, lock, parse_engine, parse_kappa};
use crate::api::{
    AdmissionCheck, Admitted, ApiError, SessionInfo, SetStandby, StandbyRequest, State, session_id,
};
use crate::client::{SpaceClient, send_closure};
use crate::owners::{Announced, EndStandby, Owner};

/// How often a standby space reads etcd for each copy it holds.
const WATCH_EVERY: Duration = Duration::from_secs(1);
/// How long the owner waits before it tries an unanswered checkpoint again.
const RETRY_EVERY: Duration = Duration::from_secs(1);
/// How long a copy sent ahead of etcd naming this space the standby waits to be named.
const PENDING_FOR: Duration = Duration::from_secs(60);
/// `--standby auto`: the space chooses the session's standby among the live spaces of the
/// fleet, and chooses another whenever it is gone.
pub(crate) const AUTO: &str = "auto";
/// How often the keeper looks at the sessions whose standby this space chooses.
const KEEP_EVERY: Duration = Duration::from_secs(2);

/// How long a chosen standby that etcd still announces may go on taking none of the
/// checkpoints sent it (refusing them, or unreachable from here) before another is chosen:
/// `FERRY_STANDBY_STUCK_MS`, else 15 s.
fn stuck_for() -> Duration {
    static AFTER: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *AFTER.get_or_init(|| {
        std::env::var("FERRY_STANDBY_STUCK_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(Duration::from_secs(15), Duration::from_millis)
    })
}

/// A checkpoint for the standby: its κ, and whether the guest runs on after it.
pub(super) struct ToStandby {
    pub(super) snapshot: Kappa,
    pub(super) running: bool,
}

/// Length of the output log a snapshot carries (0 without one).
fn output_len(store: &dyn ferry_store::Store, k: &Kappa) -> Result<u64, String> {
    let snap: ferry_object::Snapshot =
        ferry_object::decode(&store.get(k).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    let Some(o) = snap.output else {
        return Ok(0);
    };
    let log: ferry_object::OutputLog =
        ferry_object::decode(&store.get(&o).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    Ok(log.len)
}

/// Whether `space` is announced in another zone than `mine` (neither may be unnamed).
fn apart(mine: Option<&str>, space: &Announced) -> bool {
    matches!((mine, space.zone.as_deref()), (Some(m), Some(z)) if m != z)
}

/// What the keeper looked at when it asks for another standby.
struct Keeping {
    /// The session's standby then.
    looked_at: Option<String>,
    /// Only a space of another zone will do (the standby works, but shares this space's
    /// zone).
    apart_only: bool,
}

/// A standby lives on a session's checkpoints: refused for one that takes none.
fn needs_checkpoints(checkpoint_every_ms: Option<u64>) -> Result<(), ApiError> {
    match checkpoint_every_ms {
        Some(_) => Ok(()),
        None => Err(ApiError::bad_request(
            "a standby keeps the session's checkpoints: give checkpoint_every_ms \
             (`--checkpoint-every`)",
        )),
    }
}

/// Why a checkpoint did not reach the standby.
enum Unsent {
    /// Etcd names another owner now: this copy is fenced.
    Superseded(Owner),
    /// Etcd names another standby of this space's session than the one asked (the space
    /// stopped between naming it in etcd and recording it here): that one is the standby.
    Renamed(String),
    Failed(String),
}

impl Sessions {
    /// Checks a `run --standby` request (before anything is started): the space is in a fleet,
    /// the session is checkpointed, the standby is another space that answers.
    pub(super) fn check_standby(
        &self,
        to: &str,
        checkpoint_every_ms: Option<u64>,
        need: &AdmissionCheck,
    ) -> Result<String, ApiError> {
        let Some(o) = &self.cfg.owners else {
            return Err(ApiError::bad_request(
                "a standby needs a fleet: this space was started without --etcd",
            ));
        };
        needs_checkpoints(checkpoint_every_ms)?;
        let to = to.trim_end_matches('/').to_owned();
        if !(to.starts_with("http://") || to.starts_with("https://")) {
            return Err(ApiError::bad_request(format!(
                "standby `{to}`: a space's URL (http:// or https://)"
            )));
        }
        if to == o.me() {
            return Err(ApiError::bad_request(format!(
                "standby `{to}` is this space; name another space of the fleet"
            )));
        }
        let peer = SpaceClient::new(&to, &self.cfg.peer_token);
        peer.health().map_err(|e| {
            ApiError::unavailable(format!("the standby {to} cannot be reached: {}", e.msg))
        })?;
        // The standby's policy must admit the guest it would take over.
        peer.admission(need).map_err(|e| {
            let why = format!(
                "the standby {to} would not take the session over: {}",
                e.msg
            );
            match e.status {
                403 => ApiError::forbidden(why),
                0 | 502..=504 => ApiError::unavailable(why),
                _ => ApiError::bad_request(why),
            }
        })?;
        // It must be a space of this fleet: announced in the same etcd, under the same prefix.
        let announced = o.announced(&to).map_err(|e| {
            ApiError::unavailable(format!("cannot ask etcd whether {to} is in the fleet: {e}"))
        })?;
        match announced {
            None => Err(ApiError::bad_request(format!(
                "standby {to} is not a space of this fleet: etcd has no live announcement of \
                 it (start it with --etcd naming the same cluster and --etcd-prefix, and \
                 --advertise {to} if peers reach it at another address)"
            ))),
            Some(a) if a.draining => Err(ApiError::unavailable(format!(
                "standby {to} is being drained (`ferry --space {to} drain --undo` ends that)"
            ))),
            Some(_) => Ok(to),
        }
    }

    /// Chooses a standby for session `id` (`--standby auto`): the first live space of the
    /// fleet, other than this one and `avoid`, that passes [`Sessions::check_standby`] —
    /// those of another zone than this space's first (`ferry serve --zone`), and within
    /// each group starting at a place the session id picks, so that a space's sessions
    /// spread over the fleet. With `apart_only`, only spaces of another zone. Refused with
    /// each candidate's reason when none passes.
    pub(super) fn choose_standby(
        &self,
        id: &str,
        checkpoint_every_ms: Option<u64>,
        need: &AdmissionCheck,
        avoid: &[String],
        apart_only: bool,
    ) -> Result<String, ApiError> {
        let Some(o) = &self.cfg.owners else {
            return Err(ApiError::bad_request(
                "a standby needs a fleet: this space was started without --etcd",
            ));
        };
        needs_checkpoints(checkpoint_every_ms)?;
        let mut candidates: Vec<Announced> = o
            .live_spaces()
            .map_err(|e| {
                ApiError::unavailable(format!(
                    "cannot ask etcd which spaces are in the fleet: {e}"
                ))
            })?
            .into_iter()
            .filter(|s| s.space != o.me() && !avoid.contains(&s.space) && !s.draining)
            .filter(|s| !apart_only || apart(o.zone(), s))
            .collect();
        if candidates.is_empty() {
            return Err(ApiError::unavailable(format!(
                "no space of the fleet can stand by for session `{id}`: etcd announces no \
                 other live space{}{}",
                match (apart_only, o.zone()) {
                    (true, Some(zone)) => format!(" outside zone `{zone}`"),
                    _ => String::new(),
                },
                if avoid.is_empty() {
                    String::new()
                } else {
                    format!(" than {}", avoid.join(", "))
                }
            )));
        }
        super::start_where_id_picks(id, &mut candidates);
        // A stable sort: each group keeps the order the id picked.
        candidates.sort_by_key(|s| !apart(o.zone(), s));
        let mut refusals = Vec::new();
        for c in candidates.iter().map(|c| &c.space) {
            match self.check_standby(c, checkpoint_every_ms, need) {
                Ok(to) => return Ok(to),
                Err(e) => refusals.push(e.msg),
            }
        }
        Err(ApiError::unavailable(format!(
            "no space of the fleet can stand by for session `{id}`: {}",
            refusals.join("; ")
        )))
    }

    /// `GET /v1/fleet`: the live spaces of this space's fleet, and for each how many of the
    /// sessions here it stands by for.
    pub fn fleet(&self) -> Result<crate::api::Fleet, ApiError> {
        let Some(o) = &self.cfg.owners else {
            return Err(ApiError::bad_request(
                "this space was started without --etcd: it is in no fleet",
            ));
        };
        let spaces = o.live_spaces().map_err(|e| {
            ApiError::unavailable(format!(
                "cannot ask etcd which spaces are in the fleet: {e}"
            ))
        })?;
        let standbys: Vec<String> = lock(&self.live)
            .values()
            .map(|l| l.info())
            .filter(|i| matches!(i.state, State::Running | State::Suspended))
            .filter_map(|i| i.standby)
            .collect();
        Ok(crate::api::Fleet {
            me: o.me().to_owned(),
            zone: o.zone().map(str::to_owned),
            spaces: spaces
                .into_iter()
                .map(|a| crate::api::FleetSpace {
                    standby_for: standbys.iter().filter(|s| **s == a.space).count() as u64,
                    space: a.space,
                    zone: a.zone,
                    draining: a.draining,
                })
                .collect(),
        })
    }

    /// Whether a session's `standby` (its announcement among the live `spaces`) should move
    /// to another zone: this space names a zone, the standby is not in another one, and
    /// some other live space is — that one.
    fn apart_wanted<'a>(&self, standby: &Announced, spaces: &'a [Announced]) -> Option<&'a str> {
        let o = self.cfg.owners.as_ref()?;
        if o.zone().is_none() || apart(o.zone(), standby) {
            return None;
        }
        spaces
            .iter()
            .find(|s| s.space != o.me() && s.space != standby.space && apart(o.zone(), s))
            .map(|s| s.space.as_str())
    }

    /// Hands a new snapshot of a session that has a standby to its sender thread (started
    /// on first use); the newest one wins.
    pub(super) fn to_standby(self: &Arc<Self>, live: &Arc<Live>, k: Kappa, running: bool) {
        let info = live.info();
        // A moving session's checkpoints go to its destination; the standby gets the next
        // one from wherever the session runs after the move.
        if info.standby.is_none() || info.migrating_to.is_some() {
            return;
        }
        let mut g = lock(&live.standby_tx);
        let next = ToStandby {
            snapshot: k,
            running,
        };
        // A sender that is gone hands the value back, to be given to a new one.
        let next = match g.as_ref() {
            Some(tx) => match tx.send(next) {
                Ok(()) => return,
                Err(mpsc::SendError(n)) => n,
            },
            None => next,
        };
        let (tx, rx) = mpsc::channel();
        let _ = tx.send(next);
        *g = Some(tx);
        let (me, l) = (self.clone(), live.clone());
        let spawned = std::thread::Builder::new()
            .name("standby-sender".into())
            .spawn(move || me.send_to_standby(&l, &rx));
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start the standby sender");
            *g = None;
        }
    }

    /// The sender thread: each newest checkpoint to the standby, again every second until
    /// it is taken (or a newer one comes); the output it covers is then shown.
    fn send_to_standby(self: &Arc<Self>, live: &Arc<Live>, rx: &mpsc::Receiver<ToStandby>) {
        let Ok(mut next) = rx.recv() else {
            return;
        };
        loop {
            while let Ok(n) = rx.try_recv() {
                next = n;
            }
            let info = live.info();
            if live.gone.load(Ordering::SeqCst)
                || info.standby.is_none()
                || matches!(
                    info.state,
                    State::Moved | State::Standby | State::Exited | State::Failed | State::Killed
                )
            {
                return;
            }
            // What the answer says holds only while the session still has that standby
            // (`standby --to` or `--none` may have changed it meanwhile).
            let same = |i: &SessionInfo| i.standby == info.standby;
            let to = info.standby.as_deref().unwrap_or_default();
            match self.send_one(&info, to, &next, false) {
                Ok(len) => {
                    self.cfg
                        .metrics
                        .standby_taken
                        .fetch_add(1, Ordering::Relaxed);
                    *lock(&live.standby_failing_since) = None;
                    self.update(live, |i| {
                        if same(i) {
                            i.released = Some(i.released.unwrap_or(0).max(len));
                            i.standby_error = None;
                        }
                    });
                }
                Err(Unsent::Superseded(owner)) => {
                    self.fence_taken_over(live, &owner);
                    return;
                }
                Err(Unsent::Renamed(now)) => {
                    warn!(session = %info.id, was = %to, now = %now, "etcd names another standby; sending it the checkpoints");
                    self.update(live, |i| {
                        if same(i) {
                            i.standby = Some(now.clone());
                        }
                    });
                    continue;
                }
                Err(Unsent::Failed(e)) => {
                    self.cfg
                        .metrics
                        .standby_failed
                        .fetch_add(1, Ordering::Relaxed);
                    lock(&live.standby_failing_since).get_or_insert_with(Instant::now);
                    if info.standby_error.as_deref() != Some(&e) {
                        warn!(session = %info.id, error = %e, "the standby did not take the checkpoint; output is held back");
                        self.update(live, |i| {
                            if same(i) {
                                i.standby_error = Some(e);
                            }
                        });
                    }
                    match rx.recv_timeout(RETRY_EVERY) {
                        Ok(n) => next = n,
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                    continue;
                }
            }
            match rx.recv() {
                Ok(n) => next = n,
                Err(_) => return,
            }
        }
    }

    /// Sends one checkpoint's closure to standby `to` and names it there (`pending`: ahead
    /// of etcd naming `to`); returns the length of the output log it covers.
    fn send_one(
        &self,
        info: &SessionInfo,
        to: &str,
        next: &ToStandby,
        pending: bool,
    ) -> Result<u64, Unsent> {
        let o = self.cfg.owners.as_ref().expect("a standby needs owners");
        let k = next.snapshot;
        let len = output_len(self.store.as_ref(), &k).map_err(Unsent::Failed)?;
        let peer = SpaceClient::new(to, &self.cfg.peer_token);
        send_closure(self.store.as_ref(), &peer.store(), k, &mut |_, _| {})
            .map_err(|e| Unsent::Failed(format!("sending a checkpoint to {to}: {e}")))?;
        let req = StandbyRequest {
            owner: o.me().to_owned(),
            epoch: info.epoch,
            snapshot: k.to_string(),
            program: info.program.clone(),
            engine: info.engine.clone(),
            checkpoint_every_ms: info.checkpoint_every_ms,
            running: next.running,
            pending,
            auto: info.standby_auto,
            interactive: info.interactive,
        };
        match peer.standby(&info.id, &req) {
            Ok(_) => Ok(len),
            Err(e) => {
                // Refused: perhaps because the standby took the session over, or because
                // etcd names another standby.
                if e.status == 409
                    && let Ok(view) = o.standby_view(&info.id, o.me())
                {
                    if let Some(now) = &view.owner
                        && now.owner.supersedes(o.me(), info.epoch)
                    {
                        return Err(Unsent::Superseded(now.owner.clone()));
                    }
                    if !pending
                        && view.owned_by(o.me(), info.epoch)
                        && let Some((named, _)) = &view.standby
                        && named.epoch == info.epoch
                        && named.space != to
                    {
                        return Err(Unsent::Renamed(named.space.clone()));
                    }
                }
                Err(Unsent::Failed(format!("{to} refused {k}: {}", e.msg)))
            }
        }
    }

    /// The owner etcd names for session `info` now, if that is another space at a later
    /// epoch than this space's: the standby took the session over.
    pub(super) fn superseded(&self, info: &SessionInfo) -> Option<Owner> {
        let o = self.cfg.owners.as_ref()?;
        let view = o.standby_view(&info.id, o.me()).ok()?;
        view.owner
            .map(|r| r.owner)
            .filter(|now| now.supersedes(o.me(), info.epoch))
    }

    /// Etcd names `owner` as the session's owner now, not this space at the session's epoch:
    /// the standby took it over. The guest stops here, nothing more of its output is shown.
    pub(super) fn fence_taken_over(&self, live: &Live, owner: &Owner) {
        let info = self.update(live, |i| {
            i.state = State::Moved;
            i.moved_to = Some(owner.space.clone());
            i.epoch = i.epoch.max(owner.epoch);
            i.reason = Some(format!(
                "taken over by its standby {} (epoch {}): this space's etcd lease ran out",
                owner.space, owner.epoch
            ));
        });
        self.cfg.metrics.fenced.fetch_add(1, Ordering::Relaxed);
        live.log().close();
        if let Some(c) = lock(&live.control).clone() {
            c.end_without_snapshot(true);
            c.request(Request::Suspend);
        }
        warn!(session = %info.id, to = %owner.space, "taken over by the standby; fenced here");
    }

    /// Before a session with a standby is recorded as ended here: the standby record goes
    /// from etcd, so it can no longer be taken over (asked until etcd answers). `false` when
    /// the standby took it over first: this copy is fenced and its end not recorded.
    pub(super) fn end_standby(&self, live: &Live) -> bool {
        let info = live.info();
        let (Some(o), Some(_)) = (&self.cfg.owners, &info.standby) else {
            return true;
        };
        loop {
            let result = o.end_standby(&info.id, info.epoch);
            if result.is_ok() && live.info().end_waits.is_some() {
                self.update(live, |i| i.end_waits = None);
            }
            match result {
                Ok(EndStandby::Ended) => return true,
                Ok(EndStandby::Superseded(Some(owner))) if owner.supersedes(o.me(), info.epoch) => {
                    self.fence_taken_over(live, &owner);
                    return false;
                }
                // The record is gone (forgotten) or odd: nothing can take it over.
                Ok(EndStandby::Superseded(_)) => return true,
                Err(e) => {
                    let why = e.to_string();
                    if live.info().end_waits.as_deref() != Some(&why) {
                        warn!(session = %info.id, error = %why, "cannot remove the standby record from etcd; the session's end waits");
                        self.update(live, |i| i.end_waits = Some(why));
                    }
                    std::thread::sleep(RETRY_EVERY);
                }
            }
        }
    }

    /// `POST /v1/sessions/{id}/standby`: keeps checkpoint `req.snapshot` of a session another
    /// space of the fleet owns, as its standby, once etcd says so and its closure is here.
    pub fn standby(
        self: &Arc<Self>,
        id: &str,
        req: StandbyRequest,
    ) -> Result<SessionInfo, ApiError> {
        session_id(id)?;
        let Some(o) = &self.cfg.owners else {
            return Err(ApiError::bad_request(
                "this space keeps no standby copies: it was started without --etcd",
            ));
        };
        let k = parse_kappa(&req.snapshot, "snapshot")?;
        let engine = parse_engine(Some(&req.engine), ferry_engine::EngineKind::Jit)?;
        let mut closure = BTreeSet::new();
        ferry_engine::closure::snapshot_closure(self.store.as_ref(), &k, false, &mut closure)
            .map_err(|e| ApiError::unprocessable(format!("snapshot {k}: {e}")))?;
        for c in &closure {
            if !self.store.has(c).map_err(ApiError::internal)? {
                return Err(ApiError::unprocessable(format!(
                    "snapshot {k}: object {c} of its closure is not here; send it first"
                )));
            }
        }
        // A copy this space's policy would not resume is refused now, not at the take-over.
        self.admits_copy(k, engine)?;
        let view = o
            .standby_view(id, &req.owner)
            .map_err(|e| super::etcd_unreachable(id, e))?;
        let owned = view.owned_by(&req.owner, req.epoch);
        let named = owned && view.standby_is(o.me(), req.epoch);
        if !(named || (req.pending && owned)) {
            return Err(ApiError::conflict(format!(
                "etcd does not name this space the standby of session `{id}` owned by {} at \
                 epoch {}",
                req.owner, req.epoch
            )));
        }
        let record = |i: &mut SessionInfo| {
            // Nothing of a record the copy replaces (one of the session having moved away
            // from here) stays: its standby, its held output, its last move belong to the
            // owner it was then, and a take-over would act on them.
            *i = SessionInfo::starting(id, &req.program, engine.name(), req.epoch);
            i.state = State::Standby;
            i.snapshot = Some(k.to_string());
            i.source = Some(req.owner.clone());
            i.checkpoint_every_ms = req.checkpoint_every_ms;
            i.resume_on_takeover = req.running;
            i.standby_auto = req.auto;
            i.interactive = req.interactive;
        };
        let existing = lock(&self.live).get(id).cloned();
        let live = match existing {
            Some(live) => {
                let turn = lock(&live.turn);
                let info = live.info();
                // The same owner, or a later one the session moved to (etcd named this space
                // its standby at that epoch, checked above); or the record of a session that
                // moved away from here before, which the copy replaces.
                let moved_before =
                    info.state == State::Moved && info.epoch <= req.epoch && !info.commit_pending;
                if !moved_before
                    && (info.state != State::Standby
                        || info.epoch > req.epoch
                        || (info.epoch == req.epoch && info.source.as_deref() != Some(&req.owner)))
                {
                    return Err(ApiError::conflict(format!(
                        "session `{id}` is {} here (epoch {}), not a standby copy of {}'s",
                        info.state.name(),
                        info.epoch,
                        req.owner
                    )));
                }
                self.update(&live, record);
                drop(turn);
                live
            }
            None => {
                let mut info = SessionInfo::starting(id, &req.program, engine.name(), req.epoch);
                record(&mut info);
                let live = Live::new(info.clone(), ferry_wasi::OutputBuffer::default());
                live.log().close();
                let mut g = lock(&self.live);
                if g.contains_key(id) {
                    return Err(ApiError::conflict(format!(
                        "session `{id}` appeared here meanwhile; send the checkpoint again"
                    )));
                }
                self.save(&info).map_err(ApiError::internal)?;
                g.insert(id.to_owned(), live.clone());
                info!(session = %id, owner = %req.owner, "standby copy kept");
                live
            }
        };
        *lock(&live.pending_until) = (!named).then(|| Instant::now() + PENDING_FOR);
        let info = live.info();
        self.point_ref(&info, k);
        Ok(info)
    }

    /// `POST /v1/admission`: whether this space's policy admits a guest with these needs.
    pub fn admission(&self, req: &AdmissionCheck) -> Result<Admitted, ApiError> {
        const MAX_NAMES: usize = 4096;
        if req.env.len() > MAX_NAMES || req.mounts.len() > MAX_NAMES {
            return Err(ApiError::bad_request(format!(
                "at most {MAX_NAMES} environment variables and {MAX_NAMES} mounts"
            )));
        }
        let engine = match &req.engine {
            Some(e) => Some(parse_engine(Some(e), ferry_engine::EngineKind::Jit)?),
            None => None,
        };
        self.cfg
            .policy
            .admits(engine, &req.env, &req.mounts, req.memory_bytes)
            .map_err(ApiError::forbidden)?;
        Ok(Admitted { admitted: true })
    }

    /// What checkpoint `k` needs of a space's policy to be resumed on `engine` (its closure
    /// is here): refused at once if it is host-bound.
    fn admission_of(
        &self,
        k: Kappa,
        engine: ferry_engine::EngineKind,
    ) -> Result<AdmissionCheck, ApiError> {
        use ferry_object::{MemoryImage, Snapshot, WasiState};
        let store = self.store.as_ref();
        let get = |k: &Kappa| {
            store
                .get(k)
                .map_err(|e| ApiError::unprocessable(format!("snapshot {k}: {e}")))
        };
        let bad =
            |e: ferry_object::ObjectError| ApiError::unprocessable(format!("snapshot {k}: {e}"));
        let snap: Snapshot = ferry_object::decode(&get(&k)?).map_err(bad)?;
        let wasi: WasiState = ferry_object::decode(&get(&snap.wasi)?).map_err(bad)?;
        let mut memory = 0u64;
        for m in &snap.memories {
            let image: MemoryImage = ferry_object::decode(&get(m)?).map_err(bad)?;
            memory = memory.saturating_add(image.len);
        }
        if let Some(m) = wasi.mounts.iter().find(|m| m.host_bound) {
            return Err(ApiError::unprocessable(format!(
                "the checkpoint is host-bound (`{}` is a host directory passed through), so \
                 no standby can resume it",
                m.guest_path
            )));
        }
        Ok(AdmissionCheck {
            engine: Some(engine.name().into()),
            env: wasi.env.iter().map(|(k, _)| k.clone()).collect(),
            mounts: wasi.mounts.iter().map(|m| m.guest_path.clone()).collect(),
            memory_bytes: Some(memory),
        })
    }

    /// This space's policy would resume checkpoint `k` on `engine` (a standby copy's).
    fn admits_copy(&self, k: Kappa, engine: ferry_engine::EngineKind) -> Result<(), ApiError> {
        let need = self.admission_of(k, engine)?;
        self.cfg
            .policy
            .admits(Some(engine), &need.env, &need.mounts, need.memory_bytes)
            .map_err(|e| {
                ApiError::forbidden(format!("this space's policy would not resume it: {e}"))
            })
    }

    /// `POST /v1/sessions/{id}/set-standby`: the owner gives a running or suspended session
    /// a standby (`to`: another one, or a first one for a session run without), or none. A
    /// new standby is checked as at `run --standby` and sent a checkpoint that covers all the
    /// output shown so far; the old one drops its copy once etcd no longer names it. Without
    /// a standby, the whole output is shown.
    pub fn set_standby(
        self: &Arc<Self>,
        id: &str,
        req: SetStandby,
    ) -> Result<SessionInfo, ApiError> {
        self.set_standby_if(id, req, None)
    }

    /// [`Sessions::set_standby`]; for the keeper, only while the space still chooses the
    /// session's standby and that is still the one the keeper looked at (an operator may
    /// have named one, or none, since): else the session is left as it is.
    fn set_standby_if(
        self: &Arc<Self>,
        id: &str,
        req: SetStandby,
        keeper: Option<&Keeping>,
    ) -> Result<SessionInfo, ApiError> {
        let live = self.get(id)?;
        let _turn = lock(&live.turn);
        let info = live.info();
        if let Some(k) = keeper
            && !(info.standby_auto && info.standby == k.looked_at)
        {
            return Ok(info);
        }
        let apart_only = keeper.is_some_and(|k| k.apart_only);
        let Some(o) = &self.cfg.owners else {
            return Err(ApiError::bad_request(
                "a standby needs a fleet: this space was started without --etcd",
            ));
        };
        match info.state {
            State::Running | State::Suspended if info.migrating_to.is_none() => {}
            State::Lent => return Err(super::lend::lent_refusal(&info)),
            s => {
                return Err(ApiError::conflict(format!(
                    "session `{id}` is {}; only the standby of a running or suspended session \
                     changes",
                    if info.migrating_to.is_some() {
                        "moving"
                    } else {
                        s.name()
                    }
                )));
            }
        }
        // Etcd names the new standby (or none) while this space still owns the session;
        // otherwise the standby took it over: fenced.
        let superseded = |now: Option<Owner>| -> ApiError {
            match now {
                Some(owner) if owner.supersedes(o.me(), info.epoch) => {
                    self.fence_taken_over(&live, &owner);
                    ApiError::conflict(format!(
                        "session `{id}` was taken over by {} (epoch {}); it is not this \
                         space's any more",
                        owner.space, owner.epoch
                    ))
                }
                _ => ApiError::conflict(format!(
                    "etcd does not name this space the owner of session `{id}` at epoch {}",
                    info.epoch
                )),
            }
        };
        let Some(to) = req.to else {
            let Some(old) = &info.standby else {
                return Err(ApiError::conflict(format!(
                    "session `{id}` has no standby to give up"
                )));
            };
            match o.end_standby(id, info.epoch) {
                Ok(EndStandby::Ended) => {}
                Ok(EndStandby::Superseded(now)) => return Err(superseded(now)),
                Err(e) => return Err(super::etcd_unreachable(id, e)),
            }
            let info = self.update(&live, |i| {
                i.standby = None;
                i.standby_error = None;
                i.standby_auto = false;
                i.released = None;
            });
            info!(session = %id, standby = %old, "standby given up; all output shown");
            return Ok(info);
        };
        if info.checkpoint_every_ms.is_none() {
            return Err(ApiError::conflict(format!(
                "session `{id}` was started without --checkpoint-every: a standby keeps a \
                 session's checkpoints, and this one takes none"
            )));
        }
        // `auto`: a space chosen now, checked against the session's latest snapshot (and
        // again, below, against the checkpoint it is sent), before anything is held back.
        let auto = to == AUTO;
        let check = if auto {
            let k =
                parse_kappa(info.snapshot.as_deref().unwrap_or(""), "snapshot").map_err(|_| {
                    ApiError::conflict(format!(
                        "session `{id}` has no checkpoint yet to give a standby; try again \
                         after its first"
                    ))
                })?;
            Some(self.admission_of(k, super::engine_of(&live))?)
        } else {
            None
        };
        // With `auto`, a space that passed the checks but did not take the copy (it holds a
        // session of that id it cannot replace, say) gives way to the next.
        let mut avoid: Vec<String> = info.standby.iter().cloned().collect();
        let mut failed = Vec::new();
        let info = loop {
            let to = match &check {
                Some(check) => {
                    let chosen = self.choose_standby(
                        id,
                        info.checkpoint_every_ms,
                        check,
                        &avoid,
                        apart_only,
                    );
                    match chosen {
                        Ok(to) => to,
                        Err(e) if failed.is_empty() => return Err(e),
                        Err(_) => {
                            return Err(ApiError::unavailable(format!(
                                "no space of the fleet took a standby copy of session `{id}`: \
                                 {}",
                                failed.join("; ")
                            )));
                        }
                    }
                }
                None => to.clone(),
            };
            let first = info.standby.is_none();
            let need = if first {
                // From now on its output waits for the standby (the output-commit rule), and
                // the standby's first copy must hold all that was shown before: a reader that
                // found no hold read no further than the log's length now
                // ([`Sessions::logs`]).
                let held = live.log().len();
                self.update(&live, |i| i.released = Some(held));
                live.log().len()
            } else {
                0
            };
            let given = self.give_standby(&live, &info, &to, need, &superseded);
            if first && given.is_err() {
                self.update(&live, |i| {
                    if i.standby.is_none() {
                        i.released = None;
                    }
                });
            }
            match given {
                Err(e) if auto && e.status != 409 => {
                    failed.push(e.msg);
                    avoid.push(to);
                }
                given => break given?,
            }
        };
        let info = if info.standby_auto == auto {
            info
        } else {
            self.update(&live, |i| i.standby_auto = auto)
        };
        // The session ended meanwhile, perhaps before it had the standby to remove: the
        // record must not outlive it.
        if !matches!(info.state, State::Running | State::Suspended) {
            self.end_standby(&live);
        }
        Ok(info)
    }

    /// The second half of `set-standby --to`: a checkpoint covering the first `need` bytes of
    /// the output, the new standby checked against it, named in etcd, and sent it.
    fn give_standby(
        self: &Arc<Self>,
        live: &Arc<Live>,
        info: &SessionInfo,
        to: &str,
        need: u64,
        superseded: &dyn Fn(Option<Owner>) -> ApiError,
    ) -> Result<SessionInfo, ApiError> {
        let id = &info.id;
        let o = self.cfg.owners.as_ref().expect("checked by set_standby");
        if info.standby.as_deref() == Some(to.trim_end_matches('/')) {
            return Ok(live.info());
        }
        let (latest, running) = self.checkpoint_covering(live, need)?;
        let engine = super::engine_of(live);
        let check = self.admission_of(latest, engine)?;
        let to = self.check_standby(to, info.checkpoint_every_ms, &check)?;
        // The new standby holds the checkpoint before etcd names it: a failure of this space
        // at any moment leaves a named standby with a copy (the old one until the switch),
        // or, for a first standby, none named.
        let ahead = ToStandby {
            snapshot: latest,
            running,
        };
        self.send_one(info, &to, &ahead, true)
            .map_err(|e| match e {
                Unsent::Superseded(now) => superseded(Some(now)),
                // Not asked of a copy sent ahead.
                Unsent::Renamed(e) | Unsent::Failed(e) => ApiError::unavailable(format!(
                    "the standby {to} did not take the checkpoint: {e}"
                )),
            })?;
        // An interactive session's input: all of it at the new standby before etcd names
        // it, and none answered for meanwhile (`send_input` waits for this lock), so that
        // the standby etcd names holds every piece answered for.
        let mut forwarded = lock(&live.input_forwarded);
        let mut ahead = None;
        self.forward_input(&live.info(), &to, &mut ahead)
            .map_err(|e| {
                ApiError::unavailable(format!(
                    "the standby {to} did not take the session's input: {}",
                    e.msg
                ))
            })?;
        super::fault("standby-sent-ahead");
        match o.set_standby(id, info.epoch, &to) {
            Ok(true) => super::fault("standby-named"),
            Ok(false) => {
                let now = o.owner(id).ok().flatten().map(|r| r.owner);
                return Err(superseded(now));
            }
            Err(e) => return Err(super::etcd_unreachable(id, e)),
        }
        let now = self.update(live, |i| {
            i.standby = Some(to.clone());
            i.standby_error = None;
        });
        if ahead.is_some() {
            *forwarded = ahead;
        }
        drop(forwarded);
        *lock(&live.standby_failing_since) = None;
        self.to_standby(live, latest, running);
        match &info.standby {
            Some(old) => info!(session = %id, from = %old, to = %to, "standby changed"),
            None => info!(session = %id, to = %to, "standby given"),
        }
        Ok(now)
    }

    /// A snapshot of the session whose output log holds at least `need` bytes: its latest
    /// one while it is suspended, else a checkpoint taken now (again, if one already under
    /// way when asked covers less). Also whether the guest runs on after it.
    fn checkpoint_covering(&self, live: &Arc<Live>, need: u64) -> Result<(Kappa, bool), ApiError> {
        let id = live.info().id;
        for _ in 0..3 {
            let info = live.info();
            let (k, running) = if info.state == State::Running {
                let after = self.stop(&id, Request::Checkpoint, false)?;
                (after.snapshot, after.state == State::Running)
            } else {
                (info.snapshot, false)
            };
            let k = parse_kappa(k.as_deref().unwrap_or(""), "snapshot").map_err(|_| {
                ApiError::conflict(format!(
                    "session `{id}` has no checkpoint yet to give a standby; try again after \
                     its first"
                ))
            })?;
            let len = output_len(self.store.as_ref(), &k).map_err(ApiError::internal)?;
            if len >= need {
                return Ok((k, running));
            }
            match live.info().state {
                State::Running => {}
                State::Suspended => {
                    return Err(ApiError::internal(format!(
                        "session `{id}`'s snapshot {k} holds {len} bytes of output, fewer \
                         than the {need} it has shown"
                    )));
                }
                s => {
                    return Err(ApiError::conflict(format!(
                        "session `{id}` is {} now",
                        s.name()
                    )));
                }
            }
        }
        Err(ApiError::unavailable(format!(
            "no checkpoint of session `{id}` covering its output was taken; try again"
        )))
    }

    /// The keeper (a thread): every [`KEEP_EVERY`], each running or suspended session owned
    /// here whose standby this space chooses (`--standby auto`) and that has none — it was
    /// taken over or moved to its standby, or no space could stand by last time — or whose
    /// standby is gone from the fleet (its etcd lease ran out) or has taken no checkpoint
    /// for [`stuck_for`], is given another (`set-standby --to auto`).
    pub(super) fn keep_standbys(self: &Arc<Self>) {
        let chosen = |l: &Live| {
            let i = l.info();
            i.standby_auto
                && matches!(i.state, State::Running | State::Suspended)
                && i.migrating_to.is_none()
                && i.lent_to.is_none()
                && !l.gone.load(Ordering::SeqCst)
        };
        self.every_round("standby-keeper", KEEP_EVERY, chosen, |me, chosen| {
            if chosen.is_empty() {
                return;
            }
            let o = me.cfg.owners.as_ref().expect("the keeper runs in a fleet");
            match o.live_spaces() {
                Ok(spaces) => {
                    for live in chosen {
                        me.keep_one(&live, &spaces);
                    }
                }
                Err(e) => warn!(error = %e, "cannot read the fleet's spaces in etcd"),
            }
        });
    }

    /// Starts thread `name`, which every `period` hands `round` the sessions here that
    /// `which` picks (the standby watch and keeper).
    fn every_round(
        self: &Arc<Self>,
        name: &str,
        period: Duration,
        which: fn(&Live) -> bool,
        round: fn(&Arc<Self>, Vec<Arc<Live>>),
    ) {
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                loop {
                    std::thread::sleep(period);
                    let picked: Vec<_> = lock(&me.live)
                        .values()
                        .filter(|l| which(l))
                        .cloned()
                        .collect();
                    round(&me, picked);
                }
            });
        if let Err(e) = spawned {
            warn!(error = %e, thread = name, "cannot start a thread");
        }
    }

    /// One session of [`Sessions::keep_standbys`]; `spaces`: the live spaces of the fleet.
    fn keep_one(self: &Arc<Self>, live: &Arc<Live>, spaces: &[Announced]) {
        let info = live.info();
        let mut apart_only = false;
        let standby = info
            .standby
            .as_ref()
            .map(|s| (s, spaces.iter().find(|a| a.space == *s)));
        let why = match standby {
            None => "it has none".to_owned(),
            Some((s, None)) => format!("{s} is gone from the fleet"),
            Some((s, Some(a))) if a.draining => format!("{s} is being drained"),
            Some((s, Some(a))) => match *lock(&live.standby_failing_since) {
                Some(t) if t.elapsed() >= stuck_for() => format!(
                    "{s} has taken none of its checkpoints for {} s",
                    t.elapsed().as_secs()
                ),
                _ => match self.apart_wanted(a, spaces) {
                    // Only a space of another zone replaces a standby that works.
                    Some(other) => {
                        apart_only = true;
                        format!("{s} is not in another zone than this space's, and {other} is")
                    }
                    None => return,
                },
            },
        };
        let req = SetStandby {
            to: Some(AUTO.into()),
        };
        let keeping = Keeping {
            looked_at: info.standby.clone(),
            apart_only,
        };
        match self.set_standby_if(&info.id, req, Some(&keeping)) {
            Ok(now) => {
                *lock(&live.keeper_said) = None;
                info!(session = %info.id, standby = now.standby.as_deref().unwrap_or("none"), why, "another standby chosen");
            }
            Err(e) => {
                let msg = format!("{why}, and no other could be given: {}", e.msg);
                if lock(&live.keeper_said).as_ref() != Some(&msg) {
                    warn!(session = %info.id, error = %msg, "no standby chosen");
                    *lock(&live.keeper_said) = Some(msg.clone());
                }
                // With a standby, its sender says why the output is held; without one, this
                // says why there is none.
                if info.standby.is_none() {
                    self.update(live, |i| {
                        if i.standby.is_none() {
                            i.standby_error = Some(msg);
                        }
                    });
                }
            }
        }
    }

    /// The standby space's watch (a thread): each second, for every copy it holds, whether
    /// the owner's lease is gone (take the session over), or the copy is no longer wanted
    /// (the session ended, moved or was forgotten at its owner: drop it).
    pub(super) fn watch_standbys(self: &Arc<Self>) {
        let copy = |l: &Live| l.info().state == State::Standby;
        self.every_round("standby-watch", WATCH_EVERY, copy, |me, copies| {
            for live in copies {
                me.watch_one(&live);
            }
        });
    }

    fn watch_one(self: &Arc<Self>, live: &Arc<Live>) {
        let o = self
            .cfg
            .owners
            .as_ref()
            .expect("standby copies need owners");
        let info = live.info();
        let owner = info.source.clone().unwrap_or_default();
        let view = match o.standby_view(&info.id, &owner) {
            Ok(v) => v,
            Err(e) => {
                warn!(session = %info.id, error = %e, "cannot read the standby's records in etcd");
                return;
            }
        };
        let owned_by_source = view.owned_by(&owner, info.epoch);
        let standby_is_me = view.standby_is(o.me(), info.epoch);
        if owned_by_source
            && !standby_is_me
            && lock(&live.pending_until).is_some_and(|t| Instant::now() < t)
        {
            // Sent ahead of etcd naming this space (`set-standby`): not yet, or not any more
            // once the time is up.
            return;
        }
        if standby_is_me {
            *lock(&live.pending_until) = None;
        }
        if !(owned_by_source && standby_is_me) {
            // The session moved on (a migration carried its standby along): the copy now
            // watches the new owner, until that one sends a checkpoint of its own.
            if let (Some(r), Some((s, _))) = (&view.owner, &view.standby)
                && r.owner.supersedes(o.me(), info.epoch)
                && s.space == o.me()
                && s.epoch == r.owner.epoch
            {
                self.follow_move(live, &r.owner);
                return;
            }
            self.drop_standby(
                live,
                "the session ended, moved or was forgotten at its owner",
            );
            return;
        }
        if view.owner_alive {
            return;
        }
        let taken = match o.take_over(&info.id, &view) {
            Ok(Some(t)) => t,
            Ok(None) => return,
            Err(e) => {
                warn!(session = %info.id, error = %e, "cannot take the session over in etcd");
                return;
            }
        };
        let _turn = lock(&live.turn);
        // The checkpoint recorded last: one the owner heard taken before the transaction,
        // whose output it may show already, must be the one resumed.
        let info = live.info();
        if info.state != State::Standby {
            return;
        }
        let k = match parse_kappa(info.snapshot.as_deref().unwrap_or(""), "snapshot") {
            Ok(k) => k,
            Err(e) => {
                warn!(session = %info.id, error = %e.msg, "a standby copy without its snapshot");
                return;
            }
        };
        let resume = info.resume_on_takeover;
        let info = self.update(live, |i| {
            // Starting, not suspended, while it is resumed: a `wait` here waits on.
            i.state = if resume {
                State::Starting
            } else {
                State::Suspended
            };
            i.epoch = taken.owner.epoch;
            i.reason = Some(format!(
                "taken over from {owner} (its etcd lease ran out) at its checkpoint {k}"
            ));
        });
        self.point_ref(&info, k);
        self.cfg.metrics.takeovers.fetch_add(1, Ordering::Relaxed);
        warn!(session = %info.id, from = %owner, epoch = info.epoch, "owner gone: session taken over");
        if resume {
            let engine = super::engine_of(live);
            if let Err(e) = self.start(live, Begin::Resume(k), engine, false) {
                warn!(session = %info.id, error = %e.msg, "the session taken over cannot be resumed");
                self.update(live, |i| {
                    i.state = State::Suspended;
                    i.reason = Some(format!(
                        "taken over from {owner}, but it cannot be resumed here: {}",
                        e.msg
                    ));
                });
            }
        }
    }

    /// The session this copy stands by for moved to `owner`, and its standby with it.
    fn follow_move(&self, live: &Arc<Live>, owner: &Owner) {
        let _turn = lock(&live.turn);
        let info = live.info();
        if info.state != State::Standby || info.epoch >= owner.epoch {
            return;
        }
        let info = self.update(live, |i| {
            i.source = Some(owner.space.clone());
            i.epoch = owner.epoch;
        });
        if let Ok(k) = parse_kappa(info.snapshot.as_deref().unwrap_or(""), "snapshot") {
            self.point_ref(&info, k);
        }
        info!(session = %info.id, owner = %owner.space, epoch = owner.epoch, "standby copy follows the session's move");
    }

    /// Forgets a standby copy that is no longer wanted.
    fn drop_standby(&self, live: &Arc<Live>, why: &str) {
        let _turn = lock(&live.turn);
        let info = live.info();
        if info.state != State::Standby {
            return;
        }
        if let Err(e) = self.remove_traces(live, &info.id) {
            warn!(session = %info.id, error = %e, "cannot remove all of the standby copy's traces");
        }
        info!(session = %info.id, why, "standby copy dropped");
    }
}
