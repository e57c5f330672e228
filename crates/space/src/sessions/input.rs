//! Input sent to an interactive session while it runs (`RunRequest::interactive`,
//! `POST /v1/sessions/{id}/stdin`; docs/migration.md, "Interactive sessions").
//!
//! The session's stdin is an [`InputLog`] that lives as long as the session is here — across
//! its suspends and resumes — and is kept on disk (`<space dir>/stdin/<id>`, and
//! `<id>.ended` once the sender ended it), each piece synced before the sender is told it
//! arrived: a space that crashes loses none of it, and the resume after the crash reads on
//! from the last snapshot's position in it. Every snapshot carries the input received so far
//! as a blob, so it goes wherever the session goes: a move seals the log (input sent
//! meanwhile is refused with `503`, to be sent again where the session went or here if the
//! move is given up) and hands it to the destination as it is then.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry_engine::Control;
use ferry_kappa::Kappa;
use ferry_store::write_durably;
use ferry_wasi::{InputError, InputLog, OutputBuffer, StoredInput};
use tracing::warn;

use super::{Live, Sessions, lock, parse_kappa};
use crate::api::{ApiError, SessionInfo, State, StdinAnswer};
use crate::client::SpaceClient;

/// How often input the standby cannot take for want of a copy asks for a checkpoint.
const ASK_CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

/// The most input sent to a standby in one request.
const FORWARD_PIECE: usize = 8 << 20;

/// What of a session's input its standby `to` holds, as far as this space knows.
#[derive(Debug)]
pub(super) struct Forwarded {
    to: String,
    len: u64,
    ended: bool,
}

impl From<InputError> for ApiError {
    fn from(e: InputError) -> Self {
        match e {
            InputError::Ended | InputError::Gap(_) | InputError::Differs(_) => {
                ApiError::conflict(format!("not taken: {e}"))
            }
            InputError::TooMuch(_) => ApiError::new(413, format!("not taken: {e}")),
            InputError::Sealed => ApiError::unavailable(
                "not taken: the session is being moved; send it again in a moment (here if \
                 the move is given up, else where the session went)",
            ),
        }
    }
}

impl Sessions {
    fn input_path(&self, id: &str) -> PathBuf {
        self.cfg.dir.join("stdin").join(id)
    }

    fn input_ended_path(&self, id: &str) -> PathBuf {
        self.cfg.dir.join("stdin").join(format!("{id}.ended"))
    }

    /// Session `id`'s input log, as a guest of it starting here from a snapshot whose stdin
    /// blob is `carried` (or from the start: `None`) reads it. The log this space already
    /// holds for the session (in memory, else on its disk) when it starts with what the
    /// snapshot carried — it may hold more: what arrived after that snapshot, or while the
    /// session was suspended — else a new one holding what the snapshot carried.
    pub(super) fn input_log(
        &self,
        id: &str,
        carried: Option<StoredInput>,
    ) -> Result<InputLog, ApiError> {
        let carried = match carried {
            Some(k) => self.read_input(k)?,
            None => Vec::new(),
        };
        let mut inputs = lock(&self.inputs);
        if let Some(log) = inputs.get(id)
            && log.starts_with(&carried)
        {
            return Ok(log.clone());
        }
        if let Ok(data) = std::fs::read(self.input_path(id))
            && data.starts_with(&carried)
        {
            let ended = self.input_ended_path(id).exists();
            let log = InputLog::new(data, ended);
            inputs.insert(id.to_owned(), log.clone());
            return Ok(log);
        }
        self.write_input(id, &carried, false)?;
        let log = InputLog::new(carried, false);
        inputs.insert(id.to_owned(), log.clone());
        Ok(log)
    }

    /// The bytes of stored input `k`.
    fn read_input(&self, k: StoredInput) -> Result<Vec<u8>, ApiError> {
        k.read(self.store.as_ref()).map_err(|e| {
            ApiError::unprocessable(format!(
                "the session's input {} cannot be read: {e}",
                k.kappa
            ))
        })
    }

    /// Makes the input session `id` has here `data` (ended or not), on disk first.
    fn write_input(&self, id: &str, data: &[u8], ended: bool) -> Result<(), ApiError> {
        let dir = self.cfg.dir.join("stdin");
        std::fs::create_dir_all(&dir)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
        write_durably(&self.input_path(id), data)
            .map_err(|e| ApiError::internal(format!("keeping the session's input: {e}")))?;
        let end = self.input_ended_path(id);
        if ended {
            write_durably(&end, b"")
        } else {
            std::fs::remove_file(&end).or_else(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Ok(()),
                _ => Err(e),
            })
        }
        .map_err(|e| ApiError::internal(format!("keeping the session's input: {e}")))
    }

    /// Forgets session `id`'s input here (it ended, moved away, or was forgotten).
    pub(super) fn drop_input(&self, id: &str) {
        lock(&self.inputs).remove(id);
        for p in [self.input_path(id), self.input_ended_path(id)] {
            if let Err(e) = std::fs::remove_file(&p)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                warn!(session = %id, error = %e, "cannot remove {}", p.display());
            }
        }
    }

    /// At a destination: the input a move hands over (at its final prepare) becomes the
    /// session's input here, which the held copy reads from its snapshot's position on.
    pub(super) fn take_moved_input(
        &self,
        req: &crate::api::PrepareRequest,
    ) -> Result<(), ApiError> {
        let Some(k) = &req.input else {
            return Ok(());
        };
        let data = self.read_input(StoredInput::blob(parse_kappa(k, "input")?))?;
        self.write_input(&req.session, &data, req.input_ended)?;
        lock(&self.inputs).insert(req.session.clone(), InputLog::new(data, req.input_ended));
        Ok(())
    }

    /// Seals session `live`'s input for a move and stores it as a blob, whose κ the move
    /// hands the destination, with whether it has ended; `None` if the session is not
    /// interactive.
    pub(super) fn seal_input(&self, live: &Live) -> Result<Option<(Kappa, bool)>, ApiError> {
        let info = live.info();
        if !info.interactive {
            return Ok(None);
        }
        let log = self.session_input(&info)?;
        log.seal();
        let (data, ended) = log.contents();
        let k = self.store.put(&data).map_err(|e| {
            log.unseal();
            ApiError::internal(format!("storing the session's input: {e}"))
        })?;
        Ok(Some((k, ended)))
    }

    /// `POST /v1/sessions/{id}/stdin`: appends `bytes` to an interactive session's input
    /// (and ends it when `end`), synced to disk before the answer; with `at`, the bytes are
    /// the input's from byte `at` on, and what of them arrived before is taken once
    /// ([`InputLog::append`]). A session with a standby answers only once its standby
    /// holds the input too (durably): a take-over then reads on in all of it.
    pub fn send_input(
        &self,
        id: &str,
        at: Option<u64>,
        bytes: &[u8],
        end: bool,
    ) -> Result<StdinAnswer, ApiError> {
        let live = self.get(id)?;
        let info = live.info();
        refuse_input(&info)?;
        let log = self.session_input(&info)?;
        let received = self.keep_piece(id, &log, at, bytes, end)?;
        self.input_to_standby(&live)?;
        let (_, ended) = log.len();
        Ok(StdinAnswer { received, ended })
    }

    /// Appends a piece to session `id`'s input `log`, on disk (synced) first; returns the
    /// input's length then.
    fn keep_piece(
        &self,
        id: &str,
        log: &InputLog,
        at: Option<u64>,
        bytes: &[u8],
        end: bool,
    ) -> Result<u64, ApiError> {
        let path = self.input_path(id);
        log.append(at, bytes, end, |had, new| -> Result<(), ApiError> {
            let keep = |e: std::io::Error| {
                ApiError::internal(format!("not taken: keeping the input failed: {e}"))
            };
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(keep)?;
            }
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(keep)?;
            f.write_all_at(new, had).map_err(keep)?;
            f.set_len(had + new.len() as u64).map_err(keep)?;
            f.sync_data().map_err(keep)?;
            if end {
                write_durably(&self.input_ended_path(id), b"").map_err(keep)?;
            }
            Ok(())
        })
    }

    /// Makes the standby of session `live` (if it has one) hold all of the session's input
    /// received here. Holds `live.input_forwarded` meanwhile: a change of standby waits, and
    /// hands the new one all the input before etcd names it ([`Sessions::forward_input`]).
    fn input_to_standby(&self, live: &Live) -> Result<(), ApiError> {
        let mut fwd = lock(&live.input_forwarded);
        let info = live.info();
        let Some(to) = &info.standby else {
            return Ok(());
        };
        let Err(e) = self.forward_input(&info, to, &mut fwd) else {
            return Ok(());
        };
        // Refused: perhaps because the standby took the session over.
        if e.status == 409
            && let Some(owner) = self.superseded(&info)
        {
            self.fence_taken_over(live, &owner);
            return Err(ApiError::conflict(format!(
                "not taken: session `{}` was taken over by {} and moved there; send the \
                 input there",
                info.id, owner.space
            )));
        }
        // The standby holds no copy yet (none of the session's checkpoints reached it): a
        // checkpoint now gives it one, and the input is taken when sent again then.
        if e.status == 404 {
            let mut asked = lock(&live.input_asked_checkpoint);
            if asked.is_none_or(|t| t.elapsed() >= ASK_CHECKPOINT_EVERY)
                && let Some(control) = lock(&live.control).clone()
            {
                control.request_checkpoint();
                *asked = Some(Instant::now());
            }
        }
        Err(ApiError::unavailable(format!(
            "not taken yet: kept here, but the session's standby {to} does not hold it ({}); \
             send it again",
            e.msg
        )))
    }

    /// Sends standby `to` what it lacks of session `info`'s input here (as far as `fwd`
    /// knows what it holds; all of it when the standby holds less than that), and records in
    /// `fwd` that it holds it all.
    pub(super) fn forward_input(
        &self,
        info: &SessionInfo,
        to: &str,
        fwd: &mut Option<Forwarded>,
    ) -> Result<(), ApiError> {
        if !info.interactive {
            return Ok(());
        }
        let log = self.session_input(info)?;
        let now = log.len();
        let known = match fwd.as_ref() {
            Some(f) if f.to == to => (f.len, f.ended),
            _ => (0, false),
        };
        if known == now {
            return Ok(());
        }
        let peer = SpaceClient::new(to, &self.cfg.peer_token);
        let mut from = known.0.min(now.0);
        let mut again = from > 0;
        loop {
            let (bytes, ended) = log.contents_from(from, FORWARD_PIECE);
            let len = from + bytes.len() as u64;
            match peer.standby_input(&info.id, info.epoch, from, &bytes, ended) {
                Ok(_) => {
                    *fwd = Some(Forwarded {
                        to: to.to_owned(),
                        len,
                        ended,
                    });
                    if (len, ended) == log.len() {
                        return Ok(());
                    }
                    from = len;
                }
                // It holds less than this space thought (a standby restored from its disk
                // after a crash, say): all of it, once.
                Err(e) if e.status == 409 && std::mem::take(&mut again) => from = 0,
                Err(e) => return Err(e),
            }
        }
    }

    /// `POST /v1/sessions/{id}/standby/stdin`: input the owner of a session this space keeps
    /// a standby copy of (at epoch `epoch`) received, kept here durably before the answer,
    /// so that a take-over reads on in it.
    pub fn standby_input(
        &self,
        id: &str,
        epoch: u64,
        at: u64,
        bytes: &[u8],
        end: bool,
    ) -> Result<StdinAnswer, ApiError> {
        let live = self.get(id)?;
        // A take-over changes the copy's state under the turn: a piece taken here is in the
        // log the taken-over guest reads; one that comes after is refused.
        let _turn = lock(&live.turn);
        let info = live.info();
        if info.state != State::Standby || info.epoch != epoch || !info.interactive {
            return Err(ApiError::conflict(format!(
                "session `{id}` is {} here (epoch {}), not an interactive standby copy at \
                 epoch {epoch}",
                info.state.name(),
                info.epoch
            )));
        }
        // Only while etcd names this space the standby (or it was sent the copy ahead of
        // that): an owner whose record is behind etcd's must not be told that a standby
        // which no longer counts holds its input.
        let o = self.cfg.owners.as_ref().ok_or_else(|| {
            ApiError::bad_request(
                "this space keeps no standby copies: it was started without --etcd",
            )
        })?;
        let owner = info.source.clone().unwrap_or_default();
        let view = o
            .standby_view(id, &owner)
            .map_err(|e| super::etcd_unreachable(id, e))?;
        let pending = lock(&live.pending_until).is_some();
        if !(view.owned_by(&owner, epoch) && (pending || view.standby_is(o.me(), epoch))) {
            return Err(ApiError::conflict(format!(
                "etcd does not name this space the standby of session `{id}` owned by {owner} \
                 at epoch {epoch}"
            )));
        }
        let log = self.session_input(&info)?;
        let received = self.keep_piece(id, &log, Some(at), bytes, end)?;
        let (_, ended) = log.len();
        Ok(StdinAnswer { received, ended })
    }

    /// The input of session `info` here: as its guest reads it (the log a guest of it ran
    /// with here, kept in memory), else as a guest resumed from its latest snapshot would.
    fn session_input(&self, info: &SessionInfo) -> Result<InputLog, ApiError> {
        if let Some(log) = lock(&self.inputs).get(&info.id) {
            return Ok(log.clone());
        }
        let carried = match &info.snapshot {
            Some(s) => self.carried_input(&parse_kappa(s, "snapshot")?)?,
            None => None,
        };
        self.input_log(&info.id, carried)
    }

    /// The stored input snapshot `k` carries, if its stdin is input sent to the session.
    fn carried_input(&self, k: &Kappa) -> Result<Option<StoredInput>, ApiError> {
        let snap: ferry_object::Snapshot = ferry_object::decode(
            &self
                .store
                .get(k)
                .map_err(|e| ApiError::internal(format!("reading snapshot {k}: {e}")))?,
        )
        .map_err(|e| ApiError::internal(format!("snapshot {k}: {e}")))?;
        let wasi: ferry_object::WasiState = ferry_object::decode(
            &self
                .store
                .get(&snap.wasi)
                .map_err(|e| ApiError::internal(format!("reading snapshot {k}: {e}")))?,
        )
        .map_err(|e| ApiError::internal(format!("snapshot {k}: {e}")))?;
        Ok(StoredInput::of(&wasi).filter(|_| wasi.stdin_open))
    }
}

/// What a guest of interactive session `live` does each time it has read all its input and
/// waits for more ([`InputLog::on_starving`]): if it wrote output since, which its standby
/// holds no checkpoint of — held back, so an answer to what was typed would appear only a
/// checkpoint interval later —, it asks `control` for a checkpoint, once for that output.
pub(super) fn answer_at_once(
    live: Arc<Live>,
    control: Arc<Control>,
    out: OutputBuffer,
) -> impl Fn() + Send + Sync + 'static {
    let asked = AtomicU64::new(0);
    move || {
        let len = out.len();
        if len <= asked.load(Ordering::Relaxed) {
            return;
        }
        let held = {
            let i = lock(&live.info);
            i.standby.is_some() && i.released.is_some_and(|shown| shown < len)
        };
        if held {
            asked.store(len, Ordering::Relaxed);
            control.request_checkpoint();
        }
    }
}

/// Why session `info` takes no input now, if it does not.
fn refuse_input(info: &SessionInfo) -> Result<(), ApiError> {
    let id = &info.id;
    if !info.interactive {
        return Err(ApiError::conflict(format!(
            "session `{id}` takes no input: only a session run with --interactive does"
        )));
    }
    match info.state {
        State::Running | State::Suspended => Ok(()),
        State::Starting => Err(ApiError::unavailable(format!(
            "session `{id}` is starting; send its input again in a moment"
        ))),
        State::Moved => Err(ApiError::conflict(format!(
            "session `{id}` moved to {}; send its input there",
            info.moved_to.as_deref().unwrap_or("another space")
        ))),
        State::Prepared => Err(ApiError::unavailable(format!(
            "session `{id}` is moving here; send its input again in a moment"
        ))),
        s @ (State::Exited | State::Failed | State::Killed) => Err(ApiError::conflict(format!(
            "session `{id}` has ended ({}); it takes no more input",
            s.name()
        ))),
        s => Err(ApiError::conflict(format!(
            "session `{id}` is {} here; it takes no input",
            s.name()
        ))),
    }
}
