//! `ferry rm SESSION...`: forget local sessions, so `ferry store gc` can reclaim their
//! snapshots.

use std::process::ExitCode;

use anyhow::{Result, bail};
use ferry_store::Store;

use crate::session;
use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Session ids (see `ferry ps`).
    #[arg(required_unless_present = "exited", value_name = "SESSION")]
    sessions: Vec<String>,
    /// Forget every session whose program exited (see `ferry ps --all`).
    #[arg(long)]
    exited: bool,
    /// Also forget sessions that could still be resumed (suspended, or lost in a crash): their
    /// snapshots go at the next `ferry store gc`.
    #[arg(long)]
    force: bool,
}

/// `ferry --space URL rm`: the space forgets its sessions (`DELETE /v1/sessions/{id}`), so its
/// garbage collection can reclaim their snapshots.
pub fn remote(settings: &Settings, a: Args) -> Result<ExitCode> {
    let c = crate::cmd::remote::client(settings)?;
    let mut ids = a.sessions.clone();
    if a.exited {
        ids.extend(
            c.sessions()
                .map_err(crate::cmd::remote::api)?
                .into_iter()
                .filter(|s| {
                    s.state == ferry_space::api::State::Exited && !a.sessions.contains(&s.id)
                })
                .map(|s| s.id),
        );
    }
    for id in &ids {
        c.forget(id, a.force).map_err(crate::cmd::remote::api)?;
        println!("removed {id}");
    }
    Ok(ExitCode::SUCCESS)
}

pub fn run(settings: &Settings, a: Args) -> Result<ExitCode> {
    let store = settings.open_store()?;
    let mut ids = a.sessions.clone();
    if a.exited {
        ids.extend(
            session::list(settings)?
                .into_iter()
                .filter(|s| s.exited() && !a.sessions.contains(&s.id))
                .map(|s| s.id),
        );
    }
    for id in &ids {
        let id = session::checked_id(id)?;
        let s = session::load(settings, id)?;
        // Held until the session is gone: nothing resumes it meanwhile.
        let _lease = match session::lease(settings, id)? {
            Ok(lease) => lease,
            Err(pid) => bail!(
                "session `{id}` is running (pid {pid}); suspend it (`ferry suspend {id}`) or let \
                 it finish first"
            ),
        };
        if let Some(k) = &s.last_snapshot
            && !s.exited()
            && !a.force
        {
            // We hold the lease: a session recorded as running has lost its process.
            bail!(
                "session `{id}` can still be resumed ({}, last snapshot {k}); `ferry rm \
                 --force {id}` forgets it, and its snapshots go at the next `ferry store gc`",
                s.shown_state(false)
            );
        }
        // The ref first: if ferry stops halfway, `ps` still lists the session and `rm` can be
        // run again.
        let name = format!("session/{id}");
        if let Some(current) = store.get_ref(&name)? {
            store.cas_ref(&name, Some(current), None)?;
        }
        session::remove(settings, id)?;
        println!("removed {id}");
    }
    Ok(ExitCode::SUCCESS)
}
