//! The conformance kit (conformance/v5, which holds v1's to v4's cases) passes on both
//! engines, a v1 kit is still read, and a kit whose expectations are wrong fails with the
//! reason.

use std::path::Path;

use crate::harness::{Env, repo};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

#[test]
fn the_kit_passes_on_both_engines_and_across_them() {
    let env = Env::new();
    let kit = repo().join("conformance/v5");
    let (out, err, code) = env.output(&[
        "conformance",
        "--engine",
        "all",
        "--kit",
        kit.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(!out.contains("FAIL"), "{out}");
    assert!(!out.contains("skipped"), "a case was skipped:\n{out}");
    // Every kind of check ran: fresh runs, resumes across engines, state equality.
    for needle in [
        "fresh run                  -       interp   pass",
        "jit     interp   pass",
        "interp  jit      pass",
        "same state jit=interp",
        "inside-a-sleep",
        "open-files",
        "tables-and-globals",
        "cpython",
        // A trap expected (kit v2), after resumes too.
        "dropped-data-segment   safe point 20000000        interp  jit      pass",
        // Descriptors whose names changed (kit v3): a file replaced while open, carried.
        "descriptors-outlive-names path_rename call #3        jit     interp   pass",
        "descriptors-outlive-names path_unlink_file call #1   interp  jit      pass",
        // A file with three names (kit v4), resumed into a fresh directory.
        "hard-links             path_link call #2          jit     interp   pass",
    ] {
        assert!(out.contains(needle), "`{needle}` missing from:\n{out}");
    }
    let summary = out.lines().last().unwrap();
    assert!(summary.ends_with(", 0 failed"), "{summary}");
}

#[test]
fn a_wrong_expectation_fails_with_the_difference() {
    let env = Env::new();
    let kit = env.path("kit");
    let src = repo().join("conformance/v1");
    std::fs::create_dir_all(&kit).unwrap();
    std::fs::copy(src.join("cases.json"), kit.join("cases.json")).unwrap();
    copy_dir(&src.join("guests"), &kit.join("guests"));
    copy_dir(&src.join("expected"), &kit.join("expected"));
    // Guests the kit names relative to the repository.
    let cases = std::fs::read_to_string(kit.join("cases.json"))
        .unwrap()
        .replace(
            "../../guests/",
            &format!("{}/", repo().join("guests").display()),
        );
    std::fs::write(kit.join("cases.json"), cases).unwrap();
    // One line of the expected output changed: its fresh run and every resume after it fail.
    let mut expected = std::fs::read_to_string(kit.join("expected/tables.stdout")).unwrap();
    expected = expected.replacen("0000000000000021 ", "0000000000000022 ", 1);
    std::fs::write(kit.join("expected/tables.stdout"), expected).unwrap();
    let (out, _, code) = env.output(&[
        "conformance",
        "--engine",
        "jit",
        "--only",
        "tables",
        "--kit",
        kit.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("tables-and-globals     fresh run                  -       jit      FAIL: stdout differs at byte"),
        "{out}"
    );
}

#[test]
fn a_kit_of_another_version_is_refused() {
    let env = Env::new();
    let kit = env.path("kit");
    std::fs::create_dir_all(&kit).unwrap();
    std::fs::write(
        kit.join("cases.json"),
        r#"{"format": "ferry-conformance", "version": 6, "cases": []}"#,
    )
    .unwrap();
    let (_, err, code) = env.output(&["conformance", "--kit", kit.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains(
            "is a `ferry-conformance` v6 kit; this ferry reads `ferry-conformance` v1 to v5"
        ),
        "{err}"
    );
    // v1 cannot expect a trap: a v1 kit that does is refused, not half read.
    std::fs::write(
        kit.join("cases.json"),
        r#"{"format": "ferry-conformance", "version": 1, "cases": [{"name": "t", "about": "",
            "guest": "g.wat", "stdout": "o", "trap": "unreachable", "points": []}]}"#,
    )
    .unwrap();
    let (_, err, code) = env.output(&["conformance", "--kit", kit.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("case `t` expects a trap, which a v1 kit cannot say (`trap` is v2)"),
        "{err}"
    );
}
