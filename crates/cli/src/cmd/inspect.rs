//! `ferry inspect SNAPSHOT [--json]`

use std::process::ExitCode;

use anyhow::{Context, Result};
use ferry_object::{MemoryImage, Snapshot, WasiState};
use ferry_store::Store;
use serde_json::json;

use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The snapshot: `blake3:<hex>` or a unique prefix, or a session id (its last snapshot).
    #[arg(value_name = "SNAPSHOT|SESSION")]
    snapshot: String,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// List the snapshot and the earlier ones of its run (its parents), newest first: any of
    /// them can be resumed.
    #[arg(long)]
    history: bool,
}

pub fn run(settings: &Settings, a: Args) -> Result<ExitCode> {
    let store = settings.open_store()?;
    let k = crate::session::snapshot_named(settings, &store, &a.snapshot, true)
        .map_err(anyhow::Error::msg)?;
    if a.history {
        return history(&store, k, a.json);
    }
    let s: Snapshot =
        ferry_object::decode(&store.get(&k)?).with_context(|| format!("{k} is not a snapshot"))?;
    let w: WasiState = ferry_object::decode(&store.get(&s.wasi)?)?;
    let mut memories = Vec::new();
    for m in &s.memories {
        let img: MemoryImage = ferry_object::decode(&store.get(m)?)?;
        memories.push(json!({
            "kappa": m.to_string(), "bytes": img.len, "chunk_size": img.chunk_size,
            "chunks_total": img.len / u64::from(img.chunk_size), "chunks_nonzero": img.chunks.len(),
            "stored_bytes": img.chunks.len() as u64 * u64::from(img.chunk_size),
        }));
    }
    let stack_bytes = store.get(&s.stack)?.len();
    let v = json!({
        "snapshot": k.to_string(),
        "program": s.program,
        "generation": s.generation,
        "parent": s.parent.map(|p| p.to_string()),
        "module": s.module.to_string(),
        "instrumented": s.instrumented.to_string(),
        "instrument_version": s.instrument_version,
        "profile": {
            "runtime": s.profile.runtime, "engine_class": s.profile.engine_class,
            "capabilities": s.profile.capabilities, "host_bound": s.profile.host_bound,
        },
        "capability_request": {
            "mounts": w.mounts.iter().map(|m| json!({"guest_path": m.guest_path, "tree": m.tree.to_string(),
                "host_hint": m.host_hint, "read_only": m.read_only, "host_bound": m.host_bound,
                "not_carried": m.not_carried})).collect::<Vec<_>>(),
            "env": w.env.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
        },
        "args": w.args,
        "memories": memories,
        "globals": s.globals.len(),
        "stack_bytes": stack_bytes,
        "open_fds": w.fds.iter().map(|(n, f)| json!({"fd": n, "kind": f.what, "path": f.path, "offset": f.offset,
            "unnamed": f.unnamed.map(|k| k.to_string())})).collect::<Vec<_>>(),
        "stdio": {"stdout_bytes": w.stdout_bytes, "stderr_bytes": w.stderr_bytes, "stdin_bytes": w.stdin_bytes,
            "stdin_input": w.stdin_input.map(|k| k.to_string()), "stdin_open": w.stdin_open,
            "stdin_chunked": w.stdin_chunked},
        "monotonic_ns": w.monotonic_ns,
        "sleeping_until_ns": w.sleep_deadline_ns,
    });
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("snapshot     {k}");
    println!(
        "program      {} {}",
        s.program,
        w.args.iter().skip(1).cloned().collect::<Vec<_>>().join(" ")
    );
    println!(
        "generation   {}  parent {}",
        s.generation,
        s.parent
            .map_or("-".into(), |p| if store.has(&p).unwrap_or(false) {
                p.fmt_short()
            } else {
                format!(
                    "{} (no longer stored: history pruned by `store gc --keep`)",
                    p.fmt_short()
                )
            })
    );
    println!(
        "module       {}  (instrumented {} v{})",
        s.module.fmt_short(),
        s.instrumented.fmt_short(),
        s.instrument_version
    );
    println!(
        "profile      {} / {}  capabilities [{}]{}",
        s.profile.runtime,
        s.profile.engine_class,
        s.profile.capabilities.join(", "),
        if s.profile.host_bound {
            "  HOST-BOUND"
        } else {
            ""
        }
    );
    for m in &v["memories"].as_array().cloned().unwrap_or_default() {
        println!(
            "memory       {} MiB, {} of {} chunks non-zero ({} MiB stored)",
            m["bytes"].as_u64().unwrap_or(0) >> 20,
            m["chunks_nonzero"],
            m["chunks_total"],
            m["stored_bytes"].as_u64().unwrap_or(0) >> 20
        );
    }
    println!(
        "stack        {stack_bytes} bytes saved, {} globals",
        s.globals.len()
    );
    for m in &w.mounts {
        if m.host_bound {
            println!(
                "mount        {} (was {}) passed through: content not carried",
                m.guest_path, m.host_hint
            );
        } else {
            println!(
                "mount        {} (was {}) tree {}",
                m.guest_path,
                m.host_hint,
                m.tree.fmt_short()
            );
        }
        if !m.not_carried.is_empty() {
            println!(
                "             not carried (ferry's output went there): {}",
                m.not_carried.join(", ")
            );
        }
    }
    for (n, f) in w.fds.iter() {
        match (f.unnamed, f.what.as_str()) {
            (Some(_), "dir") => println!(
                "unnamed      fd {n}: the directory `{}`, removed while open (lookups in it fail)",
                f.path
            ),
            (Some(k), _) => println!(
                "unnamed      fd {n}: the file `{}`, deleted or replaced while open; its content \
                 is carried ({})",
                f.path,
                k.fmt_short()
            ),
            (None, _) => {}
        }
    }
    println!(
        "stdio        {} bytes out, {} bytes err, {} bytes in",
        w.stdout_bytes, w.stderr_bytes, w.stdin_bytes
    );
    if let Some(k) = w.stdin_input {
        println!(
            "             stdin is the stored input {}{}: a resume reads on from byte {}{}",
            k.fmt_short(),
            if w.stdin_chunked {
                " (in 1 MiB pieces)"
            } else {
                ""
            },
            w.stdin_bytes,
            if w.stdin_open {
                ", then waits for input sent to the session (interactive; more may come)"
            } else {
                ""
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `--history`: the snapshot and its parents, newest first, until the first snapshot of the
/// run or one `store gc --keep` pruned.
fn history(store: &dyn Store, newest: ferry_kappa::Kappa, json: bool) -> Result<ExitCode> {
    let mut rows = Vec::new();
    let mut next = Some(newest);
    let mut pruned = None;
    while let Some(k) = next {
        if !store.has(&k)? {
            pruned = Some(k);
            break;
        }
        let s: Snapshot = ferry_object::decode(&store.get(&k)?)
            .with_context(|| format!("{k} is not a snapshot"))?;
        let w: WasiState = ferry_object::decode(&store.get(&s.wasi)?)?;
        let memory = memory_len(store, &s)?;
        rows.push(json!({
            "snapshot": k.to_string(), "generation": s.generation, "memory": memory,
            "stdout_bytes": w.stdout_bytes, "stderr_bytes": w.stderr_bytes,
        }));
        // Bounded by the store: each parent is an older generation.
        next = s.parent.filter(|_| rows.len() < 1_000_000);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:>10}  {:<19}  {:>10}  {:>12}",
        "GENERATION", "SNAPSHOT", "MEMORY", "OUTPUT"
    );
    for r in &rows {
        let k = r["snapshot"].as_str().unwrap_or_default();
        println!(
            "{:>10}  {:<19}  {:>6} MiB  {:>12}",
            r["generation"].as_u64().unwrap_or(0),
            k.chars().take(19).collect::<String>(),
            r["memory"].as_u64().unwrap_or(0) >> 20,
            format!(
                "{} B",
                r["stdout_bytes"].as_u64().unwrap_or(0) + r["stderr_bytes"].as_u64().unwrap_or(0)
            ),
        );
    }
    if let Some(k) = pruned {
        println!(
            "(older snapshots, from {}, were pruned by `store gc --keep`)",
            k.fmt_short()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The size of snapshot `s`'s memories, in bytes.
pub fn memory_len(store: &dyn Store, s: &Snapshot) -> Result<u64> {
    let mut len = 0;
    for m in &s.memories {
        len += ferry_object::decode::<MemoryImage>(&store.get(m)?)?.len;
    }
    Ok(len)
}
