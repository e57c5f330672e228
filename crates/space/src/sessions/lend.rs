//! Lending a session to a client outside the space — a browser tab, Node — which runs it and
//! gives it back (docs/browser.md, "Taking a session over").
//!
//! The space stays the session's home: its record, its output log (the client sends the
//! guest's output here as it comes) and its snapshots. While the session is `lent` the space
//! neither runs nor moves it. The client holds it at an epoch one above the session's before;
//! every call it makes names that epoch, and a reclaim raises the epoch again, so a client
//! that comes back after a reclaim is refused: only one copy of the session ever goes on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_engine::{EXIT_TRAPPED, Request, snapshot};
use ferry_kappa::Kappa;
use ferry_store::{RefValue, write_durably};
use ferry_wasi::{AppendAtError, OutputBuffer};
use tracing::info;

use super::{Live, Sessions, lock, parse_kappa};
use crate::api::{
    ApiError, CheckpointedRequest, LendRequest, Lent, MAX_LEASE_MS, MIN_LEASE_MS, MountTree,
    ReturnRequest, SessionInfo, State, session_id,
};

/// Longest client description kept.
const MAX_CLIENT: usize = 200;

/// A refusal of `output` because the client's bytes start past the log's end: the client
/// sends again from `len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputRefusal {
    pub error: ApiError,
    /// The log's length, when the client should send again from there.
    pub len: Option<u64>,
}

impl From<ApiError> for OutputRefusal {
    fn from(error: ApiError) -> Self {
        Self { error, len: None }
    }
}

/// The refusal for anything but the holder's calls while a session is lent.
pub(super) fn lent_refusal(info: &SessionInfo) -> ApiError {
    ApiError::conflict(format!(
        "session `{}` is lent to {} (epoch {}): it runs there; suspend it there, or take it \
         back with `ferry --space URL reclaim {}` (what it did since it was lent is then lost)",
        info.id,
        info.lent_to.as_deref().unwrap_or("a client"),
        info.epoch,
        info.id
    ))
}

/// What a client calls itself, made printable and short.
fn client_name(s: &str) -> String {
    let s: String = s
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX_CLIENT)
        .collect();
    let s = s.trim();
    if s.is_empty() {
        "a client".into()
    } else {
        s.to_owned()
    }
}

/// Whether the session can be lent now: suspended (or, with `running`, running), and not
/// moving; else the refusal.
fn lendable(info: &SessionInfo, running: bool) -> Result<(), ApiError> {
    let id = &info.id;
    if let Some(standby) = &info.standby {
        // A client outside the fleet holds no etcd lease a standby could watch.
        return Err(ApiError::conflict(format!(
            "session `{id}` has a standby ({standby}); a session with a standby is not lent"
        )));
    }
    if info.interactive {
        // The input is sent to this space; a client outside it would not see it.
        return Err(ApiError::conflict(format!(
            "session `{id}` is interactive: its input is sent to this space, so it is not lent"
        )));
    }
    match info.state {
        State::Running if running && info.migrating_to.is_none() => Ok(()),
        State::Suspended if info.migrating_to.is_none() => Ok(()),
        State::Lent => Err(lent_refusal(info)),
        State::Moved => Err(ApiError::conflict(format!(
            "session `{id}` moved to {}; take it over there",
            info.moved_to.as_deref().unwrap_or_default()
        ))),
        s => Err(ApiError::conflict(format!(
            "session `{id}` is {}; only a running or suspended session can be taken over",
            if info.migrating_to.is_some() {
                "moving"
            } else {
                s.name()
            }
        ))),
    }
}

impl Sessions {
    /// `POST /v1/sessions/{id}/lend`: a running session is suspended first; the record says
    /// `lent` (durably) before the client hears of it.
    pub fn lend(self: &Arc<Self>, id: &str, req: LendRequest) -> Result<Lent, ApiError> {
        let client = client_name(&req.client);
        if let Some(ms) = req.lease_ms
            && !(MIN_LEASE_MS..=MAX_LEASE_MS).contains(&ms)
        {
            return Err(ApiError::bad_request(format!(
                "lease_ms must be from {MIN_LEASE_MS} to {MAX_LEASE_MS}"
            )));
        }
        let live = self.get(id)?;
        if !self.cfg.policy.lend {
            return Err(ApiError::forbidden(format!(
                "{} does not let sessions be taken over by clients outside the space (`lend = \
                 true` would)",
                self.cfg.policy.source
            )));
        }
        if req.dry_run {
            let info = live.info();
            lendable(&info, true)?;
            return Ok(Lent {
                snapshot: info.snapshot.clone().unwrap_or_default(),
                epoch: info.epoch,
                log_len: 0,
                session: info,
            });
        }
        // Refused before anything is suspended.
        lendable(&live.info(), true)?;
        if live.info().state == State::Running {
            self.stop(id, Request::Suspend, false)?;
        }
        let _turn = lock(&live.turn);
        lendable(&live.info(), false)?;
        // In a fleet, only the session's owner lends it.
        self.check_owner(&live)?;
        let info = live.info();
        let k = parse_kappa(info.snapshot.as_deref().unwrap_or(""), "snapshot")?;
        // The client continues the snapshot's log, byte for byte.
        let log = self.read_log(&info).map_err(ApiError::internal)?;
        *lock(&live.log) = log.clone();
        let info = self.update(&live, |i| {
            i.state = State::Lent;
            i.epoch += 1;
            i.lent_to = Some(client.clone());
            i.lease_ms = req.lease_ms;
            i.reason = None;
        });
        self.point_ref(&info, k);
        self.watch_lease(live.clone());
        info!(session = %id, client = %client, epoch = info.epoch, "session lent");
        Ok(Lent {
            snapshot: k.to_string(),
            epoch: info.epoch,
            log_len: log.len(),
            session: info,
        })
    }

    /// The holder's call at `epoch`, or its refusal: the session is not lent (any more), or
    /// was reclaimed and lent again since.
    fn holder(live: &Live, epoch: u64) -> Result<SessionInfo, ApiError> {
        let info = live.info();
        if info.state != State::Lent || info.epoch != epoch {
            return Err(ApiError::conflict(format!(
                "session `{}` is not lent at epoch {epoch} (it is {} at epoch {}): this copy is \
                 fenced and must stop",
                info.id,
                info.state.name(),
                info.epoch
            )));
        }
        // Word from the client: its lease runs from now.
        if let Some(ms) = info.lease_ms {
            *lock(&live.lease_deadline) = Some(Instant::now() + Duration::from_millis(ms));
        }
        Ok(info)
    }

    /// `POST /v1/sessions/{id}/output?epoch=E&at=N`: output records the holder's guest wrote,
    /// placed at byte `at` of the log. Returns the log's length.
    pub fn lent_output(
        &self,
        id: &str,
        epoch: u64,
        at: u64,
        records: &[u8],
    ) -> Result<u64, OutputRefusal> {
        let live = self.get(id)?;
        let _turn = lock(&live.turn);
        Self::holder(&live, epoch)?;
        live.log().append_at(at, records).map_err(|e| match e {
            AppendAtError::Gap { len } => OutputRefusal {
                error: ApiError::conflict(e.to_string()),
                len: Some(len),
            },
            AppendAtError::Malformed(_) => ApiError::bad_request(e.to_string()).into(),
            AppendAtError::Full => ApiError::new(413, e.to_string()).into(),
            AppendAtError::Differs { .. } => ApiError::conflict(e.to_string()).into(),
        })
    }

    /// `POST /v1/sessions/{id}/return`: the holder gives the session back — suspended at a
    /// snapshot it wrote here, ended (exit code or trap, with its files), or never run.
    pub fn take_back(&self, id: &str, req: ReturnRequest) -> Result<SessionInfo, ApiError> {
        let live = self.get(id)?;
        let _turn = lock(&live.turn);
        let info = Self::holder(&live, req.epoch)?;
        let said = [
            req.snapshot.is_some(),
            req.exit_code.is_some(),
            req.trap.is_some(),
            req.refused.is_some(),
        ];
        if said.iter().filter(|s| **s).count() != 1 {
            return Err(ApiError::bad_request(
                "say exactly one of snapshot, exit_code, trap, refused",
            ));
        }
        let client = info.lent_to.clone().unwrap_or_else(|| "a client".into());
        let log = live.log();
        if let Some(s) = &req.snapshot {
            let k = self.carry_on(&info, &log, s, true)?;
            log.close();
            let info = self.update(&live, |i| {
                i.state = State::Suspended;
                i.snapshot = Some(k.to_string());
                i.snapshot_error = None;
                i.lent_to = None;
                i.lease_ms = None;
                i.reason = None;
            });
            self.point_ref(&info, k);
            info!(session = %id, snapshot = %k, "lent session given back, suspended");
            return Ok(info);
        }
        if let Some(why) = &req.refused {
            // It never ran there: the log goes back to the snapshot's.
            let fresh = self.read_log(&info).map_err(ApiError::internal)?;
            fresh.close();
            let old = std::mem::replace(&mut *lock(&live.log), fresh);
            old.close();
            let why: String = why.chars().take(1000).collect();
            let info = self.update(&live, |i| {
                i.state = State::Suspended;
                i.lent_to = None;
                i.lease_ms = None;
                i.reason = Some(format!("{client} could not resume it: {why}"));
            });
            info!(session = %id, "lent session given back unrun");
            return Ok(info);
        }
        // It ended there: the log must hold all it wrote.
        if req.log_len != Some(log.len()) {
            return Err(ApiError::conflict(format!(
                "the space holds {} bytes of the session's output log, the client says {}: \
                 send the rest first",
                log.len(),
                req.log_len
                    .map_or_else(|| "nothing".to_owned(), |n| n.to_string())
            )));
        }
        let files = match &req.files {
            Some(f) => Some(self.check_files(f)?),
            None => None,
        };
        if let Some(f) = &files {
            self.name_final_files(id, f).map_err(ApiError::internal)?;
        }
        log.close();
        write_durably(&self.log_path(id), &log.bytes()).map_err(ApiError::internal)?;
        let info = self.update(&live, |i| {
            i.lent_to = None;
            i.lease_ms = None;
            if let Some(code) = req.exit_code {
                i.state = State::Exited;
                i.exit_code = Some(code);
            } else {
                let cause: String = req
                    .trap
                    .as_deref()
                    .unwrap_or("")
                    .chars()
                    .take(1000)
                    .collect();
                i.state = State::Failed;
                i.exit_code = Some(EXIT_TRAPPED);
                i.reason = Some(format!("guest trapped: {cause} (in {client})"));
            }
            i.final_files = files.clone();
        });
        info!(session = %id, state = info.state.name(), "lent session ended");
        Ok(info)
    }

    /// `POST /v1/sessions/{id}/checkpointed`: the holder wrote a checkpoint of the guest,
    /// which goes on there; the session's last snapshot is that one (a reclaim goes back to
    /// it, a space that restarts cuts the log back to its log).
    pub fn lent_checkpoint(
        &self,
        id: &str,
        req: CheckpointedRequest,
    ) -> Result<SessionInfo, ApiError> {
        let live = self.get(id)?;
        let _turn = lock(&live.turn);
        let info = Self::holder(&live, req.epoch)?;
        let k = self.carry_on(&info, &live.log(), &req.snapshot, false)?;
        let info = self.update(&live, |i| {
            i.snapshot = Some(k.to_string());
            i.snapshot_error = None;
        });
        self.point_ref(&info, k);
        info!(session = %id, snapshot = %k, "lent session checkpointed");
        Ok(info)
    }

    /// Snapshot `s` from the holder of `info`'s session, checked: its closure verifies, its
    /// parent is the session's last snapshot, and its output log and the session's agree
    /// (one goes on from the other — for the `last` snapshot, which the guest stopped at, the
    /// snapshot's from the session's; what the log lacks of the snapshot's is appended).
    fn carry_on(
        &self,
        info: &SessionInfo,
        log: &OutputBuffer,
        s: &str,
        last: bool,
    ) -> Result<Kappa, ApiError> {
        let id = &info.id;
        let k = parse_kappa(s, "snapshot")?;
        let before = parse_kappa(info.snapshot.as_deref().unwrap_or(""), "snapshot")?;
        let got = snapshot::load(self.store.as_ref(), k)
            .map_err(|e| ApiError::unprocessable(format!("snapshot {k}: {e}")))?;
        if got.snapshot.parent != Some(before) {
            return Err(ApiError::unprocessable(format!(
                "snapshot {k} does not go on from {before}, session `{id}`'s last snapshot"
            )));
        }
        // The same program: a client holds the session's continuation, not a new one.
        let prior: ferry_object::Snapshot = self
            .store
            .get(&before)
            .map_err(ApiError::internal)
            .and_then(|b| ferry_object::decode(&b).map_err(ApiError::internal))?;
        if got.snapshot.module != prior.module || got.snapshot.instrumented != prior.instrumented {
            return Err(ApiError::unprocessable(format!(
                "snapshot {k} is of another module than session `{id}`"
            )));
        }
        let have = log.bytes();
        let carried = got.output.unwrap_or_default();
        if !carried.starts_with(&have) && (last || !have.starts_with(&carried)) {
            return Err(ApiError::unprocessable(format!(
                "snapshot {k}'s output log does not go on from the session's ({} bytes here)",
                have.len()
            )));
        }
        if carried.len() > have.len() {
            log.append_at(have.len() as u64, &carried[have.len()..])
                .map_err(|e| ApiError::unprocessable(format!("snapshot {k}'s output log: {e}")))?;
        }
        Ok(k)
    }

    /// Each mount tree a client sent is whole in the store (every object was verified on
    /// receipt).
    fn check_files(&self, files: &[MountTree]) -> Result<Vec<MountTree>, ApiError> {
        if files.len() > 1024 {
            return Err(ApiError::bad_request("more than 1024 mounts"));
        }
        for m in files {
            let k: Kappa = parse_kappa(&m.tree, "tree")?;
            let mut all = std::collections::BTreeSet::new();
            ferry_engine::closure::tree_closure(self.store.as_ref(), &k, &mut all, 0).map_err(
                |e| ApiError::unprocessable(format!("the files of mount `{}`: {e}", m.guest)),
            )?;
            for o in &all {
                if !self.store.has(o).map_err(ApiError::internal)? {
                    return Err(ApiError::unprocessable(format!(
                        "the files of mount `{}`: object {o} is not in this space's store; \
                         send it first",
                        m.guest
                    )));
                }
            }
        }
        Ok(files.to_vec())
    }

    /// `POST /v1/sessions/{id}/reclaim`: the session comes back suspended at the snapshot it
    /// was lent at (or gave back last), its log cut back to that snapshot's, its epoch raised
    /// so the client it was lent to is fenced.
    pub fn reclaim(&self, id: &str) -> Result<SessionInfo, ApiError> {
        session_id(id)?;
        let live = self.get(id)?;
        let _turn = lock(&live.turn);
        let info = live.info();
        if info.state != State::Lent {
            return Err(ApiError::conflict(format!(
                "session `{id}` is {}, not lent",
                info.state.name()
            )));
        }
        let client = info.lent_to.clone().unwrap_or_else(|| "a client".into());
        self.take_back_from(&live, &info, format!("taken back from {client}"))
    }

    /// The reclaim, the session's `turn` held: suspended at its last snapshot, the log cut
    /// back to it, the epoch raised; `why` starts the reason.
    fn take_back_from(
        &self,
        live: &Live,
        info: &SessionInfo,
        why: String,
    ) -> Result<SessionInfo, ApiError> {
        let fresh: OutputBuffer = self.read_log(info).map_err(ApiError::internal)?;
        fresh.close();
        let old = std::mem::replace(&mut *lock(&live.log), fresh);
        old.close();
        *lock(&live.lease_deadline) = None;
        let info = self.update(live, |i| {
            i.state = State::Suspended;
            i.epoch += 1;
            i.lent_to = None;
            i.lease_ms = None;
            i.reason = Some(format!(
                "{why}: suspended at its last snapshot (what it did after that snapshot was \
                 discarded)"
            ));
        });
        if let Some(k) = info.snapshot.as_deref().and_then(|k| k.parse().ok()) {
            self.point_ref(&info, k);
        }
        info!(session = %info.id, epoch = info.epoch, "lent session taken back");
        Ok(info)
    }

    /// For a session lent with a lease: a thread that takes it back once the lease runs out
    /// without word from the client (it ends when the session is no longer lent at this
    /// epoch). The lease counts from now.
    pub(super) fn watch_lease(self: &Arc<Self>, live: Arc<Live>) {
        let info = live.info();
        let Some(ms) = info.lease_ms else {
            return;
        };
        *lock(&live.lease_deadline) = Some(Instant::now() + Duration::from_millis(ms));
        let me = self.clone();
        let epoch = info.epoch;
        std::thread::spawn(move || {
            loop {
                let deadline = *lock(&live.lease_deadline);
                let Some(deadline) = deadline else { return };
                // Given back or reclaimed (and perhaps lent again): another thread's lease.
                let info = live.info();
                if info.state != State::Lent || info.epoch != epoch {
                    return;
                }
                let now = Instant::now();
                if now < deadline {
                    std::thread::sleep((deadline - now).min(Duration::from_secs(1)));
                    continue;
                }
                let _turn = lock(&live.turn);
                let info = live.info();
                if info.state != State::Lent || info.epoch != epoch {
                    return;
                }
                // Renewed while this thread waited for the turn.
                if lock(&live.lease_deadline).is_some_and(|d| Instant::now() < d) {
                    continue;
                }
                let client = info.lent_to.clone().unwrap_or_else(|| "a client".into());
                let why = format!(
                    "the lease of {client} ran out (no word from it for {} s)",
                    ms.div_ceil(1000)
                );
                if let Err(e) = me.take_back_from(&live, &info, why) {
                    tracing::warn!(session = %info.id, error = %e, "cannot take a lent session back");
                }
                return;
            }
        });
    }

    /// Points the ref `session/<id>` at `k` with the session's epoch.
    pub(super) fn point_ref(&self, info: &SessionInfo, k: Kappa) {
        let name = format!("session/{}", info.id);
        let next = RefValue {
            epoch: info.epoch,
            target: k,
        };
        for _ in 0..8 {
            let cur = self.store.get_ref(&name).ok().flatten();
            if self.store.cas_ref(&name, cur, Some(next)).is_ok() {
                return;
            }
        }
        tracing::warn!(session = %info.id, "cannot point the session's ref at {k}");
    }
}
