//! CPython 3.12 for WASI, suspended mid-loop and resumed in new processes.
//! The interpreter is fetched by `scripts/fetch-python.sh` (pinned by SHA-256).

use std::path::PathBuf;

use crate::harness::{Env, repo};

fn python312() -> PathBuf {
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

#[test]
fn cpython_loop_suspended_mid_loop_resumes_identically() {
    let env = Env::new();
    let py = python312();
    let app = env.path("app");
    std::fs::create_dir_all(&app).unwrap();
    std::fs::copy(repo().join("guests/python/loop.py"), app.join("loop.py")).unwrap();
    let mount = format!("{}::/app", app.display());
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
    assert!(
        churned.snapshots.len() >= 2,
        "snapshots: {:?}",
        churned.snapshots
    );
    assert_eq!(
        String::from_utf8_lossy(&churned.stdout),
        String::from_utf8_lossy(&plain.stdout)
    );
    assert_eq!(churned.code, 0);
}
