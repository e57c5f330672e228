//! `ferry run PROG.wasm [ARGS]`

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use ferry_engine::{Control, Runtime, SnapshotMeta, Start};
use ferry_wasi::WasiCtx;

use crate::guest::{self, Execution};
use crate::session::{self, Session};
use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub guest: guest::GuestArgs,
    /// Session id (default: random).
    #[arg(long)]
    pub session: Option<String>,
    /// Pass a host directory through: HOST::GUEST (or DIR). The guest uses it as it is, and
    /// snapshots do not carry its content (a data set too big to copy into each snapshot):
    /// they are host-bound, and resume only where that directory is granted again (`resume
    /// --dir`), never in a space. Binding a script's directory passes its mounts through.
    #[arg(long = "bind", value_name = "HOST::GUEST")]
    binds: Vec<String>,
    /// On a space (`--space`): the guest's stdin, read from FILE (`-`: ferry's own stdin, to
    /// its end) and sent with the program; snapshots carry it, so the guest reads on wherever
    /// it moves. Locally, redirect stdin instead (`< FILE`).
    #[arg(long, value_name = "FILE")]
    pub stdin: Option<PathBuf>,
    /// On a space (`--space`): the guest's stdin stays open for input sent while it runs —
    /// yours, from here on (ferry attaches to the session as `attach` does), or from a later
    /// `ferry --space URL attach ID`. After --stdin's data, if that is given too. Locally the
    /// guest reads your terminal already.
    #[arg(long, short = 'i')]
    pub interactive: bool,
    /// On a space of an etcd fleet (`--space`, with --checkpoint-every): another space of the
    /// fleet keeps each checkpoint and takes the session over if this space's etcd lease runs
    /// out (it stopped, or was cut off). Output is shown once the standby holds it. `auto`:
    /// the space chooses a standby among the fleet's live spaces that would admit the guest,
    /// and chooses another whenever it is gone, stops taking checkpoints, or took over.
    #[arg(long, value_name = "URL|auto")]
    pub standby: Option<String>,
    /// Python: the runtime version to use (see `ferry python list`) [default: the default one].
    #[arg(long, value_name = "X.Y")]
    python: Option<String>,
    /// Python: run this code (`python -c CODE [ARGS]`).
    #[arg(short = 'c', value_name = "CODE", conflicts_with = "module")]
    code: Option<String>,
    /// Python: run this module (`python -m MODULE [ARGS]`).
    #[arg(short = 'm', value_name = "MODULE")]
    module: Option<String>,
    /// The WebAssembly (wasm32-wasip1) command module (`.wasm`, or `.wat` text), or a Python
    /// script (`.py`: runs under the Python runtime, its directory mounted at the same path).
    #[arg(required_unless_present_any = ["code", "module"])]
    program: Option<PathBuf>,
    /// For a WASI reactor (a module with `_initialize` and no `_start`): the export to call
    /// after `_initialize`, `() -> i32` (its result is the exit code) or `() -> ()`.
    #[arg(long, value_name = "EXPORT")]
    invoke: Option<String>,
    /// Arguments for the program: everything after it goes to the program, options too
    /// (`ferry run s.py -v` passes `-v` to the script); a `--` right after it is dropped.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

impl Args {
    /// The `--bind` mounts.
    pub fn bound(&self) -> Result<Vec<ferry_wasi::MountSpec>> {
        self.binds
            .iter()
            .map(|b| {
                Ok(ferry_wasi::MountSpec {
                    host_bound: true,
                    ..guest::parse_dir(b)?
                })
            })
            .collect()
    }
}

/// What to run: module bytes, the program's name, arguments after it, extra mounts, and a
/// reactor's entry export.
pub struct Target {
    pub module: Module,
    /// The guest's `argv[0]`.
    pub name: String,
    /// What `ps` and `inspect` call the program: the name, and for Python what runs in it
    /// (`python3.15 fit.py`, `python3.12 -m json.tool`, `python3.12 -c`).
    pub label: String,
    pub args: Vec<String>,
    pub mounts: Vec<ferry_wasi::MountSpec>,
    pub main: Option<String>,
}

pub fn target(settings: &Settings, store: &dyn ferry_store::Store, a: &Args) -> Result<Target> {
    let python = |lead: Vec<String>, mut mounts: Vec<_>| -> Result<Target> {
        let rt = crate::cmd::python::resolve(settings, store, a.python.as_deref())?;
        mounts.extend(rt.stdlib);
        let what = match lead.as_slice() {
            [flag, _, ..] if flag == "-c" => flag.clone(),
            [flag, module, ..] if flag == "-m" => format!("{flag} {module}"),
            [script, ..] => Path::new(script)
                .file_name()
                .map_or_else(|| script.clone(), |n| n.to_string_lossy().into_owned()),
            [] => String::new(),
        };
        Ok(Target {
            module: Module::Stored(rt.module),
            label: format!("{} {what}", rt.name),
            name: rt.name,
            args: lead,
            mounts,
            main: rt.main,
        })
    };
    // Everything after the program is the program's (a `--` right after it is clap's).
    let rest = &a.args[..];
    // With -c/-m there is no program: what clap took for one is the first argument.
    let lead = |flag: &str, value: &str| {
        let mut lead = vec![flag.to_string(), value.to_string()];
        lead.extend(a.program.iter().map(|p| p.display().to_string()));
        lead.extend(rest.iter().cloned());
        lead
    };
    if let Some(code) = &a.code {
        return python(lead("-c", code), vec![]);
    }
    if let Some(module) = &a.module {
        return python(lead("-m", module), vec![]);
    }
    let program = a
        .program
        .as_ref()
        .expect("clap requires a program without -c/-m");
    if program.extension().is_some_and(|e| e == "py") {
        let script = program
            .canonicalize()
            .with_context(|| format!("cannot read {}", program.display()))?;
        let dir = script
            .parent()
            .expect("a file has a directory")
            .to_path_buf();
        settings.check_mount(
            &dir,
            "the script's directory; put the script in a directory of its own",
        )?;
        // Passed through if a --bind names the same directory.
        let host_bound = a
            .bound()?
            .iter()
            .any(|b| b.host_dir.canonicalize().is_ok_and(|h| h == dir));
        // At its own path (so the script sees where it lives) and as `.` (so relative paths
        // work, as they would from that directory).
        let mount = |guest_path: String| ferry_wasi::MountSpec {
            guest_path,
            host_dir: dir.clone(),
            read_only: false,
            host_bound,
        };
        let mounts = vec![mount(dir.display().to_string()), mount(".".into())];
        let mut lead = vec![script.display().to_string()];
        lead.extend(rest.iter().cloned());
        return python(lead, mounts);
    }
    let mut wasm =
        std::fs::read(program).with_context(|| format!("cannot read {}", program.display()))?;
    if program.extension().is_some_and(|e| e == "wat") {
        wasm = wat::parse_bytes(&wasm)
            .with_context(|| format!("{} is not valid WebAssembly text", program.display()))?
            .into_owned();
    }
    let name = program
        .file_name()
        .map_or_else(|| "program".into(), |n| n.to_string_lossy().into_owned());
    Ok(Target {
        module: Module::Bytes(wasm),
        label: name.clone(),
        name,
        args: rest.to_vec(),
        mounts: vec![],
        main: a.invoke.clone(),
    })
}

/// A program's module: read from a file, or already in the store (a registered runtime,
/// which is not read again: a 95 MB interpreter would cost a read and a hash per run).
pub enum Module {
    Bytes(Vec<u8>),
    Stored(ferry_kappa::Kappa),
}

impl Module {
    /// Puts it in `store` (if it is not there yet): its κ.
    pub fn store(&self, store: &dyn ferry_store::Store) -> Result<ferry_kappa::Kappa> {
        match self {
            Module::Bytes(wasm) => {
                anyhow::ensure!(
                    wasm.starts_with(b"\0asm"),
                    "{}",
                    ferry_instrument::InstrumentError::NotWasm
                );
                Ok(store.put(wasm)?)
            }
            Module::Stored(k) => Ok(*k),
        }
    }
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((s, "s"), |i| s.split_at(i));
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration like 500ms, 10s or 5m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (use ms, s, m or h)")),
    };
    if !(secs > 0.0 && secs.is_finite()) {
        return Err(format!("`{s}` must be positive"));
    }
    Ok(Duration::from_secs_f64(secs))
}

pub fn run(settings: &Settings, a: Args) -> Result<ExitCode> {
    anyhow::ensure!(
        a.stdin.is_none(),
        "--stdin is for runs on a space (--space URL); locally, redirect stdin (`< FILE`)"
    );
    anyhow::ensure!(
        a.standby.is_none(),
        "--standby is for runs on a space of an etcd fleet (--space URL)"
    );
    anyhow::ensure!(
        !a.interactive,
        "--interactive is for runs on a space (--space URL); locally the guest reads this \
         terminal's input already"
    );
    let control = Arc::new(Control::new());
    control.pre_write_every(a.guest.pre_write);
    // A testing aid (docs/conformance.md): suspend at the guest's first safe point, so that
    // another space runs all the rest (scripts/wasi-testsuite.py --engine js).
    if std::env::var_os("FERRY_SUSPEND_AT_START").is_some() {
        control.request(ferry_engine::Request::Suspend);
    }
    guest::install_signals(
        &control,
        "before the program started: nothing ran, nothing to resume",
    )?;
    let mut mounts = a.guest.mounts()?;
    mounts.extend(a.bound()?);
    for m in &mounts {
        let how = if m.host_bound { "--bind" } else { "--dir" };
        settings.check_mount(&m.host_dir, &format!("{how} for `{}`", m.guest_path))?;
    }
    let env = a.guest.env()?;
    let store = settings.open_store()?;
    // The session's name first: a refusal should not wait for a long preparation.
    let (id, lease) = match a.session.as_deref() {
        Some(id) => {
            let lease = claim_name(settings, session::checked_id(id)?)?;
            (id.to_owned(), lease)
        }
        None => session::fresh(settings)?,
    };
    let t = target(settings, &store, &a)?;
    for m in t.mounts {
        if !mounts.iter().any(|g| g.guest_path == m.guest_path) {
            mounts.push(m);
        }
    }
    let runtime = Runtime::new(a.guest.engine(), Some(settings.compiled_cache()))?;
    let (name, label, main) = (t.name, t.label, t.main);
    let prepared = match &t.module {
        Module::Bytes(wasm) => runtime.prepare(&store, wasm, &|msg| eprintln!("ferry: {msg}")),
        Module::Stored(k) => runtime.prepare_kappa(&store, *k, &|msg| eprintln!("ferry: {msg}")),
    }
    .with_context(|| format!("cannot run {name}"))?;

    let mut args = vec![name.clone()];
    args.extend(t.args);
    let open_line = guest::OpenLine::default();
    let mut stdio = guest::stdio();
    open_line.attach(&mut stdio);
    let mut wasi = WasiCtx::new(
        args,
        env,
        mounts,
        stdio,
        guest::host_clock(),
        control.interrupt(),
    )
    .map_err(anyhow::Error::msg)?;
    wasi.leave_out(&guest::own_output_files());
    guest::warn_uncarriable(&wasi);
    let sess = Session {
        id,
        program: label.clone(),
        pid: 0,
        state: "running".into(),
        memory: 0,
        last_snapshot: None,
        outputs: Vec::new(),
        prompt: String::new(),
        prompt_fd: 1,
        snapshot_error: None,
        snapshot_failures: 0,
        updated: None,
    };
    Execution {
        settings,
        store: &store,
        runtime: &runtime,
        prepared: &prepared,
        control,
        session: sess,
        lease,
        replays: Default::default(),
        meta: SnapshotMeta {
            main,
            ..SnapshotMeta::fresh(label)
        },
        checkpoint_every: a.guest.checkpoint_every,
        keep: a.guest.keep,
        export_to: a.guest.export_to.clone(),
        export_prune: a.guest.export_prune,
        export_epoch: None,
        export_lease: a.guest.export_lease(),
        take_over: false,
        open_line,
    }
    .execute(wasi, Start::Fresh)
}

/// The lease of a session named with `--session`: refused while that session runs, and
/// while it has a snapshot to resume from (a new run would take its name, and with it the
/// only ref keeping that snapshot from `ferry store gc`). An exited session's name is free.
fn claim_name(settings: &Settings, id: &str) -> Result<session::Lease> {
    let lease = session::lease(settings, id)?.map_err(|pid| {
        anyhow!("session `{id}` is running (pid {pid}); pick another --session name")
    })?;
    if let Ok(old) = session::load(settings, id)
        && !old.exited()
        && let Some(k) = &old.last_snapshot
    {
        // We hold the lease: a session recorded as running has lost its process.
        bail!(
            "session `{id}` exists ({}, last snapshot {k}); resume it with `ferry resume {k}`, \
             or pick another --session name",
            old.shown_state(false)
        );
    }
    Ok(lease)
}

/// `python -m MODULE` under a Python runtime, with no mounts (the interactive session).
pub fn python_module(
    settings: &Settings,
    python: Option<String>,
    guest: guest::GuestArgs,
    module: &str,
) -> Result<ExitCode> {
    let a = Args {
        guest,
        session: None,
        binds: Vec::new(),
        stdin: None,
        interactive: false,
        standby: None,
        python,
        code: None,
        module: Some(module.to_owned()),
        program: None,
        invoke: None,
        args: Vec::new(),
    };
    run(settings, a)
}
