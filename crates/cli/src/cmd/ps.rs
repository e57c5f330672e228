//! `ferry ps`: local sessions.

use std::process::ExitCode;

use anyhow::Result;

use crate::session;
use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// One JSON array of sessions: id, program, state, pid (while running), memory bytes,
    /// last snapshot (its full κ).
    #[arg(long)]
    json: bool,
    /// Also list sessions whose program exited (hidden by default, as they pile up: every
    /// `ferry run` is a session; `ferry rm --exited` forgets them).
    #[arg(long, short)]
    all: bool,
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
                serde_json::json!({
                    "id": s.id, "program": s.program,
                    "state": s.shown_state(holder.is_some()),
                    "pid": holder.filter(|&p| p != 0), "memory": s.memory,
                    "last_snapshot": s.last_snapshot,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<10} {:<20} {:<12} {:>10}  LAST SNAPSHOT",
        "SESSION", "PROGRAM", "STATE", "MEMORY"
    );
    let mut lost = false;
    for s in &sessions {
        let state = s.shown_state(session::holder(settings, &s.id).is_some());
        lost |= state == "lost";
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
        println!(
            "{:<10} {:<20} {:<12} {:>10}  {}",
            s.id, s.program, state, mem, snap
        );
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
