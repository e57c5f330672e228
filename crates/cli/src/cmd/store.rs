//! `ferry store verify` and `ferry store gc`.

use std::collections::BTreeSet;
use std::process::ExitCode;

use anyhow::Result;
use ferry_engine::closure::{snapshot_closure, snapshots_closure};
use ferry_store::{Compacted, Store, StoreError};

use crate::settings::Settings;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Re-hash every object; report corrupt or missing ones (exit 1 if any).
    Verify,
    /// Delete objects no ref reaches (sessions' snapshots and their history, imported
    /// snapshots, prepared modules). Refused while another ferry process uses the store.
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
    match c {
        Command::Verify => verify(&settings.open_store()?),
        // Alone with the store: another process may have written objects it has not yet
        // named with a ref (a snapshot's chunks go before its ref).
        Command::Gc { dry_run, keep } => gc(
            &settings.open_store_exclusive()?,
            dry_run,
            keep.map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX)),
        ),
    }
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

fn gc(store: &dyn Store, dry_run: bool, keep: usize) -> Result<ExitCode> {
    let (removed, kept, compacted) = collect(store, dry_run, &|_| keep, u64::MAX)?;
    let verb = if dry_run { "would delete" } else { "deleted" };
    println!("{verb} {removed} objects, kept {kept}");
    if compacted.files > 0 {
        println!(
            "rewrote {} packs without their deleted objects: {:.1} MiB freed",
            compacted.files,
            compacted.freed as f64 / f64::from(1 << 20)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Deletes (unless `dry_run`) every object no ref reaches, keeping of each session's and
/// imported snapshot's history the newest `keep(ref name)` snapshots, and modules other
/// versions of ferry instrumented (with their refs) unless a kept snapshot names them, then reclaims the
/// space deleted objects held in packs shared with live ones ([`Store::compact`]). The
/// caller must be alone with the store (objects another process wrote may not be named yet).
/// The compaction copies at most about `compact_budget` bytes. Returns how many objects were
/// (or would be) deleted, how many are kept, and what the compaction did.
pub fn collect(
    store: &dyn Store,
    dry_run: bool,
    keep: &dyn Fn(&str) -> usize,
    compact_budget: u64,
) -> Result<(usize, usize, Compacted)> {
    let mut live = BTreeSet::new();
    let current = format!(
        "derived/instrument-v{}/",
        ferry_instrument::INSTRUMENT_VERSION
    );
    // Refs that go unless the object they name is kept.
    let mut stale = Vec::new();
    for (name, r) in store.list_refs()? {
        if name.starts_with("session/") || name.starts_with("snapshot/") {
            snapshots_closure(store, &r.target, keep(&name), &mut live)?;
        } else if name.starts_with("derived/instrument-v") && !name.starts_with(&current) {
            // A module instrumented by another version of ferry: only a snapshot of that
            // version needs it (which keeps the module), and the ref then vouches for it
            // (`OtherVersions::Derived`), so the ref goes only with the module.
            stale.push((name, r));
        } else if name.starts_with("derived/exceptions/") {
            // A mark on an instrumented module, which it does not keep.
            stale.push((name, r));
        } else {
            live.insert(r.target);
        }
    }
    stale.retain(|(_, r)| !live.contains(&r.target));
    if !dry_run {
        for (name, r) in stale {
            store.cas_ref(&name, Some(r), None)?;
        }
    }
    let mut removed = 0;
    for k in store.list()? {
        if !live.contains(&k) {
            removed += 1;
            if !dry_run {
                store.remove(&k)?;
            }
        }
    }
    let compacted = if dry_run {
        Compacted::default()
    } else {
        store.compact(compact_budget)?
    };
    Ok((removed, live.len(), compacted))
}
