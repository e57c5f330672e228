//! Differential test: generated modules behave the same, plain and instrumented, in wasmtime —
//! also when unwound at every safe point (or every third) and rewound at once. Every exported
//! function is called with default arguments; results, traps and the final contents of
//! memories and globals must match. (ferry-engine's tests cover suspension with a full host;
//! this covers code nobody here wrote.)

use wasmtime::{Caller, Config, Engine, Extern, Global, Instance, Linker, Module, Store, Val};

use crate::tests::digest;
use crate::{abi, instrument_any, instrument_any_counting};

/// The generator settings of `tests.rs` (the exception-handling proposal included), plus
/// exports of everything, canonical NaNs and no traps (so generated functions run long enough
/// to reach safe points).
fn config() -> wasm_smith::Config {
    wasm_smith::Config {
        export_everything: true,
        canonicalize_nans: true,
        disallow_traps: true,
        ..crate::tests::config()
    }
}

/// A value as the comparison sees it: references only as null or not (their handles differ
/// between instances).
fn show(v: &Val) -> String {
    match v {
        Val::ExnRef(r) => format!("exnref non-null: {}", r.is_some()),
        Val::FuncRef(r) => format!("funcref non-null: {}", r.is_some()),
        Val::ExternRef(r) => format!("externref non-null: {}", r.is_some()),
        Val::AnyRef(r) => format!("anyref non-null: {}", r.is_some()),
        other => format!("{other:?}"),
    }
}

#[derive(Debug, PartialEq)]
enum Outcome {
    Values(Vec<String>),
    Trap,
    OutOfFuel,
    /// Unbounded recursion: where the stack runs out depends on frame sizes, which the
    /// transform changes, so what ran before it (global and memory writes) is not comparable.
    StackOverflow,
}

/// Whether every call of a run finished without running out of fuel or stack (instrumented
/// code burns more of both, so only such runs are compared).
fn finished(outcomes: &[Outcome]) -> bool {
    outcomes
        .iter()
        .all(|o| !matches!(o, Outcome::OutOfFuel | Outcome::StackOverflow))
}

/// How safe points are treated.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// The original module.
    Plain,
    /// Instrumented, never suspended.
    Instrumented,
    /// The counting build, unwound at every `n`-th safe point (the host counts) and rewound
    /// at once (same instance).
    Churn(u64),
    /// The ordinary build with its flag always raised: each lean safe point unwinds by itself,
    /// and is rewound at once.
    ChurnLean,
}

fn global(caller: &mut Caller<'_, u64>, name: &str) -> Global {
    caller
        .get_export(name)
        .and_then(Extern::into_global)
        .expect("ferry global")
}

/// The host side of `ferry.poll` for [`Mode::Churn`].
fn churn_poll(mut caller: Caller<'_, u64>, n: u64) -> wasmtime::Result<()> {
    let state = global(&mut caller, abi::STATE_GLOBAL);
    if state.get(&mut caller).unwrap_i32() == abi::STATE_REWIND {
        let sp = global(&mut caller, abi::SP_GLOBAL)
            .get(&mut caller)
            .unwrap_i32();
        assert_eq!(sp, 0, "rewind ended with frames left over");
        state.set(&mut caller, Val::I32(abi::STATE_NORMAL))?;
        return Ok(());
    }
    *caller.data_mut() += 1;
    if caller.data().is_multiple_of(n) {
        state.set(&mut caller, Val::I32(abi::STATE_UNWIND))?;
        global(&mut caller, abi::SP_GLOBAL).set(&mut caller, Val::I32(0))?;
    }
    Ok(())
}

/// Calls every exported function; returns each outcome and the final state.
fn run(engine: &Engine, wasm: &[u8], mode: Mode) -> Option<(Vec<Outcome>, Vec<String>, u64)> {
    let module = Module::new(engine, wasm).ok()?;
    let mut store = Store::new(engine, 0u64);
    let mut linker = Linker::new(engine);
    match mode {
        Mode::Plain => {}
        Mode::Instrumented => {
            linker.func_wrap(abi::MODULE, abi::POLL, || {}).ok()?;
        }
        Mode::ChurnLean => {
            linker
                .func_wrap(abi::MODULE, abi::POLL, |c: Caller<'_, u64>| {
                    churn_poll(c, 1)
                })
                .ok()?;
        }
        Mode::Churn(n) => {
            linker
                .func_wrap(abi::MODULE, abi::POLL, move |c: Caller<'_, u64>| {
                    churn_poll(c, n)
                })
                .ok()?;
        }
    }
    store.set_fuel(2_000_000).ok()?;
    let instance: Instance = linker.instantiate(&mut store, &module).ok()?;
    // Churn: the flag raised for good (raised again before each rewind, in case an unwind
    // path lowered it).
    let ctl = instance.get_memory(&mut store, abi::CTL_MEMORY);
    let arm = |store: &mut Store<u64>| {
        if let (Mode::Churn(_) | Mode::ChurnLean, Some(ctl)) = (mode, ctl) {
            ctl.data_mut(store)[..4].copy_from_slice(&1u32.to_le_bytes());
        }
    };
    arm(&mut store);
    let exports: Vec<(String, bool)> = module
        .exports()
        .map(|e| {
            (
                e.name().to_owned(),
                matches!(e.ty(), wasmtime::ExternType::Func(_)),
            )
        })
        .filter(|(n, _)| !n.starts_with("ferry:"))
        .collect();
    let state_global = instance.get_global(&mut store, abi::STATE_GLOBAL);
    let mut outcomes = Vec::new();
    // The plain module ran its start function while instantiating; the instrumented one
    // exports it as `ferry:start`, which the host calls first (its outcome is not compared:
    // a trap there fails the plain instantiation, and then nothing is compared).
    let start = (mode != Mode::Plain && instance.get_func(&mut store, abi::START_EXPORT).is_some())
        .then(|| (abi::START_EXPORT.to_owned(), true));
    for (name, _) in start.iter().chain(exports.iter().filter(|(_, f)| *f)) {
        let f = instance.get_func(&mut store, name)?;
        let ty = f.ty(&store);
        let args: Vec<Val> = ty
            .params()
            .map(|t| Val::default_for_ty(&t).unwrap_or(Val::I32(0)))
            .collect();
        let mut results: Vec<Val> = ty
            .results()
            .map(|t| Val::default_for_ty(&t).unwrap_or(Val::I32(0)))
            .collect();
        store.set_fuel(2_000_000).ok()?;
        let mut call = f;
        let outcome = loop {
            let r = call.call(&mut store, &args, &mut results);
            // Unwound: rewind at once through the rewind copy, as a resume would.
            if let (Ok(()), Some(g)) = (&r, state_global)
                && g.get(&mut store).unwrap_i32() == abi::STATE_UNWIND
            {
                *store.data_mut() += 1;
                arm(&mut store);
                g.set(&mut store, Val::I32(abi::STATE_REWIND)).ok()?;
                call = instance.get_func(&mut store, &abi::rewind_export(name))?;
                continue;
            }
            break match r {
                Ok(()) => Outcome::Values(results.iter().map(show).collect()),
                Err(e) => match e.downcast_ref::<wasmtime::Trap>() {
                    Some(wasmtime::Trap::OutOfFuel) => Outcome::OutOfFuel,
                    Some(wasmtime::Trap::StackOverflow) => Outcome::StackOverflow,
                    _ => Outcome::Trap,
                },
            };
        };
        if !matches!(outcome, Outcome::Values(_)) {
            // A trap ends a real guest; here the next export still runs on this instance, so
            // clear an unwind or rewind the trap interrupted.
            if let Some(g) = state_global {
                g.set(&mut store, Val::I32(abi::STATE_NORMAL)).ok()?;
                instance
                    .get_global(&mut store, abi::SP_GLOBAL)?
                    .set(&mut store, Val::I32(0))
                    .ok()?;
            }
        }
        if *name != abi::START_EXPORT {
            outcomes.push(outcome);
        }
    }
    let mut state = Vec::new();
    for (name, _) in exports.iter().filter(|(_, f)| !*f) {
        match instance.get_export(&mut store, name) {
            Some(Extern::Memory(m)) => state.push(format!("{name}: {}", digest(m.data(&store)))),
            Some(Extern::Global(g)) => state.push(format!("{name}: {}", show(&g.get(&mut store)))),
            _ => {}
        }
    }
    let polls = *store.data();
    Some((outcomes, state, polls))
}

#[test]
fn generated_modules_behave_the_same_instrumented_and_churned() {
    let mut cfg = Config::new();
    cfg.consume_fuel(true)
        .wasm_multi_memory(true)
        .wasm_exceptions(true);
    let engine = Engine::new(&cfg).unwrap();
    let (mut compared, mut total, mut unwinds, mut with_handlers) = (0, 0, 0, 0);
    // A soak (scripts/fuzz.sh): FERRY_DIFFERENTIAL_MODULES generated modules from
    // FERRY_DIFFERENTIAL_SEED instead of the 60 of every test run.
    let (start, count) = crate::tests::soak("FERRY_DIFFERENTIAL", 0x1234_5678_9abc_def1, 60);
    for seed in crate::tests::seeds(start, count, 4096) {
        let mut u = arbitrary::Unstructured::new(&seed);
        let Ok(m) = wasm_smith::Module::new(config(), &mut u) else {
            continue;
        };
        let wasm = m.to_bytes();
        let (Ok(out), Ok(counting)) = (instrument_any(&wasm), instrument_any_counting(&wasm))
        else {
            continue;
        };
        total += 1;
        let Some((plain, plain_state, _)) = run(&engine, &wasm, Mode::Plain) else {
            continue;
        };
        let runs = [
            Mode::Instrumented,
            Mode::ChurnLean,
            Mode::Churn(1),
            Mode::Churn(3),
        ]
        .map(|m| {
            let build = if matches!(m, Mode::Churn(_)) {
                &counting.wasm
            } else {
                &out.wasm
            };
            (m, run(&engine, build, m))
        });
        // Compare runs that finished everywhere.
        if !finished(&plain)
            || runs
                .iter()
                .any(|(_, r)| r.as_ref().is_none_or(|(o, _, _)| !finished(o)))
        {
            continue;
        }
        compared += 1;
        if wasmprinter::print_bytes(&wasm).is_ok_and(|t| t.contains("try_table")) {
            with_handlers += 1;
        }
        for (mode, r) in runs {
            let (outcomes, state, polls) = r.expect("checked above");
            if mode == Mode::Churn(1) {
                unwinds += polls;
            }
            let wat = || wasmprinter::print_bytes(&wasm).unwrap_or_default();
            assert_eq!(plain, outcomes, "{mode:?}: results differ\n{}", wat());
            assert_eq!(plain_state, state, "{mode:?}: state differs\n{}", wat());
        }
    }
    eprintln!(
        "compared {compared} of {total} instrumented modules ({with_handlers} with try_table); \
         {unwinds} unwinds"
    );
    // About a quarter of them do (24.8% to 27% over the seeds tried); a fifth is the floor.
    assert!(
        with_handlers * 5 >= compared,
        "too few compared modules catch exceptions ({with_handlers} of {compared})"
    );
    assert!(
        unwinds > 15,
        "the churned runs barely suspended ({unwinds} unwinds)"
    );
    assert!(
        compared * 3 >= total,
        "only {compared} of {total} modules compared"
    );
}

/// Return polls (v14) on hand-written recursion — direct, through the table (the call's
/// table index must survive the unwind), and both mixed — unwound at every safe point in
/// the ordinary and the counting build, compared with the plain run.
#[test]
fn recursion_unwound_at_every_return_behaves_the_same() {
    let wasm = wat::parse_str(
        r#"(module
             (type $t (func (param i32) (result i32)))
             (table 2 funcref)
             (elem (i32.const 0) $dir $ind)
             (global $g (mut i32) (i32.const 0))
             (func $ind (type $t)
               (global.set $g (i32.add (global.get $g) (i32.const 1)))
               (if (result i32) (i32.lt_u (local.get 0) (i32.const 2))
                 (then (local.get 0))
                 (else (i32.add
                         (i32.add (i32.const 3)
                           (call_indirect (type $t) (i32.sub (local.get 0) (i32.const 1))
                                          (i32.const 1)))
                         (call_indirect (type $t) (i32.sub (local.get 0) (i32.const 2))
                                        (i32.and (local.get 0) (i32.const 1)))))))
             (func $dir (type $t)
               (if (result i32) (i32.lt_u (local.get 0) (i32.const 2))
                 (then (local.get 0))
                 (else (i32.add (call $dir (i32.sub (local.get 0) (i32.const 1)))
                                (i32.mul (i32.const 3)
                                  (call $dir (i32.sub (local.get 0) (i32.const 2))))))))
             (func (export "ind") (result i32) (call $ind (i32.const 12)))
             (func (export "dir") (result i32) (call $dir (i32.const 12)))
             (export "g" (global $g)))"#,
    )
    .unwrap();
    let out = instrument_any(&wasm).unwrap();
    assert_eq!(
        out.stats.entry_polls, 0,
        "every call in the cycle polls on return"
    );
    churned_like_plain(&wasm, 2, 41);
}

/// Runs `wasm` plain, then instrumented and unwound at every safe point (the ordinary build,
/// and the counting build) and at every `nth` one (the counting build): the outcomes and the
/// final state must be the plain run's, each churned run unwinding at least `min_unwinds`
/// times. Returns the plain outcomes.
fn churned_like_plain(wasm: &[u8], nth: u64, min_unwinds: u64) -> Vec<Outcome> {
    let mut cfg = Config::new();
    cfg.consume_fuel(true).wasm_multi_memory(true);
    let engine = Engine::new(&cfg).unwrap();
    let out = instrument_any(wasm).unwrap();
    let counting = instrument_any_counting(wasm).unwrap();
    let (plain, plain_state, _) = run(&engine, wasm, Mode::Plain).unwrap();
    for (mode, build) in [
        (Mode::ChurnLean, &out.wasm),
        (Mode::Churn(1), &counting.wasm),
        (Mode::Churn(nth), &counting.wasm),
    ] {
        let (outcomes, state, unwinds) = run(&engine, build, mode).unwrap();
        assert_eq!(plain, outcomes, "{mode:?}");
        assert_eq!(plain_state, state, "{mode:?}");
        assert!(unwinds >= min_unwinds, "{mode:?}: only {unwinds} unwinds");
    }
    plain
}

/// Counted leaf loops (v15): short ones run unpolled, long ones still poll at every
/// iteration; both — a `do … while (++i != n)`, a loop carrying a value through its
/// parameter, a `while (i < n)` leaving through a branch out — give the plain module's
/// results also when unwound at every poll.
#[test]
fn counted_loops_poll_only_when_they_run_long() {
    // 256 `nop`s: the loops' budget is then 2^18 / ~270 ≈ 970 iterations.
    let pad = "(nop)".repeat(256);
    let module = |n: u32| {
        wat::parse_str(format!(
            r#"(module
                 (memory (export "mem") 1)
                 (func $fill (param $p i32) (param $n i32) (local $i i32)
                   (loop {pad}
                     (i32.store8 (i32.add (local.get $p) (local.get $i)) (local.get $i))
                     (br_if 0 (i32.ne (local.tee $i (i32.add (local.get $i) (i32.const 1)))
                                      (local.get $n)))))
                 (func $sum (param $n i32) (result i32) (local $i i32)
                   (i32.const 7)
                   (loop (param i32) (result i32) {pad}
                     (i32.add (local.get $i))
                     (local.set $i (i32.add (local.get $i) (i32.const 1)))
                     (br_if 0 (i32.lt_u (local.get $i) (local.get $n)))))
                 (func $count (param $n i32) (result i32) (local $i i32) (local $odd i32)
                   (block
                     (loop {pad}
                       (br_if 1 (i32.ge_u (local.get $i) (local.get $n)))
                       (local.set $odd (i32.add (local.get $odd) (i32.and (local.get $i) (i32.const 1))))
                       (local.set $i (i32.add (local.get $i) (i32.const 1)))
                       (br 0)))
                   (local.get $odd))
                 (func (export "count") (result i32) (call $count (i32.const {n})))
                 (func (export "fill") (call $fill (i32.const 16) (i32.const {n})))
                 (func (export "sum") (result i32) (call $sum (i32.const {n}))))"#
        ))
        .unwrap()
    };
    let mut cfg = Config::new();
    cfg.consume_fuel(true).wasm_multi_memory(true);
    let engine = Engine::new(&cfg).unwrap();
    for (n, long) in [(100, false), (960, false), (3_000, true)] {
        let wasm = module(n);
        let out = instrument_any(&wasm).unwrap();
        let counting = instrument_any_counting(&wasm).unwrap();
        assert_eq!(out.stats.counted_loops, 3);
        let (plain, plain_state, _) = run(&engine, &wasm, Mode::Plain).unwrap();
        assert!(plain.iter().all(|o| matches!(o, Outcome::Values(_))));
        assert_eq!(plain.len(), 3);
        for (mode, build) in [
            (Mode::Instrumented, &out.wasm),
            (Mode::ChurnLean, &out.wasm),
            (Mode::Churn(1), &counting.wasm),
        ] {
            let (outcomes, state, polls) = run(&engine, build, mode).unwrap();
            assert_eq!(plain, outcomes, "n={n} {mode:?}");
            assert_eq!(plain_state, state, "n={n} {mode:?}");
            match (mode, long) {
                (Mode::Instrumented, _) => {}
                // Each poll unwinds and is counted, and so is each rewind.
                (_, true) => assert!(polls >= 2 * u64::from(n), "n={n} {mode:?}: {polls}"),
                (_, false) => assert_eq!(polls, 0, "n={n} {mode:?}: the short loops polled"),
            }
        }
    }
}

/// Counted loops holding loops (v18): the outer loop's unpolled copy polls only on the inner
/// loops' ways back — conditional or not, from an inner loop's top level or from a block
/// inside it — and on entry to an inner counted loop whose own guard passes (it then runs
/// unpolled); the rewind resumes at the inner loop's header in the polled loop. An inner
/// loop that leaves in its first iteration polls nowhere. Results and memory are the plain
/// module's in every mode.
#[test]
fn counted_loops_holding_loops_poll_on_the_inner_ways_back() {
    // `scan`: for i in 0..n: walk bytes from 16 + i while j < mem[8] (loop A, data-dependent:
    // not counted; `br_if` back), count `j` down from `m` through a block (loop B: `br` back
    // from inside a block), then — with `counted` — for k in 0..c (loop C, a counted leaf,
    // padded so that its own budget is ~250 iterations).
    let module = |n: u32, m: u32, c: Option<u32>| {
        let inner_c = match c {
            Some(c) => format!(
                r#"(local.set $k (i32.const 0))
                   (loop {pad}
                     (local.set $acc (i32.add (i32.mul (local.get $acc) (i32.const 31)) (local.get $k)))
                     (br_if 0 (i32.lt_u (local.tee $k (i32.add (local.get $k) (i32.const 1)))
                                        (i32.const {c}))))"#,
                pad = "(nop)".repeat(1000)
            ),
            None => String::new(),
        };
        wat::parse_str(format!(
            r#"(module
                 (memory (export "mem") 1)
                 (func $scan (param $n i32) (param $m i32) (result i32)
                   (local $i i32) (local $j i32) (local $k i32) (local $acc i32)
                   (i32.store8 (i32.const 8) (local.get $m))
                   (loop {pad}
                     (local.set $j (i32.const 0))
                     (loop
                       (i32.store8 (i32.add (i32.const 16) (i32.add (local.get $i) (local.get $j)))
                                   (i32.add (local.get $acc) (local.get $j)))
                       (local.set $acc (i32.add (local.get $acc) (i32.const 3)))
                       (br_if 0 (i32.lt_u (local.tee $j (i32.add (local.get $j) (i32.const 1)))
                                          (i32.load8_u (i32.const 8)))))
                     (local.set $j (local.get $m))
                     (loop
                       (block
                         (br_if 0 (i32.eqz (local.get $j)))
                         (local.set $acc (i32.xor (local.get $acc) (local.get $j)))
                         (local.set $j (i32.sub (local.get $j) (i32.const 1)))
                         (br 1)))
                     {inner_c}
                     (br_if 0 (i32.ne (local.tee $i (i32.add (local.get $i) (i32.const 1)))
                                      (local.get $n))))
                   (local.get $acc))
                 (func (export "scan") (result i32) (call $scan (i32.const {n}) (i32.const {m}))))"#,
            pad = "(nop)".repeat(64)
        ))
        .unwrap()
    };
    let mut cfg = Config::new();
    cfg.consume_fuel(true).wasm_multi_memory(true);
    let engine = Engine::new(&cfg).unwrap();
    // (n, m, loop C's count): C within its budget (guarded, unpolled) or beyond it.
    for (n, m, c) in [
        (50, 0, None),
        (50, 7, None),
        (120, 12, None),
        (3, 0, Some(20)),
        (3, 2, Some(300)),
    ] {
        let wasm = module(n, m, c);
        let out = instrument_any(&wasm).unwrap();
        let counting = instrument_any_counting(&wasm).unwrap();
        assert_eq!(
            out.stats.counted_loops,
            1 + u32::from(c.is_some()),
            "the outer loop (and loop C)"
        );
        let (plain, plain_state, _) = run(&engine, &wasm, Mode::Plain).unwrap();
        assert!(matches!(plain[..], [Outcome::Values(_)]), "{plain:?}");
        for (mode, build) in [
            (Mode::Instrumented, &out.wasm),
            (Mode::ChurnLean, &out.wasm),
            (Mode::Churn(1), &counting.wasm),
            (Mode::Churn(3), &counting.wasm),
        ] {
            let (outcomes, state, polls) = run(&engine, build, mode).unwrap();
            let at = format!("n={n} m={m} c={c:?} {mode:?}");
            assert_eq!(plain, outcomes, "{at}");
            assert_eq!(plain_state, state, "{at}");
            if mode == Mode::ChurnLean {
                // With m = 0 and no loop C nothing goes back: the copy runs unpolled.
                // Otherwise the first poll unwinds and rewinds into the polled loop, which
                // polls at every header from then on.
                match (m, c) {
                    (0, None) => assert_eq!(polls, 0, "{at}"),
                    _ => assert!(polls >= 2 * u64::from(n - 1), "{at}: {polls}"),
                }
            }
        }
    }
}

/// `n` live `i64` locals (1..=n) set, then `tail`, then their weighted sum: a function whose
/// frame record is `8 n` bytes wherever it unwinds.
fn wide_body(n: usize, tail: &str) -> String {
    let mut body = String::new();
    for l in 0..n {
        body += &format!("(local.set {} (i64.const {}))", l + 1, l * 7 + 1);
    }
    body += tail;
    let mut sum = "(local.get 1)".to_owned();
    for l in 1..n {
        sum = format!(
            "(i64.add {sum} (i64.mul (local.get {}) (i64.const {})))",
            l + 1,
            l % 13
        );
    }
    body + &sum
}

/// Not a counted loop (its test masks the counter): it polls at every iteration.
const POLLED_LOOP: &str = "(loop (br_if 0 (i32.and (local.tee $k (i32.add (local.get $k) (i32.const 1))) (i32.const 3))))";

/// Whether defined function `i`'s lean copy (code entry `i` of the instrumented module) grows
/// a memory.
fn lean_copy_grows(wasm: &[u8], i: usize) -> bool {
    let mut bodies = wasmparser::Parser::new(0)
        .parse_all(wasm)
        .filter_map(|p| match p.unwrap() {
            wasmparser::Payload::CodeSectionEntry(b) => Some(b),
            _ => None,
        });
    let body = bodies.nth(i).expect("code entry");
    let mut ops = body.get_operators_reader().unwrap();
    let mut grows = false;
    while !ops.eof() {
        grows |= matches!(ops.read().unwrap(), wasmparser::Operator::MemoryGrow { .. });
    }
    grows
}

/// A function whose only unwind points are loop polls is always the innermost frame of an
/// unwind (v17): its lean copy pushes its record at `sp = 0` and grows nothing (no call: the
/// compiler sees a leaf), and the saved-stack memory starts with room for that record and the
/// largest other one. Records larger than a page — the leaf's, and two callers' above it —
/// unwound at every safe point give the plain module's results. The leaf is called before
/// its caller's own loop, so the first unwind starts in it, before any epilogue has grown the
/// memory (with room for one record only, the caller's push would trap).
#[test]
fn a_function_that_only_polls_in_loops_grows_nothing() {
    let n = 9_000;
    let locals = "(local i64)".repeat(n - 1);
    let call = "(if (local.get $d) (then (local.set 1 (i64.add (local.get 1) \
                (call $big (i32.sub (local.get $d) (i32.const 1)))))))";
    let wasm = wat::parse_str(format!(
        r#"(module
             (func $leaf (param i32) (result i64) (local i64) {locals} (local $k i32)
               {leaf})
             (func $big (param $d i32) (result i64) (local i64) {locals} (local $k i32)
               {big})
             (func (export "big") (result i64) (call $big (i32.const 1))))"#,
        leaf = wide_body(n, POLLED_LOOP),
        big = wide_body(
            n,
            &format!("(local.set 2 (call $leaf (i32.const 0))){POLLED_LOOP}{call}")
        ),
    ))
    .unwrap();
    let out = instrument_any(&wasm).unwrap();
    assert!(!lean_copy_grows(&out.wasm, 0), "the leaf grows the stack");
    assert!(lean_copy_grows(&out.wasm, 1), "its caller does not");
    let plain = churned_like_plain(&wasm, 3, 6);
    assert!(matches!(plain[..], [Outcome::Values(_)]), "{plain:?}");
}

/// Frame records larger than a page, on a stack several of them deep: an unwinding frame
/// stores its record before it makes room for the next (v16), so the saved-stack memory
/// starts as large as the largest record and grows by that much. Unwound at every safe point,
/// the results are the plain module's.
#[test]
fn records_larger_than_a_page_unwind_and_rewind() {
    // 9,000 live i64 locals: a 72 KB record, two of them on the stack (the second push
    // grows the memory).
    let n = 9_000;
    let tail = format!(
        "{POLLED_LOOP}(if (local.get $d) (then (local.set 1 (i64.add (local.get 1) \
         (call $big (i32.sub (local.get $d) (i32.const 1)))))))"
    );
    let wasm = wat::parse_str(format!(
        r#"(module
             (func $big (param $d i32) (result i64) (local i64) {locals} (local $k i32)
               {body})
             (func (export "big") (result i64) (call $big (i32.const 1))))"#,
        locals = "(local i64)".repeat(n - 1),
        body = wide_body(n, &tail),
    ))
    .unwrap();
    let plain = churned_like_plain(&wasm, 3, 4);
    assert!(matches!(plain[..], [Outcome::Values(_)]), "{plain:?}");
}

/// The interpreter's `select` guard (`select_guard.rs`) on generated modules, the originals and
/// their instrumented builds (what the interpreter is given): the rewritten module validates
/// and computes on wasmtime exactly what its input does.
#[test]
fn guarded_selects_change_nothing_a_module_computes() {
    let mut cfg = Config::new();
    cfg.consume_fuel(true)
        .wasm_multi_memory(true)
        .wasm_exceptions(true);
    let engine = Engine::new(&cfg).unwrap();
    let (mut guarded, mut compared, mut inputs) = (0, 0, 0);
    let (start, count) = crate::tests::soak("FERRY_SELECT_GUARD", 0x0bad_5e1e_c7c0_ffee, 200);
    for seed in crate::tests::seeds(start, count, 4096) {
        let mut u = arbitrary::Unstructured::new(&seed);
        let Ok(m) = wasm_smith::Module::new(config(), &mut u) else {
            continue;
        };
        let wasm = m.to_bytes();
        let instrumented = instrument_any(&wasm)
            .ok()
            .map(|o| (o.wasm, Mode::Instrumented));
        for (input, mode) in std::iter::once((wasm.clone(), Mode::Plain)).chain(instrumented) {
            inputs += 1;
            let wat = || wasmprinter::print_bytes(&wasm).unwrap_or_default();
            let out = match crate::guard_select_conditions(&input) {
                Ok(Some(out)) => out,
                Ok(None) => continue,
                Err(e) => panic!("{mode:?}: a valid module not read: {e}\n{}", wat()),
            };
            guarded += 1;
            if let Err(e) = wasmparser::Validator::new().validate_all(&out) {
                panic!("{mode:?}: the guarded module is invalid: {e}\n{}", wat());
            }
            let (Some(before), Some(after)) =
                (run(&engine, &input, mode), run(&engine, &out, mode))
            else {
                continue;
            };
            // The guard's `local.tee`s burn fuel too: compare runs that finished both times.
            if !finished(&before.0) || !finished(&after.0) {
                continue;
            }
            compared += 1;
            assert_eq!(before.0, after.0, "{mode:?}: results differ\n{}", wat());
            assert_eq!(before.1, after.1, "{mode:?}: state differs\n{}", wat());
        }
    }
    eprintln!("guarded {guarded} of {inputs} modules, compared {compared}");
    assert!(
        guarded * 4 >= inputs,
        "too few modules with a select to guard"
    );
    // (Generated functions often run out of fuel or stack: ~45% compare.)
    assert!(
        compared * 3 >= guarded,
        "only {compared} of {guarded} compared"
    );
}
