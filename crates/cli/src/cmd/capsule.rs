//! `ferry export` and `ferry import`: a snapshot and its whole closure in one file, to move it
//! to a machine that shares nothing with this one (docs/format.md, "Capsules").

use std::collections::{BTreeSet, HashSet};
use std::io::{BufReader, BufWriter, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ferry_engine::closure::{moving_order, snapshot_closure};
use ferry_engine::snapshot;
use ferry_kappa::Kappa;
use ferry_store::capsule;

use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// The snapshot: blake3:<hex> or a unique prefix, or a session (its last snapshot).
    #[arg(value_name = "SNAPSHOT|SESSION")]
    snapshot: String,
    /// The capsule file to write; `-` writes it to stdout, to pipe it
    /// (`ferry export κ -o - | ssh HOST ferry import -`); `oci:DIR[:TAG]` writes an OCI image
    /// layout that `skopeo copy oci:DIR:TAG docker://…` (or oras, crane) takes to a registry;
    /// `s3://BUCKET/PREFIX[:TAG]` writes that layout into an S3-compatible bucket, sending only
    /// the layers it lacks (endpoint and credentials from AWS_ENDPOINT_URL, AWS_REGION,
    /// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or ~/.aws/credentials; docs/format.md).
    #[arg(
        short,
        long,
        value_name = "FILE|oci:DIR[:TAG]|s3://BUCKET/PREFIX[:TAG]"
    )]
    output: PathBuf,
    /// Also carry the snapshot's ancestors (parents) that this store still has.
    #[arg(long)]
    with_history: bool,
}

#[derive(Debug, clap::Args)]
pub struct ImportArgs {
    /// The capsule file written by `ferry export`; `-` reads it from stdin; `oci:DIR[:TAG]`
    /// reads an OCI image layout (`ferry export -o oci:…`, or `skopeo copy docker://… oci:DIR:TAG`);
    /// `s3://BUCKET/PREFIX[:TAG]` reads one from an S3-compatible bucket (`ferry export -o s3://…`).
    #[arg(value_name = "FILE|oci:DIR[:TAG]|s3://BUCKET/PREFIX[:TAG]")]
    capsule: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct PruneArgs {
    /// The layout: `oci:DIR` or `s3://BUCKET/PREFIX` (whole: to drop a tag, --untag it).
    #[arg(value_name = "oci:DIR|s3://BUCKET/PREFIX")]
    layout: PathBuf,
    /// Remove this tag first (repeatable): what only it needed is deleted too.
    #[arg(long, value_name = "TAG")]
    untag: Vec<String>,
    /// Keep what no tag needs if it was written within this long: an export running now may
    /// be about to name it. Under 1h, a layer an export running now reuses may be deleted;
    /// `0` when none runs.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = parse_grace)]
    grace: Duration,
    /// Say what would be deleted, and delete nothing.
    #[arg(long)]
    dry_run: bool,
}

/// A duration, or `0`.
fn parse_grace(s: &str) -> Result<Duration, String> {
    match s {
        "0" => Ok(Duration::ZERO),
        _ => super::run::parse_duration(s),
    }
}

/// Reports progress on stderr at most about once a second.
struct Progress {
    verb: &'static str,
    total: Option<u64>,
    last: Instant,
    shown: bool,
    /// Whether it says anything at all.
    on: bool,
}

impl Progress {
    fn new(verb: &'static str, total: Option<u64>) -> Self {
        Self {
            verb,
            total,
            last: Instant::now(),
            shown: false,
            on: true,
        }
    }

    /// This progress, silent unless `on`.
    fn silent_unless(self, on: bool) -> Self {
        Self { on, ..self }
    }

    fn tick(&mut self, bytes: u64) {
        if !self.on || self.last.elapsed().as_secs_f64() < 1.0 {
            return;
        }
        self.last = Instant::now();
        self.shown = true;
        match self.total {
            Some(t) if t > 0 => eprintln!(
                "ferry: {} {} of {} MiB ({}%)",
                self.verb,
                bytes >> 20,
                t >> 20,
                bytes * 100 / t
            ),
            _ => eprintln!("ferry: {} {} MiB", self.verb, bytes >> 20),
        }
    }
}

/// A file written front to back whose pages are handed to the disk as it goes (every
/// [`WRITE_BACK`] bytes, `sync_file_range`), so the `fsync` that ends an export finds little
/// left to write: the disk writes while the rest is read and encoded.
struct WritingBack<'a> {
    file: &'a std::fs::File,
    written: u64,
    /// Where the range not yet handed to the disk starts.
    started: u64,
}

/// Bytes written between two hand-overs to the disk.
const WRITE_BACK: u64 = 32 << 20;

impl Write for WritingBack<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written += n as u64;
        if self.written - self.started >= WRITE_BACK {
            use std::os::fd::AsRawFd;
            // SAFETY: a plain syscall on an open descriptor; it reads no memory of ours. A
            // failure only means the final `fsync` writes more.
            unsafe {
                libc::sync_file_range(
                    self.file.as_raw_fd(),
                    self.started as i64,
                    (self.written - self.started) as i64,
                    libc::SYNC_FILE_RANGE_WRITE,
                )
            };
            self.started = self.written;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// The digests of the capsules this store's exports built, by what each held (the store's
/// cache file `oci-layers`, at most [`LayerCache::MOST`] entries, newest last): an export
/// to a layout that holds such a capsule already does not build it again.
struct LayerCache {
    /// Entries read, then those added, by fingerprint.
    entries: Vec<(Kappa, super::oci::Built)>,
    /// The fingerprint of each part of this export.
    parts: std::collections::HashMap<super::oci::Part, Kappa>,
    changed: bool,
}

impl LayerCache {
    const FILE: &str = "oci-layers";
    const MOST: usize = 4096;

    /// What a part's capsule is made of: its root and objects in order, and the version of
    /// ferry that made it.
    fn fingerprint(root: Kappa, objects: &[Kappa]) -> Kappa {
        let mut b = Vec::with_capacity(64 + 32 * objects.len());
        b.extend_from_slice(b"ferry oci layer ");
        b.extend_from_slice(env!("CARGO_PKG_VERSION").as_bytes());
        b.extend_from_slice(&capsule::CAPSULE_VERSION.to_le_bytes());
        b.extend_from_slice(root.as_bytes());
        for k in objects {
            b.extend_from_slice(k.as_bytes());
        }
        Kappa::of(&b)
    }

    fn load(
        store: &ferry_store::FsStore,
        parts: impl Iterator<Item = (super::oci::Part, Kappa)>,
    ) -> Self {
        use ferry_store::Store;
        let text = store.load_cache(Self::FILE).unwrap_or_default();
        let entries = String::from_utf8_lossy(&text)
            .lines()
            .filter_map(|l| {
                let w: Vec<&str> = l.split(' ').collect();
                let [fp, hex, len, objects, bytes, stored] = w[..] else {
                    return None;
                };
                let n = |s: &str| s.parse::<u64>().ok();
                (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())?;
                Some((
                    fp.parse::<Kappa>().ok()?,
                    super::oci::Built {
                        hex: hex.to_owned(),
                        len: n(len)?,
                        stats: capsule::CapsuleStats {
                            objects: n(objects)?,
                            bytes: n(bytes)?,
                            stored_bytes: n(stored)?,
                            new_objects: 0,
                        },
                    },
                ))
            })
            .collect();
        Self {
            entries,
            parts: parts.collect(),
            changed: false,
        }
    }

    /// Writes the entries back (the newest [`LayerCache::MOST`]) if this export added any;
    /// a cache that cannot be written only costs the next export time.
    fn save(&self, store: &ferry_store::FsStore) {
        use ferry_store::Store;
        if !self.changed {
            return;
        }
        let skip = self.entries.len().saturating_sub(Self::MOST);
        let text: String = self.entries[skip..]
            .iter()
            .map(|(fp, b)| {
                format!(
                    "{} {} {} {} {} {}\n",
                    fp, b.hex, b.len, b.stats.objects, b.stats.bytes, b.stats.stored_bytes
                )
            })
            .collect();
        if let Err(e) = store.save_cache(Self::FILE, text.as_bytes()) {
            tracing::warn!("cannot write the cache of exported layers: {e}");
        }
    }
}

impl super::oci::Known for LayerCache {
    fn get(&self, part: super::oci::Part) -> Option<super::oci::Built> {
        let fp = self.parts.get(&part)?;
        self.entries
            .iter()
            .rev()
            .find(|(k, _)| k == fp)
            .map(|(_, b)| b.clone())
    }

    fn put(&mut self, part: super::oci::Part, built: &super::oci::Built) {
        if let Some(fp) = self.parts.get(&part) {
            self.entries.retain(|(k, _)| k != fp);
            self.entries.push((*fp, built.clone()));
            self.changed = true;
        }
    }
}

/// The snapshot `root` loaded (refused if it could not be resumed: its closure must be
/// complete and verify) and its closure (with its ancestors if `with_history`), the memory
/// chunks first, in memory order: the importer packs them so.
fn closure_of(
    store: &ferry_store::FsStore,
    root: Kappa,
    with_history: bool,
) -> Result<(snapshot::Loaded, Vec<Kappa>)> {
    let loaded = snapshot::load(store, root).with_context(|| format!("cannot export {root}"))?;
    let mut closure = BTreeSet::new();
    snapshot_closure(store, &root, with_history, &mut closure)?;
    let mut objects: Vec<_> = closure.into_iter().collect();
    moving_order(&root, loaded.chunks().copied(), &mut objects);
    Ok((loaded, objects))
}

/// Exports snapshot `root` (with its ancestors if `with_history`) as an OCI layout at `r` — a
/// directory or a bucket — and says what it did ("exported κ to …"); with `show_progress`,
/// says how far it has come every second on stderr. `claim`: a run's hold on its tag
/// ([`super::oci::Claim`]).
pub fn export_layout(
    store: &ferry_store::FsStore,
    root: Kappa,
    with_history: bool,
    r: &super::oci::OciRef,
    show_progress: bool,
    claim: Option<&mut super::oci::Claim>,
) -> Result<String> {
    let (loaded, objects) = closure_of(store, root, with_history)?;
    // The program (the same for every snapshot of it: a registry keeps it once), the
    // memory region by region (a region that did not change is the same layer), then
    // the rest.
    let program: Vec<_> = [loaded.snapshot.module, loaded.snapshot.instrumented]
        .into_iter()
        .filter(|k| objects.contains(k))
        .collect();
    let regions = memory_regions(&loaded, &program);
    let mut taken: HashSet<Kappa> = program.iter().copied().collect();
    taken.extend(regions.iter().flatten().copied());
    let files = file_groups(
        store,
        &loaded,
        &taken,
        super::oci::MAX_LAYERS - 2 - regions.len(),
    )?;
    taken.extend(files.iter().flatten().copied());
    let state: Vec<_> = objects
        .iter()
        .copied()
        .filter(|k| !taken.contains(k))
        .collect();
    let parts: Vec<_> = std::iter::once(super::oci::Part::Program)
        .chain((0..regions.len() as u32).map(super::oci::Part::Memory))
        .chain((0..files.len() as u32).map(super::oci::Part::Files))
        .chain([super::oci::Part::State])
        .collect();
    let holds = |part| match part {
        super::oci::Part::Program => (loaded.snapshot.module, &program),
        super::oci::Part::Memory(n) => {
            let chunks = &regions[n as usize];
            (chunks[0], chunks)
        }
        super::oci::Part::Files(n) => {
            let group = &files[n as usize];
            (group[0], group)
        }
        super::oci::Part::State => (root, &state),
    };
    let mut known = LayerCache::load(
        store,
        parts.iter().map(|&p| {
            let (part_root, part_objects) = holds(p);
            (p, LayerCache::fingerprint(part_root, part_objects))
        }),
    );
    let mut progress = Progress::new("exported", None).silent_unless(show_progress);
    let mut done = 0;
    let started = Instant::now();
    let mut sending = Progress::new("sent", None).silent_unless(show_progress);
    let exported = super::oci::export(
        r,
        &root,
        &parts,
        |part, w| {
            let (part_root, part_objects) = holds(part);
            let s = capsule::export(store, part_root, part_objects, w, &mut |b| {
                progress.tick(done + b)
            })?;
            done += s.stored_bytes;
            Ok(s)
        },
        &mut known,
        &mut |b| sending.tick(b),
        claim,
    )?;
    known.save(store);
    let mut total = capsule::CapsuleStats::default();
    for s in &exported.results {
        total += *s;
    }
    // In a bucket, what it held already was not sent again; what an earlier export of this
    // store built, and the layout holds, was not even built.
    let reused = match exported.reused_layers {
        0 => String::new(),
        n => format!(" ({n} known from earlier exports: not built again)"),
    };
    let sent = match r.place {
        super::oci::Place::Dir(_) if exported.reused_layers > 0 => format!(
            "; {} of its {} layers held by the layout already: not written again",
            exported.reused_layers,
            exported.results.len()
        ),
        super::oci::Place::Dir(_) => String::new(),
        super::oci::Place::Bucket(_) => match (exported.sent_layers, exported.results.len()) {
            (0, n) => format!("; the bucket held all {n} layers already: none sent{reused}"),
            (k, n) if k == n => format!(
                "; sent all {n} layers ({:.1} MiB)",
                crate::cmd::mib(exported.sent_bytes)
            ),
            (k, n) => format!(
                "; sent {k} of its {n} layers ({:.1} MiB), the bucket held the rest{reused}",
                crate::cmd::mib(exported.sent_bytes)
            ),
        },
    };
    Ok(format!(
        "exported {root} to {} (manifest {}): {} objects, {:.1} MiB of data in \
         {:.1} MiB{sent}, {:.1} s",
        r.describe(&exported.tag),
        exported.manifest,
        total.objects,
        crate::cmd::mib(total.bytes),
        crate::cmd::mib(total.stored_bytes),
        started.elapsed().as_secs_f64()
    ))
}

pub fn export(settings: &Settings, a: ExportArgs) -> Result<ExitCode> {
    let store = settings.open_store()?;
    let root = crate::session::snapshot_named(settings, &store, &a.snapshot, true)
        .map_err(anyhow::Error::msg)?;
    if let Some(r) = super::oci::OciRef::parse(a.output.as_os_str()) {
        let said = export_layout(&store, root, a.with_history, &r?, true, None)
            .with_context(|| format!("cannot export {root} to {}", a.output.display()))?;
        eprintln!("ferry: {said}");
        return Ok(ExitCode::SUCCESS);
    }
    let (_, objects) = closure_of(&store, root, a.with_history)?;
    // `-o -`: straight to stdout (no temporary file: a reader that gets less than all of it
    // refuses it as truncated). Otherwise to FILE.ferry-partial, renamed once durable.
    let to_stdout = a.output.as_os_str() == "-";
    if to_stdout && std::io::stdout().is_terminal() {
        anyhow::bail!(
            "a capsule is binary: not writing it to a terminal (redirect or pipe stdout, or \
             give -o FILE)"
        );
    }
    if !to_stdout && a.output.is_dir() {
        anyhow::bail!(
            "{} is a directory: give the capsule a file name (-o {}/NAME.ferry)",
            a.output.display(),
            a.output.display()
        );
    }
    let tmp = a.output.with_extension("ferry-partial");
    let file = match to_stdout {
        true => None,
        false => Some(
            std::fs::File::create(&tmp)
                .with_context(|| format!("cannot create {}", tmp.display()))?,
        ),
    };
    let out: Box<dyn Write> = match &file {
        Some(f) => Box::new(BufWriter::with_capacity(
            1 << 20,
            WritingBack {
                file: f,
                written: 0,
                started: 0,
            },
        )),
        None => Box::new(BufWriter::with_capacity(1 << 20, std::io::stdout().lock())),
    };
    let mut progress = Progress::new("exported", None);
    let started = Instant::now();
    let written = capsule::export(&store, root, &objects, out, &mut |b| progress.tick(b));
    let stats = match written {
        Ok(s) => s,
        Err(e) if to_stdout => return Err(e).context("cannot write the capsule to stdout"),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
    };
    if let Some(file) = file {
        let done = file
            .sync_all()
            .and_then(|()| std::fs::rename(&tmp, &a.output));
        if let Err(e) = done {
            let _ = std::fs::remove_file(&tmp);
            return Err(e).with_context(|| format!("cannot write {}", a.output.display()));
        }
    }
    eprintln!(
        "ferry: exported {root} to {}: {} objects, {:.1} MiB of data in {:.1} MiB, {:.1} s",
        if to_stdout {
            "stdout".into()
        } else {
            a.output.display().to_string()
        },
        stats.objects,
        crate::cmd::mib(stats.bytes),
        crate::cmd::mib(stats.stored_bytes),
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

/// Bytes of guest memory one OCI layer holds at most (doubled until the regions take at most
/// half of [`super::oci::MAX_LAYERS`]): small enough that a guest changing a corner of a big memory
/// sends little, large enough that a registry is not asked for thousands of blobs.
const REGION: u64 = 32 << 20;

/// The snapshot's memory chunks in regions of [`REGION`] bytes of each memory, in address
/// order, each chunk in the first region that holds it (none that `program` holds), empty
/// regions left out: each region's chunks are one layer of an OCI export, the same bytes in
/// every snapshot in which they are the same.
fn memory_regions(loaded: &snapshot::Loaded, program: &[Kappa]) -> Vec<Vec<Kappa>> {
    let mut region = REGION;
    loop {
        let mut seen: HashSet<&Kappa> = program.iter().collect();
        let mut regions: Vec<Vec<Kappa>> = Vec::new();
        let mut current = None;
        for (memory, at, k) in loaded.chunks_at() {
            if !seen.insert(k) {
                continue;
            }
            if current != Some((memory, at / region)) {
                current = Some((memory, at / region));
                regions.push(Vec::new());
            }
            regions.last_mut().expect("pushed").push(*k);
        }
        if regions.len() <= (super::oci::MAX_LAYERS - 2) / 2 {
            return regions;
        }
        region *= 2;
    }
}

/// Bytes of mounted files one OCI layer holds on average.
const FILES_GROUP: u64 = 16 << 20;

/// The objects holding the bytes of the snapshot's mounted files (whole files, and chunked
/// ones with their chunks; none in `taken`), in groups that are the same in every snapshot
/// whose files are: in κ order, a group ends after an object with a probability of its size
/// over [`FILES_GROUP`], decided by its κ (and after 4 × `FILES_GROUP` bytes in any case).
/// A changed file then changes the group its old content was in and the one its new
/// content goes to, not the others. At most `most` groups (the average doubled until they
/// fit). Sizes come from the store's index ([`ferry_store::Store::len_of`]), else from
/// reading the object: they only place the group ends, and the capsule checks every object.
fn file_groups(
    store: &dyn ferry_store::Store,
    loaded: &snapshot::Loaded,
    taken: &HashSet<Kappa>,
    most: usize,
) -> Result<Vec<Vec<Kappa>>> {
    use ferry_object::{FileChunks, Tree};
    let decode_err = |k: &Kappa, e: String| anyhow::anyhow!("object {k} of a mounted tree: {e}");
    let mut data: std::collections::BTreeMap<Kappa, u64> = Default::default();
    let len = |k: &Kappa| -> Result<u64> {
        Ok(match store.len_of(k) {
            Some(n) => n,
            None => store.get(k)?.len() as u64,
        })
    };
    let mut todo: Vec<(Kappa, usize)> = loaded
        .wasi
        .mounts
        .iter()
        .filter(|m| !m.host_bound)
        .map(|m| (m.tree, 0))
        .collect();
    // A subtree held in several places (two directories alike) is one object: walked once.
    let mut walked = HashSet::new();
    while let Some((k, depth)) = todo.pop() {
        if !walked.insert(k) {
            continue;
        }
        if depth > ferry_wasi::tree::MAX_DEPTH {
            anyhow::bail!(
                "a mounted tree nested deeper than {} directories",
                ferry_wasi::tree::MAX_DEPTH
            );
        }
        let tree: Tree =
            ferry_object::decode(&store.get(&k)?).map_err(|e| decode_err(&k, e.to_string()))?;
        for e in tree.entries.values() {
            match e.mode.as_str() {
                ferry_object::MODE_DIR => todo.push((e.object, depth + 1)),
                ferry_object::MODE_FILE | ferry_object::MODE_EXEC => {
                    let n = len(&e.object)?;
                    data.insert(e.object, n);
                }
                ferry_object::MODE_FILE_CHUNKS | ferry_object::MODE_EXEC_CHUNKS => {
                    let bytes = store.get(&e.object)?;
                    let f: FileChunks = ferry_object::decode(&bytes)
                        .map_err(|err| decode_err(&e.object, err.to_string()))?;
                    data.insert(e.object, bytes.len() as u64);
                    for c in &f.chunks {
                        let n = len(c)?;
                        data.insert(*c, n);
                    }
                }
                _ => {}
            }
        }
    }
    data.retain(|k, _| !taken.contains(k));
    let mut target = FILES_GROUP;
    loop {
        let mut groups = Vec::new();
        let (mut group, mut bytes) = (Vec::new(), 0u64);
        for (k, n) in &data {
            group.push(*k);
            bytes += n;
            let draw = u64::from_le_bytes(k.as_bytes()[..8].try_into().expect("8 bytes"));
            let ends = u128::from(draw) * u128::from(target) < u128::from(*n) << 64;
            if ends || bytes >= 4 * target {
                groups.push(std::mem::take(&mut group));
                bytes = 0;
            }
        }
        if !group.is_empty() {
            groups.push(group);
        }
        if groups.len() <= most {
            return Ok(groups);
        }
        target *= 2;
    }
}

/// Imports the OCI layout at `r` — a directory or a bucket — into `store`: every layer's
/// capsule, checked; returns the snapshot its manifest names (not yet named in the store:
/// see [`imported`]).
/// What an import from a layout brought: the snapshot, what the capsules held, and the tag
/// read with its epoch.
#[derive(Debug)]
pub struct FromLayout {
    pub root: Kappa,
    pub stats: capsule::CapsuleStats,
    pub tag: Option<String>,
    pub epoch: u64,
}

pub fn import_layout(store: &ferry_store::FsStore, r: &super::oci::OciRef) -> Result<FromLayout> {
    let artifact = super::oci::open(r)?;
    let mut progress = Progress::new("imported", Some(artifact.size()));
    let mut done = 0;
    let mut roots = Vec::new();
    let mut stats = capsule::CapsuleStats::default();
    for i in 0..artifact.len() {
        let mut cin = artifact.capsule(i)?;
        let (root, s) = capsule::import(&mut cin.reader, store, &mut |b| progress.tick(done + b))?;
        done += cin.size;
        cin.check()?;
        roots.push(root);
        stats += s;
    }
    // The snapshot is the one the manifest names (else the last layer's root), and a
    // layer must hold it.
    let root = match artifact.snapshot.as_deref() {
        Some(named) => *roots
            .iter()
            .find(|k| k.to_string() == named)
            .with_context(|| {
                let mut held: Vec<_> = roots.iter().take(3).map(|k| k.to_string()).collect();
                if roots.len() > 3 {
                    held.push(format!("{} more", roots.len() - 3));
                }
                format!(
                    "its manifest names the snapshot {named}, but no layer holds it (they \
                     hold {})",
                    held.join(", ")
                )
            })?,
        None => *roots.last().expect("at least one layer"),
    };
    Ok(FromLayout {
        root,
        stats,
        tag: artifact.tag.clone(),
        epoch: artifact.epoch,
    })
}

pub fn import(settings: &Settings, a: ImportArgs) -> Result<ExitCode> {
    let store = settings.open_store()?;
    if let Some(r) = super::oci::OciRef::parse(a.capsule.as_os_str()) {
        let name = a.capsule.display().to_string();
        let r = r?;
        super::oci::lease::say_if_copy(&r);
        let from = import_layout(&store, &r).with_context(|| format!("cannot import {name}"))?;
        return imported(&store, from.root, from.stats, &name);
    }
    let (input, total, name): (Box<dyn std::io::Read>, _, _) = if a.capsule.as_os_str() == "-" {
        let name = "the capsule on stdin".to_owned();
        (Box::new(std::io::stdin().lock()), None, name)
    } else {
        let file = std::fs::File::open(&a.capsule)
            .with_context(|| format!("cannot open {}", a.capsule.display()))?;
        let total = file.metadata().map(|m| m.len()).ok();
        (Box::new(file), total, a.capsule.display().to_string())
    };
    let mut progress = Progress::new("imported", total);
    let (root, stats) =
        capsule::import(BufReader::with_capacity(1 << 20, input), &store, &mut |b| {
            progress.tick(b)
        })
        .with_context(|| format!("cannot import {name}"))?;
    imported(&store, root, stats, &name)
}

/// `ferry resume s3://…` (or `oci:…`): the layout at `r` imported into `store`, its
/// snapshot's closure loaded and verified, then named, and said on stderr (stdout is the
/// guest's); returns the snapshot.
pub fn import_for_resume(
    store: &ferry_store::FsStore,
    r: &super::oci::OciRef,
    name: &str,
) -> Result<FromLayout> {
    let from = import_layout(store, r).with_context(|| format!("cannot import {name}"))?;
    load_and_name(store, from.root, name)?;
    eprintln!(
        "ferry: imported {} from {name} ({} objects, {} new, {:.1} MiB)",
        from.root,
        from.stats.objects,
        from.stats.new_objects,
        crate::cmd::mib(from.stats.bytes)
    );
    Ok(from)
}

/// The imported snapshot `root` (from `name`) loaded, then named: the closure must be
/// complete and verify before anything names it.
fn load_and_name(
    store: &ferry_store::FsStore,
    root: Kappa,
    name: &str,
) -> Result<snapshot::Loaded> {
    let loaded = snapshot::load(store, root)
        .with_context(|| format!("{name} holds an incomplete snapshot"))?;
    snapshot::name(store, root)?;
    Ok(loaded)
}

/// The end of an import: the snapshot's closure loaded and verified, then named.
fn imported(
    store: &ferry_store::FsStore,
    root: ferry_kappa::Kappa,
    stats: capsule::CapsuleStats,
    name: &str,
) -> Result<ExitCode> {
    let loaded = load_and_name(store, root, name)?;
    println!("imported {root}");
    eprintln!(
        "ferry: {} objects ({} new, {:.1} MiB); {}",
        stats.objects,
        stats.new_objects,
        crate::cmd::mib(stats.bytes),
        resume_hint(&loaded)
    );
    Ok(ExitCode::SUCCESS)
}

/// "resume it with `ferry resume …`" for a snapshot brought from elsewhere: mounts are the
/// destination's to grant, so it names each guest path to give a directory for (a Python
/// runtime's standard library is granted by resume itself).
pub fn resume_hint(loaded: &snapshot::Loaded) -> String {
    let grants: String = loaded
        .wasi
        .mounts
        .iter()
        .filter(|m| m.guest_path != crate::cmd::python::STDLIB_GUEST)
        .map(|m| {
            format!(
                "--dir {} ",
                crate::guest::shell_word(&format!("HOST::{}", m.guest_path))
            )
        })
        .collect();
    format!(
        "resume it with `ferry resume {grants}{}`",
        loaded.kappa.fmt_short()
    )
}

pub fn prune(a: PruneArgs) -> Result<ExitCode> {
    let r = match super::oci::OciRef::parse(a.layout.as_os_str()) {
        Some(r) => r?,
        None => anyhow::bail!(
            "`{}` is not a layout: give oci:DIR or s3://BUCKET/PREFIX",
            a.layout.display()
        ),
    };
    if let Some(t) = &r.tag {
        anyhow::bail!(
            "prune takes a whole layout, not a tag: to drop tag `{t}` and what only it needs, \
             `ferry prune {} --untag {t}`",
            super::oci::OciRef {
                tag: None,
                ..r.clone()
            }
            .name()
        );
    }
    if a.grace < super::oci::SAFE_GRACE && !a.dry_run {
        eprintln!(
            "ferry: note: with a grace under {}, a layer that an export to this layout running \
             now reuses may be deleted (docs/format.md, \"Pruning a layout\")",
            duration_text(super::oci::SAFE_GRACE)
        );
    }
    let mut last = Instant::now();
    let pruned = super::oci::prune(&r.place, &a.untag, a.grace, a.dry_run, &mut |n| {
        if last.elapsed().as_secs_f64() >= 1.0 {
            last = Instant::now();
            eprintln!("ferry: deleted {n} blobs");
        }
    })
    .with_context(|| format!("cannot prune {}", r.name()))?;
    let blobs = |(n, bytes): (usize, u64)| {
        format!(
            "{n} blob{} ({:.1} MiB)",
            if n == 1 { "" } else { "s" },
            crate::cmd::mib(bytes)
        )
    };
    let untagged = match pruned.untagged.as_slice() {
        [] => String::new(),
        tags => format!(
            "{} tag{} {}, ",
            if a.dry_run { "would remove" } else { "removed" },
            if tags.len() == 1 { "" } else { "s" },
            tags.iter()
                .map(|t| format!("`{t}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let spared = match pruned.spared {
        0 => String::new(),
        n => format!("; kept {n} that an export wrote again while this ran"),
    };
    let young = match a.grace.is_zero() {
        true => String::new(),
        false => format!(
            " and {} written in the last {}",
            blobs(pruned.young),
            duration_text(a.grace)
        ),
    };
    eprintln!(
        "ferry: {}: {untagged}{} {}; kept {} that its {} tag{} need{}{young}{spared}",
        r.name(),
        if a.dry_run { "would delete" } else { "deleted" },
        blobs(pruned.deleted),
        blobs(pruned.referenced),
        pruned.tags,
        if pruned.tags == 1 { "" } else { "s" },
        if pruned.tags == 1 { "s" } else { "" },
    );
    Ok(ExitCode::SUCCESS)
}

/// `d` as it would be given: `1h`, `90m`, `30s`, `250ms`.
fn duration_text(d: Duration) -> String {
    let (s, ms) = (d.as_secs(), d.subsec_millis());
    match (s, ms) {
        (0, ms) => format!("{ms}ms"),
        (s, 0) if s % 3600 == 0 => format!("{}h", s / 3600),
        (s, 0) if s % 60 == 0 => format!("{}m", s / 60),
        (s, 0) => format!("{s}s"),
        _ => format!("{}ms", d.as_millis()),
    }
}
