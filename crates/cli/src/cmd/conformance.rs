//! `ferry conformance`: the conformance kit every space must pass (docs/conformance.md).
//!
//! A kit is a directory with `cases.json` (format `ferry-conformance`, versions 1 to 5),
//! guests and expected outputs. For each case and each engine under test the runner checks:
//!
//! * **fresh** — an uninterrupted run prints exactly the expected stdout and stderr and exits
//!   with the expected code (or traps with the expected cause, kit v2);
//! * **resume** — for each of the case's suspension points, a snapshot taken on engine A and
//!   resumed (in a fresh instance, from the objects alone) on engine B prints exactly the rest
//!   of the expected output, exits the same, and leaves the same files in a mounted directory;
//! * **same state** — snapshots taken at the same point on different engines hold the same
//!   memories, globals and saved stack (the guest sees a deterministic clock, so they must).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use ferry_engine::{
    Control, EngineKind, Outcome, Prepared, Runtime, SnapshotMeta, Start, snapshot,
};
use ferry_kappa::Kappa;
use ferry_store::{FsStore, MemStore, Store};
use ferry_wasi::{Clock, MountSpec, Stdio, WasiCtx};
use serde::Deserialize;

use crate::settings::Settings;

/// The kit format this ferry reads.
pub const KIT_FORMAT: &str = "ferry-conformance";
/// The newest kit version this ferry reads; it reads every version from 1 (v2 added `trap`;
/// v3, v4 and v5 only cases).
pub const KIT_VERSION: u32 = 5;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Engines to check: `jit`, `interp` or `all`. With `all`, every snapshot is also resumed
    /// on the engine that did not take it.
    #[arg(long, default_value = "all", value_name = "ENGINE")]
    engine: String,
    /// The kit directory (holds cases.json).
    #[arg(long, default_value = "conformance/v5", value_name = "DIR")]
    kit: PathBuf,
    /// Only the cases whose name contains this.
    #[arg(long, value_name = "TEXT")]
    only: Option<String>,
    /// Keep the snapshots the kit takes in this store directory, with a `manifest.json`
    /// naming them (for checking another space against the same snapshots).
    #[arg(long, value_name = "DIR")]
    keep: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Kit {
    format: String,
    version: u32,
    cases: Vec<Case>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    /// What the case exercises, for the table and the docs.
    about: String,
    /// Path of the guest (.wasm or .wat) relative to the kit, or `cache:FILE` for a guest
    /// fetched by `scripts/setup.sh` into the guest cache (skipped when absent).
    guest: String,
    #[serde(default)]
    args: Vec<String>,
    /// Environment, `KEY=VALUE` each.
    #[serde(default)]
    env: Vec<String>,
    /// Guest path at which a fresh, empty host directory is mounted.
    #[serde(default)]
    mount: Option<String>,
    /// Expected stdout file, relative to the kit.
    stdout: String,
    /// Expected stderr file, relative to the kit (default: empty).
    #[serde(default)]
    stderr: Option<String>,
    #[serde(default)]
    exit: i32,
    /// The guest must trap with this cause (the WebAssembly specification's wording, as
    /// `ferry: guest trapped:` gives it) instead of exiting (kit v2).
    #[serde(default)]
    trap: Option<String>,
    /// Whether snapshots taken at one point on different engines must hold the same state
    /// (false for guests that read randomness, e.g. CPython's hash seed).
    #[serde(default = "yes")]
    same_state: bool,
    points: Vec<Point>,
}

fn yes() -> bool {
    true
}

/// Where a snapshot is taken.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
enum Point {
    /// At the n-th safe point the guest reaches.
    SafePoint(u64),
    /// As the guest makes its n-th call to a WASI function (inside it, if it blocks).
    Call { name: String, nth: u64 },
}

impl std::fmt::Display for Point {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Point::SafePoint(n) => write!(f, "safe point {n}"),
            Point::Call { name, nth } => write!(f, "{name} call #{nth}"),
        }
    }
}

/// A clock that advances 1 ms per reading: guests see the same times on every engine and
/// every run, so runs and snapshots are reproducible.
#[derive(Debug, Default)]
struct StepClock(std::sync::atomic::AtomicU64);

impl Clock for StepClock {
    fn monotonic_ns(&self) -> u64 {
        self.0
            .fetch_add(1_000_000, std::sync::atomic::Ordering::SeqCst)
    }
    fn realtime_ns(&self) -> u64 {
        1_700_000_000_000_000_000 + self.monotonic_ns()
    }
}

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Buf {
    fn take(&self) -> Vec<u8> {
        std::mem::take(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// How a run ended.
#[derive(Debug)]
enum End {
    Exited(i32),
    Suspended(Kappa),
    /// The guest trapped; the cause.
    Trapped(String),
}

impl Case {
    /// Whether a run that did not stop at a point ended as this case expects.
    fn ended_as_expected(&self, end: &End) -> Result<(), String> {
        match (&self.trap, end) {
            (None, End::Exited(c)) if *c == self.exit => Ok(()),
            (Some(t), End::Trapped(cause)) if t == cause => Ok(()),
            (None, o) => Err(format!("ended {o:?}, expected exit {}", self.exit)),
            (Some(t), o) => Err(format!("ended {o:?}, expected the trap `{t}`")),
        }
    }
}

/// What one run of a guest showed.
struct Seen {
    outcome: End,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

struct Runner<'a> {
    store: &'a dyn Store,
    scratch: PathBuf,
    runtimes: BTreeMap<&'static str, Runtime>,
    /// Prepared modules by engine and module κ (each prepared once per kit run).
    prepared: std::cell::RefCell<BTreeMap<(&'static str, Kappa), Prepared>>,
}

impl Runner<'_> {
    fn runtime(&self, e: EngineKind) -> &Runtime {
        &self.runtimes[e.name()]
    }

    /// Runs the guest fresh (`from` = None) or from a snapshot, optionally stopping at `stop`.
    fn run(
        &self,
        engine: EngineKind,
        wasm: &[u8],
        (args, env): (&[String], &[(String, String)]),
        mount: Option<(&str, &Path)>,
        from: Option<Kappa>,
        stop: Option<&Point>,
    ) -> Result<Seen> {
        let rt = self.runtime(engine);
        let key = (engine.name(), Kappa::of(wasm));
        let cached = self.prepared.borrow().get(&key).cloned();
        let prepared = match cached {
            Some(p) => p,
            None => {
                let p = rt.prepare(self.store, wasm, &|m| eprintln!("ferry: {m}"))?;
                self.prepared.borrow_mut().insert(key, p.clone());
                p
            }
        };
        let (out, err) = (Buf::default(), Buf::default());
        let stdio = Stdio {
            stdin: Box::new(std::io::empty()),
            stdin_fd: None,
            terminals: [false; 3],
            log: None,
            input: None,
            input_log: None,
            stdout: Box::new(out.clone()),
            stderr: Box::new(err.clone()),
        };
        let control = Arc::new(Control::new());
        match stop {
            Some(Point::SafePoint(n)) => control.suspend_at_safe_point(*n),
            Some(Point::Call { name, nth }) => control.suspend_in_call(name, *nth),
            None => {}
        }
        let interrupt = control.interrupt();
        let mounts: Vec<MountSpec> = mount
            .map(|(g, h)| MountSpec {
                guest_path: g.to_owned(),
                host_dir: h.to_owned(),
                read_only: false,
                host_bound: false,
            })
            .into_iter()
            .collect();
        let (wasi, start, generation) = match from {
            None => (
                WasiCtx::new(
                    args.to_vec(),
                    env.to_vec(),
                    mounts,
                    stdio,
                    Box::<StepClock>::default(),
                    interrupt,
                )
                .map_err(anyhow::Error::msg)?,
                Start::Fresh,
                0,
            ),
            Some(k) => {
                let loaded = snapshot::load(self.store, k)?;
                let ctx = WasiCtx::restore(
                    &loaded.wasi,
                    mounts,
                    stdio,
                    Box::<StepClock>::default(),
                    interrupt,
                    self.store,
                )
                .map_err(anyhow::Error::msg)?;
                let g = loaded.snapshot.generation;
                (ctx, Start::Restore(Box::new(loaded)), g)
            }
        };
        let meta = SnapshotMeta {
            program: args.first().cloned().unwrap_or_default(),
            parent: from,
            generation,
            main: None,
        };
        let store = self.store;
        let outcome = crate::guest::on_guest_thread(move || {
            let mut failed = None;
            let r = rt.run(&prepared, wasi, control, start, store, meta, &mut |r, _| {
                if let Err(e) = r {
                    failed = Some(e);
                }
            });
            match failed {
                Some(e) => Err(e),
                None => r,
            }
        });
        let outcome = match outcome {
            Ok(Outcome::Exited(c)) => End::Exited(c),
            Ok(Outcome::Suspended(k)) => End::Suspended(k),
            Err(ferry_engine::EngineError::Trap(m)) => {
                End::Trapped(m.lines().next().unwrap_or_default().to_owned())
            }
            Err(e) => return Err(e.into()),
        };
        Ok(Seen {
            outcome,
            stdout: out.take(),
            stderr: err.take(),
        })
    }

    fn fresh_dir(&self, name: &str) -> Result<PathBuf> {
        let d = self.scratch.join(name);
        if d.exists() {
            std::fs::remove_dir_all(&d)?;
        }
        std::fs::create_dir_all(&d)?;
        Ok(d)
    }
}

/// One row of the table.
struct Row {
    case: String,
    check: String,
    taken: String,
    resumed: String,
    result: Result<(), String>,
}

fn print_row(r: &Row) {
    let result = match &r.result {
        Ok(()) => "pass".to_owned(),
        Err(why) => format!("FAIL: {why}"),
    };
    println!(
        "{:<22} {:<26} {:<7} {:<8} {result}",
        r.case, r.check, r.taken, r.resumed
    );
}

fn show(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(bytes);
    let s: String = s.chars().take(120).collect();
    format!("{s:?}")
}

fn compare(what: &str, got: &[u8], want: &[u8]) -> Result<(), String> {
    if got == want {
        return Ok(());
    }
    let at = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    Err(format!(
        "{what} differs at byte {at} (got {} bytes, expected {}): got {} expected {}",
        got.len(),
        want.len(),
        show(&got[at.min(got.len())..]),
        show(&want[at.min(want.len())..])
    ))
}

/// Files under `dir`, with contents, sorted.
fn dir_contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap_or(&p).display().to_string();
                out.push((rel, std::fs::read(&p).unwrap_or_default()));
            }
        }
    }
    out.sort();
    out
}

fn read_guest(kit: &Path, spec: &str) -> Result<Option<Vec<u8>>> {
    let path = match spec.strip_prefix("cache:") {
        Some(f) => {
            let p = Settings::guest_cache().join(f);
            if !p.exists() {
                return Ok(None);
            }
            p
        }
        None => kit.join(spec),
    };
    let bytes = std::fs::read(&path).with_context(|| format!("guest {}", path.display()))?;
    if path.extension().is_some_and(|e| e == "wat") {
        return Ok(Some(
            wat::parse_bytes(&bytes)
                .with_context(|| format!("guest {}", path.display()))?
                .into_owned(),
        ));
    }
    Ok(Some(bytes))
}

fn load_kit(dir: &Path) -> Result<Kit> {
    let path = dir.join("cases.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "no conformance kit at {} (run from the repository root or pass --kit DIR)",
            path.display()
        )
    })?;
    let kit: Kit =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    if kit.format != KIT_FORMAT || !(1..=KIT_VERSION).contains(&kit.version) {
        bail!(
            "{} is a `{}` v{} kit; this ferry reads `{KIT_FORMAT}` v1 to v{KIT_VERSION}",
            path.display(),
            kit.format,
            kit.version
        );
    }
    if kit.version < 2
        && let Some(c) = kit.cases.iter().find(|c| c.trap.is_some())
    {
        bail!(
            "{}: case `{}` expects a trap, which a v{} kit cannot say (`trap` is v2)",
            path.display(),
            c.name,
            kit.version
        );
    }
    Ok(kit)
}

pub fn run(settings: &Settings, a: Args) -> Result<ExitCode> {
    let engines: Vec<EngineKind> = match a.engine.as_str() {
        "all" => EngineKind::ALL.to_vec(),
        e => vec![e.parse().map_err(anyhow::Error::msg)?],
    };
    let kit = load_kit(&a.kit)?;
    let scratch = tempdir()?;
    let mem;
    let fs;
    let store: &dyn Store = match &a.keep {
        Some(d) => {
            fs = FsStore::open(d)?;
            &fs
        }
        None => {
            mem = MemStore::new();
            &mem
        }
    };
    let mut runtimes = BTreeMap::new();
    for e in &engines {
        runtimes.insert(e.name(), Runtime::new(*e, Some(settings.compiled_cache()))?);
    }
    let runner = Runner {
        store,
        scratch: scratch.clone(),
        runtimes,
        prepared: Default::default(),
    };
    println!(
        "conformance kit {} ({KIT_FORMAT} v{}), engines: {}",
        a.kit.display(),
        kit.version,
        engines
            .iter()
            .map(|e| e.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "{:<22} {:<26} {:<7} {:<8} result",
        "case", "check", "taken", "resumed"
    );
    let mut rows = Vec::new();
    let mut manifest = Vec::new();
    let mut skipped = Vec::new();
    for case in &kit.cases {
        if a.only.as_ref().is_some_and(|o| !case.name.contains(o)) {
            continue;
        }
        let Some(wasm) = read_guest(&a.kit, &case.guest)? else {
            skipped.push(format!("{} ({} is not fetched)", case.name, case.guest));
            continue;
        };
        let want_out = std::fs::read(a.kit.join(&case.stdout))
            .with_context(|| format!("case {}: expected stdout", case.name))?;
        let want_err = match &case.stderr {
            Some(p) => std::fs::read(a.kit.join(p))
                .with_context(|| format!("case {}: expected stderr", case.name))?,
            None => Vec::new(),
        };
        let mut row = |check: String, taken: &str, resumed: &str, result: Result<(), String>| {
            let r = Row {
                case: case.name.clone(),
                check,
                taken: taken.to_owned(),
                resumed: resumed.to_owned(),
                result,
            };
            print_row(&r);
            rows.push(r);
        };
        println!("# {}: {}", case.name, case.about);
        let mut args = vec![case.name.clone()];
        args.extend(case.args.iter().cloned());
        let env = case
            .env
            .iter()
            .map(|e| crate::guest::parse_env(e))
            .collect::<Result<Vec<_>>>()
            .with_context(|| format!("case {}", case.name))?;
        let args = (args.as_slice(), env.as_slice());
        let mut fresh_files = BTreeMap::new();
        for &e in &engines {
            let dir = runner.fresh_dir(&format!("{}-fresh-{e}", case.name))?;
            let mount = case.mount.as_deref().map(|g| (g, dir.as_path()));
            let result = runner
                .run(e, &wasm, args, mount, None, None)
                .map_err(|e| format!("{e:#}"))
                .and_then(|seen| {
                    compare("stdout", &seen.stdout, &want_out)?;
                    compare("stderr", &seen.stderr, &want_err)?;
                    case.ended_as_expected(&seen.outcome)
                });
            fresh_files.insert(e.name(), dir_contents(&dir));
            row("fresh run".into(), "-", e.name(), result);
        }
        for point in &case.points {
            let mut taken: Vec<(EngineKind, Kappa, usize, usize)> = Vec::new();
            for &t in &engines {
                let dir = runner.fresh_dir(&format!("{}-take-{t}", case.name))?;
                let mount = case.mount.as_deref().map(|g| (g, dir.as_path()));
                match runner.run(t, &wasm, args, mount, None, Some(point)) {
                    Ok(Seen {
                        outcome: End::Suspended(k),
                        stdout,
                        stderr,
                    }) => {
                        let prefix = compare(
                            "stdout before the snapshot",
                            &stdout,
                            &want_out[..stdout.len().min(want_out.len())],
                        )
                        .and_then(|()| {
                            compare(
                                "stderr before the snapshot",
                                &stderr,
                                &want_err[..stderr.len().min(want_err.len())],
                            )
                        });
                        if let Err(why) = prefix {
                            row(point.to_string(), t.name(), "-", Err(why));
                            continue;
                        }
                        manifest.push(serde_json::json!({
                            "case": case.name, "point": point.to_string(), "engine": t.name(),
                            "snapshot": k.to_string(),
                            "stdout_offset": stdout.len(), "stderr_offset": stderr.len(),
                        }));
                        taken.push((t, k, stdout.len(), stderr.len()));
                    }
                    Ok(seen) => row(
                        point.to_string(),
                        t.name(),
                        "-",
                        Err(format!(
                            "the point was never reached (the guest ended {:?})",
                            seen.outcome
                        )),
                    ),
                    Err(e) => row(point.to_string(), t.name(), "-", Err(format!("{e:#}"))),
                }
            }
            for &(t, k, out_at, err_at) in &taken {
                for &r in &engines {
                    let result = resume_check(
                        &runner,
                        case,
                        &wasm,
                        args,
                        k,
                        r,
                        &want_out[out_at..],
                        &want_err[err_at..],
                        &fresh_files[r.name()],
                    );
                    row(point.to_string(), t.name(), r.name(), result);
                }
            }
            if case.same_state && taken.len() > 1 {
                let states: Vec<_> = taken
                    .iter()
                    .map(|(_, k, _, _)| engine_state(store, k))
                    .collect::<Result<_>>()?;
                let result = if states.windows(2).all(|w| w[0] == w[1]) {
                    Ok(())
                } else {
                    Err("memories, globals or saved stack differ between engines".into())
                };
                row(
                    format!("{point}: same state"),
                    &taken
                        .iter()
                        .map(|(e, _, _, _)| e.name())
                        .collect::<Vec<_>>()
                        .join("="),
                    "-",
                    result,
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    if let Some(d) = &a.keep {
        let m = serde_json::json!({"format": KIT_FORMAT, "version": kit.version, "snapshots": manifest});
        std::fs::write(d.join("manifest.json"), serde_json::to_vec_pretty(&m)?)?;
    }
    for s in &skipped {
        println!("skipped: {s}");
    }
    let failed = rows.iter().filter(|r| r.result.is_err()).count();
    println!(
        "{} checks: {} passed, {failed} failed",
        rows.len(),
        rows.len() - failed
    );
    Ok(if failed == 0 && !rows.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Resumes snapshot `k` on engine `r` and checks the rest of the output, the exit code and
/// the mounted files.
#[allow(clippy::too_many_arguments)]
fn resume_check(
    runner: &Runner<'_>,
    case: &Case,
    wasm: &[u8],
    args: (&[String], &[(String, String)]),
    k: Kappa,
    r: EngineKind,
    rest_out: &[u8],
    rest_err: &[u8],
    files: &[(String, Vec<u8>)],
) -> Result<(), String> {
    let dir = runner
        .fresh_dir(&format!("{}-resume-{r}", case.name))
        .map_err(|e| e.to_string())?;
    if case.mount.is_some() {
        // The destination re-materialises the mount from the snapshot's tree.
        let loaded = snapshot::load(runner.store, k).map_err(|e| e.to_string())?;
        let tree = loaded
            .wasi
            .mounts
            .first()
            .ok_or("the snapshot has no mount")?
            .tree;
        ferry_wasi::tree::materialize(runner.store, &tree, &dir).map_err(|e| e.to_string())?;
    }
    let mount = case.mount.as_deref().map(|g| (g, dir.as_path()));
    let seen = runner
        .run(r, wasm, args, mount, Some(k), None)
        .map_err(|e| format!("{e:#}"))?;
    compare("stdout after resume", &seen.stdout, rest_out)?;
    compare("stderr after resume", &seen.stderr, rest_err)?;
    case.ended_as_expected(&seen.outcome)?;
    if case.mount.is_some() && dir_contents(&dir) != files {
        return Err("files in the mount differ from an uninterrupted run's".into());
    }
    Ok(())
}

/// The parts of a snapshot that only the engine's execution determines.
type EngineState = (Vec<Kappa>, Vec<ferry_object::GlobalValue>, Kappa);

fn engine_state(store: &dyn Store, k: &Kappa) -> Result<EngineState> {
    let s: ferry_object::Snapshot = ferry_object::decode(&store.get(k)?)?;
    Ok((s.memories, s.globals, s.stack))
}

fn tempdir() -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!(
        "ferry-conformance-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
