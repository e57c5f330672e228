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

use anyhow::{Context, Result, bail};
use ferry_space::s3::{Body, Bucket, Condition, S3Ref, sha256_hex};
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

    /// How it is described to the user, with its tag `tag`.
    pub fn describe(&self, tag: &str) -> String {
        match &self.place {
            Place::Dir(d) => format!("the OCI layout {}, tag `{tag}`", d.display()),
            Place::Bucket(b) => format!("the OCI layout in {b}, tag `{tag}`"),
        }
    }
}

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
        match self {
            Layout::Dir(d) => {
                write_atomic(&d.join(name), bytes)?;
                Ok(true)
            }
            Layout::Bucket(b, r) => Ok(b.put(
                &r.key(name),
                Body::Bytes(bytes),
                &sha256_hex(bytes),
                condition,
                &mut |_| {},
            )?),
        }
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

    /// Whether the layout holds blob `hex` of `len` bytes.
    fn holds(&self, hex: &str, len: u64) -> Result<bool> {
        let name = format!("blobs/sha256/{hex}");
        Ok(match self {
            Layout::Dir(d) => std::fs::metadata(d.join(&name)).is_ok_and(|m| m.len() == len),
            Layout::Bucket(b, r) => b.head(&r.key(&name))? == Some(len),
        })
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
pub fn export(
    r: &OciRef,
    root: &ferry_kappa::Kappa,
    parts: &[Part],
    mut write: impl FnMut(Part, &mut dyn Write) -> Result<CapsuleStats>,
    known: &mut dyn Known,
    sending: &mut dyn FnMut(u64),
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
    for &part in parts {
        // Built before for what it holds now, and held by the layout: not built again.
        if let Some(b) = known.get(part)
            && layout.holds(&b.hex, b.len)?
        {
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
                if !layout.holds(&hex, len)? {
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
    // The index: this manifest under its tag, other tags kept. In a bucket, written only if
    // no other export changed it since it was read (else read again), so that two exports
    // to the same prefix do not lose each other's tag.
    for _ in 0..INDEX_TRIES {
        let read = layout.read_json("index.json")?;
        let mut manifests: Vec<Value> = match &read {
            Some((_, v, _)) => v["manifests"].as_array().cloned().unwrap_or_default(),
            None => Vec::new(),
        };
        manifests.retain(|m| m["annotations"][REF_NAME] != tag.as_str());
        manifests.push(json!({
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": ARTIFACT_TYPE,
            "digest": format!("sha256:{manifest_hex}"),
            "size": manifest.len(),
            "annotations": {REF_NAME: tag},
        }));
        let index =
            json!({"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": manifests});
        let condition = match &read {
            None => Condition::Absent,
            Some((_, _, Some(etag))) => Condition::Unchanged(etag),
            Some((_, _, None)) => Condition::Always,
        };
        if layout.write_small("index.json", &serde_json::to_vec(&index)?, condition)? {
            return Ok(Exported {
                results,
                reused_layers,
                manifest: format!("sha256:{manifest_hex}"),
                tag,
                sent_layers,
                sent_bytes,
            });
        }
    }
    bail!(
        "{} kept changing while this export wrote it ({INDEX_TRIES} tries): the layers are \
         there, but tag `{tag}` is not; export again",
        layout.name("index.json")
    )
}

/// Tries to write `index.json` while other exports change it.
const INDEX_TRIES: usize = 8;

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
        Some(t) => manifests
            .iter()
            .find(|m| m["annotations"][REF_NAME] == t.as_str())
            .with_context(|| {
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
