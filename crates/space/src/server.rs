//! The space's HTTP API on axum.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use ferry_kappa::Kappa;
use ferry_store::Store;
use tracing::{info, warn};

use crate::api::{
    ApiError, CheckpointedRequest, Decision, GcReport, GcRequest, LOG_LEN_HEADER, LendRequest,
    LogLength, MigrateRequest, PROGRESS, PrepareRequest, Progressed, ResumeRequest, ReturnRequest,
    RunRequest,
};
use crate::net::PROGRESS_EVERY;
use crate::sessions::{OutputRefusal, Sessions};
use crate::{MAX_BODY, MAX_OBJECT, MAX_QUERY};

/// What the server holds: the store it serves, the token clients must present, and the
/// sessions it runs (absent: an object store only; the session routes answer 404).
#[derive(Debug)]
pub struct Space {
    /// The store as the space uses it: a [`crate::gc::Recording`] store when it can collect
    /// garbage while serving (`gc`), any store otherwise.
    pub store: Arc<dyn Store>,
    /// Garbage collection while serving (`POST /v1/gc`), if this space does it.
    pub gc: Option<Arc<crate::gc::Recording>>,
    pub token: String,
    pub sessions: Option<Arc<Sessions>>,
    /// What the space counts (`GET /v1/metrics`); its sessions count into the same one.
    pub metrics: Arc<crate::metrics::Metrics>,
}

impl Space {
    /// Counts objects received and verified.
    fn received(&self, objects: u64, bytes: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.metrics.objects_received.fetch_add(objects, Relaxed);
        self.metrics.object_bytes_received.fetch_add(bytes, Relaxed);
    }
}

type Shared = Arc<Space>;

/// A refusal: a status and its reason in plain text; for an object whose bytes do not hash to
/// its κ, that κ too, in the [`REFUSED_OBJECT`] header, so that a client can act on it
/// without reading the reason.
#[derive(Debug)]
struct Refusal(StatusCode, String, Option<Kappa>);

/// The header naming the object a `422` refused for not hashing to its κ.
pub(crate) const REFUSED_OBJECT: &str = "ferry-refused-object";

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let mut r = (self.0, self.1).into_response();
        if let Some(k) = self.2 {
            let v = header::HeaderValue::from_str(&k.to_string()).expect("a κ is ASCII");
            r.headers_mut().insert(REFUSED_OBJECT, v);
        }
        r
    }
}

fn text(status: StatusCode, msg: impl Into<String>) -> Refusal {
    Refusal(status, msg.into(), None)
}

/// `422` for received objects that do not verify, naming the object when that is why.
fn refused(r: ferry_store::batch::Refused) -> Refusal {
    Refusal(StatusCode::UNPROCESSABLE_ENTITY, r.reason, r.object)
}

/// Constant-time comparison, so the token cannot be guessed byte by byte from timings.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn authenticate(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match presented {
        Some(t) if same(t.as_bytes(), s.token.as_bytes()) => next.run(req).await,
        _ => {
            warn!(path = %req.uri().path(), "refused: missing or wrong bearer token");
            text(StatusCode::UNAUTHORIZED, "missing or wrong bearer token").into_response()
        }
    }
}

fn kappa(s: &str) -> Result<Kappa, Refusal> {
    s.parse()
        .map_err(|e| text(StatusCode::BAD_REQUEST, format!("`{s}`: {e}")))
}

/// Runs store work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Refusal> + Send + 'static,
) -> Result<T, Refusal> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
}

fn internal(e: impl std::fmt::Display) -> Refusal {
    text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// `POST /v1/objects/missing`: body = κ, 32 bytes each; answer = those the store lacks.
async fn missing(State(s): State<Shared>, body: Bytes) -> Response {
    if !body.len().is_multiple_of(32) || body.len() / 32 > MAX_QUERY {
        return text(
            StatusCode::BAD_REQUEST,
            format!("expected at most {MAX_QUERY} κ of 32 bytes each"),
        )
        .into_response();
    }
    let r = blocking(move || {
        let mut out = Vec::new();
        for c in body.chunks_exact(32) {
            let k = Kappa::from_bytes(c.try_into().expect("32 bytes"));
            if !s.store.has(&k).map_err(internal)? {
                out.extend_from_slice(k.as_bytes());
            }
        }
        Ok(out)
    })
    .await;
    match r {
        Ok(v) => v.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `PUT /v1/objects/{κ}`: the object, zstd-compressed when `Content-Encoding: zstd`.
async fn put_object(
    State(s): State<Shared>,
    Path(k): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let k = match kappa(&k) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    let zstd = headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| v.as_bytes() == b"zstd");
    let r = blocking(move || {
        crate::sessions::fault_link(body.len());
        let bytes = if zstd {
            zstd::bulk::decompress(&body, MAX_OBJECT).map_err(|e| {
                text(
                    StatusCode::BAD_REQUEST,
                    format!("object {k}: bad zstd body: {e}"),
                )
            })?
        } else {
            body.to_vec()
        };
        let actual = Kappa::of(&bytes);
        if actual != k {
            warn!(%k, %actual, "refused an object that does not hash to its κ");
            return Err(refused(ferry_store::batch::Refused::mismatch(k, actual)));
        }
        s.store.put(&bytes).map_err(internal)?;
        s.received(1, bytes.len() as u64);
        Ok(())
    })
    .await;
    match r {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/objects`: many objects in one body, each `[32] κ, u8 codec (0 raw, 1 zstd),
/// u64 length, u64 stored length, stored bytes` (little-endian); every one is verified
/// before any is stored, and they are stored together (one pack on disk).
async fn put_objects(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let body = match read_body(&headers, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let r = blocking(move || {
        crate::sessions::fault("store-objects");
        crate::sessions::fault_link(body.len());
        let refuse = |e| text(StatusCode::UNPROCESSABLE_ENTITY, e);
        let stored = (|| {
            let batch = ferry_store::batch::decode(&body).map_err(refuse)?;
            let objects = batch.verify().map_err(refused)?;
            s.store.put_hashed(&objects).map_err(internal)?;
            let bytes = objects.iter().map(|o| o.bytes().len() as u64).sum();
            s.received(objects.len() as u64, bytes);
            Ok(())
        })();
        ferry_store::batch::give_back(body);
        stored
    })
    .await;
    match r {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

/// A request body of at most `MAX_BODY` bytes, read into a buffer used before (see
/// `batch::buffer`).
async fn read_body(headers: &HeaderMap, mut body: Body) -> Result<Vec<u8>, Refusal> {
    use http_body_util::BodyExt;
    let limit = MAX_BODY;
    let too_big = || {
        text(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a body of more than {limit} bytes"),
        )
    };
    let mut buf = ferry_store::batch::buffer();
    let announced = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if let Some(n) = announced {
        if n > limit {
            return Err(too_big());
        }
        buf.reserve(n);
    }
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| text(StatusCode::BAD_REQUEST, e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                return Err(too_big());
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf)
}

/// `POST /v1/objects/fetch`: body = κ, 32 bytes each (at most `MAX_FETCH`); answer = those
/// objects as a batch (the `POST /v1/objects` encoding), in the order asked; with
/// `?codec=raw`, none of them compressed (a reader without zstd: the JavaScript space).
async fn fetch_objects(
    State(s): State<Shared>,
    Query(q): Query<FetchQuery>,
    body: Bytes,
) -> Response {
    if !body.len().is_multiple_of(32) || body.len() / 32 > crate::MAX_FETCH {
        return text(
            StatusCode::BAD_REQUEST,
            format!("expected at most {} κ of 32 bytes each", crate::MAX_FETCH),
        )
        .into_response();
    }
    let raw = match q.codec.as_deref() {
        None => false,
        Some("raw") => true,
        Some(other) => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("unknown codec `{other}` (only `raw` may be asked for)"),
            )
            .into_response();
        }
    };
    let r = blocking(move || {
        let mut out = ferry_store::batch::buffer();
        let mut encoder = ferry_store::batch::Encoder::new();
        if raw {
            encoder = encoder.uncompressed();
        }
        let ks: Vec<Kappa> = body
            .chunks_exact(32)
            .map(|c| Kappa::from_bytes(c.try_into().expect("32 bytes")))
            .collect();
        match encoder.push_many_stored(&mut out, &ks, s.store.as_ref()) {
            Ok(_) => {}
            Err(ferry_store::StoreError::NotFound(k)) => {
                return Err(text(
                    StatusCode::NOT_FOUND,
                    format!("object {k} is not here"),
                ));
            }
            Err(e) => return Err(internal(e)),
        }
        Ok(out)
    })
    .await;
    match r {
        Ok(b) => Bytes::from_owner(ferry_store::batch::Pooled(b)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/objects/{κ}`: the object, zstd-compressed when the request accepts zstd
/// (`Accept-Encoding`; ferry's client does), else as it is — a browser or Node, whose
/// engines cannot decode zstd everywhere, gets the raw bytes (the JavaScript space, `web/`).
async fn get_object(
    State(s): State<Shared>,
    Path(k): Path<String>,
    headers: HeaderMap,
) -> Response {
    let k = match kappa(&k) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    let zstd = accepts_zstd(&headers);
    let r = blocking(move || match s.store.get(&k) {
        Ok(b) if zstd => zstd::bulk::compress(&b, 1).map_err(internal),
        Ok(b) => Ok(b),
        Err(ferry_store::StoreError::NotFound(_)) => Err(text(
            StatusCode::NOT_FOUND,
            format!("object {k} is not here"),
        )),
        Err(e) => Err(internal(e)),
    })
    .await;
    match r {
        Ok(b) if zstd => ([(header::CONTENT_ENCODING, "zstd")], b).into_response(),
        Ok(b) => b.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/objects/fetch?codec=raw`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FetchQuery {
    codec: Option<String>,
}

/// Whether `Accept-Encoding` names zstd (with any weight but `q=0`).
fn accepts_zstd(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|coding| {
            let mut parts = coding.split(';').map(str::trim);
            parts.next().is_some_and(|c| c.eq_ignore_ascii_case("zstd"))
                && !parts.any(|p| p.replace(' ', "") == "q=0")
        })
}

/// `POST /v1/snapshots/{κ}`: the snapshot's closure must be complete and verify; then the
/// ref `snapshot/<hex>` names it.
/// `POST /v1/gc`: collects what no ref reaches, sparing recent objects (`crate::gc`); with
/// progress when asked ([`PROGRESS`]).
async fn collect_garbage(
    State(s): State<Shared>,
    headers: HeaderMap,
    Json(req): Json<GcRequest>,
) -> Response {
    let Some(rec) = s.gc.clone() else {
        return text(
            StatusCode::NOT_FOUND,
            "this space does not collect garbage while it serves",
        )
        .into_response();
    };
    if req.keep == Some(0) {
        return text(StatusCode::BAD_REQUEST, "keep must be at least 1").into_response();
    }
    let keep = ferry_engine::gc::snapshots_kept(req.keep);
    let work = move || match rec.collect(req.dry_run, keep) {
        Ok(Some(c)) => {
            info!(
                removed = c.removed,
                kept = c.kept,
                spared = c.spared,
                freed = c.compacted.freed,
                "garbage collected"
            );
            Ok(GcReport::from(c))
        }
        Ok(None) => Err(text(
            StatusCode::CONFLICT,
            "another ferry process has this space's store open; try again when it is done",
        )),
        Err(e) => Err(internal(e)),
    };
    if headers.contains_key(PROGRESS) {
        return progress_of(move || work().map_err(|r| ApiError::new(r.0.as_u16(), r.1)));
    }
    match blocking(work).await {
        Ok(report) => Json(report).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn name_snapshot(State(s): State<Shared>, Path(k): Path<String>) -> Response {
    let k = match kappa(&k) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    let r = blocking(move || {
        ferry_engine::snapshot::load(s.store.as_ref(), k)
            .map_err(|e| text(StatusCode::CONFLICT, e.to_string()))?;
        ferry_engine::snapshot::name(s.store.as_ref(), k).map_err(internal)?;
        s.store.sync().map_err(internal)?;
        info!(snapshot = %k, "snapshot received and verified");
        Ok(())
    })
    .await;
    match r {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, self.msg).into_response()
    }
}

fn sessions(s: &Space) -> Result<Arc<Sessions>, ApiError> {
    s.sessions
        .clone()
        .ok_or_else(|| ApiError::not_found("this space runs no sessions"))
}

/// Runs session work off the async threads and answers with its JSON (or its refusal).
async fn session_call<T: serde::Serialize + Send + 'static>(
    s: Shared,
    f: impl FnOnce(Arc<Sessions>) -> Result<T, ApiError> + Send + 'static,
) -> Response {
    let r = tokio::task::spawn_blocking(move || f(sessions(&s)?))
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(e)));
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn list_sessions(State(s): State<Shared>) -> Response {
    session_call(s, |ss| Ok(ss.list())).await
}

async fn run_session(
    State(s): State<Shared>,
    headers: HeaderMap,
    Json(req): Json<RunRequest>,
) -> Response {
    with_progress(s, &headers, move |ss| ss.run(req)).await
}

async fn get_session(State(s): State<Shared>, Path(id): Path<String>) -> Response {
    session_call(s, move |ss| ss.info(&id)).await
}

async fn resume_session(
    State(s): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(req): Json<ResumeRequest>,
) -> Response {
    with_progress(s, &headers, move |ss| ss.resume(&id, req)).await
}

/// `GET /v1/sessions/{id}/files`: the trees of the session's mounts (`SessionFiles`).
async fn session_files(State(s): State<Shared>, Path(id): Path<String>) -> Response {
    session_call(s, move |ss| ss.files(&id)).await
}

async fn suspend_session(
    State(s): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    with_progress(s, &headers, move |ss| {
        ss.stop(&id, ferry_engine::Request::Suspend, false)
    })
    .await
}

async fn checkpoint_session(
    State(s): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    with_progress(s, &headers, move |ss| {
        ss.stop(&id, ferry_engine::Request::Checkpoint, false)
    })
    .await
}

/// `DELETE /v1/sessions/{id}[?force=true]`: forget a finished session (a suspended one with
/// `force`).
async fn forget_session(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Query(q): Query<ForgetQuery>,
) -> Response {
    let r = tokio::task::spawn_blocking(move || sessions(&s)?.forget(&id, q.force))
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(e)));
    match r {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ForgetQuery {
    #[serde(default)]
    force: bool,
}

async fn kill_session(
    State(s): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    with_progress(s, &headers, move |ss| {
        ss.stop(&id, ferry_engine::Request::Suspend, true)
    })
    .await
}

async fn migrate_session(
    State(s): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(req): Json<MigrateRequest>,
) -> Response {
    with_progress(s, &headers, move |ss| ss.migrate(&id, req)).await
}

#[derive(Debug, serde::Deserialize)]
struct WaitQuery {
    #[serde(default)]
    timeout_ms: u64,
}

/// Longest a single wait or log poll holds the connection.
const MAX_WAIT_MS: u64 = 30_000;

async fn wait_session(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Query(q): Query<WaitQuery>,
) -> Response {
    let t = std::time::Duration::from_millis(q.timeout_ms.min(MAX_WAIT_MS));
    session_call(s, move |ss| ss.wait(&id, t)).await
}

#[derive(Debug, serde::Deserialize)]
struct LogQuery {
    #[serde(default)]
    from: u64,
    #[serde(default)]
    wait_ms: u64,
}

/// `GET /v1/sessions/{id}/logs?from=N&wait_ms=M`: the output log's records from byte `N`
/// (whole records, at most about 1 MiB); headers `x-ferry-state`, `x-ferry-moved-to`,
/// `x-ferry-migrating-to` and `x-ferry-standby` say where the session is (and which space
/// would take it over); `x-ferry-log-start` says where the records start when that is not `N`
/// (`N` fell inside a record: the reader followed an earlier run of the guest, whose output
/// past its last snapshot came out otherwise when the guest redid it).
async fn session_logs(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Query(q): Query<LogQuery>,
) -> Response {
    let t = std::time::Duration::from_millis(q.wait_ms.min(MAX_WAIT_MS));
    let from = q.from;
    let r = tokio::task::spawn_blocking(move || sessions(&s)?.logs(&id, from, t))
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(e)));
    match r {
        Ok((start, bytes, info)) => {
            let mut resp = bytes.into_response();
            let h = resp.headers_mut();
            if start != from {
                // `from` fell inside a record of output the guest redid otherwise.
                h.insert("x-ferry-log-start", header::HeaderValue::from(start));
            }
            h.insert(
                "x-ferry-state",
                header::HeaderValue::from_static(info.state.name()),
            );
            if let Some(to) = info
                .moved_to
                .and_then(|t| header::HeaderValue::from_str(&t).ok())
            {
                h.insert("x-ferry-moved-to", to);
            }
            if let Some(to) = info
                .migrating_to
                .and_then(|t| header::HeaderValue::from_str(&t).ok())
            {
                h.insert("x-ferry-migrating-to", to);
            }
            if let Some(to) = info
                .standby
                .and_then(|t| header::HeaderValue::from_str(&t).ok())
            {
                h.insert("x-ferry-standby", to);
            }
            resp
        }
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/sessions/{id}/standby`: keep a checkpoint of another space's session as its
/// standby copy.
async fn standby_session(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Json(req): Json<crate::api::StandbyRequest>,
) -> Response {
    session_call(s, move |ss| ss.standby(&id, req)).await
}

/// `POST /v1/sessions/{id}/set-standby`: another standby for the session, or none.
async fn set_standby(
    State(s): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(req): Json<crate::api::SetStandby>,
) -> Response {
    with_progress(s, &headers, move |ss| ss.set_standby(&id, req)).await
}

/// `POST /v1/admission`: whether this space's policy would admit a guest.
async fn admission(
    State(s): State<Shared>,
    Json(req): Json<crate::api::AdmissionCheck>,
) -> Response {
    session_call(s, move |ss| ss.admission(&req)).await
}

/// `POST /v1/drain`: this space is being drained, or not any more.
async fn drain(
    State(s): State<Shared>,
    headers: HeaderMap,
    Json(req): Json<crate::api::Draining>,
) -> Response {
    with_progress(s, &headers, move |ss| ss.set_draining(req.draining)).await
}

/// `GET /v1/fleet`: the live spaces of this space's etcd fleet.
/// `GET /v1/ready` (no token: for load balancers and readiness probes): `200 ready` while the
/// space takes new sessions, `503` with why not.
async fn ready(State(s): State<Shared>) -> Response {
    let r = blocking(move || Ok(s.sessions.as_ref().map(|ss| ss.readiness())))
        .await
        .unwrap_or_else(|e| Some(Err(e.1)));
    match r {
        None | Some(Ok(())) => (StatusCode::OK, "ready\n").into_response(),
        Some(Err(why)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

/// `GET /v1/metrics`: the space's counters and the sessions' gauges, in Prometheus' text
/// format.
async fn metrics(State(s): State<Shared>) -> Response {
    let text = blocking(move || {
        let gauges = s.sessions.as_ref().map(|ss| ss.gauges());
        Ok::<_, Refusal>(s.metrics.render(gauges.as_ref()))
    })
    .await;
    match text {
        Ok(t) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            t,
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn fleet(State(s): State<Shared>, headers: HeaderMap) -> Response {
    with_progress(s, &headers, |ss| ss.fleet()).await
}

/// `POST /v1/sessions/{id}/lend`: a client outside the space takes the session over.
async fn lend_session(
    State(s): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(req): Json<LendRequest>,
) -> Response {
    with_progress(s, &headers, move |ss| ss.lend(&id, req)).await
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputQuery {
    epoch: u64,
    at: u64,
}

/// `POST /v1/sessions/{id}/output?epoch=E&at=N`: the holder's output records, placed at byte
/// `N` of the log; a `409` with [`LOG_LEN_HEADER`] when they start past its end.
async fn lent_output(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Query(q): Query<OutputQuery>,
    body: Bytes,
) -> Response {
    let r = tokio::task::spawn_blocking(move || {
        sessions(&s)
            .map_err(OutputRefusal::from)?
            .lent_output(&id, q.epoch, q.at, &body)
    })
    .await
    .unwrap_or_else(|e| Err(ApiError::internal(e).into()));
    match r {
        Ok(len) => Json(LogLength { len }).into_response(),
        Err(OutputRefusal { error, len }) => {
            let mut resp = error.into_response();
            // The log's length, for the client to send again from there.
            if let Some(len) = len {
                resp.headers_mut()
                    .insert(LOG_LEN_HEADER, header::HeaderValue::from(len));
            }
            resp
        }
    }
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StdinQuery {
    #[serde(default)]
    end: bool,
    /// The body is the input from this byte on (a repeat of what arrived is taken once).
    #[serde(default)]
    at: Option<u64>,
}

/// `POST /v1/sessions/{id}/stdin[?at=N][&end=true]`: input for an interactive session's guest
/// (the body's bytes, from byte `N` of its input on), kept durably before the answer; `end`:
/// no more comes after it.
async fn session_stdin(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Query(q): Query<StdinQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    with_progress(s, &headers, move |ss| {
        ss.send_input(&id, q.at, &body, q.end)
    })
    .await
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StandbyStdinQuery {
    epoch: u64,
    at: u64,
    #[serde(default)]
    end: bool,
}

/// `POST /v1/sessions/{id}/standby/stdin?epoch=E&at=N[&end=true]` (space to space): input an
/// interactive session's owner received, for this space's standby copy of it.
async fn standby_stdin(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Query(q): Query<StandbyStdinQuery>,
    body: Bytes,
) -> Response {
    session_call(s, move |ss| {
        ss.standby_input(&id, q.epoch, q.at, &body, q.end)
    })
    .await
}

/// `POST /v1/sessions/{id}/return`: the holder gives the session back.
async fn return_session(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Json(req): Json<ReturnRequest>,
) -> Response {
    session_call(s, move |ss| ss.take_back(&id, req)).await
}

/// `POST /v1/sessions/{id}/checkpointed`: the holder wrote a checkpoint.
async fn lent_checkpoint(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Json(req): Json<CheckpointedRequest>,
) -> Response {
    session_call(s, move |ss| ss.lent_checkpoint(&id, req)).await
}

/// `POST /v1/sessions/{id}/reclaim`: the session comes back from its holder, which is fenced.
async fn reclaim_session(
    State(s): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    with_progress(s, &headers, move |ss| ss.reclaim(&id)).await
}

/// `POST /v1/migrations`, with progress when asked ([`with_progress`]).
async fn prepare_migration(
    State(s): State<Shared>,
    headers: HeaderMap,
    Json(req): Json<PrepareRequest>,
) -> Response {
    with_progress(s, &headers, move |ss| ss.prepare(req)).await
}

/// [`session_call`], or — asked for progress ([`PROGRESS`]) — `200` at once, a space every
/// [`PROGRESS_EVERY`] while `f` works on a thread of its own, then its [`Progressed`] outcome.
/// A caller gone away is not told; the work still ends as it would without progress.
async fn with_progress<T: serde::Serialize + Send + 'static>(
    s: Shared,
    headers: &HeaderMap,
    f: impl FnOnce(Arc<Sessions>) -> Result<T, ApiError> + Send + 'static,
) -> Response {
    if !headers.contains_key(PROGRESS) {
        return session_call(s, f).await;
    }
    progress_of(move || f(sessions(&s)?))
}

/// `200` at once with [`PROGRESS`], a space every [`PROGRESS_EVERY`] while `work` runs on a
/// blocking thread, then its [`Progressed`] outcome.
fn progress_of<T: serde::Serialize + Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(2);
    tokio::spawn(async move {
        let work = tokio::task::spawn_blocking(work);
        tokio::pin!(work);
        let mut tick = tokio::time::interval(PROGRESS_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let outcome = loop {
            tokio::select! {
                r = &mut work => break r.unwrap_or_else(|e| Err(ApiError::internal(e))),
                _ = tick.tick() => {
                    let _ = tx.try_send(Bytes::from_static(b" "));
                }
            }
        };
        let outcome = match outcome {
            Ok(v) => Progressed::Ok(Box::new(v)),
            Err(e) => Progressed::Error {
                status: e.status,
                message: e.msg,
            },
        };
        let json = serde_json::to_vec(&outcome).expect("an outcome serializes");
        let _ = tx.send(Bytes::from(json)).await;
    });
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::HeaderName::from_static(PROGRESS), "1"),
        ],
        Body::new(Frames(rx)),
    )
        .into_response()
}

/// A response body whose data frames come from a channel, ending when its sender is dropped.
struct Frames(tokio::sync::mpsc::Receiver<Bytes>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|b| b.map(|b| Ok(http_body::Frame::data(b))))
    }
}

async fn commit_migration(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Json(d): Json<Decision>,
) -> Response {
    session_call(s, move |ss| ss.commit(&id, d)).await
}

async fn abort_migration(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Json(d): Json<Decision>,
) -> Response {
    session_call(s, move |ss| {
        ss.abort(&id, d).map(|()| serde_json::json!({}))
    })
    .await
}

/// The API: every route but `/v1/health`, `/v1/ready` and the console's static files requires the bearer
/// token.
pub fn router(space: Arc<Space>) -> Router {
    let authed = Router::new()
        .route("/v1/objects/missing", post(missing))
        .route("/v1/objects", post(put_objects))
        .route("/v1/objects/fetch", post(fetch_objects))
        .route("/v1/objects/{kappa}", put(put_object).get(get_object))
        .route("/v1/snapshots/{kappa}", post(name_snapshot))
        .route("/v1/gc", post(collect_garbage))
        .route("/v1/sessions", get(list_sessions).post(run_session))
        .route("/v1/sessions/{id}", get(get_session).delete(forget_session))
        .route("/v1/sessions/{id}/logs", get(session_logs))
        .route("/v1/sessions/{id}/stdin", post(session_stdin))
        .route("/v1/sessions/{id}/files", get(session_files))
        .route("/v1/sessions/{id}/wait", get(wait_session))
        .route("/v1/sessions/{id}/resume", post(resume_session))
        .route("/v1/sessions/{id}/suspend", post(suspend_session))
        .route("/v1/sessions/{id}/checkpoint", post(checkpoint_session))
        .route("/v1/sessions/{id}/kill", post(kill_session))
        .route("/v1/sessions/{id}/migrate", post(migrate_session))
        .route("/v1/sessions/{id}/lend", post(lend_session))
        .route("/v1/sessions/{id}/output", post(lent_output))
        .route("/v1/sessions/{id}/checkpointed", post(lent_checkpoint))
        .route("/v1/sessions/{id}/return", post(return_session))
        .route("/v1/sessions/{id}/reclaim", post(reclaim_session))
        .route("/v1/sessions/{id}/standby", post(standby_session))
        .route("/v1/sessions/{id}/standby/stdin", post(standby_stdin))
        .route("/v1/sessions/{id}/set-standby", post(set_standby))
        .route("/v1/admission", post(admission))
        .route("/v1/fleet", get(fleet))
        .route("/v1/drain", post(drain))
        .route("/v1/metrics", get(metrics))
        .route("/v1/migrations", post(prepare_migration))
        .route("/v1/migrations/{id}/commit", post(commit_migration))
        .route("/v1/migrations/{id}/abort", post(abort_migration))
        .layer(middleware::from_fn_with_state(space.clone(), authenticate))
        .layer(DefaultBodyLimit::max(MAX_BODY));
    Router::new()
        .route("/v1/health", get(|| async { "ferry space v1\n" }))
        .route("/v1/ready", get(ready))
        .route("/console/", get(crate::console::index))
        .route("/console/{file}", get(crate::console::asset))
        .merge(authed)
        .with_state(space)
}

/// Serves `space` on `listener` until Ctrl-C / SIGTERM, which first moves away or suspends its
/// running sessions (saying so on stderr; see [`Sessions::stop_all`]): HTTPS with `tls` (a
/// [`crate::tls::server_config`]), else plain HTTP. Every accepted connection watches its
/// peer ([`crate::net::watch_peer`]): a client that goes silent in the middle of a request is
/// given up instead of holding it for good.
pub async fn serve(
    listener: tokio::net::TcpListener,
    space: Arc<Space>,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    match tls {
        Some(config) => serve_on(crate::tls::TlsListener::new(listener, config)?, space).await,
        None => {
            let listener =
                listener.tap_io(|tcp| crate::net::watch_accepted(socket2::SockRef::from(&*tcp)));
            serve_on(listener, space).await
        }
    }
}

async fn serve_on<L>(listener: L, space: Arc<Space>) -> std::io::Result<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let sessions = space.sessions.clone();
    axum::serve(listener, router(space))
        .with_graceful_shutdown(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            // The running sessions are moved away (`--on-stop move`) or suspended first,
            // while the API still answers (a client's `wait` or `logs --follow` sees them go);
            // asked again, the space stops at once, and they come back at their last
            // snapshots.
            if let Some(ss) = sessions {
                let running = ss
                    .list()
                    .iter()
                    .filter(|i| i.state == crate::api::State::Running)
                    .count();
                if running > 0 {
                    eprintln!(
                        "ferry: stopping: {} {running} running session(s) first (Ctrl-C again \
                         stops at once)",
                        if ss.moves_on_stop() {
                            "moving"
                        } else {
                            "suspending"
                        }
                    );
                }
                let work = tokio::task::spawn_blocking(move || ss.stop_all());
                tokio::select! {
                    r = work => {
                        if let Ok(done) = r {
                            report_stop(&done);
                        }
                    }
                    _ = tokio::signal::ctrl_c() => stop_at_once(),
                    _ = term.recv() => stop_at_once(),
                }
            }
            info!("shutting down");
        })
        .await
}

/// Says on stderr what stopping did with the running sessions.
fn report_stop(done: &crate::sessions::Stopped) {
    if !done.moved.is_empty() {
        eprintln!(
            "ferry: {} session(s) moved away: {}",
            done.moved.len(),
            done.moved
                .iter()
                .map(|(id, to)| format!("{id} to {to}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if !done.suspended.is_empty() {
        eprintln!(
            "ferry: {} session(s) suspended; they go on when the space starts again",
            done.suspended.len()
        );
    }
    if !done.left.is_empty() {
        eprintln!(
            "ferry: {} session(s) neither moved nor suspended (they come back at their last \
             snapshots): {}",
            done.left.len(),
            done.left
                .iter()
                .map(|(id, why)| format!("{id}: {why}"))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
}

/// Asked to stop again while the sessions are being suspended: the process ends now (the
/// sessions not yet suspended come back at their last snapshots, as after a crash).
fn stop_at_once() -> ! {
    warn!("asked again to stop: stopping without waiting for the sessions to be suspended");
    std::process::exit(130)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ferry_kappa::Kappa;
    use ferry_store::{MemStore, StoreError};

    /// A space serving an empty `MemStore` with the token `t` on a loopback port: the runtime
    /// (keep it alive), the store, the URL.
    fn serve_mem_store() -> (tokio::runtime::Runtime, Arc<MemStore>, String) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let store = Arc::new(MemStore::new());
        let space = Arc::new(super::Space {
            store: store.clone(),
            gc: None,
            token: "t".into(),
            sessions: None,
            metrics: Default::default(),
        });
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        rt.spawn(async move { axum::serve(listener, super::router(space)).await });
        (rt, store, url)
    }

    /// A batch holding an object whose bytes do not hash to its κ is refused with that κ in
    /// the `Ferry-Refused-Object` header, which the client returns as a structured error
    /// (what a push acts on: it checks that one object of its own store), and nothing of the
    /// batch is stored.
    #[test]
    fn a_forged_object_is_refused_by_name() {
        let (_rt, store, url) = serve_mem_store();

        let good = b"an honest object".to_vec();
        let forged = Kappa::of(b"what the sender claims");
        let mut body = Vec::new();
        for (k, bytes) in [
            (Kappa::of(&good), &good),
            (forged, &b"other bytes".to_vec()),
        ] {
            body.extend_from_slice(k.as_bytes());
            body.push(0); // raw
            body.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            body.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            body.extend_from_slice(bytes);
        }
        let client = crate::client::RemoteStore::new(&url, "t");
        match client.put_batch(&body) {
            Err(StoreError::RemoteRefusedObject { kappa, why }) => {
                assert_eq!(kappa, forged);
                assert!(
                    why.contains("422") && why.contains(&format!("object {forged} hashes to")),
                    "{why}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(!ferry_store::Store::has(&*store, &Kappa::of(&good)).unwrap());
        // A malformed batch is refused without naming an object.
        match client.put_batch(&body[..40]) {
            Err(StoreError::Remote(why)) => assert!(why.contains("422"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    /// What a reader without zstd (the JavaScript space) asks for comes raw: one object by
    /// `GET` without `Accept-Encoding: zstd`, many by `POST /v1/objects/fetch?codec=raw`;
    /// ferry's own client still gets zstd; an unknown codec is refused.
    #[test]
    fn objects_come_raw_to_a_reader_without_zstd() {
        let (_rt, store, url) = serve_mem_store();
        let bytes = vec![7u8; 65536]; // compresses well
        let k = ferry_store::Store::put(&*store, &bytes).unwrap();
        let agent = ureq::Agent::new_with_defaults();
        let get = |accept: Option<&str>| {
            let mut req = agent
                .get(format!("{url}/v1/objects/{k}"))
                .header("Authorization", "Bearer t");
            if let Some(a) = accept {
                req = req.header("Accept-Encoding", a);
            }
            let mut r = req.call().unwrap();
            let coded = r.headers().get("Content-Encoding").cloned();
            (coded, r.body_mut().read_to_vec().unwrap())
        };
        assert_eq!(get(None), (None, bytes.clone()));
        assert_eq!(get(Some("gzip, deflate")).1, bytes);
        let (coded, body) = get(Some("gzip, zstd;q=0.9"));
        assert_eq!(coded.unwrap(), "zstd");
        assert!(body.len() < 1000);
        assert_eq!(get(Some("zstd;q=0")).0, None);
        // ferry's client still gets (and decodes) zstd.
        let client = crate::client::RemoteStore::new(&url, "t");
        assert_eq!(ferry_store::Store::get(&client, &k).unwrap(), bytes);

        let fetch = |query: &str| {
            agent
                .post(format!("{url}/v1/objects/fetch{query}"))
                .header("Authorization", "Bearer t")
                .config()
                .http_status_as_error(false)
                .build()
                .send(&k.as_bytes()[..])
                .unwrap()
        };
        let mut r = fetch("?codec=raw");
        let batch = r.body_mut().read_to_vec().unwrap();
        assert_eq!(batch[32], 0, "codec raw");
        assert_eq!(&batch[49..], &bytes[..]);
        let mut r = fetch("");
        assert_eq!(
            r.body_mut().read_to_vec().unwrap()[32],
            1,
            "zstd when not asked"
        );
        let mut r = fetch("?codec=lz4");
        assert_eq!(r.status(), 400);
        assert!(
            r.body_mut()
                .read_to_string()
                .unwrap()
                .contains("unknown codec `lz4`")
        );
    }

    /// docs/openapi.yaml documents every route the router serves.
    #[test]
    fn openapi_lists_every_route() {
        let spec = include_str!("../../../docs/openapi.yaml");
        let routes: Vec<&str> = include_str!("server.rs")
            .lines()
            .filter_map(|l| l.trim().strip_prefix(".route(\""))
            .filter_map(|l| l.split('"').next())
            .collect();
        assert!(routes.len() >= 15, "{routes:?}");
        for r in routes {
            assert!(
                spec.contains(&format!("  {r}:\n")),
                "docs/openapi.yaml does not document {r}"
            );
        }
    }
}
