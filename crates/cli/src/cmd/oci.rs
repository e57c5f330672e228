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
//! The layout is untrusted on import: every file is bounded before it is read, every digest
//! must be a SHA-256 of 64 hex digits (it becomes a file name) and must match the bytes, and
//! the capsule inside is checked as any capsule is.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
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

/// `oci:DIR[:TAG]`, as `skopeo` writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OciRef {
    pub dir: PathBuf,
    pub tag: Option<String>,
}

impl OciRef {
    /// `oci:DIR[:TAG]`; `None` for anything else (a plain file name).
    pub fn parse(s: &std::ffi::OsStr) -> Option<Self> {
        let s = s.to_str()?.strip_prefix("oci:")?;
        // The tag is what follows the last colon, unless that part holds a `/` (a path).
        let (dir, tag) = match s.rsplit_once(':') {
            Some((d, t)) if !t.contains('/') && !d.is_empty() => (d, Some(t.to_owned())),
            _ => (s, None),
        };
        Some(Self {
            dir: PathBuf::from(dir),
            tag,
        })
    }
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

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Writes `bytes` to `path` through a temporary file, durably ([`ferry_store::write_durably`]).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    ferry_store::write_durably(path, bytes)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Reads a JSON file of the layout, at most [`MAX_JSON`] bytes.
fn read_json(path: &Path) -> Result<(Vec<u8>, Value)> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut bytes = Vec::new();
    f.take(MAX_JSON + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {}", path.display()))?;
    if bytes.len() as u64 > MAX_JSON {
        bail!("{} is over {} MiB", path.display(), MAX_JSON >> 20);
    }
    let v = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not JSON", path.display()))?;
    Ok((bytes, v))
}

/// A layout directory being written: `oci-layout` checked or written, `blobs/sha256` there.
fn open_layout(dir: &Path) -> Result<PathBuf> {
    let blobs = dir.join("blobs").join("sha256");
    std::fs::create_dir_all(&blobs)
        .with_context(|| format!("cannot create {}", blobs.display()))?;
    let marker = dir.join("oci-layout");
    if marker.exists() {
        let (_, v) = read_json(&marker)?;
        if v["imageLayoutVersion"] != "1.0.0" {
            bail!(
                "{} is an OCI layout of version {}, not 1.0.0",
                dir.display(),
                v["imageLayoutVersion"]
            );
        }
    } else {
        write_atomic(&marker, br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    }
    Ok(blobs)
}

/// One layer of a snapshot's artifact: a capsule, and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// Writes a snapshot's capsules into the OCI layout `r` (created, or added to: a manifest of
/// the same tag is replaced), one layer per part of `parts`, in order: `write` writes the
/// part's capsule to the writer it is given. Returns what `write` returned for each, the
/// manifest's digest and the tag (by default `blake3-` and the first 16 hex digits of the
/// snapshot's κ).
pub fn export<T>(
    r: &OciRef,
    root: &ferry_kappa::Kappa,
    parts: &[Part],
    mut write: impl FnMut(Part, &mut dyn Write) -> Result<T>,
) -> Result<(Vec<T>, String, String)> {
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
    let blobs = open_layout(&r.dir)?;
    let mut results = Vec::new();
    let mut layers = Vec::new();
    for &part in parts {
        // The capsule, hashed as it is written, then named by its digest.
        let tmp = blobs.join(format!(".ferry-partial-{}", std::process::id()));
        let file = std::fs::File::create(&tmp)
            .with_context(|| format!("cannot create {}", tmp.display()))?;
        let mut w = Sha256Writer {
            inner: std::io::BufWriter::with_capacity(1 << 20, &file),
            hasher: Sha256::new(),
            len: 0,
        };
        let written = write(part, &mut w).and_then(|t| {
            w.flush()?;
            file.sync_all()?;
            Ok(t)
        });
        let t = match written {
            Ok(t) => t,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        let (hex, len) = (hex::encode(w.hasher.finalize()), w.len);
        std::fs::rename(&tmp, blobs.join(&hex))
            .with_context(|| format!("cannot write into {}", blobs.display()))?;
        results.push(t);
        layers.push(json!({
            "mediaType": CAPSULE_MEDIA_TYPE,
            "digest": format!("sha256:{hex}"),
            "size": len,
            "annotations": {
                "org.opencontainers.image.title": part.title(&tag),
                PART_ANNOTATION: part.name(),
            },
        }));
    }
    let empty_hex = sha256_hex(EMPTY);
    write_atomic(&blobs.join(&empty_hex), EMPTY)?;
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
    write_atomic(&blobs.join(&manifest_hex), &manifest)?;
    // The index: this manifest under its tag, other tags kept.
    let index_path = r.dir.join("index.json");
    let mut manifests: Vec<Value> = if index_path.exists() {
        let (_, v) = read_json(&index_path)?;
        v["manifests"].as_array().cloned().unwrap_or_default()
    } else {
        Vec::new()
    };
    manifests.retain(|m| m["annotations"][REF_NAME] != tag.as_str());
    manifests.push(json!({
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "digest": format!("sha256:{manifest_hex}"),
        "size": manifest.len(),
        "annotations": {REF_NAME: tag},
    }));
    let index = json!({"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": manifests});
    write_atomic(&index_path, &serde_json::to_vec(&index)?)?;
    Ok((results, format!("sha256:{manifest_hex}"), tag))
}

/// A blob of the layout, checked against its descriptor's digest and size (read whole: for
/// the small JSON blobs).
fn small_blob(dir: &Path, desc: &Value) -> Result<Vec<u8>> {
    let digest = desc["digest"]
        .as_str()
        .context("a descriptor without a digest")?;
    let hex = digest_hex(digest)?;
    let path = dir.join("blobs").join("sha256").join(hex);
    let (bytes, _) = read_json(&path).with_context(|| format!("blob {digest}"))?;
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
    pub reader: Sha256Reader<std::io::BufReader<std::fs::File>>,
    pub size: u64,
    digest: String,
}

impl CapsuleIn {
    /// Refuses a capsule whose bytes do not hash to the layer's digest.
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
    dir: PathBuf,
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

    /// Capsule `i`, opened and its size checked.
    pub fn capsule(&self, i: usize) -> Result<CapsuleIn> {
        let (digest, size) = &self.layers[i];
        let path = self
            .dir
            .join("blobs")
            .join("sha256")
            .join(digest_hex(digest)?);
        let file =
            std::fs::File::open(&path).with_context(|| format!("cannot open blob {digest}"))?;
        let on_disk = file.metadata()?.len();
        if on_disk != *size {
            bail!(
                "blob {digest} is {on_disk} bytes, not the {size} its descriptor says: the \
                 layout is damaged"
            );
        }
        Ok(CapsuleIn {
            reader: Sha256Reader {
                inner: std::io::BufReader::with_capacity(1 << 20, file),
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
    let dir = &r.dir;
    let (_, layout) = read_json(&dir.join("oci-layout"))
        .with_context(|| format!("{} is not an OCI image layout", dir.display()))?;
    if layout["imageLayoutVersion"] != "1.0.0" {
        bail!(
            "{} is an OCI layout of version {}, not 1.0.0",
            dir.display(),
            layout["imageLayoutVersion"]
        );
    }
    let (_, index) = read_json(&dir.join("index.json"))?;
    let manifests = index["manifests"].as_array().cloned().unwrap_or_default();
    let tags: Vec<&str> = manifests
        .iter()
        .filter_map(|m| m["annotations"][REF_NAME].as_str())
        .collect();
    let chosen = match &r.tag {
        Some(t) => manifests
            .iter()
            .find(|m| m["annotations"][REF_NAME] == t.as_str())
            .with_context(|| {
                format!(
                    "{} has no manifest tagged `{t}` (tags: {})",
                    dir.display(),
                    tags.join(", ")
                )
            })?,
        None if manifests.len() == 1 => &manifests[0],
        None => bail!(
            "{} holds {} manifests: name one as oci:{}:TAG (tags: {})",
            dir.display(),
            manifests.len(),
            dir.display(),
            tags.join(", ")
        ),
    };
    let manifest: Value =
        serde_json::from_slice(&small_blob(dir, chosen)?).context("the manifest is not JSON")?;
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
        dir: dir.clone(),
        layers,
        snapshot: manifest["annotations"][SNAPSHOT_ANNOTATION]
            .as_str()
            .map(str::to_owned),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer whose bytes were changed (same length) is read, then refused by its digest;
    /// the manifest and index written are found again by tag.
    #[test]
    fn a_layer_that_does_not_hash_to_its_digest_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let r = OciRef {
            dir: dir.path().join("l"),
            tag: Some("t".into()),
        };
        let root = ferry_kappa::Kappa::of(b"root");
        let (_, manifest, _) = export(&r, &root, &[Part::Program, Part::State], |part, w| {
            Ok(w.write_all(match part {
                Part::Program => b"program bytes",
                _ => b"capsule bytes",
            })?)
        })
        .unwrap();
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
        let blob = r
            .dir
            .join("blobs/sha256")
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
        let p = |s: &str| OciRef::parse(std::ffi::OsStr::new(s));
        assert_eq!(p("snap.ferry"), None);
        assert_eq!(
            p("oci:./out:v1"),
            Some(OciRef {
                dir: "./out".into(),
                tag: Some("v1".into())
            })
        );
        assert_eq!(
            p("oci:/a/b"),
            Some(OciRef {
                dir: "/a/b".into(),
                tag: None
            })
        );
        assert_eq!(
            p("oci:/a:b/c"),
            Some(OciRef {
                dir: "/a:b/c".into(),
                tag: None
            })
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
