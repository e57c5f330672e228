//! `ferry serve`, `ferry push`, `ferry pull`: a store served to peers, and snapshots moved
//! between stores by κ (docs/api.md).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry_space::gc::Recording;
use ferry_space::{Config, Policy, RemoteStore, Sessions, Space, SyncStats};
use ferry_store::Store;

use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on (port 0: any free port; the chosen address is printed).
    #[arg(long, default_value = "127.0.0.1:7070", value_name = "ADDR")]
    listen: String,
    /// What guests may be granted here (docs/migration.md#policy) [default: every mount,
    /// backed by fresh directories under the store; every variable; both engines].
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,
    /// Serve HTTPS with this certificate chain (PEM; with --tls-key). Clients trust it
    /// through Mozilla's roots or the PEM file `FERRY_TLS_CA` names.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// This space's URL as peers reach it [default: http(s)://<the listening address>].
    #[arg(long, value_name = "URL")]
    advertise: Option<String>,
    /// File holding the token to present to other spaces [default: this space's own token].
    #[arg(long, value_name = "FILE")]
    peer_token_file: Option<PathBuf>,
    /// Serve objects only: run no sessions.
    #[arg(long, conflicts_with = "etcd")]
    objects_only: bool,
    /// Record which space owns each session in this etcd cluster (its client URLs,
    /// comma-separated), shared by a fleet of spaces: every move is then decided there, so a
    /// destination can finish or give up a move without its source (docs/migration.md).
    #[arg(long, value_name = "URL,...", value_delimiter = ',')]
    etcd: Vec<String>,
    /// With --etcd: the key prefix of this fleet's records.
    #[arg(
        long,
        value_name = "PREFIX",
        default_value = "/ferry",
        requires = "etcd"
    )]
    etcd_prefix: String,
    /// With --etcd: sign in to etcd as this user (etcd's user authentication); the password
    /// comes from --etcd-password-file, else $FERRY_ETCD_PASSWORD. The user needs read and
    /// write on the prefix's keys.
    #[arg(long, value_name = "NAME", requires = "etcd")]
    etcd_user: Option<String>,
    /// With --etcd-user: the file holding its password.
    #[arg(long, value_name = "FILE", requires = "etcd_user")]
    etcd_password_file: Option<PathBuf>,
    /// With --etcd at https:// URLs: the PEM file of the CA(s) that sign etcd's certificates
    /// [default: those FERRY_TLS_CA names, else Mozilla's roots].
    #[arg(long, value_name = "FILE", requires = "etcd")]
    etcd_ca: Option<PathBuf>,
    /// With --etcd: the client certificate chain (PEM) this space presents to an etcd
    /// started with --client-cert-auth (with --etcd-key).
    #[arg(long, value_name = "FILE", requires_all = ["etcd", "etcd_key"])]
    etcd_cert: Option<PathBuf>,
    /// The private key of --etcd-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// With --etcd: the failure domain this space is in (a machine, rack or data centre
    /// it shares with others: letters, digits, `.`, `_`, `-`). A session run here with
    /// `--standby auto` gets a standby of another zone when one can stand by, and is moved
    /// to one when it appears.
    #[arg(long, value_name = "NAME", requires = "etcd")]
    zone: Option<String>,
    /// With --etcd: how long a destination holds a prepared copy while the move's source
    /// does not answer, before it gives the move up (in etcd: the source cannot commit it
    /// after that, and runs the guest on).
    #[arg(long, value_name = "DURATION", default_value = "1m", requires = "etcd", value_parser = crate::cmd::run::parse_duration)]
    prepared_timeout: Duration,
    /// With --etcd: the TTL of this space's lease in etcd, renewed every third of it. A
    /// session run here with `--standby` is taken over by its standby once the lease has
    /// not been renewed for that long (this space stopped, or was cut off from etcd).
    #[arg(long, value_name = "DURATION", default_value = "10s", requires = "etcd", value_parser = crate::cmd::run::parse_duration)]
    lease_ttl: Duration,
    /// On SIGTERM or Ctrl-C the space suspends its running sessions before it stops (they
    /// go on when it starts again): how long it waits for that. A session not suspended by
    /// then comes back at its last snapshot. Ctrl-C again stops at once.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = crate::cmd::run::parse_duration)]
    stop_timeout: Duration,
    /// What SIGTERM or Ctrl-C does with the running sessions: `suspend` them here (they go on
    /// when the space starts again), or — in a fleet (--etcd) — `move` each to another live
    /// space first, as `drain` does (its standby first), suspending here only those that no
    /// space took within --stop-timeout.
    #[arg(long, value_enum, value_name = "WHAT", default_value = "suspend")]
    on_stop: OnStop,
    /// Collect garbage this often while serving (as `ferry --space URL store gc` does on
    /// demand) [default: only on demand].
    #[arg(long, value_name = "DURATION", value_parser = crate::cmd::run::parse_duration)]
    gc_every: Option<Duration>,
    /// With --gc-every: keep only the newest N snapshots of each session's history.
    #[arg(long, value_name = "N", requires = "gc_every", value_parser = clap::value_parser!(u64).range(1..))]
    gc_keep: Option<u64>,
    /// How long an object written or asked about is safe from garbage collection even
    /// though no ref names it yet: the longest a push or a snapshot may take to be named.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = crate::cmd::run::parse_duration)]
    gc_grace: Duration,
}

#[derive(Debug, clap::Args)]
pub struct PushArgs {
    /// The snapshot: blake3:<hex> or a unique prefix, or a session (its last snapshot).
    #[arg(value_name = "SNAPSHOT|SESSION")]
    snapshot: String,
    /// The space to send it to, e.g. http://127.0.0.1:7070
    #[arg(long, value_name = "URL")]
    to: String,
}

#[derive(Debug, clap::Args)]
pub struct PullArgs {
    /// The snapshot: blake3:<64 hex>.
    snapshot: String,
    /// The space to fetch it from, e.g. http://127.0.0.1:7070
    #[arg(long, value_name = "URL")]
    from: String,
}

/// The bearer token: from the file, else `$FERRY_TOKEN`; never empty.
pub fn token(file: Option<&PathBuf>) -> Result<String> {
    let t = match file {
        Some(f) => std::fs::read_to_string(f)
            .with_context(|| format!("cannot read the token file {}", f.display()))?,
        None => std::env::var("FERRY_TOKEN").unwrap_or_default(),
    };
    let t = t.trim().to_owned();
    if t.is_empty() {
        bail!("no bearer token: pass --token-file FILE or set FERRY_TOKEN");
    }
    Ok(t)
}

/// The etcd user's password: from the file, else `$FERRY_ETCD_PASSWORD`; never empty.
fn etcd_password(file: Option<&PathBuf>) -> Result<String> {
    let p = match file {
        Some(f) => std::fs::read_to_string(f)
            .with_context(|| format!("cannot read the etcd password file {}", f.display()))?,
        None => std::env::var("FERRY_ETCD_PASSWORD").unwrap_or_default(),
    };
    let p = p.trim_end_matches(['\r', '\n']).to_owned();
    if p.is_empty() {
        bail!(
            "--etcd-user needs its password: pass --etcd-password-file FILE or set FERRY_ETCD_PASSWORD"
        );
    }
    Ok(p)
}

pub fn serve(settings: &Settings, a: ServeArgs) -> Result<ExitCode> {
    anyhow::ensure!(
        a.lease_ttl >= Duration::from_secs(2),
        "--lease-ttl: at least 2s (etcd makes shorter leases 2 s long anyway)"
    );
    anyhow::ensure!(
        a.on_stop != OnStop::Move || !a.etcd.is_empty(),
        "--on-stop move moves sessions to the other spaces of a fleet: give --etcd (or \
         --on-stop suspend)"
    );
    let token = token(settings.token_file.as_ref())?;
    let etcd_user = match &a.etcd_user {
        None => None,
        Some(name) => Some((name.clone(), etcd_password(a.etcd_password_file.as_ref())?)),
    };
    if let Some(zone) = &a.zone {
        anyhow::ensure!(
            ferry_space::owners::valid_zone(zone),
            "--zone `{zone}`: 1 to 64 letters, digits, `.`, `_` or `-`"
        );
    }
    let etcd_tls = if a.etcd_ca.is_some() || a.etcd_cert.is_some() {
        let identity = a.etcd_cert.as_deref().zip(a.etcd_key.as_deref());
        Some(
            ferry_space::tls::etcd_client_config(a.etcd_ca.as_deref(), identity)
                .map_err(|e| anyhow::anyhow!("--etcd-ca/--etcd-cert: {e}"))?,
        )
    } else {
        None
    };
    let peer_token = match &a.peer_token_file {
        Some(f) => self::token(Some(f))?,
        None => token.clone(),
    };
    // Every object written or asked about is noted, so garbage can be collected while the
    // space serves (ferry_space::gc).
    let recording = Arc::new(Recording::new(Arc::new(settings.open_store()?), a.gc_grace));
    let store: Arc<dyn Store> = recording.clone();
    if let Some(every) = a.gc_every {
        let keep = ferry_engine::gc::snapshots_kept(a.gc_keep);
        let rec = recording.clone();
        std::thread::Builder::new()
            .name("gc".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(every);
                    match rec.collect(false, keep) {
                        Ok(Some(c)) => tracing::info!(
                            removed = c.removed,
                            spared = c.spared,
                            freed = c.compacted.freed,
                            "garbage collected (--gc-every)"
                        ),
                        Ok(None) => tracing::info!(
                            "--gc-every: another ferry process has the store open; not collected now"
                        ),
                        Err(e) => eprintln!("ferry: --gc-every: {e}"),
                    }
                }
            })?;
    }
    let space_dir = settings.store_dir.join("space");
    let policy = match &a.policy {
        Some(p) => Policy::load(p, space_dir.join("mounts")).map_err(anyhow::Error::msg)?,
        None => Policy::permissive(space_dir.join("mounts")),
    };
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => {
            Some(ferry_space::tls::server_config(cert, key).map_err(anyhow::Error::msg)?)
        }
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("cannot listen on {}", a.listen))?;
        let addr = listener.local_addr()?;
        let advertise = a
            .advertise
            .clone()
            .unwrap_or_else(|| format!("{scheme}://{addr}"));
        let metrics = Arc::new(ferry_space::metrics::Metrics::default());
        let sessions = if a.objects_only {
            None
        } else {
            let owners = (!a.etcd.is_empty()).then(|| {
                let mut o = ferry_space::owners::Owners::new(&a.etcd, &a.etcd_prefix, &advertise);
                if let Some(tls) = etcd_tls {
                    o = o.with_tls(tls);
                }
                if let Some(zone) = &a.zone {
                    o = o.with_zone(zone);
                }
                Arc::new(match &etcd_user {
                    Some((name, password)) => o.with_user(name, password),
                    None => o,
                })
            });
            let cfg = Config {
                dir: space_dir,
                policy,
                compiled_cache: Some(settings.compiled_cache()),
                advertise,
                peer_token,
                owners: owners.clone(),
                prepared_timeout: a.prepared_timeout,
                lease_ttl: a.lease_ttl,
                stop_timeout: a.stop_timeout,
                move_on_stop: a.on_stop == OnStop::Move,
                metrics: metrics.clone(),
            };
            let st = store.clone();
            let s = tokio::task::spawn_blocking(move || {
                if let Some(o) = &owners {
                    o.check().context("--etcd")?;
                }
                Sessions::open(st, cfg).map_err(anyhow::Error::msg)
            })
            .await??;
            Some(s)
        };
        // The first line on stdout names the address (scripts and tests read it); the note
        // for the user comes first, so one who reads the address sees it written too.
        eprintln!(
            "ferry: serving {} (Ctrl-C to stop); console: {scheme}://{addr}/console/",
            settings.store_dir.display()
        );
        println!("listening on {scheme}://{addr}");
        ferry_space::serve(
            listener,
            Arc::new(Space {
                store,
                gc: Some(recording),
                token,
                sessions,
                metrics,
            }),
            tls,
        )
        .await?;
        Ok::<(), anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// `ferry serve --on-stop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnStop {
    Suspend,
    Move,
}

/// Reports progress on stderr once a second has passed ([`crate::guest::progress_after`]),
/// then about once a second.
pub fn progress(verb: &'static str) -> impl FnMut(usize, usize) {
    let started = Instant::now();
    let mut pace = crate::guest::Pace::new(crate::guest::progress_after(), Duration::from_secs(1));
    move |done, total| {
        if pace.due(started.elapsed()) {
            eprintln!("ferry: {verb} {done} of {total} objects");
        }
    }
}

fn report(verb: &str, k: &ferry_kappa::Kappa, s: SyncStats, started: Instant) {
    eprintln!(
        "ferry: {verb} {k}: {} of its {} objects moved ({:.1} MiB), {:.1} s",
        s.moved,
        s.objects,
        crate::cmd::mib(s.bytes),
        started.elapsed().as_secs_f64()
    );
}

pub fn push(settings: &Settings, a: PushArgs) -> Result<ExitCode> {
    let store = settings.open_store()?;
    let k = crate::session::snapshot_named(settings, &store, &a.snapshot, true)
        .map_err(anyhow::Error::msg)?;
    let space = RemoteStore::new(&a.to, &token(settings.token_file.as_ref())?);
    let started = Instant::now();
    let stats = ferry_space::push(&store, &space, k, &mut progress("sent"))
        .with_context(|| format!("cannot push {k} to {}", a.to))?;
    report("pushed", &k, stats, started);
    Ok(ExitCode::SUCCESS)
}

pub fn pull(settings: &Settings, a: PullArgs) -> Result<ExitCode> {
    let store = settings.open_store()?;
    let k: ferry_kappa::Kappa = a
        .snapshot
        .parse()
        .map_err(|e| anyhow::anyhow!("`{}`: {e} (pull needs the whole κ)", a.snapshot))?;
    let space = RemoteStore::new(&a.from, &token(settings.token_file.as_ref())?);
    let started = Instant::now();
    let stats = ferry_space::pull(&space, &store, k, &mut progress("fetched"))
        .with_context(|| format!("cannot pull {k} from {}", a.from))?;
    report("pulled", &k, stats, started);
    println!("pulled {k}");
    // (`pull` has verified the closure; this reads its mounts for the hint.)
    let loaded = ferry_engine::snapshot::load_leaving_module(&store, k)
        .with_context(|| format!("{k} was pulled but does not load"))?;
    eprintln!("ferry: {}", super::capsule::resume_hint(&loaded));
    Ok(ExitCode::SUCCESS)
}
