//! Phase B of the per-function transform: rewrite one function so it can save and rebuild
//! its frame. See the crate documentation for the shape of the output; in short:
//!
//! ```text
//! block $done (result R)
//!   block $unwind
//!     <prologue: if rewinding, pop this frame's record into the locals>
//!     <body, with every stretch of code between call sites inside `if (!rw) … end`>
//!     br $done
//!   end
//!   <epilogue: push this frame's record>   ;; reached only by `br $unwind`
//!   <dummy R>
//! end
//! ```

use std::collections::HashMap;
use std::convert::Infallible;

use wasm_encoder::reencode::Reencode;
use wasm_encoder::{BlockType, Encode, Function, Instruction as I, MemArg, ValType};
use wasmparser::{
    FuncToValidate, FuncType, FuncValidator, FunctionBody, Operator, OperatorsReader,
    ValidatorResources,
};

use crate::abi;
use crate::counted::{G, Guard};
use crate::error::InstrumentError;
use crate::live::{Liveness, Locals};
use crate::plan::{OpPlan, Plan};

/// Module-wide facts the emitter needs.
#[derive(Debug)]
pub(crate) struct ModuleCtx<'a> {
    pub func_types: &'a [Option<FuncType>],
    pub func_type_of: &'a [u32],
    pub is_site_callee: &'a [bool],
    /// By type index: whether a `call_indirect` of that type can unwind.
    pub is_site_indirect: &'a [bool],
    pub n_imported: u32,
    pub poll_func: u32,
    pub state_global: u32,
    pub sp_global: u32,
    /// Immutable: the largest frame record in the module. The saved-stack memory always has
    /// this much room above `sp` when an epilogue starts (see [`Emitter::epilogue`]).
    pub room_global: u32,
    /// The counting build: lean polls call `ferry.poll` (see `instrument_counting`).
    pub counting: bool,
    pub ctl_memory: u32,
    pub stack_memory: u32,
    /// Index (in the output) of the rewind copy of each instrumented function, by original
    /// function index.
    pub rewind_func: &'a [Option<u32>],
    /// The rewind table of each table (same elements, rewind copies in place of functions).
    pub rewind_table: &'a [u32],
    /// The call-graph component of each function on a cycle (by function index, imports
    /// included) and of each function type's indirect-call node (by type index); `u32::MAX`
    /// for none. A call whose callee is in the caller's component gets a return poll.
    pub scc_of_func: &'a [u32],
    pub scc_of_type: &'a [u32],
}

/// Function types the transform needs for its own blocks, appended after the module's types.
#[derive(Debug)]
pub(crate) struct TypeInterner {
    base: u32,
    map: HashMap<(Vec<ValType>, Vec<ValType>), u32>,
    list: Vec<(Vec<ValType>, Vec<ValType>)>,
}

impl TypeInterner {
    pub fn new(base: u32) -> Self {
        Self {
            base,
            map: HashMap::new(),
            list: Vec::new(),
        }
    }

    pub fn intern(&mut self, params: &[ValType], results: &[ValType]) -> u32 {
        let key = (params.to_vec(), results.to_vec());
        if let Some(&i) = self.map.get(&key) {
            return i;
        }
        let i = self.base + self.list.len() as u32;
        self.list.push(key.clone());
        self.map.insert(key, i);
        i
    }

    fn block_type(&mut self, params: &[ValType], results: &[ValType]) -> BlockType {
        match (params, results) {
            ([], []) => BlockType::Empty,
            ([], [r]) => BlockType::Result(*r),
            _ => BlockType::FunctionType(self.intern(params, results)),
        }
    }

    pub fn append_to(self, types: &mut wasm_encoder::TypeSection) {
        for (p, r) in self.list {
            types.ty().function(p, r);
        }
    }
}

fn val_type(t: wasmparser::ValType) -> Result<ValType, InstrumentError> {
    wasm_encoder::reencode::RoundtripReencoder
        .val_type(t)
        .map_err(|e| InstrumentError::Invalid(e.to_string()))
}

/// Whether a value of type `t` can be written to a frame record. References (an `exnref`
/// held while an exception is handled, a `funcref`) cannot: they are not bytes. A call site
/// where one is live never saves its frame — it *bounces* the unwind (see
/// [`Emitter::bounce`]) — and a poll where one is live is left out.
fn savable(t: ValType) -> bool {
    !matches!(t, ValType::Ref(_))
}

fn val_types(ts: &[wasmparser::ValType]) -> Result<Vec<ValType>, InstrumentError> {
    ts.iter().map(|t| val_type(*t)).collect()
}

fn size_of(t: ValType) -> u32 {
    match t {
        ValType::I32 | ValType::F32 => 4,
        ValType::I64 | ValType::F64 => 8,
        ValType::V128 => 16,
        ValType::Ref(_) => unreachable!("references are never saved"),
    }
}

fn dummy(t: ValType) -> I<'static> {
    match t {
        ValType::I32 => I::I32Const(0),
        ValType::I64 => I::I64Const(0),
        ValType::F32 => I::F32Const(0.0f32.into()),
        ValType::F64 => I::F64Const(0.0f64.into()),
        ValType::V128 => I::V128Const(0),
        // Only nullable references pass validation without typed function references.
        ValType::Ref(r) => I::RefNull(r.heap_type),
    }
}

/// Places a value of type `t` in a record of `len` bytes: its naturally aligned offset.
fn place(len: &mut u32, t: ValType) -> u32 {
    if !savable(t) {
        return u32::MAX;
    }
    let sz = size_of(t);
    let off = len.div_ceil(sz) * sz;
    *len = off + sz;
    off
}

fn load(t: ValType, m: MemArg) -> I<'static> {
    match t {
        ValType::I32 => I::I32Load(m),
        ValType::I64 => I::I64Load(m),
        ValType::F32 => I::F32Load(m),
        ValType::F64 => I::F64Load(m),
        ValType::V128 => I::V128Load(m),
        ValType::Ref(_) => unreachable!("references are never saved"),
    }
}

fn store(t: ValType, m: MemArg) -> I<'static> {
    match t {
        ValType::I32 => I::I32Store(m),
        ValType::I64 => I::I64Store(m),
        ValType::F32 => I::F32Store(m),
        ValType::F64 => I::F64Store(m),
        ValType::V128 => I::V128Store(m),
        ValType::Ref(_) => unreachable!("references are never saved"),
    }
}

/// An operand of a call made again (see [`Emitter::bounce`]).
#[derive(Debug, Clone, Copy)]
enum Arg {
    /// The spill temporary holding it.
    Temp(u32),
    /// Any value of this type: the callee's rewind copy restores its own parameters.
    Dummy(ValType),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seg {
    /// Not inside a guard.
    Closed,
    /// A guard is due but nothing needed it yet (no values, no code).
    Pending,
    /// Inside `if (!rw)` whose parameters are this many values.
    Open(usize),
}

#[derive(Debug)]
struct Frame {
    relevant: bool,
    /// Output nesting level a branch to this frame targets.
    level: u32,
    seg: Seg,
    /// The construct's result types (relevant frames only).
    results: Vec<ValType>,
}

/// Which copy of a function is being written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Copy {
    /// The copy that runs normally: polls, spills at call sites, unwind paths — no rewind code.
    Lean,
    /// The copy a rewind enters: restores its frame, skips to the saved call site, then runs
    /// on as normal (calling lean copies).
    Rewind,
}

/// A function's frame-record layout, shared by its two copies.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    temps: HashMap<(ValType, u32), u32>,
    locals: Vec<ValType>,
    offsets: Vec<u32>,
    record_len: u32,
}

impl Layout {
    pub(crate) fn record_len(&self) -> u32 {
        self.record_len
    }

    /// Bytes one record of this function takes on the saved stack.
    pub(crate) fn record_size(&self) -> u32 {
        record_size(self.record_len)
    }
}

/// A record of `len` bytes as pushed: padded to 16.
fn record_size(len: u32) -> u32 {
    len.div_ceil(16) * 16
}

struct Emitter<'c, 'm, R> {
    copy: Copy,
    ctx: &'c ModuleCtx<'m>,
    types: &'c mut TypeInterner,
    shift: &'c mut R,
    out: Vec<u8>,
    depth: u32,
    frames: Vec<Frame>,
    temps: HashMap<(ValType, u32), u32>,
    /// Types of all locals, params first; temps are appended.
    locals: Vec<ValType>,
    rw: u32,
    idx: u32,
    /// Offset of each local in this function's frame record (`u32::MAX` for `rw` and `idx`).
    offsets: Vec<u32>,
    /// Bytes of the record so far (header included).
    record_len: u32,
    /// Positions in `out` of padded `i32.const`s to patch with the record size.
    size_fixups: Vec<usize>,
    fid: i32,
    results: Vec<ValType>,
    /// Number of original locals (parameters and declared locals).
    n_orig: usize,
    live: &'c Liveness,
    /// Positions in `out` of the lean copy's `if`s that are almost never taken (a pending
    /// unwind after a call, a raised poll flag): branch hints for the compiler.
    unlikely: Vec<u32>,
    /// The distinct sets of locals the unwind paths save, each written once as a shared
    /// epilogue (`k` = index): a site branches to epilogue `k` with its number in `idx`.
    epilogues: Vec<Vec<u32>>,
    epilogue_of: HashMap<Vec<u32>, u32>,
    /// Some unwind point of this copy may run with other frames' records below `sp` (a call
    /// site), so its epilogues make room for the caller's record after pushing their own.
    /// A copy whose only unwind points are the lean copy's loop polls is always the innermost
    /// frame of an unwind, at `sp = 0`, and makes none (v17): see [`Emitter::epilogue`].
    deeper: bool,
    /// Return polls left out (a reference is live after their call, or an indirect call's
    /// result would overwrite its saved table index): the function must poll on entry
    /// instead.
    unsaved_return_polls: u32,
    /// `frames.len()` of each open counted loop of the lean copy: its `end` also closes the
    /// `if` that chose between the unpolled and the polled loop.
    versioned: Vec<usize>,
}

/// One copy of an instrumented function, as [`emit`] writes it.
pub(crate) struct Emitted {
    pub function: Function,
    pub layout: Layout,
    /// Byte offsets (from the body's start) of the `if`s hinted unlikely.
    pub unlikely: Vec<u32>,
    /// See [`Emitter::unsaved_return_polls`].
    pub unsaved_return_polls: u32,
}

type Validator = FuncValidator<ValidatorResources>;

/// `i32.const` with a 5-byte LEB128 immediate, patched once the value is known.
fn padded_i32(v: i32) -> [u8; 6] {
    let v = v as u32;
    [
        0x41,
        (v & 0x7f) as u8 | 0x80,
        ((v >> 7) & 0x7f) as u8 | 0x80,
        ((v >> 14) & 0x7f) as u8 | 0x80,
        ((v >> 21) & 0x7f) as u8 | 0x80,
        ((v >> 28) & 0x07) as u8,
    ]
}

impl<R: Reencode<Error = Infallible>> Emitter<'_, '_, R> {
    fn ins(&mut self, i: I<'_>) {
        match i {
            I::Block(_) | I::Loop(_) | I::If(_) | I::TryTable(..) => self.depth += 1,
            I::End => self.depth = self.depth.saturating_sub(1),
            _ => {}
        }
        i.encode(&mut self.out);
    }

    fn rel(&self, level: u32) -> u32 {
        self.depth - 1 - level
    }

    fn temp(&mut self, t: ValType, pos: u32) -> u32 {
        if let Some(&l) = self.temps.get(&(t, pos)) {
            return l;
        }
        let l = self.locals.len() as u32;
        self.locals.push(t);
        self.offsets.push(place(&mut self.record_len, t));
        self.temps.insert((t, pos), l);
        l
    }

    /// What a frame unwinding at this point must save: the original locals live afterwards
    /// (all of them if unknown) and the spill temporaries of the operand stack, except those
    /// at depths `skip` (0 = top: the operands a call consumes and its rewind does not need)
    /// — or `None` when one of them is a reference, which no record can hold.
    fn saved_locals(
        &mut self,
        v: &Validator,
        live: Option<&Locals>,
        skip: std::ops::Range<usize>,
    ) -> Option<Vec<u32>> {
        let mut out: Vec<u32> = match live {
            Some(l) => l.iter().filter(|&i| (i as usize) < self.n_orig).collect(),
            None => (0..self.n_orig as u32).collect(),
        };
        let height = v.operand_stack_height() as usize;
        for d in (0..height).filter(|d| !skip.contains(d)) {
            if let Some(Some(t)) = v.get_operand_type(d)
                && let Ok(t) = val_type(t)
            {
                out.push(self.temp(t, (height - 1 - d) as u32));
            }
        }
        out.iter()
            .all(|&l| savable(self.locals[l as usize]))
            .then_some(out)
    }

    /// A padded `i32.const` whose value is patched to the record size.
    fn size_const(&mut self) {
        let at = self.out.len();
        self.out.extend_from_slice(&padded_i32(0));
        self.size_fixups.push(at)
    }

    /// The frame's values (bottom first) with their absolute stack positions.
    fn frame_values(v: &Validator) -> Result<(u32, Vec<ValType>), InstrumentError> {
        let frame = v.get_control_frame(0).expect("inside a function");
        let h = frame.height;
        let n = v.operand_stack_height() as usize - h;
        let mut ts = Vec::with_capacity(n);
        for d in (0..n).rev() {
            match v.get_operand_type(d).flatten() {
                Some(t) => ts.push(val_type(t)?),
                None => {
                    return Err(InstrumentError::Internal(
                        "operand of unknown type at a segment boundary".into(),
                    ));
                }
            }
        }
        Ok((h as u32, ts))
    }

    fn top(&mut self) -> &mut Frame {
        self.frames
            .last_mut()
            .expect("function frame is always present")
    }

    fn seg_start(&mut self, v: &Validator) -> Result<(), InstrumentError> {
        if self.copy == Copy::Lean {
            self.top().seg = Seg::Closed;
            return Ok(());
        }
        let (_, vals) = Self::frame_values(v)?;
        if vals.is_empty() {
            self.top().seg = Seg::Pending;
        } else {
            let bt = self.types.block_type(&vals, &[]);
            self.ins(I::LocalGet(self.rw));
            self.ins(I::I32Eqz);
            self.ins(I::If(bt));
            self.top().seg = Seg::Open(vals.len());
        }
        Ok(())
    }

    fn ensure_open(&mut self) {
        if self.copy == Copy::Rewind && self.top().seg == Seg::Pending {
            self.ins(I::LocalGet(self.rw));
            self.ins(I::I32Eqz);
            self.ins(I::If(BlockType::Empty));
            self.top().seg = Seg::Open(0);
        }
    }

    /// Ends the current guard: spills the frame's values to temps inside it and re-pushes them
    /// after it, so they are in locals (saved on unwind, restored on rewind).
    fn seg_close(&mut self, v: &Validator) -> Result<(), InstrumentError> {
        if self.copy == Copy::Lean {
            return Ok(());
        }
        let Seg::Open(n_params) = self.top().seg else {
            self.top().seg = Seg::Closed;
            return Ok(());
        };
        let unreachable = v
            .get_control_frame(0)
            .expect("inside a function")
            .unreachable;
        let mut spilled = Vec::new();
        if unreachable {
            self.ins(I::Unreachable);
        } else {
            let (h, vals) = Self::frame_values(v)?;
            for (j, t) in vals.iter().enumerate() {
                spilled.push(self.temp(*t, h + j as u32));
            }
            for &l in spilled.iter().rev() {
                self.ins(I::LocalSet(l));
            }
        }
        self.ins(I::Else);
        for _ in 0..n_params {
            self.ins(I::Drop);
        }
        self.ins(I::End);
        if unreachable {
            // Reached only while rewinding to a site outside this construct: fall through
            // with placeholder results (the code that would read them is skipped too).
            for r in self.top().results.clone() {
                self.ins(dummy(r));
            }
        }
        for l in spilled {
            self.ins(I::LocalGet(l));
        }
        self.top().seg = Seg::Closed;
        Ok(())
    }

    /// Before a call site or a construct holding one, in the lean copy: puts the frame's values
    /// into their spill temporaries (and back), so an unwind can save them.
    fn spill(&mut self, v: &Validator) -> Result<(), InstrumentError> {
        if self.copy == Copy::Rewind {
            return self.seg_close(v);
        }
        let (h, vals) = Self::frame_values(v)?;
        let spilled: Vec<u32> = vals
            .iter()
            .enumerate()
            .map(|(j, t)| self.temp(*t, h + j as u32))
            .collect();
        for &l in spilled.iter().rev() {
            self.ins(I::LocalSet(l));
        }
        for l in spilled {
            self.ins(I::LocalGet(l));
        }
        Ok(())
    }

    /// Emits an unwind-capable call. The lean copy just calls and checks for an unwind; the
    /// rewind copy re-enters the call (through the callee's rewind copy) only if it is the
    /// target, and calls lean copies once the rewind is over.
    ///
    /// `saved` is what the unwind path saves; `None` makes a bouncing site (a reference is
    /// live here), whose `args` are the operands to call it with again.
    fn call_site(
        &mut self,
        site: u32,
        (call, call_rewind): (I<'_>, I<'_>),
        (params, results): (&[ValType], &[ValType]),
        saved: Option<&[u32]>,
        args: &[Arg],
    ) {
        if self.copy == Copy::Lean {
            self.ins(call);
            match saved {
                Some(saved) => self.call_check(site, saved),
                None => {
                    self.ins(I::GlobalGet(self.ctx.state_global));
                    self.unlikely.push(self.out.len() as u32);
                    self.bounce(call_rewind, results, args);
                    self.ins(I::End);
                }
            }
            return;
        }
        let bt = self.types.block_type(params, results);
        self.open_rewind_to(site, bt);
        // The rewind is over once the callee is re-entered: cleared before the call, because
        // the callee may throw instead of returning (this frame's handler then runs as normal
        // code).
        self.ins(I::I32Const(0));
        self.ins(I::LocalSet(self.rw));
        self.ins(call_rewind.clone());
        self.ins(I::Else);
        for _ in params {
            self.ins(I::Drop);
        }
        for r in results {
            self.ins(dummy(*r));
        }
        self.ins(I::End);
        self.ins(I::Else);
        self.ins(call);
        self.ins(I::End);
        self.ins(I::GlobalGet(self.ctx.state_global));
        self.ins(I::I32Const(abi::STATE_UNWIND));
        self.ins(I::I32Eq);
        match saved {
            Some(saved) => {
                self.ins(I::If(BlockType::Empty));
                self.save_and_return(site, saved);
            }
            None => self.bounce(call_rewind, results, args),
        }
        self.ins(I::End);
    }

    /// A call site (`Site`) or a call site with its return poll (`SiteThenPoll`), then the
    /// call's validation.
    #[allow(clippy::too_many_arguments)]
    fn call_then_poll(
        &mut self,
        v: &mut Validator,
        (offset, op): (usize, &Operator<'_>),
        op_plan: OpPlan,
        calls: (I<'_>, I<'_>),
        (params, results): (&[ValType], &[ValType]),
        (saved, after): (Option<&[u32]>, Option<&Locals>),
        args: &[Arg],
    ) -> Result<(), InstrumentError> {
        // A `call_indirect`'s table index is saved in the temp of its stack position; a
        // result landing in that same temp (same position and type) would overwrite it before
        // the return poll's unwind saves the frame. Such a call does not poll on return.
        let index_overwritten = matches!(op, Operator::CallIndirect { .. })
            && results.get(params.len().saturating_sub(1)) == Some(&ValType::I32);
        let poll_site = match op_plan {
            OpPlan::SiteThenPoll(site) if !index_overwritten => Some(site),
            _ => None,
        };
        let (Some(site), Some(saved)) = (poll_site, saved) else {
            // A bouncing site (a reference is live) cannot poll on return either.
            if matches!(op_plan, OpPlan::SiteThenPoll(_)) {
                self.unsaved_return_polls += 1;
            }
            let (OpPlan::Site(site) | OpPlan::SiteThenPoll(site)) = op_plan else {
                return Err(InstrumentError::Internal("not a call site".into()));
            };
            self.call_site(site, calls, (params, results), saved, args);
            v.op(offset, op)?;
            return Ok(());
        };
        match self.copy {
            // The lean copy's unwind check is part of the return poll.
            Copy::Lean => self.ins(calls.0),
            Copy::Rewind => self.call_site(site, calls, (params, results), Some(saved), args),
        }
        v.op(offset, op)?;
        self.return_poll(v, site, saved, after, results)
    }

    /// Opens the `if` taken when a call at a bouncing site returns unwinding (left open for
    /// the caller's `end`). This frame holds a reference, which no record can keep, so the
    /// unwind stops here: the frames the callee saved are rewound at once — state `REWIND`,
    /// the flag raised for the rewind copies' prologues, the callee's rewind copy called again
    /// with the same operands — and the callee's real results replace the placeholders. The
    /// request that started the unwind is still pending in the host, so the flag goes up
    /// again when the rewind ends and the next safe point tries again (after at least one
    /// step of progress); while a reference stays live here, the guest just keeps running.
    fn bounce(&mut self, call_rewind: I<'_>, results: &[ValType], args: &[Arg]) {
        let bt = self.types.block_type(results, results);
        self.ins(I::If(bt));
        for _ in results {
            self.ins(I::Drop);
        }
        let lt = self.types.block_type(&[], results);
        self.ins(I::Loop(lt));
        self.ins(I::I32Const(abi::STATE_REWIND));
        self.ins(I::GlobalSet(self.ctx.state_global));
        self.set_flag(1);
        for &a in args {
            match a {
                Arg::Temp(l) => self.ins(I::LocalGet(l)),
                Arg::Dummy(t) => self.ins(dummy(t)),
            }
        }
        self.ins(call_rewind);
        self.ins(I::GlobalGet(self.ctx.state_global));
        self.ins(I::BrIf(0));
        self.ins(I::End);
    }

    /// A bouncing call's operands when it is made again, bottom first: the spill temporaries
    /// of those `keep` names (by position), placeholders for the rest.
    fn call_args(
        &mut self,
        v: &Validator,
        n: usize,
        keep: impl Fn(usize) -> bool,
    ) -> Result<Vec<Arg>, InstrumentError> {
        let (h, vals) = Self::frame_values(v)?;
        let first = vals.len().checked_sub(n).ok_or_else(|| {
            InstrumentError::Internal("a call's operands lie outside its frame".into())
        })?;
        Ok((first..vals.len())
            .map(|j| match keep(j - first) {
                true => Arg::Temp(self.temp(vals[j], h + j as u32)),
                false => Arg::Dummy(vals[j]),
            })
            .collect())
    }

    /// The unwind path of one call site: note the site in `idx` and branch to the shared
    /// epilogue that pushes this frame's record with exactly `saved` — only what the rest of
    /// the function can still read — and returns. Sites that save the same locals share one
    /// epilogue (v12): the save code was most of what the transform added to a module (a
    /// 95 MB interpreter grew to 546 MB with it written at every site), and a branch to an
    /// epilogue that reads only what is live at the site adds no liveness.
    ///
    /// The epilogues are blocks around `$done`, epilogue 0 innermost, so from depth `d`
    /// epilogue `k` is `br (d + k)` whatever their final number.
    fn save_and_return(&mut self, site: u32, saved: &[u32]) {
        self.unwind_from(site, saved, true);
    }

    /// [`Emitter::save_and_return`] with `deeper` as in [`Emitter::branch_to_epilogue`].
    fn unwind_from(&mut self, site: u32, saved: &[u32], deeper: bool) {
        self.ins(I::I32Const(site as i32));
        self.ins(I::LocalSet(self.idx));
        self.branch_to_epilogue(saved, deeper);
    }

    /// Branches to the shared epilogue that saves `saved` (the site already in `idx`);
    /// `deeper`: this site may unwind with records already below `sp` (anything but a lean
    /// loop poll, which starts the unwind at `sp = 0`).
    fn branch_to_epilogue(&mut self, saved: &[u32], deeper: bool) {
        let k = match self.epilogue_of.get(saved) {
            Some(&k) => k,
            None => {
                let k = self.epilogues.len() as u32;
                self.epilogues.push(saved.to_vec());
                self.epilogue_of.insert(saved.to_vec(), k);
                k
            }
        };
        self.deeper |= deeper;
        self.ins(I::Br(self.depth + k));
    }

    /// Epilogue `k`'s code (after its block's `end`): push the record — function index, the
    /// site in `idx`, the saved locals — and return placeholder results.
    ///
    /// The saved-stack memory always has room for the largest record above `sp` when an
    /// epilogue starts (its minimum size is that record; an unwind starts at `sp = 0`), so the
    /// record is stored first and the room for the next one (the caller's) is made after:
    /// `memory.grow` is a call, and with the stores after it every saved value was live
    /// across a call on the unwind path — Cranelift then kept loop-carried values in
    /// callee-saved registers and copied them on every back edge of a polled loop (v16).
    ///
    /// A lean copy whose only unwind points are loop polls is the innermost frame of any
    /// unwind it takes part in — it starts the unwind, at `sp = 0` — so its epilogues make no
    /// room at all (v17): the memory's minimum size is twice the largest record, so the
    /// caller's epilogue still finds room for its own. Without the `memory.grow` such a
    /// function makes no call, and Cranelift compiles a leaf (`memcmp`, a compression kernel)
    /// without the stack-limit check every non-leaf function's prologue runs. (Only whole
    /// functions: leaving the call out of some epilogues of a function that calls anyway
    /// moved its register allocation about at random — LZ4's main loop +2%, zstd's
    /// `ZSTD_decompressSequences` −12%.)
    fn epilogue(&mut self, k: usize) {
        let (sp, stack) = (self.ctx.sp_global, self.ctx.stack_memory);
        let m = |offset: u32, align: u32| MemArg {
            offset: u64::from(offset),
            align,
            memory_index: stack,
        };
        self.ins(I::GlobalGet(sp));
        self.ins(I::I32Const(self.fid));
        self.ins(I::I32Store(m(0, 2)));
        self.ins(I::GlobalGet(sp));
        self.ins(I::LocalGet(self.idx));
        self.ins(I::I32Store(m(4, 2)));
        for l in self.epilogues[k].clone() {
            let t = self.locals[l as usize];
            let off = self.offsets[l as usize];
            self.ins(I::GlobalGet(sp));
            self.ins(I::LocalGet(l));
            self.ins(store(t, m(off, size_of(t).trailing_zeros())));
        }
        self.ins(I::GlobalGet(sp));
        self.size_const();
        self.ins(I::I32Add);
        self.ins(I::GlobalSet(sp));
        if !self.deeper {
            for r in self.results.clone() {
                self.ins(dummy(r));
            }
            self.ins(I::Return);
            return;
        }
        // Room for the largest record again: when less is left (the record just pushed used
        // at most that much), grow by more than its size in pages.
        let room = self.ctx.room_global;
        self.ins(I::GlobalGet(sp));
        self.ins(I::GlobalGet(room));
        self.ins(I::I32Add);
        self.ins(I::MemorySize(stack));
        self.ins(I::I32Const(16));
        self.ins(I::I32Shl);
        self.ins(I::I32GtU);
        self.ins(I::If(BlockType::Empty));
        self.ins(I::GlobalGet(room));
        self.ins(I::I32Const(16));
        self.ins(I::I32ShrU);
        self.ins(I::I32Const(1));
        self.ins(I::I32Add);
        self.ins(I::MemoryGrow(stack));
        self.ins(I::Drop);
        self.ins(I::End);
        for r in self.results.clone() {
            self.ins(dummy(r));
        }
        self.ins(I::Return);
    }

    /// Writes the poll flag word (`ferry:ctl` word 0).
    fn set_flag(&mut self, v: i32) {
        self.ins(I::I32Const(0));
        self.ins(I::I32Const(v));
        self.ins(I::I32Store(MemArg {
            offset: 0,
            align: 2,
            memory_index: self.ctx.ctl_memory,
        }));
    }

    fn flag_check(&mut self) {
        self.ins(I::I32Const(0));
        self.ins(I::I32Load(MemArg {
            offset: 0,
            align: 2,
            memory_index: self.ctx.ctl_memory,
        }));
        if self.copy == Copy::Lean {
            self.unlikely.push(self.out.len() as u32);
        }
        self.ins(I::If(BlockType::Empty));
    }

    /// A loop-header safe point; none where a reference is live (`saved` is `None`): such a
    /// frame cannot be saved, and the loop runs on until it ends or reaches another.
    fn poll_site(&mut self, site: u32, saved: Option<&[u32]>) {
        let Some(saved) = saved else {
            return;
        };
        if self.copy == Copy::Lean && !self.ctx.counting {
            self.lean_poll_site(site, saved);
            return;
        }
        self.flag_check();
        let poll = self.ctx.poll_func;
        let calls = (I::Call(poll), I::Call(poll));
        self.call_site(site, calls, (&[], &[]), Some(saved), &[]);
        self.ins(I::End);
    }

    /// A safe point of the lean copy (v9): with the flag raised, the guest starts the unwind
    /// itself — `state = UNWIND`, `sp = 0`, flag lowered, save, return — without calling the
    /// host, and nothing on the way leads back into the function. Keeping every path out of
    /// the poll away from the loop matters: a `ferry.poll` call that could return into the
    /// loop made Cranelift keep loop-carried values in stack slots (v8), and even a counter
    /// decremented in place on a path back cost LZ4 1.07x → 1.20x. Deterministic tests that
    /// must count safe points run the counting build instead (`instrument_counting`). The
    /// host learns why the guest unwound from `Control` afterwards.
    fn lean_poll_site(&mut self, site: u32, saved: &[u32]) {
        self.flag_check();
        self.ins(I::I32Const(abi::STATE_UNWIND));
        self.ins(I::GlobalSet(self.ctx.state_global));
        self.ins(I::I32Const(0));
        self.ins(I::GlobalSet(self.ctx.sp_global));
        self.unwind_from(site, saved, false);
        self.ins(I::End);
    }

    /// The return poll after call site `site` (v14): safe point `site + 1`, just after the
    /// call returned, in a function on a call-graph cycle. It replaces the entry poll: a cycle
    /// without loops can only descend until the stack is full, and every return along it
    /// now passes a safe point. The lean copy tests the flag word instead of `state` after
    /// such a call — the flag stays raised while unwinding, so one test serves both:
    ///
    /// ```text
    /// call f                     ;; results spilled to temps
    /// if ctl[0] != 0             ;; unlikely
    ///   idx = state != NORMAL ? site : site + 1   ;; f is unwinding : unwind from here
    ///   sp = state != NORMAL ? sp : 0; state = UNWIND
    ///   br $epilogue             ;; saves what is live after the call
    /// end
    /// ```
    ///
    /// The rewind copy resumes there by skipping the call (its results come from the record)
    /// and ending the rewind through `ferry.poll`. Must follow the call and its validation;
    /// `saved_call` is what the call site itself saves.
    fn return_poll(
        &mut self,
        v: &Validator,
        site: u32,
        saved_call: &[u32],
        after: Option<&Locals>,
        results: &[ValType],
    ) -> Result<(), InstrumentError> {
        let Some(saved) = self.saved_locals(v, after, 0..0) else {
            self.unsaved_return_polls += 1;
            if self.copy == Copy::Lean {
                // No safe point here; the call site's own unwind check remains.
                self.call_check(site, saved_call);
            }
            return Ok(());
        };
        let poll = site + 1;
        if self.copy == Copy::Lean && self.ctx.counting {
            // The counting build: the host counts the safe point in `ferry.poll`.
            self.spill(v)?;
            self.flag_check();
            self.ins(I::GlobalGet(self.ctx.state_global));
            self.ins(I::If(BlockType::Empty));
            self.save_and_return(site, saved_call);
            self.ins(I::End);
            let p = self.ctx.poll_func;
            let polls = (I::Call(p), I::Call(p));
            self.call_site(poll, polls, (&[], &[]), Some(&saved), &[]);
            self.ins(I::End);
            return Ok(());
        }
        if self.copy == Copy::Lean {
            // One unwind path for both cases (two cost SQLite ~5%): `idx` is the call site
            // if the callee is unwinding, else the safe point after it, where the unwind
            // starts (`sp` = 0). Both save the values live after the call and what the call
            // site needs (a `call_indirect`'s table index); for the call site the results'
            // temps are placeholders, replaced when its callee is re-entered.
            let mut both = saved.clone();
            both.extend(saved_call.iter().filter(|l| !saved.contains(l)));
            let (state, sp) = (self.ctx.state_global, self.ctx.sp_global);
            self.spill(v)?;
            self.flag_check();
            self.ins(I::GlobalGet(state));
            self.ins(I::I32Eqz);
            self.ins(I::I32Const(site as i32));
            self.ins(I::I32Add);
            self.ins(I::LocalSet(self.idx));
            self.ins(I::GlobalGet(sp));
            self.ins(I::I32Const(0));
            self.ins(I::GlobalGet(state));
            self.ins(I::Select);
            self.ins(I::GlobalSet(sp));
            self.ins(I::I32Const(abi::STATE_UNWIND));
            self.ins(I::GlobalSet(state));
            self.branch_to_epilogue(&both, true);
            self.ins(I::End);
            return Ok(());
        }
        // Rewind copy: the results on the stack are placeholders when rewinding to `poll`;
        // the record holds the real ones.
        let height = v.operand_stack_height();
        let first = height.checked_sub(results.len() as u32).ok_or_else(|| {
            InstrumentError::Internal("a call's results lie outside the stack".into())
        })?;
        let kept: Vec<u32> = results
            .iter()
            .enumerate()
            .map(|(j, t)| self.temp(*t, first + j as u32))
            .collect();
        let bt = self.types.block_type(results, results);
        self.open_rewind_to(poll, bt);
        for _ in results {
            self.ins(I::Drop);
        }
        for l in kept {
            self.ins(I::LocalGet(l));
        }
        self.ins(I::I32Const(0));
        self.ins(I::LocalSet(self.rw));
        self.ins(I::Call(self.ctx.poll_func));
        // The host may start another unwind at once (a request still pending).
        self.ins(I::GlobalGet(self.ctx.state_global));
        self.ins(I::I32Const(abi::STATE_UNWIND));
        self.ins(I::I32Eq);
        self.ins(I::If(BlockType::Empty));
        self.save_and_return(poll, &saved);
        self.ins(I::End);
        self.ins(I::End);
        self.ins(I::End);
        Ok(())
    }

    /// Rewind copy: opens `if rw` and, inside it, `if idx == site`, both of type `bt` — the
    /// code that runs only when the rewind resumes at `site`. The caller closes both.
    fn open_rewind_to(&mut self, site: u32, bt: BlockType) {
        self.ins(I::LocalGet(self.rw));
        self.ins(I::If(bt));
        self.ins(I::LocalGet(self.idx));
        self.ins(I::I32Const(site as i32));
        self.ins(I::I32Eq);
        self.ins(I::If(bt));
    }

    /// The lean copy's check after a call: if the callee is unwinding, save this frame.
    fn call_check(&mut self, site: u32, saved: &[u32]) {
        self.ins(I::GlobalGet(self.ctx.state_global));
        self.unlikely.push(self.out.len() as u32);
        self.ins(I::If(BlockType::Empty));
        self.save_and_return(site, saved);
        self.ins(I::End);
    }

    fn block_sig(
        &self,
        bt: wasmparser::BlockType,
    ) -> Result<(Vec<ValType>, Vec<ValType>), InstrumentError> {
        Ok(match bt {
            wasmparser::BlockType::Empty => (vec![], vec![]),
            wasmparser::BlockType::Type(t) => (vec![], vec![val_type(t)?]),
            wasmparser::BlockType::FuncType(i) => {
                let f = self.func_type(i)?;
                (val_types(f.params())?, val_types(f.results())?)
            }
        })
    }

    fn func_type(&self, type_index: u32) -> Result<&FuncType, InstrumentError> {
        self.ctx
            .func_types
            .get(type_index as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| InstrumentError::Invalid(format!("type {type_index} is not a function")))
    }

    /// Translates a plain operator, renumbering branch depths for the added nesting.
    fn plain(&mut self, op: &Operator<'_>) -> Result<(), InstrumentError> {
        let target = |s: &Self, d: u32| -> u32 {
            let f = &s.frames[s.frames.len() - 1 - d as usize];
            s.rel(f.level)
        };
        match op {
            Operator::Br { relative_depth } => self.ins(I::Br(target(self, *relative_depth))),
            Operator::BrIf { relative_depth } => self.ins(I::BrIf(target(self, *relative_depth))),
            Operator::BrTable { targets } => {
                let mut ls = Vec::with_capacity(targets.len() as usize);
                for t in targets.targets() {
                    ls.push(target(self, t?));
                }
                let def = target(self, targets.default());
                self.ins(I::BrTable(ls.into(), def));
            }
            // Catch labels name enclosing constructs, like branches do.
            Operator::TryTable { try_table } => {
                use wasm_encoder::Catch as C;
                use wasmparser::Catch as P;
                let catches: Vec<C> = try_table
                    .catches
                    .iter()
                    .map(|c| match *c {
                        P::One { tag, label } => C::One {
                            tag,
                            label: target(self, label),
                        },
                        P::OneRef { tag, label } => C::OneRef {
                            tag,
                            label: target(self, label),
                        },
                        P::All { label } => C::All {
                            label: target(self, label),
                        },
                        P::AllRef { label } => C::AllRef {
                            label: target(self, label),
                        },
                    })
                    .collect();
                let bt = self
                    .shift
                    .block_type(try_table.ty)
                    .map_err(|e| InstrumentError::Invalid(e.to_string()))?;
                self.ins(I::TryTable(bt, catches.into()));
            }
            other => {
                let i = self
                    .shift
                    .instruction(other.clone())
                    .map_err(|e| InstrumentError::Invalid(e.to_string()))?;
                self.ins(i);
            }
        }
        Ok(())
    }

    /// [`Self::plain`] for code that holds no site: a construct it opens or closes is a frame
    /// that branches can name but nothing is saved for.
    fn plain_tracked(&mut self, op: &Operator<'_>) -> Result<(), InstrumentError> {
        self.plain(op)?;
        match op {
            Operator::Block { .. }
            | Operator::Loop { .. }
            | Operator::If { .. }
            | Operator::TryTable { .. } => {
                let level = self.depth - 1;
                self.frames.push(Frame {
                    relevant: false,
                    level,
                    seg: Seg::Closed,
                    results: Vec::new(),
                });
            }
            Operator::End => {
                self.frames.pop();
            }
            _ => {}
        }
        Ok(())
    }

    /// A counted loop of the lean copy (v15, `counted.rs`): `guard; if <loop's type>`, the
    /// loop copied without its poll, `else` — the polled loop follows, and its `end` also
    /// closes the `if`. `rd` reads on just after the loop's `loop`, the instruction `at`;
    /// `v` is just before it. Returns whether it wrote the copy.
    ///
    /// The loops inside it (v18) poll on their ways back instead of at their headers: the
    /// unwind there is the header poll's — same site, same saved values, since a branch back
    /// carries no values and changes no local — so the rewind copy resumes at the polled
    /// loop's header as if it had been reached there. Each inner loop thus runs at most one
    /// iteration unpolled per iteration of the outer loop, whose budget counts every
    /// instruction of its body. An inner counted leaf loop whose own guard passes polls
    /// once on entry instead and runs unpolled (at most its own budget). A loop where a
    /// frame cannot be saved (a reference is live) gets no copy.
    fn unpolled_copy(
        &mut self,
        (g, at, plan, v): (&Guard, usize, &Plan, &Validator),
        blockty: wasmparser::BlockType,
        lp: &Operator<'_>,
        mut rd: OperatorsReader<'_>,
    ) -> Result<bool, InstrumentError> {
        // The inner loops' sites and what their polls save, by instruction index.
        let mut inner: HashMap<usize, (u32, Vec<u32>)> = HashMap::new();
        for &j in plan.inner_loops.get(&at).into_iter().flatten() {
            if let OpPlan::Construct {
                poll: Some(site), ..
            } = plan.ops[j]
            {
                let header = self.live.loop_header.get(&j).cloned();
                let Some(saved) = self.saved_locals(v, header.as_ref(), 0..0) else {
                    return Ok(false);
                };
                inner.insert(j, (site, saved));
            }
        }
        for gi in g.code() {
            self.ins(guard_instruction(gi, g.wide));
        }
        self.plain(&Operator::If { blockty })?;
        let base = self.frames.len();
        // Open inner loops that poll on their ways back, by `frames.len()` with them open.
        let mut back: HashMap<usize, (u32, Vec<u32>)> = HashMap::new();
        // Inner loops whose `end` also closes the `if` of their own guard (same key).
        let mut guarded: Vec<usize> = Vec::new();
        let mut op = lp.clone();
        let mut j = at;
        loop {
            // An inner counted leaf loop keeps its own guard: if it passes, the loop polls
            // once on entry (its header's safe point) and runs unpolled — a long inner loop
            // in a short outer one (a matrix kernel's rows) then polls once per outer
            // iteration, as without the copy; else it polls on its ways back.
            if let Operator::Loop { blockty } = op
                && let Some(gj) = plan.counted.get(&j).filter(|gj| gj.inner == 0)
                && let Some((site, saved)) = inner.get(&j).cloned()
            {
                for gi in gj.code() {
                    self.ins(guard_instruction(gi, gj.wide));
                }
                self.plain(&Operator::If { blockty })?;
                self.poll_site(site, Some(&saved));
                let base_j = self.frames.len();
                let mut raw = rd.clone();
                let mut o = op.clone();
                loop {
                    self.plain_tracked(&o)?;
                    if self.frames.len() == base_j {
                        break;
                    }
                    o = raw.read()?;
                }
                self.ins(I::Else);
                guarded.push(self.frames.len() + 1);
            }
            let to = match op {
                Operator::Br { relative_depth } | Operator::BrIf { relative_depth } => back
                    .get(&(self.frames.len() - relative_depth as usize))
                    .cloned(),
                _ => None,
            };
            match (to, &op) {
                (Some((site, saved)), Operator::Br { relative_depth }) => {
                    self.poll_site(site, Some(&saved));
                    self.plain(&Operator::Br {
                        relative_depth: *relative_depth,
                    })?;
                }
                (Some((site, saved)), Operator::BrIf { relative_depth }) => {
                    self.ins(I::If(BlockType::Empty));
                    self.poll_site(site, Some(&saved));
                    self.plain(&Operator::Br {
                        relative_depth: *relative_depth,
                    })?;
                    self.ins(I::End);
                }
                _ => {
                    let mut close = false;
                    if matches!(op, Operator::End) {
                        back.remove(&self.frames.len());
                        close = guarded.last() == Some(&self.frames.len());
                    }
                    self.plain_tracked(&op)?;
                    if close {
                        guarded.pop();
                        self.ins(I::End);
                    }
                    if let Some(info) = inner.get(&j) {
                        back.insert(self.frames.len(), info.clone());
                    }
                }
            }
            if self.frames.len() == base {
                break;
            }
            op = rd.read()?;
            j += 1;
        }
        self.ins(I::Else);
        Ok(true)
    }

    fn shifted(&mut self, f: u32) -> u32 {
        self.shift.function_index(f).unwrap_or(f)
    }
}

/// One instruction of a counted loop's guard at its width.
fn guard_instruction(g: G, wide: bool) -> I<'static> {
    match (g, wide) {
        (G::LocalGet(l), _) => I::LocalGet(l),
        (G::Const(k), false) => I::I32Const(k as i32),
        (G::Const(k), true) => I::I64Const(k),
        (G::Add, false) => I::I32Add,
        (G::Add, true) => I::I64Add,
        (G::Sub, false) => I::I32Sub,
        (G::Sub, true) => I::I64Sub,
        (G::And, false) => I::I32And,
        (G::And, true) => I::I64And,
        (G::Eqz, false) => I::I32Eqz,
        (G::Eqz, true) => I::I64Eqz,
        (G::Le(false), false) => I::I32LeU,
        (G::Le(false), true) => I::I64LeU,
        (G::Le(true), false) => I::I32LeS,
        (G::Le(true), true) => I::I64LeS,
        (G::Ge(false), false) => I::I32GeU,
        (G::Ge(false), true) => I::I64GeU,
        (G::Ge(true), false) => I::I32GeS,
        (G::Ge(true), true) => I::I64GeS,
        (G::Lt(false), false) => I::I32LtU,
        (G::Lt(false), true) => I::I64LtU,
        (G::Lt(true), false) => I::I32LtS,
        (G::Lt(true), true) => I::I64LtS,
        (G::Gt(false), false) => I::I32GtU,
        (G::Gt(false), true) => I::I64GtU,
        (G::Gt(true), false) => I::I32GtS,
        (G::Gt(true), true) => I::I64GtS,
        (G::BothI32, _) => I::I32And,
    }
}

#[allow(clippy::too_many_arguments)] // one caller, which writes both copies
/// Rewrites one instrumented function.
pub(crate) fn emit<R: Reencode<Error = Infallible>>(
    ctx: &ModuleCtx<'_>,
    types: &mut TypeInterner,
    shift: &mut R,
    fv: FuncToValidate<ValidatorResources>,
    body: &FunctionBody<'_>,
    plan: &Plan,
    defined_index: u32,
    copy: Copy,
    layout: Option<&Layout>,
    entry_poll: bool,
) -> Result<Emitted, InstrumentError> {
    if entry_poll && !plan.entry_poll {
        return Err(InstrumentError::Internal(
            "an entry poll without a site for it".into(),
        ));
    }
    let fty = ctx
        .func_types
        .get(fv.ty as usize)
        .and_then(Option::as_ref)
        .ok_or_else(|| InstrumentError::Invalid("function type is not a function".into()))?
        .clone();
    let mut v = fv.into_validator(Default::default());
    let mut locals = val_types(fty.params())?;
    let n_params = locals.len();
    let mut reader = body.get_locals_reader()?;
    for _ in 0..reader.get_count() {
        let offset = reader.original_position();
        let (count, ty) = reader.read()?;
        v.define_locals(offset, count, ty)?;
        let t = val_type(ty)?;
        locals.extend(std::iter::repeat_n(t, count as usize));
    }
    let results = val_types(fty.results())?;
    let n_orig = locals.len();
    let rw = locals.len() as u32;
    let idx = rw + 1;
    // Record layout: [function index][call site][locals…]; temps get offsets as they appear.
    let mut record_len = 8u32;
    let mut offsets: Vec<u32> = locals.iter().map(|t| place(&mut record_len, *t)).collect();
    locals.push(ValType::I32);
    locals.push(ValType::I32);
    offsets.extend([u32::MAX, u32::MAX]);

    let (temps, locals, offsets, record_len) = match layout {
        Some(l) => (
            l.temps.clone(),
            l.locals.clone(),
            l.offsets.clone(),
            l.record_len,
        ),
        None => (HashMap::new(), locals, offsets, record_len),
    };
    let mut e = Emitter {
        copy,
        ctx,
        types,
        shift,
        out: Vec::new(),
        depth: 0,
        frames: Vec::new(),
        temps,
        locals,
        rw,
        idx,
        offsets,
        record_len,
        size_fixups: Vec::new(),
        fid: defined_index as i32,
        results: results.clone(),
        n_orig,
        live: &plan.live,
        unlikely: Vec::new(),
        epilogues: Vec::new(),
        epilogue_of: HashMap::new(),
        deeper: false,
        unsaved_return_polls: 0,
        versioned: Vec::new(),
    };
    let done_bt = e.types.block_type(&[], &results);
    e.ins(I::Block(done_bt));
    // The rewind copy restores its frame here (the prologue is spliced in once the layout is
    // final); in both copies the flag test also gates the entry poll.
    let gated = copy == Copy::Rewind || entry_poll;
    if gated {
        e.flag_check();
    }
    let prologue_at = e.out.len();
    e.frames.push(Frame {
        relevant: true,
        level: 0,
        seg: Seg::Closed,
        results: results.clone(),
    });
    if entry_poll {
        let entry_live = e.live.entry.clone();
        // An entry poll keeps the host call: nothing is loop-carried at a function's entry,
        // and the in-line unwind made call-heavy code bigger (recursion 1.35x → 1.55x).
        // None where a reference parameter is live (such a frame cannot be saved).
        if let Some(saved) = e.saved_locals(&v, Some(&entry_live), 0..0) {
            let poll = ctx.poll_func;
            let calls = (I::Call(poll), I::Call(poll));
            e.call_site(0, calls, (&[], &[]), Some(&saved), &[]);
        }
    }
    if gated {
        e.ins(I::End);
    }
    e.seg_start(&v)?;

    let mut ops = body.get_operators_reader()?;
    let mut i = 0usize;
    while !ops.eof() {
        let offset = ops.original_position();
        let op = ops.read()?;
        let op_plan = plan.ops[i];
        let at = i;
        i += 1;
        let relevant = e.frames.last().is_some_and(|f| f.relevant);
        match (&op, op_plan) {
            (Operator::End, _) if e.frames.len() == 1 => {
                e.seg_close(&v)?;
                e.ins(I::Br(e.rel(0)));
                v.op(offset, &op)?;
                e.frames.pop();
            }
            (Operator::End, _) if relevant => {
                e.seg_close(&v)?;
                e.ins(I::End);
                if e.versioned.last() == Some(&e.frames.len()) {
                    e.versioned.pop();
                    e.ins(I::End);
                }
                e.frames.pop();
                v.op(offset, &op)?;
                e.seg_start(&v)?;
            }
            (Operator::Else, _) if relevant => {
                e.seg_close(&v)?;
                e.ins(I::Else);
                v.op(offset, &op)?;
                e.seg_start(&v)?;
            }
            (
                Operator::Block { blockty }
                | Operator::Loop { blockty }
                | Operator::If { blockty }
                | Operator::TryTable {
                    try_table: wasmparser::TryTable { ty: blockty, .. },
                },
                OpPlan::Construct { then_hi, poll },
            ) => {
                e.spill(&v)?;
                // No test on the way in: while rewinding to a site outside this construct,
                // every stretch of code inside is skipped by its guard and the construct falls
                // through to its end with its results taken from the spill temporaries. (A test
                // per construct would cost a branch per nested block on every entry — hundreds
                // per bytecode in CPython's dispatch.)
                let (_, res) = e.block_sig(*blockty)?;
                if copy == Copy::Rewind && matches!(op, Operator::If { .. }) {
                    // Rewinding into this `if`: take the arm that holds the target site.
                    let bt = e.types.block_type(&[ValType::I32], &[ValType::I32]);
                    e.ins(I::LocalGet(e.rw));
                    e.ins(I::If(bt));
                    e.ins(I::Drop);
                    e.ins(I::LocalGet(e.idx));
                    e.ins(I::I32Const(then_hi as i32));
                    e.ins(I::I32LtU);
                    e.ins(I::End);
                }
                let counted = match plan.counted.get(&at).filter(|_| copy == Copy::Lean) {
                    Some(g) => e.unpolled_copy((g, at, plan, &v), *blockty, &op, ops.clone())?,
                    None => false,
                };
                e.plain(&op)?;
                let level = e.depth - 1;
                e.frames.push(Frame {
                    relevant: true,
                    level,
                    seg: Seg::Closed,
                    results: res,
                });
                if counted {
                    e.versioned.push(e.frames.len());
                }
                v.op(offset, &op)?;
                if let Some(site) = poll {
                    e.seg_start(&v)?;
                    e.spill(&v)?;
                    let header = e.live.loop_header.get(&at).cloned();
                    let saved = e.saved_locals(&v, header.as_ref(), 0..0);
                    e.poll_site(site, saved.as_deref());
                }
                e.seg_start(&v)?;
            }
            (
                Operator::Call { .. } | Operator::CallIndirect { .. },
                OpPlan::Site(_) | OpPlan::SiteThenPoll(_),
            ) => {
                e.spill(&v)?;
                // Per kind of call: the two calls (lean, rewinding), the operand and result
                // types, the operands the unwind path does not save (`skip`, depths from the
                // top) and those a bouncing site passes again (`keep`, by position).
                let (calls, params, res, skip, keep) = match &op {
                    Operator::Call { function_index } => {
                        let ty = e.func_type(ctx.func_type_of[*function_index as usize])?;
                        let (params, res) = (val_types(ty.params())?, val_types(ty.results())?);
                        let callee = e.shifted(*function_index);
                        // Imports (blocking WASI calls) have no rewind copy: the host
                        // finishes the rewind inside them.
                        let rewind_callee = ctx
                            .rewind_func
                            .get(*function_index as usize)
                            .copied()
                            .flatten()
                            .unwrap_or(callee);
                        // A defined callee's rewind copy restores its own parameters: its
                        // operands are not saved (nor kept alive across the call for that).
                        // A blocking import is called again with its original operands.
                        let n = params.len();
                        let (skip, keep) = match *function_index < ctx.n_imported {
                            true => (0..0, 0..n),
                            false => (0..n, 0..0),
                        };
                        let calls = (I::Call(callee), I::Call(rewind_callee));
                        (calls, params, res, skip, keep)
                    }
                    Operator::CallIndirect {
                        type_index,
                        table_index,
                    } => {
                        let ty = e.func_type(*type_index)?;
                        let (mut params, res) = (val_types(ty.params())?, val_types(ty.results())?);
                        params.push(ValType::I32);
                        let call = I::CallIndirect {
                            type_index: *type_index,
                            table_index: *table_index,
                        };
                        let call_rewind = I::CallIndirect {
                            type_index: *type_index,
                            table_index: ctx.rewind_table[*table_index as usize],
                        };
                        // Only the table index (on top) is needed again: it picks the rewind
                        // copy.
                        let index = params.len() - 1;
                        let (skip, keep) = (1..params.len(), index..index + 1);
                        ((call, call_rewind), params, res, skip, keep)
                    }
                    _ => unreachable!("matched a call above"),
                };
                let after = e.live.after_call.get(&at).cloned();
                let saved = e.saved_locals(&v, after.as_ref(), skip);
                let args = e.call_args(&v, params.len(), |j| keep.contains(&j))?;
                e.call_then_poll(
                    &mut v,
                    (offset, &op),
                    op_plan,
                    calls,
                    (&params, &res),
                    (saved.as_deref(), after.as_ref()),
                    &args,
                )?;
                e.seg_start(&v)?;
            }
            _ => {
                if relevant {
                    e.ensure_open();
                }
                e.plain_tracked(&op)?;
                v.op(offset, &op)?;
            }
        }
    }

    e.ins(I::End); // $done
    // The normal way out; then each epilogue's block ends and its code follows (the blocks
    // are opened in front of `$done` below, once their number is known).
    e.ins(I::Return);
    for k in 0..e.epilogues.len() {
        e.out.push(0x0b); // `end` of epilogue k's block (outside the depth count)
        e.epilogue(k);
    }
    e.ins(I::End); // function

    // Every record of this function has the same size; patch it into the unwind paths.
    let size = record_size(e.record_len);
    for at in std::mem::take(&mut e.size_fixups) {
        e.out[at..at + 6].copy_from_slice(&padded_i32(size as i32));
    }
    let stack = |offset: u32, align: u32| MemArg {
        offset: u64::from(offset),
        align,
        memory_index: ctx.stack_memory,
    };
    let (sp, state, fid) = (ctx.sp_global, ctx.state_global, e.fid);
    let saved: Vec<(u32, ValType, u32)> = e
        .locals
        .iter()
        .zip(&e.offsets)
        .enumerate()
        .filter(|(_, (_, off))| **off != u32::MAX)
        .map(|(l, (t, off))| (l as u32, *t, *off))
        .collect();

    let mut body_bytes = std::mem::take(&mut e.out);
    if copy == Copy::Rewind {
        // Prologue of the rewind copy: pop this frame's record.
        let mut pro = Vec::new();
        let mut p = |i: I<'_>| i.encode(&mut pro);
        p(I::GlobalGet(state));
        p(I::I32Const(abi::STATE_REWIND));
        p(I::I32Eq);
        p(I::If(BlockType::Empty));
        p(I::I32Const(1));
        p(I::LocalSet(rw));
        p(I::GlobalGet(sp));
        p(I::I32Const(size as i32));
        p(I::I32Sub);
        p(I::GlobalSet(sp));
        p(I::GlobalGet(sp));
        p(I::I32Load(stack(0, 2)));
        p(I::I32Const(fid));
        p(I::I32Ne);
        p(I::If(BlockType::Empty));
        p(I::Unreachable);
        p(I::End);
        p(I::GlobalGet(sp));
        p(I::I32Load(stack(4, 2)));
        p(I::LocalSet(idx));
        for &(l, t, off) in &saved {
            p(I::GlobalGet(sp));
            p(load(t, stack(off, size_of(t).trailing_zeros())));
            p(I::LocalSet(l));
        }
        p(I::End);
        body_bytes.splice(prologue_at..prologue_at, pro);
    }
    // The epilogue blocks: epilogue K-1 outermost, epilogue 0 just around `$done`.
    let n_epilogues = e.epilogues.len();
    body_bytes.splice(0..0, [0x02, 0x40].repeat(n_epilogues));
    let opened = 2 * n_epilogues as u32;

    let declared = &e.locals[n_params..];
    let mut groups: Vec<(u32, ValType)> = Vec::new();
    for t in declared {
        match groups.last_mut() {
            Some((n, last)) if last == t => *n += 1,
            _ => groups.push((1, *t)),
        }
    }
    let mut f = Function::new(groups);
    // Hint offsets count from the start of the body (its locals declaration). The rewind copy's
    // prologue shifts its code, and it runs only while rewinding: it gets no hints.
    let base = f.byte_len() as u32;
    let unlikely = match copy {
        Copy::Lean => e.unlikely.iter().map(|p| base + opened + p).collect(),
        Copy::Rewind => Vec::new(),
    };
    f.raw(body_bytes);
    let layout = Layout {
        temps: e.temps,
        locals: e.locals,
        offsets: e.offsets,
        record_len: e.record_len,
    };
    Ok(Emitted {
        function: f,
        layout,
        unlikely,
        unsaved_return_polls: e.unsaved_return_polls,
    })
}
