//! `ferry --space URL run|ps|logs|wait|suspend|checkpoint|resume|kill|migrate`: sessions run
//! by a space (`ferry serve`), driven over its HTTP API (docs/api.md, docs/migration.md).

use std::collections::BTreeSet;
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use ferry_space::SpaceClient;
use ferry_space::api::{ApiError, MigrateRequest, MountRequest, ResumeRequest, RunRequest, State};

use crate::cmd::mib;
use crate::cmd::space::token;
use crate::settings::Settings;

/// The space named by `--space` / `$FERRY_SPACE`.
pub fn client(settings: &Settings) -> Result<SpaceClient> {
    let url = settings
        .space
        .as_deref()
        .context("this command needs a space: pass --space URL or set FERRY_SPACE")?;
    Ok(SpaceClient::new(url, &token(settings.token_file.as_ref())?))
}

pub fn api(e: ferry_space::api::ApiError) -> anyhow::Error {
    anyhow!(e.msg)
}

/// `ferry --space URL run PROG.wasm ...`: sends the module and the mounted directories (as
/// trees; only what the space lacks), starts the session, prints its id.
pub fn run(settings: &Settings, a: crate::cmd::run::Args) -> Result<ExitCode> {
    let c = client(settings)?;
    anyhow::ensure!(
        a.bound()?.is_empty(),
        "a space cannot reach this machine's directories: --bind is for local runs (--dir \
         sends a directory's content)"
    );
    anyhow::ensure!(
        a.guest.keep.is_none(),
        "--keep is for local runs: a space prunes histories when it collects garbage (`ferry \
         --space URL store gc --keep N`, or `ferry serve --gc-every D --gc-keep N`)"
    );
    anyhow::ensure!(
        a.guest.pre_write.is_none(),
        "--pre-write is for local runs: a space writes a guest's memory when it snapshots it"
    );
    anyhow::ensure!(
        a.guest.export_to.is_none(),
        "--export-to is for local runs: a space keeps its sessions' snapshots in its store, and \
         a standby of the fleet can keep their checkpoints too (--standby)"
    );
    anyhow::ensure!(
        a.standby.is_none() || a.guest.checkpoint_every.is_some(),
        "--standby keeps the session's checkpoints: give --checkpoint-every too"
    );
    let checkpoint_every_ms = match a.guest.checkpoint_every {
        Some(d) => {
            let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
            // Checked here too, before the module and directories are sent.
            let min = ferry_space::api::MIN_CHECKPOINT_MS;
            anyhow::ensure!(ms >= min, "--checkpoint-every on a space: at least {min}ms");
            Some(ms)
        }
        None => None,
    };
    let store = settings.open_store()?;
    let t = crate::cmd::run::target(settings, &store, &a)?;
    let mut mounts = a.guest.mounts()?;
    for m in t.mounts {
        if !mounts.iter().any(|g| g.guest_path == m.guest_path) {
            mounts.push(m);
        }
    }
    let module = t.module.store(&store).with_context(|| t.name.clone())?;
    let mut objects = BTreeSet::from([module]);
    let stdin = match &a.stdin {
        Some(path) => {
            let data = read_stdin_file(path)?;
            let k = ferry_store::Store::put(&store, &data)?;
            objects.insert(k);
            Some(k.to_string())
        }
        None => None,
    };
    let mut requests = Vec::new();
    // Files an earlier snapshot or upload stored, unchanged since, are not read again.
    let mut known = ferry_wasi::tree::ImportCache::saved_in(&store);
    let read_before = known.files_read();
    for m in &mounts {
        // A big data set takes a while to read (and store) before anything is sent.
        let read = Arc::new(AtomicU64::new(0));
        known.count_bytes_into(Some(read.clone()));
        let tree = crate::guest::saying_progress(
            || {
                format!(
                    "reading {} to send it: {} MiB",
                    m.host_dir.display(),
                    read.load(Ordering::Relaxed) >> 20
                )
            },
            || ferry_wasi::tree::import_cached(&store, &m.host_dir, &mut known, &[]),
        )
        .with_context(|| format!("cannot read {}", m.host_dir.display()))?;
        ferry_engine::closure::tree_closure(&store, &tree, &mut objects, 0)
            .map_err(|e| anyhow!("{e}"))?;
        requests.push(MountRequest {
            guest: m.guest_path.clone(),
            tree: tree.to_string(),
            read_only: m.read_only,
        });
    }
    known.count_bytes_into(None);
    if known.files_read() > read_before {
        // Only a cache: failing to keep it costs a re-read next time.
        let _ = known.save_in(&store);
    }
    let remote = c.store();
    let objects: Vec<_> = objects.into_iter().collect();
    let sent = ferry_space::send_objects(
        &store,
        &remote,
        &objects,
        &mut crate::cmd::space::progress("sent"),
    )
    .with_context(|| format!("cannot send the program to {}", c.base()))?;
    if sent.moved > 0 {
        eprintln!(
            "ferry: sent {} objects ({:.1} MiB) to {}",
            sent.moved,
            crate::cmd::mib(sent.bytes),
            c.base()
        );
    }
    let mut args = vec![t.name.clone()];
    args.extend(t.args);
    let request = RunRequest {
        module: module.to_string(),
        program: t.label,
        args,
        env: a.guest.env()?,
        mounts: requests,
        engine: Some(a.guest.engine().name().into()),
        session: a.session,
        main: t.main,
        checkpoint_every_ms,
        stdin,
        standby: a.standby,
        interactive: a.interactive,
    };
    // The space writes the mounted directories out, and prepares a module it has not run
    // before (a big one takes a while), before the guest starts.
    let first = match request.mounts.is_empty() {
        true => " (it prepares the program first)",
        false => " (it writes the mounted directories out and prepares the program first)",
    };
    let info = crate::guest::saying_progress(
        || format!("waiting for {} to start the session{first}", c.base()),
        || c.run(&request),
    )
    .map_err(api)?;
    if a.interactive {
        eprintln!(
            "ferry: session {} is {} on {}; attached (Ctrl-C detaches, `ferry --space {} \
             attach {}` attaches again)",
            info.id,
            info.state.name(),
            c.base(),
            c.base(),
            info.id
        );
        return attach_to(c, &info.id, false);
    }
    println!("{}", info.id);
    eprintln!(
        "ferry: session {} is {} on {}; `ferry --space {} logs {} --follow` shows its output",
        info.id,
        info.state.name(),
        c.base(),
        c.base(),
        info.id
    );
    Ok(ExitCode::SUCCESS)
}

/// The whole of `--stdin FILE` (`-`: ferry's own stdin), at most [`MAX_STDIN`] bytes.
fn read_stdin_file(path: &std::path::Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let (name, reader): (String, Box<dyn Read>) = match path.to_str() {
        Some("-") => ("standard input".into(), Box::new(std::io::stdin())),
        _ => (
            path.display().to_string(),
            Box::new(
                std::fs::File::open(path)
                    .with_context(|| format!("--stdin: cannot open {}", path.display()))?,
            ),
        ),
    };
    let mut data = Vec::new();
    reader
        .take(MAX_STDIN + 1)
        .read_to_end(&mut data)
        .with_context(|| format!("--stdin: cannot read {name}"))?;
    anyhow::ensure!(
        data.len() as u64 <= MAX_STDIN,
        "--stdin: {name} holds more than {MAX_STDIN} bytes (a guest's stored input is one \
         object); put it in a directory and mount that instead (--dir)"
    );
    Ok(data)
}

/// Largest stdin `--stdin` sends (1 GiB, as one blob).
const MAX_STDIN: u64 = 1 << 30;

/// `ferry --space URL ps [--fleet] [--json]`.
pub fn ps(settings: &Settings, a: &crate::cmd::ps::Args) -> Result<ExitCode> {
    let c = client(settings)?;
    let mut unasked = Vec::new();
    let sessions = if a.fleet {
        let fleet = c.fleet().map_err(api)?;
        let token = token(settings.token_file.as_ref())?;
        let mut all = Vec::new();
        for space in fleet.spaces.iter().map(|s| &s.space) {
            match SpaceClient::new(space, &token).sessions() {
                Ok(list) => all.extend(
                    list.into_iter()
                        .filter(|i| !matches!(i.state, State::Moved | State::Standby))
                        .map(|mut i| {
                            i.space = Some(space.clone());
                            i
                        }),
                ),
                Err(e) => unasked.push(format!("ferry: {space} cannot be asked: {}", e.msg)),
            }
        }
        all.sort_by(|x, y| (&x.id, &x.space).cmp(&(&y.id, &y.space)));
        all
    } else {
        c.sessions().map_err(api)?
    };
    let code = if unasked.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&sessions)?);
        for line in unasked {
            eprintln!("{line}");
        }
        return Ok(code);
    }
    let width = sessions
        .iter()
        .filter_map(|s| s.space.as_ref().map(String::len))
        .max()
        .unwrap_or(5)
        .max(5);
    if a.fleet {
        print!("{:<width$}  ", "SPACE");
    }
    println!(
        "{:<10} {:<20} {:<10} {:<7} {:>5}  LAST SNAPSHOT / WHERE",
        "SESSION", "PROGRAM", "STATE", "ENGINE", "EPOCH"
    );
    let mut failing = Vec::new();
    for s in sessions {
        if s.state == State::Running
            && let Some(e) = &s.snapshot_error
        {
            failing.push(crate::cmd::ps::snapshot_failed(&s.id, e));
        }
        if let Some(e) = &s.end_waits {
            failing.push(format!(
                "ferry: {}: the guest has stopped; its end is recorded once etcd answers \
                 (until then its standby must not take it over): {e}",
                s.id
            ));
        }
        if s.state.is_live()
            && let Some(e) = &s.standby_error
        {
            failing.push(match &s.standby {
                Some(_) => format!(
                    "ferry: {}: its standby does not take its checkpoints, so its output is \
                     held back (the guest runs on): {e}",
                    s.id
                ),
                None => format!(
                    "ferry: {}: no standby (the space gives it one as soon as a space of the \
                     fleet can stand by): {e}",
                    s.id
                ),
            });
        }
        let state = match (s.state, s.exit_code) {
            (State::Exited, Some(c)) => format!("exited({c})"),
            (st, _) if s.migrating_to.is_some() => format!("{}*", st.name()),
            (st, _) => st.name().to_owned(),
        };
        let whereabouts = match (&s.moved_to, &s.migrating_to, &s.snapshot) {
            (Some(to), _, _) => format!("moved to {to}"),
            // A browser describes itself at length (its user agent): the start says enough.
            (_, _, _) if s.lent_to.is_some() => {
                let who = s.lent_to.as_deref().unwrap_or("");
                match who.char_indices().nth(48) {
                    Some((at, _)) => format!("lent to {}…", &who[..at]),
                    None => format!("lent to {who}"),
                }
            }
            (_, Some(to), _) => format!("moving to {to}"),
            (_, _, _) if s.state == State::Standby => format!(
                "standby of {}",
                s.source.as_deref().unwrap_or("another space")
            ),
            (_, _, Some(k)) if s.state.is_live() && s.standby.is_some() => {
                let k: String = k.chars().take(19).collect();
                match &s.standby_error {
                    _ if s.end_waits.is_some() => format!("{k} (stopped; its end waits for etcd)"),
                    Some(_) => format!("{k} (output held back)"),
                    None => format!(
                        "{k} (standby {}{})",
                        s.standby.as_deref().unwrap_or(""),
                        if s.standby_auto { ", chosen" } else { "" }
                    ),
                }
            }
            (_, _, Some(k)) if s.interactive && s.state.is_live() => {
                format!("{} (interactive)", k.chars().take(19).collect::<String>())
            }
            (_, _, Some(k)) => k.chars().take(19).collect(),
            _ if s.interactive && s.state.is_live() => "- (interactive)".into(),
            _ => "-".into(),
        };
        let mut program = s.program.clone();
        program.truncate(20);
        if a.fleet {
            print!("{:<width$}  ", s.space.as_deref().unwrap_or(""));
        }
        println!(
            "{:<10} {:<20} {:<10} {:<7} {:>5}  {}",
            s.id, program, state, s.engine, s.epoch, whereabouts
        );
    }
    for line in failing.into_iter().chain(unasked) {
        eprintln!("{line}");
    }
    Ok(code)
}

#[derive(Debug, clap::Args)]
pub struct LogsArgs {
    /// Session id (see `ferry --space URL ps`).
    session: String,
    /// Keep printing new output until the session stops, following it when it moves.
    #[arg(long, short)]
    follow: bool,
}

/// `ferry --space URL logs SESSION [--follow]`: the session's whole output (stdout records
/// to stdout, stderr records to stderr), from the space that holds it.
pub fn logs(settings: &Settings, a: LogsArgs) -> Result<ExitCode> {
    let follow = if a.follow {
        Follow::WhileLive
    } else {
        Follow::No
    };
    print_logs(client(settings)?, &a.session, follow, None)?;
    Ok(ExitCode::SUCCESS)
}

/// How long [`print_logs`] goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Follow {
    /// Until the end of what the session wrote so far.
    No,
    /// Until the session stops running (it ended, or was suspended).
    WhileLive,
    /// Until it ends — through suspends, and through its space not answering for a while
    /// (a space restarted after a crash).
    UntilEnd,
}

/// What a follower of session `session` does when the space `c` speaks to does not answer
/// (`e`): goes to its standby if that took the session over (a client of it), else waits a
/// moment to try again (`None`) — for up to [`INPUT_PATIENCE`] after the first time
/// (`since`, reset on going elsewhere), then gives up with `e`.
fn unanswered(
    c: &SpaceClient,
    session: &str,
    standby: Option<&str>,
    e: ApiError,
    since: &mut Option<std::time::Instant>,
) -> Result<Option<SpaceClient>> {
    if let Some(s) = taken_over(c, session, standby) {
        *since = None;
        return Ok(Some(s));
    }
    let first = *since.get_or_insert_with(|| {
        eprintln!("ferry: {}; trying again", e.msg);
        std::time::Instant::now()
    });
    if first.elapsed() > INPUT_PATIENCE {
        return Err(api(e));
    }
    std::thread::sleep(Duration::from_millis(500));
    Ok(None)
}

/// How long one long poll (`wait`, `logs --follow`) asks the space to hold its answer: `want`,
/// but no longer than the peer silence, so that a space whose process hangs is noticed at most
/// the silence plus the peer stall after the call (45 s by default; `SpaceClient::wait`).
fn long_poll_ms(want: u64) -> u64 {
    want.min(ferry_space::net::peer_silence().as_millis() as u64)
}

/// A client of `standby` if it took session `session` over — it holds the session as its
/// own now, not as a standby copy — when the space `c` speaks to does not answer.
fn taken_over(c: &SpaceClient, session: &str, standby: Option<&str>) -> Option<SpaceClient> {
    let s = c.elsewhere(standby?);
    let info = s.session(session).ok()?;
    (info.state != State::Standby).then(|| {
        eprintln!(
            "ferry: {} does not answer, and its standby {} took session {session} over; \
             following it there",
            c.base(),
            s.base()
        );
        s
    })
}

/// Prints session `session`'s output from `c` on, following it where it moves — and to its
/// standby when that takes it over —, as long as `follow` says; each space it goes to is
/// written into `holder`. Returns a client of the space that holds it then.
fn print_logs(
    mut c: SpaceClient,
    session: &str,
    follow: Follow,
    holder: Option<&Mutex<String>>,
) -> Result<SpaceClient> {
    let mut from = 0u64;
    let (mut out, mut err) = (std::io::stdout().lock(), std::io::stderr());
    let mut unreachable_since: Option<std::time::Instant> = None;
    let mut said_suspended = false;
    // The session's standby, as the last answer named it.
    let mut standby = match follow {
        Follow::No => None,
        _ => c.session(session).ok().and_then(|i| i.standby),
    };
    let went = |c: &SpaceClient| {
        if let Some(h) = holder {
            *h.lock().unwrap_or_else(|p| p.into_inner()) = c.base().to_owned();
        }
    };
    loop {
        let wait = if follow == Follow::No {
            0
        } else {
            long_poll_ms(10_000)
        };
        let chunk = match c.logs(session, from, wait) {
            Ok(chunk) => {
                unreachable_since = None;
                chunk
            }
            // Not answering: perhaps a space restarted after a crash, or one gone for good
            // whose standby takes the session over.
            Err(e)
                if e.status == 0
                    && (follow == Follow::UntilEnd
                        || (follow == Follow::WhileLive && standby.is_some())) =>
            {
                if let Some(s) =
                    unanswered(&c, session, standby.as_deref(), e, &mut unreachable_since)?
                {
                    c = s;
                    went(&c);
                }
                continue;
            }
            Err(e) => return Err(api(e)),
        };
        if chunk.start != from {
            // What was shown past the guest's last snapshot came out otherwise when it redid
            // it (its space crashed): the rest goes on from the next record of the new run.
            out.flush()?;
            eprintln!(
                "ferry: session {session}'s output past its last snapshot came out otherwise \
                 when the guest redid it after its space stopped; what is shown here goes on \
                 at byte {} of the redone log (`ferry --space {} logs {session}` shows the log \
                 as the space holds it)",
                chunk.start,
                c.base()
            );
            from = chunk.start;
        }
        from += chunk.records.len() as u64;
        standby = chunk.standby.clone();
        for (stream, data) in ferry_wasi::output::Records::new(&chunk.records) {
            if stream == ferry_wasi::output::STDERR {
                out.flush()?;
                err.write_all(data)?;
            } else {
                out.write_all(data)?;
            }
        }
        out.flush()?;
        if !chunk.records.is_empty() {
            continue;
        }
        if chunk.state != State::Suspended {
            said_suspended = false;
        }
        match (chunk.state, chunk.moved_to) {
            // The log travels with the session: where it went holds the same records and
            // the ones written since, so reading on from `from` there gives the rest.
            (State::Moved, Some(to)) => {
                eprintln!(
                    "ferry: session {session} moved to {to}; {} there",
                    if follow == Follow::No {
                        "the rest of its output is read from"
                    } else {
                        "following it"
                    }
                );
                c = c.elsewhere(&to);
                went(&c);
            }
            _ if follow == Follow::No => return Ok(c),
            (st, _) if st.is_live() || chunk.migrating_to.is_some() => {}
            (State::Suspended, _) if follow == Follow::UntilEnd => {
                if !std::mem::replace(&mut said_suspended, true) {
                    eprintln!(
                        "ferry: session {session} is suspended; still attached until it is \
                         resumed and ends (Ctrl-C detaches)"
                    );
                }
                std::thread::sleep(Duration::from_millis(300));
            }
            (st, _) => {
                eprintln!("ferry: session {session} is {}", st.name());
                return Ok(c);
            }
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct SessionArgs {
    /// Session id (see `ferry --space URL ps`).
    pub session: String,
}

/// `ferry --space URL wait SESSION`: waits until the session stops wherever it moved, and
/// exits with the guest's exit code (75 if it was suspended, 137 if killed, 134 if it trapped).
pub fn wait(settings: &Settings, a: SessionArgs) -> Result<ExitCode> {
    wait_at(client(settings)?, &a.session)
}

/// [`wait`] for session `session`, asking `c` first.
fn wait_at(mut c: SpaceClient, session: &str) -> Result<ExitCode> {
    // The session's standby, as the last answer named it (a wait ends when it changes).
    let mut standby = c.session(session).ok().and_then(|i| i.standby);
    let mut unreachable_since: Option<std::time::Instant> = None;
    loop {
        let s = match c.wait(session, long_poll_ms(20_000)) {
            Ok(s) => {
                unreachable_since = None;
                s
            }
            // Not answering, with a standby that takes the session over once its space is
            // gone for good.
            Err(e) if e.status == 0 && standby.is_some() => {
                if let Some(s) =
                    unanswered(&c, session, standby.as_deref(), e, &mut unreachable_since)?
                {
                    c = s;
                }
                continue;
            }
            Err(e) => return Err(api(e)),
        };
        standby = s.standby.clone();
        match s.state {
            State::Moved => {
                let to = s
                    .moved_to
                    .context("moved, but the space does not say where")?;
                eprintln!("ferry: session {} moved to {to}; waiting there", session);
                c = c.elsewhere(&to);
            }
            st if st.is_live() || s.migrating_to.is_some() || st == State::Standby => {}
            State::Exited => {
                if s.final_files.as_ref().is_some_and(|f| !f.is_empty()) {
                    eprintln!(
                        "ferry: the files it left: `ferry --space {} files {}` (add --dir \
                         HOST::GUEST to write them here)",
                        c.base(),
                        session
                    );
                }
                return Ok(ExitCode::from(s.exit_code.unwrap_or(0) as u8));
            }
            State::Suspended => {
                eprintln!(
                    "ferry: session {} is suspended at {}",
                    session,
                    s.snapshot.unwrap_or_default()
                );
                return Ok(ExitCode::from(crate::guest::EXIT_SUSPENDED));
            }
            State::Killed => return Ok(ExitCode::from(137)),
            st => {
                let why = format!(
                    "session {} failed: {}",
                    session,
                    s.reason.unwrap_or_default()
                );
                // A guest that trapped: its exit code says so (134, as a local run).
                match s.exit_code {
                    Some(code) if st == State::Failed => {
                        crate::guest::say(&why);
                        return Ok(ExitCode::from(code as u8));
                    }
                    _ => bail!("{why}"),
                }
            }
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct AttachArgs {
    /// Session id (see `ferry --space URL ps`).
    pub session: String,
    /// When this terminal's input ends (Ctrl-D, or the end of a pipe), leave the session's
    /// input open for a later `attach` instead of ending it.
    #[arg(long)]
    pub keep_open: bool,
}

/// `ferry --space URL attach SESSION`: sends ferry's stdin to an interactive session and
/// prints its output (all of it so far, then as it comes), both following the session
/// wherever it moves, until it stops; exits as `wait` does.
pub fn attach(settings: &Settings, a: AttachArgs) -> Result<ExitCode> {
    let c = client(settings)?;
    let info = c.session(&a.session).map_err(api)?;
    anyhow::ensure!(
        info.interactive,
        "session {} takes no input: only a session run with --interactive does (`logs \
         --follow` shows its output)",
        a.session
    );
    anyhow::ensure!(
        !matches!(info.state, State::Exited | State::Failed | State::Killed),
        "session {} has ended ({}): it takes no more input (`logs` shows its output)",
        a.session,
        info.state.name()
    );
    attach_to(c, &a.session, a.keep_open)
}

/// Attaches to session `session` of the space `c` speaks to (see [`attach`]).
fn attach_to(c: SpaceClient, session: &str, keep_open: bool) -> Result<ExitCode> {
    // Ctrl-C detaches: ferry ends, the session runs on — even where ferry was started with
    // SIGINT ignored (a background job of a shell), which it would otherwise inherit.
    // SAFETY: restoring the default disposition of one signal, before any thread of this
    // command starts.
    unsafe { libc::signal(libc::SIGINT, libc::SIG_DFL) };
    let sender = c.elsewhere(c.base());
    let id = session.to_owned();
    // Where the session is, as the output's reader follows it: the sender goes there when
    // the space it sends to does not answer (its standby took the session over).
    let holder = Arc::new(Mutex::new(c.base().to_owned()));
    let held = holder.clone();
    // Input goes on a thread of its own: a read of the terminal blocks until a line comes.
    std::thread::Builder::new()
        .name("attach-input".into())
        .spawn(move || {
            if let Err(e) = send_stdin(sender, &id, keep_open, &held) {
                crate::guest::say(&format!("{e:#}"));
            }
        })
        .context("cannot start the thread sending input")?;
    let c = print_logs(c, session, Follow::UntilEnd, Some(&holder))?;
    wait_at(c, session)
}

/// How long input that a space does not take for now (being moved, unreachable) is offered
/// again before `attach` gives up on it.
const INPUT_PATIENCE: Duration = Duration::from_secs(120);

/// Sends ferry's stdin to session `id` as it comes, each piece at its place in the session's
/// input (`at`), so that a piece sent again after an unanswered request is taken once; then
/// ends the input, unless `keep_open`.
fn send_stdin(mut c: SpaceClient, id: &str, keep_open: bool, holder: &Mutex<String>) -> Result<()> {
    use std::io::Read;
    let offer = |c: &mut SpaceClient, at, bytes: &[u8], end| offer(c, id, at, bytes, end, holder);
    // Where this sender's input starts: after what the session received before.
    let mut at = offer(&mut c, None, &[], false)?;
    let mut stdin = std::io::stdin().lock();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match stdin.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).context("reading input"),
        };
        if n == 0 {
            if !keep_open {
                offer(&mut c, Some(at), &[], true)?;
            }
            return Ok(());
        }
        at = offer(&mut c, Some(at), &buf[..n], false)?;
    }
}

/// Sends one piece of input until the session takes it, following the session when it
/// moves (or where `holder` says it is, when its space does not answer) and waiting while
/// it is being moved or cannot be reached; returns the length of the input the session has
/// received.
fn offer(
    c: &mut SpaceClient,
    id: &str,
    at: Option<u64>,
    bytes: &[u8],
    end: bool,
    holder: &Mutex<String>,
) -> Result<u64> {
    let started = std::time::Instant::now();
    loop {
        let e = match c.send_input(id, at, bytes, end) {
            Ok(a) => return Ok(a.received),
            Err(e) => e,
        };
        // Moved meanwhile: the input goes where the session went.
        if e.status == 409
            && let Ok(info) = c.session(id)
            && info.state == State::Moved
            && let Some(to) = info.moved_to
        {
            *c = c.elsewhere(&to);
            continue;
        }
        // Not answering, and the output's reader found the session elsewhere (its standby
        // took it over).
        if e.status == 0 {
            let now = holder.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if now != c.base() {
                *c = c.elsewhere(&now);
                continue;
            }
        }
        // Being moved (503), or not answering (0): offered again, as is.
        if (e.status == 503 || e.status == 0) && started.elapsed() < INPUT_PATIENCE {
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        bail!(
            "input not sent ({} bytes{}): {}",
            bytes.len(),
            if end { ", and its end" } else { "" },
            e.msg
        );
    }
}

#[derive(Debug, clap::Args)]
pub struct FilesArgs {
    /// Session id (see `ferry --space URL ps`).
    pub session: String,
    /// Write the files of the mount at GUEST into HOST, a directory that must be new or
    /// empty (repeatable). Without it, the mounts are listed.
    #[arg(long = "dir", value_name = "HOST::GUEST")]
    pub dirs: Vec<String>,
}

/// `ferry --space URL files SESSION [--dir HOST::GUEST]...`: the files of a session's mounts,
/// wherever it moved — as its guest left them when it exited or failed, else as of its latest
/// snapshot. Fetches only the objects this store lacks (each verified) and writes them into
/// new or empty directories, never over anything.
pub fn files(settings: &Settings, a: FilesArgs) -> Result<ExitCode> {
    let mut c = client(settings)?;
    // Follow the session to where it is (bounded: a move chain longer than this is a loop).
    for _ in 0..16 {
        let s = c.session(&a.session).map_err(api)?;
        match (s.state, s.moved_to) {
            (State::Moved, Some(to)) => c = c.elsewhere(&to),
            _ => break,
        }
    }
    let f = c.files(&a.session).map_err(api)?;
    let when = match &f.snapshot {
        Some(k) => format!("as of its snapshot {k} (it is {})", f.state.name()),
        None => format!("as its guest left them ({})", f.state.name()),
    };
    if a.dirs.is_empty() {
        for m in &f.mounts {
            println!("{}\t{}", m.guest, m.tree);
        }
        match f.mounts.is_empty() {
            true => eprintln!("ferry: session {} has no mounts", a.session),
            false => eprintln!(
                "ferry: the files of session {} {when}; `--dir HOST::GUEST` writes a mount's \
                 files into HOST",
                a.session
            ),
        }
        return Ok(ExitCode::SUCCESS);
    }
    // Every destination is checked before anything is fetched or written.
    let mut todo = Vec::new();
    for d in &a.dirs {
        let spec = crate::guest::parse_dir(d)?;
        let guest = spec.guest_path;
        let Some(m) = f.mounts.iter().find(|m| m.guest == guest) else {
            let known: Vec<&str> = f.mounts.iter().map(|m| m.guest.as_str()).collect();
            bail!(
                "session {} has no mount at `{guest}` (its mounts: {})",
                a.session,
                match known.is_empty() {
                    true => "none".to_owned(),
                    false => known.join(", "),
                }
            );
        };
        let host = spec.host_dir;
        if host.exists() {
            let mut entries = std::fs::read_dir(&host)
                .with_context(|| format!("{} is not a directory", host.display()))?;
            anyhow::ensure!(
                entries.next().is_none(),
                "{} is not empty: files are written only into a new or empty directory",
                host.display()
            );
        }
        let k: ferry_kappa::Kappa = m
            .tree
            .parse()
            .map_err(|e| anyhow!("the space named tree `{}`: {e}", m.tree))?;
        todo.push((guest, host, k));
    }
    let store = settings.open_store()?;
    let space = c.store();
    for (guest, host, k) in todo {
        let mut progress = crate::cmd::space::progress("fetched");
        let stats = ferry_space::pull_tree(&space, &store, k, &mut progress)
            .with_context(|| format!("cannot fetch the files of `{guest}`"))?;
        let written = AtomicU64::new(0);
        // Every object is here now: the total is known before the writing starts.
        let total = ferry_wasi::tree::tree_len(&store, &k)
            .map(|t| format!(" of {:.1}", crate::cmd::mib(t)))
            .unwrap_or_default();
        crate::guest::saying_progress(
            || {
                format!(
                    "writing `{guest}` into {}: {:.1}{total} MiB",
                    host.display(),
                    crate::cmd::mib(written.load(Ordering::Relaxed))
                )
            },
            || ferry_wasi::tree::materialize_counting(&store, &k, &host, &written),
        )
        .with_context(|| format!("cannot write the files of `{guest}`"))?;
        eprintln!(
            "ferry: wrote `{guest}` of session {} into {} ({} objects, {} fetched, {:.1} MiB)",
            a.session,
            host.display(),
            stats.objects,
            stats.moved,
            crate::cmd::mib(stats.bytes)
        );
    }
    eprintln!("ferry: the files are {when}");
    Ok(ExitCode::SUCCESS)
}

/// `suspend`, `checkpoint`, `kill` on a space.
pub fn stop(settings: &Settings, session: &str, verb: &str) -> Result<ExitCode> {
    let c = client(settings)?;
    let s = c.stop(session, verb).map_err(api)?;
    match &s.snapshot {
        Some(k) if verb != "kill" => println!("{k}"),
        _ => {}
    }
    eprintln!("ferry: session {} is {}", s.id, s.state.name());
    Ok(ExitCode::SUCCESS)
}

/// `ferry --space URL resume SESSION`.
pub fn resume(settings: &Settings, session: &str, engine: Option<&str>) -> Result<ExitCode> {
    let c = client(settings)?;
    // The space restores the memory and writes the mounted directories out first.
    let s = crate::guest::saying_progress(
        || format!("waiting for {} to resume the session", c.base()),
        || {
            c.resume(
                session,
                &ResumeRequest {
                    engine: engine.map(str::to_owned),
                },
            )
        },
    )
    .map_err(api)?;
    eprintln!(
        "ferry: session {} is {} on {}",
        s.id,
        s.state.name(),
        c.base()
    );
    Ok(ExitCode::SUCCESS)
}

/// `ferry --space URL reclaim SESSION`.
pub fn reclaim(settings: &Settings, a: SessionArgs) -> Result<ExitCode> {
    let c = client(settings)?;
    let s = c.reclaim(&a.session).map_err(api)?;
    if let Some(k) = &s.snapshot {
        println!("{k}");
    }
    eprintln!(
        "ferry: session {} is {} at its last snapshot (epoch {}); `ferry --space {} resume {}` \
         continues it",
        s.id,
        s.state.name(),
        s.epoch,
        c.base(),
        s.id
    );
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["to", "none"])))]
pub struct StandbyArgs {
    /// Session id (see `ferry --space URL ps`).
    session: String,
    /// The new standby: another space of the same etcd fleet, or `auto`: the space chooses
    /// one that would admit the guest (another than the current one), and chooses again
    /// whenever it is gone.
    #[arg(long, value_name = "URL|auto")]
    to: Option<String>,
    /// No standby any more: the session's whole output is shown, and nothing takes it over.
    #[arg(long)]
    none: bool,
}

/// `ferry --space URL standby SESSION --to URL2 | --none`: another standby (or a first one for
/// a session run with `--checkpoint-every`), or none.
pub fn standby(settings: &Settings, a: StandbyArgs) -> Result<ExitCode> {
    let c = client(settings)?;
    let req = ferry_space::api::SetStandby { to: a.to };
    let s = c.set_standby(&a.session, &req).map_err(api)?;
    match &s.standby {
        Some(to) => eprintln!(
            "ferry: session {}'s standby is {to}; its output is shown once {to} holds a \
             checkpoint",
            s.id
        ),
        None => eprintln!(
            "ferry: session {} has no standby now; all its output is shown",
            s.id
        ),
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, clap::Args)]
pub struct FleetArgs {
    /// The answer of `GET /v1/fleet` as it comes (JSON).
    #[arg(long)]
    json: bool,
}

/// `ferry --space URL fleet`: the live spaces of the space's fleet, one a line: URL, zone,
/// how many of this space's sessions it stands by for.
pub fn fleet(settings: &Settings, a: FleetArgs) -> Result<ExitCode> {
    let f = client(settings)?.fleet().map_err(api)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&f)?);
        return Ok(ExitCode::SUCCESS);
    }
    let width = f
        .spaces
        .iter()
        .map(|s| s.space.len())
        .max()
        .unwrap_or(5)
        .max(5);
    println!("{:<width$}  {:<16} STANDS BY FOR", "SPACE", "ZONE");
    for s in &f.spaces {
        let mut by = if s.space == f.me {
            "(this space)".to_owned()
        } else {
            match s.standby_for {
                1 => "1 session".to_owned(),
                n => format!("{n} sessions"),
            }
        };
        if s.draining {
            by.push_str(" (draining)");
        }
        let zone = s.zone.as_deref().unwrap_or("-");
        println!("{:<width$}  {zone:<16} {by}", s.space);
    }
    if !f.spaces.iter().any(|s| s.space == f.me) {
        eprintln!(
            "ferry: {} is not announced in etcd (its lease ran out: cut off from etcd?)",
            f.me
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `ferry --space URL metrics`: the text of `GET /v1/metrics`.
pub fn metrics(settings: &Settings) -> Result<ExitCode> {
    print!("{}", client(settings)?.metrics().map_err(api)?);
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, clap::Args)]
pub struct DrainArgs {
    /// Where the sessions go: a space's URL, or `auto`: the other live spaces of the space's
    /// etcd fleet that are not being drained — each session's standby first, then the rest,
    /// starting at a place the session id picks, so that the sessions spread over the fleet;
    /// a space that refuses one gives way to the next.
    #[arg(long, value_name = "URL|auto", default_value = "auto")]
    to: String,
    /// Most pre-copy rounds before each guest is paused.
    #[arg(long, default_value_t = 8)]
    max_rounds: u32,
    /// The longest each guest may stay paused (as `migrate --max-pause`): a move that would
    /// pause it longer is aborted, and the next space is tried.
    #[arg(long, value_name = "DURATION", value_parser = crate::cmd::run::parse_duration)]
    max_pause: Option<Duration>,
    /// Hold each guest back while it is copied when it writes too fast for its move to
    /// converge (as `migrate --auto-converge`).
    #[arg(long)]
    auto_converge: bool,
    /// End the draining: the space runs new sessions and takes moves again (and may be
    /// chosen as a standby). Moves nothing.
    #[arg(long)]
    undo: bool,
    /// How many sessions move at a time. More than one ends sooner when moves wait — small
    /// sessions, a slow network or etcd — but each guest's pause grows, and sessions with
    /// much memory gain nothing on few cores (docs/benchmarks.md, "Draining a space").
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    parallel: u16,
}

/// `ferry --space URL drain [--to URL2|auto]`: every running or suspended session of the
/// space moved elsewhere, `--parallel` at a time, each as `migrate` moves it (a refused move leaves
/// the session where it was, running as before). Progress on stderr; on stdout one JSON
/// object: `moved` (session, to) and `stayed` (session, why). Exit code 1 when any stayed.
pub fn drain(settings: &Settings, a: DrainArgs) -> Result<ExitCode> {
    let c = client(settings)?;
    if a.undo {
        c.set_draining(false).map_err(api)?;
        eprintln!(
            "ferry: {} is no longer draining: it runs new sessions and takes moves again",
            c.base()
        );
        return Ok(ExitCode::SUCCESS);
    }
    // First: nothing new starts or moves in meanwhile, and no space chooses it as a standby.
    c.set_draining(true).map_err(api)?;
    eprintln!(
        "ferry: {} is draining: it takes no new session (`drain --undo` ends that)",
        c.base()
    );
    let all = c.sessions().map_err(api)?;
    let copies = all.iter().filter(|s| s.state == State::Standby).count();
    let sessions: Vec<_> = all
        .into_iter()
        .filter(|s| matches!(s.state, State::Running | State::Suspended | State::Lent))
        .collect();
    if sessions.is_empty() {
        eprintln!(
            "ferry: {} runs no session and holds none suspended: nothing to move",
            c.base()
        );
    }
    let spaces = if sessions.is_empty() {
        Vec::new()
    } else if a.to == "auto" {
        let f = c.fleet().map_err(|e| {
            anyhow!(
                "{}: --to auto moves sessions to the other spaces of the space's fleet; \
                 give --to URL",
                e.msg
            )
        })?;
        // Another space being drained would refuse them.
        let others: Vec<String> = f
            .spaces
            .into_iter()
            .filter(|s| s.space != f.me && !s.draining)
            .map(|s| s.space)
            .collect();
        anyhow::ensure!(
            !others.is_empty(),
            "etcd announces no other live space of the fleet, not draining, to move the \
             sessions of {} to",
            c.base()
        );
        others
    } else {
        vec![a.to.trim_end_matches('/').to_owned()]
    };
    let total = sessions.len();
    // Each move as `migrate` would make it (its destination set per try).
    let how = MigrateRequest {
        max_rounds: a.max_rounds,
        max_pause_ms: a.max_pause.map(|d| d.as_millis() as u64),
        auto_converge: a.auto_converge,
        ..MigrateRequest::to("")
    };
    // Movers take the sessions in the order listed; each outcome (where it went, or why it
    // stayed) is reported in that order.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut outcomes: Vec<(usize, Result<String, String>)> = std::thread::scope(|scope| {
        let movers: Vec<_> = (0..usize::from(a.parallel).min(total))
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let n = next.fetch_add(1, Ordering::SeqCst);
                        let Some(s) = sessions.get(n) else {
                            return mine;
                        };
                        let at = format!("[{}/{total}] session {}", n + 1, s.id);
                        let outcome = drain_one(&c, s, &spaces, &how, &at);
                        if let Err(why) = &outcome {
                            eprintln!("ferry: {at} stays at {}: {why}", c.base());
                        }
                        mine.push((n, outcome));
                    }
                })
            })
            .collect();
        movers
            .into_iter()
            .flat_map(|m| m.join().expect("a mover panicked"))
            .collect()
    });
    outcomes.sort_by_key(|(n, _)| *n);
    let (mut moved, mut stayed) = (Vec::new(), Vec::new());
    for (n, outcome) in outcomes {
        let id = &sessions[n].id;
        match outcome {
            Ok(to) => moved.push(serde_json::json!({ "session": id, "to": to })),
            Err(why) => stayed.push(serde_json::json!({ "session": id, "why": why })),
        }
    }
    eprintln!(
        "ferry: moved {} of {total} session(s) off {}{}",
        moved.len(),
        c.base(),
        if stayed.is_empty() {
            String::new()
        } else {
            format!("; {} stay there", stayed.len())
        }
    );
    if copies > 0 {
        eprintln!(
            "ferry: {} also holds {copies} standby cop{} of other spaces' sessions: a session \
             whose space chooses its standby gets another once this space stops; one named \
             with --standby URL holds its output until `standby ID --to` names another",
            c.base(),
            if copies == 1 { "y" } else { "ies" }
        );
    }
    println!(
        "{}",
        serde_json::json!({ "moved": moved, "stayed": stayed })
    );
    Ok(if stayed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Moves session `s` off the space `c` speaks to for `drain`: to its standby first (it holds
/// most of the session already), then to the other `spaces` from a place its id picks, each
/// refusal giving way to the next. Where it went, or why it stays. Progress on stderr,
/// each line starting with `at`.
fn drain_one(
    c: &SpaceClient,
    s: &ferry_space::api::SessionInfo,
    spaces: &[String],
    how: &MigrateRequest,
    at: &str,
) -> Result<String, String> {
    if s.state == State::Lent {
        return Err(format!(
            "lent to {} (`ferry --space {} reclaim {}` first)",
            s.lent_to.as_deref().unwrap_or("a client"),
            c.base(),
            s.id
        ));
    }
    let mut order = spaces.to_vec();
    ferry_space::sessions::start_where_id_picks(&s.id, &mut order);
    if let Some(standby) = &s.standby
        && let Some(i) = order.iter().position(|o| o == standby)
    {
        let standby = order.remove(i);
        order.insert(0, standby);
    }
    let mut refusals = Vec::new();
    for to in &order {
        eprintln!("ferry: {at} ({}): moving to {to}", s.state.name());
        let req = MigrateRequest {
            to: to.clone(),
            ..how.clone()
        };
        match c.migrate(&s.id, &req) {
            Ok(r) => {
                let held = r
                    .held_ms
                    .map(|ms| format!(" (held back {:.1} s)", ms as f64 / 1000.0))
                    .unwrap_or_default();
                eprintln!(
                    "ferry: {at} moved to {to}: paused {} ms, {} ms in all{held}",
                    r.downtime_ms, r.total_ms
                );
                return Ok(to.clone());
            }
            Err(e) => {
                eprintln!("ferry: {at}: {to} did not take it: {}", e.msg);
                refusals.push(format!("{to}: {}", e.msg));
                // An answer lost (not a refusal): the move may still be going on, so no
                // other space is tried for it.
                if e.status == 0 {
                    refusals.push(format!(
                        "the move may still be going on: `ferry --space {} ps` says where it is",
                        c.base()
                    ));
                    break;
                }
            }
        }
    }
    Err(refusals.join("; "))
}

#[derive(Debug, clap::Args)]
pub struct MigrateArgs {
    /// Session id (see `ferry --space URL ps`).
    session: String,
    /// The destination space, e.g. http://127.0.0.1:7071
    #[arg(long, value_name = "URL")]
    to: String,
    /// Show each pre-copy round as it completes.
    #[arg(long)]
    progress: bool,
    /// Engine on the destination (default: the one it runs on).
    #[arg(long, value_name = "ENGINE")]
    engine: Option<ferry_engine::EngineKind>,
    /// Most pre-copy rounds before the guest is paused.
    #[arg(long, default_value_t = 8)]
    max_rounds: u32,
    /// The longest the guest may stay paused (e.g. 5s): if the final snapshot, final delta
    /// and the destination's prepare have not ended by then, the move is aborted and the
    /// guest runs on where it is. Default: no bound.
    #[arg(long, value_name = "DURATION", value_parser = crate::cmd::run::parse_duration)]
    max_pause: Option<Duration>,
    /// Hold the guest back while it is copied when it writes its memory too fast for the
    /// move to converge — within --max-pause, else to a final delta of 4 MiB: from 20% of
    /// its time, more each round, at most 99%. It runs at full speed again once paused, or
    /// when the move is given up.
    #[arg(long)]
    auto_converge: bool,
}

/// Prints the pre-copy rounds after the first `shown` on stderr; returns how many are shown.
fn show_rounds(rounds: &[ferry_space::api::Round], shown: usize) -> usize {
    for (i, r) in rounds.iter().enumerate().skip(shown) {
        let foreseen = match (r.foreseen_bytes, r.foreseen_pause_ms) {
            (Some(b), Some(ms)) => {
                format!(
                    " (paused now, ~{:.1} MiB would be left to send: ~{ms} ms)",
                    mib(b)
                )
            }
            _ => String::new(),
        };
        let held = r
            .held_percent
            .map(|p| format!(", the guest held {p}% of its time"))
            .unwrap_or_default();
        eprintln!(
            "ferry: pre-copy round {}: {} objects, {:.1} MiB, {} ms{held}{foreseen}",
            i + 1,
            r.objects,
            mib(r.bytes),
            r.ms
        );
    }
    shown.max(rounds.len())
}

/// `ferry --space URL migrate SESSION --to URL`.
pub fn migrate(settings: &Settings, a: MigrateArgs) -> Result<ExitCode> {
    let c = client(settings)?;
    let mut req = MigrateRequest::to(&a.to);
    req.max_rounds = a.max_rounds;
    req.engine = a.engine.map(|e| e.name().into());
    req.max_pause_ms = a.max_pause.map(|d| d.as_millis() as u64);
    req.auto_converge = a.auto_converge;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The session's record of its last move, to tell this one's from it.
    let before = a
        .progress
        .then(|| c.session(&a.session).ok().and_then(|s| s.migration))
        .flatten();
    let watcher = a.progress.then(|| {
        let (c, id, done) = (c.elsewhere(c.base()), a.session.clone(), done.clone());
        std::thread::spawn(move || {
            let mut shown = 0;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                // (Until this move's record replaces it, the session shows the last move's.)
                if let Ok(s) = c.session(&id)
                    && let Some(m) = s.migration
                    && m.outcome == "in progress"
                {
                    shown = show_rounds(&m.rounds, shown);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            shown
        })
    });
    let r = c.migrate(&a.session, &req);
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let shown = watcher.map_or(0, |w| w.join().unwrap_or(0));
    if a.progress
        && r.is_err()
        && let Ok(s) = c.session(&a.session)
        && let Some(m) = s.migration
        && Some(&m) != before.as_ref()
    {
        // A move given up after rounds the watcher had not seen yet: they are in the
        // session's record.
        show_rounds(&m.rounds, shown);
    }
    let report = r.map_err(|e| {
        if e.status == 0 {
            // The answer was lost, not refused: the space may still be moving it.
            api(ApiError::new(
                0,
                format!(
                    "{}; the move may still be going on there, or have ended: \
                     `ferry --space {} ps` says where session `{}` is",
                    e.msg,
                    c.base(),
                    a.session
                ),
            ))
        } else {
            api(e)
        }
    })?;
    if a.progress {
        // Rounds that ended between two looks of the watcher (a short move ends before its
        // first look) are shown from the report.
        show_rounds(&report.rounds, shown);
    }
    eprintln!(
        "ferry: session {} moved to {}: {} pre-copy round(s) ({:.1} MiB), final delta {} objects ({:.1} MiB), \
         {:.1} MiB sent for {:.1} MiB of memory; paused {} ms, {} ms in all",
        a.session,
        report.to,
        report.rounds.len(),
        mib(report.rounds.iter().map(|r| r.bytes).sum()),
        report.final_objects,
        mib(report.final_bytes),
        mib(report.total_bytes),
        mib(report.memory_bytes),
        report.downtime_ms,
        report.total_ms
    );
    if let Some(ms) = report.held_ms {
        eprintln!(
            "ferry: the guest was held back {:.1} s in all while it was copied",
            ms as f64 / 1000.0
        );
    }
    if let Some(to) = &report.standby {
        eprintln!("ferry: its standby {to} follows it");
    }
    println!("{}", serde_json::to_string(&report)?);
    Ok(ExitCode::SUCCESS)
}
