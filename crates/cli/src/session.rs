//! Local sessions: one per `ferry run` lineage, recorded as a small JSON file (for `ps` and
//! signalling) and a ref `session/<id>` naming its latest snapshot.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde_json::json;

use crate::replay::OutputMark;
use crate::settings::Settings;

/// What `ps` shows about a session.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: String,
    pub program: String,
    pub pid: u32,
    pub state: String,
    pub memory: u64,
    pub last_snapshot: Option<String>,
    /// Where ferry's output files ended when `last_snapshot` was recorded.
    pub outputs: Vec<OutputMark>,
    /// The line the guest had begun on its terminal (stdout or stderr) and not ended at
    /// `last_snapshot` (a prompt): shown again when that snapshot is resumed on a terminal.
    pub prompt: String,
    /// The stream (1 or 2) that wrote it.
    pub prompt_fd: i32,
    /// Why the last snapshot asked for failed (a full disk), while none has succeeded since.
    pub snapshot_error: Option<String>,
    /// How many snapshots of this run failed: `ferry suspend` and `ferry checkpoint` watch it
    /// to report a failure instead of waiting for a snapshot that will not come.
    pub snapshot_failures: u64,
    /// When the record was last written (it started, took a snapshot, ended), as [`load`]
    /// found it; `None` for a record not saved yet. Not part of the record itself.
    pub updated: Option<std::time::SystemTime>,
}

impl Session {
    /// Its program ran to its end (`exited(N)`): nothing left to resume or stop.
    pub fn exited(&self) -> bool {
        self.state.starts_with("exited")
    }

    /// The state to show: a session recorded as running whose process is gone (no one holds
    /// its lease: `running` is false) is `lost`.
    pub fn shown_state(&self, running: bool) -> &str {
        if self.state == "running" && !running {
            "lost"
        } else {
            &self.state
        }
    }
}

/// The last snapshot of the local session `what` names, if it names one (a `blake3:` κ never
/// does; a session id wins over a κ prefix spelled the same). An error, saying why, when that
/// session has no snapshot, or (unless `exited_ok`) ran to its end: nothing to continue.
pub fn named_snapshot(
    settings: &Settings,
    what: &str,
    exited_ok: bool,
) -> Result<Option<String>, String> {
    if what.starts_with("blake3:") || checked_id(what).is_err() {
        return Ok(None);
    }
    let Ok(s) = load(settings, what) else {
        return Ok(None);
    };
    match &s.last_snapshot {
        Some(_) if s.exited() && !exited_ok => Err(format!(
            "session `{what}` ran to its end ({}); nothing to continue (`ferry ps --all`)",
            s.state
        )),
        Some(k) => Ok(Some(k.clone())),
        None => Err(format!(
            "session `{what}` has no snapshot (state: {})",
            s.shown_state(holder(settings, what).is_some())
        )),
    }
}

/// The snapshot `what` names for `resume`, `inspect`, `export` and `push`: a session id (its
/// last snapshot; once it has exited only if `exited_ok`, see [`named_snapshot`]) or a κ or
/// unique κ prefix. The error says why, for the caller to wrap.
pub fn snapshot_named(
    settings: &Settings,
    store: &dyn ferry_store::Store,
    what: &str,
    exited_ok: bool,
) -> Result<ferry_kappa::Kappa, String> {
    let named = named_snapshot(settings, what, exited_ok)?;
    store
        .resolve(named.as_deref().unwrap_or(what))
        .map_err(|e| unresolved(what, e))
}

/// What is said when `what` named no session (see [`named_snapshot`]) and the store could
/// not resolve it as a κ either (`e`): a word that could be a session id is named as one
/// too, so a mistyped session is not reported as a bad κ alone.
fn unresolved(what: &str, e: ferry_store::StoreError) -> String {
    if what.starts_with("blake3:") || checked_id(what).is_err() {
        e.to_string()
    } else {
        format!("no session `{what}` (`ferry ps --all` lists them), and {e}")
    }
}

/// Version of the session record (`sessions/<id>.json`).
const FORMAT_VERSION: u32 = 1;

fn path(settings: &Settings, id: &str) -> PathBuf {
    settings.sessions_dir().join(format!("{id}.json"))
}

fn lock_path(settings: &Settings, id: &str) -> PathBuf {
    settings.sessions_dir().join(format!("{id}.lock"))
}

/// `id` if it can name a session: 1–64 of `[A-Za-z0-9_-]`, the rule a space applies too (it
/// names files, so nothing else may reach the file system).
pub fn checked_id(id: &str) -> Result<&str> {
    ferry_space::api::session_id(id).map_err(|e| anyhow::anyhow!(e.msg))
}

/// A process's claim to run a session: an exclusive POSIX record lock on
/// `sessions/<id>.lock`, held for as long as the process lives. The kernel drops it when the
/// process ends, however it ends, so a lease never outlives its holder and another process
/// can ask who holds it ([`holder`]) without trusting a recorded pid. (A POSIX lock is also
/// dropped when its process closes *any* descriptor of the file, so the holding process never
/// opens the lock file a second time: [`holder`] is for other processes.)
///
/// A session that never got a record (a run refused before it started) leaves no lock file
/// behind: the lease removes it when dropped, still holding the lock. A process that opened
/// the file before it went then holds a lock on a file no path names, so [`lease`] checks,
/// once it holds the lock, that the path still leads to its file, and starts again if not.
#[derive(Debug)]
pub struct Lease {
    _file: File,
    lock: PathBuf,
    record: PathBuf,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // `_file` (and with it the lock) is closed after this, when the fields drop.
        if !self.record.exists() {
            let _ = std::fs::remove_file(&self.lock);
        }
    }
}

/// Whether `file` is the file `path` names now (same device and inode).
fn still_named(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

fn lock_file(settings: &Settings, id: &str, create: bool) -> std::io::Result<File> {
    if create {
        let dir = settings.sessions_dir();
        std::fs::create_dir_all(&dir)?;
    }
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .open(lock_path(settings, id))
}

fn write_lock() -> libc::flock {
    // SAFETY: `flock` is plain old data; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl
}

/// Takes session `id`'s lease, or says which process holds it (`Err(pid)`).
pub fn lease(settings: &Settings, id: &str) -> Result<std::result::Result<Lease, u32>> {
    let lock = lock_path(settings, id);
    loop {
        let file =
            lock_file(settings, id, true).with_context(|| format!("opening {}", lock.display()))?;
        let fl = write_lock();
        // SAFETY: a valid descriptor and a valid `flock` for the duration of the call.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLK, &fl) } == 0 {
            if !still_named(&file, &lock) {
                continue; // removed by its last holder meanwhile (see `Lease`)
            }
            return Ok(Ok(Lease {
                _file: file,
                lock,
                record: path(settings, id),
            }));
        }
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EACCES | libc::EAGAIN) => Ok(Err(holder(settings, id).unwrap_or(0))),
            _ => Err(e).with_context(|| format!("locking {}", lock.display())),
        };
    }
}

/// The process running session `id`, if one does (it holds the session's lease).
pub fn holder(settings: &Settings, id: &str) -> Option<u32> {
    let file = lock_file(settings, id, false).ok()?;
    let mut fl = write_lock();
    // SAFETY: a valid descriptor and a valid `flock` the call fills in.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETLK, &mut fl) } != 0
        || fl.l_type == libc::F_UNLCK as libc::c_short
    {
        return None;
    }
    // A holder in another pid namespace reads as pid 0: running, pid unknown here.
    Some(u32::try_from(fl.l_pid).unwrap_or(0))
}

/// A new session: an id of 8 random hex digits no session has had yet, and its lease.
pub fn fresh(settings: &Settings) -> Result<(String, Lease)> {
    loop {
        let id = format!("{:08x}", rand::random::<u32>());
        if let Ok(lease) = lease(settings, &id)?
            && !path(settings, &id).exists()
        {
            return Ok((id, lease));
        }
    }
}

pub fn save(settings: &Settings, s: &Session) -> Result<()> {
    let dir = settings.sessions_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let v = json!({
        "format": "ferry.session", "v": FORMAT_VERSION,
        "id": s.id, "program": s.program, "pid": s.pid, "state": s.state,
        "memory": s.memory, "last_snapshot": s.last_snapshot,
        "outputs": s.outputs.iter().map(|m| json!({
            "fd": m.fd, "dev": m.dev, "ino": m.ino, "end": m.end, "tail": m.tail,
        })).collect::<Vec<_>>(),
        "prompt": s.prompt, "prompt_fd": s.prompt_fd,
        "snapshot_error": s.snapshot_error, "snapshot_failures": s.snapshot_failures,
    });
    let p = path(settings, &s.id);
    // Each writer its own temporary file: `ferry ps` may read while a session writes.
    let tmp = p.with_extension(format!("{}.tmp", std::process::id()));
    let bytes = serde_json::to_vec_pretty(&v)?;
    // Durable before it replaces the record, and the replacement too, as the store's refs
    // are: after a power cut the record names the snapshot its ref does (or, cut between
    // the two, the next one; see `guest::record`), never an older one or nothing.
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| {
            std::io::Write::write_all(&mut f, &bytes)?;
            f.sync_data()
        })
        .and_then(|()| std::fs::rename(&tmp, &p))
        .and_then(|()| std::fs::File::open(&dir)?.sync_all());
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.with_context(|| format!("writing the session record {}", p.display()))
}

pub fn load(settings: &Settings, id: &str) -> Result<Session> {
    let p = path(settings, id);
    let bytes = std::fs::read(&p).with_context(|| format!("no session `{id}` (see `ferry ps`)"))?;
    let v: serde_json::Value =
        serde_json::from_slice(&bytes).with_context(|| format!("reading {}", p.display()))?;
    // Records written before the version field are version 1.
    let version = v["v"].as_u64().unwrap_or(1);
    if version > u64::from(FORMAT_VERSION) {
        bail!(
            "{} is session record version {version}; this ferry reads up to {FORMAT_VERSION} \
             (a newer ferry wrote it)",
            p.display()
        );
    }
    Ok(Session {
        id: v["id"].as_str().unwrap_or(id).to_owned(),
        program: v["program"].as_str().unwrap_or("?").to_owned(),
        pid: v["pid"].as_u64().unwrap_or(0) as u32,
        state: v["state"].as_str().unwrap_or("?").to_owned(),
        memory: v["memory"].as_u64().unwrap_or(0),
        last_snapshot: v["last_snapshot"].as_str().map(str::to_owned),
        outputs: v["outputs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|m| {
                        Some(OutputMark {
                            fd: i32::try_from(m["fd"].as_i64()?).ok()?,
                            dev: m["dev"].as_u64()?,
                            ino: m["ino"].as_u64()?,
                            end: m["end"].as_u64()?,
                            tail: m["tail"].as_u64().unwrap_or(0),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default(),
        prompt: v["prompt"].as_str().unwrap_or_default().to_owned(),
        prompt_fd: v["prompt_fd"]
            .as_i64()
            .map_or(1, |fd| if fd == 2 { 2 } else { 1 }),
        snapshot_error: v["snapshot_error"].as_str().map(str::to_owned),
        snapshot_failures: v["snapshot_failures"].as_u64().unwrap_or(0),
        updated: std::fs::metadata(&p).and_then(|m| m.modified()).ok(),
    })
}

/// Deletes session `id`'s record and lock file (its lease must be held by the caller).
pub fn remove(settings: &Settings, id: &str) -> Result<()> {
    for p in [
        path(settings, id),
        lock_path(settings, id),
        export_path(settings, id),
    ] {
        match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", p.display()));
            }
            _ => {}
        }
    }
    Ok(())
}

/// How a run's `--export-to` goes, as `ferry ps` shows it: kept beside the session's record
/// (`ID.export`), written by the run's export thread only.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExportStatus {
    /// Where to (`s3://BUCKET/PREFIX:TAG`, `oci:DIR:TAG`).
    pub to: String,
    /// The snapshot last exported there, and when.
    pub exported: Option<Stamped>,
    /// The snapshot being exported now, and since when.
    pub exporting: Option<Stamped>,
    /// Why the last export failed, if it did (the next snapshot is tried).
    pub error: Option<String>,
    /// The epoch the run writes its tag with and who it is (`oci::Claim`), once it has
    /// written it: a local resume of the session goes on with both.
    #[serde(default)]
    pub epoch: Option<u64>,
    #[serde(default)]
    pub writer: Option<String>,
}

/// A snapshot, and a time (Unix seconds).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stamped {
    pub snapshot: String,
    pub at: u64,
}

impl Stamped {
    /// `snapshot`, now.
    pub fn now(snapshot: String) -> Self {
        Self {
            snapshot,
            at: unix_now(),
        }
    }

    /// How long ago it was stamped.
    pub fn age(&self) -> std::time::Duration {
        std::time::Duration::from_secs(unix_now().saturating_sub(self.at))
    }
}

/// Seconds since the Unix epoch.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn export_path(settings: &Settings, id: &str) -> PathBuf {
    settings.sessions_dir().join(format!("{id}.export"))
}

/// Notes how session `id`'s exports go (through a temporary file: `ps` may be reading).
pub fn save_export(settings: &Settings, id: &str, status: &ExportStatus) -> Result<()> {
    let p = export_path(settings, id);
    let tmp = settings
        .sessions_dir()
        .join(format!("{id}.export.{}.tmp", std::process::id()));
    std::fs::write(&tmp, serde_json::to_vec(status)?)
        .and_then(|()| std::fs::rename(&tmp, &p))
        .with_context(|| format!("writing {}", p.display()))
}

/// How session `id`'s exports go, if it exports (nothing if the note is unreadable).
pub fn load_export(settings: &Settings, id: &str) -> Option<ExportStatus> {
    let bytes = std::fs::read(export_path(settings, id)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

pub fn list(settings: &Settings) -> Result<Vec<Session>> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(settings.sessions_dir()) else {
        return Ok(out);
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(id) = name.strip_suffix(".json")
            && let Ok(s) = load(settings, id)
        {
            out.push(s);
        }
    }
    // Most recently active first, as `docker ps` lists.
    out.sort_by(|a, b| b.updated.cmp(&a.updated).then_with(|| a.id.cmp(&b.id)));
    Ok(out)
}
