//! What a program may import: the functions of WASI preview 1 that ferry provides (with their
//! types) and [`HOST_DOOR`](crate::host::HOST_DOOR) — no memories, tables, globals or tags.
//! Checked before a module is made suspendable, so a program that needs something else is
//! refused at once — before a big module is instrumented and compiled for minutes — and with
//! the same words on every engine (each engine's own linker words a missing import its own
//! way).

use ferry_wasi::FUNCTIONS;
use wasmparser::{CompositeInnerType, FuncType, Parser, Payload, TypeRef, ValType};

use crate::host::HOST_DOOR;

/// At most this many imports are named in one refusal; the rest are counted.
const NAMED: usize = 5;

/// Why a module's function imports cannot be satisfied. Each message says what ferry gives a
/// program instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    /// Functions ferry does not provide (`module.name`, in import order), and how many there
    /// are in all.
    #[error(
        "the module imports {} ferry does not provide: {}; ferry gives a program the functions \
         of WASI preview 1 (`wasi_snapshot_preview1`) and nothing else (build it for \
         wasm32-wasip1 with every symbol defined)",
        count(*.total, "function"), list(.names, *.total)
    )]
    Unknown { names: Vec<String>, total: usize },
    /// Something other than a function (a memory, table, global or tag), which a program
    /// must define itself.
    #[error(
        "the module imports a {kind}, `{name}`; ferry gives a program only functions (those \
         of WASI preview 1), so it must define its own {kind} (a C program: link it without \
         `--import-memory` or `--import-table`)"
    )]
    NotFunction { name: String, kind: &'static str },
    /// A function ferry provides, imported with another type.
    #[error(
        "the module imports `{name}` as {found}, but ferry provides it as {expected} (the type \
         WASI preview 1 gives it)"
    )]
    WrongType {
        name: String,
        found: String,
        expected: String,
    },
}

fn count(n: usize, what: &str) -> String {
    if n == 1 {
        format!("a {what}")
    } else {
        format!("{n} {what}s")
    }
}

fn list(names: &[String], total: usize) -> String {
    let mut s = names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if total > names.len() {
        s.push_str(&format!(" and {} more", total - names.len()));
    }
    s
}

/// The type ferry gives `module.name`, as (params, results), or `None` if it gives none.
fn provided(module: &str, name: &str) -> Option<(Vec<ValType>, Vec<ValType>)> {
    let wide = |w: bool| if w { ValType::I64 } else { ValType::I32 };
    if (module, name) == HOST_DOOR {
        return Some((vec![ValType::I32; 4], vec![ValType::I32]));
    }
    if module != "wasi_snapshot_preview1" {
        return None;
    }
    let (_, sig) = FUNCTIONS.iter().find(|(n, _)| *n == name)?;
    let params = sig.params.iter().map(|&w| wide(w)).collect();
    let results = if sig.returns {
        vec![ValType::I32]
    } else {
        Vec::new()
    };
    Some((params, results))
}

fn show(params: &[ValType], results: &[ValType]) -> String {
    let join = |ts: &[ValType]| {
        ts.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!("({}) -> ({})", join(params), join(results))
}

/// Checks the function imports of `wasm` against what ferry provides. A module that cannot
/// be read this far passes: making it suspendable refuses it with the reason.
pub fn check(wasm: &[u8]) -> Result<(), ImportError> {
    let mut types: Vec<Option<FuncType>> = Vec::new();
    let mut unknown = Vec::new();
    let mut total = 0;
    for payload in Parser::new(0).parse_all(wasm) {
        let Ok(payload) = payload else { break };
        match payload {
            Payload::Version { encoding, .. } if encoding != wasmparser::Encoding::Module => {
                break;
            }
            Payload::TypeSection(r) => {
                for group in r {
                    let Ok(group) = group else { return Ok(()) };
                    for sub in group.into_types() {
                        types.push(match sub.composite_type.inner {
                            CompositeInnerType::Func(f) => Some(f),
                            _ => None,
                        });
                    }
                }
            }
            Payload::ImportSection(r) => {
                for imp in r.into_imports() {
                    let Ok(imp) = imp else { return Ok(()) };
                    let full_name = || format!("{}.{}", imp.module, imp.name);
                    let t = match imp.ty {
                        TypeRef::Func(t) | TypeRef::FuncExact(t) => t,
                        other => {
                            return Err(ImportError::NotFunction {
                                name: full_name(),
                                kind: match other {
                                    TypeRef::Memory(_) => "memory",
                                    TypeRef::Table(_) => "table",
                                    TypeRef::Global(_) => "global",
                                    _ => "tag",
                                },
                            });
                        }
                    };
                    let Some((params, results)) = provided(imp.module, imp.name) else {
                        total += 1;
                        if unknown.len() < NAMED {
                            unknown.push(full_name());
                        }
                        continue;
                    };
                    let Some(Some(ty)) = types.get(t as usize) else {
                        return Ok(()); // invalid: refused by the transform
                    };
                    if ty.params() != params || ty.results() != results {
                        return Err(ImportError::WrongType {
                            name: full_name(),
                            found: show(ty.params(), ty.results()),
                            expected: show(&params, &results),
                        });
                    }
                }
            }
            Payload::CodeSectionStart { .. } => break,
            _ => {}
        }
    }
    if total > 0 {
        return Err(ImportError::Unknown {
            names: unknown,
            total,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_wat(wat: &str) -> Result<(), ImportError> {
        check(&wat::parse_str(wat).unwrap())
    }

    #[test]
    fn wasi_and_the_host_door_pass() {
        check_wat(
            r#"(module
                (import "wasi_snapshot_preview1" "fd_write" (func (param i32 i32 i32 i32) (result i32)))
                (import "wasi_snapshot_preview1" "proc_exit" (func (param i32)))
                (import "wasi_snapshot_preview1" "clock_time_get" (func (param i32 i64 i32) (result i32)))
                (import "host" "call" (func (param i32 i32 i32 i32) (result i32)))
                (func (export "_start")))"#,
        )
        .unwrap();
    }

    #[test]
    fn unknown_functions_are_named_and_counted() {
        let imports: String = (0..7)
            .map(|i| format!(r#"(import "env" "f{i}" (func))"#))
            .collect();
        let err = check_wat(&format!(
            r#"(module (import "wasi_snapshot_preview1" "sched_yield" (func (result i32)))
               {imports} (func (export "_start")))"#
        ))
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the module imports 7 functions ferry does not provide: `env.f0`, `env.f1`, \
             `env.f2`, `env.f3`, `env.f4` and 2 more; ferry gives a program the functions of \
             WASI preview 1 (`wasi_snapshot_preview1`) and nothing else (build it for \
             wasm32-wasip1 with every symbol defined)"
        );
        let err = check_wat(
            r#"(module (import "wasi_snapshot_preview1" "sock_open" (func)) (func (export "_start")))"#,
        )
        .unwrap_err();
        assert!(
            err.to_string().starts_with(
                "the module imports a function ferry does not provide: \
                 `wasi_snapshot_preview1.sock_open`;"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_wrong_type_names_both() {
        let err = check_wat(
            r#"(module (import "wasi_snapshot_preview1" "fd_write" (func (param i32 i64) (result i32)))
               (func (export "_start")))"#,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the module imports `wasi_snapshot_preview1.fd_write` as (i32, i64) -> (i32), but \
             ferry provides it as (i32, i32, i32, i32) -> (i32) (the type WASI preview 1 gives it)"
        );
    }

    #[test]
    fn a_memory_or_global_import_is_named() {
        let err =
            check_wat(r#"(module (import "env" "memory" (memory 1)) (func (export "_start")))"#)
                .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the module imports a memory, `env.memory`; ferry gives a program only functions \
             (those of WASI preview 1), so it must define its own memory (a C program: link it \
             without `--import-memory` or `--import-table`)"
        );
        let err = check_wat(
            r#"(module (import "env" "__stack_pointer" (global (mut i32))) (func (export "_start")))"#,
        )
        .unwrap_err();
        assert_eq!(
            err,
            ImportError::NotFunction {
                name: "env.__stack_pointer".into(),
                kind: "global"
            }
        );
    }

    #[test]
    fn what_cannot_be_read_is_left_to_the_transform() {
        check(b"\0asm\x0d\0\x01\0").unwrap(); // a component
        check(b"\0asm\x01\0\0\0\x02\x05").unwrap(); // a truncated import section
        check(b"not wasm").unwrap();
    }
}
