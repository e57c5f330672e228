//! Liveness of a function's original locals at each unwind point, so an unwinding frame saves
//! only what its continuation can still read (and the save code adds no liveness of its own:
//! the register allocator keeps exactly what the original code keeps across each call).
//!
//! A backward analysis over the structured body: `local.get` makes a local live, `local.set`
//! and `local.tee` kill it, branches take the live set of their target label (a block's end,
//! a loop's header), loops iterate to a fixed point; a call or throw inside a `try_table` may
//! also leave for its handlers (the catch labels). Each loop's header set is cached and
//! reused as the starting point when an enclosing loop iterates again, so nested loops cost
//! about one extra pass each. A work budget guards against pathological nesting: past it,
//! every local counts as live everywhere (always safe, only slower to unwind).

use std::collections::HashMap;

use wasmparser::{Catch, Operator};

/// A set of local indices.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Locals(Vec<u64>);

impl Locals {
    fn new(n: usize) -> Self {
        Self(vec![0; n.div_ceil(64)])
    }
    fn all(n: usize) -> Self {
        let mut s = Self::new(n);
        for i in 0..n {
            s.insert(i as u32);
        }
        s
    }
    fn insert(&mut self, i: u32) {
        if let Some(w) = self.0.get_mut(i as usize / 64) {
            *w |= 1 << (i % 64);
        }
    }
    fn remove(&mut self, i: u32) {
        if let Some(w) = self.0.get_mut(i as usize / 64) {
            *w &= !(1 << (i % 64));
        }
    }
    fn union(&mut self, o: &Locals) {
        for (a, b) in self.0.iter_mut().zip(&o.0) {
            *a |= b;
        }
    }
    /// The members, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().enumerate().flat_map(|(w, bits)| {
            (0..64)
                .filter(move |b| bits & (1u64 << b) != 0)
                .map(move |b| (w * 64 + b) as u32)
        })
    }
}

/// Live sets at the points where a frame can unwind.
#[derive(Debug)]
pub(crate) struct Liveness {
    /// After each call instruction (by operator index).
    pub after_call: HashMap<usize, Locals>,
    /// At the top of each loop body (by the loop's operator index): where its poll sits.
    pub loop_header: HashMap<usize, Locals>,
    /// At function entry.
    pub entry: Locals,
}

struct Analysis<'o> {
    ops: &'o [Operator<'o>],
    /// For each `end`/`else`, the index of the construct that opens it; for each opener, its `else`.
    opener: Vec<usize>,
    else_of: HashMap<usize, usize>,
    n: usize,
    out: Liveness,
    loop_cache: HashMap<usize, Locals>,
    /// For each enclosing `try_table` (innermost last): what its handlers can read — the union
    /// of its catch targets' live sets and the enclosing handlers' (an exception a catch
    /// does not match goes further out).
    handlers: Vec<Locals>,
    work: usize,
    budget: usize,
}

/// Analyses `ops` (a whole function body, final `end` included) with `n_locals` locals.
pub(crate) fn analyze(ops: &[Operator<'_>], n_locals: usize) -> Liveness {
    let mut opener = vec![usize::MAX; ops.len()];
    let mut else_of = HashMap::new();
    let mut stack = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        match op {
            Operator::Block { .. }
            | Operator::Loop { .. }
            | Operator::If { .. }
            | Operator::TryTable { .. } => stack.push(i),
            Operator::Else => {
                if let Some(&s) = stack.last() {
                    else_of.insert(s, i);
                    opener[i] = s;
                }
            }
            Operator::End => {
                if let Some(s) = stack.pop() {
                    opener[i] = s;
                }
            }
            _ => {}
        }
    }
    let mut a = Analysis {
        ops,
        opener,
        else_of,
        n: n_locals,
        out: Liveness {
            after_call: HashMap::new(),
            loop_header: HashMap::new(),
            entry: Locals::new(n_locals),
        },
        loop_cache: HashMap::new(),
        handlers: Vec::new(),
        work: 0,
        budget: 64 * ops.len() + 1_000_000,
    };
    let body_end = ops.len().saturating_sub(1); // the function's own `end`
    let exit = Locals::new(n_locals);
    let entry = a.seq(0, body_end, exit.clone(), &mut vec![exit]);
    if a.work > a.budget {
        let all = Locals::all(n_locals);
        return Liveness {
            after_call: a.out.after_call.keys().map(|k| (*k, all.clone())).collect(),
            loop_header: a
                .out
                .loop_header
                .keys()
                .map(|k| (*k, all.clone()))
                .collect(),
            entry: all,
        };
    }
    a.out.entry = entry;
    a.out
}

impl Analysis<'_> {
    /// Live-in of the instructions `[start, end)` given the live-out set; `labels` are the
    /// live sets of the enclosing branch targets, innermost last.
    fn seq(
        &mut self,
        start: usize,
        end: usize,
        mut live: Locals,
        labels: &mut Vec<Locals>,
    ) -> Locals {
        let mut i = end;
        while i > start {
            i -= 1;
            self.work += 1;
            if self.work > self.budget {
                return Locals::all(self.n);
            }
            let op = &self.ops[i];
            match op {
                Operator::End => {
                    let s = self.opener[i];
                    if s == usize::MAX || s < start {
                        continue;
                    }
                    live = self.construct(s, i, live, labels);
                    i = s;
                }
                Operator::LocalGet { local_index } => live.insert(*local_index),
                Operator::LocalSet { local_index } | Operator::LocalTee { local_index } => {
                    live.remove(*local_index)
                }
                Operator::Br { relative_depth } => live = self.label(labels, *relative_depth),
                Operator::BrIf { relative_depth } => {
                    live.union(&self.label(labels, *relative_depth))
                }
                Operator::BrTable { targets } => {
                    let mut l = self.label(labels, targets.default());
                    for t in targets.targets().flatten() {
                        l.union(&self.label(labels, t));
                    }
                    live = l;
                }
                Operator::Return | Operator::Unreachable => live = Locals::new(self.n),
                // An exception leaves for the innermost handler (or the caller).
                Operator::Throw { .. } | Operator::ThrowRef => live = self.thrown(),
                Operator::Call { .. } | Operator::CallIndirect { .. } => {
                    // A callee may throw instead of returning (also after a resume): what the
                    // handlers read is live across the call.
                    live.union(&self.thrown());
                    self.out.after_call.insert(i, live.clone());
                }
                _ => {}
            }
        }
        live
    }

    /// A block, loop or if spanning `[s, e]` (`e` is its `end`).
    fn construct(&mut self, s: usize, e: usize, after: Locals, labels: &mut Vec<Locals>) -> Locals {
        match &self.ops[s] {
            Operator::Loop { .. } => {
                let mut header = self
                    .loop_cache
                    .get(&s)
                    .cloned()
                    .unwrap_or_else(|| Locals::new(self.n));
                loop {
                    labels.push(header.clone());
                    let mut next = self.seq(s + 1, e, after.clone(), labels);
                    labels.pop();
                    next.union(&header);
                    if next == header || self.work > self.budget {
                        break;
                    }
                    header = next;
                }
                self.loop_cache.insert(s, header.clone());
                self.out.loop_header.insert(s, header.clone());
                header
            }
            Operator::If { .. } => {
                labels.push(after.clone());
                let live = match self.else_of.get(&s).copied() {
                    Some(x) => {
                        let mut t = self.seq(s + 1, x, after.clone(), labels);
                        t.union(&self.seq(x + 1, e, after.clone(), labels));
                        t
                    }
                    None => {
                        let mut t = self.seq(s + 1, e, after.clone(), labels);
                        t.union(&after);
                        t
                    }
                };
                labels.pop();
                live
            }
            Operator::TryTable { try_table } => {
                // Catch labels are resolved outside the `try_table`'s own label.
                let mut caught = self.thrown();
                for c in &try_table.catches {
                    let label = match c {
                        Catch::One { label, .. }
                        | Catch::OneRef { label, .. }
                        | Catch::All { label }
                        | Catch::AllRef { label } => *label,
                    };
                    caught.union(&self.label(labels, label));
                }
                self.handlers.push(caught);
                labels.push(after.clone());
                let live = self.seq(s + 1, e, after, labels);
                labels.pop();
                self.handlers.pop();
                live
            }
            _ => {
                labels.push(after.clone());
                let live = self.seq(s + 1, e, after, labels);
                labels.pop();
                live
            }
        }
    }

    /// Live at a throw: what the innermost enclosing handler (and those outside it) can read.
    fn thrown(&self) -> Locals {
        self.handlers
            .last()
            .cloned()
            .unwrap_or_else(|| Locals::new(self.n))
    }
}

impl Analysis<'_> {
    /// The live set at a branch target; every local when the depth names no label (never for
    /// validated code, and "all live" is the safe answer).
    fn label(&self, labels: &[Locals], depth: u32) -> Locals {
        labels
            .get(labels.len().wrapping_sub(1 + depth as usize))
            .cloned()
            .unwrap_or_else(|| Locals::all(self.n))
    }
}
