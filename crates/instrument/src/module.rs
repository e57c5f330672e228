//! Module-level driver: validates the input, decides which functions need instrumenting, runs
//! the per-function transform and assembles the output module.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;

use wasm_encoder::reencode::{Reencode, RoundtripReencoder};
use wasm_encoder::{
    ConstExpr, EntityType, ExportKind, ExportSection, GlobalSection, GlobalType, ImportSection,
    MemorySection, MemoryType, Module, ValType,
};
use wasmparser::{
    ExternalKind, FuncToValidate, FuncType, FunctionBody, Operator, Parser, Payload, TypeRef,
    ValidPayload, Validator, ValidatorResources, WasmFeatures,
};

use crate::abi;
use crate::emit::{self, ModuleCtx, TypeInterner};
use crate::error::InstrumentError;
use crate::plan;

/// An instrumented module and what the transform did.
#[derive(Debug, Clone)]
pub struct Instrumented {
    /// The suspendable module's bytes.
    pub wasm: Vec<u8>,
    /// Counts, for `inspect` and benchmarks.
    pub stats: Stats,
}

/// What the transform did to a module.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Defined functions in the module.
    pub functions: u32,
    /// Of those, how many can be on the stack at a safe point and were instrumented.
    pub instrumented: u32,
    /// Unwind-capable call sites.
    pub call_sites: u32,
    /// Safe-point polls: loop headers, returns of calls inside a call-graph cycle, and the
    /// entries of cyclic functions where such a return cannot poll.
    pub polls: u32,
    /// Of those, function entries.
    pub entry_polls: u32,
    /// Loop polls the lean copy skips when the loop's entry values show it ends soon: counted
    /// leaf loops (v15), each also emitted without its poll.
    pub counted_loops: u32,
}

/// The proposals ferry can suspend. Threads, tail calls, GC and the legacy exception
/// instructions (`try`/`catch`/`delegate`) are refused with the validator's message naming the
/// proposal.
fn supported_features() -> WasmFeatures {
    WasmFeatures::WASM2
        | WasmFeatures::MULTI_MEMORY
        | WasmFeatures::EXTENDED_CONST
        | WasmFeatures::FLOATS
        | WasmFeatures::EXCEPTIONS
}

/// Per-function facts gathered before the transform.
#[derive(Debug, Default, Clone)]
pub(crate) struct FuncFacts {
    pub has_loop: bool,
    pub calls_defined: bool,
    pub calls_unwinding_import: bool,
    /// Defined functions called directly (original indices).
    pub callees: Vec<u32>,
    /// Functions whose reference the body takes (`ref.func`).
    pub refs: Vec<u32>,
    /// On a cycle of the call graph: the only way to run unboundedly without a loop.
    pub recursive: bool,
    /// Type indices of the body's `call_indirect`s.
    pub indirect_types: Vec<u32>,
    /// Data segments the body drops (`data.drop`).
    pub drops: Vec<u32>,
    /// Can reach a safe point (a poll, or a blocking import) while it is on the stack:
    /// computed over the call graph by [`mark_unwinding`].
    pub can_unwind: bool,
}

impl FuncFacts {
    /// Can this function be on the stack at a safe point?
    pub fn instrumented(&self) -> bool {
        self.can_unwind
    }
    /// Is site 0 kept for an entry poll? Only functions on a call-graph cycle can run
    /// unboundedly without passing a loop header. Their calls inside the cycle's component
    /// poll on return instead (v14); the entry poll is emitted only where one of those
    /// cannot (see `Emitted::unsaved_return_polls`).
    pub fn entry_poll(&self) -> bool {
        self.recursive
    }
}

/// Renumbers function indices after ferry's poll import is added at the end of the imports,
/// and turns each `data.drop` into a call of the function that drops the segment and records
/// the drop (see [`Drops`]).
pub(crate) struct Shift {
    imported_funcs: u32,
    /// Data segment → the function (output index) that drops it and records that it did.
    drop_calls: HashMap<u32, u32>,
}

impl Reencode for Shift {
    type Error = Infallible;
    fn function_index(
        &mut self,
        func: u32,
    ) -> Result<u32, wasm_encoder::reencode::Error<Infallible>> {
        Ok(if func >= self.imported_funcs {
            func + 1
        } else {
            func
        })
    }

    fn instruction<'a>(
        &mut self,
        op: Operator<'a>,
    ) -> Result<wasm_encoder::Instruction<'a>, wasm_encoder::reencode::Error<Infallible>> {
        if let Operator::DataDrop { data_index } = op
            && let Some(&f) = self.drop_calls.get(&data_index)
        {
            return Ok(wasm_encoder::Instruction::Call(f));
        }
        wasm_encoder::reencode::utils::instruction(self, op)
    }
}

/// The data segments a module drops, which a snapshot must remember: a resume instantiates
/// the module afresh, with every passive segment whole again, and a `memory.init` of a
/// dropped segment would then copy it where the uninterrupted run traps.
///
/// Each `data.drop N` becomes a call of a function that drops N and sets a mutable global
/// (`ferry:global:<index>`, captured and restored with the module's own globals). The rewind
/// entry points the host calls on a resume (`ferry:rewind:<export>`) become functions that
/// first drop again every segment whose global is set, then call the rewind copy. A module
/// that drops no segment gets none of this (its output is as before).
struct Drops {
    /// The dropped segments, in increasing order.
    segments: Vec<u32>,
    /// Output index of the global of `segments[0]`; the others follow.
    first_global: u32,
    /// Output index of the function that drops `segments[0]`; the others follow.
    first_func: u32,
    /// Original index of an exported (or start) function with a rewind copy → output index of
    /// its rewind entry point.
    entry_of: HashMap<u32, u32>,
}

impl Drops {
    /// The function that drops `segments[k]` and sets its flag: `[] -> []`.
    fn drop_function(&self, k: usize) -> wasm_encoder::Function {
        use wasm_encoder::Instruction as I;
        let mut f = wasm_encoder::Function::new([]);
        f.instruction(&I::DataDrop(self.segments[k]))
            .instruction(&I::I32Const(1))
            .instruction(&I::GlobalSet(self.first_global + k as u32))
            .instruction(&I::End);
        f
    }

    /// The rewind entry point of function `f` (original index): drops again each segment
    /// whose flag is set, then calls `f`'s rewind copy with its own arguments.
    fn rewind_entry(
        &self,
        f: u32,
        ctx: &ModuleCtx<'_>,
        func_types: &[Option<FuncType>],
        func_type_of: &[u32],
    ) -> Result<wasm_encoder::Function, InstrumentError> {
        use wasm_encoder::Instruction as I;
        let copy = ctx.rewind_func[f as usize]
            .ok_or_else(|| InstrumentError::Internal(format!("function {f} has no rewind copy")))?;
        let n_params = func_types
            .get(func_type_of[f as usize] as usize)
            .and_then(Option::as_ref)
            .map(|t| t.params().len() as u32)
            .ok_or_else(|| InstrumentError::Internal(format!("function {f} has no type")))?;
        let mut body = wasm_encoder::Function::new([]);
        for (k, &seg) in self.segments.iter().enumerate() {
            body.instruction(&I::GlobalGet(self.first_global + k as u32))
                .instruction(&I::If(wasm_encoder::BlockType::Empty))
                .instruction(&I::DataDrop(seg))
                .instruction(&I::End);
        }
        for p in 0..n_params {
            body.instruction(&I::LocalGet(p));
        }
        body.instruction(&I::Call(copy)).instruction(&I::End);
        Ok(body)
    }
}

/// Makes `wasm` suspendable. See the crate documentation for what that means.
pub fn instrument(wasm: &[u8]) -> Result<Instrumented, InstrumentError> {
    instrument_inner(wasm, true, false)
}

/// The counting build of [`instrument`]'s output, for deterministic tests that suspend at
/// the n-th safe point: identical frames, sites and records — a snapshot of either resumes in
/// either — but every poll of the lean copies calls `ferry.poll` (where the host counts)
/// instead of unwinding by itself, which makes hot loops slower. A machine-local artefact:
/// snapshots name the ordinary build.
pub fn instrument_counting(wasm: &[u8]) -> Result<Instrumented, InstrumentError> {
    instrument_inner(wasm, true, true)
}

/// Like [`instrument`] but without requiring a `_start` export: for fuzzing the transform
/// with generated modules.
#[doc(hidden)]
pub fn instrument_any(wasm: &[u8]) -> Result<Instrumented, InstrumentError> {
    instrument_inner(wasm, false, false)
}

/// [`instrument_counting`] without requiring a `_start` export (fuzzing).
#[doc(hidden)]
pub fn instrument_any_counting(wasm: &[u8]) -> Result<Instrumented, InstrumentError> {
    instrument_inner(wasm, false, true)
}

fn instrument_inner(
    wasm: &[u8],
    require_start: bool,
    counting: bool,
) -> Result<Instrumented, InstrumentError> {
    if wasm.len() < 8 || &wasm[..4] != b"\0asm" {
        return Err(InstrumentError::NotWasm);
    }
    if wasm[4..8] != [1, 0, 0, 0] {
        return Err(InstrumentError::Component);
    }

    let mut validator = Validator::new_with_features(supported_features());
    let mut sections: Vec<Payload<'_>> = Vec::new();
    let mut bodies: Vec<(FuncToValidate<ValidatorResources>, FunctionBody<'_>)> = Vec::new();
    let mut func_types: Vec<Option<FuncType>> = Vec::new();
    let mut func_type_of: Vec<u32> = Vec::new(); // by original function index
    let mut imports: Vec<(String, String)> = Vec::new(); // function imports
    let mut mutable_globals: Vec<u32> = Vec::new();
    let mut n_globals = 0u32;
    let mut n_memories = 0u32;
    let mut n_tables = 0u32;
    // Functions reachable through tables (targets of indirect calls).
    let mut address_taken: Vec<u32> = Vec::new();
    let mut has_start_export = false;
    // Functions the host may call: exports and the start function (original indices).
    let mut entries: Vec<u32> = Vec::new();

    for payload in Parser::new(0).parse_all(wasm) {
        let payload = payload?;
        let valid = validator.payload(&payload).map_err(|e| classify(wasm, e))?;
        if let ValidPayload::Func(f, body) = valid {
            bodies.push((f, body));
            continue;
        }
        match &payload {
            Payload::TypeSection(r) => {
                for group in r.clone() {
                    for sub in group?.into_types() {
                        func_types.push(match sub.composite_type.inner {
                            wasmparser::CompositeInnerType::Func(f) => Some(f),
                            _ => None,
                        });
                    }
                }
            }
            Payload::ImportSection(r) => {
                for imp in r.clone().into_imports() {
                    let imp = imp?;
                    match imp.ty {
                        TypeRef::Func(t) | TypeRef::FuncExact(t) => {
                            func_type_of.push(t);
                            imports.push((imp.module.to_owned(), imp.name.to_owned()));
                        }
                        _ => {
                            return Err(InstrumentError::Unsupported(format!(
                                "import `{}.{}` is not a function; ferry provides only functions \
                                 to guests",
                                imp.module, imp.name
                            )));
                        }
                    }
                }
            }
            Payload::FunctionSection(r) => {
                for t in r.clone() {
                    func_type_of.push(t?);
                }
            }
            Payload::MemorySection(r) => n_memories += r.count(),
            Payload::TableSection(r) => n_tables += r.count(),
            Payload::ElementSection(r) => {
                for e in r.clone() {
                    match e?.items {
                        wasmparser::ElementItems::Functions(fs) => {
                            for f in fs {
                                address_taken.push(f?);
                            }
                        }
                        wasmparser::ElementItems::Expressions(_, es) => {
                            for expr in es {
                                let mut ops = expr?.get_operators_reader();
                                while !ops.eof() {
                                    if let Operator::RefFunc { function_index } = ops.read()? {
                                        address_taken.push(function_index);
                                    }
                                }
                            }
                        }
                    }
                }
            }
            Payload::GlobalSection(r) => {
                for g in r.clone() {
                    let ty = g?.ty;
                    if ty.mutable {
                        if let wasmparser::ValType::Ref(_) = ty.content_type {
                            return Err(InstrumentError::Unsupported(format!(
                                "mutable global {n_globals} holds a reference, which a snapshot \
                                 cannot capture"
                            )));
                        }
                        mutable_globals.push(n_globals);
                    }
                    n_globals += 1;
                }
            }
            Payload::ExportSection(r) => {
                for e in r.clone() {
                    let e = e?;
                    // A command's `_start`, or a reactor's `_initialize` (its entry is named
                    // when it runs).
                    if matches!(e.name, "_start" | "_initialize") && e.kind == ExternalKind::Func {
                        has_start_export = true;
                    }
                    if e.kind == ExternalKind::Func {
                        entries.push(e.index);
                    }
                    if e.name.starts_with("ferry:") {
                        return Err(InstrumentError::Unsupported(format!(
                            "export `{}` uses the reserved `ferry:` prefix (already instrumented?)",
                            e.name
                        )));
                    }
                }
            }
            Payload::StartSection { func, .. } => entries.push(*func),
            _ => {}
        }
        sections.push(payload);
    }
    if require_start && !has_start_export {
        return Err(InstrumentError::NoStart);
    }

    let n_imported = imports.len() as u32;
    let unwinding_import: Vec<bool> = imports
        .iter()
        .map(|(m, n)| abi::UNWINDING_IMPORTS.contains(&(m.as_str(), n.as_str())))
        .collect();

    // Facts per defined function, then which call sites matter.
    let mut facts = Vec::with_capacity(bodies.len());
    for (_, body) in &bodies {
        facts.push(scan(body, n_imported, &unwinding_import)?);
    }
    address_taken.extend(facts.iter().flat_map(|f| f.refs.iter().copied()));
    let (scc_of_func, scc_of_type) = mark_recursive(
        &mut facts,
        n_imported,
        &address_taken,
        &func_type_of,
        &func_types,
    );
    let unwinding_sigs = mark_unwinding(
        &mut facts,
        &unwinding_import,
        &address_taken,
        &func_type_of,
        &func_types,
    );
    let mut is_site_callee: Vec<bool> = unwinding_import.clone();
    is_site_callee.extend(facts.iter().map(FuncFacts::instrumented));
    // A `call_indirect` can unwind only if some function its type admits can.
    let is_site_indirect: Vec<bool> = func_types
        .iter()
        .map(|t| t.as_ref().is_some_and(|t| unwinding_sigs.contains(t)))
        .collect();

    // Rewind copies are appended after every defined function (output numbering: imports,
    // ferry.poll, defined functions, rewind copies), rewind tables after every table.
    let n_defined = bodies.len() as u32;
    let mut rewind_func: Vec<Option<u32>> = vec![None; (n_imported + n_defined) as usize];
    let mut rewind_order = Vec::new();
    for (i, f) in facts.iter().enumerate() {
        if f.instrumented() {
            rewind_func[n_imported as usize + i] =
                Some(n_imported + 1 + n_defined + rewind_order.len() as u32);
            rewind_order.push(i);
        }
    }
    let rewind_table: Vec<u32> = (0..n_tables).map(|t| n_tables + t).collect();

    // Functions after the rewind copies: one per dropped segment, then the rewind entry
    // points (only when some segment is dropped).
    let mut segments: Vec<u32> = facts.iter().flat_map(|f| f.drops.iter().copied()).collect();
    segments.sort_unstable();
    segments.dedup();
    let first_func = n_imported + 1 + n_defined + rewind_order.len() as u32;
    let mut entry_of = HashMap::new();
    if !segments.is_empty() {
        entries.sort_unstable();
        entries.dedup();
        for &f in &entries {
            if rewind_func.get(f as usize).copied().flatten().is_some() {
                let at = first_func + segments.len() as u32 + entry_of.len() as u32;
                entry_of.insert(f, at);
            }
        }
    }
    let drops = Drops {
        first_global: n_globals + 3,
        first_func,
        segments,
        entry_of,
    };

    let mut interner = TypeInterner::new(func_types.len() as u32);
    let poll_type = interner.intern(&[], &[]);
    let ctx = ModuleCtx {
        rewind_func: &rewind_func,
        rewind_table: &rewind_table,
        func_types: &func_types,
        func_type_of: &func_type_of,
        is_site_callee: &is_site_callee,
        is_site_indirect: &is_site_indirect,
        n_imported,
        poll_func: n_imported,
        state_global: n_globals,
        sp_global: n_globals + 1,
        room_global: n_globals + 2,
        counting,
        ctl_memory: n_memories,
        stack_memory: n_memories + 1,
        scc_of_func: &scc_of_func,
        scc_of_type: &scc_of_type,
    };

    let mut stats = Stats {
        functions: bodies.len() as u32,
        ..Stats::default()
    };
    let mut code = wasm_encoder::CodeSection::new();
    let mut shift = Shift {
        imported_funcs: n_imported,
        drop_calls: drops
            .segments
            .iter()
            .enumerate()
            .map(|(k, &seg)| (seg, drops.first_func + k as u32))
            .collect(),
    };
    let mut rewind_code = Vec::new();
    // The largest frame record (bytes, as pushed): the room an epilogue may need.
    let mut largest_record = 16u32;
    let mut hints = wasm_encoder::BranchHints::new();
    for (i, ((fv, body), facts)) in bodies.into_iter().zip(&facts).enumerate() {
        let defined_index = i as u32;
        if !facts.instrumented() {
            shift
                .parse_function_body(&mut code, body)
                .map_err(|e| InstrumentError::Invalid(e.to_string()))?;
            continue;
        }
        let plan = plan::plan(&fv, &body, facts.entry_poll(), &ctx)?;
        stats.instrumented += 1;
        stats.call_sites += plan.n_sites - plan.n_polls - u32::from(plan.entry_poll);
        stats.polls += plan.n_polls;
        stats.counted_loops += plan.counted.len() as u32;
        // The rewind copy first: it fixes the frame-record layout both copies share.
        let fv2 = FuncToValidate {
            resources: fv.resources.clone(),
            ..fv
        };
        let fv3 = FuncToValidate {
            resources: fv.resources.clone(),
            ..fv
        };
        let mut emitted = emit::emit(
            &ctx,
            &mut interner,
            &mut shift,
            fv,
            &body,
            &plan,
            defined_index,
            emit::Copy::Rewind,
            None,
            false,
        )?;
        // A call inside the cycle whose return cannot poll leaves that cycle without a safe
        // point: poll on entry instead, as up to v13.
        let entry_poll = emitted.unsaved_return_polls > 0;
        stats.polls -= emitted.unsaved_return_polls;
        if entry_poll {
            emitted = emit::emit(
                &ctx,
                &mut interner,
                &mut shift,
                fv3,
                &body,
                &plan,
                defined_index,
                emit::Copy::Rewind,
                None,
                true,
            )?;
        }
        stats.polls += u32::from(entry_poll);
        stats.entry_polls += u32::from(entry_poll);
        let (rewind, layout) = (emitted.function, emitted.layout);
        let lean = emit::emit(
            &ctx,
            &mut interner,
            &mut shift,
            fv2,
            &body,
            &plan,
            defined_index,
            emit::Copy::Lean,
            Some(&layout),
            entry_poll,
        )?;
        let (lean, lean_layout, unlikely) = (lean.function, lean.layout, lean.unlikely);
        if lean_layout.record_len() != layout.record_len() {
            return Err(InstrumentError::Internal(format!(
                "function {defined_index}: the two copies disagree on the frame layout"
            )));
        }
        largest_record = largest_record.max(layout.record_size());
        code.function(&lean);
        if !unlikely.is_empty() {
            // The lean copy keeps the function's index (after the one added import).
            hints.function_hints(
                n_imported + 1 + defined_index,
                unlikely.into_iter().map(|at| wasm_encoder::BranchHint {
                    branch_func_offset: at,
                    branch_hint_value: 0,
                }),
            );
        }
        rewind_code.push(rewind);
    }
    for f in &rewind_code {
        code.function(f);
    }
    // The types of the functions appended after the defined ones, in order.
    let mut appended_types: Vec<u32> = rewind_order
        .iter()
        .map(|&i| func_type_of[n_imported as usize + i])
        .collect();
    for k in 0..drops.segments.len() {
        code.function(&drops.drop_function(k));
        appended_types.push(poll_type);
    }
    let mut rewind_entries: Vec<(u32, u32)> =
        drops.entry_of.iter().map(|(&f, &at)| (at, f)).collect();
    rewind_entries.sort_unstable();
    for (_, f) in rewind_entries {
        code.function(&drops.rewind_entry(f, &ctx, &func_types, &func_type_of)?);
        appended_types.push(func_type_of[f as usize]);
    }

    let out = assemble(
        sections,
        &ctx,
        &appended_types,
        interner,
        poll_type,
        (code, hints),
        (n_memories, largest_record),
        &mutable_globals,
        &drops,
    )?;
    // The output is checked, so a transform bug surfaces here and not as a guest crash.
    if let Err(e) = Validator::new_with_features(supported_features()).validate_all(&out) {
        // Bodies of functions copied unchanged were not validated on the way in: an input
        // that is itself invalid, or uses an unsupported proposal there, is named as such.
        if let Err(e) = Validator::new_with_features(supported_features()).validate_all(wasm) {
            return Err(classify(wasm, e));
        }
        // For bug reports: FERRY_DUMP_INVALID=path keeps the invalid output.
        if let Some(p) = std::env::var_os("FERRY_DUMP_INVALID") {
            let _ = std::fs::write(p, &out);
        }
        return Err(InstrumentError::Internal(e.to_string()));
    }
    Ok(Instrumented { wasm: out, stats })
}

/// Tells an invalid module from a valid one that uses a proposal ferry does not support.
fn classify(wasm: &[u8], e: wasmparser::BinaryReaderError) -> InstrumentError {
    if Validator::new_with_features(WasmFeatures::all())
        .validate_all(wasm)
        .is_ok()
    {
        InstrumentError::Unsupported(e.to_string())
    } else {
        InstrumentError::Invalid(e.to_string())
    }
}

/// Walks a body once to learn what it calls and whether it loops.
fn scan(
    body: &FunctionBody<'_>,
    n_imported: u32,
    unwinding_import: &[bool],
) -> Result<FuncFacts, InstrumentError> {
    let mut facts = FuncFacts::default();
    let mut reader = body.get_operators_reader()?;
    while !reader.eof() {
        match reader.read()? {
            Operator::Loop { .. } => facts.has_loop = true,
            Operator::Call { function_index } => {
                if function_index >= n_imported {
                    facts.calls_defined = true;
                    facts.callees.push(function_index);
                } else if unwinding_import[function_index as usize] {
                    facts.calls_unwinding_import = true;
                }
            }
            Operator::CallIndirect { type_index, .. } => facts.indirect_types.push(type_index),
            Operator::DataDrop { data_index } => facts.drops.push(data_index),
            Operator::RefFunc { function_index } => facts.refs.push(function_index),
            Operator::TableSet { .. }
            | Operator::TableGrow { .. }
            | Operator::TableFill { .. }
            | Operator::TableCopy { .. }
            | Operator::TableInit { .. } => {
                return Err(InstrumentError::Unsupported(
                    "tables modified at run time (table.set/grow/fill/copy/init): their contents \
                     cannot be captured yet"
                        .into(),
                ));
            }
            _ => {}
        }
    }
    Ok(facts)
}

#[allow(clippy::too_many_arguments)] // one caller; the pieces are all distinct
fn assemble(
    sections: Vec<Payload<'_>>,
    ctx: &ModuleCtx<'_>,
    appended_types: &[u32],
    interner: TypeInterner,
    poll_type: u32,
    (code, hints): (wasm_encoder::CodeSection, wasm_encoder::BranchHints),
    (n_memories, largest_record): (u32, u32),
    mutable_globals: &[u32],
    drops: &Drops,
) -> Result<Vec<u8>, InstrumentError> {
    let err =
        |e: wasm_encoder::reencode::Error<Infallible>| InstrumentError::Invalid(e.to_string());
    let mut shift = Shift {
        imported_funcs: ctx.n_imported,
        drop_calls: HashMap::new(),
    };
    // What the host calls to rewind function `f` (original index).
    let rewind_entry = |f: u32| -> Option<u32> {
        let copy = ctx.rewind_func.get(f as usize).copied().flatten()?;
        Some(drops.entry_of.get(&f).copied().unwrap_or(copy))
    };
    let mut module = Module::new();
    let mut customs = Vec::new();

    let mut types = wasm_encoder::TypeSection::new();
    let mut imports = ImportSection::new();
    let mut memories = MemorySection::new();
    let mut globals = GlobalSection::new();
    let mut tags = None;
    let mut exports = ExportSection::new();
    let mut functions = None;
    let mut tables = None;
    let mut start = None;
    let mut elements = None;
    let mut datacount = None;
    let mut data = None;

    for payload in sections {
        match payload {
            Payload::TypeSection(r) => shift.parse_type_section(&mut types, r).map_err(err)?,
            Payload::ImportSection(r) => {
                shift.parse_import_section(&mut imports, r).map_err(err)?
            }
            Payload::FunctionSection(r) => {
                let mut s = wasm_encoder::FunctionSection::new();
                shift.parse_function_section(&mut s, r).map_err(err)?;
                for &t in appended_types {
                    s.function(t);
                }
                functions = Some(s);
            }
            Payload::TableSection(r) => {
                let mut s = wasm_encoder::TableSection::new();
                shift.parse_table_section(&mut s, r.clone()).map_err(err)?;
                // The rewind tables: same types, filled below with the rewind copies.
                for t in r {
                    let t = t?;
                    s.table(shift.table_type(t.ty).map_err(err)?);
                }
                tables = Some(s);
            }
            Payload::MemorySection(r) => {
                shift.parse_memory_section(&mut memories, r).map_err(err)?
            }
            Payload::GlobalSection(r) => {
                shift.parse_global_section(&mut globals, r).map_err(err)?
            }
            Payload::TagSection(r) => {
                let mut s = wasm_encoder::TagSection::new();
                shift.parse_tag_section(&mut s, r).map_err(err)?;
                tags = Some(s);
            }
            Payload::ExportSection(r) => {
                shift
                    .parse_export_section(&mut exports, r.clone())
                    .map_err(err)?;
                for e in r {
                    let e = e?;
                    if let (ExternalKind::Func, Some(f)) = (e.kind, rewind_entry(e.index)) {
                        exports.export(&abi::rewind_export(e.name), ExportKind::Func, f);
                    }
                }
            }
            // The start function becomes an export the host calls itself, so that a resume
            // (which instantiates the module again) does not run it a second time.
            Payload::StartSection { func, .. } => {
                start = Some((shift.function_index(func).map_err(err)?, rewind_entry(func)))
            }
            Payload::ElementSection(r) => {
                let mut s = wasm_encoder::ElementSection::new();
                shift
                    .parse_element_section(&mut s, r.clone())
                    .map_err(err)?;
                rewind_elements(&mut s, r, ctx, &mut shift)?;
                elements = Some(s);
            }
            Payload::DataCountSection { count, .. } => {
                datacount = Some(wasm_encoder::DataCountSection { count })
            }
            Payload::DataSection(r) => {
                let mut s = wasm_encoder::DataSection::new();
                shift.parse_data_section(&mut s, r).map_err(err)?;
                data = Some(s);
            }
            Payload::CustomSection(c) => customs.push(c),
            _ => {}
        }
    }

    interner.append_to(&mut types);
    imports.import(abi::MODULE, abi::POLL, EntityType::Function(poll_type));
    let fixed = |pages| MemoryType {
        minimum: pages,
        maximum: Some(pages),
        memory64: false,
        shared: false,
        page_size_log2: None,
    };
    memories.memory(fixed(1));
    memories.memory(MemoryType {
        maximum: None,
        // Room for an innermost frame's record (pushed at 0 without growing the memory) and
        // its caller's (see `emit::Emitter::epilogue`).
        ..fixed((2 * u64::from(largest_record)).div_ceil(65536))
    });
    let i32_mut = GlobalType {
        val_type: ValType::I32,
        mutable: true,
        shared: false,
    };
    globals.global(i32_mut, &ConstExpr::i32_const(0));
    globals.global(i32_mut, &ConstExpr::i32_const(0));
    globals.global(
        GlobalType {
            mutable: false,
            ..i32_mut
        },
        &ConstExpr::i32_const(largest_record as i32),
    );
    // One flag per dropped data segment, captured like the module's own globals.
    for _ in &drops.segments {
        globals.global(i32_mut, &ConstExpr::i32_const(0));
    }
    exports.export(abi::CTL_MEMORY, ExportKind::Memory, ctx.ctl_memory);
    exports.export(abi::STACK_MEMORY, ExportKind::Memory, ctx.stack_memory);
    exports.export(abi::STATE_GLOBAL, ExportKind::Global, ctx.state_global);
    exports.export(abi::SP_GLOBAL, ExportKind::Global, ctx.sp_global);
    if let Some((f, rewind)) = start {
        exports.export(abi::START_EXPORT, ExportKind::Func, f);
        if let Some(r) = rewind {
            exports.export(&abi::rewind_export(abi::START_EXPORT), ExportKind::Func, r);
        }
    }
    for m in 0..n_memories {
        exports.export(&abi::memory_export(m), ExportKind::Memory, m);
    }
    let flags = drops.first_global..drops.first_global + drops.segments.len() as u32;
    for g in mutable_globals.iter().copied().chain(flags) {
        exports.export(&abi::global_export(g), ExportKind::Global, g);
    }

    module.section(&types);
    module.section(&imports);
    if let Some(s) = &functions {
        module.section(s);
    }
    if let Some(s) = &tables {
        module.section(s);
    }
    module.section(&memories);
    if let Some(s) = &tags {
        module.section(s);
    }
    module.section(&globals);
    module.section(&exports);
    if let Some(s) = &elements {
        module.section(s);
    }
    if let Some(s) = &datacount {
        module.section(s);
    }
    // Branch hints must precede the code section they describe.
    if !hints.is_empty() {
        module.section(&hints);
    }
    module.section(&code);
    if let Some(s) = &data {
        module.section(s);
    }
    for c in customs {
        match c.as_known() {
            wasmparser::KnownCustom::Name(name) => {
                module.section(&shift.custom_name_section(name).map_err(err)?);
            }
            // The input's hints name offsets in code that no longer exists as it was.
            wasmparser::KnownCustom::BranchHints(_) => {}
            _ => {
                module.section(&RoundtripReencoder.custom_section(c).map_err(err)?);
            }
        }
    }
    Ok(module.finish())
}

/// Copies every active element segment into the matching rewind table, with each
/// instrumented function replaced by its rewind copy, so an indirect call made while
/// rewinding reaches the rewind copy of the function the table holds.
fn rewind_elements(
    out: &mut wasm_encoder::ElementSection,
    reader: wasmparser::ElementSectionReader<'_>,
    ctx: &ModuleCtx<'_>,
    shift: &mut Shift,
) -> Result<(), InstrumentError> {
    let map = |f: u32| -> u32 {
        ctx.rewind_func
            .get(f as usize)
            .copied()
            .flatten()
            .unwrap_or(if f >= ctx.n_imported { f + 1 } else { f })
    };
    for e in reader {
        let e = e?;
        let wasmparser::ElementKind::Active {
            table_index,
            offset_expr,
        } = e.kind
        else {
            continue;
        };
        let table = ctx.rewind_table[table_index.unwrap_or(0) as usize];
        let offset = shift
            .const_expr(offset_expr)
            .map_err(|e| InstrumentError::Invalid(e.to_string()))?;
        match e.items {
            wasmparser::ElementItems::Functions(r) => {
                let fs = r
                    .into_iter()
                    .map(|f| f.map(map))
                    .collect::<Result<Vec<_>, _>>()?;
                out.active(
                    Some(table),
                    &offset,
                    wasm_encoder::Elements::Functions(fs.into()),
                );
            }
            wasmparser::ElementItems::Expressions(ty, r) => {
                let mut exprs = Vec::new();
                for expr in r {
                    let mut ops = expr?.get_operators_reader();
                    let c = match ops.read()? {
                        wasmparser::Operator::RefFunc { function_index } => {
                            ConstExpr::ref_func(map(function_index))
                        }
                        wasmparser::Operator::RefNull { hty } => ConstExpr::ref_null(
                            shift
                                .heap_type(hty)
                                .map_err(|e| InstrumentError::Invalid(e.to_string()))?,
                        ),
                        other => {
                            return Err(InstrumentError::Unsupported(format!(
                                "element expression {other:?}"
                            )));
                        }
                    };
                    exprs.push(c);
                }
                let ty = shift
                    .ref_type(ty)
                    .map_err(|e| InstrumentError::Invalid(e.to_string()))?;
                out.active(
                    Some(table),
                    &offset,
                    wasm_encoder::Elements::Expressions(ty, exprs.into()),
                );
            }
        }
    }
    Ok(())
}

/// Marks the defined functions on a cycle of the call graph (Tarjan's algorithm, iterative).
/// An indirect call may reach any function whose address is taken.
/// Which functions can reach a safe point while on the stack: those with a loop, a blocking
/// import call or recursion (they poll), and, transitively, their direct callers and the
/// callers through `call_indirect` of any type an address-taken unwinding function has.
/// Returns those function types (an indirect call of another type cannot unwind: its target
/// must have exactly its type).
fn mark_unwinding(
    facts: &mut [FuncFacts],
    unwinding_import: &[bool],
    address_taken: &[u32],
    func_type_of: &[u32],
    func_types: &[Option<FuncType>],
) -> HashSet<FuncType> {
    let n_imported = unwinding_import.len();
    let sig = |f: usize| -> Option<FuncType> {
        func_type_of
            .get(f)
            .and_then(|&t| func_types.get(t as usize))
            .cloned()
            .flatten()
    };
    let mut callers: Vec<Vec<usize>> = vec![Vec::new(); facts.len()];
    let mut callers_by_sig: HashMap<FuncType, Vec<usize>> = HashMap::new();
    for (i, f) in facts.iter().enumerate() {
        for &c in &f.callees {
            if let Some(c) = (c as usize).checked_sub(n_imported)
                && c < facts.len()
            {
                callers[c].push(i);
            }
        }
        for &t in &f.indirect_types {
            if let Some(Some(ty)) = func_types.get(t as usize) {
                callers_by_sig.entry(ty.clone()).or_default().push(i);
            }
        }
    }
    let mut taken = vec![false; n_imported + facts.len()];
    for &f in address_taken {
        if let Some(t) = taken.get_mut(f as usize) {
            *t = true;
        }
    }
    let mut sigs = HashSet::new();
    let mut work = Vec::new();
    for (i, f) in facts.iter_mut().enumerate() {
        f.can_unwind = f.has_loop || f.calls_unwinding_import || f.recursive;
        if f.can_unwind {
            work.push(i);
        }
    }
    // Blocking imports placed in a table unwind through indirect calls too.
    let mut new_sigs: Vec<FuncType> = (0..n_imported)
        .filter(|&f| unwinding_import[f] && taken[f])
        .filter_map(sig)
        .collect();
    loop {
        for s in new_sigs.drain(..) {
            if sigs.insert(s.clone()) {
                for &g in callers_by_sig.get(&s).into_iter().flatten() {
                    if !facts[g].can_unwind {
                        facts[g].can_unwind = true;
                        work.push(g);
                    }
                }
            }
        }
        let Some(f) = work.pop() else { break };
        for &g in &callers[f] {
            if !facts[g].can_unwind {
                facts[g].can_unwind = true;
                work.push(g);
            }
        }
        if taken[n_imported + f]
            && let Some(s) = sig(n_imported + f)
            && !sigs.contains(&s)
        {
            new_sigs.push(s);
        }
    }
    sigs
}

/// Marks the functions on a call-graph cycle and returns the strongly connected component of
/// each cyclic function (by function index, imports included) and of each function type's
/// indirect-call node (by type index); `u32::MAX` where there is no cycle. An edge inside one
/// component is the only kind a cycle can use, so those are the calls that get a return poll.
fn mark_recursive(
    facts: &mut [FuncFacts],
    n_imported: u32,
    address_taken: &[u32],
    func_type_of: &[u32],
    func_types: &[Option<FuncType>],
) -> (Vec<u32>, Vec<u32>) {
    let n = facts.len();
    let defined = |f: u32| {
        (f >= n_imported)
            .then(|| (f - n_imported) as usize)
            .filter(|&i| i < n)
    };
    // One node per defined function, plus one per function type some `call_indirect` uses:
    // an indirect call of type t reaches exactly the address-taken functions of type t, so
    // the caller gets an edge to t's node and t's node one to each of them. (An edge from
    // every indirect caller to every address-taken function, up to v12, made 10^9 edges and
    // 7.5 GB for CPython 3.15 + numpy.)
    let mut edges: Vec<Vec<usize>> = facts
        .iter()
        .map(|f| f.callees.iter().filter_map(|&c| defined(c)).collect())
        .collect();
    let mut type_node: HashMap<FuncType, usize> = HashMap::new();
    for (i, f) in facts.iter().enumerate() {
        for &t in &f.indirect_types {
            if let Some(Some(ty)) = func_types.get(t as usize) {
                let node = *type_node.entry(ty.clone()).or_insert_with(|| {
                    edges.push(Vec::new());
                    edges.len() - 1
                });
                edges[i].push(node);
            }
        }
    }
    let mut taken: Vec<usize> = address_taken.iter().filter_map(|&f| defined(f)).collect();
    taken.sort_unstable();
    taken.dedup();
    for d in taken {
        let ty = func_type_of
            .get(d + n_imported as usize)
            .and_then(|&t| func_types.get(t as usize))
            .and_then(Option::as_ref);
        if let Some(&node) = ty.and_then(|ty| type_node.get(ty)) {
            edges[node].push(d);
        }
    }
    let n = edges.len();
    let mut scc = vec![u32::MAX; n];
    let mut n_scc = 0u32;
    let (mut index, mut low, mut on_stack) = (vec![usize::MAX; n], vec![0; n], vec![false; n]);
    let (mut stack, mut next) = (Vec::new(), 0usize);
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        let mut work = vec![(root, 0usize)];
        while let Some(&mut (v, ref mut i)) = work.last_mut() {
            if *i == 0 && index[v] == usize::MAX {
                index[v] = next;
                low[v] = next;
                next += 1;
                stack.push(v);
                on_stack[v] = true;
            }
            if let Some(&w) = edges[v].get(*i) {
                *i += 1;
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut members = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    members.push(w);
                    if w == v {
                        break;
                    }
                }
                let cyclic = members.len() > 1 || edges[v].contains(&v);
                for m in members {
                    if let Some(f) = facts.get_mut(m) {
                        f.recursive = cyclic;
                    }
                    if cyclic {
                        scc[m] = n_scc;
                    }
                }
                n_scc += 1;
            }
        }
    }
    let mut scc_of_func = vec![u32::MAX; n_imported as usize];
    scc_of_func.extend_from_slice(&scc[..facts.len()]);
    let scc_of_type = func_types
        .iter()
        .map(|t| {
            t.as_ref()
                .and_then(|t| type_node.get(t))
                .map_or(u32::MAX, |&node| scc[node])
        })
        .collect();
    (scc_of_func, scc_of_type)
}
