//! `ferry export` and `ferry import`: a snapshot and its whole closure in one file, to move it
//! to a machine that shares nothing with this one (docs/format.md, "Capsules").

use std::collections::BTreeSet;
use std::io::{BufReader, BufWriter};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use ferry_engine::closure::{moving_order, snapshot_closure};
use ferry_engine::snapshot;
use ferry_store::Store;
use ferry_store::capsule;

use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// The snapshot: blake3:<hex> or a unique prefix.
    snapshot: String,
    /// The capsule file to write; `-` writes it to stdout, to pipe it
    /// (`ferry export κ -o - | ssh HOST ferry import -`).
    #[arg(short, long, value_name = "FILE")]
    output: PathBuf,
    /// Also carry the snapshot's ancestors (parents) that this store still has.
    #[arg(long)]
    with_history: bool,
}

#[derive(Debug, clap::Args)]
pub struct ImportArgs {
    /// The capsule file written by `ferry export`; `-` reads it from stdin.
    capsule: PathBuf,
}

/// Reports progress on stderr at most about once a second.
struct Progress {
    verb: &'static str,
    total: Option<u64>,
    last: Instant,
    shown: bool,
}

impl Progress {
    fn new(verb: &'static str, total: Option<u64>) -> Self {
        Self {
            verb,
            total,
            last: Instant::now(),
            shown: false,
        }
    }

    fn tick(&mut self, bytes: u64) {
        if self.last.elapsed().as_secs_f64() < 1.0 {
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

pub fn export(settings: &Settings, a: ExportArgs) -> Result<ExitCode> {
    let store = settings.open_store()?;
    let root = store.resolve(&a.snapshot)?;
    // Refuse to export what could not be resumed: the closure must be complete and verify.
    let loaded = snapshot::load(&store, root).with_context(|| format!("cannot export {root}"))?;
    let mut closure = BTreeSet::new();
    snapshot_closure(&store, &root, a.with_history, &mut closure)?;
    // The snapshot's memory chunks first, in memory order: the importer packs them so.
    let mut objects: Vec<_> = closure.into_iter().collect();
    moving_order(&root, loaded.chunks().copied(), &mut objects);
    if a.output.as_os_str() == "-" {
        return export_to_stdout(&store, root, &objects);
    }
    let tmp = a.output.with_extension("ferry-partial");
    let file =
        std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let mut progress = Progress::new("exported", None);
    let started = Instant::now();
    let written = capsule::export(
        &store,
        root,
        &objects,
        BufWriter::with_capacity(1 << 20, &file),
        &mut |b| progress.tick(b),
    );
    let stats = match written {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
    };
    file.sync_all()?;
    std::fs::rename(&tmp, &a.output)
        .with_context(|| format!("cannot write {}", a.output.display()))?;
    eprintln!(
        "ferry: exported {root} to {}: {} objects, {:.1} MiB of data in {:.1} MiB, {:.1} s",
        a.output.display(),
        stats.objects,
        stats.bytes as f64 / (1u64 << 20) as f64,
        stats.stored_bytes as f64 / (1u64 << 20) as f64,
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

/// `export -o -`: the capsule goes to stdout as it is written (no temporary file; a reader
/// that gets less than all of it refuses it as truncated).
fn export_to_stdout(
    store: &ferry_store::FsStore,
    root: ferry_kappa::Kappa,
    objects: &[ferry_kappa::Kappa],
) -> Result<ExitCode> {
    use std::io::{IsTerminal, Write};
    let stdout = std::io::stdout();
    if stdout.is_terminal() {
        anyhow::bail!(
            "a capsule is binary: not writing it to a terminal (redirect or pipe stdout, or \
             give -o FILE)"
        );
    }
    let mut progress = Progress::new("exported", None);
    let started = Instant::now();
    let mut out = BufWriter::with_capacity(1 << 20, stdout.lock());
    let stats = capsule::export(store, root, objects, &mut out, &mut |b| progress.tick(b))?;
    out.flush().context("cannot write the capsule to stdout")?;
    eprintln!(
        "ferry: exported {root} to stdout: {} objects, {:.1} MiB of data in {:.1} MiB, {:.1} s",
        stats.objects,
        stats.bytes as f64 / (1u64 << 20) as f64,
        stats.stored_bytes as f64 / (1u64 << 20) as f64,
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

pub fn import(settings: &Settings, a: ImportArgs) -> Result<ExitCode> {
    let store = settings.open_store()?;
    let from_stdin = a.capsule.as_os_str() == "-";
    let (input, total): (Box<dyn std::io::Read>, _) = if from_stdin {
        (Box::new(std::io::stdin().lock()), None)
    } else {
        let file = std::fs::File::open(&a.capsule)
            .with_context(|| format!("cannot open {}", a.capsule.display()))?;
        let total = file.metadata().map(|m| m.len()).ok();
        (Box::new(file), total)
    };
    let name = if from_stdin {
        "the capsule on stdin".to_owned()
    } else {
        a.capsule.display().to_string()
    };
    let mut progress = Progress::new("imported", total);
    let (root, stats) =
        capsule::import(BufReader::with_capacity(1 << 20, input), &store, &mut |b| {
            progress.tick(b)
        })
        .with_context(|| format!("cannot import {name}"))?;
    // The closure must be complete and verify before anything names it.
    snapshot::load(&store, root).with_context(|| format!("{name} holds an incomplete snapshot"))?;
    snapshot::name(&store, root)?;
    println!("imported {root}");
    eprintln!(
        "ferry: {} objects ({} new, {:.1} MiB); resume it with `ferry resume {}`",
        stats.objects,
        stats.new_objects,
        stats.bytes as f64 / (1u64 << 20) as f64,
        root.fmt_short()
    );
    Ok(ExitCode::SUCCESS)
}
