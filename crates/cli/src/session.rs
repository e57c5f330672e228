//! Local sessions: one per `ferry run` lineage, recorded as a small JSON file (for `ps` and
//! signalling) and a ref `session/<id>` naming its latest snapshot.

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde_json::json;

use crate::settings::Settings;

/// What `ps` shows about a session.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: String,
    pub program: String,
    pub pid: u32,
    pub state: String,
    pub memory: u64,
    pub last_snapshot: Option<String>,
}

fn path(settings: &Settings, id: &str) -> PathBuf {
    settings.sessions_dir().join(format!("{id}.json"))
}

/// A new session id: 8 hex digits.
pub fn new_id() -> String {
    format!("{:08x}", rand::random::<u32>())
}

pub fn save(settings: &Settings, s: &Session) -> Result<()> {
    let dir = settings.sessions_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let v = json!({
        "id": s.id, "program": s.program, "pid": s.pid, "state": s.state,
        "memory": s.memory, "last_snapshot": s.last_snapshot,
    });
    let p = path(settings, &s.id);
    let tmp = p.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&v)?)?;
    std::fs::rename(&tmp, &p)?;
    Ok(())
}

pub fn load(settings: &Settings, id: &str) -> Result<Session> {
    let p = path(settings, id);
    let bytes = std::fs::read(&p).with_context(|| format!("no session `{id}` (see `ferry ps`)"))?;
    let v: serde_json::Value =
        serde_json::from_slice(&bytes).with_context(|| format!("reading {}", p.display()))?;
    Ok(Session {
        id: v["id"].as_str().unwrap_or(id).to_owned(),
        program: v["program"].as_str().unwrap_or("?").to_owned(),
        pid: v["pid"].as_u64().unwrap_or(0) as u32,
        state: v["state"].as_str().unwrap_or("?").to_owned(),
        memory: v["memory"].as_u64().unwrap_or(0),
        last_snapshot: v["last_snapshot"].as_str().map(str::to_owned),
    })
}

pub fn list(settings: &Settings) -> Result<Vec<Session>> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(settings.sessions_dir()) else {
        return Ok(out);
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(id) = name.strip_suffix(".json")
            && let Ok(s) = load(settings, id)
        {
            out.push(s);
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// Whether process `pid` is alive.
pub fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    pid != 0 && unsafe { libc::kill(pid as i32, 0) } == 0
}
