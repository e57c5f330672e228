//! Where ferry keeps things.

use std::path::PathBuf;

use anyhow::{Context, Result};
use ferry_store::FsStore;

/// Refuses a tuning variable that is set but does not parse, rather than ignoring it: the
/// libraries that read them fall back to their defaults, which a user who set one would not
/// notice (a compiled-code cache growing to 8 GiB, objects stored uncompressed).
fn check_tuning() -> Result<()> {
    /// A variable's name, what it must hold, and whether a value does.
    type Check = (&'static str, &'static str, fn(&str) -> bool);
    let checks: [Check; 3] = [
        ("FERRY_ZSTD", "a zstd level, 1 to 22", |v| {
            v.parse::<i32>().is_ok_and(|l| (1..=22).contains(&l))
        }),
        ("FERRY_CACHE_MAX_MB", "a size in MiB", |v| {
            v.parse::<u64>().is_ok()
        }),
        (
            "FERRY_PEER_SILENCE_MS",
            "a time in milliseconds, at least 1000",
            |v| v.parse::<u64>().is_ok_and(|ms| ms >= 1000),
        ),
    ];
    for (name, what, ok) in checks {
        if let Some(v) = std::env::var_os(name) {
            let v = v.to_string_lossy();
            anyhow::ensure!(
                ok(v.trim()),
                "{name}={v} is not {what}: set it to one, or unset it"
            );
        }
    }
    Ok(())
}

/// Paths and opened resources shared by every subcommand.
#[derive(Debug, Clone)]
pub struct Settings {
    pub store_dir: PathBuf,
    /// The space to drive (`--space` / `$FERRY_SPACE`), if any.
    pub space: Option<String>,
    /// Where the bearer token for spaces is (`--token-file`; else `$FERRY_TOKEN`).
    pub token_file: Option<PathBuf>,
}

impl Settings {
    pub fn new(
        store: Option<PathBuf>,
        space: Option<String>,
        token_file: Option<PathBuf>,
    ) -> Result<Self> {
        check_tuning()?;
        let store_dir = match store {
            Some(s) => s,
            None => {
                let base = std::env::var_os("XDG_DATA_HOME")
                    .map(PathBuf::from)
                    .or_else(|| {
                        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share"))
                    })
                    .context("cannot find a data directory: set --store or FERRY_STORE")?;
                base.join("ferry")
            }
        };
        Ok(Self {
            store_dir,
            space,
            token_file,
        })
    }

    /// The store, held open (shared with other ferry processes) until dropped.
    pub fn open_store(&self) -> Result<FsStore> {
        let dir = &self.store_dir;
        self.configure(FsStore::open_waiting(dir, &|| {
            eprintln!(
                "ferry: waiting for `ferry store gc` to finish with {}",
                dir.display()
            )
        }))
    }

    /// The store for `store gc`: refused while another process has it open.
    pub fn open_store_exclusive(&self) -> Result<FsStore> {
        self.configure(FsStore::open_exclusive(&self.store_dir))
    }

    fn configure(&self, opened: Result<FsStore, ferry_store::StoreError>) -> Result<FsStore> {
        let store = match opened {
            Err(e @ ferry_store::StoreError::InUse(_)) => return Err(e.into()),
            other => other.with_context(|| {
                format!(
                    "cannot use the store at {} (set --store or FERRY_STORE)",
                    self.store_dir.display()
                )
            })?,
        };
        // FERRY_ZSTD=LEVEL compresses new objects (κ is unchanged; reads decompress).
        let store = match std::env::var("FERRY_ZSTD")
            .ok()
            .and_then(|v| v.trim().parse().ok())
        {
            Some(level) => store.with_zstd(level),
            None => store,
        };
        // Fault injection (tests, DESIGN §5): the disk "fills up" after N more objects.
        if let Some(n) = std::env::var("FERRY_FAULT_STORE_FULL_AFTER")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            store.fail_writes_after(n);
        }
        Ok(store)
    }

    /// Machine cache of compiled code (per host and engine; always safe to delete):
    /// `$FERRY_CACHE`, else `$XDG_CACHE_HOME/ferry/compiled`, else `~/.cache/ferry/compiled`.
    pub fn compiled_cache(&self) -> PathBuf {
        if let Some(c) = std::env::var_os("FERRY_CACHE") {
            return PathBuf::from(c);
        }
        std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|c| c.join("ferry").join("compiled"))
            .unwrap_or_else(|| self.store_dir.join("cache").join("compiled"))
    }

    /// Where `scripts/setup.sh` puts fetched and built guests (CPython, SQLite, zstd):
    /// `$FERRY_GUEST_CACHE`, else `~/.cache/ferry/guests` (the scripts' rule).
    pub fn guest_cache() -> PathBuf {
        std::env::var_os("FERRY_GUEST_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                    .join(".cache/ferry/guests")
            })
    }

    /// Refuses to mount `host_dir` when it holds ferry's store or compiled-code cache (or lies
    /// inside one): a snapshot carries what its mounts hold, so it would copy the store into
    /// itself, and the guest could rewrite the objects it is resumed from.
    pub fn check_mount(&self, host_dir: &std::path::Path, what: &str) -> Result<()> {
        // Paths not there yet (a store or cache made on first use) are taken as written.
        let full = |p: &std::path::Path| p.canonicalize().or_else(|_| std::path::absolute(p));
        let Ok(mount) = full(host_dir) else {
            return Ok(());
        };
        for (name, dir) in [
            ("store", &self.store_dir),
            ("compiled-code cache", &self.compiled_cache()),
        ] {
            let Ok(dir) = full(dir) else {
                continue;
            };
            if dir.starts_with(&mount) || mount.starts_with(&dir) {
                anyhow::bail!(
                    "cannot mount {} ({what}): ferry's {name} {} is {} it, and a snapshot carries \
                     what its mounts hold; give ferry a {name} elsewhere ({}) or mount a \
                     directory that does not hold it",
                    mount.display(),
                    dir.display(),
                    if dir.starts_with(&mount) {
                        "inside"
                    } else {
                        "around"
                    },
                    if name == "store" {
                        "--store or FERRY_STORE"
                    } else {
                        "FERRY_CACHE"
                    },
                );
            }
        }
        Ok(())
    }

    pub fn sessions_dir(&self) -> PathBuf {
        self.store_dir.join("sessions")
    }
}
