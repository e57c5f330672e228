//! Snapshots as OCI artifacts: `ferry export κ -o oci:DIR[:TAG]` writes an OCI image layout
//! (the directory form of the OCI image specification) holding the snapshot as capsules, one
//! layer each — the program, shared by every snapshot of it, the memory region by region
//! and the mounted files group by group (what did not change is the same layer), then the
//! state — and
//! `ferry import oci:DIR[:TAG]` reads one back. Tools that move OCI content
//! (`skopeo copy`, `oras`, `crane`) carry such a layout to and from any container registry —
//! the way checkpoint images are shipped today — with their own transport and credentials
//! (docs/format.md, "Snapshots in OCI registries").
//!
//! The same layout can live in an S3-compatible bucket instead of a directory: `ferry export
//! κ -o s3://BUCKET/PREFIX[:TAG]` writes it under the key prefix (a layer the bucket already
//! holds is not sent again) and `ferry import s3://BUCKET/PREFIX[:TAG]` reads it back
//! ([`ferry_space::s3`] says where the bucket is and how requests are signed).
//!
//! The layout is untrusted on import: every file is bounded before it is read, every digest
//! must be a SHA-256 of 64 hex digits (it becomes a file name) and must match the bytes, and
//! the capsule inside is checked as any capsule is.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use ferry_space::s3::{Body, Bucket, Condition, Head, Listed, S3Ref, sha256_hex};
use ferry_store::capsule::CapsuleStats;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// The media type of the layer: a ferry capsule (docs/format.md, "Capsules").
pub const CAPSULE_MEDIA_TYPE: &str = "application/vnd.ferry.capsule.v1";
/// The artifact type of the manifest.
pub const ARTIFACT_TYPE: &str = "application/vnd.ferry.snapshot.v1";
const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
/// The OCI empty descriptor's content (`{}`), the config of an artifact.
const EMPTY_MEDIA_TYPE: &str = "application/vnd.oci.empty.v1+json";
const EMPTY: &[u8] = b"{}";
const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// The annotation naming the snapshot the capsule holds.
pub const SNAPSHOT_ANNOTATION: &str = "dev.ferry.snapshot";
/// Largest `index.json`, `oci-layout` or manifest read.
const MAX_JSON: u64 = 4 << 20;

/// Where a layout lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// A directory (`oci:DIR`).
    Dir(PathBuf),
    /// A key prefix of an S3-compatible bucket (`s3://BUCKET/PREFIX`).
    Bucket(S3Ref),
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Dir(d) => write!(f, "{}", d.display()),
            Place::Bucket(b) => write!(f, "{b}"),
        }
    }
}

/// `oci:DIR[:TAG]`, as `skopeo` writes it, or `s3://BUCKET[/PREFIX][:TAG]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OciRef {
    pub place: Place,
    pub tag: Option<String>,
}

impl OciRef {
    /// `oci:DIR[:TAG]` or `s3://BUCKET[/PREFIX][:TAG]`; `None` for anything else (a plain
    /// file name), an error for an `s3://` reference that names no valid bucket.
    pub fn parse(s: &std::ffi::OsStr) -> Option<Result<Self>> {
        let s = s.to_str()?;
        // The tag is what follows the last colon, unless that part holds a `/` (a path).
        let split = |s: &str| match s.rsplit_once(':') {
            Some((d, t)) if !t.contains('/') && !d.is_empty() && !d.ends_with(':') => {
                (d.to_owned(), Some(t.to_owned()))
            }
            _ => (s.to_owned(), None),
        };
        if let Some(rest) = s.strip_prefix("oci:") {
            let (dir, tag) = split(rest);
            return Some(Ok(Self {
                place: Place::Dir(PathBuf::from(dir)),
                tag,
            }));
        }
        s.strip_prefix("s3://")?;
        let (place, tag) = split(s);
        Some(
            S3Ref::parse(&place)
                .expect("an s3:// reference")
                .map(|b| Self {
                    place: Place::Bucket(b),
                    tag,
                })
                .map_err(anyhow::Error::from),
        )
    }

    /// As it is written on a command line: `oci:DIR[:TAG]` or `s3://BUCKET/PREFIX[:TAG]`.
    pub fn name(&self) -> String {
        let tag = self
            .tag
            .as_deref()
            .map(|t| format!(":{t}"))
            .unwrap_or_default();
        match &self.place {
            Place::Dir(d) => format!("oci:{}{tag}", d.display()),
            Place::Bucket(b) => format!("{b}{tag}"),
        }
    }

    /// [`OciRef::name`] without the tag: the layout, as `--export-to` takes it.
    pub fn layout_name(&self) -> String {
        OciRef {
            place: self.place.clone(),
            tag: None,
        }
        .name()
    }

    /// How it is described to the user, with its tag `tag`.
    pub fn describe(&self, tag: &str) -> String {
        match &self.place {
            Place::Dir(d) => format!("the OCI layout {}, tag `{tag}`", d.display()),
            Place::Bucket(b) => format!("the OCI layout in {b}, tag `{tag}`"),
        }
    }
}

pub mod lease;
pub use lease::{TagLease, await_lease};

/// A JSON file of a layout: its bytes, what they say, and its ETag (in a bucket).
type Json = (Vec<u8>, Value, Option<String>);

/// A layout opened for reading or writing: a directory, or a bucket and the prefix in it.
enum Layout {
    Dir(PathBuf),
    Bucket(Box<Bucket>, S3Ref),
}

impl Layout {
    fn open(place: &Place) -> Result<Self> {
        Ok(match place {
            Place::Dir(d) => Layout::Dir(d.clone()),
            Place::Bucket(r) => Layout::Bucket(Box::new(Bucket::from_env(&r.bucket)?), r.clone()),
        })
    }

    /// How the layout is named in messages.
    fn place(&self) -> String {
        match self {
            Layout::Dir(d) => d.display().to_string(),
            Layout::Bucket(_, r) => r.to_string(),
        }
    }

    /// How file `name` of the layout is named in messages.
    fn name(&self, name: &str) -> String {
        match self {
            Layout::Dir(d) => d.join(name).display().to_string(),
            Layout::Bucket(_, r) => format!("s3://{}/{}", r.bucket, r.key(name)),
        }
    }

    /// The JSON file `name` of the layout (at most [`MAX_JSON`] bytes) and, in a bucket, its
    /// ETag; `None` if it is not there.
    fn read_json(&self, name: &str) -> Result<Option<Json>> {
        let (bytes, etag) = match self {
            Layout::Dir(d) => {
                let path = d.join(name);
                let f = match std::fs::File::open(&path) {
                    Ok(f) => f,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(e) => {
                        return Err(e).with_context(|| format!("cannot open {}", path.display()));
                    }
                };
                let mut bytes = Vec::new();
                f.take(MAX_JSON + 1)
                    .read_to_end(&mut bytes)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                (bytes, None)
            }
            Layout::Bucket(b, r) => match b.get_small(&r.key(name), MAX_JSON) {
                Ok(Some(got)) => got,
                Ok(None) => return Ok(None),
                Err(e) => return Err(e.into()),
            },
        };
        if bytes.len() as u64 > MAX_JSON {
            bail!("{} is over {} MiB", self.name(name), MAX_JSON >> 20);
        }
        let v = serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not JSON", self.name(name)))?;
        Ok(Some((bytes, v, etag)))
    }

    /// [`Layout::read_json`] of a file that must be there.
    fn need_json(&self, name: &str) -> Result<(Vec<u8>, Value)> {
        match self.read_json(name)? {
            Some((bytes, v, _)) => Ok((bytes, v)),
            None => bail!("{} is not there", self.name(name)),
        }
    }

    /// Writes the small file `name` if `condition` holds (a directory has no conditions:
    /// written through a temporary file, durably); `false` if it did not.
    fn write_small(&self, name: &str, bytes: &[u8], condition: Condition<'_>) -> Result<bool> {
        Ok(self.write_small_tagged(name, bytes, condition)?.is_some())
    }

    /// [`Layout::write_small`], telling the ETag of what was written (in a bucket); `None`
    /// if `condition` did not hold.
    fn write_small_tagged(
        &self,
        name: &str,
        bytes: &[u8],
        condition: Condition<'_>,
    ) -> Result<Option<Option<String>>> {
        match self {
            Layout::Dir(d) => {
                let path = d.join(name);
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)
                        .with_context(|| format!("cannot create {}", parent.display()))?;
                }
                write_atomic(&path, bytes)?;
                Ok(Some(None))
            }
            Layout::Bucket(b, r) => Ok(b.put_tagged(
                &r.key(name),
                Body::Bytes(bytes),
                &sha256_hex(bytes),
                condition,
                &mut |_| {},
            )?),
        }
    }

    /// In a directory, an exclusive lock on its `index.json` (on `.ferry-index.lock`, held
    /// until dropped): a directory has no conditional writes, so ferry processes changing
    /// the index take turns (a bucket's writes are conditional instead: `None`).
    fn lock_index(&self) -> Result<Option<std::fs::File>> {
        let Layout::Dir(d) = self else {
            return Ok(None);
        };
        let path = d.join(".ferry-index.lock");
        let file = std::fs::File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .and_then(|f| f.lock().map(|()| f))
            .with_context(|| format!("cannot lock {}", path.display()))?;
        Ok(Some(file))
    }

    /// `oci-layout` checked, or written where there is none.
    fn start(&self) -> Result<()> {
        if let Layout::Dir(d) = self {
            let blobs = d.join("blobs").join("sha256");
            std::fs::create_dir_all(&blobs)
                .with_context(|| format!("cannot create {}", blobs.display()))?;
        }
        match self.read_json("oci-layout")? {
            Some((_, v, _)) => check_layout_version(&v, &self.name("")),
            None => {
                // Another writer may have written it meanwhile: then it is checked.
                if !self.write_small("oci-layout", LAYOUT_MARKER, Condition::Absent)? {
                    let (_, v) = self.need_json("oci-layout")?;
                    check_layout_version(&v, &self.name(""))?;
                }
                Ok(())
            }
        }
    }

    /// What the layout says of file `name` of `blobs/sha256` — its length, when it was last
    /// written, and the layout's clock now — if it is there.
    fn stat(&self, name: &str) -> Result<Option<Head>> {
        self.stat_file(&format!("blobs/sha256/{name}"))
    }

    /// What the layout says of its file `name` (as [`Layout::stat`]).
    fn stat_file(&self, name: &str) -> Result<Option<Head>> {
        Ok(match self {
            Layout::Dir(d) => match std::fs::metadata(d.join(name)) {
                Ok(m) => Some(Head {
                    len: m.len(),
                    modified: m.modified().ok(),
                    now: Some(SystemTime::now()),
                }),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => {
                    return Err(e).with_context(|| format!("cannot look up {}", self.name(name)));
                }
            },
            Layout::Bucket(b, r) => b.head(&r.key(name))?,
        })
    }

    /// How long ago blob `hex` of `len` bytes was last written, if the layout holds it.
    fn held(&self, hex: &str, len: u64) -> Result<Option<Duration>> {
        Ok(self.stat(hex)?.filter(|h| h.len == len).map(|h| h.age()))
    }

    /// Blob `hex` made new (its last-modified time now), so that a prune running meanwhile
    /// counts it as just written: a directory's file touched, a bucket's object copied onto
    /// itself.
    fn touch(&self, hex: &str) -> Result<()> {
        let name = format!("blobs/sha256/{hex}");
        match self {
            Layout::Dir(d) => {
                let path = d.join(&name);
                std::fs::File::options()
                    .write(true)
                    .open(&path)
                    .and_then(|f| f.set_modified(SystemTime::now()))
                    .with_context(|| format!("cannot touch {}", path.display()))?;
            }
            Layout::Bucket(b, r) => {
                if !b.touch(&r.key(&name))? {
                    bail!("{} went away while this export used it", self.name(&name));
                }
            }
        }
        Ok(())
    }

    /// The files of `blobs/sha256` — blobs and, in a directory, what exports left there — and
    /// the time by the layout's clock when they were listed.
    fn blobs(&self) -> Result<(Vec<Listed>, SystemTime)> {
        match self {
            Layout::Dir(d) => {
                let dir = d.join("blobs").join("sha256");
                let now = SystemTime::now();
                let mut all = Vec::new();
                let entries = match std::fs::read_dir(&dir) {
                    Ok(e) => e,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((all, now)),
                    Err(e) => {
                        return Err(e).with_context(|| format!("cannot list {}", dir.display()));
                    }
                };
                for entry in entries {
                    let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
                    let Ok(name) = entry.file_name().into_string() else {
                        continue;
                    };
                    let meta = entry.metadata()?;
                    if !meta.is_file() {
                        continue;
                    }
                    all.push(Listed {
                        key: name,
                        size: meta.len(),
                        modified: meta.modified().unwrap_or(now),
                    });
                    if all.len() > MAX_BLOBS {
                        bail!("{} holds over {MAX_BLOBS} files", dir.display());
                    }
                }
                Ok((all, now))
            }
            Layout::Bucket(b, r) => {
                let prefix = r.key("blobs/sha256/");
                let (mut all, now) = b.list(&prefix, MAX_BLOBS)?;
                for l in &mut all {
                    l.key = l.key[prefix.len()..].to_owned();
                }
                Ok((all, now.unwrap_or_else(SystemTime::now)))
            }
        }
    }

    /// Deletes file `name` of `blobs/sha256`.
    fn delete(&self, name: &str) -> Result<()> {
        self.delete_file(&format!("blobs/sha256/{name}"))
    }

    /// Deletes the layout's file `name` (nothing if it is not there).
    fn delete_file(&self, name: &str) -> Result<()> {
        match self {
            Layout::Dir(d) => match std::fs::remove_file(d.join(name)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(e).with_context(|| format!("cannot delete {}", self.name(name)))
                }
                _ => Ok(()),
            },
            Layout::Bucket(b, r) => Ok(b.delete(&r.key(name))?),
        }
    }

    /// A reader of blob `hex`, which must be `size` bytes (read no further).
    fn blob(&self, hex: &str, size: u64) -> Result<Box<dyn Read + Send>> {
        let name = format!("blobs/sha256/{hex}");
        match self {
            Layout::Dir(d) => {
                let path = d.join(&name);
                let file = std::fs::File::open(&path)
                    .with_context(|| format!("cannot open blob sha256:{hex}"))?;
                let on_disk = file.metadata()?.len();
                if on_disk != size {
                    bail!(
                        "blob sha256:{hex} is {on_disk} bytes, not the {size} its descriptor \
                         says: the layout is damaged"
                    );
                }
                Ok(Box::new(std::io::BufReader::with_capacity(1 << 20, file)))
            }
            Layout::Bucket(b, r) => match b.get(&r.key(&name))? {
                Some((reader, _)) => Ok(Box::new(std::io::BufReader::with_capacity(
                    1 << 20,
                    reader.take(size),
                ))),
                None => bail!(
                    "{} is not there: the layout is incomplete",
                    self.name(&name)
                ),
            },
        }
    }
}

/// What `oci-layout` holds.
const LAYOUT_MARKER: &[u8] = br#"{"imageLayoutVersion":"1.0.0"}"#;

fn check_layout_version(v: &Value, place: &str) -> Result<()> {
    if v["imageLayoutVersion"] != "1.0.0" {
        bail!(
            "{place} is an OCI layout of version {}, not 1.0.0",
            v["imageLayoutVersion"]
        );
    }
    Ok(())
}

/// A tag for a session's snapshots: its name where that is a valid tag, else the name with
/// every other character replaced by `-` (and cut to 128).
pub fn tag_for(session: &str) -> String {
    if valid_tag(session) {
        return session.to_owned();
    }
    let t: String = session
        .chars()
        .map(
            |c| match c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                true => c,
                false => '-',
            },
        )
        .take(127)
        .collect();
    format!("_{t}")
}

/// Whether `tag` is a valid OCI tag (`[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`).
fn valid_tag(tag: &str) -> bool {
    let mut chars = tag.chars();
    tag.len() <= 128
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// The 64 hex digits of a `sha256:` digest, refused otherwise (they name a file).
fn digest_hex(digest: &str) -> Result<&str> {
    match digest.strip_prefix("sha256:") {
        Some(h) if h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) => {
            Ok(h)
        }
        _ => bail!("`{digest}` is not a SHA-256 digest (sha256:<64 hex digits>)"),
    }
}

/// Writes through to `inner`, hashing what passes with SHA-256.
pub struct Sha256Writer<W> {
    pub inner: W,
    pub hasher: Sha256,
    pub len: u64,
}

impl<W: Write> Write for Sha256Writer<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Reads through from `inner`, hashing what passes with SHA-256.
pub struct Sha256Reader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for Sha256Reader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Writes `bytes` to `path` through a temporary file, durably ([`ferry_store::write_durably`]).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    ferry_store::write_durably(path, bytes)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// One layer of a snapshot's artifact: a capsule, and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// The program: the module and its instrumented form (the bulk for an interpreter such
    /// as CPython), the same for every snapshot of it — so a registry stores it once and a
    /// second snapshot of the program does not send it again.
    Program,
    /// The memory chunks of one region of the guest's memory (its number: regions in
    /// address order, memory after memory), not held by a layer before: the same bytes for
    /// every snapshot in which that region did not change, so a registry stores it once.
    Memory(u32),
    /// A group of the objects that hold the mounted files' bytes (its number), the same
    /// bytes in every snapshot in which those files are (see `capsule::file_groups`).
    Files(u32),
    /// Everything else of the snapshot's closure: stack, WASI state, the mounts' trees,
    /// output (and, with `--with-history`, the earlier snapshots).
    State,
}

impl Part {
    fn name(self) -> &'static str {
        match self {
            Part::Program => "program",
            Part::Memory(_) => "memory",
            Part::Files(_) => "files",
            Part::State => "state",
        }
    }

    fn title(self, tag: &str) -> String {
        match self {
            Part::Memory(n) => format!("{tag}.memory-{n}.ferry"),
            Part::Files(n) => format!("{tag}.files-{n}.ferry"),
            _ => format!("{tag}.{}.ferry", self.name()),
        }
    }
}

/// The annotation naming a layer's [`Part`].
const PART_ANNOTATION: &str = "dev.ferry.part";
/// Annotations of a tag's entry in `index.json` written by a run's exports (`--export-to`):
/// the run that wrote it, and its epoch — the tag's fencing token (see [`Claim`]).
const WRITER_ANNOTATION: &str = "dev.ferry.writer";
const EPOCH_ANNOTATION: &str = "dev.ferry.epoch";

/// A run's hold on the tag it exports to. A run writes the tag only while the tag's epoch
/// is below its own, or is its own and was written by it (or by no run): a run resumed
/// elsewhere from the tag takes the epoch after the one it imported, so the run it took
/// over from — a machine cut off, not lost — finds a later epoch at its next export, and
/// stops ([`TakenOver`]) instead of writing over it; of two resumed from the same tag, the
/// first to export keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// Who writes (random; kept by a local resume of the session, new for a takeover).
    pub writer: String,
    /// The epoch written with; `None` until the first export takes the one after the tag's.
    pub epoch: Option<u64>,
}

/// A run's export found its tag written by another run with a later epoch: that run took
/// the session over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakenOver {
    pub tag: String,
    pub epoch: u64,
    pub writer: String,
}

impl std::fmt::Display for TakenOver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tag `{}` was taken over by another run (writer {}, epoch {})",
            self.tag, self.writer, self.epoch
        )
    }
}

impl std::error::Error for TakenOver {}

/// The entry of `manifests` (an index's) tagged `tag`.
fn tagged<'a>(manifests: &'a [Value], tag: &str) -> Option<&'a Value> {
    manifests.iter().find(|m| m["annotations"][REF_NAME] == tag)
}

/// The epoch of an index entry (`0` if it has none).
fn epoch_of(entry: &Value) -> u64 {
    entry["annotations"][EPOCH_ANNOTATION]
        .as_str()
        .and_then(|e| e.parse().ok())
        .unwrap_or(0)
}

/// A capsule built for a part before: its digest (hex), size and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Built {
    pub hex: String,
    pub len: u64,
    pub stats: CapsuleStats,
}

/// What [`export`] may know of capsules built before (a cache, never trusted further than
/// this: a layout that holds a blob of that digest and size holds that capsule).
pub trait Known {
    /// The capsule built before for what `part` holds now, if there was one.
    fn get(&self, part: Part) -> Option<Built>;
    /// The capsule of `part` was built.
    fn put(&mut self, part: Part, built: &Built);
}

/// What [`export`] wrote.
#[derive(Debug)]
pub struct Exported {
    /// What each part's capsule holds.
    pub results: Vec<CapsuleStats>,
    /// Parts whose capsule was not built again: the layout held it, as `known` said.
    pub reused_layers: usize,
    /// The manifest's digest.
    pub manifest: String,
    pub tag: String,
    /// Layers sent, and their bytes: in a bucket, those it did not hold already.
    pub sent_layers: usize,
    pub sent_bytes: u64,
}

/// Writes a snapshot's capsules into the OCI layout `r` (created, or added to: a manifest of
/// the same tag is replaced), one layer per part of `parts`, in order: `write` writes the
/// part's capsule to the writer it is given. `sending` is told the bytes sent to a bucket so
/// far. The tag is by default `blake3-` and the first 16 hex digits of the snapshot's κ.
/// With `claim` (a run's exports), the tag is written only under the rule of [`Claim`]
/// (else the error is a [`TakenOver`]); without, the tag's epoch is kept.
#[allow(clippy::too_many_arguments)]
pub fn export(
    r: &OciRef,
    root: &ferry_kappa::Kappa,
    parts: &[Part],
    mut write: impl FnMut(Part, &mut dyn Write) -> Result<CapsuleStats>,
    known: &mut dyn Known,
    sending: &mut dyn FnMut(u64),
    claim: Option<&mut Claim>,
) -> Result<Exported> {
    if parts.is_empty() || parts.len() > MAX_LAYERS {
        bail!(
            "a snapshot artifact has 1 to {MAX_LAYERS} layers, not {}",
            parts.len()
        );
    }
    let tag = r
        .tag
        .clone()
        .unwrap_or_else(|| format!("blake3-{}", &root.to_hex()[..16]));
    if !valid_tag(&tag) {
        bail!("`{tag}` is not an OCI tag (letters, digits, `_`, `.`, `-`; at most 128)");
    }
    let layout = Layout::open(&r.place)?;
    layout.start()?;
    // A capsule is written to a temporary file first, hashed as it goes, then named by its
    // digest: renamed into a directory's `blobs/sha256`, or sent to a bucket that lacks it.
    let tmp_dir = match &layout {
        Layout::Dir(d) => d.join("blobs").join("sha256"),
        Layout::Bucket(..) => std::env::temp_dir(),
    };
    let mut results = Vec::new();
    let mut layers = Vec::new();
    let (mut sent_layers, mut sent_bytes, mut reused_layers) = (0, 0, 0);
    let descriptor = |part: Part, hex: &str, len: u64| {
        json!({
            "mediaType": CAPSULE_MEDIA_TYPE,
            "digest": format!("sha256:{hex}"),
            "size": len,
            "annotations": {
                "org.opencontainers.image.title": part.title(&tag),
                PART_ANNOTATION: part.name(),
            },
        })
    };
    let started = Instant::now();
    // A blob held already that has not been written for a while is touched, so that a prune
    // running now does not take it for garbage (see [`prune`]).
    let reuse = |hex: &str, age: Duration| match age > REFRESH_AFTER {
        true => layout.touch(hex),
        false => Ok(()),
    };
    let mut written = Vec::new();
    for &part in parts {
        // Built before for what it holds now, and held by the layout: not built again.
        if let Some(b) = known.get(part)
            && let Some(age) = layout.held(&b.hex, b.len)?
        {
            reuse(&b.hex, age)?;
            written.push(b.hex.clone());
            results.push(b.stats);
            layers.push(descriptor(part, &b.hex, b.len));
            reused_layers += 1;
            continue;
        }
        let tmp = tempfile::Builder::new()
            .prefix(".ferry-partial-")
            .tempfile_in(&tmp_dir)
            .with_context(|| format!("cannot create a file in {}", tmp_dir.display()))?;
        let mut w = Sha256Writer {
            inner: std::io::BufWriter::with_capacity(1 << 20, tmp.as_file().try_clone()?),
            hasher: Sha256::new(),
            len: 0,
        };
        let t = write(part, &mut w).and_then(|t| {
            w.flush()?;
            if let Layout::Dir(_) = layout {
                tmp.as_file().sync_all()?;
            }
            Ok(t)
        })?;
        let Sha256Writer { hasher, len, .. } = w;
        let hex = hex::encode(hasher.finalize());
        match &layout {
            Layout::Dir(_) => {
                tmp.persist(tmp_dir.join(&hex))
                    .with_context(|| format!("cannot write into {}", tmp_dir.display()))?;
                sent_layers += 1;
                sent_bytes += len;
            }
            Layout::Bucket(b, r) => {
                let key = r.key(&format!("blobs/sha256/{hex}"));
                // Named by its digest: a blob of that name and size is these bytes (and an
                // import checks them anyway).
                if let Some(age) = layout.held(&hex, len)? {
                    reuse(&hex, age)?;
                } else {
                    let before = sent_bytes;
                    b.put(
                        &key,
                        Body::File(tmp.path(), len),
                        &hex,
                        Condition::Always,
                        &mut |n| sending(before + n),
                    )?;
                    sent_layers += 1;
                    sent_bytes += len;
                }
            }
        }
        written.push(hex.clone());
        known.put(
            part,
            &Built {
                hex: hex.clone(),
                len,
                stats: t,
            },
        );
        results.push(t);
        layers.push(descriptor(part, &hex, len));
    }
    // An export this long may have outlasted the grace of a prune running beside it: every
    // layer is made new again before the index names it.
    if started.elapsed() > REFRESH_AFTER {
        for hex in &written {
            layout.touch(hex)?;
        }
    }
    let empty_hex = sha256_hex(EMPTY);
    layout.write_small(
        &format!("blobs/sha256/{empty_hex}"),
        EMPTY,
        Condition::Always,
    )?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": EMPTY_MEDIA_TYPE, "digest": format!("sha256:{empty_hex}"), "size": EMPTY.len()},
        "layers": layers,
        "annotations": {SNAPSHOT_ANNOTATION: root.to_string()},
    });
    let manifest = serde_json::to_vec(&manifest)?;
    let manifest_hex = sha256_hex(&manifest);
    layout.write_small(
        &format!("blobs/sha256/{manifest_hex}"),
        &manifest,
        Condition::Always,
    )?;
    // The index: this manifest under its tag, other tags kept, so that two exports to the
    // same prefix do not lose each other's tag.
    let mut epoch = 0;
    let written = change_index(&layout, |read| {
        let mut manifests: Vec<Value> = read
            .and_then(|v| v["manifests"].as_array().cloned())
            .unwrap_or_default();
        let current = tagged(&manifests, &tag);
        let current_epoch = current.map_or(0, epoch_of);
        let mut annotations = json!({REF_NAME: tag});
        epoch = match claim.as_deref() {
            Some(c) => {
                let epoch = c.epoch.unwrap_or(current_epoch + 1);
                let writer = current.and_then(|m| m["annotations"][WRITER_ANNOTATION].as_str());
                if current_epoch > epoch
                    || (current_epoch == epoch && writer.is_some_and(|w| w != c.writer))
                {
                    return Err(TakenOver {
                        tag: tag.clone(),
                        epoch: current_epoch,
                        writer: writer.unwrap_or("unknown").to_owned(),
                    }
                    .into());
                }
                annotations[WRITER_ANNOTATION] = json!(c.writer);
                epoch
            }
            None => current_epoch,
        };
        if epoch > 0 {
            annotations[EPOCH_ANNOTATION] = json!(epoch.to_string());
        }
        manifests.retain(|m| m["annotations"][REF_NAME] != tag.as_str());
        manifests.push(json!({
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": ARTIFACT_TYPE,
            "digest": format!("sha256:{manifest_hex}"),
            "size": manifest.len(),
            "annotations": annotations,
        }));
        Ok(Some(
            json!({"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": manifests}),
        ))
    })?;
    if !written {
        bail!(
            "{} kept changing while this export wrote it ({INDEX_TRIES} tries): the layers are \
             there, but tag `{tag}` is not; export again",
            layout.name("index.json")
        );
    }
    if let Some(c) = claim {
        c.epoch = Some(epoch);
    }
    Ok(Exported {
        results,
        reused_layers,
        manifest: format!("sha256:{manifest_hex}"),
        tag,
        sent_layers,
        sent_bytes,
    })
}

/// Changes `index.json` as `change` says — given the index as it is (`None`: there is none),
/// it returns the index to write, or `None` to write nothing — written only if no other
/// writer changed it since it was read (in a bucket, a conditional `PUT`; in a directory,
/// under [`Layout::lock_index`]), else read and changed again, [`INDEX_TRIES`] times at
/// most: `false` if it kept changing.
fn change_index(
    layout: &Layout,
    mut change: impl FnMut(Option<&Value>) -> Result<Option<Value>>,
) -> Result<bool> {
    let _turn = layout.lock_index()?;
    for _ in 0..INDEX_TRIES {
        let read = layout.read_json("index.json")?;
        let Some(index) = change(read.as_ref().map(|(_, v, _)| v))? else {
            return Ok(true);
        };
        let condition = match &read {
            None => Condition::Absent,
            Some((_, _, Some(etag))) => Condition::Unchanged(etag),
            Some((_, _, None)) => Condition::Always,
        };
        if layout.write_small("index.json", &serde_json::to_vec(&index)?, condition)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Tries to write `index.json` while other exports change it.
const INDEX_TRIES: usize = 8;

/// How long since it was last written an export trusts a blob it finds in the layout without
/// touching it ([`Layout::touch`]); also how long an export may run before it touches all its
/// layers again before naming them.
pub const REFRESH_AFTER: Duration = Duration::from_secs(15 * 60);

/// The shortest grace with which [`prune`] cannot take a layer from an export running beside
/// it (one that takes under [`REFRESH_AFTER`] plus this margin between its look at a layer
/// and its index): see docs/format.md, "Pruning a layout".
pub const SAFE_GRACE: Duration = Duration::from_secs(60 * 60);

/// Most files of `blobs/sha256` a prune looks at.
const MAX_BLOBS: usize = 10_000_000;

/// What [`prune`] did, or (`dry_run`) would do.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pruned {
    /// Tags the layout names after the prune.
    pub tags: usize,
    /// Tags removed.
    pub untagged: Vec<String>,
    /// Blobs a tag needs: kept.
    pub referenced: (usize, u64),
    /// Blobs no tag needs, written within the grace: kept.
    pub young: (usize, u64),
    /// Blobs no tag needs (and partial files an export left), older: deleted.
    pub deleted: (usize, u64),
    /// Blobs that changed after they were listed: kept.
    pub spared: usize,
}

/// Removes the tags `untag` from the layout at `place`, then deletes the blobs (and the
/// partial files of exports that ended early) that no tag needs and that were last written
/// over `grace` ago — with `dry_run`, only says what it would do. `deleting` is told how
/// many it has deleted so far.
///
/// Safe beside exports to the same layout when `grace` is at least [`SAFE_GRACE`]: the blobs
/// are listed first, the index and manifests read after (so a blob an export wrote and named
/// meanwhile is needed), an export touches a layer it reuses that is older than
/// [`REFRESH_AFTER`], and each blob is looked at again just before it is deleted (one changed
/// since it was listed is kept).
pub fn prune(
    place: &Place,
    untag: &[String],
    grace: Duration,
    dry_run: bool,
    deleting: &mut dyn FnMut(usize),
) -> Result<Pruned> {
    let layout = Layout::open(place)?;
    let (_, marker) = layout
        .need_json("oci-layout")
        .with_context(|| format!("{place} is not an OCI image layout"))?;
    check_layout_version(&marker, &place.to_string())?;
    let mut pruned = Pruned::default();
    untag_all(&layout, untag, dry_run)?;
    pruned.untagged = untag.to_vec();
    // Listed before the index is read: a blob an export writes after this is not listed,
    // and one it wrote and named before the index was read is needed.
    let (listed, now) = layout.blobs()?;
    let (_, mut index) = layout.need_json("index.json")?;
    if dry_run {
        without(&mut index, untag);
    }
    let manifests = index["manifests"].as_array().cloned().unwrap_or_default();
    pruned.tags = manifests
        .iter()
        .filter(|m| m["annotations"][REF_NAME].is_string())
        .count();
    let needed = needed(&layout, &manifests)?;
    let mut doomed = Vec::new();
    for l in listed {
        let partial = l.key.starts_with(".ferry-partial-") && matches!(layout, Layout::Dir(_));
        if !partial && digest_hex(&format!("sha256:{}", l.key)).is_err() {
            continue; // not a blob, nor ours: left alone
        }
        if needed.contains(&l.key) {
            pruned.referenced.0 += 1;
            pruned.referenced.1 += l.size;
        } else if now.duration_since(l.modified).unwrap_or_default() < grace {
            pruned.young.0 += 1;
            pruned.young.1 += l.size;
        } else {
            doomed.push(l);
        }
    }
    for l in doomed {
        if !dry_run {
            // Written again since it was listed (an export touched it): kept.
            match layout.stat(&l.key)? {
                None => continue,
                Some(h) if h.modified != Some(l.modified) => {
                    pruned.spared += 1;
                    continue;
                }
                Some(_) => layout.delete(&l.key)?,
            }
        }
        pruned.deleted.0 += 1;
        pruned.deleted.1 += l.size;
        deleting(pruned.deleted.0);
    }
    Ok(pruned)
}

/// Removes the tags `untag` from the layout's index (refused if one is not there), written
/// only if no export changed it since it was read (with `dry_run`, only checked).
fn untag_all(layout: &Layout, untag: &[String], dry_run: bool) -> Result<()> {
    if untag.is_empty() {
        return Ok(());
    }
    // A tag a run still holds would be written again at its next export.
    for tag in untag {
        if let Some(holder) = lease::live_holder(layout, tag)? {
            bail!(
                "tag `{tag}` of {} is held by a run that is still going (writer {holder}): \
                 its next export would tag it again; suspend that run first",
                layout.place()
            );
        }
    }
    let written = change_index(layout, |read| {
        let index = read.with_context(|| format!("{} is not there", layout.name("index.json")))?;
        let tags: Vec<String> = index["manifests"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["annotations"][REF_NAME].as_str().map(str::to_owned))
            .collect();
        if let Some(t) = untag.iter().find(|t| !tags.contains(t)) {
            bail!(
                "{} has no tag `{t}` (tags: {})",
                layout.place(),
                tags.join(", ")
            );
        }
        if dry_run {
            return Ok(None);
        }
        let mut index = index.clone();
        without(&mut index, untag);
        Ok(Some(index))
    })?;
    if !written {
        bail!(
            "{} kept changing while this prune wrote it ({INDEX_TRIES} tries): nothing was \
             deleted; prune again",
            layout.name("index.json")
        );
    }
    if !dry_run {
        for tag in untag {
            layout.delete_file(&lease::file(tag)?)?;
        }
    }
    Ok(())
}

/// `index` without the manifests tagged one of `untag`.
fn without(index: &mut Value, untag: &[String]) {
    if let Some(manifests) = index["manifests"].as_array_mut() {
        manifests.retain(|m| {
            !m["annotations"][REF_NAME]
                .as_str()
                .is_some_and(|n| untag.iter().any(|t| t == n))
        });
    }
}

/// The blobs (hex digests) the index's `manifests` need: each manifest, and every digest it
/// names (config, layers, subject), through nested image indexes too. A manifest that cannot
/// be read is refused: what it needs is not known, so nothing may be deleted.
fn needed(layout: &Layout, manifests: &[Value]) -> Result<HashSet<String>> {
    let mut needed = HashSet::new();
    let mut todo: Vec<(Value, usize)> = manifests.iter().map(|m| (m.clone(), 0)).collect();
    while let Some((desc, depth)) = todo.pop() {
        let digest = desc["digest"]
            .as_str()
            .context("a descriptor without a digest")?;
        let hex = digest_hex(digest)?.to_owned();
        if !needed.insert(hex) {
            continue;
        }
        let media = desc["mediaType"].as_str().unwrap_or_default();
        if !(media.contains("manifest") || media.contains("index")) {
            continue;
        }
        if depth >= MAX_INDEX_DEPTH {
            bail!("image indexes nest deeper than {MAX_INDEX_DEPTH}: not pruned");
        }
        let tag = desc["annotations"][REF_NAME]
            .as_str()
            .unwrap_or("(untagged)");
        let bytes = small_blob(layout, &desc).with_context(|| {
            format!(
                "cannot read manifest {digest} (tag `{tag}`), so what it needs is not known: \
                 nothing was deleted (`--untag {tag}` drops that tag)"
            )
        })?;
        let manifest: Value = serde_json::from_slice(&bytes)
            .with_context(|| format!("manifest {digest} is not JSON: nothing was deleted"))?;
        let mut found = Vec::new();
        descriptors_in(&manifest, &mut found);
        todo.extend(found.into_iter().map(|d| (d, depth + 1)));
    }
    Ok(needed)
}

/// Deepest nesting of image indexes a prune follows.
const MAX_INDEX_DEPTH: usize = 8;

/// Every object of `v` (at any depth) that has a `digest` string: the descriptors.
fn descriptors_in(v: &Value, found: &mut Vec<Value>) {
    match v {
        Value::Object(o) => {
            if o.get("digest").is_some_and(Value::is_string) {
                found.push(v.clone());
            }
            for child in o.values() {
                descriptors_in(child, found);
            }
        }
        Value::Array(a) => a.iter().for_each(|c| descriptors_in(c, found)),
        _ => {}
    }
}

/// A blob of the layout, checked against its descriptor's digest and size (read whole: for
/// the small JSON blobs).
fn small_blob(layout: &Layout, desc: &Value) -> Result<Vec<u8>> {
    let digest = desc["digest"]
        .as_str()
        .context("a descriptor without a digest")?;
    let hex = digest_hex(digest)?;
    let (bytes, _) = layout
        .need_json(&format!("blobs/sha256/{hex}"))
        .with_context(|| format!("blob {digest}"))?;
    if sha256_hex(&bytes) != hex {
        bail!("blob {digest} does not hash to its digest: the layout is damaged");
    }
    if desc["size"].as_u64() != Some(bytes.len() as u64) {
        bail!(
            "blob {digest} is {} bytes, not the {} its descriptor says",
            bytes.len(),
            desc["size"]
        );
    }
    Ok(bytes)
}

/// One capsule of the layout: a reader of it that checks its SHA-256 (call
/// [`CapsuleIn::check`] once it has been read to its end), and its size.
pub struct CapsuleIn {
    pub reader: Sha256Reader<Box<dyn Read + Send>>,
    pub size: u64,
    digest: String,
}

impl CapsuleIn {
    /// Refuses a capsule whose bytes do not hash to the layer's digest (or that ended early).
    pub fn check(self) -> Result<()> {
        let got = hex::encode(self.reader.hasher.finalize());
        if digest_hex(&self.digest)? != got {
            bail!(
                "the capsule does not hash to its layer's digest {} (sha256:{got}): the \
                 layout is damaged",
                self.digest
            );
        }
        Ok(())
    }
}

/// The snapshot artifact of a layout, as [`open`] found it.
pub struct Artifact {
    layout: Layout,
    /// The layers' (digest, size), in order: each a capsule.
    layers: Vec<(String, u64)>,
    /// The snapshot the manifest names.
    pub snapshot: Option<String>,
    /// The tag read, and its epoch ([`Claim`]; `0` if it has none).
    pub tag: Option<String>,
    pub epoch: u64,
}

impl Artifact {
    /// How many capsules it holds.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of all its capsules.
    pub fn size(&self) -> u64 {
        self.layers.iter().map(|(_, n)| n).sum()
    }

    /// Capsule `i`, opened (its size checked, where the layout tells it beforehand).
    pub fn capsule(&self, i: usize) -> Result<CapsuleIn> {
        let (digest, size) = &self.layers[i];
        Ok(CapsuleIn {
            reader: Sha256Reader {
                inner: self.layout.blob(digest_hex(digest)?, *size)?,
                hasher: Sha256::new(),
            },
            size: *size,
            digest: digest.clone(),
        })
    }
}

/// Most layers a snapshot artifact may have: the program, the state and up to 1022 memory
/// regions and groups of files (a manifest is read only up to 4 MiB anyway; ferry before
/// 2026-12-04 read 16).
pub const MAX_LAYERS: usize = 1024;

/// The snapshot artifact of the manifest tagged `r.tag` (or the layout's only manifest).
pub fn open(r: &OciRef) -> Result<Artifact> {
    let layout = Layout::open(&r.place)?;
    let place = &r.place;
    let (_, marker) = layout
        .need_json("oci-layout")
        .with_context(|| format!("{place} is not an OCI image layout"))?;
    check_layout_version(&marker, &place.to_string())?;
    let (_, index) = layout.need_json("index.json")?;
    let manifests = index["manifests"].as_array().cloned().unwrap_or_default();
    let tags: Vec<&str> = manifests
        .iter()
        .filter_map(|m| m["annotations"][REF_NAME].as_str())
        .collect();
    let scheme = match place {
        Place::Dir(_) => "oci:",
        Place::Bucket(_) => "",
    };
    let chosen = match &r.tag {
        Some(t) => tagged(&manifests, t).with_context(|| {
            format!(
                "{place} has no manifest tagged `{t}` (tags: {})",
                tags.join(", ")
            )
        })?,
        None if manifests.len() == 1 => &manifests[0],
        None => bail!(
            "{place} holds {} manifests: name one as {scheme}{place}:TAG (tags: {})",
            manifests.len(),
            tags.join(", ")
        ),
    };
    let manifest: Value = serde_json::from_slice(&small_blob(&layout, chosen)?)
        .context("the manifest is not JSON")?;
    let descriptors = manifest["layers"].as_array().cloned().unwrap_or_default();
    if descriptors.is_empty() || descriptors.len() > MAX_LAYERS {
        bail!(
            "the manifest has {} layers; a ferry snapshot has 1 to {MAX_LAYERS}, each a capsule",
            descriptors.len()
        );
    }
    let mut layers = Vec::new();
    for layer in &descriptors {
        if layer["mediaType"] != CAPSULE_MEDIA_TYPE {
            bail!(
                "a layer of the manifest is {}, not a ferry capsule ({CAPSULE_MEDIA_TYPE})",
                layer["mediaType"]
            );
        }
        let digest = layer["digest"].as_str().context("a layer has no digest")?;
        digest_hex(digest)?;
        let size = layer["size"].as_u64().context("a layer has no size")?;
        layers.push((digest.to_owned(), size));
    }
    Ok(Artifact {
        layout,
        layers,
        snapshot: manifest["annotations"][SNAPSHOT_ANNOTATION]
            .as_str()
            .map(str::to_owned),
        tag: chosen["annotations"][REF_NAME].as_str().map(str::to_owned),
        epoch: epoch_of(chosen),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Knows nothing.
    #[derive(Debug)]
    struct Nothing;

    impl Known for Nothing {
        fn get(&self, _: Part) -> Option<Built> {
            None
        }
        fn put(&mut self, _: Part, _: &Built) {}
    }

    /// A layer whose bytes were changed (same length) is read, then refused by its digest;
    /// the manifest and index written are found again by tag.
    #[test]
    fn a_layer_that_does_not_hash_to_its_digest_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let r = OciRef {
            place: Place::Dir(dir.path().join("l")),
            tag: Some("t".into()),
        };
        let root = ferry_kappa::Kappa::of(b"root");
        let exported = export(
            &r,
            &root,
            &[Part::Program, Part::State],
            |part, w| {
                w.write_all(match part {
                    Part::Program => b"program bytes",
                    _ => b"capsule bytes",
                })?;
                Ok(CapsuleStats::default())
            },
            &mut Nothing,
            &mut |_| {},
            None,
        )
        .unwrap();
        let manifest = exported.manifest;
        assert_eq!(exported.sent_layers, 2);
        assert!(manifest.starts_with("sha256:"));
        let read = |r: &OciRef| {
            let a = open(r).unwrap();
            assert_eq!(a.snapshot.as_deref(), Some(root.to_string().as_str()));
            assert_eq!(a.len(), 2);
            let mut c = a.capsule(1).unwrap();
            let mut got = Vec::new();
            c.reader.read_to_end(&mut got).unwrap();
            (got, c.check())
        };
        let (got, checked) = read(&r);
        assert_eq!(got, b"capsule bytes");
        checked.unwrap();
        let blob = dir
            .path()
            .join("l/blobs/sha256")
            .join(sha256_hex(b"capsule bytes"));
        std::fs::write(&blob, b"capsule BYTES").unwrap();
        let (_, checked) = read(&r);
        assert!(
            checked
                .unwrap_err()
                .to_string()
                .contains("does not hash to its layer's digest")
        );
    }

    /// Exports to `r` a snapshot of one state layer holding `capsule`, under `claim`.
    fn export_state(r: &OciRef, claim: Option<&mut Claim>) -> Result<Exported> {
        export(
            r,
            &ferry_kappa::Kappa::of(b"root"),
            &[Part::State],
            |_, w| {
                w.write_all(b"capsule")?;
                Ok(CapsuleStats::default())
            },
            &mut Nothing,
            &mut |_| {},
            claim,
        )
    }

    /// Writes blob `bytes` into the directory layout `dir`; its descriptor.
    fn put_blob(dir: &Path, media: &str, bytes: &[u8]) -> Value {
        let hex = sha256_hex(bytes);
        std::fs::write(dir.join("blobs/sha256").join(&hex), bytes).unwrap();
        json!({"mediaType": media, "digest": format!("sha256:{hex}"), "size": bytes.len()})
    }

    /// What other OCI content in the layout needs — through an image index nested in the
    /// index, a manifest's config and layers — is kept; a tag whose manifest is missing
    /// stops the prune before anything is deleted, and `--untag` of it lets it go on.
    #[test]
    fn prune_keeps_what_nested_indexes_need_and_stops_at_a_missing_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let place = Place::Dir(dir.path().to_owned());
        let r = OciRef {
            place: place.clone(),
            tag: Some("ours".into()),
        };
        export_state(&r, None).unwrap();
        // An image as skopeo would add it: index -> manifest -> config and a layer.
        let layer = put_blob(
            dir.path(),
            "application/vnd.oci.image.layer.v1.tar",
            b"layer",
        );
        let config = put_blob(
            dir.path(),
            "application/vnd.oci.image.config.v1+json",
            b"{}",
        );
        let manifest = json!({"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE,
            "config": config, "layers": [layer]});
        let manifest = put_blob(
            dir.path(),
            MANIFEST_MEDIA_TYPE,
            &serde_json::to_vec(&manifest).unwrap(),
        );
        let image = json!({"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE,
            "manifests": [manifest]});
        let mut image = put_blob(
            dir.path(),
            INDEX_MEDIA_TYPE,
            &serde_json::to_vec(&image).unwrap(),
        );
        image["annotations"] = json!({REF_NAME: "image"});
        let garbage = put_blob(dir.path(), "x", b"garbage");
        let index_path = dir.path().join("index.json");
        let mut index: Value =
            serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
        index["manifests"].as_array_mut().unwrap().push(image);
        let missing = json!({"mediaType": MANIFEST_MEDIA_TYPE, "digest":
            format!("sha256:{}", "0".repeat(64)), "size": 2, "annotations": {REF_NAME: "gone"}});
        index["manifests"].as_array_mut().unwrap().push(missing);
        std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
        let blobs = || {
            std::fs::read_dir(dir.path().join("blobs/sha256"))
                .unwrap()
                .count()
        };
        let all = blobs();
        let err = prune(&place, &[], Duration::ZERO, false, &mut |_| {}).unwrap_err();
        assert!(
            format!("{err:#}").contains(
                "(tag `gone`), so what it needs is not known: nothing \
                 was deleted (`--untag gone` drops that tag)"
            ),
            "{err:#}"
        );
        assert_eq!(blobs(), all);
        let pruned = prune(&place, &["gone".into()], Duration::ZERO, false, &mut |_| {}).unwrap();
        assert_eq!(pruned.deleted.0, 1, "{pruned:?}");
        assert_eq!(pruned.tags, 2);
        assert!(
            !dir.path()
                .join("blobs/sha256")
                .join(&garbage["digest"].as_str().unwrap()[7..])
                .exists()
        );
        assert_eq!(blobs(), all - 1);
        open(&r).unwrap();
    }

    /// The tag's fence: a later epoch stops a run; an equal one stops another writer but
    /// not the same one; a plain export keeps the epoch and names no writer.
    #[test]
    fn a_tag_is_written_only_under_its_claim() {
        let dir = tempfile::tempdir().unwrap();
        let r = OciRef {
            place: Place::Dir(dir.path().to_owned()),
            tag: Some("job".into()),
        };
        let put = |claim: Option<&mut Claim>| {
            export_state(&r, claim)
                .map(|_| open(&r).unwrap().epoch)
                .map_err(|e| e.downcast::<TakenOver>().unwrap())
        };
        let claim = |writer: &str, epoch| Claim {
            writer: writer.into(),
            epoch,
        };
        let mut a = claim("a", None);
        assert_eq!(put(Some(&mut a)).unwrap(), 1);
        assert_eq!(a.epoch, Some(1));
        let mut b = claim("b", Some(2));
        assert_eq!(put(Some(&mut b)).unwrap(), 2);
        let taken = put(Some(&mut a)).unwrap_err();
        assert_eq!((taken.epoch, taken.writer.as_str()), (2, "b"));
        assert!(
            put(Some(&mut claim("c", Some(2)))).is_err(),
            "same epoch, other writer"
        );
        assert_eq!(
            put(Some(&mut claim("b", Some(2)))).unwrap(),
            2,
            "a local resume of b"
        );
        assert_eq!(put(None).unwrap(), 2, "a plain export keeps the epoch");
        assert_eq!(put(Some(&mut claim("c", Some(2)))).unwrap(), 2);
        assert_eq!(put(Some(&mut claim("d", None))).unwrap(), 3);
    }

    #[test]
    fn references_read_as_skopeo_writes_them() {
        let p = |s: &str| OciRef::parse(std::ffi::OsStr::new(s)).map(|r| r.unwrap());
        let dir = |d: &str, tag: Option<&str>| OciRef {
            place: Place::Dir(d.into()),
            tag: tag.map(str::to_owned),
        };
        assert_eq!(p("snap.ferry"), None);
        assert_eq!(p("oci:./out:v1"), Some(dir("./out", Some("v1"))));
        assert_eq!(p("oci:/a/b"), Some(dir("/a/b", None)));
        assert_eq!(p("oci:/a:b/c"), Some(dir("/a:b/c", None)));
        let bucket = |prefix: &str, tag: Option<&str>| OciRef {
            place: Place::Bucket(S3Ref {
                bucket: "my-bucket".into(),
                prefix: prefix.into(),
            }),
            tag: tag.map(str::to_owned),
        };
        assert_eq!(
            p("s3://my-bucket/snaps:v1"),
            Some(bucket("snaps", Some("v1")))
        );
        assert_eq!(p("s3://my-bucket/a/b/"), Some(bucket("a/b", None)));
        assert_eq!(p("s3://my-bucket:v2"), Some(bucket("", Some("v2"))));
        assert!(
            OciRef::parse(std::ffi::OsStr::new("s3://No_Bucket/x")).is_some_and(|r| r.is_err())
        );
        assert!(valid_tag("blake3-0123abcd") && valid_tag("v1.2_x"));
        assert!(
            !valid_tag("") && !valid_tag(".x") && !valid_tag("a/b") && !valid_tag(&"a".repeat(129))
        );
        assert!(digest_hex("sha256:../../etc/passwd").is_err());
        assert!(digest_hex(&format!("sha256:{}", "A".repeat(64))).is_err());
        assert!(digest_hex(&format!("sha256:{}", "a".repeat(64))).is_ok());
    }
}
