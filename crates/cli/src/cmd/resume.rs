//! `ferry resume SNAPSHOT`: the verified transition Resolving → Verifying → Admitting →
//! Restoring → Running (DESIGN §1.6).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, anyhow};
use ferry_engine::{
    Control, EngineError, OtherVersions, Runtime, SnapshotMeta, Stage, Start, snapshot,
};
use ferry_store::Store;
use ferry_wasi::{MountSpec, WasiCtx};

use crate::cmd::mib;
use crate::guest::{self, Execution};
use crate::replay::Replays;
use crate::session::{self, Session};
use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    guest: guest::GuestArgs,
    /// Resume even if a mounted host directory changed since the snapshot.
    #[arg(long)]
    allow_changed_dirs: bool,
    /// Run a snapshot made by another version of ferry's transform with its own instrumented
    /// module even though this store did not derive that module from the program (a
    /// snapshot from a machine with another ferry): its code is taken on trust.
    #[arg(long)]
    trust_instrumented: bool,
    /// The snapshot: `blake3:<hex>` or a unique prefix of it, or a session's id (its last
    /// snapshot; a session named so wins over a κ prefix), or an OCI layout to import it from
    /// first (`s3://BUCKET/PREFIX[:TAG]`, `oci:DIR[:TAG]`: what `export` or `--export-to`
    /// wrote). With --space: the session id.
    #[arg(value_name = "SNAPSHOT|SESSION|s3://BUCKET/PREFIX[:TAG]")]
    snapshot: String,
    /// With --export-to the layout it is resumed from: take the session over from the run
    /// that holds the tag's lease without waiting for the lease to lapse; that run suspends
    /// at its next renewal (what it did since its last export is done again here).
    #[arg(long, requires = "export_to")]
    take_over: bool,
    /// The layout the snapshot was imported from, with the tag and epoch read there.
    #[arg(skip)]
    from_layout: Option<(crate::cmd::oci::OciRef, crate::cmd::capsule::FromLayout)>,
}

impl Args {
    /// The snapshot (or, with --space, the session) named on the command line.
    pub fn target(&self) -> &str {
        &self.snapshot
    }

    /// Refuses what only a local resume does (with --space, a session resumes as it was).
    pub fn local_only(&self) -> Result<()> {
        anyhow::ensure!(
            self.guest.checkpoint_every.is_none()
                && self.guest.pre_write.is_none()
                && self.guest.keep.is_none()
                && self.guest.export_to.is_none()
                && self.guest.mounts()?.is_empty()
                && self.guest.env()?.is_empty()
                && !self.allow_changed_dirs
                && !self.trust_instrumented,
            "--dir, --env, --allow-changed-dirs, --trust-instrumented, --checkpoint-every, \
             --pre-write, --keep and --export-to are for local resumes: a session on a space resumes with what it had (and \
             the space's policy decides what it trusts)"
        );
        Ok(())
    }

    /// The engine named with --engine / $FERRY_ENGINE, if any.
    pub fn engine(&self) -> Option<ferry_engine::EngineKind> {
        self.guest.engine
    }
}

fn refused(stage: Stage, why: impl std::fmt::Display) -> anyhow::Error {
    anyhow!(EngineError::Refused {
        stage,
        reason: why.to_string()
    })
}

/// What a write-back into a mount's directory is staged in, inside it, until it is whole:
/// this prefix and ferry's process id.
const PARTIAL: &str = ".ferry-partial-";

/// Whether `dir` is missing, empty, or holds only the staging of a write-back that did not
/// end (interrupted, failed), which is then removed.
fn empty_but_for_partial(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return !dir.exists();
    };
    let mut partial = Vec::new();
    for e in entries {
        let Ok(e) = e else { return false };
        if !e.file_name().to_string_lossy().starts_with(PARTIAL) {
            return false;
        }
        partial.push(e.path());
    }
    partial
        .iter()
        .all(|p| std::fs::remove_dir_all(p).is_ok() || !p.exists())
}

/// Writes mount `m`'s tree into the empty directory `dir`: into a staging directory inside
/// it first, whose entries are then moved up, so that an interrupted or failed write-back
/// leaves only the staging, which the next resume removes (`dir` does not look changed).
/// Says how far it got when it takes long; tells `known` what the files hold, so the run's
/// first snapshot does not read them.
fn write_back(
    store: &dyn Store,
    m: &ferry_object::Mount,
    dir: &Path,
    known: &mut ferry_wasi::tree::ImportCache,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let staging = dir.join(format!("{PARTIAL}{}", std::process::id()));
    let written = AtomicU64::new(0);
    let total = ferry_wasi::tree::tree_len(store, &m.tree)
        .map(|t| format!(" of {:.1}", mib(t)))
        .unwrap_or_default();
    let result = guest::saying_progress(
        || {
            format!(
                "writing the snapshot's `{}` into {}: {:.1}{total} MiB",
                m.guest_path,
                dir.display(),
                mib(written.load(Ordering::Relaxed))
            )
        },
        || ferry_wasi::tree::materialize_counting(store, &m.tree, &staging, &written),
    );
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e.into());
    }
    // The crash tests stop a write-back here (`FERRY_FAULT=write-back`).
    ferry_space::sessions::fault("write-back");
    for e in std::fs::read_dir(&staging)? {
        let e = e?;
        std::fs::rename(e.path(), dir.join(e.file_name()))?;
    }
    std::fs::remove_dir(&staging)?;
    ferry_wasi::tree::remember_tree(store, &m.tree, dir, known)?;
    Ok(())
}

/// Admitting a mount: the granted host directory must hold what the snapshot saw, or be empty
/// (then the snapshot's tree is written into it: `true`).
fn admit_mount(
    store: &dyn Store,
    m: &ferry_object::Mount,
    grant: &MountSpec,
    allow_changed: bool,
    known: &mut ferry_wasi::tree::ImportCache,
    own_output: &[std::path::PathBuf],
) -> Result<bool> {
    let dir = &grant.host_dir;
    if empty_but_for_partial(dir) {
        write_back(store, m, dir, known).with_context(|| {
            format!(
                "writing the snapshot's `{}` into {}",
                m.guest_path,
                dir.display()
            )
        })?;
        return Ok(true);
    }
    // Files a snapshot stored and that have not changed since are not read again (a 52 MB
    // standard library, a data set): the store's import cache knows them.
    // Not compared: the files ferry's output went to, then and now (ferry wrote to them after
    // the snapshot; those now outside this directory match no entry of it).
    let root = dir.canonicalize().unwrap_or_else(|_| dir.clone());
    let mut skip: Vec<_> = m.not_carried.iter().map(|p| root.join(p)).collect();
    skip.extend_from_slice(own_output);
    let same = ferry_wasi::tree::matches_tree(store, &root, known, &skip, &m.tree)
        .with_context(|| format!("reading {}", dir.display()))?;
    if !same && !allow_changed {
        // What changed, for the user (a few entries; the refusal stands whatever this finds).
        let what = match ferry_wasi::tree::differences(store, &root, &m.tree, known, &skip, 5) {
            Ok((shown, all)) if !shown.is_empty() => {
                let more = match all - shown.len() {
                    0 => String::new(),
                    n => format!(", and {n} more"),
                };
                format!(": {}{more}", shown.join(", "))
            }
            _ => String::new(),
        };
        return Err(refused(
            Stage::Admitting,
            format!(
                "host directory {} (mounted at `{}`) changed since the snapshot was taken{what}; \
                 restore it, mount an empty directory to get the snapshot's copy, or pass \
                 --allow-changed-dirs to continue with the directory as it is now",
                dir.display(),
                m.guest_path
            ),
        ));
    }
    Ok(false)
}

pub fn run(settings: &Settings, mut a: Args) -> Result<ExitCode> {
    let control = Arc::new(Control::new());
    control.pre_write_every(a.guest.pre_write);
    guest::install_signals(
        &control,
        "before the program continued: its snapshot is as it was, resume it again later",
    )?;
    let grants = a.guest.mounts()?;
    for g in &grants {
        settings.check_mount(&g.host_dir, &format!("--dir for `{}`", g.guest_path))?;
    }
    let env = a.guest.env()?;
    let store = settings.open_store()?;
    // A snapshot in a bucket or an OCI layout is imported first (`ferry import`, then this).
    let k = match crate::cmd::oci::OciRef::parse(std::ffi::OsStr::new(&a.snapshot)) {
        Some(r) => {
            let r = r?;
            // Taking the session over from its tag: once no run holds the tag's lease.
            let takes_over = a.guest.export_to.as_ref().is_some_and(|to| {
                to.place == r.place && (to.tag.is_none() || r.tag.is_none() || to.tag == r.tag)
            });
            if !takes_over {
                crate::cmd::oci::lease::say_if_copy(&r);
            } else if a.guest.export_lease().is_some() {
                crate::cmd::oci::await_lease(&r, a.take_over, &mut |said| {
                    eprintln!("ferry: {said}")
                })
                .with_context(|| format!("cannot take the session of {} over", a.snapshot))?;
            }
            let from = crate::cmd::capsule::import_for_resume(&store, &r, &a.snapshot)?;
            let k = from.root;
            a.from_layout = Some((r, from));
            k
        }
        None => session::snapshot_named(settings, &store, &a.snapshot, false)
            .map_err(|why| refused(Stage::Resolving, why))?,
    };
    let loaded = snapshot::load_leaving_module(&store, k)?;
    // Verifying the module (re-hashing up to 100 MB) goes on while the guest is admitted and
    // restored, and the memory chunks mapped from packs are re-hashed while it runs: it is
    // held at its first host call until both have passed (post-copy; docs/architecture.md).
    control.check_while_running(check_while_running());
    snapshot::with_module_check(&store, loaded.snapshot.module, &control, || {
        admit_and_run(settings, a, control.clone(), grants, env, &store, loaded)
    })
}

/// Whether a resumed guest may run while its snapshot's last checks do (see
/// `Control::check_while_running`): `FERRY_CHECK_WHILE_RUNNING=off` makes every check end
/// before the guest runs.
pub(crate) fn check_while_running() -> bool {
    std::env::var("FERRY_CHECK_WHILE_RUNNING").map_or(true, |v| v != "off")
}

/// Admitting, Restoring, Running: the rest of [`run`] once the snapshot is loaded.
fn admit_and_run(
    settings: &Settings,
    a: Args,
    control: Arc<Control>,
    mut grants: Vec<MountSpec>,
    env: Vec<(String, String)>,
    store: &ferry_store::FsStore,
    mut loaded: ferry_engine::snapshot::Loaded,
) -> Result<ExitCode> {
    let k = loaded.kappa;
    // A registered Python runtime's standard library is granted again without asking.
    if !grants
        .iter()
        .any(|g| g.guest_path == crate::cmd::python::STDLIB_GUEST)
        && loaded
            .wasi
            .mounts
            .iter()
            .any(|m| m.guest_path == crate::cmd::python::STDLIB_GUEST)
    {
        grants.extend(crate::cmd::python::stdlib_grant(
            settings,
            store,
            loaded.snapshot.module,
        )?);
    }
    // A script's directory is mounted twice, at its own path and as `.`: the directory
    // granted at its path is granted as `.` too (no authority beyond what was given).
    let mounts = &loaded.wasi.mounts;
    if !grants.iter().any(|g| g.guest_path == ".")
        && let Some(dot) = mounts.iter().find(|m| m.guest_path == ".")
        && let Some(grant) = mounts
            .iter()
            .filter(|m| m.guest_path != "." && m.host_hint == dot.host_hint)
            .find_map(|m| grants.iter().find(|g| g.guest_path == m.guest_path))
    {
        grants.push(MountSpec {
            guest_path: ".".into(),
            ..grant.clone()
        });
    }

    // Admitting: one process at a time continues a session; every mount granted and
    // unchanged; the module re-derives to the same κ.
    tracing::info!(snapshot = %k, "admitting");
    let (id, lease, before) = continuing_session(settings, store, &k)?;
    // A lost session's output files may hold what it wrote after this snapshot (and a
    // replay cut short by a suspend, what it had not matched yet).
    // The session's record of this very snapshot (not of a later one).
    let continued = before
        .as_ref()
        .filter(|b| b.last_snapshot == Some(k.to_string()));
    let replays = match continued {
        Some(b) => Replays::from_marks(&b.outputs, b.state == "running"),
        None => Replays::default(),
    };
    let mut known = ferry_wasi::tree::ImportCache::saved_in(store);
    let own_output = guest::own_output_files();
    let mut wrote_back = false;
    for m in &loaded.wasi.mounts {
        let grant = grants
            .iter()
            .find(|g| g.guest_path == m.guest_path)
            .ok_or_else(|| {
                refused(
                    Stage::Admitting,
                    format!(
                        "the snapshot needs a directory mounted at `{}` (it was {}{}); grant one \
                     with --dir HOST::{}",
                        m.guest_path,
                        m.host_hint,
                        if m.host_bound {
                            ", passed through: the snapshot does not carry its content"
                        } else {
                            ""
                        },
                        m.guest_path
                    ),
                )
            })?;
        if m.host_bound {
            // Passed through: the guest goes on with the directory as it is now.
            if !grant.host_dir.is_dir() {
                return Err(refused(
                    Stage::Admitting,
                    format!(
                        "`{}` is passed through to the host directory {}, which is not there \
                         (the snapshot does not carry its content)",
                        m.guest_path,
                        grant.host_dir.display()
                    ),
                ));
            }
            continue;
        }
        wrote_back |= admit_mount(
            store,
            m,
            grant,
            a.allow_changed_dirs,
            &mut known,
            &own_output,
        )?;
    }
    // What was written back is remembered for the run's first snapshot.
    if wrote_back && let Err(e) = known.save_in(store) {
        tracing::warn!("could not save the mount import cache: {e}");
    }
    let runtime = Runtime::new(a.guest.engine(), Some(settings.compiled_cache()))?;
    let other = if a.trust_instrumented {
        OtherVersions::Trusted
    } else {
        OtherVersions::Derived
    };
    let prepared = runtime.prepare_snapshot(store, &loaded.snapshot, other, &|msg| {
        eprintln!("ferry: {msg}")
    })?;
    if prepared.instrument_version != ferry_instrument::INSTRUMENT_VERSION {
        eprintln!(
            "ferry: snapshot made by instrumentation v{} (this ferry has v{}): it runs with its \
             own instrumented module, and so do its later snapshots",
            prepared.instrument_version,
            ferry_instrument::INSTRUMENT_VERSION
        );
    }
    for (key, value) in env {
        loaded.wasi.env.retain(|(k, _)| *k != key);
        loaded.wasi.env.push((key, value));
    }

    let mut stdio = match ferry_wasi::StoredInput::of(&loaded.wasi) {
        // Input sent to an interactive session of a space: the guest reads on in what was
        // sent, then this process's stdin (taken as it comes, so that a snapshot carries
        // what the guest has not read yet).
        Some(k) if loaded.wasi.stdin_open => {
            let data = k.read(store).map_err(|e| refused(Stage::Verifying, e))?;
            let input = ferry_wasi::InputLog::new(data, false);
            pump_stdin(input.clone());
            ferry_wasi::Stdio::inherit().with_input_log(input, Some(k), loaded.wasi.stdin_bytes)
        }
        // Stdin given as data (a space's `run --stdin FILE`): the guest reads on in it.
        Some(k) => {
            let data = k.read(store).map_err(|e| refused(Stage::Verifying, e))?;
            ferry_wasi::Stdio::inherit().with_input(data, k, loaded.wasi.stdin_bytes)
        }
        None => ferry_wasi::Stdio::inherit_resumed(loaded.wasi.stdin_bytes),
    };
    if replays.pending() > 0 {
        eprintln!(
            "ferry: the {} bytes of output a lost run of session `{id}` wrote past this snapshot \
             are already in the output file and are not written again",
            replays.pending()
        );
        stdio.stdout = replays.wrap(1, stdio.stdout);
        stdio.stderr = replays.wrap(2, stdio.stderr);
    }
    // The line the guest had begun when it stopped (a prompt), if this session recorded it.
    let open_line = continued.map_or_else(guest::OpenLine::default, |b| {
        guest::OpenLine::new(b.prompt_fd, &b.prompt)
    });
    open_line.attach(&mut stdio);
    let mut wasi = WasiCtx::restore(
        &loaded.wasi,
        grants,
        stdio,
        guest::host_clock(),
        control.interrupt(),
        store,
    )
    .map_err(|e| refused(Stage::Admitting, e))?;
    wasi.leave_out(&own_output);
    guest::warn_uncarriable(&wasi);
    let program = loaded.snapshot.program.clone();
    let (prompt_fd, prompt) = open_line.get();
    open_line.show_again();
    let sess = Session {
        id,
        program: program.clone(),
        pid: 0,
        state: "running".into(),
        memory: loaded.memory_bytes(),
        last_snapshot: Some(k.to_string()),
        outputs: replays.marks(),
        prompt,
        prompt_fd,
        snapshot_error: None,
        snapshot_failures: 0,
        updated: None,
    };
    // Resumed from a tag and exporting to the same layout: to that tag (by default), as the
    // run that takes the session over — with the epoch after the one imported, so that the
    // run it came from stops at its next export (`oci::Claim`).
    let mut export_to = a.guest.export_to.clone();
    let mut export_epoch = None;
    if let (Some(to), Some((from, imported))) = (&mut export_to, &a.from_layout)
        && to.place == from.place
        && imported.tag.is_some()
        && (to.tag.is_none() || to.tag == imported.tag)
    {
        to.tag = imported.tag.clone();
        export_epoch = Some(imported.epoch + 1);
    }
    let meta = SnapshotMeta {
        program,
        parent: Some(k),
        generation: loaded.snapshot.generation,
        main: None,
    };
    Execution {
        settings,
        store,
        runtime: &runtime,
        prepared: &prepared,
        control,
        session: sess,
        lease,
        replays,
        meta,
        checkpoint_every: a.guest.checkpoint_every,
        keep: a.guest.keep,
        export_to,
        export_prune: a.guest.export_prune,
        export_epoch,
        export_lease: a.guest.export_lease(),
        take_over: a.take_over,
        open_line,
    }
    .execute(wasi, Start::Restore(Box::new(loaded)))
}

/// Which session the resumed guest continues, with its lease: the session whose latest
/// snapshot κ is, so a resumed run keeps its id — refused while another process runs it
/// (two copies of one guest would both write its output and files). A snapshot no session
/// ends at, or one whose session already ran on from it to its exit, starts a new session.
///
/// With the lease, the session's record as it was: a session recorded as running whose lease
/// was free had lost its process.
fn continuing_session(
    settings: &Settings,
    store: &dyn Store,
    k: &ferry_kappa::Kappa,
) -> Result<(String, session::Lease, Option<Session>)> {
    if let Some(id) = owning_session(settings, store, k) {
        let lease = match session::lease(settings, &id)? {
            Ok(lease) => lease,
            Err(pid) => {
                return Err(refused(
                    Stage::Admitting,
                    format!(
                        "session `{id}` is already running from this snapshot (pid {pid}); \
                         suspend it first (`ferry suspend {id}`) or let it finish"
                    ),
                ));
            }
        };
        // Read under the lease: no other process writes the record now.
        let before = session::load(settings, &id).ok();
        if !before.as_ref().is_some_and(|s| s.exited()) {
            return Ok((id, lease, before));
        }
        drop(lease);
        let (new, lease) = session::fresh(settings)?;
        eprintln!(
            "ferry: session `{id}` already ran on from this snapshot to its exit; \
             this run is a new session `{new}`"
        );
        return Ok((new, lease, None));
    }
    let (id, lease) = session::fresh(settings)?;
    Ok((id, lease, None))
}

/// The session whose latest snapshot is κ: the one whose ref names it, else the one whose
/// file does (a run that died between writing its file and its ref; see `guest::record`),
/// the most recently active first.
fn owning_session(
    settings: &Settings,
    store: &dyn Store,
    k: &ferry_kappa::Kappa,
) -> Option<String> {
    let by_ref = store.list_refs().ok().and_then(|refs| {
        refs.into_iter()
            .find(|(name, v)| name.starts_with("session/") && v.target == *k)
            .map(|(name, _)| name["session/".len()..].to_owned())
    });
    by_ref.or_else(|| {
        let k = k.to_string();
        session::list(settings)
            .ok()?
            .into_iter()
            .find(|s| s.last_snapshot.as_deref() == Some(k.as_str()))
            .map(|s| s.id)
    })
}

/// Appends what this process's stdin brings to `input` as it comes, and ends `input` with it.
fn pump_stdin(input: ferry_wasi::InputLog) {
    let spawned = std::thread::Builder::new()
        .name("stdin".into())
        .spawn(move || {
            use std::io::Read;
            let mut stdin = std::io::stdin().lock();
            let mut buf = vec![0u8; 64 << 10];
            let keep = |_: u64, _: &[u8]| Ok::<(), ferry_wasi::InputError>(());
            loop {
                let n = match stdin.read(&mut buf) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => 0,
                };
                if input.append(None, &buf[..n], n == 0, keep).is_err() || n == 0 {
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        guest::say(&format!("cannot read stdin: {e}"));
    }
}
