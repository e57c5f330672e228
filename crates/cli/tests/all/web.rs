//! The JavaScript space (`web/`): snapshots that ferry took on wasmtime or wasmi, pushed to a
//! space, resumed in V8 (Node 24, what `scripts/fetch-node.sh` installs) end exactly as an
//! uninterrupted run; what V8 cannot resume is refused with the reason; its hash and decoder
//! agree with ferry's.

use std::path::PathBuf;
use std::process::{Command, Output};

use crate::harness::{
    Env, SPACE_TOKEN, SpaceProc, dir_contents, guest, loop_py_app, repo, run_and_suspend,
    suspend_after_output, suspended_kappa,
};

/// Where `scripts/fetch-node.sh` puts the Nodes it fetches.
fn tools() -> PathBuf {
    std::env::var_os("FERRY_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/ferry/tools")
        })
}

/// `p`, which `scripts/setup.sh` must have fetched.
fn fetched(p: PathBuf) -> PathBuf {
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup.sh (scripts/fetch-node.sh)",
        p.display()
    );
    p
}

/// Node 24: `FERRY_NODE`, else where `scripts/fetch-node.sh` puts it.
pub(crate) fn node() -> PathBuf {
    fetched(
        std::env::var_os("FERRY_NODE")
            .map(PathBuf::from)
            .unwrap_or_else(|| tools().join("node-24.22.3/bin/node")),
    )
}

/// Node 24 for arm64 (what `scripts/fetch-node.sh` puts beside the x64 one), run by qemu-user
/// with the arm64 runtime libraries `scripts/setup.sh` installs: the words of the command.
pub(crate) fn node_arm64() -> Vec<String> {
    let node = fetched(tools().join("node-arm64-24.22.3/bin/node"));
    [
        "qemu-aarch64",
        "-L",
        "/usr/aarch64-linux-gnu",
        node.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

/// A command from its words (`node()` alone, or [`node_arm64`]'s).
pub(crate) fn command(words: &[String]) -> Command {
    let mut c = Command::new(&words[0]);
    c.args(&words[1..]);
    c
}

/// `ferry push k --to` the space, which must succeed.
fn push(env: &Env, k: &str, space: &SpaceProc) {
    let (_, err, code) = env.output(&["push", k, "--to", &space.url]);
    assert_eq!(code, 0, "{err}");
}

/// A new local store that pulled snapshot `k` from the space (another machine's, as it were).
fn pulled(k: &str, space: &SpaceProc) -> Env {
    let there = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let (_, err, code) = there.output(&["pull", k, "--from", &space.url]);
    assert_eq!(code, 0, "{err}");
    there
}

/// The guest's own lines of a stderr: ferry's (`suspended …`, `ferry: …`) left out.
fn guest_lines(stderr: &[u8]) -> String {
    String::from_utf8_lossy(stderr)
        .lines()
        .filter(|l| !l.starts_with("suspended ") && !l.starts_with("ferry: "))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// `node web/ferry-resume.mjs --space URL ARGS…` with the test spaces' token.
fn resume_in_v8(space: &SpaceProc, args: &[&str]) -> Output {
    Command::new(node())
        .arg(repo().join("web/ferry-resume.mjs"))
        .args(["--space", &space.url])
        .args(args)
        .env("FERRY_TOKEN", SPACE_TOKEN)
        .output()
        .expect("spawn node")
}

/// That `conformance.mjs`'s `table` ends saying all of its (at least `least`) snapshots passed.
pub(crate) fn all_passed(table: &str, least: usize) {
    let summary = table.lines().last().unwrap();
    let n: usize = summary.split(' ').next().unwrap().parse().unwrap();
    assert!(n >= least, "{table}");
    assert!(
        summary.ends_with(&format!("{n} passed, 0 failed, 0 known failures")),
        "{table}"
    );
}

/// A space serving the snapshots `ferry conformance --engine ENGINE --keep` takes of kit
/// v5 (kept in the space's own store), then `web/conformance.mjs --in RUNNER` over them (each
/// resume run by the command `resume_by` when given: `--node`): its table, once it has exited 0.
pub(crate) fn kit_in(engine: &str, runner: &str, resume_by: Option<&[String]>) -> String {
    let mut space = SpaceProc::start(&[]);
    space.stop();
    let store = space.env.store();
    let kit = repo().join("conformance/v5");
    let (out, err, code) = space.env.output(&[
        "conformance",
        "--kit",
        kit.to_str().unwrap(),
        "--engine",
        engine,
        "--keep",
        store.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    space.spawn(None);
    let token = space.env.path("token");
    std::fs::write(&token, SPACE_TOKEN).unwrap();
    let mut c = Command::new(node());
    c.arg(repo().join("web/conformance.mjs"))
        .args(["--in", runner, "--space", &space.url, "--token-file"])
        .arg(&token)
        .arg("--manifest")
        .arg(store.join("manifest.json"))
        .arg("--kit")
        .arg(&kit);
    if let Some(words) = resume_by {
        c.arg("--node").arg(words.join(" "));
    }
    if runner == "browser" {
        c.arg("--known-failures")
            .arg(repo().join("conformance/browser-known-failures.txt"));
    }
    let out = c.output().expect("spawn node");
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{table}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    table
}

#[test]
fn conformance_kit_snapshots_resume_in_v8() {
    // The kit's snapshots, taken on both engines.
    let table = kit_in("all", "node", None);
    // Every case of the kit, from both engines (CPython too, when setup fetched it).
    all_passed(&table, 50);
    for case in [
        "deep-recursion",
        "cpython",
        "descriptors-outlive-names",
        "hard-links",
        "inode-numbers",
    ] {
        assert!(
            table
                .lines()
                .any(|l| l.starts_with(case) && l.contains(" interp ") && l.ends_with(" pass")),
            "{case} taken on the interpreter:\n{table}"
        );
    }
}

/// The same snapshots resumed in a browser tab: a headless Chromium opening the space's
/// console (`/console/`), the guest in a worker of the page.
#[test]
fn conformance_kit_snapshots_resume_in_a_browser_tab() {
    let table = kit_in("jit", "browser", None);
    let summary = table.lines().last().unwrap();
    // deep-recursion is a known failure there (conformance/browser-known-failures.txt).
    assert!(
        summary.contains(" passed, 0 failed, 2 known failures"),
        "{table}"
    );
    for case in [
        "counter",
        "cpython",
        "inside-a-sleep",
        "open-files",
        "hard-links",
    ] {
        assert!(
            table
                .lines()
                .any(|l| l.starts_with(case) && l.ends_with(" pass")),
            "{case}:\n{table}"
        );
    }
}

#[test]
fn a_run_suspended_on_wasmtime_ends_in_v8_as_if_uninterrupted() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let g = guest("wasm/files.wasm");
    let (plain_dir, pd) = here.data_dir("plain");
    let (_, cd) = here.data_dir("churn");
    let plain = here.plain(&["--dir", &pd, g.to_str().unwrap(), "--", "/data", "500"]);
    let (mut seen, k) = run_and_suspend(
        &here,
        &["--dir", &cd, g.to_str().unwrap(), "--", "/data", "500"],
        300,
    );
    push(&here, &k, &space);

    let written = here.path("written");
    let out = resume_in_v8(&space, &["--write-mounts", written.to_str().unwrap(), &k]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    seen.extend(&out.stdout);
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain.stdout)
    );
    assert_eq!(
        dir_contents(&written.join("data")),
        dir_contents(&plain_dir),
        "the files the guest left in V8 differ from an uninterrupted run's"
    );

    // CPython 3.12, suspended mid-loop.
    let app = loop_py_app(&here);
    let py = crate::python::python312();
    let args = [
        "--dir",
        &app,
        py.to_str().unwrap(),
        "--",
        "/app/loop.py",
        "16",
    ];
    let plain = here.plain(&args);
    assert!(String::from_utf8_lossy(&plain.stdout).contains("done "));
    let (mut seen, k) = run_and_suspend(&here, &args, 1000);
    assert!(
        !seen.is_empty() && seen.len() < plain.stdout.len(),
        "suspended mid-loop"
    );
    push(&here, &k, &space);
    let out = resume_in_v8(&space, &[&k]);
    assert_eq!(
        out.status.code(),
        Some(plain.code),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    seen.extend(&out.stdout);
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain.stdout)
    );
}

/// `node web/ferry-resume.mjs` on snapshot `k`, sent SIGINT after `ms`: its output and the
/// κ of the snapshot it wrote to `space` (None if the guest ended first).
fn suspend_in_v8(space: &SpaceProc, k: &str, ms: u64) -> (Output, Option<String>) {
    let child = Command::new(node())
        .arg(repo().join("web/ferry-resume.mjs"))
        .args(["--space", &space.url, k])
        .env("FERRY_TOKEN", SPACE_TOKEN)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn node");
    std::thread::sleep(std::time::Duration::from_millis(ms));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let k2 = (out.status.code() == Some(75)).then(|| suspended_kappa(&out));
    (out, k2)
}

/// wasmtime → V8 → wasmtime: a guest suspended by ferry, resumed in Node and suspended there
/// (Ctrl-C) writes a snapshot the space verifies and names, which a native ferry pulls and
/// resumes; the three parts of the output are an uninterrupted run's, and so are the files.
#[test]
fn a_guest_suspended_in_v8_ends_natively_as_if_uninterrupted() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let files = guest("wasm/files.wasm");
    let sleepy = guest("wasm/sleepy.wasm");
    for (name, args, native_ms, v8_ms) in [
        (
            "files in a mount",
            vec![files.to_str().unwrap(), "--", "/data", "500"],
            300,
            400,
        ),
        (
            "sleeps, stderr, exit code 3",
            vec![sleepy.to_str().unwrap(), "--", "40", "3"],
            200,
            400,
        ),
    ] {
        let (plain_dir, pd) = here.data_dir(&format!("{name}-plain"));
        let (_, cd) = here.data_dir(&format!("{name}-churn"));
        fn with<'a>(d: &'a str, args: &[&'a str]) -> Vec<&'a str> {
            [&["--dir", d][..], args].concat()
        }
        let plain = here.plain(&with(&pd, &args));
        let (first, k) = suspend_after_output(&here, "run", &with(&cd, &args), native_ms);
        let mut stdout = first.stdout.clone();
        let mut stderr = guest_lines(&first.stderr);
        push(&here, &k, &space);

        let (out, k2) = suspend_in_v8(&space, &k, v8_ms);
        let k2 = k2.unwrap_or_else(|| {
            panic!(
                "{name}: not suspended in V8: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        stdout.extend(&out.stdout);
        stderr.push_str(&guest_lines(&out.stderr));

        let there = pulled(&k2, &space);
        let (end_dir, ed) = there.data_dir("data");
        let end = there
            .ferry()
            .args(["resume", "--dir", &ed, &k2])
            .output()
            .unwrap();
        assert_eq!(
            end.status.code(),
            Some(plain.code),
            "{name}: {}",
            String::from_utf8_lossy(&end.stderr)
        );
        stdout.extend(&end.stdout);
        stderr.push_str(&guest_lines(&end.stderr));
        assert_eq!(
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&plain.stdout),
            "{name}"
        );
        assert_eq!(stderr, plain.stderr, "{name}");
        assert_eq!(
            dir_contents(&end_dir),
            dir_contents(&plain_dir),
            "{name}: files differ"
        );
    }
}

#[test]
fn v8_refuses_what_it_cannot_resume_with_the_reason() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let g = guest("wasm/cpu.wasm");
    let (_, k) = run_and_suspend(&here, &[g.to_str().unwrap(), "--", "120"], 200);
    let refused = |out: &Output, why: &str| {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(65), "{err}");
        assert!(
            err.starts_with("ferry: refused: ") && err.contains(why),
            "{err}"
        );
        assert!(out.stdout.is_empty());
    };
    // Not pushed yet: the space lacks it.
    refused(&resume_in_v8(&space, &[&k]), "is missing from the space");
    push(&here, &k, &space);
    refused(&resume_in_v8(&space, &[&k[..20]]), "is not a full κ");
    let wrong = Command::new(node())
        .arg(repo().join("web/ferry-resume.mjs"))
        .args(["--space", &space.url, &k])
        .env("FERRY_TOKEN", "not-the-token")
        .output()
        .unwrap();
    refused(&wrong, "refused the token");
    // Usage errors are not refusals.
    let none = Command::new(node())
        .arg(repo().join("web/ferry-resume.mjs"))
        .arg(&k)
        .env_remove("FERRY_SPACE")
        .output()
        .unwrap();
    assert_eq!(none.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&none.stderr).contains("no space"));
}

#[test]
fn the_javascript_hash_and_decoder_agree_with_ferry() {
    // The WebAssembly hasher in web/blake3-wasm.js is built from web/hasher/blake3.c as it is
    // (web/hasher/build.sh writes the source's κ next to the module).
    let source = std::fs::read(repo().join("web/hasher/blake3.c")).unwrap();
    let built = std::fs::read_to_string(repo().join("web/blake3-wasm.js")).unwrap();
    let want = format!("SOURCE = \"{}\"", ferry_kappa::Kappa::of(&source));
    assert!(
        built.contains(&want),
        "web/blake3-wasm.js is not built from web/hasher/blake3.c as it is: run web/hasher/build.sh"
    );
    let env = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let vectors: Vec<serde_json::Value> = [
        0u32,
        1,
        63,
        64,
        65,
        1023,
        1024,
        1025,
        2048,
        2049,
        3072,
        3073,
        4096,
        4097,
        5119,
        5120,
        5121,
        9216,
        31 * 1024,
        65535,
        65536,
        65537,
        100_000,
        1 << 20,
        (1 << 20) + 4 * 1024 + 1,
    ]
    .iter()
    .map(|&len| {
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        serde_json::json!({"len": len, "kappa": ferry_kappa::Kappa::of(&bytes).to_hex()})
    })
    .collect();
    let file = env.path("vectors.json");
    std::fs::write(&file, serde_json::to_vec(&vectors).unwrap()).unwrap();
    // Snapshots with mounted files (trees, a file over 1 MiB in pieces) and a sleep, in a
    // space: their objects as ferry encoded them.
    let space = SpaceProc::start(&[]);
    let (dir, mount) = env.data_dir("data");
    std::fs::write(
        dir.join("big.bin"),
        crate::harness::varied_bytes(3 << 20, 7),
    )
    .unwrap();
    let files = guest("wasm/files.wasm");
    let sleepy = guest("wasm/sleepy.wasm");
    let mut snapshots = Vec::new();
    for args in [
        vec![
            "--dir",
            &mount,
            files.to_str().unwrap(),
            "--",
            "/data",
            "500",
        ],
        vec![sleepy.to_str().unwrap(), "--", "40", "3"],
    ] {
        let (_, k) = run_and_suspend(&env, &args, 300);
        push(&env, &k, &space);
        snapshots.push(k);
    }
    let out = Command::new(node())
        .arg(repo().join("web/test.mjs"))
        .arg(&file)
        .args([&space.url, SPACE_TOKEN])
        .args(&snapshots)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        text.matches("bytes is ferry's κ (wasm-simd)").count(),
        vectors.len(),
        "{text}"
    );
    assert!(text.contains("the hasher is the WebAssembly one"), "{text}");
    assert!(text.contains("re-encode to ferry's very bytes"), "{text}");
    assert!(
        text.contains("mutated objects are read or refused"),
        "{text}"
    );
    assert!(text.trim_end().ends_with("checks passed"), "{text}");
}

/// wasmtime → a browser tab → wasmtime: the console's Suspend button writes the guest's
/// snapshot (taken in a sleep, most likely) to the space, and a native ferry ends it as an
/// uninterrupted run would.
#[test]
fn a_guest_suspended_in_a_browser_tab_ends_natively_as_if_uninterrupted() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let g = guest("wasm/sleepy.wasm");
    let args = [g.to_str().unwrap(), "--", "40", "3"];
    let plain = here.plain(&args);
    let (first, k) = suspend_after_output(&here, "run", &args, 300);
    push(&here, &k, &space);
    let token = here.path("token");
    std::fs::write(&token, SPACE_TOKEN).unwrap();
    let tab = Command::new(node())
        .arg(repo().join("web/browser.mjs"))
        .args([
            "--suspend-after",
            "300",
            "--space",
            &space.url,
            "--token-file",
        ])
        .arg(&token)
        .arg(&k)
        .output()
        .unwrap();
    let tab_err = String::from_utf8_lossy(&tab.stderr);
    let k2 = suspended_kappa(&tab);
    let there = pulled(&k2, &space);
    let end = there.ferry().args(["resume", &k2]).output().unwrap();
    assert_eq!(end.status.code(), Some(3));
    let seen = [&first.stdout[..], &tab.stdout, &end.stdout].concat();
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain.stdout)
    );
    // Something ran in each of the three places.
    assert!(
        !tab.stdout.is_empty() || tab_err.contains("warn"),
        "{tab_err}"
    );
    assert!(!end.stdout.is_empty());
}

/// A guest that computes without any WASI call is suspended in V8 at its next safe point,
/// not at its end: the JavaScript space makes `ferry:ctl` shared, so the thread that takes
/// the Ctrl-C raises the guest's poll flag, as native ferry does. Its snapshot then ends
/// natively as an uninterrupted run.
#[test]
fn a_guest_that_makes_no_wasi_call_is_suspended_in_v8_at_its_next_safe_point() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let spin = here.path("spin.wat");
    std::fs::write(
        &spin,
        r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "spun\n")
  (global $n (mut i64) (i64.const 0))
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 16))
    (i32.store (i32.const 4) (i32.const 5))
    (loop $again
      (global.set $n (i64.add (global.get $n) (i64.const 1)))
      (br_if $again (i64.lt_u (global.get $n) (i64.const 100000000000))))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#,
    )
    .unwrap();
    let (_, k) = run_and_suspend(&here, &[spin.to_str().unwrap()], 300);
    push(&here, &k, &space);
    // 10^11 iterations: minutes, unless the suspend is seen at a safe point.
    let (out, k2) = suspend_in_v8(&space, &k, 500);
    let k2 =
        k2.unwrap_or_else(|| panic!("not suspended: {}", String::from_utf8_lossy(&out.stderr)));
    assert!(out.stdout.is_empty());
    // Natively, from there: the counter goes on (it is in the snapshot's globals) and the
    // guest is suspended again, so that this test does not wait for 10^11 iterations.
    let there = pulled(&k2, &space);
    let (_, k3) = crate::harness::resume_and_suspend(&there, &[&k2], 300);
    let before: u64 = global_n(&there, &k2);
    let after: u64 = global_n(&there, &k3);
    assert!(
        before > 0 && after > before,
        "the counter went {before} → {after}"
    );
}

/// The value of the spin guest's counter (its one mutable global) in snapshot `k`, read from
/// `env`'s store.
fn global_n(env: &Env, k: &str) -> u64 {
    let (_, snap) = stored_snapshot(env, k);
    assert_eq!(snap.globals[0].ty, "i64");
    u64::from_le_bytes(snap.globals[0].bits.clone().try_into().unwrap())
}

/// A space session's snapshot resumed and suspended in V8: the snapshot written there carries
/// the session's output log on — what the session printed on the space, then what it printed
/// in V8 — and the space verifies it (its log may not claim more than the guest showed).
#[test]
fn a_space_session_suspended_in_v8_carries_its_output_log_on() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let space = SpaceProc::start(&[]);
    let g = guest("wasm/sleepy.wasm");
    let (_, err, code) = here.output(&[
        "--space",
        &space.url,
        "run",
        g.to_str().unwrap(),
        "--",
        "300",
        "3",
    ]);
    assert_eq!(code, 0, "{err}");
    let id = err
        .split_whitespace()
        .skip_while(|w| *w != "session")
        .nth(1)
        .unwrap_or_else(|| panic!("{err}"))
        .to_owned();
    std::thread::sleep(std::time::Duration::from_millis(800));
    let (_, err, code) = here.output(&["--space", &space.url, "suspend", &id]);
    assert_eq!(code, 0, "{err}");
    let k = space.snapshot(&id);
    let (out, k2) = suspend_in_v8(&space, &k, 800);
    let k2 = k2.unwrap_or_else(|| panic!("{}", String::from_utf8_lossy(&out.stderr)));

    let there = pulled(&k2, &space);
    let stderr_of = |k: &str, env: &Env| {
        use ferry_store::Store;
        let (store, snap) = stored_snapshot(env, k);
        let get = |k: &ferry_kappa::Kappa| store.get(k).unwrap();
        let log: ferry_object::OutputLog =
            ferry_object::decode(&get(&snap.output.expect("a session's snapshot has a log")))
                .unwrap();
        let bytes: Vec<u8> = log.chunks.iter().flat_map(get).collect();
        let (mut at, mut err) = (0, Vec::new());
        while at < bytes.len() {
            let n = u32::from_le_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
            if bytes[at] == 2 {
                err.extend_from_slice(&bytes[at + 5..at + 5 + n]);
            }
            at += 5 + n;
        }
        String::from_utf8(err).unwrap()
    };
    let (_, err, code) = there.output(&["pull", &k, "--from", &space.url]);
    assert_eq!(code, 0, "{err}");
    let before = stderr_of(&k, &there);
    let after = stderr_of(&k2, &there);
    let in_v8 = guest_lines(&out.stderr);
    assert!(before.contains("warn 0\n"), "{before}");
    assert!(!in_v8.is_empty());
    assert_eq!(after, format!("{before}{in_v8}"));
}

/// `env`'s store, and snapshot `k` decoded from it.
fn stored_snapshot(env: &Env, k: &str) -> (ferry_store::FsStore, ferry_object::Snapshot) {
    use ferry_store::Store;
    let store = ferry_store::FsStore::open(env.store()).unwrap();
    let k: ferry_kappa::Kappa = k.parse().unwrap();
    let snap = ferry_object::decode(&store.get(&k).unwrap()).unwrap();
    (store, snap)
}

/// The JavaScript space names the transform versions whose modules speak ferry's host
/// contract; they must be ferry's own (`abi::OLDEST_COMPATIBLE..=INSTRUMENT_VERSION`), or a
/// new transform's snapshots would be refused there (or an incompatible one admitted).
#[test]
fn the_javascript_space_speaks_the_host_contract_of_this_ferry() {
    let js = std::fs::read_to_string(repo().join("web/resume.js")).unwrap();
    let line = js
        .lines()
        .find(|l| l.starts_with("export const HOST_CONTRACT_VERSIONS"))
        .expect("HOST_CONTRACT_VERSIONS in web/resume.js");
    assert_eq!(
        line,
        format!(
            "export const HOST_CONTRACT_VERSIONS = [{}, {}];",
            ferry_instrument::abi::OLDEST_COMPATIBLE,
            ferry_instrument::INSTRUMENT_VERSION
        )
    );
}
