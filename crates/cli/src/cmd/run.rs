//! `ferry run PROG.wasm [-- ARGS]`

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use ferry_engine::{Control, Runtime, SnapshotMeta, Start};
use ferry_wasi::WasiCtx;

use crate::guest::{self, Execution};
use crate::session::{self, Session};
use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    guest: guest::GuestArgs,
    /// Session id (default: random).
    #[arg(long)]
    session: Option<String>,
    /// The WebAssembly (wasm32-wasip1) command module (`.wasm`, or `.wat` text).
    program: PathBuf,
    /// Arguments for the program (after `--`).
    #[arg(last = true)]
    args: Vec<String>,
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
    let control = Arc::new(Control::new());
    guest::install_signals(&control)?;
    let mounts = a.guest.mounts()?;
    let env = a.guest.env()?;
    let mut wasm = std::fs::read(&a.program)
        .with_context(|| format!("cannot read {}", a.program.display()))?;
    if a.program.extension().is_some_and(|e| e == "wat") {
        wasm = wat::parse_bytes(&wasm)
            .with_context(|| format!("{} is not valid WebAssembly text", a.program.display()))?
            .into_owned();
    }
    let store = settings.open_store()?;
    let runtime = Runtime::new(Some(settings.compiled_cache()))?;
    let name = a
        .program
        .file_name()
        .map_or_else(|| "program".into(), |n| n.to_string_lossy().into_owned());
    let prepared = runtime
        .prepare(&store, &wasm, &|msg| eprintln!("ferry: {msg}"))
        .with_context(|| format!("cannot run {}", a.program.display()))?;

    let mut args = vec![name.clone()];
    args.extend(a.args);
    let wasi = WasiCtx::new(
        args,
        env,
        mounts,
        guest::stdio(),
        guest::host_clock(),
        guest::interrupt_of(&control),
    )
    .map_err(anyhow::Error::msg)?;
    let id = a.session.unwrap_or_else(session::new_id);
    let sess = Session {
        id,
        program: name.clone(),
        pid: 0,
        state: "running".into(),
        memory: 0,
        last_snapshot: None,
    };
    Execution {
        settings,
        store: &store,
        runtime: &runtime,
        prepared: &prepared,
        control,
        session: sess,
        meta: SnapshotMeta {
            program: name,
            parent: None,
            generation: 0,
        },
        checkpoint_every: a.guest.checkpoint_every,
    }
    .execute(wasi, Start::Fresh)
}
