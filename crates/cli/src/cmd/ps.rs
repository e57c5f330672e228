//! `ferry ps`: local sessions.

use std::process::ExitCode;

use anyhow::Result;

use crate::session;
use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// One JSON array of sessions, most recently active first: id, program, state, pid (while
    /// running), memory bytes, updated (when its record was last written, Unix seconds),
    /// last snapshot (its full κ), export (with --export-to: where to, the snapshot last
    /// exported and when, the one being exported and since when, the last export's error).
    /// With --space: the space's `SessionInfo` records as they come.
    #[arg(long)]
    pub(crate) json: bool,
    /// Also list sessions whose program exited (hidden by default, as they pile up: every
    /// `ferry run` is a session; `ferry rm --exited` forgets them). A space lists them all.
    #[arg(long, short)]
    all: bool,
    /// With --space: the sessions of every live space of that space's etcd fleet, each with
    /// the space that holds it — records of sessions that moved away and standby copies
    /// left out, so that each session shows where it is.
    #[arg(long)]
    pub(crate) fleet: bool,
}

pub fn run(settings: &Settings, a: Args) -> Result<ExitCode> {
    let mut sessions = session::list(settings)?;
    let listed = sessions.len();
    if !a.all {
        sessions.retain(|s| !s.exited());
    }
    let hidden = listed - sessions.len();
    if a.json {
        let rows: Vec<_> = sessions
            .iter()
            .map(|s| {
                let holder = session::holder(settings, &s.id);
                let updated = s
                    .updated
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_secs());
                serde_json::json!({
                    "id": s.id, "program": s.program,
                    "state": s.shown_state(holder.is_some()),
                    "pid": holder.filter(|&p| p != 0), "memory": s.memory,
                    "last_snapshot": s.last_snapshot, "updated": updated,
                    "snapshot_error": s.snapshot_error,
                    "export": session::load_export(settings, &s.id),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    let exports: Vec<_> = sessions
        .iter()
        .map(|s| session::load_export(settings, &s.id))
        .collect();
    // The column of `--export-to` only when a session listed exports.
    let exporting = exports.iter().any(Option::is_some);
    let header = format!(
        "{:<10} {:<20} {:<12} {:>10}  {:<9} {:<19}{}",
        "SESSION",
        "PROGRAM",
        "STATE",
        "MEMORY",
        "UPDATED",
        "LAST SNAPSHOT",
        if exporting { "  EXPORTED" } else { "" }
    );
    println!("{}", header.trim_end());
    let mut lost = false;
    let mut failing = Vec::new();
    for (s, export) in sessions.iter().zip(&exports) {
        let running = session::holder(settings, &s.id).is_some();
        let state = s.shown_state(running);
        lost |= state == "lost";
        if running && let Some(e) = &s.snapshot_error {
            failing.push(snapshot_failed(&s.id, e));
        }
        let snap = s
            .last_snapshot
            .as_deref()
            .map(|k| k.chars().take(19).collect::<String>())
            .unwrap_or_else(|| "-".into());
        let mem = match s.memory {
            0 => "-".to_owned(),
            m if m < 1 << 20 => format!("{} KiB", m >> 10),
            m => format!("{} MiB", m >> 20),
        };
        let age = s
            .updated
            .and_then(|t| t.elapsed().ok())
            .map_or_else(|| "-".into(), ago);
        let exported = match export {
            Some(e) => {
                if let Some(error) = e.error.as_ref().filter(|_| running) {
                    failing.push(format!(
                        "ferry: {}: its last export to {} failed (the next snapshot will be \
                         tried): {error}",
                        s.id, e.to
                    ));
                }
                format!("  {}", export_text(e))
            }
            None => String::new(),
        };
        let line = format!(
            "{:<10} {:<20} {:<12} {:>10}  {:<9} {:<19}{exported}",
            s.id, s.program, state, mem, age, snap
        );
        println!("{}", line.trim_end());
    }
    for line in failing {
        eprintln!("{line}");
    }
    if hidden > 0 {
        eprintln!(
            "ferry: {hidden} exited session{} not shown (`ferry ps --all`; `ferry rm --exited` \
             forgets them)",
            if hidden == 1 { "" } else { "s" }
        );
    }
    if lost {
        eprintln!(
            "ferry: lost: the process ended without a last snapshot (a crash, a kill); \
             `ferry resume SESSION` continues from the last snapshot it wrote"
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// What `ps` (local or a space's) says of a running session whose last snapshot failed.
pub fn snapshot_failed(id: &str, error: &str) -> String {
    format!("ferry: {id}: its last snapshot failed, it keeps running: {error}")
}

/// The EXPORTED column: how long ago the last export ended and of which snapshot (`12s ago
/// blake3:0123456789`), whether one is under way (`exporting 3s`) or failed (`failed`).
fn export_text(e: &session::ExportStatus) -> String {
    let mut parts = Vec::new();
    match &e.exported {
        Some(e) => parts.push(format!(
            "{} {}",
            ago(e.age()),
            e.snapshot.chars().take(19).collect::<String>()
        )),
        None => parts.push("none yet".into()),
    }
    if let Some(e) = &e.exporting {
        parts.push(format!("exporting {}s", e.age().as_secs()));
    }
    if e.error.is_some() {
        parts.push("last one failed".into());
    }
    parts.join(", ")
}

/// `d` as a short age: `12s ago`, `5m ago`, `3h ago`, `4d ago`.
fn ago(d: std::time::Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s ago"),
        60..3600 => format!("{}m ago", s / 60),
        3600..172_800 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86_400),
    }
}
