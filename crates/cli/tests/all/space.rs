//! `ferry serve` / `push` / `pull`: a snapshot moved to another machine's store over HTTP by κ
//! (only missing objects move, each verified), resumed there byte-identically; no token, no
//! access; a damaged object in transit is refused.

use crate::harness::{
    Env, SPACE_TOKEN, SpaceProc, guest, resume_to_end, run_and_suspend, session_of,
};

#[test]
fn push_to_a_space_resume_there_pull_back_only_what_is_missing() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let mut server = SpaceProc::start(&[]);
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "120"];
    let plain = here.plain(&args);
    let (mut seen, k) = run_and_suspend(&here, &args, 300);

    let (_, err, code) = here.output(&["push", &k, "--to", &server.url]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("pushed "), "{err}");
    // Again, named by its session: nothing left to move.
    let session = session_of(&here, &k);
    let (_, err, code) = here.output(&["push", &session, "--to", &server.url]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(&format!("pushed {k}: 0 of its ")), "{err}");

    // The space's store holds a verified, named snapshot that resumes to the rest.
    server.stop();
    let (out, _, code) = server.env.output(&["store", "verify"]);
    assert_eq!(code, 0, "{out}");
    seen.extend(resume_to_end(&server.env, &k));
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain.stdout)
    );

    // Pull it into a third store.
    server.spawn(None);
    let third = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let (out, err, code) = third.output(&["pull", &k, "--from", &server.url]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("pulled {k}"));
    assert!(
        err.contains(&format!("resume it with `ferry resume {}`", &k[..19])),
        "{err}"
    );
    let (_, err, code) = third.output(&["pull", &k, "--from", &server.url]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(": 0 of its "), "{err}");
}

#[test]
fn no_token_no_access_and_damaged_objects_are_refused() {
    let server = SpaceProc::start(&[]);
    let here = Env::new();
    let g = guest("wasm/cpu.wasm");
    let (_, k) = run_and_suspend(&here, &[g.to_str().unwrap(), "--", "120"], 200);

    let (_, err, code) = here.output(&["push", &k, "--to", &server.url]);
    assert_eq!(code, 1);
    assert!(err.contains("no bearer token"), "{err}");
    let wrong = here.path("wrong-token");
    std::fs::write(&wrong, "not-the-token\n").unwrap();
    let (_, err, code) = here.output(&[
        "push",
        &k,
        "--to",
        &server.url,
        "--token-file",
        wrong.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("401"), "{err}");

    // An object whose bytes do not hash to the κ it is sent under.
    let agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .new_agent();
    let k0 = ferry_kappa::Kappa::of(b"what it claims to be");
    let r = agent
        .put(format!("{}/v1/objects/{k0}", server.url))
        .header("Authorization", format!("Bearer {SPACE_TOKEN}"))
        .send(&b"something else"[..])
        .unwrap();
    assert_eq!(r.status(), 422);
    let r = agent
        .put(format!("{}/v1/objects/{k0}", server.url))
        .send(&b"what it claims to be"[..])
        .unwrap();
    assert_eq!(r.status(), 401, "an unauthenticated write must be refused");
    // A snapshot whose closure is not there cannot be named.
    let r = agent
        .post(format!("{}/v1/snapshots/{k}", server.url))
        .header("Authorization", format!("Bearer {SPACE_TOKEN}"))
        .send_empty()
        .unwrap();
    assert_eq!(r.status(), 409);
}

/// A client that asks a space for a big object and then reads nothing (its process hung)
/// does not hold the space's connection for good: the space's kernel gives the connection up
/// once the client's window has stayed shut for the peer silence (`TCP_USER_TIMEOUT` on every
/// accepted connection, which covers a zero window on Linux ≥ 5.11), so what the client reads
/// afterwards stops short of the object, and the space answers on.
#[test]
fn a_space_gives_up_a_client_that_stops_reading() {
    use std::io::{Read, Write};
    let server = SpaceProc::start_with_vars(&[("FERRY_PEER_SILENCE_MS", "1000")], &[]);
    // 64 MiB that do not compress: more than the socket buffers of both sides hold.
    let mut blob = vec![0u8; 64 << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for c in blob.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    let k = ferry_kappa::Kappa::of(&blob);
    let r = ureq::put(format!("{}/v1/objects/{k}", server.url))
        .header("Authorization", format!("Bearer {SPACE_TOKEN}"))
        .send(&blob[..])
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let addr = server.url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET /v1/objects/{k} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {SPACE_TOKEN}\r\n\
         Connection: close\r\n\r\n"
    )
    .unwrap();
    // Nothing read for 6 s: the space's writes fill both sides' buffers, then wait on a
    // shut window.
    std::thread::sleep(std::time::Duration::from_secs(6));
    s.set_read_timeout(Some(std::time::Duration::from_secs(3)))
        .unwrap();
    let (mut got, mut buf) = (0usize, vec![0u8; 1 << 20]);
    while let Ok(n @ 1..) = s.read(&mut buf) {
        got += n;
    }
    assert!(
        got < blob.len(),
        "the space held the connection: {got} bytes came"
    );
    assert!(got > 0, "nothing came at all");
    let r = ureq::get(format!("{}/v1/health", server.url))
        .call()
        .unwrap();
    assert!(r.status().is_success());
}

/// The number of runs a `-v resume` says it mapped memory from (0 if it mapped none).
fn mapped_runs(err: &str) -> usize {
    err.lines()
        .filter(|l| l.contains("mapped from packs"))
        .filter_map(|l| l.split("runs=").nth(1))
        .filter_map(|r| r.split_whitespace().next()?.parse::<usize>().ok())
        .sum()
}

/// Chunks are sent in memory order, so the receiving store packs them so, and a resume there
/// maps the memory in a few long runs — pushed to a space, and pulled from it.
#[test]
fn moved_memory_is_packed_in_memory_order() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let mut server = SpaceProc::start(&[]);
    let g = guest("wasm/dirty.wasm");
    // 16 MiB of random bytes (256 distinct chunks), then 20 ticks of 100 ms.
    let args = [g.to_str().unwrap(), "--", "16", "20", "10"];
    let plain = here.plain(&args);
    let (seen, k) = run_and_suspend(&here, &args, 1500);
    assert!(
        String::from_utf8_lossy(&seen).starts_with("ready\n"),
        "suspended before the memory was filled"
    );
    let (_, err, code) = here.output(&["push", &k, "--to", &server.url]);
    assert_eq!(code, 0, "{err}");
    let third = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let (_, err, code) = third.output(&["pull", &k, "--from", &server.url]);
    assert_eq!(code, 0, "{err}");
    server.stop();
    for env in [&server.env, &third] {
        let out = env
            .ferry()
            .args(["-v", "resume", &k])
            .output()
            .expect("spawn ferry");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        let runs = mapped_runs(&err);
        assert!((1..=4).contains(&runs), "{runs} runs: {err}");
        assert_eq!(
            String::from_utf8_lossy(&[seen.clone(), out.stdout].concat()),
            String::from_utf8_lossy(&plain.stdout)
        );
    }
}

/// A damaged chunk in the pushing store is named, not just refused: chunks go from the packs
/// to the space without being hashed on the way out, the space re-hashes them and refuses the
/// batch, and the sender then finds which of its own objects is corrupt.
#[test]
fn a_damaged_object_in_the_pushing_store_is_named() {
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    let server = SpaceProc::start(&[]);
    let g = guest("wasm/dirty.wasm");
    // 16 MiB of random bytes: the largest pack holds the memory chunks.
    let (seen, k) = run_and_suspend(&here, &[g.to_str().unwrap(), "--", "16", "20", "10"], 1500);
    assert!(String::from_utf8_lossy(&seen).starts_with("ready\n"));
    let pack = std::fs::read_dir(here.store().join("packs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pack"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let mut bytes = std::fs::read(&pack).unwrap();
    assert!(bytes.len() > 8 << 20, "{} bytes", bytes.len());
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&pack, &bytes).unwrap();

    let (_, err, code) = here.output(&["push", &k, "--to", &server.url]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("is corrupt") && err.contains("ferry store verify"),
        "{err}"
    );
}

/// `--log-format json` writes ferry's log lines as one JSON object a line (time, level,
/// message) — here the warning of a space that comes back drained — while the messages for
/// the user stay text.
#[test]
fn a_space_logs_json_lines_for_a_collector() {
    use std::io::{BufRead, BufReader, Read};
    let here = Env::new().with_var("FERRY_TOKEN", SPACE_TOKEN);
    std::fs::create_dir_all(here.store().join("space")).unwrap();
    std::fs::write(here.store().join("space/draining"), "drained\n").unwrap();
    let mut child = here
        .ferry()
        .env("FERRY_TOKEN", SPACE_TOKEN)
        .args(["--log-format", "json", "serve", "--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("listening on "), "{line}");
    child.kill().unwrap();
    child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let logged: Vec<serde_json::Value> = err
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let drained = logged
        .iter()
        .find(|v| {
            v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("being drained"))
        })
        .unwrap_or_else(|| panic!("no JSON line about draining in:\n{err}"));
    assert_eq!(drained["level"], "WARN");
    assert!(drained["timestamp"].as_str().unwrap().ends_with('Z'));
    assert!(err.contains("ferry: serving "), "{err}");
}
