//! Which space owns which session, recorded in etcd for a fleet of spaces (DESIGN §3: etcd,
//! with revisions as fencing tokens, for "which space owns which session";
//! docs/migration.md, "Owners in etcd").
//!
//! Without it the two spaces of a move hold the whole truth between them: the source's
//! durable record of the move is the commit point, so a destination holding a prepared copy
//! must hear the outcome from the source — and if the source is gone for good, the copy waits
//! for ever. With `ferry serve --etcd URL` the outcome of every move is decided in etcd:
//!
//! * `<prefix>/sessions/<id>` holds the owner record `{"space": URL, "epoch": e}`: created by
//!   the space that first runs the session, moved by each committed migration. Its mod
//!   revision is the fencing token a move compares, and a space resumes or moves only a
//!   session the record says is its own, at the epoch it holds.
//! * `<prefix>/moves/<id>/<epoch>/<attempt>` holds the outcome of one attempt to move the
//!   session to `epoch`: `committed` or `aborted`, written once, by a transaction that
//!   succeeds only while the key does not exist. The source commits with one transaction that
//!   also moves the owner record (only if its mod revision is still the one the source read
//!   before the move); the destination, or the source, aborts by writing `aborted`. Whichever
//!   lands first is the outcome, so a destination may give a prepared copy up on its own when
//!   the source stays silent, and run it on its own when etcd says `committed`.
//! * `<prefix>/spaces/<URL>` says a space is alive: put under a lease the space renews
//!   (`--lease-ttl`), so it goes when the space has not been heard from for that long.
//! * `<prefix>/standby/<id>` names a session's standby `{"space": URL, "epoch": e}`: the
//!   space that holds a copy of it at each checkpoint (`run --standby`). When the owner's
//!   `spaces` key is gone, the standby takes the session over with one transaction (owner
//!   record and standby record unchanged since it read them, the owner's key still absent →
//!   the owner record names the standby at epoch e + 1, the standby record goes). An owner
//!   whose session ends removes the standby record first, by a transaction that holds only
//!   while it still owns the session — so of the two, exactly one decides.
//!
//! The client speaks etcd's v3 JSON gateway (`POST /v3/kv/range`, `/v3/kv/txn`; keys and
//! values in base64), over connections that notice a silent peer ([`crate::net`]). Every
//! answer is bounded in size and checked before it is believed. Against an etcd with user
//! authentication ([`Owners::with_user`]) it signs in (`/v3/auth/authenticate`), sends the
//! token it is given with every request, and signs in again when etcd no longer knows it.

use std::io::Read;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tracing::warn;

use crate::sessions::lock;

/// Largest etcd answer read (a range of one key, a transaction of a few operations).
const MAX_ANSWER: u64 = 1 << 20;

/// Why etcd could not be asked, or what it answered that ferry cannot use.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint answered (each one's failure is in the message).
    #[error("etcd cannot be reached ({0})")]
    Unreachable(String),
    /// An endpoint answered with an error (no leader, a request it refuses).
    #[error("etcd at {endpoint} answered {status}: {msg}")]
    Refused {
        endpoint: String,
        status: u16,
        msg: String,
    },
    /// The answer, or a record in it, is not what ferry writes there.
    #[error("etcd at {endpoint}: unexpected answer: {msg}")]
    Malformed { endpoint: String, msg: String },
}

impl EtcdError {
    /// The same error, with the message of etcd's refusal rewritten by `f` (context, a hint).
    fn reworded(self, f: impl FnOnce(&str) -> String) -> Self {
        match self {
            Self::Refused {
                endpoint,
                status,
                msg,
            } => Self::Refused {
                endpoint,
                status,
                msg: f(&msg),
            },
            e => e,
        }
    }
}

/// Who owns a session: the space (its advertised URL) and the session's epoch there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Owner {
    pub space: String,
    pub epoch: u64,
}

impl Owner {
    /// Whether this owner record took the session from `space`, which held it at `epoch`:
    /// it names another space at a later epoch (a take-over, or a move on from there).
    pub fn supersedes(&self, space: &str, epoch: u64) -> bool {
        self.space != space && self.epoch > epoch
    }
}

/// An owner record and its mod revision (the fencing token a move compares).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owned {
    pub owner: Owner,
    pub revision: i64,
}

/// The outcome of one attempt to move a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Committed,
    Aborted,
}

impl Outcome {
    /// As etcd holds it: `committed` or `aborted`.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Committed => "committed",
            Outcome::Aborted => "aborted",
        }
    }
}

/// What a commit attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Commit {
    /// The move is decided: this attempt committed (now or by an earlier try), or someone
    /// aborted it first.
    Decided(Outcome),
    /// The owner record changed since the source read it: someone else owns the session now.
    Superseded(Option<Owner>),
}

/// What [`Owners::claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The record names this space at the epoch asked for (now, or already).
    Mine(Owned),
    /// Another space owns the session, or this one at another epoch.
    Taken(Owned),
}

/// A session's standby (`<prefix>/standby/<id>`): the space that holds a copy of it at its
/// checkpoints and takes it over if its owner's lease runs out, for the owner's epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Standby {
    pub space: String,
    pub epoch: u64,
}

/// What a standby space reads of a session each round: its owner record, its standby
/// record (with their mod revisions), and whether the owner's lease is alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StandbyView {
    pub owner: Option<Owned>,
    pub standby: Option<(Standby, i64)>,
    pub owner_alive: bool,
}

impl StandbyView {
    /// Whether the owner record names `space` at `epoch`.
    pub fn owned_by(&self, space: &str, epoch: u64) -> bool {
        self.owner
            .as_ref()
            .is_some_and(|r| r.owner.space == space && r.owner.epoch == epoch)
    }

    /// Whether the standby record names `space` at `epoch`.
    pub fn standby_is(&self, space: &str, epoch: u64) -> bool {
        self.standby
            .as_ref()
            .is_some_and(|(s, _)| s.space == space && s.epoch == epoch)
    }
}

/// What [`Owners::end_standby`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndStandby {
    /// No standby can take the session over any more.
    Ended,
    /// The owner record no longer names this space at that epoch: the session was taken
    /// over (or moved) — this copy is fenced.
    Superseded(Option<Owner>),
}

/// The etcd owner records of one space (`ferry serve --etcd`).
#[derive(Debug)]
pub struct Owners {
    endpoints: Vec<String>,
    /// The endpoint that answered last: asked first next time.
    current: AtomicUsize,
    prefix: String,
    me: String,
    /// The failure domain this space announces (`ferry serve --zone`).
    zone: Option<String>,
    agent: ureq::Agent,
    /// Announced as draining ([`Owners::set_draining`]).
    draining: std::sync::atomic::AtomicBool,
    /// The lease this space is announced under now (0: none yet).
    lease: std::sync::atomic::AtomicI64,
    /// When that lease was last granted or renewed.
    renewed: Mutex<Option<std::time::Instant>>,
    /// With etcd's user authentication: who this space signs in as.
    user: Option<User>,
}

/// A live space of the fleet, as its announcement says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announced {
    /// Its URL.
    pub space: String,
    /// Its failure domain (`ferry serve --zone`), if it names one.
    pub zone: Option<String>,
    /// It is being drained (`ferry --space URL drain`): it takes no new sessions, and no
    /// space chooses it as a standby.
    pub draining: bool,
}

/// An announcement's value: `{"space": URL, "zone": NAME, "draining": true}` (a space
/// without `--zone` that is not draining, or of a ferry before zones, announces its bare
/// URL).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Announcement {
    space: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    zone: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    draining: bool,
}

/// Whether `zone` is a name `--zone` takes: 1 to 64 letters, digits, `.`, `_` or `-`.
pub fn valid_zone(zone: &str) -> bool {
    (1..=64).contains(&zone.len())
        && zone
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// An etcd user, and the token etcd gave it last.
struct User {
    name: String,
    password: String,
    token: Mutex<Option<String>>,
}

impl std::fmt::Debug for User {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("User")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The first key after every key that starts with `prefix` (etcd's `range_end` of a prefix).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// An int64 of etcd's JSON: a string of digits (or, from some gateways, a number).
fn int(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

impl Owners {
    /// The records under `prefix` (e.g. `/ferry`) of the etcd cluster at `endpoints`
    /// (`http(s)://host:port`), for the space that peers reach at `me`. Asks nothing yet:
    /// [`Owners::check`] does.
    pub fn new(endpoints: &[String], prefix: &str, me: &str) -> Self {
        Self {
            endpoints: endpoints
                .iter()
                .map(|e| e.trim_end_matches('/').to_owned())
                .collect(),
            current: AtomicUsize::new(0),
            prefix: prefix.trim_end_matches('/').to_owned(),
            me: me.trim_end_matches('/').to_owned(),
            zone: None,
            agent: crate::client::answering_agent(),
            draining: Default::default(),
            lease: Default::default(),
            renewed: Mutex::new(None),
            user: None,
        }
    }

    /// Signs in to etcd as `name` (etcd's user authentication, `etcdctl auth enable`): the
    /// user needs read and write on the fleet's prefix.
    pub fn with_user(mut self, name: &str, password: &str) -> Self {
        self.user = Some(User {
            name: name.to_owned(),
            password: password.to_owned(),
            token: Mutex::new(None),
        });
        self
    }

    /// Speaks HTTPS to etcd with `tls` ([`crate::tls::etcd_client_config`]: the CA that
    /// signed etcd's certificate, and a client certificate when etcd asks for one).
    pub fn with_tls(mut self, tls: ureq::tls::TlsConfig) -> Self {
        self.agent = crate::client::answering_agent_with(tls);
        self
    }

    /// Announces this space in failure domain `zone` (a [`valid_zone`] name): a session here
    /// whose standby the space chooses gets one of another zone when one can stand by.
    pub fn with_zone(mut self, zone: &str) -> Self {
        self.zone = Some(zone.to_owned());
        self
    }

    /// The failure domain this space announces, if any.
    pub fn zone(&self) -> Option<&str> {
        self.zone.as_deref()
    }

    /// This space's URL, as the owner records name it.
    pub fn me(&self) -> &str {
        &self.me
    }

    fn owner_key(&self, id: &str) -> String {
        format!("{}/sessions/{id}", self.prefix)
    }

    fn move_key(&self, id: &str, epoch: u64, attempt: &str) -> String {
        format!("{}/moves/{id}/{epoch}/{attempt}", self.prefix)
    }

    /// `POST <endpoint>/v3/<what>` on the first endpoint that answers, signed in when etcd
    /// authenticates its users.
    fn call(&self, what: &str, body: &Value) -> Result<(String, Value), EtcdError> {
        let Some(user) = &self.user else {
            return self.call_as(what, body, None).map_err(|e| {
                e.reworded(|msg| {
                    if msg.contains("user name is empty") {
                        format!("{msg} (this etcd authenticates its users: give --etcd-user)")
                    } else {
                        msg.to_owned()
                    }
                })
            });
        };
        let token = self.token(user)?;
        match self.call_as(what, body, Some(&token)) {
            // The token is no longer good (etcd forgets them after a while unused, and when
            // its authentication is turned off and on): a new one, once.
            Err(EtcdError::Refused { status: 401, .. }) => {
                let mut held = lock(&user.token);
                if held.as_deref() == Some(token.as_str()) {
                    *held = None;
                }
                drop(held);
                let token = self.token(user)?;
                self.call_as(what, body, Some(&token))
            }
            r => r,
        }
    }

    /// The token etcd gave `user`, signing in first if there is none.
    fn token(&self, user: &User) -> Result<String, EtcdError> {
        if let Some(t) = lock(&user.token).clone() {
            return Ok(t);
        }
        let body = json!({ "name": user.name, "password": user.password });
        let (endpoint, v) = self
            .call_as("auth/authenticate", &body, None)
            .map_err(|e| e.reworded(|msg| format!("signing in as `{}`: {msg}", user.name)))?;
        let token = v
            .get("token")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty() && t.len() <= 4096)
            .ok_or_else(|| malformed(&endpoint, "a sign-in answer without a token"))?
            .to_owned();
        *lock(&user.token) = Some(token.clone());
        Ok(token)
    }

    /// `POST <endpoint>/v3/<what>` on the first endpoint that answers, with `token`.
    fn call_as(
        &self,
        what: &str,
        body: &Value,
        token: Option<&str>,
    ) -> Result<(String, Value), EtcdError> {
        let n = self.endpoints.len();
        let first = self.current.load(Ordering::Relaxed) % n.max(1);
        let mut failures = Vec::new();
        for i in 0..n {
            let at = (first + i) % n;
            let endpoint = &self.endpoints[at];
            let mut req = self
                .agent
                .post(format!("{endpoint}/v3/{what}"))
                .header("Content-Type", "application/json");
            if let Some(t) = token {
                req = req.header("Authorization", t);
            }
            let r = req.send(body.to_string());
            let mut r = match r {
                Ok(r) => r,
                Err(e) => {
                    let client_cert = self.agent.config().tls_config().client_cert().is_some();
                    let why = explain(e.to_string(), endpoint, client_cert);
                    failures.push(format!("{endpoint}: {why}"));
                    continue;
                }
            };
            let status = r.status().as_u16();
            let mut bytes = Vec::new();
            if let Err(e) = r
                .body_mut()
                .as_reader()
                .take(MAX_ANSWER)
                .read_to_end(&mut bytes)
            {
                failures.push(format!("{endpoint}: {e}"));
                continue;
            }
            self.current.store(at, Ordering::Relaxed);
            let v: Value = serde_json::from_slice(&bytes).map_err(|e| EtcdError::Malformed {
                endpoint: endpoint.clone(),
                msg: format!("{e} (status {status})"),
            })?;
            if status != 200 {
                let msg = v
                    .get("message")
                    .or_else(|| v.get("error"))
                    .and_then(Value::as_str)
                    .unwrap_or("no reason given")
                    .to_owned();
                // No leader, or the member is cut off from its cluster: another may answer.
                if status == 503 {
                    failures.push(format!("{endpoint}: {msg}"));
                    continue;
                }
                return Err(EtcdError::Refused {
                    endpoint: endpoint.clone(),
                    status,
                    msg,
                });
            }
            return Ok((endpoint.clone(), v));
        }
        Err(EtcdError::Unreachable(failures.join("; ")))
    }

    /// A transaction: `compare`, then `success` or `failure`; whether it succeeded, and the
    /// answers to its operations.
    fn txn(
        &self,
        compare: Vec<Value>,
        success: Vec<Value>,
        failure: Vec<Value>,
    ) -> Result<(String, bool, Value), EtcdError> {
        let body = json!({ "compare": compare, "success": success, "failure": failure });
        let (endpoint, v) = self.call("kv/txn", &body)?;
        let ok = v.get("succeeded").and_then(Value::as_bool).unwrap_or(false);
        Ok((endpoint, ok, v))
    }

    fn standby_key(&self, id: &str) -> String {
        format!("{}/standby/{id}", self.prefix)
    }

    /// Where a space announces that it is alive, under its lease.
    fn space_key(&self, space: &str) -> String {
        format!("{}/spaces/{space}", self.prefix)
    }

    fn owner_value(&self, epoch: u64) -> String {
        let mine = Owner {
            space: self.me.clone(),
            epoch,
        };
        B64.encode(serde_json::to_vec(&mine).expect("a plain struct"))
    }

    /// Grants a lease of `ttl` and announces this space under it; returns the lease's id.
    pub fn announce(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let secs = ttl.as_secs().max(1);
        let (endpoint, v) = self.call("lease/grant", &json!({ "TTL": secs.to_string() }))?;
        let id = v
            .get("ID")
            .and_then(int)
            .ok_or_else(|| malformed(&endpoint, "a lease without its id"))?;
        self.put_announcement(id)?;
        self.lease.store(id, Ordering::SeqCst);
        *lock(&self.renewed) = Some(std::time::Instant::now());
        Ok(id)
    }

    /// How long ago this space's lease was last granted or renewed (`None` before the first
    /// announcement).
    pub fn lease_renewed_age(&self) -> Option<Duration> {
        lock(&self.renewed).map(|t| t.elapsed())
    }

    /// What this space's announcement holds: its bare URL, or — with a zone, or while it is
    /// draining — the JSON [`Announcement`].
    fn announcement(&self) -> String {
        let draining = self.draining.load(Ordering::SeqCst);
        if self.zone.is_none() && !draining {
            return self.me.clone();
        }
        serde_json::to_string(&Announcement {
            space: self.me.clone(),
            zone: self.zone.clone(),
            draining,
        })
        .expect("a plain struct")
    }

    /// Announces this space as draining, or not any more: at once under its current lease,
    /// and under each later one.
    pub fn set_draining(&self, on: bool) -> Result<(), EtcdError> {
        self.draining.store(on, Ordering::SeqCst);
        let lease = self.lease.load(Ordering::SeqCst);
        if lease == 0 {
            return Ok(());
        }
        self.put_announcement(lease)
    }

    /// Puts this space's announcement under lease `id`.
    fn put_announcement(&self, id: i64) -> Result<(), EtcdError> {
        self.call(
            "kv/put",
            &json!({
                "key": B64.encode(self.space_key(&self.me)),
                "value": B64.encode(self.announcement()),
                "lease": id.to_string(),
            }),
        )?;
        Ok(())
    }

    /// `space`'s announcement, if it has one (its lease alive): a space of this fleet that
    /// runs.
    pub fn announced(&self, space: &str) -> Result<Option<Announced>, EtcdError> {
        let key = B64.encode(self.space_key(space.trim_end_matches('/')));
        let (endpoint, v) = self.call("kv/range", &json!({ "key": key }))?;
        Ok(spaces_in(&endpoint, &self.space_key(""), &v)?.pop())
    }

    /// The spaces announced now (their leases alive), sorted by URL; at most [`MAX_SPACES`]
    /// of them.
    pub fn live_spaces(&self) -> Result<Vec<Announced>, EtcdError> {
        let prefix = self.space_key("");
        let (endpoint, v) = self.call(
            "kv/range",
            &json!({
                "key": B64.encode(&prefix),
                "range_end": B64.encode(prefix_end(&prefix)),
                "limit": MAX_SPACES.to_string(),
            }),
        )?;
        spaces_in(&endpoint, &prefix, &v)
    }

    /// Renews lease `id`: whether it was still alive (an expired lease answers a TTL of 0, or
    /// none).
    pub fn keep_alive(&self, id: i64) -> Result<bool, EtcdError> {
        let (_, v) = self.call("lease/keepalive", &json!({ "ID": id.to_string() }))?;
        let ttl = v.pointer("/result/TTL").and_then(int).unwrap_or(0);
        if ttl > 0 {
            *lock(&self.renewed) = Some(std::time::Instant::now());
        }
        Ok(ttl > 0)
    }

    /// Keeps this space announced while the process lives (a thread): the lease of `ttl` is
    /// renewed every third of it, and granted anew if it ran out (etcd was unreachable for
    /// that long — a standby may have taken this space's sessions over meanwhile, which the
    /// owner records then say).
    pub fn keep_announced(self: &Arc<Self>, ttl: Duration) {
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("etcd-lease".into())
            .spawn(move || {
                loop {
                    let id = match me.announce(ttl) {
                        Ok(id) => id,
                        Err(e) => {
                            warn!(error = %e, "cannot announce this space in etcd; trying again");
                            std::thread::sleep(Duration::from_secs(1));
                            continue;
                        }
                    };
                    loop {
                        std::thread::sleep(ttl / 3);
                        match me.keep_alive(id) {
                            Ok(true) => {}
                            Ok(false) => {
                                warn!("this space's etcd lease ran out; announcing it again");
                                break;
                            }
                            Err(e) => warn!(error = %e, "cannot renew this space's etcd lease"),
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start the etcd lease thread");
        }
    }

    /// Names `to` as the standby of session `id`, which this space owns at `epoch` (only
    /// then: `false` otherwise).
    pub fn set_standby(&self, id: &str, epoch: u64, to: &str) -> Result<bool, EtcdError> {
        let owner = B64.encode(self.owner_key(id));
        let standby = Standby {
            space: to.trim_end_matches('/').to_owned(),
            epoch,
        };
        let (_, ok, _) = self.txn(
            vec![json!({ "key": owner, "target": "VALUE", "result": "EQUAL", "value": self.owner_value(epoch) })],
            vec![json!({ "request_put": {
                "key": B64.encode(self.standby_key(id)),
                "value": B64.encode(serde_json::to_vec(&standby).expect("a plain struct")),
            } })],
            vec![],
        )?;
        Ok(ok)
    }

    /// Removes session `id`'s standby while this space owns it at `epoch`, so that nothing
    /// takes the session over any more (it ended here); or finds that it no longer owns it.
    pub fn end_standby(&self, id: &str, epoch: u64) -> Result<EndStandby, EtcdError> {
        let owner = B64.encode(self.owner_key(id));
        let (endpoint, ok, v) = self.txn(
            vec![json!({ "key": owner, "target": "VALUE", "result": "EQUAL", "value": self.owner_value(epoch) })],
            vec![json!({ "request_delete_range": { "key": B64.encode(self.standby_key(id)) } })],
            vec![json!({ "request_range": { "key": owner } })],
        )?;
        if ok {
            return Ok(EndStandby::Ended);
        }
        let r = v
            .pointer("/responses/0/response_range")
            .ok_or_else(|| malformed(&endpoint, "a failed transaction without its read"))?;
        Ok(EndStandby::Superseded(
            owned_in(&endpoint, r)?.map(|o| o.owner),
        ))
    }

    /// Session `id`'s owner record, standby record, and whether `owner`'s lease is alive,
    /// read together.
    pub fn standby_view(&self, id: &str, owner: &str) -> Result<StandbyView, EtcdError> {
        let (endpoint, _, v) = self.txn(
            vec![],
            vec![
                json!({ "request_range": { "key": B64.encode(self.owner_key(id)) } }),
                json!({ "request_range": { "key": B64.encode(self.standby_key(id)) } }),
                json!({ "request_range": { "key": B64.encode(self.space_key(owner)) } }),
            ],
            vec![],
        )?;
        let range = |i: usize| {
            v.pointer(&format!("/responses/{i}/response_range"))
                .ok_or_else(|| malformed(&endpoint, "a transaction without its reads"))
        };
        Ok(StandbyView {
            owner: owned_in(&endpoint, range(0)?)?,
            standby: standby_in(&endpoint, range(1)?)?,
            owner_alive: value_in(&endpoint, range(2)?)?.is_some(),
        })
    }

    /// Takes session `id` over as its standby: only while the owner record and the standby
    /// record are as `view` read them and the owner's lease is gone, the owner record names
    /// this space at the next epoch and the standby record goes. Returns the new record, or
    /// `None` when something changed (read again and decide again).
    pub fn take_over(&self, id: &str, view: &StandbyView) -> Result<Option<Owned>, EtcdError> {
        let (Some(owned), Some((_, standby_rev))) = (&view.owner, &view.standby) else {
            return Ok(None);
        };
        let owner = B64.encode(self.owner_key(id));
        let standby = B64.encode(self.standby_key(id));
        let alive = B64.encode(self.space_key(&owned.owner.space));
        let epoch = owned.owner.epoch + 1;
        let (endpoint, ok, v) = self.txn(
            vec![
                json!({ "key": owner, "target": "MOD", "result": "EQUAL", "mod_revision": owned.revision.to_string() }),
                json!({ "key": standby, "target": "MOD", "result": "EQUAL", "mod_revision": standby_rev.to_string() }),
                json!({ "key": alive, "target": "VERSION", "result": "EQUAL", "version": "0" }),
            ],
            vec![
                json!({ "request_put": { "key": owner, "value": self.owner_value(epoch) } }),
                json!({ "request_delete_range": { "key": standby } }),
            ],
            vec![],
        )?;
        if !ok {
            return Ok(None);
        }
        let revision = v
            .pointer("/header/revision")
            .and_then(int)
            .ok_or_else(|| malformed(&endpoint, "a transaction without its revision"))?;
        Ok(Some(Owned {
            owner: Owner {
                space: self.me.clone(),
                epoch,
            },
            revision,
        }))
    }

    /// Asks etcd for nothing in particular: whether it answers (at `ferry serve`'s start).
    pub fn check(&self) -> Result<(), EtcdError> {
        self.call(
            "kv/range",
            &json!({ "key": B64.encode(self.owner_key("")) }),
        )
        .map(|_| ())
    }

    /// The session's owner record, if it has one.
    pub fn owner(&self, id: &str) -> Result<Option<Owned>, EtcdError> {
        let (endpoint, v) = self.call(
            "kv/range",
            &json!({ "key": B64.encode(self.owner_key(id)) }),
        )?;
        owned_in(&endpoint, &v)
    }

    /// The outcome of a move attempt, if it is decided.
    pub fn decided(
        &self,
        id: &str,
        epoch: u64,
        attempt: &str,
    ) -> Result<Option<Outcome>, EtcdError> {
        let key = self.move_key(id, epoch, attempt);
        let (endpoint, v) = self.call("kv/range", &json!({ "key": B64.encode(key) }))?;
        outcome_in(&endpoint, &v)
    }

    /// The session's owner record and the outcome of a move attempt, read together (one
    /// request: a destination asks both before it prepares a move).
    pub fn move_state(
        &self,
        id: &str,
        epoch: u64,
        attempt: &str,
    ) -> Result<(Option<Owned>, Option<Outcome>), EtcdError> {
        let (endpoint, _, v) = self.txn(
            vec![],
            vec![
                json!({ "request_range": { "key": B64.encode(self.owner_key(id)) } }),
                json!({ "request_range": { "key": B64.encode(self.move_key(id, epoch, attempt)) } }),
            ],
            vec![],
        )?;
        let range = |i: usize| {
            v.pointer(&format!("/responses/{i}/response_range"))
                .ok_or_else(|| malformed(&endpoint, "a transaction without its reads"))
        };
        Ok((
            owned_in(&endpoint, range(0)?)?,
            outcome_in(&endpoint, range(1)?)?,
        ))
    }

    /// Makes this space the session's owner at `epoch` if it has no owner, or if this space
    /// is its owner already (at any epoch: a session id this space reuses). Another space's
    /// record is left alone and returned.
    pub fn claim(&self, id: &str, epoch: u64) -> Result<Claim, EtcdError> {
        let key = B64.encode(self.owner_key(id));
        let mine = Owner {
            space: self.me.clone(),
            epoch,
        };
        let value = B64.encode(serde_json::to_vec(&mine).expect("a plain struct"));
        let mut known: Option<Owned> = None;
        // A few times at most: the record may change between the read and the write.
        for _ in 0..3 {
            let compare = match &known {
                None => {
                    json!({ "key": key, "target": "VERSION", "result": "EQUAL", "version": "0" })
                }
                Some(o) => {
                    json!({ "key": key, "target": "MOD", "result": "EQUAL", "mod_revision": o.revision.to_string() })
                }
            };
            let (endpoint, ok, v) = self.txn(
                vec![compare],
                vec![json!({ "request_put": { "key": key, "value": value } })],
                vec![json!({ "request_range": { "key": key } })],
            )?;
            if ok {
                let revision = v
                    .pointer("/header/revision")
                    .and_then(int)
                    .ok_or_else(|| malformed(&endpoint, "a transaction without its revision"))?;
                return Ok(Claim::Mine(Owned {
                    owner: mine,
                    revision,
                }));
            }
            let now = v
                .pointer("/responses/0/response_range")
                .map(|r| owned_in(&endpoint, r))
                .transpose()?
                .flatten();
            match now {
                Some(o) if o.owner == mine => return Ok(Claim::Mine(o)),
                Some(o) if o.owner.space != self.me => return Ok(Claim::Taken(o)),
                other => known = other,
            }
        }
        Err(EtcdError::Unreachable(format!(
            "the owner record of `{id}` keeps changing"
        )))
    }

    /// Commits attempt `attempt` of moving session `id` to `to`: in one transaction, only if
    /// the owner record is still at `revision` and the attempt is undecided, the record names
    /// `to`, the attempt is `committed`, and the standby record names `standby` at the new
    /// epoch (the standby follows the session) or goes (`None`). Asking again after a lost
    /// answer is safe: an attempt already committed answers `Committed`.
    pub fn commit_move(
        &self,
        id: &str,
        attempt: &str,
        revision: i64,
        to: &Owner,
        standby: Option<&str>,
    ) -> Result<Commit, EtcdError> {
        let owner = B64.encode(self.owner_key(id));
        let decision = B64.encode(self.move_key(id, to.epoch, attempt));
        let value = B64.encode(serde_json::to_vec(to).expect("a plain struct"));
        let standby_key = B64.encode(self.standby_key(id));
        let standby = match standby {
            Some(space) => {
                let record = Standby {
                    space: space.trim_end_matches('/').to_owned(),
                    epoch: to.epoch,
                };
                json!({ "request_put": {
                    "key": standby_key,
                    "value": B64.encode(serde_json::to_vec(&record).expect("a plain struct")),
                } })
            }
            None => json!({ "request_delete_range": { "key": standby_key } }),
        };
        let (endpoint, ok, v) = self.txn(
            vec![
                json!({ "key": owner, "target": "MOD", "result": "EQUAL", "mod_revision": revision.to_string() }),
                json!({ "key": decision, "target": "VERSION", "result": "EQUAL", "version": "0" }),
            ],
            vec![
                json!({ "request_put": { "key": owner, "value": value } }),
                json!({ "request_put": { "key": decision, "value": B64.encode(Outcome::Committed.name()) } }),
                standby,
            ],
            vec![
                json!({ "request_range": { "key": decision } }),
                json!({ "request_range": { "key": owner } }),
            ],
        )?;
        if ok {
            return Ok(Commit::Decided(Outcome::Committed));
        }
        let range = |i: usize| {
            v.pointer(&format!("/responses/{i}/response_range"))
                .ok_or_else(|| malformed(&endpoint, "a failed transaction without its reads"))
        };
        if let Some(o) = outcome_in(&endpoint, range(0)?)? {
            return Ok(Commit::Decided(o));
        }
        Ok(Commit::Superseded(
            owned_in(&endpoint, range(1)?)?.map(|o| o.owner),
        ))
    }

    /// Aborts attempt `attempt` of moving session `id` to `epoch` unless it is decided;
    /// returns the outcome (`Committed` if the source committed it first).
    pub fn abort_move(&self, id: &str, epoch: u64, attempt: &str) -> Result<Outcome, EtcdError> {
        let decision = B64.encode(self.move_key(id, epoch, attempt));
        let (endpoint, ok, v) = self.txn(
            vec![json!({ "key": decision, "target": "VERSION", "result": "EQUAL", "version": "0" })],
            vec![json!({ "request_put": { "key": decision, "value": B64.encode(Outcome::Aborted.name()) } })],
            vec![json!({ "request_range": { "key": decision } })],
        )?;
        if ok {
            return Ok(Outcome::Aborted);
        }
        let r = v
            .pointer("/responses/0/response_range")
            .ok_or_else(|| malformed(&endpoint, "a failed transaction without its read"))?;
        outcome_in(&endpoint, r)?
            .ok_or_else(|| malformed(&endpoint, "the attempt is decided, but its record is gone"))
    }

    /// Removes the session's owner record, if this space owns it, its standby record and the
    /// outcomes of its moves (the session is forgotten here).
    pub fn release(&self, id: &str) -> Result<(), EtcdError> {
        let Some(o) = self.owner(id)? else {
            return Ok(());
        };
        if o.owner.space != self.me {
            return Ok(());
        }
        let key = B64.encode(self.owner_key(id));
        let moves = format!("{}/moves/{id}/", self.prefix);
        self.txn(
            vec![json!({ "key": key, "target": "MOD", "result": "EQUAL", "mod_revision": o.revision.to_string() })],
            vec![
                json!({ "request_delete_range": { "key": key } }),
                json!({ "request_delete_range": { "key": B64.encode(self.standby_key(id)) } }),
                json!({ "request_delete_range": { "key": B64.encode(&moves), "range_end": B64.encode(prefix_end(&moves)) } }),
            ],
            vec![],
        )?;
        Ok(())
    }
}

fn malformed(endpoint: &str, msg: impl Into<String>) -> EtcdError {
    EtcdError::Malformed {
        endpoint: endpoint.to_owned(),
        msg: msg.into(),
    }
}

/// The value of the one key a range answer holds, if any.
fn value_in(endpoint: &str, range: &Value) -> Result<Option<(Vec<u8>, i64)>, EtcdError> {
    let Some(kv) = range
        .get("kvs")
        .and_then(Value::as_array)
        .and_then(|k| k.first())
    else {
        return Ok(None);
    };
    let value = match kv.get("value").and_then(Value::as_str) {
        Some(s) => B64
            .decode(s)
            .map_err(|e| malformed(endpoint, format!("a value that is not base64: {e}")))?,
        None => Vec::new(),
    };
    let revision = kv
        .get("mod_revision")
        .and_then(int)
        .ok_or_else(|| malformed(endpoint, "a key without its mod revision"))?;
    Ok(Some((value, revision)))
}

/// `msg`, a failure to reach etcd at `endpoint`, with a hint a user can act on: as
/// [`crate::tls::explain`] gives it, but naming `ferry serve`'s etcd options. An etcd that
/// requires client certificates (`--client-cert-auth`) closes the connection right after a
/// TLS 1.3 handshake when it refuses the client's, so the client sees a broken pipe or a
/// reset rather than the refusal: over HTTPS that is read as the likely reason.
fn explain(msg: String, endpoint: &str, client_cert: bool) -> String {
    let cut = [
        "Broken pipe",
        "Connection reset",
        "CertificateRequired",
        "BadCertificate",
    ];
    if endpoint.starts_with("https://") && cut.iter().any(|c| msg.contains(c)) {
        let hint = if client_cert {
            "etcd closed the connection after the handshake: it may not trust the client \
             certificate given (--etcd-cert: signed by a CA in etcd's --trusted-ca-file, for \
             client authentication)"
        } else {
            "etcd closed the connection after the handshake: it may require a client \
             certificate (give --etcd-cert and --etcd-key)"
        };
        format!("{msg} ({hint})")
    } else if msg.contains("UnknownIssuer") {
        format!(
            "{msg} (no trusted certificate vouches for etcd's: give --etcd-ca with the CA \
             that signed it)"
        )
    } else if msg.contains("NotValidForName") {
        format!("{msg} (etcd's certificate is not for this host name or address)")
    } else {
        crate::tls::explain(msg)
    }
}

/// How many announced spaces [`Owners::live_spaces`] reads at most.
pub const MAX_SPACES: usize = 1024;

/// The spaces a range answer over the announcements (keys `prefix` + URL) names, sorted by
/// URL, each with the zone its announcement names (none when the value is not an
/// [`Announcement`] of that URL with a [`valid_zone`]).
fn spaces_in(endpoint: &str, prefix: &str, range: &Value) -> Result<Vec<Announced>, EtcdError> {
    let kvs = range.get("kvs").and_then(Value::as_array);
    let mut spaces = Vec::new();
    for kv in kvs.into_iter().flatten().take(MAX_SPACES) {
        let key = kv
            .get("key")
            .and_then(Value::as_str)
            .and_then(|k| B64.decode(k).ok())
            .ok_or_else(|| malformed(endpoint, "an announcement without its key"))?;
        let space = key
            .strip_prefix(prefix.as_bytes())
            .and_then(|s| std::str::from_utf8(s).ok())
            .filter(|s| !s.is_empty())
            .ok_or_else(|| malformed(endpoint, "an announcement outside its prefix"))?;
        let said = kv
            .get("value")
            .and_then(Value::as_str)
            .filter(|v| v.len() <= 4096)
            .and_then(|v| B64.decode(v).ok())
            .and_then(|v| serde_json::from_slice::<Announcement>(&v).ok())
            .filter(|a| a.space == space);
        spaces.push(Announced {
            space: space.to_owned(),
            draining: said.as_ref().is_some_and(|a| a.draining),
            zone: said.and_then(|a| a.zone).filter(|z| valid_zone(z)),
        });
    }
    spaces.sort_by(|a, b| a.space.cmp(&b.space));
    spaces.dedup_by(|a, b| a.space == b.space);
    Ok(spaces)
}

/// The owner record a range answer holds, if any.
fn owned_in(endpoint: &str, range: &Value) -> Result<Option<Owned>, EtcdError> {
    Ok(record_in(endpoint, range, "an owner record")?
        .map(|(owner, revision)| Owned { owner, revision }))
}

/// The standby record a range answer holds, if any, with its mod revision.
fn standby_in(endpoint: &str, range: &Value) -> Result<Option<(Standby, i64)>, EtcdError> {
    record_in(endpoint, range, "a standby record")
}

/// The JSON record of ferry's (`what`, for the error) a range answer holds, if any, with
/// its mod revision.
fn record_in<T: serde::de::DeserializeOwned>(
    endpoint: &str,
    range: &Value,
    what: &str,
) -> Result<Option<(T, i64)>, EtcdError> {
    let Some((value, revision)) = value_in(endpoint, range)? else {
        return Ok(None);
    };
    let record = serde_json::from_slice(&value)
        .map_err(|e| malformed(endpoint, format!("{what} that is not ferry's: {e}")))?;
    Ok(Some((record, revision)))
}

/// The outcome a range answer holds, if any.
fn outcome_in(endpoint: &str, range: &Value) -> Result<Option<Outcome>, EtcdError> {
    match value_in(endpoint, range)? {
        None => Ok(None),
        Some((v, _)) if v == b"committed" => Ok(Some(Outcome::Committed)),
        Some((v, _)) if v == b"aborted" => Ok(Some(Outcome::Aborted)),
        Some((v, _)) => Err(malformed(
            endpoint,
            format!("a move outcome `{}`", String::from_utf8_lossy(&v)),
        )),
    }
}

/// Feeds `data` to the decoders of etcd's answers (the fuzzing entry point's part).
pub(crate) fn fuzz_answers(data: &[u8]) {
    if let Ok(v) = serde_json::from_slice::<Value>(data) {
        let _ = owned_in("fuzz", &v);
        let _ = outcome_in("fuzz", &v);
        let _ = standby_in("fuzz", &v);
        let _ = spaces_in("fuzz", "/ferry/spaces/", &v);
        let _ = v.pointer("/header/revision").and_then(int);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_space_announces_its_zone() {
        let o = Owners::new(&[], "/f", "http://a:1/");
        assert_eq!(o.announcement(), "http://a:1");
        let o = o.with_zone("eu-1.b");
        let range = json!({ "kvs": [{
            "key": B64.encode("/f/spaces/http://a:1"),
            "value": B64.encode(o.announcement()),
        }] });
        assert_eq!(
            spaces_in("e", "/f/spaces/", &range).unwrap()[0]
                .zone
                .as_deref(),
            Some("eu-1.b")
        );
        assert!(valid_zone("eu-1.b_2") && !valid_zone("") && !valid_zone("a/b"));
        o.draining.store(true, Ordering::SeqCst);
        let range = json!({ "kvs": [{
            "key": B64.encode("/f/spaces/http://a:1"),
            "value": B64.encode(o.announcement()),
        }] });
        let read = &spaces_in("e", "/f/spaces/", &range).unwrap()[0];
        assert!(read.draining && read.zone.as_deref() == Some("eu-1.b"));
        assert!(!valid_zone(&"z".repeat(65)));
    }

    #[test]
    fn a_prefix_ends_where_its_keys_do() {
        assert_eq!(prefix_end("/ferry/moves/a/"), b"/ferry/moves/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
        assert_eq!(prefix_end(""), vec![0]);
    }

    #[test]
    fn answers_are_read_as_etcd_writes_them() {
        let owner = B64.encode(br#"{"space":"http://a:1","epoch":3}"#);
        let range = json!({ "kvs": [{ "key": "eA==", "mod_revision": "17", "value": owner }] });
        assert_eq!(
            owned_in("e", &range).unwrap(),
            Some(Owned {
                owner: Owner {
                    space: "http://a:1".into(),
                    epoch: 3
                },
                revision: 17
            })
        );
        assert_eq!(owned_in("e", &json!({ "count": "0" })).unwrap(), None);
        let decided = json!({ "kvs": [{ "mod_revision": "5", "value": B64.encode("aborted") }] });
        assert_eq!(outcome_in("e", &decided).unwrap(), Some(Outcome::Aborted));
        let odd = json!({ "kvs": [{ "mod_revision": "5", "value": B64.encode("maybe") }] });
        assert!(outcome_in("e", &odd).is_err());
        let foreign = json!({ "kvs": [{ "mod_revision": "5", "value": B64.encode("{}") }] });
        assert!(owned_in("e", &foreign).is_err());
        let standby = B64.encode(br#"{"space":"http://b:2","epoch":4}"#);
        let range = json!({ "kvs": [{ "mod_revision": "9", "value": standby }] });
        assert_eq!(
            standby_in("e", &range).unwrap(),
            Some((
                Standby {
                    space: "http://b:2".into(),
                    epoch: 4
                },
                9
            ))
        );
        assert!(standby_in("e", &foreign).is_err());
        assert_eq!(standby_in("e", &json!({})).unwrap(), None);
    }

    #[test]
    fn announced_spaces_are_read_from_their_keys() {
        let kv = |k: &str| json!({ "key": B64.encode(k), "mod_revision": "3", "value": "" });
        let with = |k: &str, v: &str| json!({ "key": B64.encode(format!("/f/spaces/{k}")), "value": B64.encode(v) });
        let range = json!({ "kvs": [
            kv("/f/spaces/http://b:2"),
            kv("/f/spaces/http://a:1"),
            with("http://c:3", r#"{"space":"http://c:3","zone":"rack-1"}"#),
            // Another URL's zone, a name --zone refuses, a bare URL: no zone.
            with("http://d:4", r#"{"space":"http://x:9","zone":"rack-1"}"#),
            with("http://e:5", r#"{"space":"http://e:5","zone":"a b"}"#),
            with("http://f:6", "http://f:6"),
        ] });
        let zoned = |space: &str, zone: Option<&str>| Announced {
            space: space.into(),
            zone: zone.map(str::to_owned),
            draining: false,
        };
        assert_eq!(
            spaces_in("e", "/f/spaces/", &range).unwrap(),
            vec![
                zoned("http://a:1", None),
                zoned("http://b:2", None),
                zoned("http://c:3", Some("rack-1")),
                zoned("http://d:4", None),
                zoned("http://e:5", None),
                zoned("http://f:6", None),
            ]
        );
        assert_eq!(
            spaces_in("e", "/f/spaces/", &json!({})).unwrap(),
            Vec::<Announced>::new()
        );
        let outside = json!({ "kvs": [kv("/g/spaces/http://a:1")] });
        assert!(spaces_in("e", "/f/spaces/", &outside).is_err());
        assert!(spaces_in("e", "/f/spaces/", &json!({ "kvs": [{ "value": "" }] })).is_err());
    }
}
