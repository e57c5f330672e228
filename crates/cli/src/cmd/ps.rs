//! `ferry ps`: local sessions.

use std::process::ExitCode;

use anyhow::Result;

use crate::session;
use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {}

pub fn run(settings: &Settings, _a: Args) -> Result<ExitCode> {
    let sessions = session::list(settings)?;
    println!(
        "{:<10} {:<20} {:<12} {:>10}  LAST SNAPSHOT",
        "SESSION", "PROGRAM", "STATE", "MEMORY"
    );
    let mut lost = false;
    for s in sessions {
        let state = if s.state == "running" && session::holder(settings, &s.id).is_none() {
            lost = true;
            "lost".to_owned()
        } else {
            s.state
        };
        let snap = s
            .last_snapshot
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
    if lost {
        eprintln!(
            "ferry: lost: the process ended without a last snapshot (a crash, a kill); \
             `ferry resume` its last snapshot to continue from there"
        );
    }
    Ok(ExitCode::SUCCESS)
}
