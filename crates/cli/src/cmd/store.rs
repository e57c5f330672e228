//! `ferry store verify` and `ferry store gc`.

use std::collections::BTreeSet;
use std::process::ExitCode;

use anyhow::Result;
use ferry_engine::closure::snapshot_closure;
use ferry_engine::gc::Collected;
use ferry_store::{Store, StoreError};

use crate::cmd::mib;
use crate::settings::Settings;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Re-hash every object; report corrupt or missing ones (exit 1 if any).
    Verify,
    /// Delete objects no ref reaches (sessions' snapshots and their history, imported
    /// snapshots, prepared modules). Refused while another ferry process uses the store;
    /// with --space, the space collects while it serves.
    Gc {
        /// Only report what would be deleted.
        #[arg(long)]
        dry_run: bool,
        /// Keep only the newest N snapshots of each session and imported snapshot (the latest
        /// and its N-1 ancestors); older checkpoints are deleted. Default: the whole history.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        keep: Option<u64>,
    },
}

pub fn run(settings: &Settings, c: Command) -> Result<ExitCode> {
    if settings.space.is_some() {
        return remote(settings, c);
    }
    match c {
        Command::Verify => verify(&settings.open_store()?),
        // Alone with the store: another process may have written objects it has not yet
        // named with a ref (a snapshot's chunks go before its ref).
        Command::Gc { dry_run, keep } => gc(
            &settings.open_store_exclusive()?,
            dry_run,
            ferry_engine::gc::snapshots_kept(keep),
        ),
    }
}

/// `ferry --space URL store gc`: the space collects while it serves, sparing objects written
/// or asked about within its grace period (`ferry serve --gc-grace`).
fn remote(settings: &Settings, c: Command) -> Result<ExitCode> {
    let Command::Gc { dry_run, keep } = c else {
        anyhow::bail!(
            "`store verify` runs where the store is: on the space's machine, `ferry store \
             verify --store DIR` (while the space is stopped or idle)"
        );
    };
    let client = crate::cmd::remote::client(settings)?;
    let r = client
        .gc(&ferry_space::api::GcRequest { dry_run, keep })
        .map_err(crate::cmd::remote::api)?;
    print_collected(&r.into(), dry_run);
    Ok(ExitCode::SUCCESS)
}

fn verify(store: &dyn Store) -> Result<ExitCode> {
    let all = store.list()?;
    let mut bad = 0;
    for p in store.problems() {
        bad += 1;
        eprintln!("ferry: {p}");
    }
    let mut last = std::time::Instant::now();
    for (i, k) in all.iter().enumerate() {
        // A big store takes a while: say how far it got, about once a second.
        if last.elapsed() >= std::time::Duration::from_secs(1) {
            last = std::time::Instant::now();
            eprintln!("ferry: verified {i} of {} objects", all.len());
        }
        // Hashed as it streams: an instrumented interpreter is hundreds of MB.
        match store.check(k) {
            Ok(()) => {}
            Err(e @ StoreError::Corrupt { .. }) => {
                bad += 1;
                eprintln!("ferry: {e}");
            }
            Err(e) => return Err(e.into()),
        }
    }
    for (name, r) in store.list_refs()? {
        if !store.has(&r.target)? {
            bad += 1;
            eprintln!("ferry: ref `{name}` points at missing object {}", r.target);
        } else if name.starts_with("session/") || name.starts_with("snapshot/") {
            let mut c = BTreeSet::new();
            if let Err(e) = snapshot_closure(store, &r.target, false, &mut c) {
                bad += 1;
                eprintln!("ferry: ref `{name}`: closure incomplete: {e}");
            }
        }
    }
    println!("{} objects checked, {bad} problems", all.len());
    Ok(if bad == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn gc(store: &ferry_store::FsStore, dry_run: bool, keep: usize) -> Result<ExitCode> {
    // A big store takes a while (deleting, then copying live objects out of half-empty
    // packs): say how far it has come.
    let c = crate::guest::saying_progress(
        || gc_progress(store.housekeeping()),
        || ferry_engine::gc::collect(store, dry_run, &|_| keep, u64::MAX, None),
    )?;
    print_collected(&c, dry_run);
    // Alone with the store (opened exclusively): what `tmp/` holds, no process is writing.
    let (files, bytes) = store.remove_unfinished(dry_run)?;
    if files > 0 {
        println!(
            "{} {files} unfinished write{} ({:.1} MiB) left by a ferry that died while writing",
            if dry_run { "would remove" } else { "removed" },
            if files == 1 { "" } else { "s" },
            mib(bytes)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// What a long `store gc` says while it works.
fn gc_progress(h: ferry_store::Housekeeping) -> String {
    match h {
        h if h.compact_total > 0 => format!(
            "collecting garbage: {} objects deleted; rewriting packs without them: {:.0} of \
             {:.0} MiB of live objects copied",
            h.removed,
            mib(h.compact_copied),
            mib(h.compact_total)
        ),
        h if h.removed > 0 => format!("collecting garbage: {} objects deleted", h.removed),
        _ => "collecting garbage: finding what the refs reach".into(),
    }
}

/// What `store gc` reports, here or on a space.
pub fn print_collected(c: &Collected, dry_run: bool) {
    let verb = if dry_run { "would delete" } else { "deleted" };
    let spared = if c.spared > 0 {
        format!(
            ", and spared {} that no ref reaches but were written or asked about recently",
            c.spared
        )
    } else {
        String::new()
    };
    println!("{verb} {} objects, kept {}{spared}", c.removed, c.kept);
    let compacted = c.compacted;
    if compacted.files > 0 {
        println!(
            "rewrote {} packs without their deleted objects: {:.1} MiB freed",
            compacted.files,
            mib(compacted.freed)
        );
    }
}
