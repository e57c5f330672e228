//! `ferry`: run WebAssembly programs that can stop here and continue elsewhere.

mod cmd;
mod guest;
mod replay;
mod session;
mod settings;

use std::process::ExitCode;

use std::ffi::OsString;

use clap::{CommandFactory, Parser, Subcommand};

/// Suspend a running WebAssembly (WASI) program — call stack and all — and resume it later,
/// in another process or on another machine.
#[derive(Debug, Parser)]
#[command(name = "ferry", version, about, long_about = None)]
struct Cli {
    /// Object store directory [default: $XDG_DATA_HOME/ferry or ~/.local/share/ferry]
    #[arg(long, global = true, env = "FERRY_STORE", value_name = "DIR")]
    store: Option<std::path::PathBuf>,
    /// Show each step (resume transitions, snapshot writes) on stderr, with the seconds since
    /// ferry started.
    #[arg(long, short, global = true)]
    verbose: bool,
    /// How ferry's own log lines (warnings; with -v each step) are written on stderr: `text`
    /// for people, `json` — one object a line, with its time, level and fields — for a log
    /// collector (`ferry serve` under systemd or Kubernetes). Messages meant for the user of a
    /// command (progress, results) stay text.
    #[arg(long, global = true, env = "FERRY_LOG_FORMAT", value_name = "FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// Drive sessions on this space (`ferry serve`) instead of this machine: run, ps, logs,
    /// wait, suspend, checkpoint, resume, kill, migrate.
    #[arg(long, global = true, env = "FERRY_SPACE", value_name = "URL")]
    space: Option<String>,
    /// File holding the bearer token for spaces [default: $FERRY_TOKEN].
    #[arg(long, global = true, value_name = "FILE")]
    token_file: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a WASI program; Ctrl-C (SIGINT, SIGTERM, or SIGHUP: the terminal closed) suspends it
    /// at the next safe point.
    Run(cmd::run::Args),
    /// Continue a suspended program from its snapshot.
    Resume(cmd::resume::Args),
    /// Ask a running session to write a snapshot and keep running.
    Checkpoint(cmd::signal::Args),
    /// Ask a running session to write a snapshot and stop.
    Suspend(cmd::signal::Args),
    /// List sessions (local ones, or a space's with --space).
    Ps(cmd::ps::Args),
    /// Forget sessions (not running; resumable ones with --force), local or a space's with
    /// --space, so `ferry store gc` can reclaim their snapshots.
    Rm(cmd::rm::Args),
    /// Print a space's session output so far (with --space), read on where it moved; --follow
    /// keeps streaming.
    Logs(cmd::remote::LogsArgs),
    /// Wait for a space's session to stop wherever it moved; exits with the guest's code.
    Wait(cmd::remote::SessionArgs),
    /// Send this terminal's input to an interactive session of a space (run with
    /// --interactive) and show its output, wherever it moves, until it stops; exits with the
    /// guest's code.
    Attach(cmd::remote::AttachArgs),
    /// List a space's session's mounts, or write their files here (--dir HOST::GUEST): as the
    /// guest left them when it exited, else as of its latest snapshot.
    Files(cmd::remote::FilesArgs),
    /// Stop a space's session (its last snapshot is kept).
    Kill(cmd::remote::SessionArgs),
    /// Move a running session to another space: pre-copy, pause, final delta, commit.
    Migrate(cmd::remote::MigrateArgs),
    /// Give a space's session another standby, or a first one (--to URL, a space of the same
    /// etcd fleet), or none (--none).
    Standby(cmd::remote::StandbyArgs),
    /// The live spaces of a space's etcd fleet: their zones, and how many of its sessions
    /// each stands by for.
    Fleet(cmd::remote::FleetArgs),
    /// Move every running or suspended session of a space elsewhere (before the space is
    /// stopped for maintenance, say): to --to URL, or to the other live spaces of its etcd
    /// fleet.
    Drain(cmd::remote::DrainArgs),
    /// A space's counters and gauges (sessions by state, snapshots and their write times,
    /// moves, take-overs, output held for standbys), in Prometheus' text format: what a
    /// Prometheus server scrapes from `GET /v1/metrics`.
    Metrics,
    /// Take a space's session back from the browser tab or Node process it was lent to: it is
    /// suspended at its last snapshot, and that client is fenced.
    Reclaim(cmd::remote::SessionArgs),
    /// Describe a snapshot: profile, capability request, sizes, chunks, parent.
    Inspect(cmd::inspect::Args),
    /// An interactive Python session that can be suspended; `install`/`list` manage the
    /// CPython WASI runtimes (also used by `ferry run script.py`).
    Python(cmd::python::Args),
    /// Measure overhead, time to safe point, snapshot and resume times (docs/benchmarks.md).
    Bench(cmd::bench::Args),
    /// Write a snapshot and everything it needs into one file (a capsule), to move it offline.
    Export(cmd::capsule::ExportArgs),
    /// Read a capsule written by `ferry export`, verifying every object; prints the snapshot.
    Import(cmd::capsule::ImportArgs),
    /// Delete from an OCI layout (oci:DIR or s3://BUCKET/PREFIX) what no tag needs any more,
    /// such as the layers of checkpoints a later export replaced.
    Prune(cmd::capsule::PruneArgs),
    /// Serve this machine's store to peers over HTTP (bearer token required).
    Serve(cmd::space::ServeArgs),
    /// Send a snapshot to a space: only the objects it lacks move; it verifies them all.
    Push(cmd::space::PushArgs),
    /// Fetch a snapshot from a space: only the objects this store lacks move, each verified.
    Pull(cmd::space::PullArgs),
    /// Run the conformance kit (docs/conformance.md) against the engines; prints a table.
    Conformance(cmd::conformance::Args),
    /// Maintain the object store.
    #[command(subcommand)]
    Store(cmd::store::Command),
}

/// jemalloc rather than glibc's malloc: compiling a big module is where ferry allocates most,
/// and there its resident peak is lower (CPython 3.15: 10.6 GB instead of 12.0; CPython 3.12:
/// 0.97 GB instead of 1.05–1.44; docs/benchmarks.md, "Compiling a big module").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Lets ferry hold as many open files as the host allows (the soft limit raised to the hard
/// one, as Go programs do): each file and directory a guest holds open is a host descriptor,
/// and a space runs many guests in one process. A guest past the limit gets `EMFILE`.
fn raise_open_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write the one struct they are given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(guest_args_last(std::env::args_os().collect()));
    let filter = if cli.verbose { "info" } else { "warn" };
    let log = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter)),
        );
    // With --verbose each step shows the seconds since ferry started.
    if cli.log_format == "json" {
        // Wall-clock times (RFC 3339), as collectors expect.
        log.json().with_ansi(false).init();
    } else if cli.verbose {
        log.with_timer(tracing_subscriber::fmt::time::uptime())
            .init();
    } else {
        log.without_time().init();
    }
    raise_open_file_limit();
    let settings = match settings::Settings::new(cli.store, cli.space, cli.token_file) {
        Ok(s) => s,
        Err(e) => return report(&e),
    };
    // Commands that only print end quietly when their reader goes away (`ferry ps | head`),
    // as Unix tools do. Those that run guests or serve keep SIGPIPE ignored: a guest writing
    // to a closed pipe gets EPIPE, as it would natively, and a space outlives its clients.
    if !matches!(
        cli.command,
        Command::Run(_)
            | Command::Resume(_)
            | Command::Python(_)
            | Command::Serve(_)
            | Command::Bench(_)
            | Command::Conformance(_)
    ) {
        // SAFETY: restoring the default disposition of one signal, before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        Command::Run(a) if settings.space.is_some() => cmd::remote::run(&settings, a),
        Command::Run(a) => cmd::run::run(&settings, a),
        Command::Resume(a) if settings.space.is_some() => a.local_only().and_then(|()| {
            cmd::remote::resume(&settings, a.target(), a.engine().map(|e| e.name()))
        }),
        Command::Resume(a) => cmd::resume::run(&settings, a),
        Command::Checkpoint(a) if settings.space.is_some() => {
            cmd::remote::stop(&settings, &a.session, "checkpoint")
        }
        Command::Checkpoint(a) => cmd::signal::run(&settings, a, cmd::signal::Kind::Checkpoint),
        Command::Suspend(a) if settings.space.is_some() => {
            cmd::remote::stop(&settings, &a.session, "suspend")
        }
        Command::Suspend(a) => cmd::signal::run(&settings, a, cmd::signal::Kind::Suspend),
        Command::Ps(a) if settings.space.is_some() => cmd::remote::ps(&settings, &a),
        Command::Ps(a) => cmd::ps::run(&settings, a),
        Command::Rm(a) if settings.space.is_some() => cmd::rm::remote(&settings, a),
        Command::Rm(a) => cmd::rm::run(&settings, a),
        Command::Logs(a) => cmd::remote::logs(&settings, a),
        Command::Wait(a) => cmd::remote::wait(&settings, a),
        Command::Attach(a) => cmd::remote::attach(&settings, a),
        Command::Files(a) => cmd::remote::files(&settings, a),
        Command::Kill(a) => cmd::remote::stop(&settings, &a.session, "kill"),
        Command::Migrate(a) => cmd::remote::migrate(&settings, a),
        Command::Reclaim(a) => cmd::remote::reclaim(&settings, a),
        Command::Standby(a) => cmd::remote::standby(&settings, a),
        Command::Fleet(a) => cmd::remote::fleet(&settings, a),
        Command::Metrics => cmd::remote::metrics(&settings),
        Command::Drain(a) => cmd::remote::drain(&settings, a),
        Command::Inspect(a) => cmd::inspect::run(&settings, a),
        Command::Store(c) => cmd::store::run(&settings, c),
        Command::Bench(a) => cmd::bench::run(&settings, a),
        Command::Python(a) => cmd::python::run(&settings, a),
        Command::Export(a) => cmd::capsule::export(&settings, a),
        Command::Import(a) => cmd::capsule::import(&settings, a),
        Command::Prune(a) => cmd::capsule::prune(a),
        Command::Serve(a) => cmd::space::serve(&settings, a),
        Command::Push(a) => cmd::space::push(&settings, a),
        Command::Pull(a) => cmd::space::pull(&settings, a),
        Command::Conformance(a) => cmd::conformance::run(&settings, a),
    };
    match result {
        Ok(code) => code,
        Err(e) => report(&e),
    }
}

/// `ferry run PROGRAM ARGS…`, `ferry run -c CODE ARGS…` and `ferry run -m MODULE ARGS…` as
/// `python` and `docker run` have them: everything after the program, code or module belongs to
/// it, options such as `--help` or `-v` too. clap takes options wherever they are, so a `--`
/// goes in after the program (or the code or module), unless one is there already.
fn guest_args_last(mut argv: Vec<OsString>) -> Vec<OsString> {
    let cli = Cli::command();
    let Some(run) = cli.find_subcommand("run") else {
        return argv;
    };
    let takes_value = |token: &str| {
        cli.get_arguments()
            .chain(run.get_arguments())
            .filter(|a| a.get_action().takes_values())
            .any(|a| {
                token.strip_prefix("--").map_or_else(
                    || {
                        let mut chars = token.chars();
                        chars.next() == Some('-')
                            && a.get_short() == chars.next()
                            && chars.next().is_none()
                    },
                    |long| a.get_long() == Some(long),
                )
            })
    };
    let mut i = 1;
    let mut in_run = false;
    while i < argv.len() {
        let Some(token) = argv[i].to_str() else {
            return argv;
        };
        if token == "--" {
            return argv;
        }
        // Where the guest's arguments start, if this is the program, `-c CODE` or `-m MODULE`.
        let end = if !token.starts_with('-') || token == "-" {
            if in_run {
                Some(i + 1)
            } else if token == "run" {
                in_run = true;
                i += 1;
                continue;
            } else {
                return argv; // another command
            }
        } else if in_run && (token.starts_with("-c") || token.starts_with("-m")) {
            Some(if token.len() == 2 { i + 2 } else { i + 1 })
        } else {
            None
        };
        if let Some(end) = end {
            if argv.get(end).is_some_and(|t| t != "--") {
                argv.insert(end, "--".into());
            }
            return argv;
        }
        i += if !token.contains('=') && takes_value(token) {
            2
        } else {
            1
        };
    }
    argv
}

fn report(e: &anyhow::Error) -> ExitCode {
    if let Some(io) = e.downcast_ref::<std::io::Error>()
        && io.kind() == std::io::ErrorKind::BrokenPipe
    {
        return ExitCode::SUCCESS;
    }
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        msg.push_str(&format!("\n  caused by: {cause}"));
    }
    guest::say(&msg);
    // A guest that trapped (C's `abort()`, a failed `assert`, an access out of bounds) ends
    // as `wasmtime run` ends it, 128 + SIGABRT, so that a crash is told from ferry failing.
    if e.chain()
        .any(|c| matches!(c.downcast_ref(), Some(ferry_engine::EngineError::Trap(_))))
    {
        return ExitCode::from(ferry_engine::EXIT_TRAPPED as u8);
    }
    ExitCode::FAILURE
}

#[cfg(test)]
mod tests {
    use super::*;

    fn after(args: &str) -> String {
        let argv = args.split(' ').map(OsString::from).collect();
        let out: Vec<String> = guest_args_last(argv)
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        out.join(" ")
    }

    #[test]
    fn what_follows_the_program_is_the_programs() {
        assert_eq!(after("ferry run s.py -v x"), "ferry run s.py -- -v x");
        assert_eq!(after("ferry run s.py -- -v"), "ferry run s.py -- -v");
        assert_eq!(after("ferry run s.py"), "ferry run s.py");
        assert_eq!(
            after("ferry --store S run --env A=1 --dir D p.wasm --help"),
            "ferry --store S run --env A=1 --dir D p.wasm -- --help"
        );
        // An option's value is not the program.
        assert_eq!(
            after("ferry run --session s --engine=jit -v p.wasm 1"),
            "ferry run --session s --engine=jit -v p.wasm -- 1"
        );
        assert_eq!(
            after("ferry run -m json.tool -h"),
            "ferry run -m json.tool -- -h"
        );
        assert_eq!(after("ferry run -cprint(1) x"), "ferry run -cprint(1) -- x");
        assert_eq!(
            after("ferry run --python 3.12 -c pass"),
            "ferry run --python 3.12 -c pass"
        );
        // Other commands are left alone.
        assert_eq!(
            after("ferry resume --dir a::b k"),
            "ferry resume --dir a::b k"
        );
        assert_eq!(after("ferry python list -v"), "ferry python list -v");
    }
}
