//! Snapshots are engine-neutral: guests moved between the JIT (wasmtime) and the interpreter
//! (wasmi) on every resume, each resume a new process, print exactly what an uninterrupted run
//! prints.

use crate::harness::{Env, assert_same_run, check_churn, dir_contents, guest, loop_py_app};
use crate::python::python312;

const ALTERNATE: [&str; 2] = ["jit", "interp"];
const ALTERNATE_FROM_INTERP: [&str; 2] = ["interp", "jit"];

fn check(engines: &[&str], run_args: &[&str], suspends: usize, delay_ms: (u64, u64), seed: u64) {
    check_churn(engines, run_args, suspends, delay_ms, seed);
}

#[test]
fn the_interpreter_runs_a_guest_like_the_jit() {
    let env = Env::new();
    let g = guest("wasm/sleepy.wasm");
    let args = [g.to_str().unwrap(), "--", "5", "3"];
    let jit = env.plain(&args);
    let interp = Env::new().with_var("FERRY_ENGINE", "interp").plain(&args);
    assert_eq!(jit.code, 3);
    assert_eq!(interp.stdout, jit.stdout);
    assert_eq!(interp.stderr, jit.stderr);
    assert_eq!(interp.code, jit.code);
}

/// A `select` on `i32.eqz` of a local, which wasmi 2.0.0 gets wrong (it tests a stale
/// register instead), prints the same on both engines: the interpreter runs the module with
/// those conditions passed through a local of their own.
#[test]
fn a_select_on_a_comparison_gives_the_same_on_both_engines() {
    let g = guest("wat/select-eqz.wat");
    let args = [g.to_str().unwrap()];
    let jit = Env::new().plain(&args);
    let interp = Env::new().with_var("FERRY_ENGINE", "interp").plain(&args);
    assert_eq!(String::from_utf8_lossy(&jit.stdout), "9 1 1 7 3\n");
    assert_eq!(
        String::from_utf8_lossy(&interp.stdout),
        String::from_utf8_lossy(&jit.stdout)
    );
    assert_eq!((jit.code, interp.code), (0, 0));
}

#[test]
fn c_cpu_loop_alternating_engines() {
    let g = guest("wasm/cpu.wasm");
    check(
        &ALTERNATE,
        &[g.to_str().unwrap(), "--", "200"],
        6,
        (40, 300),
        31,
    );
}

/// 32 MiB of memory that changes slowly: its chunks are written with direct I/O, so every
/// resume maps them from their packs, on either engine, and each incremental snapshot after
/// a mapped restore is checked against a full one (`FERRY_VERIFY_DIRTY`).
#[test]
fn c_memory_mapped_from_packs_alternating_engines() {
    let g = guest("wasm/dirty.wasm");
    check(
        &ALTERNATE,
        &[g.to_str().unwrap(), "--", "32", "50", "10"],
        4,
        (500, 1200),
        34,
    );
}

#[test]
fn c_deep_recursion_alternating_engines() {
    let g = guest("wasm/recurse.wasm");
    check(
        &ALTERNATE_FROM_INTERP,
        &[g.to_str().unwrap(), "--", "20000", "20"],
        5,
        (100, 400),
        32,
    );
}

#[test]
fn c_sleeps_stderr_and_exit_code_alternating_engines() {
    let g = guest("wasm/sleepy.wasm");
    check(
        &ALTERNATE,
        &[g.to_str().unwrap(), "--", "25", "3"],
        5,
        (50, 150),
        33,
    );
}

#[test]
fn c_file_io_in_a_mount_alternating_engines() {
    let env = Env::new();
    let g = guest("wasm/files.wasm");
    let (plain_dir, pd) = env.data_dir("plain-data");
    let (churn_dir, cd) = env.data_dir("churn-data");
    let plain = env.plain(&["--dir", &pd, g.to_str().unwrap(), "--", "/data", "500"]);
    let churned = env.churn_on(
        &ALTERNATE_FROM_INTERP,
        &["--dir", &cd, g.to_str().unwrap(), "--", "/data", "500"],
        &["--dir", &cd],
        5,
        34,
        (40, 300),
    );
    assert_eq!(plain.code, 0);
    assert_same_run(&churned, &plain, 2);
    assert_eq!(dir_contents(&churn_dir), dir_contents(&plain_dir));
}

#[test]
fn cpython_alternating_engines() {
    let env = Env::new();
    let py = python312();
    let mount = loop_py_app(&env);
    let args = [
        "--dir",
        mount.as_str(),
        py.to_str().unwrap(),
        "--",
        "/app/loop.py",
        "6",
    ];
    let plain = env.plain(&args);
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    let churned = env.churn_on(&ALTERNATE, &args, &["--dir", &mount], 4, 35, (150, 1200));
    assert_same_run(&churned, &plain, 2);
}

/// The interpreter keeps the guest's memory in a reservation of ferry's own, as wasmtime does:
/// a JIT snapshot resumes on it with its chunks mapped from the packs; its checkpoints store
/// only what the guest wrote (each checked against a full hash, `FERRY_VERIFY_DIRTY`) and are
/// pre-written; and the output is an uninterrupted run's.
#[test]
fn the_interpreter_maps_snapshots_and_tracks_what_the_guest_writes() {
    let env = Env::new();
    let g = guest("wasm/dirty.wasm");
    let args = [g.to_str().unwrap(), "--", "32", "40", "10"];
    let plain = env.plain(&args);
    assert_eq!(plain.code, 0);
    let (first, k) = crate::harness::suspend_after_output(&env, "run", &args, 1500);
    // The check of the mapped chunks starts 300 ms late, so the guest surely runs beside it.
    let out = env
        .ferry()
        .env("FERRY_FAULT_PAUSE", "check-mapped:300")
        .args([
            "-v",
            "resume",
            "--engine",
            "interp",
            "--checkpoint-every",
            "500ms",
            &k,
        ])
        .output()
        .expect("spawn ferry");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("mapped from packs"), "{err}");
    assert!(err.contains("engine=interp checking=true"), "{err}");
    assert!(!err.contains("write tracking unavailable"), "{err}");
    assert!(err.contains("before_checkpoint=true"), "{err}");
    assert!(err.contains("ferry: checkpoint "), "{err}");
    let mut stdout = first.stdout;
    stdout.extend(out.stdout);
    assert_eq!(
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&plain.stdout)
    );
}
