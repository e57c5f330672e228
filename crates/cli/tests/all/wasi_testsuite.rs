//! The official WASI preview 1 test suite (WebAssembly/wasi-testsuite) on both engines and in
//! the JavaScript space, through
//! `scripts/wasi-testsuite.py`: every test passes except the known failures listed (with
//! reasons) in conformance/wasi-testsuite-known-failures.txt. The suite is not committed; on
//! a machine that has no copy and cannot clone it, the script says so and this test is skipped.

use std::process::Command;

use crate::harness::repo;

/// `scripts/wasi-testsuite.py --engine ENGINE`: what it printed, once it has succeeded; None
/// when the suite is not at hand.
fn suite(engine: &str) -> Option<String> {
    let out = Command::new("python3")
        .arg(repo().join("scripts/wasi-testsuite.py"))
        .args(["--engine", engine, "--ferry", env!("CARGO_BIN_EXE_ferry")])
        .output()
        .expect("python3 runs scripts/wasi-testsuite.py");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{text}");
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (!text.contains("skipped")).then_some(text)
}

#[test]
fn official_wasi_testsuite_on_both_engines() {
    if let Some(text) = suite("all") {
        for engine in ["jit", "interp"] {
            assert!(
                text.contains(&format!("{engine:<7} wasi-testsuite wasm32-wasip1: ")),
                "{text}"
            );
        }
    }
}

/// The same suite in the JavaScript space: each test suspended by ferry at its first safe
/// point, pushed to a space, and run on from there in Node's V8 (`web/`); tests that end
/// before their first safe point are counted apart (nothing of them ran in JavaScript).
#[test]
fn official_wasi_testsuite_in_the_javascript_space() {
    if let Some(text) = suite("js") {
        let summary = text
            .lines()
            .find(|l| l.starts_with("js      wasi-testsuite wasm32-wasip1: "))
            .unwrap_or_else(|| panic!("{text}"));
        // Most of the suite runs in JavaScript, not only its trivial programs.
        let ran: usize = summary
            .split('/')
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(ran >= 50, "{summary}");
    }
}
