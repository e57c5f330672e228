//! Running `ferry` the way a user does, and the churn driver: suspend at random points,
//! resume each time in a new process, and collect exactly what the user saw.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Repository root (for guests).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repo root")
}

/// A built test guest under `guests/`.
pub fn guest(rel: &str) -> PathBuf {
    let p = repo().join("guests").join(rel);
    assert!(
        p.exists(),
        "missing guest {} (run guests/build.sh)",
        p.display()
    );
    p
}

/// A private store and scratch directory.
pub struct Env {
    pub dir: tempfile::TempDir,
    vars: Vec<(String, String)>,
    stdin: Option<PathBuf>,
}

/// What one (possibly interrupted many times) run showed the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub stdout: Vec<u8>,
    /// The guest's stderr: ferry's own lines (`suspended …`, `ferry: …`) removed.
    pub stderr: String,
    pub code: i32,
    /// Snapshots taken on the way.
    pub snapshots: Vec<String>,
}

impl Env {
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("temp dir"),
            vars: Vec::new(),
            stdin: None,
        }
    }

    /// Sets an environment variable for every ferry this environment runs.
    pub fn with_var(mut self, k: &str, v: &str) -> Self {
        self.vars.push((k.to_owned(), v.to_owned()));
        self
    }

    /// Feeds this file as stdin to every ferry this environment runs (opened afresh each time).
    pub fn with_stdin(mut self, path: PathBuf) -> Self {
        self.stdin = Some(path);
        self
    }

    pub fn store(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// A new directory `rel` for a guest's files, and the `HOST::/data` form that mounts it.
    pub fn data_dir(&self, rel: &str) -> (PathBuf, String) {
        let d = self.path(rel);
        std::fs::create_dir_all(&d).expect("data dir");
        let mount = format!("{}::/data", d.display());
        (d, mount)
    }

    pub fn ferry(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
        c.env("FERRY_STORE", self.store())
            // Every incremental snapshot is checked against a full one.
            .env("FERRY_VERIFY_DIRTY", "1")
            .env_remove("FERRY_LOG")
            .env_remove("FERRY_ENGINE")
            // A space and token of the shell's own must not reach the tests' commands.
            .env_remove("FERRY_SPACE")
            .env_remove("FERRY_TOKEN")
            .stdin(Stdio::null());
        for (k, v) in &self.vars {
            c.env(k, v);
        }
        if let Some(p) = &self.stdin {
            c.stdin(File::open(p).expect("stdin file"));
        }
        c
    }

    /// Runs ferry to completion; returns (stdout, stderr, exit code).
    pub fn output(&self, args: &[&str]) -> (String, String, i32) {
        let out = self.ferry().args(args).output().expect("spawn ferry");
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            out.status.code().unwrap_or(-1),
        )
    }

    /// `ferry run`, interrupted once after `delay_ms`: the κ of its snapshot (not resumed).
    pub fn suspend_once(&self, run_args: &[&str], delay_ms: u64) -> String {
        run_and_suspend(self, run_args, delay_ms).1
    }

    /// `ferry inspect --json κ`, which must succeed.
    pub fn inspect_json(&self, k: &str) -> serde_json::Value {
        let (out, err, code) = self.output(&["inspect", "--json", k]);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str(&out).expect("inspect --json prints JSON")
    }

    /// Session `id`'s record (`sessions/<id>.json`).
    pub fn session_record(&self, id: &str) -> serde_json::Value {
        let p = self.store().join("sessions").join(format!("{id}.json"));
        serde_json::from_slice(&std::fs::read(p).expect("session record")).expect("JSON")
    }

    /// `ferry run` without interruption.
    pub fn plain(&self, run_args: &[&str]) -> Seen {
        self.churn(run_args, &[], 0, 0, (0, 0))
    }

    /// Runs `ferry run RUN_ARGS`, sends SIGINT after a random delay in `delay_ms`, and
    /// resumes with `ferry resume RESUME_ARGS κ` in a new process, up to `suspends` times;
    /// then lets it finish.
    pub fn churn(
        &self,
        run_args: &[&str],
        resume_args: &[&str],
        suspends: usize,
        seed: u64,
        delay_ms: (u64, u64),
    ) -> Seen {
        self.churn_on(&[], run_args, resume_args, suspends, seed, delay_ms)
    }

    /// [`Env::churn`] with step i (the run, then each resume) on `engines[i % len]`.
    pub fn churn_on(
        &self,
        engines: &[&str],
        run_args: &[&str],
        resume_args: &[&str],
        suspends: usize,
        seed: u64,
        delay_ms: (u64, u64),
    ) -> Seen {
        let out_path = self.path(&format!("stdout-{seed}-{suspends}"));
        let _ = std::fs::remove_file(&out_path);
        let mut rng = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407)
            | 1;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut seen = Seen {
            stdout: vec![],
            stderr: String::new(),
            code: -1,
            snapshots: vec![],
        };
        let mut args: Vec<String> = std::iter::once("run".to_owned())
            .chain(run_args.iter().map(|s| s.to_string()))
            .collect();
        let started = Instant::now();
        let mut early_kills = 0;
        loop {
            let stdout = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&out_path)
                .expect("stdout file");
            let err_path = self.path("stderr-step");
            let stderr = File::create(&err_path).expect("stderr file");
            let out_len = std::fs::metadata(&out_path).map_or(0, |m| m.len());
            let mut cmd = self.ferry();
            if !engines.is_empty() {
                cmd.env(
                    "FERRY_ENGINE",
                    engines[seen.snapshots.len() % engines.len()],
                );
            }
            let mut child = cmd
                .args(&args)
                .stdout(stdout)
                .stderr(stderr)
                .spawn()
                .expect("spawn ferry");
            let interrupt = seen.snapshots.len() < suspends;
            if interrupt {
                let span = delay_ms.1.saturating_sub(delay_ms.0).max(1);
                let delay = delay_ms.0 + next() % span;
                std::thread::sleep(Duration::from_millis(delay));
                // SAFETY: signalling our own child; if it already exited the call just fails.
                unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
            }
            let status = child.wait().expect("wait ferry");
            // A SIGINT that lands before ferry has installed its handlers (a loaded machine can
            // take that long to start a process) ends it the default way: nothing has run yet,
            // nothing was written, and the same step is simply tried again.
            if std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGINT) {
                assert_eq!(
                    std::fs::metadata(&out_path).map_or(0, |m| m.len()),
                    out_len,
                    "ferry died of SIGINT after the guest had written output"
                );
                early_kills += 1;
                assert!(early_kills < 20, "ferry keeps dying before it starts");
                continue;
            }
            let mut err = String::new();
            File::open(&err_path)
                .and_then(|mut f| f.read_to_string(&mut err))
                .expect("read stderr");
            let mut snapshot = None;
            for line in err.lines() {
                if let Some(k) = line.strip_prefix("suspended ") {
                    snapshot = Some(k.to_owned());
                } else if !line.starts_with("ferry: ") {
                    seen.stderr.push_str(line);
                    seen.stderr.push('\n');
                }
            }
            let code = status.code().unwrap_or(-1);
            match (code, snapshot) {
                (75, Some(k)) => {
                    assert!(k.starts_with("blake3:") && k.len() == 71, "bad κ {k}");
                    seen.snapshots.push(k.clone());
                    args = std::iter::once("resume".to_owned())
                        .chain(resume_args.iter().map(|s| s.to_string()))
                        .chain(std::iter::once(k))
                        .collect();
                }
                (75, None) => panic!("exit 75 without a snapshot line; stderr:\n{err}"),
                _ => {
                    seen.code = code;
                    break;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(600),
                "churn did not finish"
            );
        }
        seen.stdout = std::fs::read(&out_path).expect("read stdout");
        seen
    }
}

/// Runs `run_args` uninterrupted, then churned (step i on `engines[i % len]`, or the default
/// engine when `engines` is empty), in a fresh environment, and requires the same stdout
/// bytes, guest stderr and exit code, with at least `min(suspends, 2)` suspends on the way.
pub fn check_churn(
    engines: &[&str],
    run_args: &[&str],
    suspends: usize,
    delay_ms: (u64, u64),
    seed: u64,
) {
    let env = Env::new();
    let plain = env.plain(run_args);
    let churned = env.churn_on(engines, run_args, &[], suspends, seed, delay_ms);
    assert_same_run(&churned, &plain, suspends.min(2));
}

/// A churned run showed exactly what the uninterrupted `plain` one did — stdout bytes, guest
/// stderr, exit code — after at least `min_suspends` suspends.
pub fn assert_same_run(churned: &Seen, plain: &Seen, min_suspends: usize) {
    assert!(
        churned.snapshots.len() >= min_suspends,
        "expected at least {min_suspends} suspends, got {:?}",
        churned.snapshots
    );
    assert_eq!(
        String::from_utf8_lossy(&churned.stdout),
        String::from_utf8_lossy(&plain.stdout)
    );
    assert_eq!(churned.stdout, plain.stdout, "stdout bytes differ");
    assert_eq!(churned.stderr, plain.stderr, "guest stderr differs");
    assert_eq!(churned.code, plain.code, "exit code differs");
}

/// Waits (up to 30 s) until `ferry ps` in `env` shows a running session.
pub fn wait_until_running(env: &Env) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !env.output(&["ps"]).0.contains("running") {
        assert!(std::time::Instant::now() < deadline, "no session ever ran");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `ferry resume κ` in `env` to the guest's exit (code 0): its stdout.
pub fn resume_to_end(env: &Env, k: &str) -> Vec<u8> {
    resume_to_end_with(env, &[], k)
}

/// [`resume_to_end`] with options (`--dir HOST::GUEST`, …) before the κ.
pub fn resume_to_end_with(env: &Env, options: &[&str], k: &str) -> Vec<u8> {
    let out = env
        .ferry()
        .arg("resume")
        .args(options)
        .arg(k)
        .output()
        .expect("spawn ferry");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// `guests/python/loop.py` copied into `env`'s directory `app`: the `--dir` grant mounting it
/// at `/app`.
pub fn loop_py_app(env: &Env) -> String {
    let app = env.path("app");
    std::fs::create_dir_all(&app).expect("app dir");
    std::fs::copy(repo().join("guests/python/loop.py"), app.join("loop.py")).expect("loop.py");
    format!("{}::/app", app.display())
}

/// `len` bytes that neither repeat nor compress (a multiplicative hash of each index, plus
/// `seed`): a data file's stand-in, written fast.
pub fn varied_bytes(len: u32, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 24) as u8)
        .collect()
}

/// `ferry run ARGS` in `env`, interrupted after `ms`: (its stdout so far, the snapshot κ).
/// An interrupt that lands before the guest has started (a cold compiled-code cache, a loaded
/// machine) ends ferry with nothing run; the run is then tried again, waiting twice as long.
pub fn run_and_suspend(env: &Env, args: &[&str], ms: u64) -> (Vec<u8>, String) {
    suspend_after(env, "run", args, ms)
}

/// `ferry run ARGS` in `env` (ARGS asking for periodic checkpoints), interrupted once `ferry
/// ps` has shown its session's last snapshot take `n` different values: (its stdout so far,
/// the snapshot κ). Its history then holds at least `n + 1` snapshots however slow the
/// machine is (a fixed wait can see a single checkpoint when start-up is slow).
pub fn run_and_suspend_after_checkpoints(env: &Env, args: &[&str], n: usize) -> (Vec<u8>, String) {
    let mut child = env
        .ferry()
        .arg("run")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ferry");
    let pid = u64::from(child.id());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut seen: Vec<String> = Vec::new();
    while seen.len() < n {
        if let Some(status) = child.try_wait().expect("wait ferry") {
            panic!(
                "the run ended ({status}) after only {} checkpoints",
                seen.len()
            );
        }
        assert!(
            std::time::Instant::now() < deadline,
            "only {} checkpoints in 60 s",
            seen.len()
        );
        let (out, _, _) = env.output(&["ps", "--json"]);
        let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap_or_default();
        let last = rows
            .iter()
            .find(|r| r["pid"].as_u64() == Some(pid))
            .and_then(|r| r["last_snapshot"].as_str());
        if let Some(k) = last
            && !seen.iter().any(|s| s == k)
        {
            seen.push(k.to_owned());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().expect("wait ferry");
    let k = suspended_kappa(&out);
    (out.stdout, k)
}

/// `ferry resume ARGS` in `env`, interrupted after `ms`: as [`run_and_suspend`].
pub fn resume_and_suspend(env: &Env, args: &[&str], ms: u64) -> (Vec<u8>, String) {
    suspend_after(env, "resume", args, ms)
}

fn suspend_after(env: &Env, command: &str, args: &[&str], ms: u64) -> (Vec<u8>, String) {
    let (out, k) = suspend_after_output(env, command, args, ms);
    (out.stdout, k)
}

/// `ferry COMMAND ARGS` interrupted once after `ms` (later if it was interrupted before the
/// guest started): its whole output and the κ of its snapshot.
pub fn suspend_after_output(
    env: &Env,
    command: &str,
    args: &[&str],
    ms: u64,
) -> (std::process::Output, String) {
    let mut ms = ms;
    for _ in 0..8 {
        let child = env
            .ferry()
            .arg(command)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ferry");
        std::thread::sleep(Duration::from_millis(ms));
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let out = child.wait_with_output().expect("wait ferry");
        if std::os::unix::process::ExitStatusExt::signal(&out.status) == Some(libc::SIGINT) {
            assert!(
                out.stdout.is_empty(),
                "the guest ran before ferry died of SIGINT"
            );
            ms *= 2;
            continue;
        }
        let k = suspended_kappa(&out);
        return (out, k);
    }
    panic!("ferry keeps being interrupted before the guest starts");
}

/// The κ a ferry that exited suspended (code 75) printed on its `suspended κ` line.
pub fn suspended_kappa(out: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "not suspended: {err}");
    err.lines()
        .find_map(|l| l.strip_prefix("suspended "))
        .expect("snapshot line")
        .to_owned()
}

/// A WAT guest that prints `before\n` and traps (`unreachable`, as C's `abort()` compiles).
pub const ABORTING_GUEST: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "before\n")
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 16))
    (i32.store (i32.const 4) (i32.const 7))
    (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))
    unreachable))"#;

/// The id of the local session whose last snapshot is `k` (from `ferry ps --all --json`).
pub fn session_of(env: &Env, k: &str) -> String {
    let (ps, err, code) = env.output(&["ps", "--all", "--json"]);
    assert_eq!(code, 0, "{err}");
    let ps: serde_json::Value = serde_json::from_str(&ps).expect("ps --json");
    ps.as_array()
        .expect("a list of sessions")
        .iter()
        .find(|s| s["last_snapshot"] == k)
        .and_then(|s| s["id"].as_str())
        .unwrap_or_else(|| panic!("no session has {k} as its last snapshot: {ps}"))
        .to_owned()
}

/// Every file under `dir`, with contents, sorted (to compare directories).
pub fn dir_contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p
                    .strip_prefix(dir)
                    .expect("under dir")
                    .display()
                    .to_string();
                out.push((rel, std::fs::read(&p).expect("read file")));
            }
        }
    }
    out.sort();
    out
}

/// The bearer token of every test space.
pub const SPACE_TOKEN: &str = "test-space-token";

/// A `ferry serve` with a store of its own, restartable on the same port.
pub struct SpaceProc {
    pub env: Env,
    child: Option<Child>,
    pub url: String,
    port: u16,
    extra: Vec<String>,
    /// The address it listens on (`127.0.0.1`, or `0.0.0.0`: also reachable at 127.0.0.2).
    host: &'static str,
}

impl SpaceProc {
    pub fn start(extra: &[&str]) -> Self {
        Self::start_with_vars(&[], extra)
    }

    /// Like [`SpaceProc::start`], with environment variables for the server.
    pub fn start_with_vars(vars: &[(&str, &str)], extra: &[&str]) -> Self {
        Self::start_on(
            "127.0.0.1",
            0,
            vars,
            extra.iter().map(|s| s.to_string()).collect(),
        )
    }

    /// Like [`SpaceProc::start_with_vars`], listening on every address and telling its peers
    /// to reach it at 127.0.0.2 (`--advertise`) while clients use 127.0.0.1: a
    /// [`Blackhole::address`] of 127.0.0.2 then cuts it off from its peers only.
    pub fn start_for_peers_at_127_0_0_2(vars: &[(&str, &str)], extra: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut all = vec!["--advertise".to_owned(), format!("http://127.0.0.2:{port}")];
        all.extend(extra.iter().map(|s| s.to_string()));
        Self::start_on("0.0.0.0", port, vars, all)
    }

    fn start_on(host: &'static str, port: u16, vars: &[(&str, &str)], extra: Vec<String>) -> Self {
        let env = vars.iter().fold(
            Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN),
            |e, (k, v)| e.with_var(k, v),
        );
        let mut s = Self {
            env,
            child: None,
            url: String::new(),
            port,
            extra,
            host,
        };
        s.spawn(None);
        s
    }

    /// Starts the server (again), dying at `fault` (`FERRY_FAULT`) if given.
    pub fn spawn(&mut self, fault: Option<&str>) {
        let mut c = self.env.ferry();
        c.args(["serve", "--listen", &format!("{}:{}", self.host, self.port)])
            .args(&self.extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some(f) = fault {
            c.env("FERRY_FAULT", f);
        }
        let mut child = c.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        self.url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line `{line}`"))
            .replace("0.0.0.0", "127.0.0.1");
        self.port = self.url.rsplit(':').next().unwrap().parse().unwrap();
        self.child = Some(child);
        // A space of a fleet announces itself in etcd on a thread of its own, after it
        // listens: a test that asks the fleet for its spaces at once must find it there.
        if self.extra.iter().any(|a| a == "--etcd") {
            let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while self.ready().1.contains("not yet announced") && std::time::Instant::now() < until
            {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }

    /// Stops the server (its store stays; [`SpaceProc::spawn`] starts it again).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `GET /v1/ready` without a token: status and body.
    pub fn ready(&self) -> (u16, String) {
        let mut r = ureq::get(format!("{}/v1/ready", self.url))
            .config()
            .http_status_as_error(false)
            .build()
            .call()
            .unwrap();
        let body = r.body_mut().read_to_string().unwrap();
        (r.status().as_u16(), body)
    }

    /// Sends the server `sig` (`SIGSTOP`: its process hangs, its kernel still answering for
    /// it; `SIGCONT`: it goes on).
    pub fn signal(&self, sig: i32) {
        let c = self.child.as_ref().expect("a running server");
        // SAFETY: kill(2) on the pid of a child this harness started and has not waited for.
        unsafe {
            libc::kill(c.id() as i32, sig);
        }
    }

    /// Asks the server to stop as an init system does (SIGTERM) and waits for it to exit;
    /// returns its exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("a running server");
        // SAFETY: kill(2) on the pid of a child this harness started and has not waited for.
        unsafe {
            libc::kill(c.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the space at {} did not stop on SIGTERM",
                self.url
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for a space that is meant to die (fault injection) to be gone.
    pub fn wait_dead(&mut self) {
        let mut c = self.child.take().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while c.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "the space at {} did not die",
                self.url
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The session as the space's API shows it (None: it has no such session).
    pub fn session(&self, id: &str) -> Option<serde_json::Value> {
        let mut r = ureq::get(format!("{}/v1/sessions/{id}", self.url))
            .header("Authorization", format!("Bearer {SPACE_TOKEN}"))
            .config()
            .http_status_as_error(false)
            .build()
            .call()
            .unwrap();
        if r.status() == 404 {
            return None;
        }
        assert_eq!(r.status(), 200);
        Some(serde_json::from_slice(&r.body_mut().read_to_vec().unwrap()).unwrap())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The κ of session `id`'s latest snapshot, as the space's API shows it (it must have one).
    pub fn snapshot(&self, id: &str) -> String {
        self.session(id).expect("no such session")["snapshot"]
            .as_str()
            .expect("no snapshot yet")
            .to_owned()
    }

    pub fn state(&self, id: &str) -> Option<String> {
        self.session(id)
            .map(|s| s["state"].as_str().unwrap().to_owned())
    }
}

impl Drop for SpaceProc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Every packet to and from a TCP port of this machine dropped (an nftables table of its own,
/// deleted on drop): the server there has gone silent — its machine powered off, or cut off
/// by the network — instead of closing its connections. Needs root; `None` where nftables
/// cannot be used, except under CI (`CI` set), where that fails the test.
pub struct Blackhole {
    table: String,
}

impl Blackhole {
    pub fn port(port: u16) -> Option<Self> {
        Self::ports(&[port])
    }

    /// Several ports at once: two spaces cut off from each other (and from everyone else).
    pub fn ports(ports: &[u16]) -> Option<Self> {
        let rules = ports
            .iter()
            .map(|port| format!("tcp dport {port} drop\ntcp sport {port} drop\n"))
            .collect::<String>();
        Self::rules(ports[0], &rules)
    }

    /// Only the packets to and from `ip:port` (a space reached at several addresses stays
    /// reachable at the others).
    pub fn address(ip: &str, port: u16) -> Option<Self> {
        let rules =
            format!("ip daddr {ip} tcp dport {port} drop\nip saddr {ip} tcp sport {port} drop\n");
        Self::rules(port, &rules)
    }

    /// A table of its own holding `rules` (one per line, each a match and a verdict).
    fn rules(tag: u16, rules: &str) -> Option<Self> {
        let table = format!("ferry_test_{}_{tag}", std::process::id());
        let rules = rules.lines().fold(
            format!(
                "add table inet {table}\n\
                 add chain inet {table} out {{ type filter hook output priority 0; }}\n"
            ),
            |all, r| all + &format!("add rule inet {table} out {r}\n"),
        );
        let added = Command::new("nft")
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(rules.as_bytes())?;
                c.wait_with_output()
            });
        match added {
            Ok(o) if o.status.success() => Some(Self { table }),
            r => {
                let why = match r {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                    Err(e) => e.to_string(),
                };
                assert!(
                    std::env::var_os("CI").is_none(),
                    "nftables is needed to make a peer go silent: {why}"
                );
                eprintln!("skipped: nftables cannot be used here (needs root): {why}");
                None
            }
        }
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.table])
            .status();
    }
}

/// A tool the tests run: on the PATH, or where scripts/setup.sh unpacks it (`FERRY_TOOLS`,
/// else `~/.cache/ferry/tools`).
pub fn tool(name: &str) -> Option<String> {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .ok()?;
    if found.status.success() {
        return Some(String::from_utf8_lossy(&found.stdout).trim().to_owned());
    }
    let tools = std::env::var_os("FERRY_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/ferry/tools")
        });
    let p = tools.join(name);
    p.exists().then(|| p.to_string_lossy().into_owned())
}

/// The number that follows the first `phrase` in `text` (up to the next space), if any.
pub fn number_after(text: &str, phrase: &str) -> Option<u64> {
    text.split(phrase).nth(1)?.split(' ').next()?.parse().ok()
}

/// Waits until something listens on 127.0.0.1:`port` (at most 30 s: then `what` did not
/// start).
pub fn wait_for_port(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An S3-compatible server of the test's own (moto's, `scripts/fetch-moto.sh`, on a free
/// port, checking every request's signature), holding one bucket, `ferry-test`, and an
/// access key allowed everything; stopped on drop.
pub struct S3Server {
    pub endpoint: String,
    pub access_key: String,
    pub secret: String,
    python: String,
    child: std::process::Child,
}

impl S3Server {
    pub fn start() -> Self {
        let server = tool("moto/bin/moto_server")
            .expect("moto's S3 server is missing: run scripts/setup.sh (scripts/fetch-moto.sh)");
        let python = server.replace("moto_server", "python");
        let port = free_port();
        // Unsigned, its first three calls create the key; every later one must be signed.
        let child = Command::new(&server)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .env("INITIAL_NO_AUTH_ACTION_COUNT", "3")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let endpoint = format!("http://127.0.0.1:{port}");
        let mut me = Self {
            endpoint,
            access_key: String::new(),
            secret: String::new(),
            python,
            child,
        };
        wait_for_port(port, "the S3 server");
        let keys = me.boto(
            r#"
iam = boto3.client("iam", endpoint_url=ep, aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1")
iam.create_user(UserName="ferry")
k = iam.create_access_key(UserName="ferry")["AccessKey"]
iam.put_user_policy(UserName="ferry", PolicyName="all", PolicyDocument=json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
print(k["AccessKeyId"], k["SecretAccessKey"])
"#,
        );
        let mut words = keys.split_whitespace();
        me.access_key = words.next().expect("an access key").to_owned();
        me.secret = words.next().expect("a secret").to_owned();
        me.boto("s3.create_bucket(Bucket='ferry-test')");
        me
    }

    /// Runs Python `code` with boto3 (`ep`: the endpoint, `s3`: a client signed with the
    /// key); returns what it printed.
    pub fn boto(&self, code: &str) -> String {
        let prelude = format!(
            "import boto3, json\nep = {:?}\n\
             s3 = boto3.client('s3', endpoint_url=ep, aws_access_key_id={:?}, \
             aws_secret_access_key={:?}, region_name='us-east-1')\n",
            self.endpoint, self.access_key, self.secret
        );
        let o = Command::new(&self.python)
            .arg("-c")
            .arg(format!("{prelude}{code}"))
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "boto3: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// `env` with this server's endpoint and key in the variables ferry reads.
    pub fn for_ferry(&self, env: Env) -> Env {
        env.with_var("AWS_ENDPOINT_URL", &self.endpoint)
            .with_var("AWS_REGION", "us-east-1")
            .with_var("AWS_ACCESS_KEY_ID", &self.access_key)
            .with_var("AWS_SECRET_ACCESS_KEY", &self.secret)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An etcd server of the test's own (Debian's `etcd`, on free ports, its data in a
/// temporary directory; clients reach it at 127.0.0.1 and 127.0.0.3), stopped on drop. `None` where there is no `etcd` binary, except
/// under CI (`CI` set), where that fails the test.
/// A port on 127.0.0.1 free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// etcd and etcdctl (unpacked by scripts/setup.sh); `None` (the test skipped) outside CI.
fn etcd_tools() -> Option<(String, String)> {
    let (Some(etcd), Some(etcdctl)) = (tool("etcd"), tool("etcdctl")) else {
        assert!(
            std::env::var_os("CI").is_none(),
            "etcd and etcdctl are needed for the fleet tests: run scripts/setup.sh"
        );
        eprintln!("skipped: no etcd here (scripts/setup.sh unpacks it)");
        return None;
    };
    Some((etcd, etcdctl))
}

/// A private CA made with `openssl` in a directory, issuing certificates for TLS tests.
pub struct TestCa {
    dir: PathBuf,
    /// Its certificate (PEM file).
    pub cert: String,
    key: String,
}

impl TestCa {
    pub fn new(dir: &Path) -> Self {
        let ca = Self {
            dir: dir.to_owned(),
            cert: dir.join("ca.pem").to_str().unwrap().to_owned(),
            key: dir.join("ca-key.pem").to_str().unwrap().to_owned(),
        };
        let subject = "/CN=ferry test CA";
        openssl(
            &[
                &["req", "-x509"][..],
                &EC_KEY,
                &["-days", "2", "-subj", subject, "-keyout", &ca.key],
                &["-out", &ca.cert],
            ]
            .concat(),
        );
        ca
    }

    /// A certificate it signed for `name`, with the extension lines `ext` (as an openssl
    /// extension file has them; `CA:FALSE` is added): (the certificate, its key), PEM files.
    pub fn issue(&self, name: &str, ext: &str) -> (String, String) {
        let path = |f: String| self.dir.join(f).to_str().unwrap().to_owned();
        let (cert, key, csr) = (
            path(format!("{name}.pem")),
            path(format!("{name}-key.pem")),
            path(format!("{name}.csr")),
        );
        let subject = format!("/CN=ferry test {name}");
        openssl(
            &[
                &["req"][..],
                &EC_KEY,
                &["-subj", &subject, "-keyout", &key, "-out", &csr],
            ]
            .concat(),
        );
        let extfile = path(format!("{name}.ext"));
        std::fs::write(&extfile, format!("basicConstraints=CA:FALSE\n{ext}\n")).unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &self.cert,
            "-CAkey",
            &self.key,
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &extfile,
            "-out",
            &cert,
        ]);
        (cert, key)
    }
}

/// openssl's arguments for a new P-256 key, unencrypted.
const EC_KEY: [&str; 5] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:prime256v1",
    "-nodes",
];

fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .expect("openssl (scripts/setup.sh installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// How etcd speaks TLS ([`Etcd::start_tls`]), and how etcdctl reaches it.
pub struct EtcdTls {
    /// The CA that signed etcd's certificate and the clients' (PEM).
    pub ca: String,
    /// A client certificate and key etcd accepts (PEM files).
    pub client: (String, String),
    /// The CA itself, to issue more certificates.
    pub issuer: TestCa,
    _dir: tempfile::TempDir,
}

pub struct Etcd {
    child: Child,
    /// Its client URL at 127.0.0.1 (it listens at 127.0.0.3 too: [`Etcd::url_at`]).
    pub url: String,
    etcdctl: String,
    /// `user:password` for etcdctl once [`Etcd::enable_auth`] turned authentication on.
    root: Option<String>,
    /// Set by [`Etcd::start_tls`].
    pub tls: Option<EtcdTls>,
    _dir: tempfile::TempDir,
}

impl Etcd {
    pub fn start() -> Option<Self> {
        Self::start_with(None)
    }

    /// An etcd serving HTTPS with a certificate of a private CA, which accepts only clients
    /// with a certificate that CA signed (`--client-cert-auth`).
    pub fn start_tls() -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new(dir.path());
        // Client authentication too: etcd's JSON gateway reaches etcd's own gRPC service
        // with the server's certificate.
        let _ = ca.issue(
            "etcd",
            "subjectAltName=IP:127.0.0.1,IP:127.0.0.3\nextendedKeyUsage=serverAuth,clientAuth",
        );
        let client = ca.issue("client", "extendedKeyUsage=clientAuth");
        Self::start_with(Some(EtcdTls {
            ca: ca.cert.clone(),
            client,
            issuer: ca,
            _dir: dir,
        }))
    }

    fn start_with(tls: Option<EtcdTls>) -> Option<Self> {
        let (etcd, etcdctl) = etcd_tools()?;
        let (client, peer) = (free_port(), free_port());
        let dir = tempfile::tempdir().unwrap();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://127.0.0.1:{client}");
        let mut cmd = Command::new(etcd);
        if let Some(t) = &tls {
            let at = |f: &str| t.issuer.dir.join(f).to_str().unwrap().to_owned();
            cmd.args([
                "--cert-file",
                &at("etcd.pem"),
                "--key-file",
                &at("etcd-key.pem"),
            ])
            .args(["--client-cert-auth", "--trusted-ca-file", &t.ca]);
        }
        let child = cmd
            .arg("--data-dir")
            .arg(dir.path())
            .args([
                "--listen-client-urls",
                &format!("{url},{scheme}://127.0.0.3:{client}"),
                "--advertise-client-urls",
                &url,
            ])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args([
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
            ])
            .args([
                "--initial-cluster",
                &format!("default=http://127.0.0.1:{peer}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let e = Self {
            child,
            url,
            etcdctl,
            root: None,
            tls,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !e.answers() {
            assert!(Instant::now() < deadline, "etcd did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(e)
    }

    /// Its client URL at `ip` (`127.0.0.1` or `127.0.0.3`): a space given the second can be
    /// cut off from etcd alone ([`Blackhole::address`]).
    pub fn url_at(&self, ip: &str) -> String {
        self.url.replace("127.0.0.1", ip)
    }

    pub fn port(&self) -> u16 {
        self.url.rsplit(':').next().unwrap().parse().unwrap()
    }

    fn answers(&self) -> bool {
        self.ctl(&["endpoint", "health"])
    }

    /// etcdctl against this etcd, as root once authentication is on.
    fn etcdctl(&self) -> Command {
        let mut c = Command::new(&self.etcdctl);
        c.args(["--endpoints", &self.url]);
        if let Some(t) = &self.tls {
            c.args([
                "--cacert",
                &t.ca,
                "--cert",
                &t.client.0,
                "--key",
                &t.client.1,
            ]);
        }
        if let Some(root) = &self.root {
            c.args(["--user", root]);
        }
        c
    }

    /// etcdctl against this etcd (as root once authentication is on): whether it succeeded.
    pub fn ctl(&self, args: &[&str]) -> bool {
        self.etcdctl()
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Turns etcd's user authentication on, with user `ferry` (password `ferrypw`) allowed to
    /// read and write under `/ferry/`.
    pub fn enable_auth(&mut self) {
        for args in [
            &["user", "add", "root:rootpw"][..],
            &["user", "grant-role", "root", "root"],
            &["role", "add", "ferry"],
            &[
                "role",
                "grant-permission",
                "ferry",
                "--prefix=true",
                "readwrite",
                "/ferry/",
            ],
            &["user", "add", "ferry:ferrypw"],
            &["user", "grant-role", "ferry", "ferry"],
            &["auth", "enable"],
        ] {
            assert!(self.ctl(args), "etcdctl {args:?}");
        }
        self.root = Some("root:rootpw".into());
    }

    /// The values of every key that starts with `prefix`, in key order.
    pub fn values(&self, prefix: &str) -> Vec<String> {
        let out = self
            .etcdctl()
            .args(["get", "--prefix", "--print-value-only", prefix])
            .output()
            .unwrap();
        assert!(out.status.success(), "etcdctl get {prefix}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// A session's owner record (`/ferry/sessions/<id>`), if it has one.
    pub fn owner(&self, id: &str) -> Option<serde_json::Value> {
        let key = format!("/ferry/sessions/{id}");
        let v = self.values(&key);
        v.first().map(|v| serde_json::from_str(v).unwrap())
    }
}

/// An etcd cluster of three members on 127.0.0.1, each of which can be stopped and started
/// again (its data directory kept): a fleet given all three client URLs goes on while two
/// answer.
pub struct EtcdCluster {
    members: Vec<Option<Child>>,
    /// Each member's client URL.
    pub urls: Vec<String>,
    peers: Vec<String>,
    etcd: String,
    etcdctl: String,
    dir: tempfile::TempDir,
}

impl EtcdCluster {
    pub fn start() -> Option<Self> {
        let (etcd, etcdctl) = etcd_tools()?;
        let urls: Vec<_> = (0..3)
            .map(|_| format!("http://127.0.0.1:{}", free_port()))
            .collect();
        let peers: Vec<_> = (0..3)
            .map(|_| format!("http://127.0.0.1:{}", free_port()))
            .collect();
        let mut c = Self {
            members: vec![None, None, None],
            urls,
            peers,
            etcd,
            etcdctl,
            dir: tempfile::tempdir().unwrap(),
        };
        for i in 0..3 {
            c.start_member(i);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while !c.healthy() {
            assert!(Instant::now() < deadline, "the etcd cluster did not start");
            std::thread::sleep(Duration::from_millis(200));
        }
        Some(c)
    }

    /// Starts member `i` (again).
    pub fn start_member(&mut self, i: usize) {
        let cluster: Vec<_> = self
            .peers
            .iter()
            .enumerate()
            .map(|(j, p)| format!("m{j}={p}"))
            .collect();
        let child = Command::new(&self.etcd)
            .args(["--name", &format!("m{i}")])
            .arg("--data-dir")
            .arg(self.dir.path().join(format!("m{i}")))
            .args(["--listen-client-urls", &self.urls[i]])
            .args(["--advertise-client-urls", &self.urls[i]])
            .args(["--listen-peer-urls", &self.peers[i]])
            .args(["--initial-advertise-peer-urls", &self.peers[i]])
            .args(["--initial-cluster", &cluster.join(",")])
            .args(["--initial-cluster-state", "new"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.members[i] = Some(child);
    }

    /// Stops member `i` (killed, as a machine that fails).
    pub fn stop_member(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends member `i` `sig` (`SIGSTOP`: its process hangs while its machine answers for
    /// it; `SIGCONT`: it goes on).
    pub fn signal_member(&self, i: usize, sig: i32) {
        let c = self.members[i].as_ref().expect("a running member");
        // SAFETY: kill(2) on the pid of a child this harness started and has not waited for.
        unsafe {
            libc::kill(c.id() as i32, sig);
        }
    }

    /// Every client URL, comma-separated (`ferry serve --etcd`).
    pub fn endpoints(&self) -> String {
        self.urls.join(",")
    }

    /// Whether the cluster has a leader that answers (a quorum).
    pub fn healthy(&self) -> bool {
        Command::new(&self.etcdctl)
            .args(["--endpoints", &self.endpoints(), "--command-timeout", "3s"])
            .args(["get", "health-probe"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// A session's owner record (`/ferry/sessions/<id>`), if it has one.
    pub fn owner(&self, id: &str) -> Option<serde_json::Value> {
        let out = Command::new(&self.etcdctl)
            .args(["--endpoints", &self.endpoints()])
            .args([
                "get",
                "--print-value-only",
                &format!("/ferry/sessions/{id}"),
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "etcdctl get");
        let v = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        (!v.is_empty()).then(|| serde_json::from_str(&v).unwrap())
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..3 {
            self.stop_member(i);
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy on 127.0.0.1 to `upstream` (a port of 127.0.0.1) that, once, breaks a
/// connection after it has carried `cut_after` bytes from the server: a network failing in
/// the middle of an answer. Its port; whether it has cut yet.
pub fn cutting_proxy(
    upstream: u16,
    cut_after: u64,
) -> (u16, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    use std::io::Write;
    use std::sync::atomic::Ordering;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let has_cut = cut.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(mut client) = client else { return };
            let Ok(mut server) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else {
                continue;
            };
            let (mut up_from, mut up_to) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut up_from, &mut up_to);
                let _ = up_to.shutdown(std::net::Shutdown::Write);
            });
            let cut = cut.clone();
            std::thread::spawn(move || {
                let mut carried = 0u64;
                let mut buf = [0u8; 4096];
                loop {
                    let n = match server.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if !cut.load(Ordering::SeqCst) && carried + n as u64 >= cut_after {
                        let part = (cut_after - carried) as usize;
                        let _ = client.write_all(&buf[..part]);
                        cut.store(true, Ordering::SeqCst);
                        let _ = client.shutdown(std::net::Shutdown::Both);
                        let _ = server.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                    carried += n as u64;
                    if client.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = client.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    (port, has_cut)
}

/// A TCP proxy on 127.0.0.1 to `upstream` (a port of 127.0.0.1) until the flag returned is
/// raised: then it cuts every connection it carries and closes each new one at once — a
/// machine cut off from a server. Its port and that flag.
pub fn switched_proxy(upstream: u16) -> (u16, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    use std::net::{Shutdown, TcpStream};
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let open: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
    let (cutting, carried) = (cut.clone(), open.clone());
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_millis(20));
            if cutting.load(Ordering::SeqCst) {
                for s in carried.lock().unwrap().drain(..) {
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
        }
    });
    let has_cut = cut.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            if cut.load(Ordering::SeqCst) {
                let _ = client.shutdown(Shutdown::Both);
                continue;
            }
            let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                continue;
            };
            open.lock()
                .unwrap()
                .extend([client.try_clone().unwrap(), server.try_clone().unwrap()]);
            for (mut from, mut to) in [
                (client.try_clone().unwrap(), server.try_clone().unwrap()),
                (server, client),
            ] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(Shutdown::Write);
                });
            }
        }
    });
    (port, has_cut)
}
