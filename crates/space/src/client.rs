//! The client side: a remote space seen as a [`Store`], and `push` / `pull` of a snapshot's
//! closure by κ.

use std::collections::BTreeSet;

use ferry_engine::closure::{memory_chunks, moving_order, snapshot_closure};
use ferry_kappa::Kappa;
use ferry_store::{RefValue, Store, StoreError};
use tracing::info;

use crate::api::{
    ApiError, Decision, GcReport, GcRequest, MigrateRequest, MigrationReport, PROGRESS,
    PrepareRequest, Progressed, ResumeRequest, RunRequest, SessionInfo, session_id,
};
use crate::{MAX_BODY, MAX_OBJECT, MAX_QUERY};

/// A space at `base` (e.g. `http://127.0.0.1:7070`), authenticated with `token`. Reads are
/// verified like any store's: an object that does not hash to its κ is an error. A space
/// that sends nothing for [`crate::net::peer_stall`] while a call waits is given up.
#[derive(Clone)]
pub struct RemoteStore {
    base: String,
    token: String,
    agent: ureq::Agent,
    /// Every call is given up once this has passed ([`RemoteStore::until`]).
    deadline: Option<std::time::Instant>,
}

/// An HTTP agent for talking to a space: non-2xx answers are returned, not errors (their
/// reason is read and reported), connecting gives up after 5 s, a connection whose peer
/// goes silent — or takes nothing of a write — for [`crate::net::peer_silence`] is given up,
/// and `https://` spaces are trusted as [`crate::tls::client_config`] says.
pub(crate) fn agent() -> ureq::Agent {
    build_agent(
        crate::tls::client_config(),
        crate::net::PeerConnector::default(),
    )
}

/// [`agent`] for calls whose answer is due soon (store calls, a migration's steps, etcd): a
/// peer that sends nothing for [`crate::net::peer_stall`] while one waits is given up — its
/// machine answers, but its process has hung.
pub(crate) fn answering_agent() -> ureq::Agent {
    answering_agent_with(crate::tls::client_config())
}

/// [`answering_agent`] with the TLS settings `tls` (etcd's: [`crate::tls::etcd_client_config`]).
pub(crate) fn answering_agent_with(tls: ureq::tls::TlsConfig) -> ureq::Agent {
    build_agent(tls, crate::net::PeerConnector::answering())
}

/// An agent over `connector` (which bounds how long a peer may stall) with `tls`.
pub(crate) fn build_agent(
    tls: ureq::tls::TlsConfig,
    connector: crate::net::PeerConnector,
) -> ureq::Agent {
    use ureq::unversioned::transport::Connector;
    let config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(std::time::Duration::from_secs(5)))
        .tls_config(tls)
        .build();
    ureq::Agent::with_parts(
        config,
        connector.chain(ureq::unversioned::transport::RustlsConnector::default()),
        ureq::unversioned::resolver::DefaultResolver::default(),
    )
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

fn remote(e: impl std::fmt::Display) -> StoreError {
    StoreError::Remote(crate::tls::explain(e.to_string()))
}

impl RemoteStore {
    pub fn new(base: &str, token: &str) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
            agent: answering_agent(),
            deadline: None,
        }
    }

    /// This store with its batch calls (`missing`, batches sent or fetched, naming a snapshot)
    /// given up once `deadline` has passed, the ones under way included: a migration's final
    /// delta, sent while the guest is paused, within what is left of `--max-pause`. (Single
    /// objects, `put` and `get`, are not bounded by it.)
    pub fn until(&self, deadline: std::time::Instant) -> Self {
        Self {
            deadline: Some(deadline),
            ..self.clone()
        }
    }

    fn auth(&self) -> String {
        format!("Bearer {}", self.token)
    }

    /// A `POST` to `path`, authorized, bounded by the deadline if there is one.
    fn post(
        &self,
        path: &str,
    ) -> Result<ureq::RequestBuilder<ureq::typestate::WithBody>, StoreError> {
        let b = self
            .agent
            .post(format!("{}{path}", self.base))
            .header("Authorization", self.auth());
        let Some(deadline) = self.deadline else {
            return Ok(b);
        };
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(remote(format!("{}: past the deadline", self.base)));
        }
        Ok(b.config().timeout_global(Some(left)).build())
    }

    /// Turns a non-2xx answer into an error carrying the server's reason.
    fn check(
        &self,
        what: &str,
        mut r: ureq::http::Response<ureq::Body>,
    ) -> Result<ureq::http::Response<ureq::Body>, StoreError> {
        if r.status().is_success() {
            return Ok(r);
        }
        let refused_object = r
            .headers()
            .get(crate::server::REFUSED_OBJECT)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<Kappa>().ok());
        let why = r
            .body_mut()
            .with_config()
            .limit(64 << 10)
            .read_to_string()
            .unwrap_or_default();
        let why = format!("{what}: {} {}: {}", self.base, r.status(), why.trim());
        Err(match refused_object {
            Some(kappa) => StoreError::RemoteRefusedObject { kappa, why },
            None => remote(why),
        })
    }

    /// Which of `ks` the space lacks.
    pub fn missing(&self, ks: &[Kappa]) -> Result<Vec<Kappa>, StoreError> {
        let mut out = Vec::new();
        for part in ks.chunks(MAX_QUERY) {
            let body: Vec<u8> = part.iter().flat_map(|k| *k.as_bytes()).collect();
            let r = self
                .post("/v1/objects/missing")?
                .send(&body[..])
                .map_err(remote)?;
            let mut r = self.check("asking what is missing", r)?;
            let bytes = r
                .body_mut()
                .with_config()
                .limit((MAX_QUERY * 32) as u64)
                .read_to_vec()
                .map_err(remote)?;
            if !bytes.len().is_multiple_of(32) {
                return Err(remote("malformed answer to `missing`"));
            }
            out.extend(
                bytes
                    .chunks_exact(32)
                    .map(|c| Kappa::from_bytes(c.try_into().expect("32 bytes"))),
            );
        }
        Ok(out)
    }

    /// Fetches `ks` (at most `MAX_FETCH`) in one request and stores them in `local`, each
    /// verified against its κ first. Returns their bytes in all.
    fn fetch_batch(
        &self,
        ks: &[Kappa],
        local: &dyn Store,
        buf: &mut Vec<u8>,
    ) -> Result<u64, StoreError> {
        let body: Vec<u8> = ks.iter().flat_map(|k| *k.as_bytes()).collect();
        let r = self
            .post("/v1/objects/fetch")?
            .send(&body[..])
            .map_err(remote)?;
        let mut r = self.check("fetching objects", r)?;
        buf.clear();
        std::io::Read::read_to_end(
            &mut r.body_mut().with_config().limit(MAX_BODY as u64).reader(),
            buf,
        )
        .map_err(remote)?;
        let batch = ferry_store::batch::decode(buf).map_err(remote)?;
        let objects = batch.verify().map_err(remote)?;
        // Each object is what its κ says; they must also be exactly those asked, in order.
        if objects.len() != ks.len() || objects.iter().zip(ks).any(|(o, k)| o.kappa() != *k) {
            return Err(remote("the space answered with other objects than asked"));
        }
        local.put_hashed(&objects)?;
        Ok(objects.iter().map(|o| o.bytes().len() as u64).sum())
    }

    /// Sends a batch built by `batch::push` (`POST /v1/objects`).
    pub(crate) fn put_batch(&self, body: &[u8]) -> Result<(), StoreError> {
        let r = self.post("/v1/objects")?.send(body).map_err(remote)?;
        self.check("sending objects", r).map(drop)
    }

    /// Asks the space to verify snapshot κ's closure and name it `snapshot/<hex>`.
    pub fn name_snapshot(&self, k: &Kappa) -> Result<(), StoreError> {
        let r = self
            .post(&format!("/v1/snapshots/{k}"))?
            .send_empty()
            .map_err(remote)?;
        self.check("naming the snapshot", r).map(drop)
    }
}

impl Store for RemoteStore {
    fn put(&self, bytes: &[u8]) -> Result<Kappa, StoreError> {
        let k = Kappa::of(bytes);
        let body = zstd::bulk::compress(bytes, 1).map_err(remote)?;
        let r = self
            .agent
            .put(format!("{}/v1/objects/{k}", self.base))
            .header("Authorization", self.auth())
            .header("Content-Encoding", "zstd")
            .send(&body[..])
            .map_err(remote)?;
        self.check(&format!("sending {k}"), r)?;
        Ok(k)
    }

    fn get(&self, k: &Kappa) -> Result<Vec<u8>, StoreError> {
        let r = self
            .agent
            .get(format!("{}/v1/objects/{k}", self.base))
            .header("Authorization", self.auth())
            .header("Accept-Encoding", "zstd")
            .call()
            .map_err(remote)?;
        if r.status() == 404 {
            return Err(StoreError::NotFound(*k));
        }
        let mut r = self.check(&format!("fetching {k}"), r)?;
        let zstd = r
            .headers()
            .get("Content-Encoding")
            .is_some_and(|v| v.as_bytes() == b"zstd");
        let body = r
            .body_mut()
            .with_config()
            .limit(MAX_BODY as u64)
            .read_to_vec()
            .map_err(remote)?;
        let bytes = if zstd {
            zstd::bulk::decompress(&body, MAX_OBJECT).map_err(remote)?
        } else {
            body
        };
        StoreError::check_hash(k, &bytes, || self.base.clone())?;
        Ok(bytes)
    }

    fn has(&self, k: &Kappa) -> Result<bool, StoreError> {
        Ok(self.missing(&[*k])?.is_empty())
    }

    fn list(&self) -> Result<Vec<Kappa>, StoreError> {
        Err(remote("a space does not list its objects"))
    }

    fn remove(&self, _: &Kappa) -> Result<(), StoreError> {
        Err(remote("objects cannot be removed from a space remotely"))
    }

    fn get_ref(&self, _: &str) -> Result<Option<RefValue>, StoreError> {
        Err(remote("refs of a space are not readable remotely"))
    }

    fn cas_ref(&self, _: &str, _: Option<RefValue>, _: Option<RefValue>) -> Result<(), StoreError> {
        Err(remote("refs of a space are set by the space"))
    }

    fn list_refs(&self) -> Result<Vec<(String, RefValue)>, StoreError> {
        Err(remote("refs of a space are not readable remotely"))
    }
}

/// What a push or pull moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// Objects in the snapshot's closure.
    pub objects: usize,
    /// Of those, how many were sent (the others were there already).
    pub moved: usize,
    /// Bytes of the moved objects (before compression).
    pub bytes: u64,
}

/// Sends snapshot κ's closure from `local` to `space` (only what it lacks), then has the
/// space verify it and name it. `progress(done, total)` is called after each object.
pub fn push(
    local: &dyn Store,
    space: &RemoteStore,
    k: Kappa,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SyncStats, StoreError> {
    let stats = send_closure(local, space, k, progress)?;
    info!(snapshot = %k, "sent; the space verifies and names it");
    space.name_snapshot(&k)?;
    info!(snapshot = %k, "named on the space");
    Ok(stats)
}

/// [`push`] without naming the snapshot on the space: for a migration, whose prepare step
/// verifies the closure anyway (Resolving + Verifying) before anything runs there.
pub fn send_closure(
    local: &dyn Store,
    space: &RemoteStore,
    k: Kappa,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SyncStats, StoreError> {
    let mut closure = BTreeSet::new();
    snapshot_closure(local, &k, false, &mut closure).map_err(remote)?;
    let all: Vec<Kappa> = closure.into_iter().collect();
    info!(
        objects = all.len(),
        "closure walked; asking the space what it lacks"
    );
    let mut todo = space.missing(&all)?;
    info!(missing = todo.len(), "sending what it lacks");
    let chunks = moving_order(&k, memory_chunks(local, &k), &mut todo);
    let mut stats = send_batches(local, space, &todo, chunks, progress)?;
    stats.objects = all.len();
    Ok(stats)
}

/// How many batches are worked on at once, each by a thread of its own that reads, encodes
/// and sends it (on its own connection) — or fetches, checks and stores it — so that reading,
/// the network and the other side's checking and storing overlap.
const IN_FLIGHT: usize = 2;

/// Sends `todo` (read from `local`) in batches of about `BATCH_BYTES`, each stored together on
/// the other side, [`IN_FLIGHT`] at once; the first `leading` objects (a snapshot's memory
/// chunks) end a batch of their own. `progress(sent, total)` is called as batches arrive.
fn send_batches(
    local: &dyn Store,
    space: &RemoteStore,
    todo: &[Kappa],
    leading: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SyncStats, StoreError> {
    let groups = ferry_store::batch::groups(local, todo, leading);
    let mut stats = SyncStats::default();
    let sent = in_flight(
        &groups,
        todo.len(),
        &mut stats,
        progress,
        || {
            (
                ferry_store::batch::Encoder::new(),
                ferry_store::batch::Pooled(ferry_store::batch::buffer()),
            )
        },
        |(encoder, batch), group| {
            batch.0.clear();
            let len = encoder.push_many_stored(&mut batch.0, group, local)?;
            space.put_batch(&batch.0)?;
            Ok((group.len(), len))
        },
    );
    match sent {
        // Objects read straight from packs are not hashed here (the space hashes them): when
        // the space refuses one that does not match, say that this store's copy is damaged.
        Err(StoreError::RemoteRefusedObject { kappa, why }) => match local.check(&kappa) {
            Err(e @ StoreError::Corrupt { .. }) => Err(e),
            _ => Err(StoreError::RemoteRefusedObject { kappa, why }),
        },
        Err(e) => Err(e),
        Ok(()) => Ok(stats),
    }
}

/// Works on `parts` on [`IN_FLIGHT`] threads, each with a `state` of its own kept from one
/// part to the next: `work` returns the objects and bytes a part moved, added to `stats` and
/// reported as `progress(objects so far, total)`. The first error stops the threads taking
/// more parts, and is returned once they are done.
fn in_flight<P: Sync, S>(
    parts: &[P],
    total: usize,
    stats: &mut SyncStats,
    progress: &mut dyn FnMut(usize, usize),
    state: impl Fn() -> S + Sync,
    work: impl Fn(&mut S, &P) -> Result<(usize, u64), StoreError> + Sync,
) -> Result<(), StoreError> {
    use std::sync::atomic::Ordering::Relaxed;
    let next = std::sync::atomic::AtomicUsize::new(0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Result<(usize, u64), StoreError>>();
    let mut failed = None;
    std::thread::scope(|s| {
        for _ in 0..IN_FLIGHT {
            let (next, stop, done_tx) = (&next, &stop, done_tx.clone());
            let (state, work) = (&state, &work);
            s.spawn(move || {
                let mut state = state();
                while !stop.load(Relaxed) {
                    let Some(part) = parts.get(next.fetch_add(1, Relaxed)) else {
                        break;
                    };
                    let r = work(&mut state, part);
                    if r.is_err() {
                        stop.store(true, Relaxed);
                    }
                    if done_tx.send(r).is_err() {
                        break;
                    }
                }
            });
        }
        drop(done_tx);
        for r in done_rx.iter() {
            match r {
                Ok((n, bytes)) => {
                    stats.moved += n;
                    stats.bytes += bytes;
                    progress(stats.moved, total);
                }
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
    });
    failed.map_or(Ok(()), Err)
}

/// Fetches snapshot κ's closure from `space` into `local` (only what it lacks), verifies it
/// (Resolving + Verifying) and names it `snapshot/<hex>`.
pub fn pull(
    space: &RemoteStore,
    local: &dyn Store,
    k: Kappa,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SyncStats, StoreError> {
    // The closure walk reads structured objects from the space (each verified); blobs are
    // only listed, then fetched if this store lacks them.
    let mut closure = BTreeSet::new();
    snapshot_closure(space, &k, false, &mut closure).map_err(remote)?;
    info!(
        objects = closure.len(),
        "closure walked on the space; fetching what this store lacks"
    );
    let order = |todo: &mut Vec<Kappa>| moving_order(&k, memory_chunks(space, &k), todo);
    let stats = fetch_missing(space, local, &closure, order, progress)?;
    info!(moved = stats.moved, "fetched; making them durable");
    local.sync()?;
    info!("durable; checking the closure");
    ferry_engine::snapshot::load(local, k).map_err(remote)?;
    ferry_engine::snapshot::name(local, k)?;
    Ok(stats)
}

/// Fetches tree κ (a mount's content) and everything under it from `space` into `local`
/// (only what it lacks; every object verified as it is stored), so that it can be
/// materialized.
pub fn pull_tree(
    space: &RemoteStore,
    local: &dyn Store,
    k: Kappa,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SyncStats, StoreError> {
    let mut closure = BTreeSet::new();
    ferry_engine::closure::tree_closure(space, &k, &mut closure, 0).map_err(remote)?;
    fetch_missing(space, local, &closure, |_| 0, progress)
}

/// Fetches the objects of `closure` that `local` lacks, each re-hashed, and stores them.
/// `order` may reorder the missing ones and returns how many lead, fetched in batches of
/// their own (a snapshot's memory chunks, in memory order). [`IN_FLIGHT`] batches are fetched
/// at once, each checked and stored by the thread that fetched it.
fn fetch_missing(
    space: &RemoteStore,
    local: &dyn Store,
    closure: &BTreeSet<Kappa>,
    order: impl FnOnce(&mut Vec<Kappa>) -> usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SyncStats, StoreError> {
    let mut todo = Vec::new();
    for c in closure {
        if !local.has(c)? {
            todo.push(*c);
        }
    }
    let leading = order(&mut todo);
    let (leading, rest) = todo.split_at(leading);
    let parts: Vec<&[Kappa]> = leading
        .chunks(crate::MAX_FETCH)
        .chain(rest.chunks(crate::MAX_FETCH))
        .collect();
    let mut stats = SyncStats {
        objects: closure.len(),
        ..SyncStats::default()
    };
    in_flight(
        &parts,
        todo.len(),
        &mut stats,
        progress,
        || ferry_store::batch::Pooled(ferry_store::batch::buffer()),
        |buf, part| Ok((part.len(), space.fetch_batch(part, local, &mut buf.0)?)),
    )?;
    Ok(stats)
}

/// The sessions and migration API of a space (docs/api.md), as its CLI and its peers call
/// it. Errors carry the space's status and reason; status 0 means it could not be reached.
pub struct SpaceClient {
    base: String,
    token: String,
    agent: ureq::Agent,
    /// For calls whose answers are due soon ([`answering_agent`]): a migration's steps, a
    /// standby's checkpoint, the health check and the session records (which a destination
    /// asks a source for, to learn how a move ended).
    answering: ureq::Agent,
}

impl std::fmt::Debug for SpaceClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpaceClient")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

/// What `GET /v1/sessions/{id}/logs` answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogChunk {
    /// Whole records (`ferry_wasi::output`), starting at the offset asked for.
    pub records: Vec<u8>,
    pub state: crate::api::State,
    pub moved_to: Option<String>,
    /// Set while the session is being moved there.
    pub migrating_to: Option<String>,
    /// The session's standby, which takes it over if its space is gone.
    pub standby: Option<String>,
    /// Where `records` start: the offset asked for, unless it fell inside a record of output
    /// the guest redid otherwise after a crash (then the next record boundary).
    pub start: u64,
}

/// The longest a standby may take to answer for a piece of input
/// ([`SpaceClient::standby_input`]).
const STANDBY_INPUT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

fn unreachable_err(base: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(0, crate::tls::explain(format!("cannot reach {base}: {e}")))
}

impl SpaceClient {
    pub fn new(base: &str, token: &str) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
            agent: agent(),
            answering: answering_agent(),
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// The space at `base`, with the same token (a session that moved there).
    pub fn elsewhere(&self, base: &str) -> Self {
        Self::new(base, &self.token)
    }

    /// The same space's object store (sync by κ).
    pub fn store(&self) -> RemoteStore {
        RemoteStore::new(&self.base, &self.token)
    }

    fn answer(
        &self,
        r: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Vec<u8>, ApiError> {
        let mut r = r.map_err(|e| unreachable_err(&self.base, e))?;
        let body = r
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_vec()
            .map_err(|e| unreachable_err(&self.base, e))?;
        if r.status().is_success() {
            Ok(body)
        } else {
            Err(ApiError::new(
                r.status().as_u16(),
                String::from_utf8_lossy(&body).trim().to_owned(),
            ))
        }
    }

    fn json<R: serde::de::DeserializeOwned>(&self, body: &[u8]) -> Result<R, ApiError> {
        serde_json::from_slice(body)
            .map_err(|e| ApiError::internal(format!("malformed answer from {}: {e}", self.base)))
    }

    /// A `POST` asking for progress ([`SpaceClient::post_progress`]): a space that hangs while
    /// it works on it is given up.
    fn post<B: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, ApiError> {
        self.post_progress(path, body, None)
    }

    /// A `POST` whose answer is due at once (no progress asked): a space that sends nothing
    /// for [`crate::net::peer_stall`] is given up.
    fn post_answered<B: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, ApiError> {
        let body = serde_json::to_vec(body).expect("request bodies serialize");
        let r = self
            .answering
            .post(format!("{}{path}", self.base))
            .header("Authorization", format!("Bearer {}", self.token))
            .header("Content-Type", "application/json")
            .send(&body[..]);
        let b = self.answer(r)?;
        self.json(&b)
    }

    /// A `GET` that the space answers from what it holds: one that sends nothing for
    /// [`crate::net::peer_stall`] is given up.
    fn get_json<R: serde::de::DeserializeOwned>(&self, path: &str) -> Result<R, ApiError> {
        let r = self
            .answering
            .get(format!("{}{path}", self.base))
            .header("Authorization", format!("Bearer {}", self.token))
            .call();
        let b = self.answer(r)?;
        self.json(&b)
    }

    /// A `GET` of `path` that the space may hold `wait_ms` before it answers: given up if its
    /// answer has not begun [`crate::net::peer_stall`] after that.
    fn long_poll(
        &self,
        path: &str,
        wait_ms: u64,
    ) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        let within = std::time::Duration::from_millis(wait_ms) + crate::net::peer_stall();
        self.agent
            .get(format!("{}{path}", self.base))
            .config()
            .timeout_recv_response(Some(within))
            .build()
            .header("Authorization", format!("Bearer {}", self.token))
    }

    /// A long poll's error (status 0), said plainly when the space did not answer in time.
    fn unanswered(&self, e: ureq::Error, wait_ms: u64) -> ApiError {
        match e {
            ureq::Error::Timeout(_) => ApiError::new(
                0,
                format!(
                    "{} stopped answering: nothing came {} s past the {} ms it was asked to \
                     wait (its process may have hung)",
                    self.base,
                    crate::net::peer_stall().as_secs(),
                    wait_ms
                ),
            ),
            e => unreachable_err(&self.base, e),
        }
    }

    /// `GET /v1/health`. (This call and the session records are answered at once: a space
    /// that sends nothing for [`crate::net::peer_stall`] is given up.)
    pub fn health(&self) -> Result<(), ApiError> {
        let r = self
            .answering
            .get(format!("{}/v1/health", self.base))
            .call();
        self.answer(r).map(drop)
    }

    pub fn sessions(&self) -> Result<Vec<SessionInfo>, ApiError> {
        self.get_json("/v1/sessions")
    }

    /// `POST /v1/drain`.
    pub fn set_draining(&self, on: bool) -> Result<crate::api::Draining, ApiError> {
        self.post("/v1/drain", &crate::api::Draining { draining: on })
    }

    /// `GET /v1/fleet`, with progress (the space asks etcd, whose members it gives up one
    /// stall each).
    pub fn fleet(&self) -> Result<crate::api::Fleet, ApiError> {
        self.get_progress("/v1/fleet")
    }

    /// `GET /v1/metrics`: the space's counters and gauges, in Prometheus' text format.
    pub fn metrics(&self) -> Result<String, ApiError> {
        let r = self
            .answering
            .get(format!("{}/v1/metrics", self.base))
            .header("Authorization", format!("Bearer {}", self.token))
            .call();
        let b = self.answer(r)?;
        String::from_utf8(b)
            .map_err(|e| ApiError::internal(format!("malformed answer from {}: {e}", self.base)))
    }

    pub fn session(&self, id: &str) -> Result<SessionInfo, ApiError> {
        let id = session_id(id)?;
        self.get_json(&format!("/v1/sessions/{id}"))
    }

    /// `POST /v1/sessions`, with progress (a space that hangs while it prepares the module is
    /// given up: [`SpaceClient::post_progress`]).
    pub fn run(&self, req: &RunRequest) -> Result<SessionInfo, ApiError> {
        self.post_progress("/v1/sessions", req, None)
    }

    /// `POST /v1/sessions/{id}/resume`, with progress.
    pub fn resume(&self, id: &str, req: &ResumeRequest) -> Result<SessionInfo, ApiError> {
        let id = session_id(id)?;
        self.post_progress(&format!("/v1/sessions/{id}/resume"), req, None)
    }

    /// `DELETE /v1/sessions/{id}`: forget a finished session (a suspended one with `force`).
    pub fn forget(&self, id: &str, force: bool) -> Result<(), ApiError> {
        let id = session_id(id)?;
        let r = self
            .answering
            .delete(format!("{}/v1/sessions/{id}?force={force}", self.base))
            .header("Authorization", format!("Bearer {}", self.token))
            .call();
        self.answer(r).map(drop)
    }

    /// `GET /v1/sessions/{id}/files`: the trees of the session's mounts.
    pub fn files(&self, id: &str) -> Result<crate::api::SessionFiles, ApiError> {
        let id = session_id(id)?;
        self.get_json(&format!("/v1/sessions/{id}/files"))
    }

    /// `POST /v1/gc`, with progress (a collection of a big store may work long).
    pub fn gc(&self, req: &GcRequest) -> Result<GcReport, ApiError> {
        self.post("/v1/gc", req)
    }

    /// `suspend`, `checkpoint` or `kill`.
    pub fn stop(&self, id: &str, verb: &str) -> Result<SessionInfo, ApiError> {
        let id = session_id(id)?;
        self.post(&format!("/v1/sessions/{id}/{verb}"), &serde_json::json!({}))
    }

    /// `POST /v1/sessions/{id}/lend`: takes the session over (docs/browser.md).
    pub fn lend(&self, id: &str, client: &str) -> Result<crate::api::Lent, ApiError> {
        let id = session_id(id)?;
        let req = crate::api::LendRequest {
            client: client.to_owned(),
            lease_ms: None,
            dry_run: false,
        };
        self.post(&format!("/v1/sessions/{id}/lend"), &req)
    }

    /// `POST /v1/sessions/{id}/output`: output records of a session this client holds at
    /// `epoch`, placed at byte `at` of its log; the log's new length.
    pub fn send_output(
        &self,
        id: &str,
        epoch: u64,
        at: u64,
        records: &[u8],
    ) -> Result<u64, ApiError> {
        let id = session_id(id)?;
        let r = self
            .agent
            .post(format!(
                "{}/v1/sessions/{id}/output?epoch={epoch}&at={at}",
                self.base
            ))
            .header("Authorization", format!("Bearer {}", self.token))
            .send(records);
        let b = self.answer(r)?;
        self.json::<crate::api::LogLength>(&b).map(|l| l.len)
    }

    /// `POST /v1/sessions/{id}/return`: gives a session this client holds back.
    pub fn give_back(
        &self,
        id: &str,
        req: &crate::api::ReturnRequest,
    ) -> Result<SessionInfo, ApiError> {
        let id = session_id(id)?;
        self.post(&format!("/v1/sessions/{id}/return"), req)
    }

    /// `POST /v1/sessions/{id}/checkpointed`: a checkpoint of a session this client holds,
    /// already sent and named.
    pub fn checkpointed(
        &self,
        id: &str,
        req: &crate::api::CheckpointedRequest,
    ) -> Result<SessionInfo, ApiError> {
        let id = session_id(id)?;
        self.post(&format!("/v1/sessions/{id}/checkpointed"), req)
    }

    /// `POST /v1/sessions/{id}/reclaim`: takes a lent session back (its holder is fenced).
    pub fn reclaim(&self, id: &str) -> Result<SessionInfo, ApiError> {
        let id = session_id(id)?;
        self.post(
            &format!("/v1/sessions/{id}/reclaim"),
            &serde_json::json!({}),
        )
    }

    /// `POST /v1/sessions/{id}/migrate`, with progress: a source that hangs mid-move is given
    /// up (the move itself goes on or ends there as it would).
    pub fn migrate(&self, id: &str, req: &MigrateRequest) -> Result<MigrationReport, ApiError> {
        let id = session_id(id)?;
        self.post_progress(&format!("/v1/sessions/{id}/migrate"), req, None)
    }

    /// Waits (at most `timeout_ms` on the space's side) until the session is no longer live.
    /// A space that has not begun to answer [`crate::net::peer_stall`] after that is given up
    /// (status 0): its machine answers, but its process has hung.
    pub fn wait(&self, id: &str, timeout_ms: u64) -> Result<SessionInfo, ApiError> {
        let id = session_id(id)?;
        let r = self
            .long_poll(
                &format!("/v1/sessions/{id}/wait?timeout_ms={timeout_ms}"),
                timeout_ms,
            )
            .call()
            .map_err(|e| self.unanswered(e, timeout_ms))?;
        let b = self.answer(Ok(r))?;
        self.json(&b)
    }

    /// The output log from byte `from` on; waits up to `wait_ms` for more while it is live
    /// (bounded as [`SpaceClient::wait`] is).
    pub fn logs(&self, id: &str, from: u64, wait_ms: u64) -> Result<LogChunk, ApiError> {
        let id = session_id(id)?;
        let r = self
            .long_poll(
                &format!("/v1/sessions/{id}/logs?from={from}&wait_ms={wait_ms}"),
                wait_ms,
            )
            .call()
            .map_err(|e| self.unanswered(e, wait_ms))?;
        let header = |name: &str| {
            r.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let state = header("x-ferry-state");
        let moved_to = header("x-ferry-moved-to");
        let migrating_to = header("x-ferry-migrating-to");
        let standby = header("x-ferry-standby");
        // A start before what was asked for would show records twice: refused.
        let start = match header("x-ferry-log-start") {
            None => from,
            Some(v) => v
                .parse::<u64>()
                .ok()
                .filter(|&s| s >= from)
                .ok_or_else(|| {
                    ApiError::internal(format!("malformed log start from {}: {v}", self.base))
                })?,
        };
        let records = self.answer(Ok(r))?;
        let state = serde_json::from_value(serde_json::Value::String(state.unwrap_or_default()))
            .map_err(|e| ApiError::internal(format!("malformed state from {}: {e}", self.base)))?;
        Ok(LogChunk {
            records,
            state,
            moved_to,
            migrating_to,
            standby,
            start,
        })
    }

    /// `POST /v1/sessions/{id}/stdin[?at=N][&end=true]`: input for an interactive session
    /// (from byte `at` of its input on, when given).
    pub fn send_input(
        &self,
        id: &str,
        at: Option<u64>,
        bytes: &[u8],
        end: bool,
    ) -> Result<crate::api::StdinAnswer, ApiError> {
        let id = session_id(id)?;
        let mut query = Vec::new();
        if let Some(at) = at {
            query.push(format!("at={at}"));
        }
        if end {
            query.push("end=true".to_owned());
        }
        let query = if query.is_empty() {
            String::new()
        } else {
            format!("?{}", query.join("&"))
        };
        // The space may hold the answer while a standby takes the input too: with progress, so
        // that a space that hangs meanwhile is given up.
        let r = self
            .answering
            .post(format!("{}/v1/sessions/{id}/stdin{query}", self.base))
            .header("Authorization", format!("Bearer {}", self.token))
            .header("Content-Type", "application/octet-stream")
            .header(PROGRESS, "1")
            .send(bytes);
        self.progressed(r)
    }

    /// `POST /v1/sessions/{id}/standby/stdin?epoch=E&at=N[&end=true]` (space to space): the
    /// input of an interactive session from byte `at` on, as its owner at epoch `epoch`
    /// received it, for the standby copy.
    pub fn standby_input(
        &self,
        id: &str,
        epoch: u64,
        at: u64,
        bytes: &[u8],
        end: bool,
    ) -> Result<crate::api::StdinAnswer, ApiError> {
        let id = session_id(id)?;
        // The owner waits for this with the session's input held: a standby that takes
        // connections but does not answer must not keep it waiting for ever.
        let r = self
            .agent
            .post(format!(
                "{}/v1/sessions/{id}/standby/stdin?epoch={epoch}&at={at}&end={end}",
                self.base
            ))
            .config()
            .timeout_global(Some(STANDBY_INPUT_TIMEOUT))
            .build()
            .header("Authorization", format!("Bearer {}", self.token))
            .header("Content-Type", "application/octet-stream")
            .send(bytes);
        let b = self.answer(r)?;
        self.json(&b)
    }

    /// `POST /v1/sessions/{id}/standby` (space to space): keep this checkpoint as the
    /// session's standby copy.
    pub fn standby(
        &self,
        id: &str,
        req: &crate::api::StandbyRequest,
    ) -> Result<SessionInfo, ApiError> {
        let id = session_id(id)?;
        self.post_answered(&format!("/v1/sessions/{id}/standby"), req)
    }

    /// Gives session `id` another standby, or none.
    pub fn set_standby(
        &self,
        id: &str,
        req: &crate::api::SetStandby,
    ) -> Result<SessionInfo, ApiError> {
        let id = session_id(id)?;
        self.post(&format!("/v1/sessions/{id}/set-standby"), req)
    }

    /// Whether the space's policy would admit a guest with these needs.
    pub fn admission(
        &self,
        req: &crate::api::AdmissionCheck,
    ) -> Result<crate::api::Admitted, ApiError> {
        self.post("/v1/admission", req)
    }

    /// `POST /v1/migrations`, asking for progress (`Ferry-Progress: 1`): the destination
    /// sends a byte every [`crate::net::PROGRESS_EVERY`] while it prepares, then its
    /// [`crate::api::Prepared`] answer; one that sends nothing for [`crate::net::peer_stall`] is given
    /// up. (A space that predates progress answers as other calls do.)
    pub fn prepare(&self, req: &PrepareRequest) -> Result<SessionInfo, ApiError> {
        self.prepare_within(req, None)
    }

    /// [`SpaceClient::prepare`], given up (status 0) unless answered `within`.
    pub fn prepare_within(
        &self,
        req: &PrepareRequest,
        within: Option<std::time::Duration>,
    ) -> Result<SessionInfo, ApiError> {
        self.post_progress("/v1/migrations", req, within)
    }

    /// Posts `body` to `path` asking for progress ([`PROGRESS`]): the space answers at once
    /// and sends a byte every [`crate::net::PROGRESS_EVERY`] while it works, so a space that
    /// sends nothing for [`crate::net::peer_stall`] has hung and is given up (status 0), as is
    /// one that has not answered `within`. A space that predates progress answers as other
    /// calls do (and is given up the same way if it works longer than the stall).
    fn post_progress<B: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
        within: Option<std::time::Duration>,
    ) -> Result<R, ApiError> {
        let body = serde_json::to_vec(body).expect("request bodies serialize");
        let r = self
            .answering
            .post(format!("{}{path}", self.base))
            .config()
            .timeout_global(within)
            .build()
            .header("Authorization", format!("Bearer {}", self.token))
            .header("Content-Type", "application/json")
            .header(PROGRESS, "1")
            .send(&body[..]);
        self.progressed(r)
    }

    /// `GET path` asking for progress, as [`SpaceClient::post_progress`].
    fn get_progress<R: serde::de::DeserializeOwned>(&self, path: &str) -> Result<R, ApiError> {
        let r = self
            .answering
            .get(format!("{}{path}", self.base))
            .header("Authorization", format!("Bearer {}", self.token))
            .header(PROGRESS, "1")
            .call();
        self.progressed(r)
    }

    /// The answer of a call that asked for progress: its [`Progressed`] outcome, or — from a
    /// space that predates progress — the answer itself.
    fn progressed<R: serde::de::DeserializeOwned>(
        &self,
        r: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<R, ApiError> {
        let progress = r
            .as_ref()
            .is_ok_and(|r| r.status().is_success() && r.headers().contains_key(PROGRESS));
        let b = self.answer(r)?;
        if !progress {
            return self.json(&b);
        }
        match self.json(&b)? {
            Progressed::Ok(v) => Ok(*v),
            Progressed::Error { status, message } => Err(ApiError::new(status, message)),
        }
    }

    pub fn commit(&self, id: &str, d: Decision) -> Result<SessionInfo, ApiError> {
        let id = session_id(id)?;
        self.post_answered(&format!("/v1/migrations/{id}/commit"), &d)
    }

    pub fn abort(&self, id: &str, d: Decision) -> Result<(), ApiError> {
        let id = session_id(id)?;
        self.post_answered::<_, serde_json::Value>(&format!("/v1/migrations/{id}/abort"), &d)
            .map(drop)
    }
}

/// Sends objects (and nothing they refer to) that `space` lacks, in verified batches,
/// reporting `progress(objects sent, objects to send)` as batches land.
pub fn send_objects(
    local: &dyn Store,
    space: &RemoteStore,
    all: &[Kappa],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SyncStats, StoreError> {
    let todo = space.missing(all)?;
    let mut stats = send_batches(local, space, &todo, 0, progress)?;
    stats.objects = all.len();
    Ok(stats)
}
