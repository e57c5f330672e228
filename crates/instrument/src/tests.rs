//! The transform on generated modules: every valid module is either instrumented into a valid
//! module or refused with a reason — never an internal error, never a panic.

use proptest::prelude::*;

use crate::{InstrumentError, instrument, instrument_any};

pub(crate) fn config() -> wasm_smith::Config {
    wasm_smith::Config {
        exceptions_enabled: true,
        gc_enabled: false,
        tail_call_enabled: false,
        threads_enabled: false,
        relaxed_simd_enabled: false,
        reference_types_enabled: false,
        memory64_enabled: false,
        bulk_memory_enabled: false,
        max_imports: 0,
        min_funcs: 1,
        ..wasm_smith::Config::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn generated_modules_instrument_to_valid_modules(seed in proptest::collection::vec(any::<u8>(), 256..4096)) {
        let mut u = arbitrary::Unstructured::new(&seed);
        // Bulk memory too (`data.drop` is rewritten; the table instructions are refused).
        let config = wasm_smith::Config {
            bulk_memory_enabled: true,
            ..config()
        };
        let Ok(module) = wasm_smith::Module::new(config, &mut u) else { return Ok(()) };
        let bytes = module.to_bytes();
        match instrument_any(&bytes) {
            Ok(out) => prop_assert!(out.wasm.len() > 8),
            Err(InstrumentError::Internal(e)) => {
                let _ = std::fs::write(std::env::temp_dir().join("ferry-instrument-failure.wasm"), &bytes);
                prop_assert!(false, "invalid output: {e}\n{}", wasmprinter::print_bytes(&bytes).unwrap_or_default())
            }
            Err(_) => {}
        }
    }

    #[test]
    fn arbitrary_bytes_are_refused_not_crashed(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut b = bytes;
        if b.len() >= 8 && b[0] % 2 == 0 {
            b[..8].copy_from_slice(b"\0asm\x01\0\0\0");
        }
        prop_assert!(!matches!(instrument(&b), Err(InstrumentError::Internal(_))));
    }
}

#[test]
fn refusals_name_the_problem() {
    assert!(matches!(
        instrument(b"hello world"),
        Err(InstrumentError::NotWasm)
    ));
    assert!(matches!(
        instrument(b"\0asm\x0d\0\x01\0"),
        Err(InstrumentError::Component)
    ));
    let lib = wat::parse_str("(module (func (export \"f\")))").unwrap();
    assert!(matches!(instrument(&lib), Err(InstrumentError::NoStart)));
    let threads = wat::parse_str(
        "(module (memory 1 1 shared) (func (export \"_start\") (drop (i32.atomic.load (i32.const 0)))))",
    )
    .unwrap();
    assert!(matches!(
        instrument(&threads),
        Err(InstrumentError::Unsupported(_))
    ));
}

#[test]
fn leaf_functions_are_left_alone_and_loops_are_polled() {
    let m = wat::parse_str(
        r#"(module
             (func $leaf (param i32) (result i32) (i32.add (local.get 0) (i32.const 1)))
             (func (export "_start") (local i32)
               (loop (local.set 0 (call $leaf (local.get 0))) (br_if 0 (i32.lt_u (local.get 0) (i32.const 9))))))"#,
    )
    .unwrap();
    let out = instrument(&m).unwrap();
    assert_eq!(out.stats.functions, 2);
    assert_eq!(
        out.stats.instrumented, 1,
        "only _start can be on the stack at a safe point"
    );
    assert_eq!(
        out.stats.polls, 1,
        "the loop header; _start is on no call cycle"
    );
    assert_eq!(
        out.stats.call_sites, 0,
        "the call to a leaf is not a call site"
    );
}

#[test]
fn calls_inside_call_cycles_poll_on_return() {
    let m = wat::parse_str(
        r#"(module
             (type $t (func (param i32) (result i32)))
             (table 1 funcref)
             (elem (i32.const 0) $via_table)
             (func $self (param i32) (result i32)
               (if (result i32) (local.get 0)
                 (then (call $self (i32.sub (local.get 0) (i32.const 1))))
                 (else (i32.const 0))))
             (func $via_table (param i32) (result i32)
               (call_indirect (type $t) (local.get 0) (i32.const 0)))
             (func $once (param i32) (result i32) (call $self (local.get 0)))
             (func (export "_start") (drop (call $once (i32.const 3))) (drop (call $via_table (i32.const 0)))))"#,
    )
    .unwrap();
    let out = instrument(&m).unwrap();
    // $self's call of itself and $via_table's call through the table (which reaches
    // $via_table) poll on return; $once and _start call but lie on no cycle.
    assert_eq!(out.stats.polls, 2);
    assert_eq!(out.stats.entry_polls, 0);
}

/// An indirect call with no arguments returning an `i32` puts its result in the temp that
/// holds its table index (same stack position and type), which its unwind must save: it does
/// not poll on return, and the function polls on entry instead.
#[test]
fn an_indirect_call_whose_result_replaces_its_index_polls_on_entry() {
    let m = wat::parse_str(
        r#"(module
             (type $t (func (result i32)))
             (table 1 funcref)
             (elem (i32.const 0) $f)
             (func $f (type $t) (call_indirect (type $t) (i32.const 0)))
             (func (export "_start") (drop (call $f))))"#,
    )
    .unwrap();
    let out = instrument(&m).unwrap();
    assert_eq!((out.stats.polls, out.stats.entry_polls), (1, 1));
}

/// A reference live after a call inside a cycle keeps that return from polling (no record
/// can hold it), so the function polls on entry instead: every cycle keeps a safe point.
#[test]
fn a_cycle_whose_return_cannot_poll_polls_on_entry() {
    let m = wat::parse_str(
        r#"(module
             (elem declare func $r)
             (func $r (param i32) (result i32) (local funcref)
               (local.set 1 (ref.func $r))
               (if (result i32) (local.get 0)
                 (then (call $r (i32.sub (local.get 0) (i32.const 1)))
                       (drop (local.get 1)))
                 (else (i32.const 0))))
             (func (export "_start") (drop (call $r (i32.const 3)))))"#,
    )
    .unwrap();
    let out = instrument(&m).unwrap();
    assert_eq!((out.stats.polls, out.stats.entry_polls), (1, 1));
}

/// An indirect call reaches only functions of its own type: a function that calls through
/// the table with type $a lies on no cycle with an address-taken function of type $b, even
/// when that one calls it back; with matching types it does.
#[test]
fn indirect_calls_make_cycles_only_through_functions_of_their_type() {
    let module = |callee_type: &str| {
        wat::parse_str(format!(
            r#"(module
                 (type $a (func (param i32) (result i32)))
                 (type $b (func (param i64) (result i32)))
                 (table 1 funcref)
                 (elem (i32.const 0) $target)
                 (func $caller (param i32) (result i32)
                   (call_indirect (type $a) (local.get 0) (i32.const 0)))
                 (func $target (type {callee_type}) (param {}) (result i32)
                   (call $caller (i32.const 0)))
                 (func (export "_start") (drop (call $caller (i32.const 0)))))"#,
            if callee_type == "$a" { "i32" } else { "i64" }
        ))
        .unwrap()
    };
    // Types differ: $caller's indirect call cannot reach $target, so no cycle, no entry poll
    // (and no loop, blocking import or reachable poll: nothing is instrumented).
    assert_eq!(instrument(&module("$b")).unwrap().stats.polls, 0);
    // Same type: $caller → table → $target → $caller, both poll on entry.
    assert_eq!(instrument(&module("$a")).unwrap().stats.polls, 2);
}

/// The first seed state and how many modules a generated-module test runs: `start` and
/// `count`, unless `{PREFIX}_SEED` (decimal or `0x` hex) and `{PREFIX}_MODULES` say otherwise —
/// a longer run than CI's, with other modules, looking for what the usual seeds miss.
pub(crate) fn soak(prefix: &str, start: u64, count: usize) -> (u64, usize) {
    let var = |name: &str| std::env::var(format!("{prefix}_{name}")).ok();
    let start = var("SEED")
        .and_then(|s| match s.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => s.parse().ok(),
        })
        .filter(|&s| s != 0) // xorshift's one fixed point
        .unwrap_or(start);
    let count = var("MODULES").and_then(|n| n.parse().ok()).unwrap_or(count);
    (start, count)
}

/// A memory's content as a short digest: its length and an FNV-1a hash of its pages that are
/// not all zero, each with its index. Exact (two memories get the same digest only by a hash
/// collision), and quick on the big, mostly untouched memories generated modules declare:
/// a zero page is compared, not hashed byte by byte.
pub(crate) fn digest(bytes: &[u8]) -> String {
    const PAGE: usize = 64 << 10;
    static ZERO: [u8; PAGE] = [0; PAGE];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100_0000_01b3);
    };
    for (i, page) in bytes.chunks(PAGE).enumerate() {
        if page == &ZERO[..page.len()] {
            continue;
        }
        (i as u64).to_le_bytes().into_iter().for_each(&mut eat);
        page.iter().copied().for_each(&mut eat);
    }
    format!("{} bytes {h:016x}", bytes.len())
}

/// Deterministic pseudo-random seeds for wasm-smith (xorshift; no RNG dependency).
pub(crate) fn seeds(mut state: u64, count: usize, len: usize) -> impl Iterator<Item = Vec<u8>> {
    (0..count).map(move |_| {
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect()
    })
}

/// Guards against the property test above passing vacuously (every module refused).
#[test]
fn most_generated_modules_are_actually_instrumented() {
    let (mut ok, mut total) = (0, 0);
    let (start, count) = soak("FERRY_GENERATED", 0x9e37_79b9_7f4a_7c15, 300);
    for seed in seeds(start, count, 2048) {
        let mut u = arbitrary::Unstructured::new(&seed);
        let Ok(module) = wasm_smith::Module::new(config(), &mut u) else {
            continue;
        };
        total += 1;
        match instrument_any(&module.to_bytes()) {
            Ok(_) => ok += 1,
            Err(InstrumentError::Internal(e)) => panic!("invalid output: {e}"),
            Err(_) => {}
        }
    }
    assert!(
        ok * 2 >= total,
        "only {ok} of {total} generated modules were instrumented"
    );
}

#[test]
fn unwind_paths_are_hinted_unlikely_in_the_lean_copies() {
    let m = wat::parse_str(
        r#"(module
             (func $rec (param i32) (result i32)
               (if (result i32) (local.get 0)
                 (then (i32.add (call $rec (i32.sub (local.get 0) (i32.const 1))) (i32.const 1)))
                 (else (i32.const 0))))
             (func (export "_start") (local i32)
               (loop (local.set 0 (call $rec (local.get 0))) (br_if 0 (i32.lt_u (local.get 0) (i32.const 9))))))"#,
    )
    .unwrap();
    let out = instrument(&m).unwrap();
    let mut hints = Vec::new();
    let mut bodies = Vec::new();
    let mut imported = 0;
    for p in wasmparser::Parser::new(0).parse_all(&out.wasm) {
        match p.unwrap() {
            wasmparser::Payload::ImportSection(r) => imported = r.into_imports().count() as u32,
            wasmparser::Payload::CustomSection(c) => {
                if let wasmparser::KnownCustom::BranchHints(r) = c.as_known() {
                    for f in r {
                        let f = f.unwrap();
                        let offsets: Vec<(u32, bool)> = f
                            .hints
                            .into_iter()
                            .map(|h| {
                                let h = h.unwrap();
                                (h.func_offset, h.taken)
                            })
                            .collect();
                        hints.push((f.func, offsets));
                    }
                }
            }
            wasmparser::Payload::CodeSectionEntry(b) => bodies.push(b.range()),
            _ => {}
        }
    }
    // Both functions' lean copies: the post-call checks and the polls (loop header, return of
    // the recursive call), each an `if` whose then-arm is the unwind.
    assert_eq!(hints.len(), 2, "{hints:?}");
    let mut total = 0;
    for (func, offsets) in &hints {
        let body = &bodies[(func - imported) as usize];
        for &(at, taken) in offsets {
            assert!(!taken);
            assert_eq!(
                out.wasm[body.start + at as usize],
                0x04,
                "not an `if` at {at}"
            );
            total += 1;
        }
    }
    // One hinted `if` per call site (its post-call check) and per poll (its flag test); a
    // return poll's flag test is also its call's unwind check (v14), and the recursive
    // function polls on return, not on entry.
    let return_polls = 1; // $rec calling itself
    assert_eq!((out.stats.call_sites, out.stats.polls), (2, 2));
    assert_eq!(
        total,
        out.stats.call_sites + out.stats.polls - return_polls,
        "{hints:?}"
    );
}

#[test]
fn only_calls_that_can_reach_a_safe_point_are_call_sites() {
    // $cmp (a leaf) and $spin (a loop) sit in the table with different types; $mid calls only
    // leaves. Only the indirect call whose type admits $spin, and the direct call of $spin, are
    // call sites; $mid and $cmp stay uninstrumented.
    let m = wat::parse_str(
        r#"(module
             (type $cmp_t (func (param i32 i32) (result i32)))
             (type $spin_t (func (param i32) (result i32)))
             (table 2 funcref)
             (elem (i32.const 0) $cmp $spin)
             (func $cmp (type $cmp_t) (i32.sub (local.get 0) (local.get 1)))
             (func $spin (type $spin_t)
               (loop (local.set 0 (i32.sub (local.get 0) (i32.const 1))) (br_if 0 (local.get 0)))
               (local.get 0))
             (func $mid (param i32) (result i32)
               (call_indirect (type $cmp_t) (local.get 0) (i32.const 1) (i32.const 0)))
             (func (export "_start")
               (drop (call $mid (i32.const 3)))
               (drop (call_indirect (type $cmp_t) (i32.const 1) (i32.const 2) (i32.const 0)))
               (drop (call_indirect (type $spin_t) (i32.const 5) (i32.const 1)))
               (drop (call $spin (i32.const 5)))))"#,
    )
    .unwrap();
    let out = instrument(&m).unwrap();
    assert_eq!(out.stats.functions, 4);
    assert_eq!(out.stats.instrumented, 2, "$spin and _start");
    assert_eq!(
        out.stats.call_sites, 2,
        "the indirect call of $spin's type, the direct call of $spin"
    );
    assert_eq!(out.stats.polls, 1, "$spin's loop");
}

/// Every `data.drop` of the input, in an instrumented function or in one copied as it is,
/// becomes a call of the function that drops the segment and sets its flag (an exported
/// global the host captures); the rewind entry points drop again what the flags say; and a
/// module that drops nothing gets none of it.
#[test]
fn dropped_data_segments_are_recorded_and_dropped_again_on_rewind() {
    let wat = r#"(module
        (memory 1)
        (data $a "a") (data $b "b") (data $c "c")
        (func $plain (data.drop $b))
        (func (export "_start") (local $i i32)
            (data.drop $a)
            (call $plain)
            (loop $l
                (local.set $i (i32.add (local.get $i) (i32.const 1)))
                (br_if $l (i32.lt_u (local.get $i) (i32.const 10))))
            (data.drop $a)
            (memory.init $c (i32.const 0) (i32.const 0) (i32.const 1))))"#;
    let out = instrument(&wat::parse_str(wat).unwrap()).unwrap();
    // Per function of the output: the segments it drops and the functions it calls.
    let mut drops: Vec<Vec<u32>> = Vec::new();
    let mut calls: Vec<Vec<u32>> = Vec::new();
    let mut flags = Vec::new();
    let mut rewind_start = None;
    for p in wasmparser::Parser::new(0).parse_all(&out.wasm) {
        match p.unwrap() {
            wasmparser::Payload::ExportSection(r) => {
                for e in r {
                    let e = e.unwrap();
                    if e.name.starts_with(crate::abi::GLOBAL_PREFIX) {
                        flags.push(e.index);
                    }
                    if e.name == crate::abi::rewind_export("_start") {
                        rewind_start = Some(e.index);
                    }
                }
            }
            wasmparser::Payload::CodeSectionEntry(b) => {
                let (mut d, mut c) = (Vec::new(), Vec::new());
                let mut ops = b.get_operators_reader().unwrap();
                while !ops.eof() {
                    match ops.read().unwrap() {
                        wasmparser::Operator::DataDrop { data_index } => d.push(data_index),
                        wasmparser::Operator::Call { function_index } => c.push(function_index),
                        _ => {}
                    }
                }
                drops.push(d);
                calls.push(c);
            }
            _ => {}
        }
    }
    // No imports but ferry.poll: defined function k is function k + 1. Defined: $plain,
    // _start (lean), _start (rewind copy), the drops of $a and $b, _start's rewind entry.
    assert_eq!(drops.len(), 6, "{drops:?}");
    let (drop_a, drop_b) = (4, 5);
    assert_eq!(calls[0], [drop_b], "$plain, copied as it is");
    assert!(drops[..3].iter().all(Vec::is_empty), "{drops:?}");
    for copy in [1, 2] {
        assert_eq!(
            calls[copy].iter().filter(|&&f| f == drop_a).count(),
            2,
            "{calls:?}"
        );
    }
    assert_eq!(
        (drops[3].as_slice(), drops[4].as_slice()),
        (&[0][..], &[1][..])
    );
    // The entry drops both again (under their flags), then calls the rewind copy.
    assert_eq!(rewind_start, Some(6));
    assert_eq!(drops[5], [0, 1]);
    assert_eq!(calls[5], [3]);
    assert_eq!(flags.len(), 2, "one flag per dropped segment: {flags:?}");

    // Without a `data.drop`, nothing of this: the output is the transform's usual one.
    let none = wat
        .replace("(data.drop $a)", "")
        .replace("(data.drop $b)", "");
    let out = instrument(&wat::parse_str(&none).unwrap()).unwrap();
    let text = wasmprinter::print_bytes(&out.wasm).unwrap();
    assert!(
        !text.contains("data.drop") && !text.contains("ferry:global"),
        "{text}"
    );
}

/// A rewind copy is shown as the function it copies: its lean copy, named as the program
/// named the function; other functions as themselves.
#[test]
fn rewind_copies_are_shown_as_the_functions_they_copy() {
    let m = wat::parse_str(
        r#"(module
          (func $spin (param i32) (result i32)
            (loop $l (br_if $l (local.tee 0 (i32.sub (local.get 0) (i32.const 1)))))
            (local.get 0))
          (func $outer (param i32) (result i32)
            (i32.add (call $spin (local.get 0)) (i32.const 1)))
          (func $leaf (result i32) (i32.const 7))
          (func (export "_start") (drop (call $outer (i32.const 9))) (drop (call $leaf))))"#,
    )
    .unwrap();
    let out = instrument(&m).unwrap();
    let n = wasmparser::Parser::new(0)
        .parse_all(&out.wasm)
        .filter_map(|p| match p.unwrap() {
            wasmparser::Payload::CodeSectionStart { count, .. } => Some(count),
            _ => None,
        })
        .next()
        .unwrap();
    let all: Vec<u32> = (0..200).collect();
    let shown = crate::frame_functions(&out.wasm, &all).unwrap();
    let named = |name: &str| {
        shown
            .iter()
            .filter(|(_, n)| n.as_deref() == Some(name))
            .count()
    };
    // Each instrumented function is shown twice (lean copy, rewind copy); the leaf once.
    assert_eq!(named("spin"), 2, "{shown:?}");
    assert_eq!(named("outer"), 2);
    assert_eq!(named("leaf"), 1);
    let spin: Vec<u32> = shown
        .iter()
        .filter(|(_, n)| n.as_deref() == Some("spin"))
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(spin[0], spin[1], "both frames lead to the lean copy");
    assert!(n > 4, "rewind copies were emitted ({n} bodies)");
    assert_eq!(crate::frame_functions(b"not wasm", &[0]), None);
}
