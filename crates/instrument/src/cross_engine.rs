//! Engine neutrality on code nobody here wrote: generated modules, instrumented, are unwound
//! at safe points on one engine (wasmtime or wasmi), their memories and globals copied into
//! a fresh instance on the *other* engine, and rewound there — as a resume with
//! `--engine` does — at every unwind, back and forth. Results and final state must be the
//! plain module's on wasmtime. (The engine crate's tests and the conformance kit move real
//! guests with a full host; this covers the transform's output on both engines.)

use crate::tests::{seeds, soak};
use crate::{abi, instrument_any, instrument_any_counting};

/// The differential test's generator settings without the exception-handling proposal,
/// which wasmi does not implement.
fn config() -> wasm_smith::Config {
    wasm_smith::Config {
        export_everything: true,
        canonicalize_nans: true,
        disallow_traps: true,
        exceptions_enabled: false,
        // Dropped data segments must stay dropped in the instance a move creates.
        bulk_memory_enabled: true,
        ..crate::tests::config()
    }
}

/// A value both engines can hold, as bits.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Bits {
    I32(i32),
    I64(i64),
    F32(u32),
    F64(u64),
    V128(u128),
}

impl Bits {
    fn of_jit(v: &wasmtime::Val) -> Option<Self> {
        Some(match v {
            wasmtime::Val::I32(x) => Self::I32(*x),
            wasmtime::Val::I64(x) => Self::I64(*x),
            wasmtime::Val::F32(x) => Self::F32(*x),
            wasmtime::Val::F64(x) => Self::F64(*x),
            wasmtime::Val::V128(x) => Self::V128(x.as_u128()),
            _ => return None,
        })
    }

    fn to_jit(self) -> wasmtime::Val {
        match self {
            Self::I32(x) => wasmtime::Val::I32(x),
            Self::I64(x) => wasmtime::Val::I64(x),
            Self::F32(x) => wasmtime::Val::F32(x),
            Self::F64(x) => wasmtime::Val::F64(x),
            Self::V128(x) => wasmtime::Val::V128(x.into()),
        }
    }

    fn of_interp(v: &wasmi::Val) -> Option<Self> {
        Some(match v {
            wasmi::Val::I32(x) => Self::I32(*x),
            wasmi::Val::I64(x) => Self::I64(*x),
            wasmi::Val::F32(x) => Self::F32(x.to_bits()),
            wasmi::Val::F64(x) => Self::F64(x.to_bits()),
            wasmi::Val::V128(x) => Self::V128(x.as_u128()),
            _ => return None,
        })
    }

    fn to_interp(self) -> wasmi::Val {
        match self {
            Self::I32(x) => wasmi::Val::I32(x),
            Self::I64(x) => wasmi::Val::I64(x),
            Self::F32(x) => wasmi::Val::F32(wasmi::F32::from_bits(x)),
            Self::F64(x) => wasmi::Val::F64(wasmi::F64::from_bits(x)),
            Self::V128(x) => wasmi::Val::V128(x.into()),
        }
    }

    fn show(b: Option<Self>) -> String {
        b.map_or_else(|| "reference".to_owned(), |b| format!("{b:?}"))
    }
}

/// How a call ended.
#[derive(Debug, PartialEq)]
enum End {
    Values(Vec<String>),
    Unwound,
    Trap,
    OutOfFuel,
    /// Unbounded recursion: the depth it ends at depends on the engine and on frame sizes, so
    /// what ran before it is not comparable.
    StackOverflow,
}

/// What moves from one engine to the other: every exported memory and mutable global (the
/// instrumented module exports all of its own, and ferry's control state), and the count of
/// safe points met so far.
#[derive(Debug)]
struct Moved {
    memories: Vec<(String, Vec<u8>)>,
    globals: Vec<(String, Bits)>,
    polls: u64,
}

/// A module compiled for both engines.
struct Built {
    jit: wasmtime::Module,
    interp: wasmi::Module,
}

/// An instance on one of the two engines.
#[allow(clippy::large_enum_variant)] // one per run, never moved around in bulk
enum Live {
    Jit(wasmtime::Store<u64>, wasmtime::Instance),
    Interp(wasmi::Store<u64>, wasmi::Instance),
}

/// The host side of `ferry.poll` (the counting build's every safe point; the lean build's
/// entry and return polls): a rewind ends at the first call; otherwise every `n`-th call
/// starts an unwind. `state` and `sp` are the globals' values; what to write back goes to
/// `set`.
fn poll(
    count: &mut u64,
    n: u64,
    state: i32,
    sp: i32,
    mut set: impl FnMut(&'static str, i32),
) -> Result<(), String> {
    if state == abi::STATE_REWIND {
        if sp != 0 {
            return Err(format!("rewind ended with frames left over (sp {sp})"));
        }
        set(abi::STATE_GLOBAL, abi::STATE_NORMAL);
        return Ok(());
    }
    *count += 1;
    if count.is_multiple_of(n) {
        set(abi::STATE_GLOBAL, abi::STATE_UNWIND);
        set(abi::SP_GLOBAL, 0);
    }
    Ok(())
}

impl Live {
    fn new(
        jit: &wasmtime::Engine,
        interp: &wasmi::Engine,
        built: &Built,
        on_jit: bool,
        n: u64,
        polls: u64,
    ) -> Option<Self> {
        if on_jit {
            let mut store = wasmtime::Store::new(jit, polls);
            let mut linker = wasmtime::Linker::new(jit);
            linker
                .func_wrap(
                    abi::MODULE,
                    abi::POLL,
                    move |mut c: wasmtime::Caller<'_, u64>| -> wasmtime::Result<()> {
                        let g = |c: &mut wasmtime::Caller<'_, u64>, name| {
                            c.get_export(name)
                                .and_then(wasmtime::Extern::into_global)
                                .expect("ferry global")
                        };
                        let state = g(&mut c, abi::STATE_GLOBAL).get(&mut c).unwrap_i32();
                        let sp = g(&mut c, abi::SP_GLOBAL).get(&mut c).unwrap_i32();
                        let mut writes = Vec::new();
                        let mut count = *c.data();
                        poll(&mut count, n, state, sp, |name, v| writes.push((name, v)))
                            .map_err(wasmtime::Error::msg)?;
                        *c.data_mut() = count;
                        for (name, v) in writes {
                            g(&mut c, name).set(&mut c, wasmtime::Val::I32(v))?;
                        }
                        Ok(())
                    },
                )
                .ok()?;
            store.set_fuel(FUEL).ok()?;
            let instance = linker.instantiate(&mut store, &built.jit).ok()?;
            Some(Self::Jit(store, instance))
        } else {
            let mut store = wasmi::Store::new(interp, polls);
            let mut linker = wasmi::Linker::new(interp);
            linker
                .func_wrap(
                    abi::MODULE,
                    abi::POLL,
                    move |mut c: wasmi::Caller<'_, u64>| -> Result<(), wasmi::Error> {
                        let g = |c: &wasmi::Caller<'_, u64>, name| {
                            c.get_export(name)
                                .and_then(wasmi::Extern::into_global)
                                .expect("ferry global")
                        };
                        let int = |v: wasmi::Val| match v {
                            wasmi::Val::I32(x) => x,
                            other => panic!("ferry global holds {other:?}"),
                        };
                        let state = int(g(&c, abi::STATE_GLOBAL).get(&c));
                        let sp = int(g(&c, abi::SP_GLOBAL).get(&c));
                        let mut writes = Vec::new();
                        let mut count = *c.data();
                        poll(&mut count, n, state, sp, |name, v| writes.push((name, v)))
                            .map_err(wasmi::Error::new)?;
                        *c.data_mut() = count;
                        for (name, v) in writes {
                            g(&c, name)
                                .set(&mut c, wasmi::Val::I32(v))
                                .map_err(|e| wasmi::Error::new(e.to_string()))?;
                        }
                        Ok(())
                    },
                )
                .ok()?;
            store.set_fuel(FUEL).ok()?;
            let instance = linker
                .instantiate_and_start(&mut store, &built.interp)
                .ok()?;
            Some(Self::Interp(store, instance))
        }
    }

    fn memory_bytes(&mut self) -> usize {
        match self {
            Self::Jit(s, i) => {
                let memories: Vec<wasmtime::Memory> =
                    i.exports(&mut *s).filter_map(|e| e.into_memory()).collect();
                memories.iter().map(|m| m.data_size(&*s)).sum()
            }
            Self::Interp(s, i) => i
                .exports(&*s)
                .filter_map(|e| e.into_memory())
                .map(|m| m.data(&*s).len())
                .sum(),
        }
    }

    fn polls(&self) -> u64 {
        match self {
            Self::Jit(s, _) => *s.data(),
            Self::Interp(s, _) => *s.data(),
        }
    }

    /// Raises the poll flag (`ferry:ctl` word 0) for good, as `differential.rs` does.
    fn arm(&mut self) {
        match self {
            Self::Jit(s, i) => {
                if let Some(m) = i.get_memory(&mut *s, abi::CTL_MEMORY) {
                    m.data_mut(s)[..4].copy_from_slice(&1u32.to_le_bytes());
                }
            }
            Self::Interp(s, i) => {
                if let Some(m) = i.get_memory(&*s, abi::CTL_MEMORY) {
                    m.data_mut(s)[..4].copy_from_slice(&1u32.to_le_bytes());
                }
            }
        }
    }

    fn state_global(&mut self) -> Option<i32> {
        match self {
            Self::Jit(s, i) => i
                .get_global(&mut *s, abi::STATE_GLOBAL)
                .map(|g| g.get(&mut *s).unwrap_i32()),
            Self::Interp(s, i) => {
                i.get_global(&*s, abi::STATE_GLOBAL)
                    .and_then(|g| match g.get(&*s) {
                        wasmi::Val::I32(x) => Some(x),
                        _ => None,
                    })
            }
        }
    }

    fn set_control(&mut self, state: i32, sp: Option<i32>) {
        let mut sets = vec![(abi::STATE_GLOBAL, state)];
        sets.extend(sp.map(|sp| (abi::SP_GLOBAL, sp)));
        for (name, v) in sets {
            match self {
                Self::Jit(s, i) => {
                    if let Some(g) = i.get_global(&mut *s, name) {
                        g.set(&mut *s, wasmtime::Val::I32(v)).expect("set");
                    }
                }
                Self::Interp(s, i) => {
                    if let Some(g) = i.get_global(&*s, name) {
                        g.set(&mut *s, wasmi::Val::I32(v)).expect("set");
                    }
                }
            }
        }
    }

    /// Calls export `name` with zero arguments of its parameter types, with [`FUEL`] anew
    /// if `refuel` (else what is left: a rewind in place goes on with the call's fuel).
    fn call(&mut self, name: &str, refuel: bool) -> Option<End> {
        match self {
            Self::Jit(s, i) => {
                let f = i.get_func(&mut *s, name)?;
                let ty = f.ty(&*s);
                let args: Vec<_> = ty
                    .params()
                    .map(|t| wasmtime::Val::default_for_ty(&t).unwrap_or(wasmtime::Val::I32(0)))
                    .collect();
                let mut results: Vec<_> = ty
                    .results()
                    .map(|t| wasmtime::Val::default_for_ty(&t).unwrap_or(wasmtime::Val::I32(0)))
                    .collect();
                if refuel {
                    s.set_fuel(FUEL).ok()?;
                }
                Some(match f.call(&mut *s, &args, &mut results) {
                    Ok(()) => End::Values(
                        results
                            .iter()
                            .map(|v| Bits::show(Bits::of_jit(v)))
                            .collect(),
                    ),
                    Err(e) => match e.downcast_ref::<wasmtime::Trap>() {
                        Some(wasmtime::Trap::OutOfFuel) => End::OutOfFuel,
                        Some(wasmtime::Trap::StackOverflow) => End::StackOverflow,
                        _ => End::Trap,
                    },
                })
            }
            Self::Interp(s, i) => {
                let f = i.get_func(&*s, name)?;
                let ty = f.ty(&*s);
                let args: Vec<_> = ty
                    .params()
                    .iter()
                    .map(|t| wasmi::Val::default_for_ty(*t))
                    .collect();
                let mut results: Vec<_> = ty
                    .results()
                    .iter()
                    .map(|t| wasmi::Val::default_for_ty(*t))
                    .collect();
                if refuel {
                    s.set_fuel(FUEL).ok()?;
                }
                Some(match f.call(&mut *s, &args, &mut results) {
                    Ok(()) => End::Values(
                        results
                            .iter()
                            .map(|v| Bits::show(Bits::of_interp(v)))
                            .collect(),
                    ),
                    Err(e) => match e.as_trap_code() {
                        Some(wasmi::TrapCode::OutOfFuel) => End::OutOfFuel,
                        Some(wasmi::TrapCode::StackOverflow) => End::StackOverflow,
                        _ => End::Trap,
                    },
                })
            }
        }
        .map(|end| match end {
            End::Values(_) if self.state_global() == Some(abi::STATE_UNWIND) => End::Unwound,
            other => other,
        })
    }

    /// Every exported memory and mutable global (`all`), or only the original module's own
    /// exports (not `ferry:`), for the final comparison.
    fn take(&mut self, all: bool) -> Moved {
        let keep = |name: &str| all || !name.starts_with("ferry:");
        let (mut memories, mut globals) = (Vec::new(), Vec::new());
        match self {
            Self::Jit(s, i) => {
                let exports: Vec<(String, wasmtime::Extern)> = i
                    .exports(&mut *s)
                    .map(|e| (e.name().to_owned(), e.into_extern()))
                    .collect();
                for (name, e) in exports.into_iter().filter(|(n, _)| keep(n)) {
                    match e {
                        wasmtime::Extern::Memory(m) => memories.push((name, m.data(&*s).to_vec())),
                        wasmtime::Extern::Global(g)
                            if !all || g.ty(&*s).mutability() == wasmtime::Mutability::Var =>
                        {
                            if let Some(b) = Bits::of_jit(&g.get(&mut *s)) {
                                globals.push((name, b));
                            }
                        }
                        _ => {}
                    }
                }
            }
            Self::Interp(s, i) => {
                let exports: Vec<(String, wasmi::Extern)> = i
                    .exports(&*s)
                    .map(|e| (e.name().to_owned(), e.into_extern()))
                    .collect();
                for (name, e) in exports.into_iter().filter(|(n, _)| keep(n)) {
                    match e {
                        wasmi::Extern::Memory(m) => memories.push((name, m.data(&*s).to_vec())),
                        wasmi::Extern::Global(g) if !all || g.ty(&*s).mutability().is_mut() => {
                            if let Some(b) = Bits::of_interp(&g.get(&*s)) {
                                globals.push((name, b));
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        memories.sort();
        globals.sort_by(|a, b| a.0.cmp(&b.0));
        Moved {
            memories,
            globals,
            polls: self.polls(),
        }
    }

    /// Writes what [`Live::take`] took from the other engine into this fresh instance.
    fn restore(&mut self, moved: &Moved) -> Option<()> {
        const PAGE: usize = 65_536;
        match self {
            Self::Jit(s, i) => {
                for (name, bytes) in &moved.memories {
                    let m = i.get_memory(&mut *s, name)?;
                    let short = (bytes.len() - m.data_size(&*s)) / PAGE;
                    if short > 0 {
                        m.grow(&mut *s, short as u64).ok()?;
                    }
                    m.data_mut(&mut *s)[..bytes.len()].copy_from_slice(bytes);
                }
                for (name, b) in &moved.globals {
                    i.get_global(&mut *s, name)?.set(&mut *s, b.to_jit()).ok()?;
                }
            }
            Self::Interp(s, i) => {
                for (name, bytes) in &moved.memories {
                    let m = i.get_memory(&*s, name)?;
                    let short = (bytes.len() - m.data(&*s).len()) / PAGE;
                    if short > 0 {
                        m.grow(&mut *s, short as u64).ok()?;
                    }
                    m.data_mut(&mut *s)[..bytes.len()].copy_from_slice(bytes);
                }
                for (name, b) in &moved.globals {
                    i.get_global(&*s, name)?.set(&mut *s, b.to_interp()).ok()?;
                }
            }
        }
        Some(())
    }
}

/// Fuel for each call (and each stretch of one between two moves).
const FUEL: u64 = 2_000_000;
/// Most memory (all memories together, at instantiation) of a module this test runs.
const MAX_MEMORY: usize = 4 << 20;
/// Most moves between engines in one run.
const MAX_MOVES: u64 = 64;

/// A memory's content as a short digest, a global as its bits.
fn final_state(moved: &Moved) -> Vec<String> {
    let mut out: Vec<String> = moved
        .memories
        .iter()
        .map(|(n, m)| format!("{n}: {}", crate::tests::digest(m)))
        .collect();
    out.extend(moved.globals.iter().map(|(n, b)| format!("{n}: {b:?}")));
    out
}

/// What a run gave: each export's outcome, the final state, how many moves it made.
type Run = (Vec<End>, Vec<String>, u64);

/// Calls every exported function of `built` (the instrumented module's start first), starting
/// on the JIT when `on_jit`; at every unwind the state moves to a fresh instance on the other
/// engine, which rewinds. `None` if something could not be set up.
fn run(
    jit: &wasmtime::Engine,
    interp: &wasmi::Engine,
    built: &Built,
    mut on_jit: bool,
    n: u64,
    instrumented: bool,
) -> Option<Run> {
    let mut live = Live::new(jit, interp, built, on_jit, n, 0)?;
    // Every move copies every memory: modules with big ones are left out.
    if live.memory_bytes() > MAX_MEMORY {
        return None;
    }
    if instrumented {
        live.arm();
    }
    let exports: Vec<String> = built
        .jit
        .exports()
        .filter(|e| matches!(e.ty(), wasmtime::ExternType::Func(_)))
        .map(|e| e.name().to_owned())
        .filter(|n| !n.starts_with("ferry:"))
        .collect();
    let start = (instrumented && built.jit.get_export(abi::START_EXPORT).is_some())
        .then(|| abi::START_EXPORT.to_owned());
    let (mut outcomes, mut moves) = (Vec::new(), 0);
    for name in start.iter().chain(&exports) {
        let mut callee = name.clone();
        let end = loop {
            match live.call(&callee, callee == *name)? {
                End::Unwound => {
                    // Past MAX_MOVES the same instance rewinds (each move copies memory).
                    if moves < MAX_MOVES {
                        let moved = live.take(true);
                        on_jit = !on_jit;
                        live = Live::new(jit, interp, built, on_jit, n, moved.polls)?;
                        live.restore(&moved)?;
                        live.arm();
                        moves += 1;
                    }
                    live.set_control(abi::STATE_REWIND, None);
                    callee = abi::rewind_export(name);
                }
                other => break other,
            }
        };
        if !matches!(end, End::Values(_)) && instrumented {
            // The next export runs on this instance: clear what the trap interrupted.
            live.set_control(abi::STATE_NORMAL, Some(0));
        }
        if *name != abi::START_EXPORT {
            outcomes.push(end);
        }
    }
    Some((outcomes, final_state(&live.take(false)), moves))
}

#[test]
fn generated_modules_unwound_on_one_engine_rewind_on_the_other() {
    let jit = {
        let mut cfg = wasmtime::Config::new();
        cfg.consume_fuel(true).wasm_multi_memory(true);
        wasmtime::Engine::new(&cfg).expect("wasmtime")
    };
    let interp = {
        let mut cfg = wasmi::Config::default();
        cfg.consume_fuel(true)
            .wasm_multi_memory(true)
            .wasm_simd(true)
            .wasm_extended_const(true);
        wasmi::Engine::new(&cfg)
    };
    let build = |wasm: &[u8]| -> Option<Built> {
        Some(Built {
            jit: wasmtime::Module::new(&jit, wasm).ok()?,
            // As the interpreter engine runs it (select_guard.rs).
            interp: match crate::guard_select_conditions(wasm).ok()? {
                Some(guarded) => wasmi::Module::new(&interp, &guarded).ok()?,
                None => wasmi::Module::new(&interp, wasm).ok()?,
            },
        })
    };
    // A soak (scripts/fuzz.sh): FERRY_CROSS_ENGINE_MODULES and FERRY_CROSS_ENGINE_SEED.
    let (start, count) = soak("FERRY_CROSS_ENGINE", 0x0bad_cafe_f00d_5eed, 300);
    let (mut compared, mut total, mut moves) = (0, 0, 0);
    for seed in seeds(start, count, 4096) {
        let mut u = arbitrary::Unstructured::new(&seed);
        let Ok(m) = wasm_smith::Module::new(config(), &mut u) else {
            continue;
        };
        let wasm = m.to_bytes();
        let (Ok(lean), Ok(counting)) = (instrument_any(&wasm), instrument_any_counting(&wasm))
        else {
            continue;
        };
        let (Some(plain), Some(lean), Some(counting)) =
            (build(&wasm), build(&lean.wasm), build(&counting.wasm))
        else {
            continue;
        };
        total += 1;
        let Some(expected) = run(&jit, &interp, &plain, true, 1, false) else {
            continue;
        };
        // Each safe point (the counting build), every third starting on the interpreter,
        // and the lean build's own unwinds with the flag raised.
        let runs = [
            ("counting, every safe point, from jit", &counting, true, 1),
            ("counting, every third, from interp", &counting, false, 3),
            ("lean, flag raised, from interp", &lean, false, 1),
        ]
        .map(|(what, built, on_jit, n)| (what, run(&jit, &interp, built, on_jit, n, true)));
        let finished = |o: &[End]| {
            o.iter()
                .all(|o| !matches!(o, End::OutOfFuel | End::StackOverflow))
        };
        if !finished(&expected.0)
            || runs
                .iter()
                .any(|(_, r)| r.as_ref().is_none_or(|(o, _, _)| !finished(o)))
        {
            continue;
        }
        compared += 1;
        for (what, r) in runs {
            let (outcomes, state, moved) = r.expect("checked above");
            moves += moved;
            let wat = || wasmprinter::print_bytes(&wasm).unwrap_or_default();
            assert_eq!(expected.0, outcomes, "{what}: results differ\n{}", wat());
            assert_eq!(expected.1, state, "{what}: state differs\n{}", wat());
        }
    }
    eprintln!("compared {compared} of {total} modules; {moves} moves between engines");
    assert!(moves > 15, "the runs barely moved ({moves} moves)");
    assert!(
        compared * 3 >= total,
        "only {compared} of {total} modules compared"
    );
}
