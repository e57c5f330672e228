//! A work-around for a miscompilation in wasmi 2.0.0, the interpreter engine, found by the
//! cross-engine test on generated modules (`cross_engine.rs`).
//!
//! wasmi fuses `i32.eqz` (or `i32.eq`/`i32.ne` with zero) into a `select` that takes its
//! result as the condition: it drops the comparison and selects on the comparison's input
//! instead, swapping the operands for `eqz`. When that input is a local variable (the
//! comparison reads a stack slot and writes the register), the fused `select` still tests the
//! register — which holds whatever an earlier instruction left there. So
//! `(select (i32.const 1) (local.get $b) (i32.eqz (local.get $a)))` with `$a = 7` gives 1
//! instead of `$b`. (`wasmi` 2.0.0, `try_fuse_select` in its function translator; `i32.eqz`
//! feeding `br_if` or `if` is not affected.)
//!
//! [`guard_select_conditions`] rewrites the module the interpreter is given so that no
//! `select` can be fused with such a comparison: right before each `select` whose condition is
//! computed (not a `local.get` or an `i32.const`), a `local.tee` of a fresh `i32` local of the
//! function's. wasmi then writes the condition into that local, which it never fuses (for a
//! condition computed by an instruction it writes the result there directly: nothing more to
//! run). The rewrite changes no value the guest computes and nothing a snapshot holds (the
//! fresh local is the function's last, outside every saved frame: ferry's transform has
//! already run and saves only the locals it knows), so it is the interpreter's business alone,
//! like its compiled form: the module's κ is the one the JIT runs.

use wasmparser::{BinaryReader, BinaryReaderError, Operator, Parser, Payload};

const CODE_SECTION: u8 = 10;

/// Changes whenever [`guard_select_conditions`] would rewrite some module differently: the
/// interpreter caches its output under this number.
pub const SELECT_GUARD_VERSION: u32 = 1;

/// What the rewrite of one function body needs (offsets into the module).
struct Plan {
    /// The body, after its size.
    range: std::ops::Range<usize>,
    /// How many entries its locals declaration has, and where the first starts.
    groups: u32,
    entries_start: usize,
    /// Where its operators start.
    ops_start: usize,
    /// The fresh local's index and the selects to guard, if there are any.
    guard: Option<(u32, Vec<usize>)>,
}

/// The module with every `select` on a computed condition guarded (module docs), or `None`
/// when it has none.
pub fn guard_select_conditions(wasm: &[u8]) -> Result<Option<Vec<u8>>, BinaryReaderError> {
    let mut params: Vec<u32> = Vec::new(); // by type index (0 for non-function types)
    let mut func_types: Vec<u32> = Vec::new(); // by defined function
    let mut bodies = Vec::new();
    for payload in Parser::new(0).parse_all(wasm) {
        match payload? {
            Payload::TypeSection(r) => {
                for group in r {
                    for ty in group?.into_types() {
                        params.push(match &ty.composite_type.inner {
                            wasmparser::CompositeInnerType::Func(f) => f.params().len() as u32,
                            _ => 0,
                        });
                    }
                }
            }
            Payload::FunctionSection(r) => {
                for ty in r {
                    func_types.push(ty?);
                }
            }
            Payload::CodeSectionEntry(body) => bodies.push(body),
            _ => {}
        }
    }
    // Per body: its locals and the selects to guard. Bodies are scanned on every core
    // (CPython's 55 MB of instrumented code takes ~0.5 s on one).
    let plan = |i: usize, body: &wasmparser::FunctionBody<'_>| -> Result<Plan, BinaryReaderError> {
        let ty = func_types.get(i).copied().unwrap_or(0);
        let mut count = u64::from(params.get(ty as usize).copied().unwrap_or(0));
        let mut locals = body.get_locals_reader()?;
        let groups = locals.get_count();
        let entries_start = locals.original_position();
        for _ in 0..groups {
            let (n, _) = locals.read()?;
            count += u64::from(n);
        }
        let mut ops = body.get_operators_reader()?;
        let ops_start = ops.original_position();
        let mut selects = Vec::new();
        // Whether the value on top of the stack is a local's or a constant, which wasmi never
        // fuses (every other `select` is guarded: the comparison may lie behind instructions
        // that emit nothing, such as `local.get` and `drop`).
        let mut plain = false;
        while !ops.eof() {
            let (op, at) = ops.read_with_offset()?;
            plain = match op {
                Operator::Select
                | Operator::TypedSelect { .. }
                | Operator::TypedSelectMulti { .. } => {
                    if !plain {
                        selects.push(at);
                    }
                    false
                }
                Operator::LocalGet { .. } | Operator::I32Const { .. } => true,
                _ => false,
            };
        }
        let fresh = u32::try_from(count).ok().filter(|_| !selects.is_empty());
        Ok(Plan {
            range: body.range(),
            groups,
            entries_start,
            ops_start,
            guard: fresh.map(|f| (f, selects)),
        })
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8);
    let per = bodies.len().div_ceil(threads).max(1);
    let plans: Vec<Plan> = std::thread::scope(|scope| {
        let workers: Vec<_> = bodies
            .chunks(per)
            .enumerate()
            .map(|(c, chunk)| {
                scope.spawn(move || {
                    chunk
                        .iter()
                        .enumerate()
                        .map(|(j, body)| plan(c * per + j, body))
                        .collect::<Result<Vec<Plan>, _>>()
                })
            })
            .collect();
        let mut all = Vec::with_capacity(bodies.len());
        for w in workers {
            all.extend(w.join().expect("a scan thread panicked")?);
        }
        Ok::<_, BinaryReaderError>(all)
    })?;
    if plans.iter().all(|p| p.guard.is_none()) {
        return Ok(None);
    }

    let mut code = Vec::new();
    leb(&mut code, bodies.len() as u32);
    for plan in plans {
        let range = plan.range;
        let Some((fresh, selects)) = plan.guard else {
            leb(&mut code, (range.end - range.start) as u32);
            code.extend_from_slice(&wasm[range]);
            continue;
        };
        let mut body = Vec::new();
        // The locals: the same entries, then one i32.
        leb(&mut body, plan.groups + 1);
        body.extend_from_slice(&wasm[plan.entries_start..plan.ops_start]);
        body.extend_from_slice(&[0x01, 0x7f]);
        let mut at = plan.ops_start;
        for s in selects {
            body.extend_from_slice(&wasm[at..s]);
            body.push(0x22); // local.tee
            leb(&mut body, fresh);
            at = s;
        }
        body.extend_from_slice(&wasm[at..range.end]);
        leb(&mut code, body.len() as u32);
        code.extend_from_slice(&body);
    }

    // The module with its code section replaced.
    let mut out = wasm[..8].to_vec();
    let mut at = 8;
    while at < wasm.len() {
        let id = wasm[at];
        let mut r = BinaryReader::new(&wasm[at + 1..], at + 1);
        let size = r.read_var_u32()? as usize;
        let start = r.original_position();
        let end = start + size;
        if id == CODE_SECTION {
            out.push(id);
            leb(&mut out, code.len() as u32);
            out.extend_from_slice(&code);
        } else {
            out.extend_from_slice(&wasm[at..end]);
        }
        at = end;
    }
    Ok(Some(out))
}

/// `v` as an unsigned LEB128 number.
fn leb(out: &mut Vec<u8>, v: u32) {
    wasm_encoder::Encode::encode(&v, out);
}

#[cfg(test)]
mod tests {
    use super::guard_select_conditions;

    /// The reduced case: wasmi 2.0.0 gives 1 and 9 (then 2) instead of 9 and 1 (then 1).
    const FUSED: &str = r#"(module
      (func (export "f") (param $a i32) (param $b i32) (result i32)
        (local.set $a (i32.const 7))
        (local.set $b (i32.const 9))
        (select (i32.const 1) (local.get $b) (i32.eqz (local.get $a))))
      (func (export "g") (param $a i32) (param $b i32) (result i32)
        (local.set $a (i32.const 7))
        (local.set $b (i32.const 9))
        (select (local.get $b) (i32.const 1) (i32.eqz (local.get $a))))
      (func (export "h") (param $a i32) (result i32) (local i64)
        (local.set $a (i32.const 7))
        (select (i32.const 2) (i32.const 1) (i32.eq (i32.const 0) (local.get $a))))
      (func (export "k") (param $a i32) (param $b i32) (result i32)
        (local.set $a (i32.const 7))
        (local.set $b (i32.const 9))
        (i32.const 1) (local.get $b) (i32.eqz (local.get $a)) (local.get $b) (drop)
        (select)))"#;

    fn call(wasm: &[u8], name: &str) -> i32 {
        let engine = wasmi::Engine::default();
        let module = wasmi::Module::new(&engine, wasm).expect("valid");
        let mut store = wasmi::Store::new(&engine, ());
        let instance = wasmi::Linker::<()>::new(&engine)
            .instantiate_and_start(&mut store, &module)
            .expect("instantiates");
        let f = instance.get_func(&store, name).expect("export");
        let mut out = [wasmi::Val::I32(0)];
        let args: Vec<wasmi::Val> = f
            .ty(&store)
            .params()
            .iter()
            .map(|_| wasmi::Val::I32(0))
            .collect();
        f.call(&mut store, &args, &mut out).expect("runs");
        match out[0] {
            wasmi::Val::I32(x) => x,
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_select_on_a_comparison_of_a_local_is_right_on_the_interpreter() {
        let wasm = wat::parse_str(FUSED).unwrap();
        let guarded = guard_select_conditions(&wasm).unwrap().expect("rewritten");
        wasmparser::Validator::new()
            .validate_all(&guarded)
            .expect("valid");
        assert_eq!(
            [9, 1, 1, 9],
            ["f", "g", "h", "k"].map(|f| call(&guarded, f)),
            "guarded"
        );
        // If this starts to pass, wasmi no longer miscompiles it and the guard can go.
        assert_ne!(
            [9, 1, 1, 9],
            ["f", "g", "h", "k"].map(|f| call(&wasm, f)),
            "wasmi unguarded"
        );
    }

    #[test]
    fn modules_without_such_a_select_are_left_as_they_are() {
        let wasm = wat::parse_str(
            r#"(module (func (export "f") (param i32) (result i32)
                 (select (i32.const 1) (i32.const 2) (local.get 0))
                 (select (i32.const 1) (i32.const 2) (i32.const 0))
                 (select (i32.const 1) (i32.const 2) (i32.const 0))
                 (drop) (drop)))"#,
        )
        .unwrap();
        assert!(guard_select_conditions(&wasm).unwrap().is_none());
    }
}
