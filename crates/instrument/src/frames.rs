//! Which of the program's functions a frame of the instrumented module belongs to, for a
//! trapped guest's call stack.
//!
//! After a resume, the frames that were on the stack at the suspend run in their *rewind
//! copies* until they return. Those copies have no names (the name section names the lean
//! copies, which keep the original functions' names), so without this a trap after a resume
//! would show functions the user cannot place. Each rewind copy's prologue checks that the
//! record it pops names its function (`i32.load ferry:stack[sp]; i32.const <defined index>;
//! i32.ne; if unreachable`), and that constant leads to the lean copy. Read from the module
//! itself, so that code compiled before (from a cache) is served as well.

use std::collections::HashMap;

use wasmparser::{KnownCustom, Name, Operator, Parser, Payload};

use crate::abi;

/// Most operators of a function's start looked through for the prologue's check.
const PROLOGUE_SCAN: usize = 256;

/// For each function index of the instrumented module `wasm` in `funcs`, the function a
/// call stack should show: a rewind copy's lean copy (which has the original function's
/// name), any other function itself; with its name, if the module names it. `None` where
/// `wasm` cannot be read.
pub fn frame_functions(wasm: &[u8], funcs: &[u32]) -> Option<Vec<(u32, Option<String>)>> {
    let mut n_imports = 0u32;
    let mut stack_memory = None;
    let mut defined = 0u32;
    let mut lean_of: HashMap<u32, u32> = HashMap::new();
    let mut names: HashMap<u32, String> = HashMap::new();
    for payload in Parser::new(0).parse_all(wasm) {
        match payload.ok()? {
            Payload::ImportSection(r) => {
                for imp in r.into_imports() {
                    if matches!(imp.ok()?.ty, wasmparser::TypeRef::Func(_)) {
                        n_imports += 1;
                    }
                }
            }
            Payload::ExportSection(r) => {
                for e in r {
                    let e = e.ok()?;
                    if e.name == abi::STACK_MEMORY && e.kind == wasmparser::ExternalKind::Memory {
                        stack_memory = Some(e.index);
                    }
                }
            }
            Payload::CodeSectionEntry(body) => {
                let index = n_imports + defined;
                defined += 1;
                if !funcs.contains(&index) {
                    continue;
                }
                if let Some(mem) = stack_memory
                    && let Some(fid) = checked_record(&body, mem)
                {
                    lean_of.insert(index, n_imports + fid);
                }
            }
            Payload::CustomSection(c) => {
                if let KnownCustom::Name(r) = c.as_known() {
                    for sub in r {
                        if let Ok(Name::Function(map)) = sub {
                            for n in map.into_iter().flatten() {
                                names.insert(n.index, n.name.to_owned());
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Some(
        funcs
            .iter()
            .map(|f| {
                let shown = lean_of.get(f).copied().unwrap_or(*f);
                (shown, names.get(&shown).cloned())
            })
            .collect(),
    )
}

/// The defined-function index a rewind copy's prologue checks its record against, if `body`
/// is a rewind copy: `i32.load` at offset 0 of the saved-stack memory, `i32.const`, `i32.ne`.
fn checked_record(body: &wasmparser::FunctionBody<'_>, stack_memory: u32) -> Option<u32> {
    let mut ops = body.get_operators_reader().ok()?;
    let mut last: [Option<Operator<'_>>; 2] = [None, None];
    for _ in 0..PROLOGUE_SCAN {
        if ops.eof() {
            return None;
        }
        let op = ops.read().ok()?;
        if let (
            Some(Operator::I32Load { memarg }),
            Some(Operator::I32Const { value }),
            Operator::I32Ne,
        ) = (&last[0], &last[1], &op)
            && memarg.memory == stack_memory
            && memarg.offset == 0
        {
            return u32::try_from(*value).ok();
        }
        last = [last[1].take(), Some(op)];
    }
    None
}
