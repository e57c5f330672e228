//! `Control::throttle`: a throttled guest is held back to its share of the time — computing
//! (held at the ticks) and sleeping (its sleeps stretch) — ends as it would have, and a
//! request made while it is held is served at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_engine::{Control, EngineKind, Outcome, Request, Runtime, SnapshotMeta, Start};
use ferry_store::MemStore;
use ferry_wasi::{HostClock, WasiCtx};

use crate::every_safe_point::{Buf, stdio};

/// Prints "done\n" (fd_write on fd 1; the module imports it as `$fd_write`).
const DONE: &str = r#"(i32.store (i32.const 100) (i32.const 0x656e6f64))
    (i32.store8 (i32.const 104) (i32.const 10))
    (i32.store (i32.const 0) (i32.const 100))
    (i32.store (i32.const 4) (i32.const 5))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))"#;

/// Counts to `n` in a loop, prints "done", exits.
fn spinner(n: u64) -> Vec<u8> {
    wat::parse_str(format!(
        r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start") (local $i i64)
    (loop $l
      (local.set $i (i64.add (local.get $i) (i64.const 1)))
      (br_if $l (i64.lt_u (local.get $i) (i64.const {n}))))
    {DONE}))"#
    ))
    .unwrap()
}

/// Sleeps 10 ms `n` times (`poll_oneoff` on the monotonic clock), then prints "done".
fn sleeper(n: u32) -> Vec<u8> {
    wat::parse_str(format!(
        r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start") (local $i i32)
    ;; one subscription at 200: a relative clock timeout of 10 ms on the monotonic clock
    (i32.store8 (i32.const 208) (i32.const 0))
    (i32.store (i32.const 216) (i32.const 1))
    (i64.store (i32.const 224) (i64.const 10000000))
    (i64.store (i32.const 232) (i64.const 0))
    (i32.store16 (i32.const 240) (i32.const 0))
    (loop $l
      (drop (call $poll (i32.const 200) (i32.const 300) (i32.const 1) (i32.const 400)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const {n}))))
    {DONE}))"#
    ))
    .unwrap()
}

/// Runs `wasm` on `kind` with `percent` of throttle; `meanwhile` runs beside it. Returns the
/// outcome, what it printed, how long it took, and the control.
fn run(
    kind: EngineKind,
    wasm: &[u8],
    percent: u32,
    meanwhile: impl FnOnce(&Arc<Control>),
) -> (Outcome, String, Duration, Arc<Control>) {
    let rt = Runtime::new(kind, None).unwrap();
    let store = MemStore::new();
    let prepared = rt.prepare(&store, wasm, &|_| {}).unwrap();
    let c = Arc::new(Control::new());
    c.throttle(percent);
    let out = Buf::default();
    let ctx = WasiCtx::new(
        vec!["t".into()],
        vec![],
        vec![],
        stdio(&out),
        Box::new(HostClock::default()),
        c.interrupt(),
    )
    .unwrap();
    let t = Instant::now();
    let outcome = std::thread::scope(|s| {
        let (c2, store, prepared, rt) = (c.clone(), &store, &prepared, &rt);
        let h = std::thread::Builder::new()
            .stack_size(64 << 20)
            .spawn_scoped(s, move || {
                rt.run(
                    prepared,
                    ctx,
                    c2,
                    Start::Fresh,
                    store,
                    SnapshotMeta::fresh("t"),
                    &mut |r, _| {
                        r.unwrap();
                    },
                )
            })
            .unwrap();
        meanwhile(&c);
        h.join().unwrap()
    })
    .unwrap();
    (outcome, out.text(), t.elapsed(), c)
}

/// Iterations that take the engine roughly 300 ms unthrottled here.
fn iterations(kind: EngineKind) -> u64 {
    match kind {
        EngineKind::Jit => 400_000_000,
        EngineKind::Interp => 30_000_000,
    }
}

#[test]
fn a_computing_guest_held_to_a_quarter_of_its_time_is_held_three_quarters_of_its_run() {
    for kind in EngineKind::ALL {
        let wasm = spinner(iterations(kind));
        let (o, out, plain, _) = run(kind, &wasm, 0, |_| {});
        assert!(matches!(o, Outcome::Exited(0)), "{kind}: {o:?}");
        assert_eq!(out, "done\n");
        let (o, out, slow, c) = run(kind, &wasm, 75, |_| {});
        assert!(matches!(o, Outcome::Exited(0)), "{kind}: {o:?}");
        assert_eq!(out, "done\n", "{kind}: the throttled run printed otherwise");
        let ratio = slow.as_secs_f64() / plain.as_secs_f64();
        eprintln!(
            "{kind}: {plain:?} unthrottled, {slow:?} at 75% ({ratio:.2}x), held {:?}",
            c.held()
        );
        // 4x in theory, and more: once held, the guest goes on in its rewind copies (slower
        // than the lean ones in this one-function loop), and each tick unwinds and rewinds it.
        assert!(
            ratio > 2.5,
            "{kind}: {plain:?} unthrottled, {slow:?} at 75%: {ratio:.2}x"
        );
        let held = c.held().as_secs_f64() / slow.as_secs_f64();
        assert!(
            (0.6..0.9).contains(&held),
            "{kind}: held {:?} of {slow:?}",
            c.held()
        );
    }
}

#[test]
fn a_sleeping_guest_held_to_half_of_its_time_sleeps_twice_as_long() {
    for kind in EngineKind::ALL {
        // 30 sleeps of 10 ms.
        let wasm = sleeper(30);
        let (o, out, plain, _) = run(kind, &wasm, 0, |_| {});
        assert!(matches!(o, Outcome::Exited(0)), "{kind}: {o:?}");
        assert_eq!(out, "done\n");
        let (o, out, slow, c) = run(kind, &wasm, 50, |_| {});
        assert!(matches!(o, Outcome::Exited(0)), "{kind}: {o:?}");
        assert_eq!(out, "done\n");
        eprintln!(
            "{kind}: {plain:?} unthrottled, {slow:?} at 50%, held {:?}",
            c.held()
        );
        assert!(
            plain >= Duration::from_millis(300) && slow >= Duration::from_millis(600),
            "{kind}: {plain:?} unthrottled, {slow:?} at 50%"
        );
        assert!(
            c.held() >= Duration::from_millis(290),
            "{kind}: held only {:?}",
            c.held()
        );
    }
}

#[test]
fn a_suspend_asked_while_the_guest_is_held_is_served_at_once_and_lifting_the_throttle_frees_it() {
    for kind in EngineKind::ALL {
        let wasm = spinner(u64::MAX);
        let (o, _, _, c) = run(kind, &wasm, 99, |c| {
            // Held 99% of the time: most requests arrive during a hold.
            std::thread::sleep(Duration::from_millis(300));
            for _ in 0..3 {
                let t = Instant::now();
                c.request(Request::Checkpoint);
                while c.pending() != Request::None {
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert!(
                    t.elapsed() < Duration::from_millis(200),
                    "{kind}: a checkpoint waited {:?}",
                    t.elapsed()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            let before = c.held();
            c.throttle(0);
            std::thread::sleep(Duration::from_millis(200));
            let after = c.held();
            assert!(
                after - before < Duration::from_millis(60),
                "{kind}: still held {:?} after the throttle was lifted",
                after - before
            );
            c.request(Request::Suspend);
        });
        assert!(matches!(o, Outcome::Suspended(_)), "{kind}: {o:?}");
        assert!(c.held() > Duration::from_millis(200), "{kind}");
    }
}
