//! A fleet of spaces sharing an etcd (`ferry serve --etcd URL`; docs/migration.md, "Owners in
//! etcd"): the owner record follows each move, a move is decided in etcd, so a destination
//! finishes a committed move whose source died at once, gives up one whose source is gone or
//! cut off before the commit (and the source, told by etcd, runs on), and a source that
//! comes back after its move committed is fenced.

use std::time::Duration;

use serde_json::json;

use crate::harness::{Blackhole, Etcd, EtcdCluster, SpaceProc};
use crate::migrate::{
    assert_finished_like, cli, client, eventually, metric, migrate_in_background, ok, refused,
    run_cpu_guest, stores_verify,
};

fn fleet_space(etcd: &Etcd, extra: &[&str]) -> SpaceProc {
    let mut args = vec!["--etcd", &etcd.url];
    args.extend_from_slice(extra);
    SpaceProc::start(&args)
}

/// A space of the fleet whose etcd client URLs are `endpoints` (comma-separated).
fn fleet_space_at(endpoints: &str) -> SpaceProc {
    SpaceProc::start(&["--etcd", endpoints])
}

/// The session ran once, on `on` of `spaces`.
fn finished_once(spaces: &[&SpaceProc], id: &str, on: &SpaceProc) {
    let finished: Vec<_> = spaces
        .iter()
        .filter(|s| s.state(id).as_deref() == Some("exited"))
        .map(|s| s.url.clone())
        .collect();
    assert_eq!(finished, vec![on.url.clone()], "finished on {finished:?}");
}

#[test]
fn in_a_fleet_the_owner_record_follows_each_move() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let a = fleet_space(&etcd, &[]);
    let b = fleet_space(&etcd, &[]);
    let plain = run_cpu_guest(&here, &a.url, "own", "800");
    assert_eq!(etcd.owner("own"), Some(json!({"space": a.url, "epoch": 1})));
    // The id is taken fleet-wide: another space refuses to start a session under it.
    let g = crate::harness::guest("wasm/cpu.wasm");
    let err = refused(
        &here,
        &b.url,
        &["run", "--session", "own", g.to_str().unwrap(), "--", "1"],
    );
    assert!(err.contains("belongs to") && err.contains(&a.url), "{err}");
    ok(&here, &a.url, &["migrate", "own", "--to", &b.url]);
    assert_eq!(etcd.owner("own"), Some(json!({"space": b.url, "epoch": 2})));
    // `ps --fleet` on either space shows the session once, where it is now.
    for s in [&a, &b] {
        let (listed, err, code) = cli(&here, &s.url, &["ps", "--fleet"]);
        assert_eq!(code, 0, "{err}");
        let rows: Vec<&str> = listed.lines().filter(|l| l.contains(" own ")).collect();
        assert_eq!(rows.len(), 1, "{listed}");
        assert!(rows[0].starts_with(&b.url), "{listed}");
        let (json, _, _) = cli(&here, &s.url, &["ps", "--fleet", "--json"]);
        let json: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(json.as_array().unwrap().len(), 1, "{json}");
        assert_eq!(json[0]["space"], json!(b.url));
    }
    // Without --fleet, the space's own records: the moved one at A.
    let (json, _, _) = cli(&here, &a.url, &["ps", "--json"]);
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(json[0]["state"], json!("moved"), "{json}");
    let attempt = a.session("own").unwrap()["attempt"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        etcd.values(&format!("/ferry/moves/own/2/{attempt}")),
        vec!["committed"]
    );
    // The source no longer owns it: it cannot resume it.
    let err = refused(&here, &a.url, &["resume", "own"]);
    assert!(err.contains("moved to"), "{err}");
    ok(&here, &b.url, &["migrate", "own", "--to", &a.url]);
    assert_eq!(etcd.owner("own"), Some(json!({"space": a.url, "epoch": 3})));
    assert_finished_like(&here, &a.url, "own", &plain.stdout);
    finished_once(&[&a, &b], "own", &a);
    // Forgetting the finished session at its owner removes its records from etcd.
    ok(&here, &a.url, &["rm", "own"]);
    assert_eq!(etcd.owner("own"), None);
    assert!(etcd.values("/ferry/moves/own/").is_empty());
    stores_verify(&[&a, &b]);
}

/// Two spaces of a fleet (B started with `b_extra`); a guest run on A as session `id` and
/// moved to B, A dying at `step` of the move (`FERRY_FAULT`) and left down. Returns etcd, A,
/// B and the guest's plain output (`None` without etcd).
fn move_and_kill_the_source(
    step: &str,
    id: &str,
    b_extra: &[&str],
) -> Option<(Etcd, SpaceProc, SpaceProc, Vec<u8>)> {
    let etcd = Etcd::start()?;
    let here = client();
    let mut a = fleet_space(&etcd, &[]);
    let b = fleet_space(&etcd, b_extra);
    a.stop();
    a.spawn(Some(step));
    let plain = run_cpu_guest(&here, &a.url, id, "400");
    let _ = cli(&here, &a.url, &["migrate", id, "--to", &b.url]);
    a.wait_dead();
    Some((etcd, a, b, plain.stdout))
}

/// The source dies right after etcd recorded the move, before its own record says so
/// (`FERRY_FAULT=owner-moved`), and stays down: the destination learns the outcome from etcd
/// and runs the guest alone (without etcd it would wait for the source). When the source
/// comes back, etcd tells it the move committed: its copy is fenced, never resumed.
#[test]
fn in_a_fleet_a_committed_move_runs_though_its_source_died_at_once() {
    let Some((_etcd, mut a, b, plain)) = move_and_kill_the_source("owner-moved", "gone", &[])
    else {
        return;
    };
    let here = client();
    assert_finished_like(&here, &b.url, "gone", &plain);
    a.spawn(None);
    eventually("the source learns that the move committed", || {
        a.state("gone").as_deref() == Some("moved")
    });
    let err = refused(&here, &a.url, &["resume", "gone"]);
    assert!(err.contains("moved to"), "{err}");
    finished_once(&[&a, &b], "gone", &b);
    stores_verify(&[&a, &b]);
}

/// The source dies after the destination prepared the final round, before the commit, and
/// stays down: the destination gives the move up after `--prepared-timeout` (in etcd) and
/// drops its copy. The source, back, finds the move aborted and resumes the session itself.
#[test]
fn in_a_fleet_a_destination_gives_up_a_move_whose_source_is_gone() {
    let Some((etcd, mut a, b, plain)) =
        move_and_kill_the_source("prepared", "left", &["--prepared-timeout", "2s"])
    else {
        return;
    };
    let here = client();
    eventually("the destination gives the move up", || {
        b.state("left").is_none()
    });
    assert_eq!(etcd.values("/ferry/moves/left/2/"), vec!["aborted"]);
    assert_eq!(
        etcd.owner("left"),
        Some(json!({"space": a.url, "epoch": 1}))
    );
    a.spawn(None);
    assert_eq!(a.state("left").as_deref(), Some("suspended"));
    ok(&here, &a.url, &["resume", "left"]);
    assert_finished_like(&here, &a.url, "left", &plain);
    finished_once(&[&a, &b], "left", &a);
    stores_verify(&[&a, &b]);
}

/// The source's process hangs (`SIGSTOP`: its machine still answers, so the connection never
/// goes silent) once it has paused the guest and the destination holds a prepared copy: the
/// destination's questions to the source get nothing for the peer stall (2 s here), so after
/// `--prepared-timeout` it gives the move up in etcd and drops its copy; the source, going on,
/// finds the move aborted and runs the guest on — one copy, output unchanged.
#[test]
fn in_a_fleet_a_source_whose_process_hangs_before_its_commit_runs_the_guest_on() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let a = SpaceProc::start_with_vars(
        &[("FERRY_FAULT_PAUSE", "prepared:3000")],
        &["--etcd", &etcd.url],
    );
    let b = SpaceProc::start_with_vars(
        &[("FERRY_PEER_SILENCE_MS", "1000")],
        &["--etcd", &etcd.url, "--prepared-timeout", "1s"],
    );
    let plain = run_cpu_guest(&here, &a.url, "froze", "1200");
    let rx = migrate_in_background(&[], &a.url, "froze", &b.url);
    eventually(
        "the guest is paused and the destination holds a copy",
        || {
            a.state("froze").as_deref() == Some("suspended")
                && b.state("froze").as_deref() == Some("prepared")
        },
    );
    a.signal(libc::SIGSTOP);
    let t = std::time::Instant::now();
    let mut dropped = false;
    while !dropped && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
        dropped = b.state("froze").is_none();
    }
    a.signal(libc::SIGCONT);
    assert!(
        dropped,
        "the destination still holds its copy 30 s into the hang"
    );
    let (_, err, code) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("migrate still waits after 60 s");
    assert_ne!(code, 0, "the move committed: {err}");
    assert!(err.contains("migration aborted"), "{err}");
    assert_eq!(etcd.values("/ferry/moves/froze/2/"), vec!["aborted"]);
    assert_finished_like(&here, &a.url, "froze", &plain.stdout);
    finished_once(&[&a, &b], "froze", &a);
    stores_verify(&[&a, &b]);
}

/// The destination cannot reach the source (every packet between them on the source's peer
/// address dropped; clients still reach it) while the source holds just before its commit
/// (`FERRY_FAULT_PAUSE`): the destination gives the move up in etcd, so the source's commit
/// finds it aborted and the guest runs on at the source — one copy, output unchanged.
#[test]
fn in_a_fleet_a_source_cut_off_before_its_commit_runs_the_guest_on() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let a = SpaceProc::start_for_peers_at_127_0_0_2(
        &[("FERRY_FAULT_PAUSE", "prepared:15000")],
        &["--etcd", &etcd.url],
    );
    let b = SpaceProc::start_with_vars(
        &[("FERRY_PEER_SILENCE_MS", "2000")],
        &["--etcd", &etcd.url, "--prepared-timeout", "1s"],
    );
    let plain = run_cpu_guest(&here, &a.url, "cut", "1200");
    let rx = migrate_in_background(&[], &a.url, "cut", &b.url);
    eventually("the destination holds a prepared copy", || {
        b.state("cut").as_deref() == Some("prepared")
    });
    let Some(cut) = Blackhole::address("127.0.0.2", a.port()) else {
        return;
    };
    eventually("the destination gives the move up", || {
        b.state("cut").is_none()
    });
    let (_, err, code) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("migrate still waits after 60 s");
    drop(cut);
    assert_ne!(code, 0, "the move committed: {err}");
    assert!(err.contains("gave the move up"), "{err}");
    assert_eq!(
        etcd.owner("cut"),
        Some(json!({"space": "http://127.0.0.2:".to_owned() + &a.port().to_string(), "epoch": 1}))
    );
    assert_finished_like(&here, &a.url, "cut", &plain.stdout);
    finished_once(&[&a, &b], "cut", &a);
    stores_verify(&[&a, &b]);
}

/// A space told to use an etcd it cannot reach refuses to start, saying why; the other etcd
/// options need `--etcd`.
#[test]
fn a_space_does_not_start_without_its_etcd() {
    let env = client();
    let listen = ["serve", "--listen", "127.0.0.1:0"];
    let (_, err, code) = env.output(&[&listen[..], &["--etcd", "http://127.0.0.1:1"]].concat());
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--etcd") && err.contains("etcd cannot be reached"),
        "{err}"
    );
    let (_, err, code) = env.output(&[&listen[..], &["--prepared-timeout", "5s"]].concat());
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--etcd"), "{err}");
}

/// An etcd that authenticates its users: a space started without a user, or with a wrong
/// password, refuses to start with etcd's reason; one signed in as a user allowed the fleet's
/// prefix records its sessions and moves there, and signs in again when etcd has forgotten its
/// token (authentication turned off and on).
#[test]
fn a_fleet_signs_in_to_an_etcd_that_authenticates_its_users() {
    let Some(mut etcd) = Etcd::start() else {
        return;
    };
    etcd.enable_auth();
    let env = client();
    let serve = ["serve", "--listen", "127.0.0.1:0", "--etcd", &etcd.url];
    let (_, err, code) = env.output(&serve);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("give --etcd-user"), "{err}");
    let bad = env.path("bad-password");
    std::fs::write(&bad, "nope\n").unwrap();
    let user = ["--etcd-user", "ferry", "--etcd-password-file"];
    let (_, err, code) = env.output(&[&serve[..], &user[..], &[bad.to_str().unwrap()]].concat());
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("signing in as `ferry`") && err.contains("invalid user ID or password"),
        "{err}"
    );
    let (_, err, code) = env.output(&[&serve[..], &user[..2]].concat());
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("FERRY_ETCD_PASSWORD"), "{err}");
    let good = env.path("password");
    std::fs::write(&good, "ferrypw\n").unwrap();
    let good = good.to_str().unwrap();
    let a = fleet_space(&etcd, &[&user[..], &[good]].concat());
    let b = SpaceProc::start_with_vars(
        &[("FERRY_ETCD_PASSWORD", "ferrypw")],
        &["--etcd", &etcd.url, "--etcd-user", "ferry"],
    );
    let plain = run_cpu_guest(&env, &a.url, "signed", "800");
    assert_eq!(
        etcd.owner("signed"),
        Some(json!({"space": a.url, "epoch": 1}))
    );
    // Etcd forgets every token when its authentication is turned off and on.
    assert!(etcd.ctl(&["auth", "disable"]) && etcd.ctl(&["auth", "enable"]));
    ok(&env, &a.url, &["migrate", "signed", "--to", &b.url]);
    assert_eq!(
        etcd.owner("signed"),
        Some(json!({"space": b.url, "epoch": 2}))
    );
    assert_finished_like(&env, &b.url, "signed", &plain.stdout);
    stores_verify(&[&a, &b]);
}

/// An etcd that speaks HTTPS and accepts only clients with a certificate its CA signed
/// (`--client-cert-auth`): a space that does not trust etcd's certificate, presents no client
/// certificate, one from another CA, or a key that does not serve its certificate refuses to
/// start, saying which option to give; one given `--etcd-ca`, `--etcd-cert` and `--etcd-key`
/// records its sessions and moves there.
#[test]
fn a_fleet_speaks_tls_to_an_etcd_that_checks_client_certificates() {
    let Some(etcd) = Etcd::start_tls() else {
        return;
    };
    let tls = etcd.tls.as_ref().unwrap();
    let env = client();
    let serve = ["serve", "--listen", "127.0.0.1:0", "--etcd", &etcd.url];
    let start = |extra: &[&str]| env.output(&[&serve[..], extra].concat());
    let (_, err, code) = start(&[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("give --etcd-ca"), "{err}");
    let ca = ["--etcd-ca", tls.ca.as_str()];
    let (_, err, code) = start(&ca);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--etcd-cert and --etcd-key"), "{err}");
    let (cert, key) = (tls.client.0.as_str(), tls.client.1.as_str());
    let (_, err, code) = start(&[&ca[..], &["--etcd-cert", cert]].concat());
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--etcd-key"), "{err}");
    let other_dir = tempfile::tempdir().unwrap();
    let other = crate::harness::TestCa::new(other_dir.path());
    let (stranger, stranger_key) = other.issue("stranger", "extendedKeyUsage=clientAuth");
    let mismatched = [&ca[..], &["--etcd-cert", cert, "--etcd-key", &stranger_key]].concat();
    let (_, err, code) = start(&mismatched);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("does not serve the certificate"), "{err}");
    let (_, err, code) = start(
        &[
            &ca[..],
            &["--etcd-cert", &stranger, "--etcd-key", &stranger_key],
        ]
        .concat(),
    );
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("etcd cannot be reached") && err.contains("may not trust the client"),
        "{err}"
    );
    let fleet = [&ca[..], &["--etcd-cert", cert, "--etcd-key", key]].concat();
    let a = fleet_space(&etcd, &fleet);
    let b = fleet_space(&etcd, &fleet);
    let plain = run_cpu_guest(&env, &a.url, "sealed", "800");
    assert_eq!(
        etcd.owner("sealed"),
        Some(json!({"space": a.url, "epoch": 1}))
    );
    ok(&env, &a.url, &["migrate", "sealed", "--to", &b.url]);
    assert_eq!(
        etcd.owner("sealed"),
        Some(json!({"space": b.url, "epoch": 2}))
    );
    assert_finished_like(&env, &b.url, "sealed", &plain.stdout);
    stores_verify(&[&a, &b]);
}

/// A fleet given every member of a three-member etcd cluster: with the member it asks first
/// gone, the other two decide its moves; with two gone (no quorum) a move is refused before
/// its guest pauses, and the guest runs on; once a member is back the session moves, and it
/// ends exactly once, with an uninterrupted run's output.
#[test]
fn a_fleet_goes_on_while_its_etcd_cluster_keeps_a_quorum() {
    let Some(mut etcd) = EtcdCluster::start() else {
        return;
    };
    let here = client();
    let endpoints = etcd.endpoints();
    let a = fleet_space_at(&endpoints);
    let b = fleet_space_at(&endpoints);
    let g = crate::harness::guest("wasm/sleepy.wasm");
    let g = g.to_str().unwrap();
    let plain = here.plain(&[g, "--", "1200", "0"]).stdout;
    ok(
        &here,
        &a.url,
        &["run", "--session", "quorum", g, "--", "1200", "0"],
    );
    assert_eq!(
        etcd.owner("quorum"),
        Some(json!({"space": a.url, "epoch": 1}))
    );
    etcd.stop_member(0);
    ok(&here, &a.url, &["migrate", "quorum", "--to", &b.url]);
    assert_eq!(
        etcd.owner("quorum"),
        Some(json!({"space": b.url, "epoch": 2}))
    );
    // Without a quorum nothing can be decided: the move is refused before the guest
    // pauses, saying why, and the guest runs on where it is.
    etcd.stop_member(1);
    let err = refused(&here, &b.url, &["migrate", "quorum", "--to", &a.url]);
    assert!(
        err.contains("cannot ask etcd who owns session `quorum`")
            && err.contains("request timed out"),
        "{err}"
    );
    assert_eq!(b.state("quorum").as_deref(), Some("running"));
    etcd.start_member(0);
    eventually("the cluster has a quorum again", || etcd.healthy());
    ok(&here, &b.url, &["migrate", "quorum", "--to", &a.url]);
    assert_eq!(
        etcd.owner("quorum"),
        Some(json!({"space": a.url, "epoch": 3}))
    );
    assert_finished_like(&here, &a.url, "quorum", &plain);
    finished_once(&[&a, &b], "quorum", &a);
    stores_verify(&[&a, &b]);
}

/// A fleet given every member of a three-member etcd cluster, with the member it asks first
/// hung (`SIGSTOP`: its machine still answers, so the connection never goes silent): each
/// space gives that member up once it has sent nothing for the peer stall (2 s here) and asks
/// the next, so a move is decided as before and the session ends once, at its destination.
#[test]
fn a_fleet_goes_on_while_the_etcd_member_it_asks_first_hangs() {
    let Some(etcd) = EtcdCluster::start() else {
        return;
    };
    let here = client();
    let endpoints = etcd.endpoints();
    let silence = [("FERRY_PEER_SILENCE_MS", "1000")];
    let a = SpaceProc::start_with_vars(&silence, &["--etcd", &endpoints]);
    let b = SpaceProc::start_with_vars(&silence, &["--etcd", &endpoints]);
    let g = crate::harness::guest("wasm/sleepy.wasm");
    let g = g.to_str().unwrap();
    let plain = here.plain(&[g, "--", "400", "0"]).stdout;
    ok(
        &here,
        &a.url,
        &["run", "--session", "hung", g, "--", "400", "0"],
    );
    etcd.signal_member(0, libc::SIGSTOP);
    let done =
        migrate_in_background(&[], &a.url, "hung", &b.url).recv_timeout(Duration::from_secs(60));
    etcd.signal_member(0, libc::SIGCONT);
    let (_, err, code) = done.expect("migrate still waits after 60 s with an etcd member hung");
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        etcd.owner("hung"),
        Some(json!({"space": b.url, "epoch": 2}))
    );
    assert_finished_like(&here, &a.url, "hung", &plain);
    finished_once(&[&a, &b], "hung", &b);
    stores_verify(&[&a, &b]);
}

/// `sleepy STEPS 0` run on `space` as session `id`, checkpointed every 200 ms with `standby`
/// (a space's URL, or `auto`) as its standby; returns what an uninterrupted run shows.
fn run_with_standby(
    here: &crate::harness::Env,
    space: &SpaceProc,
    standby: &str,
    id: &str,
    steps: &str,
) -> Vec<u8> {
    let g = crate::harness::guest("wasm/sleepy.wasm");
    let plain = here.plain(&[g.to_str().unwrap(), "--", steps, "0"]);
    ok(
        here,
        &space.url,
        &[
            "run",
            "--session",
            id,
            "--checkpoint-every",
            "200ms",
            "--standby",
            standby,
            g.to_str().unwrap(),
            "--",
            steps,
            "0",
        ],
    );
    plain.stdout
}

/// Once `standby` has taken a further checkpoint of session `id`, `owner` dies: the standby
/// takes the session over (etcd names it at epoch 2) and runs it to the end, showing `plain`.
fn owner_dies_standby_goes_on(
    here: &crate::harness::Env,
    etcd: &Etcd,
    owner: &mut SpaceProc,
    standby: &SpaceProc,
    id: &str,
    plain: &[u8],
) {
    let before = released(owner, id);
    eventually("the standby takes further checkpoints", || {
        released(owner, id) > before
    });
    owner.stop();
    eventually("the standby takes the session over", || {
        standby.state(id).as_deref() != Some("standby")
    });
    assert_eq!(
        etcd.owner(id),
        Some(json!({"space": standby.url, "epoch": 2}))
    );
    assert_finished_like(here, &standby.url, id, plain);
}

/// How much of the session's output its space shows (`released`).
fn released(space: &SpaceProc, id: &str) -> u64 {
    space.session(id).unwrap()["released"].as_u64().unwrap()
}

/// A session run with `--standby` on a space that then dies for good: once the space's etcd
/// lease runs out, the standby takes the session over from the last checkpoint it holds and
/// runs it to the end — the output is that of an uninterrupted run, and what the dead space
/// had shown of it is a prefix of that. The space, back, finds its copy fenced.
#[test]
fn in_a_fleet_a_standby_takes_over_a_session_whose_space_died() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let mut a = fleet_space(&etcd, &["--lease-ttl", "2s"]);
    let b = fleet_space(&etcd, &[]);
    let plain = run_with_standby(&here, &a, &b.url, "spare", "150");
    eventually("the standby holds a checkpoint", || {
        released(&a, "spare") > 0 && b.state("spare").as_deref() == Some("standby")
    });
    let (ps, _, _) = cli(&here, &b.url, &["ps"]);
    assert!(ps.contains(&format!("standby of {}", a.url)), "{ps}");
    let (shown, _, code) = cli(&here, &a.url, &["logs", "spare"]);
    assert_eq!(code, 0);
    assert!(
        !shown.is_empty() && plain.starts_with(shown.as_bytes()),
        "shown before the failure: {shown:?}"
    );
    // The standby shows what its copy holds: at least what the owner showed.
    let (copy, _, code) = cli(&here, &b.url, &["logs", "spare"]);
    assert_eq!(code, 0);
    assert!(
        copy.starts_with(&shown) && plain.starts_with(copy.as_bytes()),
        "the standby's copy: {copy:?}"
    );
    let (at_a, _, _) = cli(&here, &a.url, &["metrics"]);
    assert!(metric(&at_a, "ferry_standby_checkpoints_total{result=\"taken\"}") >= 1.0);
    assert!(metric(&at_a, "ferry_etcd_lease_renewed_age_seconds") < 2.0);
    let (at_b, _, _) = cli(&here, &b.url, &["metrics"]);
    assert_eq!(metric(&at_b, "ferry_sessions{state=\"standby\"}"), 1.0);
    // Following the session at A: `wait` and `logs --follow` go on at the standby.
    let follow = |args: &[&str]| {
        here.ferry()
            .args(["--space", &a.url])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let waiting = follow(&["wait", "spare"]);
    let following = follow(&["logs", "spare", "--follow"]);
    std::thread::sleep(Duration::from_millis(500));
    a.stop();
    eventually("the standby takes the session over", || {
        b.state("spare").as_deref() != Some("standby")
    });
    let waited = waiting.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&waited.stderr);
    assert_eq!(waited.status.code(), Some(0), "{err}");
    assert!(err.contains("took session spare over"), "{err}");
    let followed = following.wait_with_output().unwrap();
    assert_eq!(followed.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&followed.stdout),
        String::from_utf8_lossy(&plain),
        "read on at the standby"
    );
    assert_eq!(
        etcd.owner("spare"),
        Some(json!({"space": b.url, "epoch": 2}))
    );
    assert!(etcd.values("/ferry/standby/spare").is_empty());
    assert_finished_like(&here, &b.url, "spare", &plain);
    let taken = b.session("spare").unwrap();
    assert_eq!(
        (&taken["source"], &taken["epoch"]),
        (&json!(a.url), &json!(2))
    );
    // The space comes back: its copy is fenced, never resumed.
    a.spawn(None);
    eventually("the old owner learns its session was taken over", || {
        a.state("spare").as_deref() == Some("moved")
    });
    let err = refused(&here, &a.url, &["resume", "spare"]);
    assert!(err.contains("moved to"), "{err}");
    finished_once(&[&a, &b], "spare", &b);
    stores_verify(&[&a, &b]);
    let (at_b, _, _) = cli(&here, &b.url, &["metrics"]);
    assert_eq!(metric(&at_b, "ferry_takeovers_total"), 1.0);
    assert_eq!(
        metric(&at_b, "ferry_sessions_ended_total{how=\"exited\"}"),
        1.0
    );
}

/// A space stopped with SIGTERM suspends a session that has a standby, and does not come
/// back: once its lease runs out the standby takes the session over and runs it on (the
/// suspend was no user's: the copy is to go on), ending with an uninterrupted run's output.
#[test]
fn in_a_fleet_a_session_suspended_by_its_space_stopping_goes_on_at_its_standby() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let mut a = fleet_space(&etcd, &["--lease-ttl", "2s"]);
    let b = fleet_space(&etcd, &[]);
    let plain = run_with_standby(&here, &a, &b.url, "stopped", "150");
    eventually("the standby holds a checkpoint", || {
        released(&a, "stopped") > 0 && b.state("stopped").as_deref() == Some("standby")
    });
    let status = a.terminate();
    assert!(status.success(), "{status}");
    eventually("the standby takes the session over", || {
        b.state("stopped").as_deref() != Some("standby")
    });
    assert_finished_like(&here, &b.url, "stopped", &plain);
    // Back, the space finds the session taken over, and does not resume it.
    a.spawn(None);
    eventually("the old owner learns its session was taken over", || {
        a.state("stopped").as_deref() == Some("moved")
    });
    finished_once(&[&a, &b], "stopped", &b);
    stores_verify(&[&a, &b]);
}

/// On `a`, `sleepy STEPS 0` three times: `kept` with `b` as its standby (once `b` holds a
/// checkpoint), `loose` without, and `asleep`, suspended. Returns what an uninterrupted run
/// shows (the same for the three).
fn three_sessions(
    here: &crate::harness::Env,
    a: &SpaceProc,
    b: &SpaceProc,
    steps: &str,
) -> Vec<u8> {
    let plain = run_with_standby(here, a, &b.url, "kept", steps);
    let g = crate::harness::guest("wasm/sleepy.wasm");
    let g = g.to_str().unwrap();
    for id in ["loose", "asleep"] {
        ok(here, &a.url, &["run", "--session", id, g, "--", steps, "0"]);
    }
    ok(here, &a.url, &["suspend", "asleep"]);
    eventually("the standby holds a checkpoint", || {
        b.state("kept").as_deref() == Some("standby")
    });
    plain
}

/// `serve --on-stop move`: a space stopped with SIGTERM first moves its running sessions to
/// other spaces of the fleet — one with a standby to that standby, one without to another
/// live space — where each ends with an uninterrupted run's output; a suspended one stays
/// there, suspended. Back, the space runs none of the moved ones.
#[test]
fn in_a_fleet_a_space_stopped_with_on_stop_move_moves_its_sessions_away() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let mut a = fleet_space(&etcd, &["--on-stop", "move"]);
    let b = fleet_space(&etcd, &[]);
    let c = fleet_space(&etcd, &[]);
    let plain = three_sessions(&here, &a, &b, "300");
    let status = a.terminate();
    assert!(status.success(), "{status}");
    let holder = |id: &str| {
        [&b, &c]
            .into_iter()
            .find(|s| matches!(s.state(id).as_deref(), Some("running" | "exited")))
            .unwrap_or_else(|| panic!("{id} runs on neither B nor C"))
    };
    assert_eq!(
        holder("kept").url,
        b.url,
        "a session goes to its standby first"
    );
    for id in ["kept", "loose"] {
        assert_finished_like(&here, &holder(id).url, id, &plain);
    }
    a.spawn(None);
    for id in ["kept", "loose"] {
        assert_eq!(a.state(id).as_deref(), Some("moved"), "{id}");
    }
    assert_eq!(a.state("asleep").as_deref(), Some("suspended"));
    stores_verify(&[&a, &b, &c]);
}

/// While the standby cannot take checkpoints (it is down), the owner shows no more output —
/// the guest runs on — and catches up once the standby is back. A session that ends removes
/// its standby: its owner dying afterwards runs nothing a second time.
#[test]
fn in_a_fleet_output_waits_for_the_standby_and_an_ended_session_takes_it_along() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let mut a = fleet_space(&etcd, &["--lease-ttl", "2s"]);
    let mut b = fleet_space(&etcd, &[]);
    let plain = run_with_standby(&here, &a, &b.url, "held", "150");
    eventually("the standby holds a checkpoint", || {
        released(&a, "held") > 0
    });
    b.stop();
    eventually("the owner notices that the standby is gone", || {
        a.session("held").unwrap().get("standby_error").is_some()
    });
    let (ps, ps_err, _) = cli(&here, &a.url, &["ps"]);
    assert!(ps.contains("(output held back)"), "{ps}");
    assert!(ps_err.contains("its output is held back"), "{ps_err}");
    let before = released(&a, "held");
    // Both streams (the guest's stdout is buffered; it writes to stderr every 120 ms).
    let (out, err, _) = cli(&here, &a.url, &["logs", "held"]);
    std::thread::sleep(std::time::Duration::from_millis(1000));
    assert_eq!(
        released(&a, "held"),
        before,
        "output shown without the standby"
    );
    let (out2, err2, _) = cli(&here, &a.url, &["logs", "held"]);
    assert_eq!((out2, err2), (out, err));
    assert_eq!(a.state("held").as_deref(), Some("running"));
    b.spawn(None);
    assert_finished_like(&here, &a.url, "held", &plain);
    eventually("the standby drops its copy", || b.state("held").is_none());
    assert!(etcd.values("/ferry/standby/held").is_empty());
    // The owner dies after the end: nothing takes the session over.
    a.stop();
    std::thread::sleep(std::time::Duration::from_millis(4000));
    assert!(b.state("held").is_none());
    assert_eq!(
        etcd.owner("held"),
        Some(json!({"space": a.url, "epoch": 1}))
    );
    stores_verify(&[&b]);
}

/// A session with a standby moves on (`migrate`): etcd names the standby again at the new
/// epoch in the commit's transaction, the destination sends it its checkpoints and holds its
/// output back until the standby has them, and the standby's copy follows — so when the
/// destination then dies, the standby takes the session over from it. A session moved to its
/// own standby runs there without one.
#[test]
fn in_a_fleet_a_standby_follows_its_session_when_it_moves() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let a = fleet_space(&etcd, &[]);
    let b = fleet_space(&etcd, &[]);
    let mut c = fleet_space(&etcd, &["--lease-ttl", "2s"]);
    let plain = run_with_standby(&here, &a, &b.url, "roam", "600");
    eventually("the standby holds a checkpoint", || {
        released(&a, "roam") > 0 && b.state("roam").as_deref() == Some("standby")
    });
    let (report, err, code) = cli(&here, &a.url, &["migrate", "roam", "--to", &c.url]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!("its standby {} follows it", b.url)),
        "{err}"
    );
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(report["standby"], json!(b.url));
    assert_eq!(
        etcd.owner("roam"),
        Some(json!({"space": c.url, "epoch": 2}))
    );
    assert_eq!(
        standby_record(&etcd, "roam"),
        json!({"space": b.url, "epoch": 2})
    );
    let moved = c.session("roam").unwrap();
    assert_eq!(moved["standby"], json!(b.url));
    let at_move = moved["released"].as_u64().unwrap();
    eventually("the standby's copy follows the move", || {
        let copy = b.session("roam").unwrap();
        copy["source"] == json!(c.url) && copy["epoch"] == json!(2)
    });
    eventually("the destination's checkpoints reach the standby", || {
        released(&c, "roam") > at_move
    });
    let (shown, _, _) = cli(&here, &c.url, &["logs", "roam"]);
    assert!(plain.starts_with(shown.as_bytes()), "{shown:?}");
    c.stop();
    eventually("the standby takes the session over", || {
        b.state("roam").as_deref() != Some("standby")
    });
    assert_eq!(
        etcd.owner("roam"),
        Some(json!({"space": b.url, "epoch": 3}))
    );
    assert_finished_like(&here, &b.url, "roam", &plain);
    assert_eq!(a.state("roam").as_deref(), Some("moved"));
    finished_once(&[&a, &b], "roam", &b);

    // Moved to its own standby: the copy there gives way to the session, which runs without
    // a standby (its output shown as it comes); etcd keeps no standby record.
    let plain = run_with_standby(&here, &a, &b.url, "home", "300");
    eventually("the standby holds a checkpoint", || {
        b.state("home").as_deref() == Some("standby")
    });
    let (report, err, code) = cli(&here, &a.url, &["migrate", "home", "--to", &b.url]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("follows it"), "{err}");
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(report.get("standby"), None);
    assert!(etcd.values("/ferry/standby/home").is_empty());
    let home = b.session("home").unwrap();
    assert_eq!((home.get("standby"), home.get("released")), (None, None));
    assert_finished_like(&here, &b.url, "home", &plain);
    finished_once(&[&a, &b], "home", &b);

    // The same for a session whose space chooses its standby (B, the only other space
    // alive): the destination chooses one in turn — A, where the copy takes the place of
    // A's record of the session that moved away.
    let plain = run_with_standby(&here, &a, "auto", "back", "300");
    assert_eq!(standby_of(&a, "back"), Some(b.url.clone()));
    eventually("the standby holds a checkpoint", || {
        b.state("back").as_deref() == Some("standby")
    });
    ok(&here, &a.url, &["migrate", "back", "--to", &b.url]);
    // (A holds the copy a moment before etcd, and then B, name it.)
    eventually("the destination chooses the source as its standby", || {
        standby_of(&b, "back") == Some(a.url.clone())
    });
    assert!(
        a.session("back")
            .is_some_and(|s| s["state"] == "standby" && s["source"] == json!(b.url))
    );
    assert_eq!(
        standby_record(&etcd, "back"),
        json!({"space": a.url, "epoch": 2})
    );
    assert_finished_like(&here, &b.url, "back", &plain);
    eventually("the standby drops its copy once the session ended", || {
        a.state("back").is_none()
    });
    finished_once(&[&a, &b], "back", &b);
    stores_verify(&[&a, &b]);
}

/// `ferry --space A standby ID --to auto` while the session runs: A chooses C (the only space
/// but A and B), etcd names C, B drops its copy, C gets the latest checkpoint and then takes
/// the session over when A dies. `--none`
/// while the standby is down: the output held back is shown at once, and nothing can take
/// the session over any more.
#[test]
fn in_a_fleet_a_running_session_changes_or_gives_up_its_standby() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let mut a = fleet_space(&etcd, &["--lease-ttl", "2s"]);
    let b = fleet_space(&etcd, &[]);
    let mut c = fleet_space(&etcd, &[]);
    let plain = run_with_standby(&here, &a, &b.url, "swap", "600");
    eventually("the standby holds a checkpoint", || {
        b.state("swap").as_deref() == Some("standby")
    });
    let (_, err, code) = cli(&here, &a.url, &["standby", "swap"]);
    assert_eq!(code, 2, "{err}");
    let err = refused(&here, &a.url, &["standby", "swap", "--to", &a.url]);
    assert!(err.contains("is this space"), "{err}");
    let err = refused(&here, &a.url, &["standby", "nosuch", "--none"]);
    assert!(err.contains("nosuch"), "{err}");
    // `auto`: the space chooses another than B — C, the only other space.
    let (_, err, code) = cli(&here, &a.url, &["standby", "swap", "--to", "auto"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(&format!("standby is {}", c.url)), "{err}");
    assert_eq!(a.session("swap").unwrap()["standby_auto"], json!(true));
    assert_eq!(
        standby_record(&etcd, "swap"),
        json!({"space": c.url, "epoch": 1})
    );
    eventually(
        "the old standby drops its copy, the new one holds one",
        || b.state("swap").is_none() && c.state("swap").as_deref() == Some("standby"),
    );
    owner_dies_standby_goes_on(&here, &etcd, &mut a, &c, "swap", &plain);

    // The standby is down: the owner holds the output back until told to go without one.
    let plain = run_with_standby(&here, &b, &c.url, "free", "300");
    eventually("the standby holds a checkpoint", || {
        released(&b, "free") > 0
    });
    c.stop();
    eventually("the owner notices that the standby is gone", || {
        b.session("free").unwrap().get("standby_error").is_some()
    });
    let (_, err, code) = cli(&here, &b.url, &["standby", "free", "--none"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("no standby now"), "{err}");
    let now = b.session("free").unwrap();
    assert_eq!((now.get("standby"), now.get("released")), (None, None));
    assert!(etcd.values("/ferry/standby/free").is_empty());
    let err = refused(&here, &b.url, &["standby", "free", "--none"]);
    assert!(err.contains("has no standby"), "{err}");
    // A first standby again, but A is down: refused, and the output stays unheld.
    let err = refused(&here, &b.url, &["standby", "free", "--to", &a.url]);
    assert!(err.contains("cannot be reached"), "{err}");
    assert_eq!(b.session("free").unwrap().get("released"), None);
    assert_finished_like(&here, &b.url, "free", &plain);
    stores_verify(&[&b]);
}

/// A session run without `--standby` is given one while it runs: A holds its output, takes a
/// checkpoint covering all it showed, and sends it to B, which then takes the session over
/// when A dies — with an uninterrupted run's output, what A showed before and after being a
/// prefix of it. A session run without `--checkpoint-every` is refused a standby, and a
/// refused standby leaves the output unheld.
#[test]
fn in_a_fleet_a_session_run_without_a_standby_is_given_one_while_it_runs() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let mut a = fleet_space(&etcd, &["--lease-ttl", "2s"]);
    let b = fleet_space(&etcd, &[]);
    let g = crate::harness::guest("wasm/sleepy.wasm");
    let g = g.to_str().unwrap();
    let plain = here.plain(&[g, "--", "400", "0"]).stdout;
    ok(
        &here,
        &a.url,
        &["run", "--session", "bare", g, "--", "400", "0"],
    );
    let err = refused(&here, &a.url, &["standby", "bare", "--to", &b.url]);
    assert!(err.contains("without --checkpoint-every"), "{err}");
    ok(&here, &a.url, &["kill", "bare"]);
    let run = ["run", "--session", "late", "--checkpoint-every", "200ms"];
    ok(&here, &a.url, &[&run[..], &[g, "--", "400", "0"]].concat());
    let err = refused(&here, &a.url, &["standby", "late", "--none"]);
    assert!(err.contains("has no standby"), "{err}");
    eventually("the guest shows output", || {
        !cli(&here, &a.url, &["logs", "late"]).0.is_empty()
    });
    let err = refused(
        &here,
        &a.url,
        &["standby", "late", "--to", "http://127.0.0.1:9"],
    );
    assert!(err.contains("cannot be reached"), "{err}");
    assert_eq!(a.session("late").unwrap().get("released"), None);
    let (before, _, _) = cli(&here, &a.url, &["logs", "late"]);
    let (_, err, code) = cli(&here, &a.url, &["standby", "late", "--to", &b.url]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(&format!("standby is {}", b.url)), "{err}");
    assert_eq!(
        standby_record(&etcd, "late"),
        json!({"space": b.url, "epoch": 1})
    );
    eventually("the standby holds a checkpoint", || {
        b.state("late").as_deref() == Some("standby")
    });
    let (after, _, _) = cli(&here, &a.url, &["logs", "late"]);
    assert!(
        after.starts_with(&before) && plain.starts_with(after.as_bytes()),
        "shown before the standby: {before:?}, after: {after:?}"
    );
    owner_dies_standby_goes_on(&here, &etcd, &mut a, &b, "late", &plain);
    a.spawn(None);
    eventually("the old owner learns its session was taken over", || {
        a.state("late").as_deref() == Some("moved")
    });
    finished_once(&[&a, &b], "late", &b);
    stores_verify(&[&a, &b]);
}

/// The standby the space holds a session's copy at, as its owner names it.
fn standby_of(owner: &SpaceProc, id: &str) -> Option<String> {
    owner.session(id).unwrap()["standby"]
        .as_str()
        .map(str::to_owned)
}

/// A session run with `--standby auto`: its space chooses the standby among the fleet's live
/// spaces, and chooses another when that one dies (its output catching up once the new one
/// holds a checkpoint); the space that takes the session over when the owner dies chooses
/// one in turn — none while no other space is alive (the output then is not held), the
/// first one to come back after. The session ends once, with an uninterrupted run's output.
/// With no other space alive, `run --standby auto` is refused.
#[test]
fn in_a_fleet_a_session_whose_space_chooses_its_standby_keeps_one_through_failures() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let mut a = fleet_space(&etcd, &["--lease-ttl", "2s"]);
    let g = crate::harness::guest("wasm/sleepy.wasm");
    let g = g.to_str().unwrap();
    let run = |space: &SpaceProc, id: &str, steps: &str| {
        cli(
            &here,
            &space.url,
            &[
                "run",
                "--session",
                id,
                "--checkpoint-every",
                "200ms",
                "--standby",
                "auto",
                g,
                "--",
                steps,
                "0",
            ],
        )
    };
    let (_, err, code) = run(&a, "alone", "10");
    assert_ne!(code, 0);
    assert!(err.contains("etcd announces no other live space"), "{err}");
    assert_eq!(a.state("alone"), None);

    let mut spaces = [
        fleet_space(&etcd, &["--lease-ttl", "2s"]),
        fleet_space(&etcd, &["--lease-ttl", "2s"]),
    ];
    let steps = "1000";
    // The uninterrupted run (30 s) runs meanwhile.
    let plain = {
        let g = g.to_owned();
        std::thread::spawn(move || client().plain(&[&g, "--", steps, "0"]).stdout)
    };
    let (_, err, code) = run(&a, "kept", steps);
    assert_eq!(code, 0, "{err}");
    let info = a.session("kept").unwrap();
    assert_eq!(info["standby_auto"], json!(true));
    let first = standby_of(&a, "kept").unwrap();
    let at = |url: &str| spaces.iter().position(|s| s.url == url).unwrap();
    let (s1, s2) = (at(&first), 1 - at(&first));
    eventually("the chosen standby holds a checkpoint", || {
        spaces[s1].state("kept").as_deref() == Some("standby") && released(&a, "kept") > 0
    });
    let (ps, _, _) = cli(&here, &a.url, &["ps"]);
    assert!(ps.contains(&format!("(standby {first}, chosen)")), "{ps}");

    // The standby dies: the owner chooses the other space.
    spaces[s1].stop();
    eventually("the owner chooses another standby", || {
        standby_of(&a, "kept").as_deref() == Some(spaces[s2].url.as_str())
    });
    let held = released(&a, "kept");
    eventually(
        "the new standby holds a checkpoint and the output catches up",
        || spaces[s2].state("kept").as_deref() == Some("standby") && released(&a, "kept") > held,
    );
    assert_eq!(
        standby_record(&etcd, "kept"),
        json!({"space": spaces[s2].url, "epoch": 1})
    );

    // The owner dies: the standby takes the session over; no other space is alive to stand
    // by for it there, so it runs without one, its output not held, and says why.
    a.stop();
    let b = &spaces[s2];
    eventually("the standby takes the session over", || {
        b.state("kept").as_deref() == Some("running")
    });
    eventually("the new owner finds no space to stand by", || {
        b.session("kept").unwrap()["standby_error"]
            .as_str()
            .is_some_and(|e| e.contains("etcd announces no other live space"))
    });
    let now = b.session("kept").unwrap();
    assert_eq!((now.get("standby"), now.get("released")), (None, None));
    let (_, says, _) = cli(&here, &b.url, &["ps"]);
    assert!(
        says.contains("kept: no standby (the space gives it one"),
        "{says}"
    );
    assert_eq!(
        etcd.owner("kept"),
        Some(json!({"space": b.url, "epoch": 2}))
    );

    // The first standby's space comes back: the new owner chooses it.
    spaces[s1].spawn(None);
    let (b, c) = (&spaces[s2], &spaces[s1]);
    eventually("the new owner chooses the space that came back", || {
        standby_of(b, "kept").as_deref() == Some(c.url.as_str())
    });
    eventually("it holds a checkpoint of the new owner's", || {
        c.session("kept")
            .is_some_and(|s| s["state"] == "standby" && s["source"] == json!(b.url))
    });
    assert_eq!(
        standby_record(&etcd, "kept"),
        json!({"space": c.url, "epoch": 2})
    );
    assert_finished_like(&here, &b.url, "kept", &plain.join().unwrap());
    eventually("the standby drops its copy once the session ended", || {
        c.state("kept").is_none()
    });
    a.spawn(None);
    eventually("the first owner, back, is fenced", || {
        a.state("kept").as_deref() == Some("moved")
    });
    finished_once(&[&a, b, c], "kept", b);
    stores_verify(&[b, c]);
}

/// Spaces in zones (`serve --zone`): a session whose space chooses its standby gets one of
/// another zone; with that one gone, one of its own zone; and, once a space of another zone
/// is back, is moved to it (the one of its own zone drops its copy). The session ends once,
/// with an uninterrupted run's output. A zone name `--zone` does not take is refused.
#[test]
fn in_a_fleet_a_chosen_standby_is_of_another_zone_when_one_can_stand_by() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let (_, err, code) = here.output(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--etcd",
        &etcd.url,
        "--zone",
        "rack 1",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--zone `rack 1`"), "{err}");
    let zone = |z| ["--lease-ttl", "2s", "--zone", z];
    let a = fleet_space(&etcd, &zone("rack-1"));
    let b = fleet_space(&etcd, &zone("rack-1"));
    let mut c = fleet_space(&etcd, &zone("rack-2"));
    let plain = run_with_standby(&here, &a, "auto", "zoned", "1000");
    assert_eq!(standby_of(&a, "zoned").as_deref(), Some(c.url.as_str()));
    eventually("the standby of another zone holds a checkpoint", || {
        c.state("zoned").as_deref() == Some("standby")
    });

    // The only space of another zone dies: one of the owner's zone will do meanwhile.
    c.stop();
    eventually("the owner chooses the space of its own zone", || {
        standby_of(&a, "zoned").as_deref() == Some(b.url.as_str())
    });
    eventually("it holds a checkpoint", || {
        b.state("zoned").as_deref() == Some("standby")
    });

    // Back: the standby moves to the other zone, and the one of the owner's zone drops its
    // copy.
    c.spawn(None);
    eventually("the owner moves the standby to the other zone", || {
        standby_of(&a, "zoned").as_deref() == Some(c.url.as_str())
    });
    eventually(
        "the standby of another zone holds a checkpoint again",
        || {
            c.session("zoned")
                .is_some_and(|s| s["state"] == "standby" && s["source"] == json!(a.url))
        },
    );
    eventually("the one of the owner's zone drops its copy", || {
        b.state("zoned").is_none()
    });
    assert_eq!(
        standby_record(&etcd, "zoned"),
        json!({"space": c.url, "epoch": 1})
    );
    // `fleet` lists the live spaces with their zones, and whom each stands by for.
    let (listed, err, code) = cli(&here, &a.url, &["fleet"]);
    assert_eq!(code, 0, "{err}");
    let row = |s: &SpaceProc| {
        let line = listed.lines().find(|l| l.starts_with(&s.url)).unwrap();
        line.split_whitespace()
            .skip(1)
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(
        [row(&a), row(&b), row(&c)],
        [
            "rack-1 (this space)",
            "rack-1 0 sessions",
            "rack-2 1 session"
        ],
        "{listed}"
    );
    assert_finished_like(&here, &a.url, "zoned", &plain);
    finished_once(&[&a, &b, &c], "zoned", &a);
    stores_verify(&[&a, &b, &c]);
}

/// A session with a standby whose guest ends while its space cannot reach etcd: the end
/// waits (nothing may take the session over once it is recorded), the session says so
/// (`end_waits`, and `ps`) while its state is still `running`, and it ends once etcd answers
/// again — once, with an uninterrupted run's output, the standby dropping its copy.
#[test]
fn in_a_fleet_a_session_that_ends_while_etcd_is_out_of_reach_says_its_end_waits() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    // A lease long enough that A, cut off, is not taken over while the test looks.
    let a = SpaceProc::start(&["--etcd", &etcd.url_at("127.0.0.3"), "--lease-ttl", "60s"]);
    let b = fleet_space(&etcd, &[]);
    let plain = run_with_standby(&here, &a, &b.url, "late", "150");
    eventually("the standby holds a checkpoint", || {
        released(&a, "late") > 0
    });
    let Some(cut) = Blackhole::address("127.0.0.3", etcd.port()) else {
        return;
    };
    eventually("the session says its end waits for etcd", || {
        a.session("late").unwrap()["end_waits"]
            .as_str()
            .is_some_and(|e| e.contains("etcd cannot be reached"))
    });
    assert_eq!(a.state("late").as_deref(), Some("running"));
    let (_, says, _) = cli(&here, &a.url, &["ps"]);
    assert!(
        says.contains("late: the guest has stopped; its end is recorded once etcd answers"),
        "{says}"
    );
    assert_eq!(b.state("late").as_deref(), Some("standby"));
    drop(cut);
    assert_finished_like(&here, &a.url, "late", &plain);
    assert_eq!(a.session("late").unwrap().get("end_waits"), None);
    eventually("the standby drops its copy", || b.state("late").is_none());
    finished_once(&[&a, &b], "late", &a);
}

/// `drain` moves every running or suspended session off a space: refused by an unreachable
/// `--to`, each session stays running where it was (exit code 1, each one's reason); with
/// `--to auto` (and `--parallel 3`: all three moved at once) a session with a standby goes to
/// its standby and the others to the other live spaces of the fleet, each ending there with
/// an uninterrupted run's output (a suspended one
/// stays suspended there until resumed). Drained again, the space has nothing to move; while
/// drained it runs no new session, no space chooses it as a standby and naming it as one is
/// refused — also after it is restarted —, until `drain --undo`.
#[test]
fn in_a_fleet_drain_moves_every_session_off_a_space() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    // A short lease: A is restarted below, and its announcement must run out first.
    let mut a = fleet_space(&etcd, &["--lease-ttl", "3s"]);
    let b = fleet_space(&etcd, &[]);
    let c = fleet_space(&etcd, &[]);
    // The three run the same program: one uninterrupted run's output serves them all.
    let plain = three_sessions(&here, &a, &b, "600");
    let g = crate::harness::guest("wasm/sleepy.wasm");
    let g = g.to_str().unwrap();

    let (out, err, code) = cli(&here, &a.url, &["drain", "--to", "http://127.0.0.1:9"]);
    assert_eq!(code, 1, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["moved"], json!([]), "{err}");
    assert_eq!(report["stayed"].as_array().unwrap().len(), 3, "{err}");
    assert!(err.contains("the destination is unreachable"), "{err}");
    assert_eq!(a.state("kept").as_deref(), Some("running"));
    assert_eq!(a.state("asleep").as_deref(), Some("suspended"));

    // All three at once.
    let (out, err, code) = cli(
        &here,
        &a.url,
        &["drain", "--parallel", "3", "--max-pause", "60s"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("moved 3 of 3 session(s) off"), "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let to = |id: &str| {
        report["moved"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["session"] == id)
            .map(|m| m["to"].as_str().unwrap().to_owned())
            .unwrap()
    };
    assert_eq!(to("kept"), b.url, "a session goes to its standby first");
    for id in ["kept", "loose", "asleep"] {
        assert_eq!(a.state(id).as_deref(), Some("moved"), "{id}");
        assert_ne!(to(id), a.url);
    }
    // A suspended session stays suspended at its destination, and goes on there when
    // resumed.
    let asleep_at = [&b, &c]
        .into_iter()
        .find(|s| s.url == to("asleep"))
        .unwrap();
    assert_eq!(asleep_at.state("asleep").as_deref(), Some("suspended"));
    ok(&here, &asleep_at.url, &["resume", "asleep"]);
    for id in ["kept", "loose", "asleep"] {
        assert_finished_like(&here, &to(id), id, &plain);
    }
    let (_, err, code) = cli(&here, &a.url, &["drain"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("nothing to move"), "{err}");
    // A load balancer's probe hears that A takes no new sessions; B does.
    let (status, body) = a.ready();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("being drained"), "{body}");
    assert_eq!(b.ready(), (200, "ready\n".to_owned()));

    // While drained, A runs nothing new, and no space chooses it as a standby.
    let err = refused(
        &here,
        &a.url,
        &["run", "--session", "new", g, "--", "5", "0"],
    );
    assert!(err.contains("this space is being drained"), "{err}");
    let (listed, _, _) = cli(&here, &b.url, &["fleet"]);
    let line = listed.lines().find(|l| l.starts_with(&a.url)).unwrap();
    assert!(line.ends_with("(draining)"), "{listed}");
    run_with_standby(&here, &b, "auto", "spared", "20");
    assert_eq!(standby_of(&b, "spared").as_deref(), Some(c.url.as_str()));
    let every = ["--checkpoint-every", "200ms", "--standby", &a.url];
    let err = refused(
        &here,
        &b.url,
        &[
            &["run", "--session", "onto"][..],
            &every,
            &[g, "--", "5", "0"],
        ]
        .concat(),
    );
    assert!(err.contains("is being drained"), "{err}");
    // Restarted, A is still drained, and announced so from its first announcement on.
    a.stop();
    eventually("A's lease runs out", || {
        let (listed, _, _) = cli(&here, &b.url, &["fleet"]);
        !listed.contains(&a.url)
    });
    a.spawn(None);
    let mut listed = String::new();
    eventually("A is announced again", || {
        listed = cli(&here, &b.url, &["fleet"]).0;
        listed.contains(&a.url)
    });
    let line = listed.lines().find(|l| l.starts_with(&a.url)).unwrap();
    assert!(line.ends_with("(draining)"), "{listed}");
    let err = refused(
        &here,
        &a.url,
        &["run", "--session", "new", g, "--", "5", "0"],
    );
    assert!(err.contains("this space is being drained"), "{err}");
    let (_, err, code) = cli(&here, &a.url, &["drain", "--undo"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(a.ready().0, 200);
    ok(
        &here,
        &a.url,
        &["run", "--session", "new", g, "--", "5", "0"],
    );
    stores_verify(&[&a, &b, &c]);
}

/// Session `id` (`sleepy 300`) run on A, which dies at `fault` (`FERRY_FAULT`) of
/// `standby ID --to C` once B holds a checkpoint; A's etcd lease is `ttl`. Returns etcd, A,
/// B, C and what an uninterrupted run shows (`None` without etcd).
fn owner_dies_changing_standby(
    fault: &str,
    ttl: &str,
    id: &str,
) -> Option<(Etcd, SpaceProc, SpaceProc, SpaceProc, Vec<u8>)> {
    let etcd = Etcd::start()?;
    let here = client();
    let a = SpaceProc::start_with_vars(
        &[("FERRY_FAULT", fault)],
        &["--etcd", &etcd.url, "--lease-ttl", ttl],
    );
    let b = fleet_space(&etcd, &[]);
    let c = fleet_space(&etcd, &[]);
    let plain = run_with_standby(&here, &a, &b.url, id, "300");
    eventually("the standby holds a checkpoint", || {
        b.state(id).as_deref() == Some("standby")
    });
    let (_, err, code) = cli(&here, &a.url, &["standby", id, "--to", &c.url]);
    assert_ne!(code, 0, "{err}");
    Some((etcd, a, b, c, plain))
}

/// The standby record etcd holds for session `id`.
fn standby_record(etcd: &Etcd, id: &str) -> serde_json::Value {
    serde_json::from_str(&etcd.values(&format!("/ferry/standby/{id}"))[0]).unwrap()
}

/// A space that dies while it gives its session another standby — after the new standby
/// holds the checkpoint, before etcd names it (`FERRY_FAULT=standby-sent-ahead`): etcd still
/// names the old standby, which takes the session over; the new one drops the copy it was
/// sent ahead.
#[test]
fn in_a_fleet_an_owner_dying_while_it_changes_its_standby_is_taken_over_by_the_old_one() {
    let Some((etcd, _a, b, c, plain)) =
        owner_dies_changing_standby("standby-sent-ahead", "2s", "ahead")
    else {
        return;
    };
    let here = client();
    assert_eq!(c.state("ahead").as_deref(), Some("standby"));
    eventually("the old standby takes the session over", || {
        b.state("ahead").as_deref() != Some("standby")
    });
    assert_eq!(
        etcd.owner("ahead"),
        Some(json!({"space": b.url, "epoch": 2}))
    );
    assert_finished_like(&here, &b.url, "ahead", &plain);
    eventually("the new standby drops the copy sent ahead", || {
        c.state("ahead").is_none()
    });
    assert!(etcd.values("/ferry/standby/ahead").is_empty());
    stores_verify(&[&b, &c]);
}

/// The owner dies right after etcd names the new standby C (`FERRY_FAULT=standby-named`),
/// before its own record does, and comes back before its lease runs out: its record still
/// names B. The checkpoint it sends next (its last snapshot, sent again as it comes back, or
/// the next one), refused by B (etcd names C), goes to C instead, and the output held back
/// since catches up; the session ends once.
#[test]
fn in_a_fleet_an_owner_back_from_a_crash_sends_its_checkpoints_to_the_standby_etcd_names() {
    let Some((etcd, mut a, b, c, plain)) =
        owner_dies_changing_standby("standby-named", "30s", "named")
    else {
        return;
    };
    let here = client();
    a.wait_dead();
    assert_eq!(
        standby_record(&etcd, "named"),
        json!({"space": c.url, "epoch": 1})
    );
    // Its record from before the crash names B; the last snapshot it sends B again as it
    // comes back (`recover`) may already have been refused and sent to C by the time it
    // answers, so which one the record names now is not asserted.
    a.spawn(None);
    ok(&here, &a.url, &["resume", "named"]);
    eventually(
        "the owner sends its checkpoints to the standby etcd names",
        || a.session("named").unwrap()["standby"] == json!(c.url),
    );
    let held = released(&a, "named");
    eventually("the output catches up", || released(&a, "named") > held);
    assert_eq!(c.state("named").as_deref(), Some("standby"));
    eventually("the old standby drops its copy", || {
        b.state("named").is_none()
    });
    assert_finished_like(&here, &a.url, "named", &plain);
    finished_once(&[&a, &b, &c], "named", &a);
    stores_verify(&[&a, &c]);
}

/// What `run --standby` refuses, before anything runs.
#[test]
fn a_standby_is_refused_where_it_cannot_work() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let a = fleet_space(&etcd, &[]);
    let lone = SpaceProc::start(&[]);
    let g = crate::harness::guest("wasm/sleepy.wasm");
    let g = g.to_str().unwrap();
    let run = |space: &str, extra: &[&str]| {
        let mut args = vec!["run", "--session", "no"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&[g, "--", "5", "0"]);
        refused(&here, space, &args)
    };
    let err = run(&a.url, &["--standby", &lone.url]);
    assert!(err.contains("--checkpoint-every"), "{err}");
    let every = ["--checkpoint-every", "200ms", "--standby"];
    let err = run(&lone.url, &[&every[..], &[a.url.as_str()]].concat());
    assert!(err.contains("without --etcd"), "{err}");
    let err = refused(&here, &lone.url, &["fleet"]);
    assert!(err.contains("it is in no fleet"), "{err}");
    let err = run(&a.url, &[&every[..], &[lone.url.as_str()]].concat());
    assert!(err.contains("not a space of this fleet"), "{err}");
    let err = run(&a.url, &[&every[..], &[a.url.as_str()]].concat());
    assert!(err.contains("is this space"), "{err}");
    let err = run(&a.url, &[&every[..], &["http://127.0.0.1:9"]].concat());
    assert!(err.contains("cannot be reached"), "{err}");
    // A standby whose policy would not admit the guest: refused before it runs.
    let policy = here.path("strict.toml");
    std::fs::write(&policy, "version = 1\nenv = []\nmax_memory_mib = 8\n").unwrap();
    let strict = fleet_space(&etcd, &["--policy", policy.to_str().unwrap()]);
    let err = run(
        &a.url,
        &[&every[..], &[strict.url.as_str(), "--env", "SECRET=1"]].concat(),
    );
    assert!(
        err.contains("would not take the session over") && err.contains("`SECRET`"),
        "{err}"
    );
    assert_eq!(a.state("no"), None);
    assert_eq!(etcd.owner("no"), None);
    // A guest that grows past the standby's memory limit: the standby refuses its
    // checkpoints, and the owner holds the output back, saying why.
    let dirty = crate::harness::guest("wasm/dirty.wasm");
    ok(
        &here,
        &a.url,
        &[
            "run",
            "--session",
            "big",
            "--checkpoint-every",
            "200ms",
            "--standby",
            &strict.url,
            dirty.to_str().unwrap(),
            "--",
            "16",
            "100",
            "10",
        ],
    );
    eventually("the standby refuses the checkpoint", || {
        a.session("big").unwrap()["standby_error"]
            .as_str()
            .is_some_and(|e| e.contains("policy would not resume it") && e.contains("MiB"))
    });
    assert_eq!(released(&a, "big"), 0);
    assert_eq!(strict.state("big"), None);
    ok(&here, &a.url, &["kill", "big"]);
}

/// A standby the space chose that goes on refusing the session's checkpoints while etcd still
/// announces it (the guest outgrew its memory limit) is replaced once a space that takes them
/// is there (`FERRY_STANDBY_STUCK_MS`: after 1 s here, 15 s by default): the held output is
/// then shown, and the refusing space holds no copy.
#[test]
fn in_a_fleet_a_space_replaces_a_chosen_standby_that_refuses_its_checkpoints() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let a = SpaceProc::start_with_vars(
        &[("FERRY_STANDBY_STUCK_MS", "1000")],
        &["--etcd", &etcd.url],
    );
    let policy = here.path("strict.toml");
    std::fs::write(&policy, "version = 1\nmax_memory_mib = 8\n").unwrap();
    let strict = fleet_space(&etcd, &["--policy", policy.to_str().unwrap()]);
    let dirty = crate::harness::guest("wasm/dirty.wasm");
    ok(
        &here,
        &a.url,
        &[
            "run",
            "--session",
            "grown",
            "--checkpoint-every",
            "200ms",
            "--standby",
            "auto",
            dirty.to_str().unwrap(),
            "--",
            "16",
            "600",
            "10",
        ],
    );
    assert_eq!(standby_of(&a, "grown"), Some(strict.url.clone()));
    eventually("the chosen standby refuses the checkpoints", || {
        a.session("grown").unwrap()["standby_error"]
            .as_str()
            .is_some_and(|e| e.contains("policy would not resume it"))
    });
    assert_eq!(released(&a, "grown"), 0);
    let c = fleet_space(&etcd, &[]);
    eventually("the owner chooses the space that takes them", || {
        standby_of(&a, "grown").as_deref() == Some(c.url.as_str())
    });
    eventually("its output is shown", || released(&a, "grown") > 0);
    assert_eq!(c.state("grown").as_deref(), Some("standby"));
    assert_eq!(strict.state("grown"), None);
    let (shown, _, code) = cli(&here, &a.url, &["logs", "grown"]);
    assert_eq!(code, 0);
    assert!(shown.starts_with("ready\ntick 0 "), "{shown}");
    ok(&here, &a.url, &["kill", "grown"]);
    eventually("the standby drops its copy once the session ended", || {
        c.state("grown").is_none()
    });
}

/// A session lent to a client and reclaimed raises its epoch here; in a fleet its owner
/// record follows, so the space resumes it as before. A session with a standby is not lent.
#[test]
fn in_a_fleet_a_reclaimed_session_resumes_and_a_standby_one_is_not_lent() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let a = fleet_space(&etcd, &[]);
    let b = fleet_space(&etcd, &[]);
    let plain = run_cpu_guest(&here, &a.url, "lent", "400");
    let c = ferry_space::SpaceClient::new(&a.url, crate::harness::SPACE_TOKEN);
    assert_eq!(c.lend("lent", "a test").unwrap().epoch, 2);
    assert_eq!(c.reclaim("lent").unwrap().epoch, 3);
    ok(&here, &a.url, &["resume", "lent"]);
    assert_eq!(
        etcd.owner("lent"),
        Some(json!({"space": a.url, "epoch": 3}))
    );
    assert_finished_like(&here, &a.url, "lent", &plain.stdout);

    run_with_standby(&here, &a, &b.url, "kept", "100");
    let e = c.lend("kept", "a test").unwrap_err();
    assert_eq!(e.status, 409);
    assert!(e.msg.contains("has a standby"), "{e}");
    let (_, err, code) = cli(&here, &a.url, &["wait", "kept"]);
    assert_eq!(code, 0, "{err}");
}

/// The owner is cut off from etcd alone (it still reaches its standby; nftables on the etcd
/// address it uses, 127.0.0.3): its lease runs out and the standby takes the session over,
/// while the owner's guest runs on. The guest prints a random draw at each step, so a step
/// run twice would show differently: what the owner showed must be a byte-for-byte prefix
/// of the output the standby's copy ends with, which has every step once. Once the owner
/// reaches etcd again, its copy is fenced.
#[test]
fn in_a_fleet_an_owner_cut_off_from_etcd_shows_only_what_its_standby_goes_on_from() {
    let Some(etcd) = Etcd::start() else {
        return;
    };
    let here = client();
    let a = SpaceProc::start(&["--etcd", &etcd.url_at("127.0.0.3"), "--lease-ttl", "2s"]);
    let b = fleet_space(&etcd, &[]);
    let g = crate::harness::guest("wasm/draws.wasm");
    ok(
        &here,
        &a.url,
        &[
            "run",
            "--session",
            "cut",
            "--checkpoint-every",
            "200ms",
            "--standby",
            &b.url,
            g.to_str().unwrap(),
            "--",
            "200",
        ],
    );
    eventually("the standby holds a checkpoint", || released(&a, "cut") > 0);
    let Some(cut) = Blackhole::address("127.0.0.3", etcd.port()) else {
        return;
    };
    eventually("the standby takes the session over", || {
        b.state("cut").as_deref() != Some("standby")
    });
    let (_, err, code) = cli(&here, &b.url, &["wait", "cut"]);
    assert_eq!(code, 0, "{err} {:?}", b.session("cut"));
    let (out, _, _) = cli(&here, &b.url, &["logs", "cut"]);
    let steps: Vec<_> = out
        .lines()
        .map(|l| l.split(' ').nth(1).unwrap().parse::<u32>().unwrap())
        .collect();
    assert_eq!(steps, (0..200).collect::<Vec<_>>(), "{out}");
    let (shown, _, _) = cli(&here, &a.url, &["logs", "cut"]);
    assert!(
        !shown.is_empty() && out.starts_with(&shown),
        "the cut-off owner showed what the standby's copy does not:\n{shown}\n---\n{out}"
    );
    drop(cut);
    eventually(
        "the cut-off owner learns that its session was taken over",
        || a.state("cut").as_deref() == Some("moved"),
    );
    let (shown, _, _) = cli(&here, &a.url, &["logs", "cut"]);
    assert!(out.starts_with(&shown));
    finished_once(&[&a, &b], "cut", &b);
}
