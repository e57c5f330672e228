//! An S3-compatible object store (AWS S3, MinIO, Ceph's RADOS Gateway, Cloudflare R2, …) as a
//! place for snapshot artifacts: the few calls `ferry export -o s3://…` and `ferry import
//! s3://…` make — `HEAD`, `GET` and `PUT` of whole objects, the `PUT` optionally conditional
//! (`If-None-Match: *`, `If-Match: ETAG`) — and the ones `ferry prune s3://…` adds (a listing
//! of a key prefix, `DELETE`, and a copy of an object onto itself, which makes it new), signed
//! with AWS Signature Version 4 (docs/format.md, "Snapshots in S3 buckets").
//!
//! Where and as whom, from the variables the AWS tools read: `AWS_ENDPOINT_URL_S3` or
//! `AWS_ENDPOINT_URL` (another S3-compatible store, addressed path-style:
//! `ENDPOINT/BUCKET/KEY`; without one, AWS itself, virtual-hosted:
//! `https://BUCKET.s3.REGION.amazonaws.com/KEY`), `AWS_REGION` or `AWS_DEFAULT_REGION`
//! (`us-east-1`), `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and `AWS_SESSION_TOKEN`, else
//! the profile `AWS_PROFILE` (`default`) of the shared credentials file
//! (`AWS_SHARED_CREDENTIALS_FILE`, `~/.aws/credentials`). With no credentials at all the
//! requests go unsigned (a public bucket can be read).
//!
//! What comes back is untrusted: error bodies are read up to 64 KiB, [`Bucket::get_small`]
//! reads at most what it is told, and the callers check every blob against its digest.

use std::io::Read;
use std::path::Path;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

/// What went wrong talking to the bucket.
#[derive(Debug, thiserror::Error)]
pub enum S3Error {
    /// The reference, the endpoint or the credentials are not usable.
    #[error("{0}")]
    Config(String),
    /// The store answered with an error.
    #[error("{what} {url}: {status} {code}{}", if message.is_empty() { String::new() } else { format!(": {message}") })]
    Refused {
        what: &'static str,
        url: String,
        status: u16,
        /// The S3 error code (`NoSuchBucket`, `SignatureDoesNotMatch`, …), or the HTTP reason.
        code: String,
        message: String,
    },
    /// The store could not be reached, or the connection failed.
    #[error("{what} {url}: {reason}")]
    Transport {
        what: &'static str,
        url: String,
        reason: String,
    },
    /// A local file could not be read.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl S3Error {
    /// The S3 error code of a refusal (`NoSuchBucket`, …).
    pub fn code(&self) -> Option<&str> {
        match self {
            S3Error::Refused { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// `s3://BUCKET[/PREFIX]`: a bucket and a key prefix (no leading or trailing `/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Ref {
    pub bucket: String,
    pub prefix: String,
}

impl S3Ref {
    /// `s3://BUCKET[/PREFIX]`; `None` when `s` does not start with `s3://`, an error when
    /// the bucket name is not one S3 accepts (3–63 lowercase letters, digits, `.`, `-`).
    pub fn parse(s: &str) -> Option<Result<Self, S3Error>> {
        let rest = s.strip_prefix("s3://")?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let ok = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'-'))
            && !bucket.starts_with(['.', '-'])
            && !bucket.ends_with(['.', '-']);
        if !ok {
            return Some(Err(S3Error::Config(format!(
                "`{bucket}` in {s} is not an S3 bucket name (3 to 63 lowercase letters, digits, \
                 `.` and `-`)"
            ))));
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|p| p == "." || p == "..") || prefix.contains("//") {
            return Some(Err(S3Error::Config(format!(
                "the key prefix `{prefix}` in {s} has an empty, `.` or `..` part"
            ))));
        }
        Some(Ok(Self {
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
        }))
    }

    /// The key of `name` under the prefix.
    pub fn key(&self, name: &str) -> String {
        match self.prefix.is_empty() {
            true => name.to_owned(),
            false => format!("{}/{name}", self.prefix),
        }
    }
}

impl std::fmt::Display for S3Ref {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.prefix.is_empty() {
            true => write!(f, "s3://{}", self.bucket),
            false => write!(f, "s3://{}/{}", self.bucket, self.prefix),
        }
    }
}

/// Access key, secret and (temporary credentials) session token.
#[derive(Clone)]
pub struct Credentials {
    pub access_key: String,
    pub secret: String,
    pub token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key", &self.access_key)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    /// From the environment, else from the shared credentials file; `None` when neither has
    /// any (requests then go unsigned).
    pub fn from_env() -> Result<Option<Self>, S3Error> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        match (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
            (Some(access_key), Some(secret)) => {
                return Ok(Some(Self {
                    access_key,
                    secret,
                    token: var("AWS_SESSION_TOKEN"),
                }));
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(S3Error::Config(
                    "set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither".into(),
                ));
            }
            (None, None) => {}
        }
        let file = match var("AWS_SHARED_CREDENTIALS_FILE") {
            Some(f) => std::path::PathBuf::from(f),
            None => match var("HOME") {
                Some(h) => Path::new(&h).join(".aws").join("credentials"),
                None => return Ok(None),
            },
        };
        let profile = var("AWS_PROFILE").unwrap_or_else(|| "default".into());
        let text = match std::fs::File::open(&file) {
            Ok(f) => {
                let mut s = String::new();
                f.take(1 << 20)
                    .read_to_string(&mut s)
                    .map_err(|e| S3Error::Config(format!("cannot read {}: {e}", file.display())))?;
                s
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(S3Error::Config(format!(
                    "cannot read {}: {e}",
                    file.display()
                )));
            }
        };
        Self::from_ini(&text, &profile).map(Some).ok_or_else(|| {
            S3Error::Config(format!(
                "{} has no profile `{profile}` with aws_access_key_id and aws_secret_access_key",
                file.display()
            ))
        })
    }

    /// The profile `profile` of a shared credentials file's text.
    fn from_ini(text: &str, profile: &str) -> Option<Self> {
        let mut inside = false;
        let (mut access_key, mut secret, mut token) = (None, None, None);
        for line in text.lines() {
            let line = line.trim();
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                inside = name.trim() == profile;
            } else if let Some((k, v)) = line.split_once('=').filter(|_| inside) {
                let v = Some(v.trim().to_owned());
                match k.trim() {
                    "aws_access_key_id" => access_key = v,
                    "aws_secret_access_key" => secret = v,
                    "aws_session_token" => token = v,
                    _ => {}
                }
            }
        }
        Some(Self {
            access_key: access_key?,
            secret: secret?,
            token,
        })
    }
}

/// An object's content (bytes, or a reader of them) and its ETag, if the store gave one.
pub type Tagged<B> = (B, Option<String>);

/// A condition on a `PUT`.
#[derive(Debug, Clone, Copy)]
pub enum Condition<'a> {
    /// Always written.
    Always,
    /// Only if no object has the key (`If-None-Match: *`).
    Absent,
    /// Only if the object's ETag is still this one (`If-Match`).
    Unchanged(&'a str),
}

/// The body of a `PUT`: bytes, or a file of a known length (read from its start, on each try).
#[derive(Debug, Clone, Copy)]
pub enum Body<'a> {
    Bytes(&'a [u8]),
    File(&'a Path, u64),
}

/// What a `HEAD` of an object says: its length, when it was last written and the store's
/// clock when it answered (both by the store's clock, when it says them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub len: u64,
    pub modified: Option<SystemTime>,
    pub now: Option<SystemTime>,
}

impl Head {
    /// How long ago the object was last written, by the store's clock (else this machine's).
    pub fn age(&self) -> Duration {
        let now = self.now.unwrap_or_else(SystemTime::now);
        self.modified
            .and_then(|m| now.duration_since(m).ok())
            .unwrap_or_default()
    }
}

/// An object of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub key: String,
    pub size: u64,
    /// When it was last written, by the store's clock.
    pub modified: SystemTime,
}

/// Largest page of a listing read (S3 sends at most 1000 objects a page: about 350 KiB).
const MAX_LISTING_PAGE: u64 = 16 << 20;

/// A bucket of an S3-compatible store, with the credentials to use it.
#[derive(Clone)]
pub struct Bucket {
    /// `http://HOST[:PORT]` or `https://…`, no path.
    origin: String,
    /// The `Host` header (and signed host).
    host: String,
    /// `ENDPOINT/BUCKET/KEY` rather than `BUCKET.ENDPOINT/KEY`.
    path_style: bool,
    bucket: String,
    region: String,
    credentials: Option<Credentials>,
    agent: ureq::Agent,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bucket")
            .field("origin", &self.origin)
            .field("bucket", &self.bucket)
            .finish_non_exhaustive()
    }
}

/// SHA-256 of nothing: the payload hash of `GET` and `HEAD`.
const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// Tries of a request the store failed (5xx, `429`, a broken connection) before giving up.
const TRIES: u32 = 4;

impl Bucket {
    /// The bucket `bucket`, reached and signed for as the environment says (module docs).
    pub fn from_env(bucket: &str) -> Result<Self, S3Error> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let region = var("AWS_REGION")
            .or_else(|| var("AWS_DEFAULT_REGION"))
            .unwrap_or_else(|| "us-east-1".into());
        let endpoint = var("AWS_ENDPOINT_URL_S3").or_else(|| var("AWS_ENDPOINT_URL"));
        Self::new(
            bucket,
            endpoint.as_deref(),
            &region,
            Credentials::from_env()?,
        )
    }

    /// The bucket `bucket` at `endpoint` (path-style), or on AWS in `region` (virtual-hosted).
    pub fn new(
        bucket: &str,
        endpoint: Option<&str>,
        region: &str,
        credentials: Option<Credentials>,
    ) -> Result<Self, S3Error> {
        let (origin, host, path_style) = match endpoint {
            Some(e) => {
                let e = e.trim_end_matches('/');
                let host = e
                    .strip_prefix("http://")
                    .or_else(|| e.strip_prefix("https://"))
                    .filter(|h| !h.is_empty() && !h.contains(['/', '?', '#', '@']))
                    .ok_or_else(|| {
                        S3Error::Config(format!(
                            "the S3 endpoint `{e}` is not http://HOST[:PORT] or https://HOST[:PORT]"
                        ))
                    })?;
                (e.to_owned(), host.to_owned(), true)
            }
            None => {
                if !region
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                {
                    return Err(S3Error::Config(format!("`{region}` is not an AWS region")));
                }
                // A bucket name with dots does not fit the wildcard certificate of
                // `*.s3.REGION.amazonaws.com`: path-style for it.
                let dotted = bucket.contains('.');
                let host = match dotted {
                    true => format!("s3.{region}.amazonaws.com"),
                    false => format!("{bucket}.s3.{region}.amazonaws.com"),
                };
                (format!("https://{host}"), host, dotted)
            }
        };
        Ok(Self {
            origin,
            host,
            path_style,
            bucket: bucket.to_owned(),
            region: region.to_owned(),
            credentials,
            agent: crate::client::answering_agent(),
        })
    }

    /// The path of `key` (encoded once, as both the URL and the signature take it).
    fn path(&self, key: &str) -> String {
        let key = uri_encode(key, false);
        match self.path_style {
            true => format!("/{}/{key}", uri_encode(&self.bucket, true)),
            false => format!("/{key}"),
        }
    }

    /// The error answer `r` to a request about `key` stands for.
    fn refused(
        &self,
        what: &'static str,
        key: &str,
        r: ureq::http::Response<ureq::Body>,
    ) -> S3Error {
        refusal(what, &self.name(key), r, self.credentials.is_none())
    }

    /// How `key` is named in messages.
    fn name(&self, key: &str) -> String {
        format!("s3://{}/{key}", self.bucket)
    }

    /// One request about object `key` (the bucket itself if it is empty), with the query
    /// `query`, signed, tried again while the store fails it for a reason that may pass.
    #[allow(clippy::too_many_arguments)]
    fn request(
        &self,
        what: &'static str,
        method: &'static str,
        key: &str,
        query: &[(&str, &str)],
        headers: &[(&'static str, &str)],
        body: Option<(Body<'_>, &str)>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<ureq::http::Response<ureq::Body>, S3Error> {
        let path = match key.is_empty() && self.path_style {
            true => format!("/{}", uri_encode(&self.bucket, true)),
            false => self.path(key),
        };
        let query = canonical_query(query);
        let url = match query.is_empty() {
            true => format!("{}{path}", self.origin),
            false => format!("{}{path}?{query}", self.origin),
        };
        let mut wait = Duration::from_millis(200);
        let mut tried = 0;
        loop {
            tried += 1;
            let payload = body.map_or(EMPTY_SHA256, |(_, sha)| sha);
            let mut all: Vec<(String, String)> = headers
                .iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), (*v).to_owned()))
                .collect();
            if let Some(c) = &self.credentials {
                let now = amz_date(SystemTime::now());
                all.push(("x-amz-date".into(), now.clone()));
                all.push(("x-amz-content-sha256".into(), payload.to_owned()));
                if let Some(t) = &c.token {
                    all.push(("x-amz-security-token".into(), t.clone()));
                }
                let auth = authorization(
                    c,
                    &self.region,
                    (method, &path, &query),
                    &self.host,
                    &all,
                    &now,
                );
                all.push(("authorization".into(), auth));
            }
            let mut req = ureq::http::Request::builder()
                .method(method)
                .uri(&url)
                .header("host", &self.host);
            for (k, v) in &all {
                req = req.header(k.as_str(), v.as_str());
            }
            let sent = match body {
                None => self.run(req.body(ureq::SendBody::none())),
                Some((body, _)) => {
                    let (inner, len): (Box<dyn Read + '_>, u64) = match body {
                        Body::Bytes(b) => (Box::new(b), b.len() as u64),
                        Body::File(p, len) => (Box::new(std::fs::File::open(p)?.take(len)), len),
                    };
                    let mut counted = Counted {
                        inner,
                        read: 0,
                        progress: &mut *progress,
                    };
                    self.run(
                        req.header("content-length", len.to_string())
                            .body(ureq::SendBody::from_reader(&mut counted)),
                    )
                }
            };
            let again = match sent {
                Ok(r) if r.status().is_server_error() || r.status().as_u16() == 429 => {
                    Err(self.refused(what, key, r))
                }
                Ok(r) => return Ok(r),
                Err(reason) => Err(S3Error::Transport {
                    what,
                    url: self.name(key),
                    reason: crate::tls::explain(reason),
                }),
            };
            if tried >= TRIES {
                return again;
            }
            if let Err(e) = again {
                // Said with -v: a request that fails in the end is said by its caller.
                tracing::info!("{e}; trying again in {} ms", wait.as_millis());
            }
            std::thread::sleep(wait);
            wait *= 2;
        }
    }

    /// Sends the request built (a failure to build or send, as text).
    fn run(
        &self,
        r: Result<ureq::http::Request<ureq::SendBody<'_>>, ureq::http::Error>,
    ) -> Result<ureq::http::Response<ureq::Body>, String> {
        r.map_err(|e| e.to_string())
            .and_then(|r| self.agent.run(r).map_err(|e| e.to_string()))
    }

    /// What the store says of object `key`, or `None` if there is none.
    pub fn head(&self, key: &str) -> Result<Option<Head>, S3Error> {
        let r = self.request("cannot look up", "HEAD", key, &[], &[], None, &mut |_| {})?;
        match r.status().as_u16() {
            404 => Ok(None),
            s if (200..300).contains(&s) => Ok(Some(Head {
                len: r
                    .headers()
                    .get("content-length")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
                modified: header_time(&r, "last-modified"),
                now: header_time(&r, "date"),
            })),
            _ => Err(self.refused("cannot look up", key, r)),
        }
    }

    /// The objects whose keys start with `prefix`, in key order, and the store's clock when
    /// it listed them (its `Date`, if it said one); refused past `limit` objects.
    pub fn list(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<(Vec<Listed>, Option<SystemTime>), S3Error> {
        let mut all = Vec::new();
        let mut token: Option<String> = None;
        let mut now = None;
        loop {
            let mut query = vec![("list-type", "2"), ("prefix", prefix)];
            if let Some(t) = &token {
                query.push(("continuation-token", t.as_str()));
            }
            let what = "cannot list";
            let r = self.request(what, "GET", "", &query, &[], None, &mut |_| {})?;
            if !r.status().is_success() {
                return Err(self.refused(what, prefix, r));
            }
            if now.is_none() {
                now = header_time(&r, "date");
            }
            let mut text = String::new();
            r.into_body()
                .into_reader()
                .take(MAX_LISTING_PAGE + 1)
                .read_to_string(&mut text)
                .map_err(|e| S3Error::Transport {
                    what,
                    url: self.name(prefix),
                    reason: e.to_string(),
                })?;
            if text.len() as u64 > MAX_LISTING_PAGE {
                return Err(self.malformed(prefix, "a page of the listing is over 16 MiB"));
            }
            let (objects, next) = listing_page(&text).map_err(|why| self.malformed(prefix, why))?;
            all.extend(objects);
            if all.len() > limit {
                return Err(S3Error::Config(format!(
                    "{} holds over {limit} objects",
                    self.name(prefix)
                )));
            }
            match next {
                Some(t) => token = Some(t),
                None => return Ok((all, now)),
            }
        }
    }

    /// Deletes object `key` (done too if there was none).
    pub fn delete(&self, key: &str) -> Result<(), S3Error> {
        let r = self.request("cannot delete", "DELETE", key, &[], &[], None, &mut |_| {})?;
        match r.status().as_u16() {
            404 => Ok(()),
            s if (200..300).contains(&s) => Ok(()),
            _ => Err(self.refused("cannot delete", key, r)),
        }
    }

    /// Makes object `key` new — its last-modified time now — by copying it onto itself on the
    /// store (no byte goes through here); `false` if there is no such object.
    pub fn touch(&self, key: &str) -> Result<bool, S3Error> {
        let what = "cannot copy";
        let source = format!("/{}/{}", self.bucket, uri_encode(key, false));
        let r = self.request(
            what,
            "PUT",
            key,
            &[],
            &[
                ("x-amz-copy-source", &source),
                ("x-amz-metadata-directive", "REPLACE"),
            ],
            Some((Body::Bytes(&[]), EMPTY_SHA256)),
            &mut |_| {},
        )?;
        if r.status().as_u16() == 404 {
            return Ok(false);
        }
        if !r.status().is_success() {
            return Err(self.refused(what, key, r));
        }
        // A copy can fail after its `200` has been sent: the error is then in the body.
        let status = r.status();
        let text = body_text(r);
        match text.contains("<Error>") {
            true => Err(refused_with(what, &self.name(key), status, &text, false)),
            false => Ok(true),
        }
    }

    /// An answer about `key` that is not what S3 answers.
    fn malformed(&self, key: &str, why: &str) -> S3Error {
        S3Error::Transport {
            what: "cannot list",
            url: self.name(key),
            reason: format!("the store's answer is malformed: {why}"),
        }
    }

    /// Object `key` read whole if it is at most `limit` bytes, with its ETag; `None` if there
    /// is none.
    pub fn get_small(&self, key: &str, limit: u64) -> Result<Option<Tagged<Vec<u8>>>, S3Error> {
        let Some((mut body, etag)) = self.get(key)? else {
            return Ok(None);
        };
        let mut bytes = Vec::new();
        (&mut body)
            .take(limit + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| S3Error::Transport {
                what: "cannot read",
                url: self.name(key),
                reason: e.to_string(),
            })?;
        if bytes.len() as u64 > limit {
            return Err(S3Error::Config(format!(
                "{} is over {limit} bytes",
                self.name(key)
            )));
        }
        Ok(Some((bytes, etag)))
    }

    /// A reader of object `key` (and its ETag); `None` if there is none (an error if the
    /// bucket is not there).
    pub fn get(&self, key: &str) -> Result<Option<Tagged<Box<dyn Read + Send>>>, S3Error> {
        let r = self.request("cannot read", "GET", key, &[], &[], None, &mut |_| {})?;
        match r.status().as_u16() {
            404 => match self.refused("cannot read", key, r) {
                e @ S3Error::Refused { .. } if e.code() == Some("NoSuchBucket") => Err(e),
                _ => Ok(None),
            },
            s if (200..300).contains(&s) => {
                let etag = r
                    .headers()
                    .get("etag")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let reader = Resuming {
                    bucket: self.clone(),
                    key: key.to_owned(),
                    etag: etag.clone(),
                    read: 0,
                    inner: Box::new(r.into_body().into_reader()),
                    tries: 1,
                };
                Ok(Some((Box::new(reader), etag)))
            }
            _ => Err(self.refused("cannot read", key, r)),
        }
    }

    /// Writes object `key` (its SHA-256 `sha256`, hex, which the store checks) if
    /// `condition` holds; `false` if it did not (`412`). `progress` is told the bytes of a
    /// file sent so far.
    pub fn put(
        &self,
        key: &str,
        body: Body<'_>,
        sha256: &str,
        condition: Condition<'_>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<bool, S3Error> {
        Ok(self
            .put_tagged(key, body, sha256, condition, progress)?
            .is_some())
    }

    /// [`Bucket::put`], telling the ETag the store gave the object written (`Some(None)`
    /// if it gave none); `None` if `condition` did not hold.
    pub fn put_tagged(
        &self,
        key: &str,
        body: Body<'_>,
        sha256: &str,
        condition: Condition<'_>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Option<Option<String>>, S3Error> {
        let headers: &[(&'static str, &str)] = match condition {
            Condition::Always => &[],
            Condition::Absent => &[("if-none-match", "*")],
            Condition::Unchanged(etag) => &[("if-match", etag)],
        };
        let r = self.request(
            "cannot write",
            "PUT",
            key,
            &[],
            headers,
            Some((body, sha256)),
            progress,
        )?;
        match r.status().as_u16() {
            412 => Ok(None),
            s if (200..300).contains(&s) => Ok(Some(
                r.headers()
                    .get("etag")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
            )),
            _ => Err(self.refused("cannot write", key, r)),
        }
    }
}

/// The body of a `GET`, which goes on where it broke: when the connection fails mid-body, the
/// rest is asked for (`Range: bytes=READ-`, `If-Match` the ETag first given, so that it is
/// the same object), up to [`TRIES`] times in all.
struct Resuming {
    bucket: Bucket,
    key: String,
    /// Without one, the rest cannot be told to be of the same object: not asked for.
    etag: Option<String>,
    read: u64,
    inner: Box<dyn Read + Send>,
    tries: u32,
}

impl Resuming {
    /// The rest of the object, from byte `self.read`.
    fn rest(&self, etag: &str) -> std::io::Result<Box<dyn Read + Send>> {
        let what = "cannot read";
        let range = format!("bytes={}-", self.read);
        let r = self
            .bucket
            .request(
                what,
                "GET",
                &self.key,
                &[],
                &[("range", &range), ("if-match", etag)],
                None,
                &mut |_| {},
            )
            .map_err(std::io::Error::other)?;
        match r.status().as_u16() {
            206 => Ok(Box::new(r.into_body().into_reader())),
            // The store ignored the range: the bytes already read are skipped.
            200 => {
                let mut body = r.into_body().into_reader();
                std::io::copy(&mut (&mut body).take(self.read), &mut std::io::sink())?;
                Ok(Box::new(body))
            }
            412 => Err(std::io::Error::other(format!(
                "{} changed while it was read",
                self.bucket.name(&self.key)
            ))),
            _ => Err(std::io::Error::other(
                self.bucket.refused(what, &self.key, r),
            )),
        }
    }
}

impl Read for Resuming {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            match self.inner.read(buf) {
                Ok(n) => {
                    self.read += n as u64;
                    return Ok(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let Some(etag) = self.etag.clone().filter(|_| self.tries < TRIES) else {
                        return Err(e);
                    };
                    self.tries += 1;
                    tracing::warn!(
                        "reading {} broke after {} bytes ({e}); asking for the rest",
                        self.bucket.name(&self.key),
                        self.read
                    );
                    std::thread::sleep(Duration::from_millis(100 << self.tries));
                    self.inner = self.rest(&etag)?;
                }
            }
        }
    }
}

/// The time the HTTP date header `name` of answer `r` gives (`Date`, `Last-Modified`).
fn header_time(r: &ureq::http::Response<ureq::Body>, name: &str) -> Option<SystemTime> {
    let v = r.headers().get(name)?.to_str().ok()?;
    httpdate::parse_http_date(v).ok()
}

/// Hex SHA-256 of `bytes`: the payload hash a `PUT` of them is signed with.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Counts what passes through to `progress`.
struct Counted<'a, R> {
    inner: R,
    read: u64,
    progress: &'a mut dyn FnMut(u64),
}

impl<R: Read> Read for Counted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        (self.progress)(self.read);
        Ok(n)
    }
}

/// The error an answer of status `>= 300` stands for: its S3 error code and message when the
/// body is an S3 error document (read up to 64 KiB).
/// Said of a request that went unsigned (`unsigned`) and was refused access: why.
fn refusal(
    what: &'static str,
    url: &str,
    r: ureq::http::Response<ureq::Body>,
    unsigned: bool,
) -> S3Error {
    let status = r.status();
    refused_with(what, url, status, &body_text(r), unsigned)
}

/// Up to 64 KiB of the body of answer `r`, as text (what could not be read left out).
fn body_text(r: ureq::http::Response<ureq::Body>) -> String {
    let mut text = String::new();
    let _ = r
        .into_body()
        .into_reader()
        .take(64 << 10)
        .read_to_string(&mut text);
    text
}

/// [`refusal`] of an answer of status `status` whose body, read, is `text`.
fn refused_with(
    what: &'static str,
    url: &str,
    status: ureq::http::StatusCode,
    text: &str,
    unsigned: bool,
) -> S3Error {
    let element = |name: &str| element(text, name).map(unescape);
    S3Error::Refused {
        what,
        url: url.to_owned(),
        status: status.as_u16(),
        code: element("Code")
            .unwrap_or_else(|| status.canonical_reason().unwrap_or("error").to_owned()),
        message: match (unsigned && status.as_u16() == 403, element("Message")) {
            (true, m) => format!(
                "{}no credentials were given (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or \
                 ~/.aws/credentials), so the request went unsigned",
                m.map(|m| format!("{m}; ")).unwrap_or_default()
            ),
            (false, m) => m.unwrap_or_default(),
        },
    }
}

/// The query `query` as SigV4 signs it (and as it is sent): `KEY=VALUE` pairs, both
/// percent-encoded, sorted, joined by `&`.
fn canonical_query(query: &[(&str, &str)]) -> String {
    let mut pairs: Vec<String> = query
        .iter()
        .map(|(k, v)| format!("{}={}", uri_encode(k, true), uri_encode(v, true)))
        .collect();
    pairs.sort();
    pairs.join("&")
}

/// The objects of a `ListObjectsV2` page, and its continuation token if the listing goes on;
/// what is wrong with it if it is malformed.
fn listing_page(text: &str) -> Result<(Vec<Listed>, Option<String>), &'static str> {
    let mut objects = Vec::new();
    for object in elements(text, "Contents") {
        let field = |name| element(object, name).map(unescape);
        let (Some(key), Some(size), Some(modified)) = (
            field("Key"),
            field("Size").and_then(|s| s.parse().ok()),
            field("LastModified").and_then(|t| parse_iso8601(&t)),
        ) else {
            return Err("an object of the listing lacks its key, size or time");
        };
        objects.push(Listed {
            key,
            size,
            modified,
        });
    }
    match element(text, "IsTruncated").as_deref() {
        Some("true") => match element(text, "NextContinuationToken") {
            Some(t) => Ok((objects, Some(unescape(t)))),
            None => Err("a cut listing names no next page"),
        },
        _ => Ok((objects, None)),
    }
}

/// Feeds `data` to the readers of what an S3 store answers (a listing page, an error
/// document, a time): the fuzzing entry point's share of this module ([`crate::fuzz_inputs`]).
pub fn fuzz_answers(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = listing_page(text);
        let _ = element(text, "Code").map(unescape);
        let _ = parse_iso8601(text);
    }
}

/// The text inside each `<name>…</name>` of `text`, in order (no nesting of `name`).
fn elements<'a>(text: &'a str, name: &str) -> impl Iterator<Item = &'a str> {
    let (open, close) = (format!("<{name}>"), format!("</{name}>"));
    let mut rest = text;
    std::iter::from_fn(move || {
        let start = rest.find(&open)? + open.len();
        let len = rest[start..].find(&close)?;
        let inside = &rest[start..start + len];
        rest = &rest[start + len + close.len()..];
        Some(inside)
    })
}

/// The text of the first `<name>…</name>` of `text`, trimmed (XML escapes left as they are).
fn element(text: &str, name: &str) -> Option<String> {
    elements(text, name).next().map(|t| t.trim().to_owned())
}

/// XML text with its escapes (`&amp;`, `&lt;`, `&#NN;`, …) replaced.
fn unescape(text: impl AsRef<str>) -> String {
    let text = text.as_ref();
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        let Some(end) = rest.find(';').filter(|&e| e <= 10) else {
            out.push('&');
            rest = &rest[1..];
            continue;
        };
        let entity = &rest[1..end];
        let c = match entity {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            _ => entity
                .strip_prefix("#x")
                .map(|h| u32::from_str_radix(h, 16))
                .or_else(|| entity.strip_prefix('#').map(str::parse))
                .and_then(Result::ok)
                .and_then(char::from_u32),
        };
        match c {
            Some(c) => {
                out.push(c);
                rest = &rest[end + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// `YYYY-MM-DDTHH:MM:SS[.fff]Z`, as S3 lists times, as a time.
fn parse_iso8601(t: &str) -> Option<SystemTime> {
    let t = t.strip_suffix('Z')?;
    let (date, time) = t.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (d.next()??, d.next()??, d.next()??);
    let time = time.split_once('.').map_or(time, |(whole, _)| whole);
    let mut h = time.splitn(3, ':').map(|p| p.parse::<u64>().ok());
    let (hour, minute, second) = (h.next()??, h.next()??, h.next()??);
    if !(1..=9999).contains(&year)
        || !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    // Days since 1970-01-01 from a civil date (Howard Hinnant's `days_from_civil`).
    let y = year - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = u64::try_from(era * 146_097 + doe - 719_468).ok()?;
    Some(
        SystemTime::UNIX_EPOCH
            + Duration::from_secs(days * 86_400 + hour * 3600 + minute * 60 + second),
    )
}

/// Percent-encoding as SigV4 wants it: all but `A-Z a-z 0-9 - _ . ~` (and `/` unless
/// `slash`) as `%XX`, upper case.
fn uri_encode(s: &str, slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            b'/' if !slash => out.push('/'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// `YYYYMMDDTHHMMSSZ` of `t` (UTC).
fn amz_date(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's `civil_from_days`).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

fn hmac(key: &[u8], data: &str) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    ring::hmac::sign(&key, data.as_bytes()).as_ref().to_vec()
}

/// The `Authorization` header of request `(method, path, query)` (path encoded, query
/// canonical) to `host` with the lower-case `headers` (`x-amz-date` = `now` and
/// `x-amz-content-sha256` among them), all of them signed, `host` too.
fn authorization(
    c: &Credentials,
    region: &str,
    (method, path, query): (&str, &str, &str),
    host: &str,
    headers: &[(String, String)],
    now: &str,
) -> String {
    let mut signed: Vec<(&str, String)> = headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str(),
                v.split_whitespace().collect::<Vec<_>>().join(" "),
            )
        })
        .collect();
    signed.push(("host", host.to_owned()));
    signed.sort();
    let names = signed.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(";");
    let canonical_headers: String = signed.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
    let payload = headers
        .iter()
        .find(|(k, _)| k == "x-amz-content-sha256")
        .map_or(EMPTY_SHA256, |(_, v)| v.as_str());
    let request = format!("{method}\n{path}\n{query}\n{canonical_headers}\n{names}\n{payload}");
    let day = &now[..8];
    let scope = format!("{day}/{region}/s3/aws4_request");
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{now}\n{scope}\n{}",
        sha256_hex(request.as_bytes())
    );
    let mut key = hmac(format!("AWS4{}", c.secret).as_bytes(), day);
    for part in [region, "s3", "aws4_request"] {
        key = hmac(&key, part);
    }
    format!(
        "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={names}, Signature={}",
        c.access_key,
        hex::encode(hmac(&key, &to_sign))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> Credentials {
        Credentials {
            access_key: "AKIAIOSFODNN7EXAMPLE".into(),
            secret: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            token: None,
        }
    }

    fn h(k: &str, v: &str) -> (String, String) {
        (k.into(), v.into())
    }

    /// The example of AWS's S3 documentation ("Signature calculations for the Authorization
    /// header: transferring payload in a single chunk", GET object), whose signature botocore
    /// computes the same.
    #[test]
    fn signs_as_the_aws_documentation_example() {
        let now = "20130524T000000Z";
        let auth = authorization(
            &example(),
            "us-east-1",
            ("GET", "/test.txt", ""),
            "examplebucket.s3.amazonaws.com",
            &[
                h("range", "bytes=0-9"),
                h("x-amz-content-sha256", EMPTY_SHA256),
                h("x-amz-date", now),
            ],
            now,
        );
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, \
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, \
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
    }

    /// Listings, signed with their query: AWS's documentation example ("GET Bucket (List
    /// Objects)") and a path-style `ListObjectsV2` page with a continuation token that needs
    /// encoding, both as botocore 1.44 (`S3SigV4Auth`) signs them.
    #[test]
    fn signs_listings_with_their_query() {
        let now = "20130524T000000Z";
        let sign = |path: &str, query: &[(&str, &str)], host: &str| {
            authorization(
                &example(),
                "us-east-1",
                ("GET", path, &canonical_query(query)),
                host,
                &[
                    h("x-amz-content-sha256", EMPTY_SHA256),
                    h("x-amz-date", now),
                ],
                now,
            )
        };
        let signature = |auth: String| auth.rsplit_once('=').unwrap().1.to_owned();
        assert_eq!(
            signature(sign(
                "/",
                &[("max-keys", "2"), ("prefix", "J")],
                "examplebucket.s3.amazonaws.com"
            )),
            "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"
        );
        assert_eq!(
            signature(sign(
                "/my-bucket",
                &[
                    ("list-type", "2"),
                    ("prefix", "snaps/blobs/sha256/"),
                    ("continuation-token", "a+b=="),
                ],
                "127.0.0.1:5055"
            )),
            "2bab18a5e13f12a219c06bf8da1a0890aa829457b17653743cd3ac596f62366c"
        );
    }

    /// A `ListObjectsV2` page as S3 writes it: keys (escaped), sizes and times read back.
    #[test]
    fn listing_pages_are_read() {
        let page = r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name>
<Prefix>p/</Prefix><KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>
<NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>
<Contents><Key>p/a&amp;b&#x20;c</Key><LastModified>2026-12-07T20:22:10.000Z</LastModified>
<ETag>&quot;x&quot;</ETag><Size>42</Size><StorageClass>STANDARD</StorageClass></Contents>
<Contents><Key>p/z</Key><LastModified>1970-01-02T00:00:01Z</LastModified><Size>0</Size></Contents>
</ListBucketResult>"#;
        let objects: Vec<_> = elements(page, "Contents").collect();
        assert_eq!(objects.len(), 2);
        assert_eq!(
            element(objects[0], "Key").map(unescape).as_deref(),
            Some("p/a&b c")
        );
        assert_eq!(element(objects[0], "Size").as_deref(), Some("42"));
        assert_eq!(
            element(page, "NextContinuationToken").as_deref(),
            Some("1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=")
        );
        let t = parse_iso8601("2026-12-07T20:22:10.000Z").unwrap();
        assert_eq!(amz_date(t), "20261207T202210Z");
        assert_eq!(
            parse_iso8601("1970-01-02T00:00:01Z"),
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(86_401))
        );
        assert_eq!(
            amz_date(parse_iso8601("2000-02-29T23:59:59Z").unwrap()),
            "20000229T235959Z"
        );
        for bad in [
            "2026-13-01T00:00:00Z",
            "2026-12-07 20:22:10Z",
            "2026-12-07T20:22:10",
            "x",
        ] {
            assert_eq!(parse_iso8601(bad), None, "{bad}");
        }
        assert_eq!(unescape("a &unknown; &amp"), "a &unknown; &amp");
        assert_eq!(
            canonical_query(&[("b", "1 2"), ("a", "x/y")]),
            "a=x%2Fy&b=1%202"
        );
    }

    /// A path-style, conditional `PUT` with a session token and a key that needs encoding, as
    /// botocore 1.4x (`S3SigV4Auth`) signs it.
    #[test]
    fn signs_a_conditional_put_as_botocore_does() {
        let now = "20130524T000000Z";
        let c = Credentials {
            token: Some("TOKEN/x+y=".into()),
            ..example()
        };
        let b = Bucket::new(
            "ferry-test",
            Some("http://127.0.0.1:5055"),
            "us-east-1",
            None,
        )
        .expect("bucket");
        let path = b.path("snaps/blobs/sha256/ab c");
        assert_eq!(path, "/ferry-test/snaps/blobs/sha256/ab%20c");
        let auth = authorization(
            &c,
            "us-east-1",
            ("PUT", &path, ""),
            "127.0.0.1:5055",
            &[
                h("if-none-match", "*"),
                h("x-amz-date", now),
                h("x-amz-content-sha256", &sha256_hex(b"hello")),
                h("x-amz-security-token", "TOKEN/x+y="),
            ],
            now,
        );
        assert!(
            auth.ends_with(
                "SignedHeaders=host;if-none-match;x-amz-content-sha256;x-amz-date;\
                 x-amz-security-token, \
                 Signature=018bcd8584ed13cfaf075373c00786e4a2b8de6370eedba3c3a4bb989b146ccb"
            ),
            "{auth}"
        );
    }

    #[test]
    fn dates_are_utc_calendar_dates() {
        let at = |s: u64| amz_date(SystemTime::UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!(at(0), "19700101T000000Z");
        assert_eq!(at(1_369_353_600), "20130524T000000Z");
        assert_eq!(at(951_782_400 + 3661), "20000229T010101Z");
        assert_eq!(at(4_102_444_799), "20991231T235959Z");
        assert_eq!(at(4_107_542_400), "21000301T000000Z");
    }

    #[test]
    fn references_and_endpoints() {
        let p = |s: &str| S3Ref::parse(s).map(|r| r.map_err(|e| e.to_string()));
        assert_eq!(p("oci:x"), None);
        assert_eq!(
            p("s3://my-bucket/a/b/"),
            Some(Ok(S3Ref {
                bucket: "my-bucket".into(),
                prefix: "a/b".into()
            }))
        );
        let only = S3Ref::parse("s3://my.bucket").expect("s3").expect("valid");
        assert_eq!(only.key("index.json"), "index.json");
        assert_eq!(only.to_string(), "s3://my.bucket");
        for bad in [
            "s3://",
            "s3://ab",
            "s3://My-Bucket/x",
            "s3://-ab/x",
            "s3://abc/../x",
        ] {
            assert!(matches!(p(bad), Some(Err(_))), "{bad}");
        }
        let aws = Bucket::new("abc", None, "eu-west-3", None).expect("aws");
        assert_eq!(
            (aws.origin.as_str(), aws.path("k")),
            ("https://abc.s3.eu-west-3.amazonaws.com", "/k".to_owned())
        );
        let dotted = Bucket::new("a.b.c", None, "eu-west-3", None).expect("aws");
        assert_eq!(dotted.path("k"), "/a.b.c/k");
        assert!(Bucket::new("abc", Some("ftp://x"), "r", None).is_err());
        assert!(Bucket::new("abc", Some("http://x/path"), "r", None).is_err());
    }

    #[test]
    fn credentials_from_a_profile() {
        let text = "[default]\naws_access_key_id = A\naws_secret_access_key=S\n\n[other]\n\
                    aws_access_key_id=B\naws_secret_access_key = T\naws_session_token = X\n";
        let d = Credentials::from_ini(text, "default").expect("default");
        assert_eq!((d.access_key.as_str(), d.secret.as_str()), ("A", "S"));
        assert!(d.token.is_none());
        let o = Credentials::from_ini(text, "other").expect("other");
        assert_eq!(o.token.as_deref(), Some("X"));
        assert!(Credentials::from_ini(text, "none").is_none());
    }
}
