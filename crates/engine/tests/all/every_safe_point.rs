//! Each WAT program runs once uninterrupted, then once per safe point k: suspended exactly at
//! its k-th safe point, resumed in a fresh instance from the snapshot objects alone (suspended
//! once more on the way), and its output must equal the uninterrupted run's.

use std::io::Write;
use std::sync::{Arc, Mutex};

use ferry_engine::{Control, EngineKind, Outcome, Runtime, SnapshotMeta, Start, snapshot};
use ferry_store::MemStore;
use ferry_wasi::{HostClock, Stdio, WasiCtx};

#[derive(Clone, Default)]
pub(crate) struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Buf {
    /// What was written, as text.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

pub(crate) fn stdio(out: &Buf) -> Stdio {
    Stdio {
        stdin: Box::new(std::io::empty()),
        stdin_fd: None,
        terminals: [false; 3],
        log: None,
        input: None,
        input_log: None,
        stdout: Box::new(out.clone()),
        stderr: Box::new(std::io::sink()),
    }
}

/// Prints the i64 on the stack, in decimal, with a newline (fd_write on fd 1).
const PRELUDE: &str = r#"
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func $print (param $v i64)
    (local $p i32) (local $neg i32)
    (local.set $p (i32.const 1000))
    (i32.store8 (local.get $p) (i32.const 10))
    (if (i64.lt_s (local.get $v) (i64.const 0))
      (then (local.set $neg (i32.const 1)) (local.set $v (i64.sub (i64.const 0) (local.get $v)))))
    (loop $digits
      (local.set $p (i32.sub (local.get $p) (i32.const 1)))
      (i32.store8 (local.get $p) (i32.wrap_i64 (i64.add (i64.const 48) (i64.rem_u (local.get $v) (i64.const 10)))))
      (local.set $v (i64.div_u (local.get $v) (i64.const 10)))
      (br_if $digits (i64.ne (local.get $v) (i64.const 0))))
    (if (local.get $neg) (then
      (local.set $p (i32.sub (local.get $p) (i32.const 1)))
      (i32.store8 (local.get $p) (i32.const 45))))
    (i32.store (i32.const 0) (local.get $p))
    (i32.store (i32.const 4) (i32.sub (i32.const 1001) (local.get $p)))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8))))
"#;

fn module(body: &str) -> Vec<u8> {
    wat::parse_str(format!("(module {PRELUDE} {body})")).unwrap()
}

/// Both engines; each check alternates between them, so every snapshot is also resumed by the
/// engine that did not take it.
struct Harness {
    engines: [Runtime; 2],
    store: MemStore,
}

impl Harness {
    fn new() -> Self {
        Self {
            engines: EngineKind::ALL.map(|k| Runtime::new(k, None).unwrap()),
            store: MemStore::new(),
        }
    }

    /// The JIT twice: for proposals the interpreter lacks (exception handling).
    fn jit_only() -> Self {
        Self {
            engines: [EngineKind::Jit; 2].map(|k| Runtime::new(k, None).unwrap()),
            store: MemStore::new(),
        }
    }

    /// Runs (fresh, or from κ) on engine `e` with an optional countdown; returns the outcome
    /// and output.
    fn run(
        &self,
        e: usize,
        wasm: &[u8],
        from: Option<ferry_kappa::Kappa>,
        countdown: Option<u64>,
    ) -> (Outcome, Vec<u8>) {
        let rt = &self.engines[e % 2];
        let prepared = rt.prepare(&self.store, wasm, &|_| {}).unwrap();
        let out = Buf::default();
        let c = Arc::new(Control::new());
        if let Some(n) = countdown {
            c.suspend_at_safe_point(n);
        }
        let (ctx, start, generation) = match from {
            None => (
                WasiCtx::new(
                    vec!["t".into()],
                    vec![],
                    vec![],
                    stdio(&out),
                    Box::new(HostClock::default()),
                    c.interrupt(),
                )
                .unwrap(),
                Start::Fresh,
                0,
            ),
            Some(k) => {
                let loaded = snapshot::load(&self.store, k).unwrap();
                let ctx = WasiCtx::restore(
                    &loaded.wasi,
                    vec![],
                    stdio(&out),
                    Box::new(HostClock::default()),
                    c.interrupt(),
                    &self.store,
                )
                .unwrap();
                let g = loaded.snapshot.generation;
                (ctx, Start::Restore(Box::new(loaded)), g)
            }
        };
        let meta = SnapshotMeta {
            program: "t".into(),
            parent: from,
            generation,
            main: None,
        };
        let outcome = std::thread::scope(|s| {
            std::thread::Builder::new()
                .stack_size(64 << 20)
                .spawn_scoped(s, || {
                    rt.run(&prepared, ctx, c, start, &self.store, meta, &mut |r, _| {
                        r.unwrap();
                    })
                })
                .unwrap()
                .join()
                .unwrap()
        })
        .unwrap();
        let bytes = out.0.lock().unwrap().clone();
        (outcome, bytes)
    }

    /// A module printing 0 to 4, and its snapshot at its second safe point.
    fn counter_at_its_second_safe_point(&self) -> (Vec<u8>, ferry_kappa::Kappa) {
        let wasm = module(
            r#"
      (func (export "_start") (local $i i32)
        (loop $l
          (call $print (i64.extend_i32_u (local.get $i)))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $l (i32.lt_u (local.get $i) (i32.const 5)))))
    "#,
        );
        let (Outcome::Suspended(k), _) = self.run(0, &wasm, None, Some(2)) else {
            panic!("not suspended")
        };
        (wasm, k)
    }

    /// The check described in the module doc, for every safe point (or every `step`-th).
    fn check_every_point(&self, wasm: &[u8], step: u64) -> u64 {
        let (outcome, expected) = self.run(0, wasm, None, None);
        assert_eq!(outcome, Outcome::Exited(0));
        assert!(!expected.is_empty());
        let (outcome, other) = self.run(1, wasm, None, None);
        assert_eq!(outcome, Outcome::Exited(0));
        assert_eq!(other, expected, "the two engines disagree");
        let mut k = 1;
        loop {
            // Start on either engine, resume on the other, finish on the first.
            let e = k as usize;
            let (first, mut seen) = self.run(e, wasm, None, Some(k));
            let Outcome::Suspended(snap) = first else {
                assert_eq!(
                    seen, expected,
                    "run with countdown {k} that never suspended"
                );
                return k - 1;
            };
            let (second, more) = self.run(e + 1, wasm, Some(snap), Some(k % 5 + 1));
            seen.extend(more);
            let last = match second {
                Outcome::Suspended(s2) => {
                    let (third, rest) = self.run(e, wasm, Some(s2), None);
                    seen.extend(rest);
                    third
                }
                done => done,
            };
            assert_eq!(last, Outcome::Exited(0), "safe point {k}");
            assert_eq!(
                String::from_utf8_lossy(&seen),
                String::from_utf8_lossy(&expected),
                "suspended at safe point {k}"
            );
            k += step;
        }
    }
}

#[test]
fn values_of_every_type_on_the_operand_stack_across_calls() {
    let wasm = module(
        r#"
      (func $work (param $n i32) (result i32)
        (local $i i32)
        (loop $l
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $l (i32.lt_u (local.get $i) (local.get $n))))
        (local.get $i))
      (func (export "_start")
        (local $k i32)
        (loop $outer
          (call $print
            (i64.add
              (i64.const 1000000000000)
              (i64.add
                (i64.trunc_f64_s (f64.mul (f64.const 1.5) (f64.convert_i32_s (call $work (i32.const 3)))))
                (i64.extend_i32_s
                  (i32.add (i32.trunc_f32_s (f32.const 7.25)) (call $work (local.get $k)))))))
          (local.set $k (i32.add (local.get $k) (i32.const 1)))
          (br_if $outer (i32.lt_u (local.get $k) (i32.const 6)))))
    "#,
    );
    let points = Harness::new().check_every_point(&wasm, 1);
    assert!(points > 20, "only {points} safe points exercised");
}

#[test]
fn multi_value_blocks_and_loops_with_parameters() {
    let wasm = module(
        r#"
      (type $ii_i (func (param i32 i64) (result i64)))
      (func $id (param i64) (result i64) (local $j i32)
        (loop $l (local.set $j (i32.add (local.get $j) (i32.const 1))) (br_if $l (i32.lt_u (local.get $j) (i32.const 2))))
        (local.get 0))
      (func (export "_start") (local $t i64) (local $n i32)
        (call $print
          (i32.const 5) (i64.const 40)
          (block (type $ii_i)
            (loop $l (param i32 i64) (result i64)
              (call $id)
              (local.set $t)
              (local.set $n)
              (i32.sub (local.get $n) (i32.const 1))
              (i64.add (local.get $t) (call $id (i64.extend_i32_u (local.get $n))))
              (br_if $l (i32.gt_u (local.get $n) (i32.const 1)))
              (local.set $t)
              (drop)
              (local.get $t)))))
      (func $pair (param $x i64) (result i64 i64) (local.get $x) (call $id (i64.add (local.get $x) (i64.const 1))))
      (func $both (local $i i64)
        (loop $l
          (call $pair (local.get $i))
          (i64.add)
          (call $print)
          (local.set $i (i64.add (local.get $i) (i64.const 1)))
          (br_if $l (i64.lt_u (local.get $i) (i64.const 4)))))
      (start $both)
    "#,
    );
    Harness::new().check_every_point(&wasm, 1);
}

#[test]
fn calls_in_if_arms_br_table_and_dead_code() {
    let wasm = module(
        r#"
      (func $f (param $x i64) (result i64) (local $i i32)
        (loop $l (local.set $i (i32.add (local.get $i) (i32.const 1))) (br_if $l (i32.lt_u (local.get $i) (i32.const 2))))
        (i64.mul (local.get $x) (i64.const 3)))
      (func $classify (param $x i32) (result i64)
        (block $d (block $c (block $b (block $a
          (br_table $a $b $c $d (i32.rem_u (local.get $x) (i32.const 4))))
          (return (call $f (i64.const 1))))
          (return (i64.add (call $f (i64.const 2)) (call $f (i64.const 10)))))
          (if (result i64) (i32.and (local.get $x) (i32.const 8))
            (then (call $f (i64.extend_i32_u (local.get $x))))
            (else (i64.sub (i64.const 0) (call $f (i64.const 7)))))
          (return))
        (call $f (i64.const 100))
        (return)
        (call $f (i64.const 999))
        (drop)
        (i64.const 0))
      (func (export "_start") (local $i i32)
        (loop $l
          (call $print (call $classify (local.get $i)))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $l (i32.lt_u (local.get $i) (i32.const 12)))))
    "#,
    );
    Harness::new().check_every_point(&wasm, 1);
}

#[test]
fn indirect_calls_recursion_globals_memory_growth_and_v128() {
    let wasm = module(
        r#"
      (type $t (func (param i64) (result i64)))
      (table 3 funcref)
      (elem (i32.const 0) $double $fib $square)
      (global $acc (mut i64) (i64.const 0))
      (global $f (mut f64) (f64.const 0.5))
      (func $double (type $t) (i64.mul (local.get 0) (i64.const 2)))
      (func $square (type $t) (i64.mul (local.get 0) (local.get 0)))
      (func $fib (type $t)
        (if (result i64) (i64.lt_u (local.get 0) (i64.const 2))
          (then (local.get 0))
          (else (i64.add (call $fib (i64.sub (local.get 0) (i64.const 1)))
                         (call $fib (i64.sub (local.get 0) (i64.const 2)))))))
      (func (export "_start") (local $i i32) (local $v v128)
        (local.set $v (v128.const i64x2 7 9))
        (loop $l
          (global.set $acc (i64.add (global.get $acc)
            (call_indirect (type $t) (i64.extend_i32_u (i32.add (local.get $i) (i32.const 8))) (i32.rem_u (local.get $i) (i32.const 3)))))
          (global.set $f (f64.mul (global.get $f) (f64.const 1.5)))
          (local.set $v (i64x2.add (local.get $v) (i64x2.splat (call $double (i64.const 1)))))
          (drop (memory.grow (i32.const 1)))
          (i64.store (i32.mul (memory.size) (i32.const 65528)) (global.get $acc))
          (call $print (i64.load (i32.mul (memory.size) (i32.const 65528))))
          (call $print (i64.add (i64x2.extract_lane 0 (local.get $v)) (i64x2.extract_lane 1 (local.get $v))))
          (call $print (i64.trunc_f64_s (global.get $f)))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $l (i32.lt_u (local.get $i) (i32.const 9)))))
    "#,
    );
    Harness::new().check_every_point(&wasm, 3);
}

#[test]
fn a_snapshot_needing_an_engine_class_no_engine_has_is_refused_by_each() {
    use ferry_store::Store;
    let h = Harness::new();
    let (wasm, k) = h.counter_at_its_second_safe_point();
    // The same snapshot, asking for a class no engine provides.
    let mut snap: ferry_object::Snapshot = ferry_object::decode(&h.store.get(&k).unwrap()).unwrap();
    snap.profile.engine_class = "wasm-core-3+gc".into();
    let k2 = h.store.put(&ferry_object::encode(&snap)).unwrap();
    for rt in &h.engines {
        let loaded = snapshot::load(&h.store, k2).unwrap();
        let prepared = rt.prepare(&h.store, &wasm, &|_| {}).unwrap();
        let c = Arc::new(Control::new());
        let ctx = WasiCtx::restore(
            &loaded.wasi,
            vec![],
            stdio(&Buf::default()),
            Box::new(HostClock::default()),
            c.interrupt(),
            &h.store,
        )
        .unwrap();
        let meta = SnapshotMeta {
            program: "t".into(),
            parent: Some(k2),
            generation: 1,
            main: None,
        };
        let err = rt
            .run(
                &prepared,
                ctx,
                c,
                Start::Restore(Box::new(loaded)),
                &h.store,
                meta,
                &mut |_, _| {},
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "resume refused while admitting: the snapshot needs engine class `wasm-core-3+gc`"
            ),
            "{err}"
        );
    }
}

/// Exceptions thrown through instrumented frames, caught with and without payloads, and
/// rethrown after cleanup code that loops and prints while the `exnref` is held — in a local
/// or on the operand stack. A frame holding one cannot be saved: a suspend requested inside
/// the cleanup is deferred (the unwind bounces) until the exception has left it.
#[test]
fn exceptions_caught_rethrown_and_held_across_safe_points() {
    let wasm = module(
        r#"
      (tag $e (param i64))
      (func $work (param $n i64) (result i64)
        (local $i i64) (local $acc i64)
        (loop $l
          (local.set $acc (i64.add (local.get $acc) (local.get $i)))
          (local.set $i (i64.add (local.get $i) (i64.const 1)))
          (br_if $l (i64.lt_u (local.get $i) (local.get $n))))
        (if (i64.eqz (i64.rem_u (local.get $n) (i64.const 3)))
          (then (throw $e (local.get $acc))))
        (local.get $acc))
      (func $cleanup (param $n i64)
        (local $i i64)
        (loop $l
          (call $print (i64.add (i64.const 1000) (local.get $i)))
          (local.set $i (i64.add (local.get $i) (i64.const 1)))
          (br_if $l (i64.lt_u (local.get $i) (local.get $n)))))
      ;; the exnref in a local while cleaning up
      (func $guarded (param $n i64) (result i64)
        (local $x exnref)
        (block $ok (result i64)
          (local.set $x
            (block $h (result exnref)
              (try_table (result i64) (catch_all_ref $h)
                (call $work (local.get $n)))
              (br $ok)))
          (call $cleanup (i64.const 3))
          (throw_ref (local.get $x))))
      ;; the exnref on the operand stack while cleaning up
      (func $guarded2 (param $n i64) (result i64)
        (block $ok (result i64)
          (block $h (result exnref)
            (try_table (result i64) (catch_all_ref $h)
              (call $work (local.get $n)))
            (br $ok))
          (call $cleanup (i64.const 2))
          (throw_ref)))
      (func (export "_start") (local $i i64) (local $sum i64)
        (loop $l
          (block $next
            (call $print
              (i64.sub (i64.const 0)
                (block $c (result i64)
                  (try_table (catch $e $c)
                    (local.set $sum (i64.add (local.get $sum)
                      (if (result i64) (i32.wrap_i64 (i64.rem_u (local.get $i) (i64.const 2)))
                        (then (call $guarded2 (local.get $i)))
                        (else (call $guarded (local.get $i))))))
                    (call $print (local.get $sum)))
                  (br $next)))))
          (local.set $i (i64.add (local.get $i) (i64.const 1)))
          (br_if $l (i64.lt_u (local.get $i) (i64.const 10)))))
    "#,
    );
    let points = Harness::jit_only().check_every_point(&wasm, 1);
    assert!(points > 50, "only {points} safe points exercised");
}

/// The content of a file the guest held open after no path named it
/// (`FdState::unnamed`) belongs to the snapshot: its closure (what gc keeps, what push, pull
/// and capsules move) holds it, and a resume without it is refused before anything runs.
#[test]
fn a_file_deleted_while_open_is_part_of_the_snapshot() {
    use ferry_store::Store;
    let h = Harness::jit_only();
    let (_, k) = h.counter_at_its_second_safe_point();
    let file = tempfile::tempfile().unwrap();
    file.set_len(3 << 20).unwrap(); // over 1 MiB: stored in pieces, behind a `ferry.file`
    std::os::unix::fs::FileExt::write_all_at(&file, b"scratch", 1 << 20).unwrap();
    let content = ferry_wasi::tree::import_unnamed(&h.store, &file, "scratch").unwrap();
    let mut snap: ferry_object::Snapshot = ferry_object::decode(&h.store.get(&k).unwrap()).unwrap();
    let mut wasi: ferry_object::WasiState =
        ferry_object::decode(&h.store.get(&snap.wasi).unwrap()).unwrap();
    let fd = |unnamed| ferry_object::FdState {
        what: "file".into(),
        mount: 0,
        path: "scratch".into(),
        offset: 7,
        fdflags: 0,
        read: true,
        write: true,
        unnamed,
    };
    wasi.fds.push((9, fd(Some(content))));
    snap.wasi = h.store.put(&ferry_object::encode(&wasi)).unwrap();
    let k2 = h.store.put(&ferry_object::encode(&snap)).unwrap();

    let mut closure = std::collections::BTreeSet::new();
    ferry_engine::closure::snapshot_closure(&h.store, &k2, false, &mut closure).unwrap();
    let tree: ferry_object::Tree = ferry_object::decode(&h.store.get(&content).unwrap()).unwrap();
    let pieces = tree.entries[ferry_object::UNNAMED_ENTRY].object;
    let chunks: ferry_object::FileChunks =
        ferry_object::decode(&h.store.get(&pieces).unwrap()).unwrap();
    assert_eq!(chunks.len, 3 << 20);
    for needed in [content, pieces, chunks.chunks[1]] {
        assert!(closure.contains(&needed), "{needed} not in the closure");
    }
    snapshot::load(&h.store, k2).unwrap();
    h.store.remove(&chunks.chunks[1]).unwrap();
    let refused = snapshot::load(&h.store, k2).unwrap_err().to_string();
    assert!(refused.contains(&chunks.chunks[1].to_string()), "{refused}");
}
