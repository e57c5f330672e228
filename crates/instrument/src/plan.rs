//! Phase A of the per-function transform: number the call sites and find the constructs that
//! contain them.
//!
//! Sites are numbered in the order the emitter meets them: the entry poll (if any) is 0, then
//! in instruction order each reachable loop's header poll and each reachable unwind-capable
//! call (followed by its return poll for a call inside a call-graph cycle). A construct is
//! *relevant* when it is reachable at its start and contains sites.

use std::collections::HashMap;

use wasmparser::{FuncToValidate, FunctionBody, Operator, ValidatorResources};

use crate::counted::Guard;
use crate::emit::ModuleCtx;
use crate::error::InstrumentError;
use crate::live::Liveness;

/// Deepest control nesting ferry accepts in one function.
pub(crate) const MAX_NESTING: usize = 10_000;

/// What the emitter must do at one instruction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum OpPlan {
    /// Copy it (renumbering indices and branch depths).
    #[default]
    Plain,
    /// An unwind-capable call: call site number.
    Site(u32),
    /// An unwind-capable call inside a call-graph cycle: call site `n`, and `n + 1` a safe
    /// point just after it returns (a return poll, v14).
    SiteThenPoll(u32),
    /// A relevant block/loop/if: the end of the `then` arm's site range (for `if`: sites below
    /// it are in the `then` arm) and the loop-header poll's site.
    Construct { then_hi: u32, poll: Option<u32> },
}

/// Phase A's result for one function.
#[derive(Debug)]
pub(crate) struct Plan {
    pub entry_poll: bool,
    pub ops: Vec<OpPlan>,
    pub n_sites: u32,
    pub n_polls: u32,
    /// Live original locals at each unwind point (shared by both copies of the function).
    pub live: Liveness,
    /// Counted loops (by the index of their `loop`): the lean copy runs an unpolled copy
    /// when the guard says the loop ends soon enough (v15, `counted.rs`).
    pub counted: HashMap<usize, Guard>,
    /// The loops inside each counted loop that holds any (by index; v18): the unpolled copy
    /// polls on their ways back.
    pub inner_loops: HashMap<usize, Vec<usize>>,
}

struct Open {
    op: usize,
    lo: u32,
    reachable: bool,
    then_hi: Option<u32>,
    poll: Option<u32>,
}

pub(crate) fn plan(
    fv: &FuncToValidate<ValidatorResources>,
    body: &FunctionBody<'_>,
    entry_poll: bool,
    ctx: &ModuleCtx<'_>,
) -> Result<Plan, InstrumentError> {
    let mut validator = FuncToValidate {
        resources: fv.resources.clone(),
        ..*fv
    }
    .into_validator(Default::default());
    let mut locals = body.get_locals_reader()?;
    for _ in 0..locals.get_count() {
        let offset = locals.original_position();
        let (count, ty) = locals.read()?;
        validator.define_locals(offset, count, ty)?;
    }

    let mut next = 0u32;
    let mut n_polls = 0u32;
    if entry_poll {
        // Reserved: emitted only where a return poll inside the cycle cannot be.
        next = 1;
    }
    let own_scc = ctx
        .scc_of_func
        .get(fv.index as usize)
        .copied()
        .unwrap_or(u32::MAX);
    let in_cycle = |scc: Option<&u32>| own_scc != u32::MAX && scc == Some(&own_scc);
    let mut ops = Vec::new();
    let mut open: Vec<Open> = Vec::new();
    let mut body_ops = Vec::new();
    let mut counted = HashMap::new();
    let mut inner_loops = HashMap::new();
    // The operand stack's height on entry to each loop.
    let mut loop_heights: HashMap<usize, u32> = HashMap::new();
    let mut reader = body.get_operators_reader()?;
    while !reader.eof() {
        let offset = reader.original_position();
        let op = reader.read()?;
        // Code inside a construct that starts in dead code looks reachable to the validator
        // (a new frame starts reachable), so liveness is inherited from the enclosing frame.
        let reachable = !validator
            .get_control_frame(0)
            .expect("a function body always has a frame")
            .unreachable
            && open.last().is_none_or(|o| o.reachable);
        let idx = ops.len();
        let mut this = OpPlan::Plain;
        match &op {
            Operator::Block { .. }
            | Operator::If { .. }
            | Operator::Loop { .. }
            | Operator::TryTable { .. } => {
                if open.len() >= MAX_NESTING {
                    return Err(InstrumentError::Unsupported(format!(
                        "control nesting deeper than {MAX_NESTING} in function {}",
                        fv.index
                    )));
                }
                let mut o = Open {
                    op: idx,
                    lo: next,
                    reachable,
                    then_hi: None,
                    poll: None,
                };
                if reachable && matches!(op, Operator::Loop { .. }) {
                    o.poll = Some(next);
                    next += 1;
                    n_polls += 1;
                }
                if matches!(op, Operator::Loop { .. }) {
                    loop_heights.insert(idx, validator.operand_stack_height());
                }
                open.push(o);
            }
            Operator::Else => {
                if let Some(o) = open.last_mut() {
                    o.then_hi = Some(next);
                }
            }
            Operator::End => {
                if let Some(o) = open.pop()
                    && o.reachable
                    && next > o.lo
                {
                    ops[o.op] = OpPlan::Construct {
                        then_hi: o.then_hi.unwrap_or(next),
                        poll: o.poll,
                    };
                    // `body_ops` ends just before this `end`: the slice is the loop's body.
                    // An inner loop's ways back save what its header poll saves: the values
                    // on the stack there must be those on entry to this loop (spilled before
                    // its guard), with none pushed in between.
                    let height = loop_heights.get(&o.op);
                    if o.poll.is_some()
                        && body.range().len() <= crate::counted::MAX_FUNCTION
                        && let Some(g) = crate::counted::analyze(&body_ops[o.op + 1..])
                    {
                        let inner: Vec<usize> = (o.op + 1..idx)
                            .filter(|&j| matches!(body_ops[j], Operator::Loop { .. }))
                            .collect();
                        if inner.iter().all(|j| loop_heights.get(j) == height) {
                            counted.insert(o.op, g);
                            if !inner.is_empty() {
                                inner_loops.insert(o.op, inner);
                            }
                        }
                    }
                }
            }
            Operator::Call { function_index }
                if reachable && ctx.is_site_callee[*function_index as usize] =>
            {
                this = match in_cycle(ctx.scc_of_func.get(*function_index as usize)) {
                    true => OpPlan::SiteThenPoll(next),
                    false => OpPlan::Site(next),
                };
            }
            Operator::CallIndirect { type_index, .. }
                if reachable && ctx.is_site_indirect[*type_index as usize] =>
            {
                this = match in_cycle(ctx.scc_of_type.get(*type_index as usize)) {
                    true => OpPlan::SiteThenPoll(next),
                    false => OpPlan::Site(next),
                };
            }
            _ => {}
        }
        match this {
            OpPlan::Site(_) => next += 1,
            OpPlan::SiteThenPoll(_) => {
                next += 2;
                n_polls += 1;
            }
            _ => {}
        }
        ops.push(this);
        validator.op(offset, &op)?;
        body_ops.push(op);
    }
    let live = crate::live::analyze(&body_ops, validator.len_locals() as usize);
    Ok(Plan {
        entry_poll,
        ops,
        n_sites: next,
        n_polls,
        live,
        counted,
        inner_loops,
    })
}
