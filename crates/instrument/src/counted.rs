//! Counted leaf loops (v15): loops whose header poll the lean copy may skip when, on entry,
//! the loop is known to end within a bounded number of iterations.
//!
//! A poll at a loop header costs one load and a branch, but in a tight numeric kernel (numpy's
//! BLAS dot products, SQLite's and Lua's byte loops) it also costs a register: the flag's
//! address is loop-invariant, so Cranelift keeps it in one for the whole loop and spills a
//! loop-carried value instead. A *counted leaf loop* is
//!
//! * in a function of at most [`MAX_FUNCTION`] bytes of code;
//! * a leaf: no call of any kind, no nested loop, no instruction whose work grows with its
//!   operands (`memory.grow`, `memory.fill` / `copy` / `init`, the table forms),
//!   no `try_table`, at most [`MAX_BODY`] instructions;
//! * with a *test* at its top level, before its first way back (so every iteration runs it):
//!   a `br_if` that is that way back (`do … while`) or one that leaves the loop (`while`,
//!   `for`); the code after the first way back may branch back again or anywhere;
//! * whose test compares an *induction variable* `i` with a limit `n`: `i` is a local written
//!   exactly once in the loop, at its top level before the first way back, as `i = i ± c` (a
//!   constant `c`), and `n` is a constant or a local the loop never writes. The test is
//!   `i OP n` (`ne`, `lt`/`le` counting up, `gt`/`ge` counting down, signed or unsigned,
//!   either operand order, possibly under an `eqz`) or `i` against zero, reading `i` before
//!   or after the update.
//!
//! For such a loop the values of `i` and `n` on entry decide how many iterations it can run at
//! most; [`Guard`] turns that into a test the lean copy makes once, before the loop: if the
//! loop will end within [`Guard::budget`] iterations it runs a copy without the poll,
//! otherwise the polled loop as before. The budget keeps the time to a safe point bounded: at
//! most [`WORK`] instructions of the loop run without a poll (plus what the loop's entry
//! reached before it).

use std::collections::HashMap;

use wasmparser::Operator;

/// Largest function (bytes of original code) whose loops get unpolled copies. In a very large
/// function the guards and second loops slow everything else down although the instruction
/// count stays the same: SQLite's 50 KB `sqlite3VdbeExec` took the SQLite workload from 1.32x
/// to 1.46x (A/B, alternating, page cache dropped before each run); with this limit it is
/// 1.31–1.32x again. Its hot loops are not leaves anyway; numeric kernels are small.
pub(crate) const MAX_FUNCTION: usize = 32 * 1024;
/// Largest loop body (instructions) given an unpolled copy: the copy is code-size growth.
const MAX_BODY: usize = 2048;
/// Most loop-body instructions an unpolled copy may run: the budget is `WORK / body length`
/// iterations (at most [`MAX_ITERATIONS`]).
const WORK: u64 = 1 << 18;
/// Most iterations an unpolled copy may run.
const MAX_ITERATIONS: u64 = 1 << 16;
/// Largest step `|c|` accepted: keeps `budget × |c|` far from overflowing either width.
const MAX_STEP: u64 = 1 << 12;

/// An operand of a loop's test — the limit `n` of a [`Guard`]: a local (read, or written by a
/// `local.tee`) or a constant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Operand {
    Local(u32),
    Const(i64),
}

/// The continue condition, with the induction variable on the left: `i OP n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pred {
    Ne,
    Lt { signed: bool },
    Le { signed: bool },
    Gt { signed: bool },
    Ge { signed: bool },
}

/// What the lean copy tests on entry to a counted leaf loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Guard {
    /// `i64` induction variable (else `i32`).
    pub wide: bool,
    /// The induction variable (a local index, unchanged by the transform).
    pub ivar: u32,
    /// Added to it once per iteration.
    pub step: i64,
    /// The test reads the variable before the iteration's update (else after it).
    pub pre: bool,
    pub limit: Operand,
    pub pred: Pred,
    /// Most iterations the unpolled copy may run.
    pub budget: u64,
    /// Loops inside the loop (v18): the unpolled copy polls on their ways back, so each runs
    /// at most one iteration unpolled per iteration of this loop, and the budget (over the
    /// whole body, inner loops included) still bounds the work between two polls.
    pub inner: u32,
}

/// The guard for a loop whose body (between `loop` and its `end`, both excluded) is `body`,
/// or `None` if it is not a counted leaf loop.
pub(crate) fn analyze(body: &[Operator<'_>]) -> Option<Guard> {
    let n = body.len();
    if !(2..=MAX_BODY).contains(&n) {
        return None;
    }
    // writes[l] = (count, index of the last one, all at top level)
    let mut writes: HashMap<u32, (u32, usize, bool)> = HashMap::new();
    let mut depth = 0u32;
    // Per open construct inside the loop: whether it is a loop (an inner loop).
    let mut loops: Vec<bool> = Vec::new();
    // The top-level instruction (or construct) holding the first way back.
    let mut first_back: Option<usize> = None;
    let mut top = 0usize;
    // Top-level `br_if`s: (index, leaves the loop).
    let mut tests: Vec<(usize, bool)> = Vec::new();
    let mut inner = 0u32;
    for (j, op) in body.iter().enumerate() {
        if depth == 0 {
            top = j;
        }
        let mut back = false;
        match op {
            Operator::Block { .. } | Operator::If { .. } => {
                depth += 1;
                loops.push(false);
            }
            // An inner loop (v18): the unpolled copy polls on its ways back instead of at its
            // header, which a branch can only reach with no values (no parameters).
            Operator::Loop { blockty } => {
                if matches!(blockty, wasmparser::BlockType::FuncType(_)) {
                    return None;
                }
                depth += 1;
                loops.push(true);
                inner += 1;
            }
            Operator::End => {
                depth = depth.checked_sub(1)?;
                loops.pop();
            }
            Operator::Br { relative_depth } => back = *relative_depth == depth,
            Operator::BrIf { relative_depth } => {
                back = *relative_depth == depth;
                if depth == 0 {
                    tests.push((j, !back));
                }
            }
            Operator::BrTable { targets } => {
                // A table naming an inner loop would need a poll per entry: not handled.
                let names_inner_loop = |t: u32| t < depth && loops[(depth - 1 - t) as usize];
                for t in targets.targets() {
                    let t = t.ok()?;
                    back |= t == depth;
                    if names_inner_loop(t) {
                        return None;
                    }
                }
                back |= targets.default() == depth;
                if names_inner_loop(targets.default()) {
                    return None;
                }
            }
            Operator::LocalSet { local_index } | Operator::LocalTee { local_index } => {
                let w = writes.entry(*local_index).or_insert((0, j, true));
                w.0 += 1;
                w.1 = j;
                w.2 &= depth == 0;
            }
            op if is_call(op) => return None,
            Operator::TryTable { .. }
            | Operator::MemoryGrow { .. }
            | Operator::MemoryFill { .. }
            | Operator::MemoryCopy { .. }
            | Operator::MemoryInit { .. }
            | Operator::TableGrow { .. }
            | Operator::TableFill { .. }
            | Operator::TableCopy { .. }
            | Operator::TableInit { .. }
            | Operator::BrOnNull { .. }
            | Operator::BrOnNonNull { .. }
            | Operator::BrOnCast { .. }
            | Operator::BrOnCastFail { .. }
            | Operator::Try { .. }
            | Operator::Delegate { .. } => return None,
            _ => {}
        }
        if back && first_back.is_none() {
            first_back = Some(top);
        }
    }
    // Every iteration runs the top-level code before `first_back` (nothing else leads back).
    let first_back = first_back?;
    if depth != 0 {
        return None;
    }
    let budget = (WORK / n as u64).min(MAX_ITERATIONS);
    if budget < 2 {
        return None;
    }
    let ctx = Ctx {
        body,
        writes: &writes,
        first_back,
    };
    tests
        .into_iter()
        .filter(|&(e, exits)| {
            if exits {
                e < first_back
            } else {
                e == first_back
            }
        })
        .find_map(|(e, exits)| ctx.test(e, exits, budget))
        .map(|g| Guard { inner, ..g })
}

/// What [`analyze`] knows about the loop when it reads a test.
struct Ctx<'b, 'a> {
    body: &'b [Operator<'a>],
    writes: &'b HashMap<u32, (u32, usize, bool)>,
    first_back: usize,
}

impl Ctx<'_, '_> {
    /// `x` is an induction variable: written exactly once, at top level, before the first way
    /// back, as `x = x + c`. Its width, `c`, and where it is written.
    fn induction(&self, x: u32) -> Option<(bool, i64, usize)> {
        let &(count, w, top) = self.writes.get(&x)?;
        if count != 1 || !top || w < 3 || w > self.first_back {
            return None;
        }
        let b = self.body;
        let (wide, sub) = match b[w - 1] {
            Operator::I32Add => (false, false),
            Operator::I64Add => (true, false),
            Operator::I32Sub => (false, true),
            Operator::I64Sub => (true, true),
            _ => return None,
        };
        let get =
            |o: &Operator<'_>| matches!(o, Operator::LocalGet { local_index } if *local_index == x);
        let c = match (&b[w - 3], &b[w - 2], wide) {
            (g, Operator::I32Const { value }, false) if get(g) => i64::from(*value),
            (g, Operator::I64Const { value }, true) if get(g) => *value,
            (Operator::I32Const { value }, g, false) if get(g) && !sub => i64::from(*value),
            (Operator::I64Const { value }, g, true) if get(g) && !sub => *value,
            _ => return None,
        };
        let c = if sub { c.checked_neg()? } else { c };
        (c != 0 && c.unsigned_abs() <= MAX_STEP).then_some((wide, c, w))
    }

    /// The operand whose value the instruction at `q` leaves, and where its code starts.
    fn operand(&self, q: usize) -> Option<(Operand, usize)> {
        Some(match self.body[q] {
            Operator::LocalGet { local_index } => (Operand::Local(local_index), q),
            // The update itself, written into the test (`(x = x + c) != n`).
            Operator::LocalTee { local_index } => match self.induction(local_index) {
                Some((_, _, w)) if w == q => (Operand::Local(local_index), q - 3),
                _ => (Operand::Local(local_index), q),
            },
            Operator::I32Const { value } => (Operand::Const(i64::from(value)), q),
            Operator::I64Const { value } => (Operand::Const(value), q),
            _ => return None,
        })
    }

    /// The top-level `br_if` at `e` — a way back (`exits` false) or out — as the loop's
    /// continue condition on an induction variable, if it is one.
    fn test(&self, e: usize, exits: bool, budget: u64) -> Option<Guard> {
        let b = self.body;
        let mut p = e.checked_sub(1)?;
        // The condition is negated by an `eqz`; leaving the loop negates it again.
        let mut negate = exits;
        let mut eqz_wide = None;
        match b[p] {
            Operator::I32Eqz => eqz_wide = Some(false),
            Operator::I64Eqz => eqz_wide = Some(true),
            _ => {}
        }
        if eqz_wide.is_some() {
            negate = !negate;
            p = p.checked_sub(1)?;
        }
        let (ivar, limit, pred, cmp_wide) = if let Some((wide, pred)) = compare(&b[p]) {
            if eqz_wide == Some(true) {
                return None;
            }
            let (rhs, start) = self.operand(p.checked_sub(1)?)?;
            let (lhs, _) = self.operand(start.checked_sub(1)?)?;
            let invariant = |o: Operand| match o {
                Operand::Const(_) => Some(o),
                Operand::Local(l) => (!self.writes.contains_key(&l)).then_some(o),
            };
            let pred = if negate { negated(pred)? } else { pred };
            match (lhs, rhs) {
                (Operand::Local(x), o) if self.induction(x).is_some() => {
                    (x, invariant(o)?, pred, wide)
                }
                (o, Operand::Local(x)) if self.induction(x).is_some() => {
                    (x, invariant(o)?, flip(pred), wide)
                }
                _ => return None,
            }
        } else {
            // A test of the variable itself: `x != 0`, or with an `eqz`, `x == 0`.
            let (Operand::Local(x), _) = self.operand(p)? else {
                return None;
            };
            if negate {
                return None; // continues while `x == 0`
            }
            (x, Operand::Const(0), Pred::Ne, eqz_wide.unwrap_or(false))
        };
        let (wide, step, w) = self.induction(ivar)?;
        if wide != cmp_wide {
            return None;
        }
        finish(Guard {
            wide,
            ivar,
            step,
            // Tested before it is updated: the k-th test sees `i0 + (k − 1)·c`.
            pre: w > e,
            limit,
            pred,
            budget,
            inner: 0,
        })
    }
}

/// `!(i OP n)`, where that is again a test [`Guard`] can bound.
fn negated(p: Pred) -> Option<Pred> {
    Some(match p {
        Pred::Ne => return None, // continues while `i == n`
        Pred::Lt { signed } => Pred::Ge { signed },
        Pred::Le { signed } => Pred::Gt { signed },
        Pred::Gt { signed } => Pred::Le { signed },
        Pred::Ge { signed } => Pred::Lt { signed },
    })
}

/// Keeps only the conditions whose iteration count the entry values bound.
fn finish(g: Guard) -> Option<Guard> {
    let ok = match g.pred {
        // The loop ends when `i` meets `n` exactly: a power-of-two step makes that testable.
        Pred::Ne => g.step.unsigned_abs().is_power_of_two(),
        Pred::Lt { .. } | Pred::Le { .. } => g.step > 0,
        Pred::Gt { .. } | Pred::Ge { .. } => g.step < 0,
    };
    ok.then_some(g)
}

/// A call of any kind (a loop holding one is not a leaf).
fn is_call(op: &Operator<'_>) -> bool {
    matches!(
        op,
        Operator::Call { .. }
            | Operator::CallIndirect { .. }
            | Operator::CallRef { .. }
            | Operator::ReturnCall { .. }
            | Operator::ReturnCallIndirect { .. }
            | Operator::ReturnCallRef { .. }
    )
}

fn compare(op: &Operator<'_>) -> Option<(bool, Pred)> {
    use Pred::*;
    Some(match op {
        Operator::I32Ne => (false, Ne),
        Operator::I32LtS => (false, Lt { signed: true }),
        Operator::I32LtU => (false, Lt { signed: false }),
        Operator::I32LeS => (false, Le { signed: true }),
        Operator::I32LeU => (false, Le { signed: false }),
        Operator::I32GtS => (false, Gt { signed: true }),
        Operator::I32GtU => (false, Gt { signed: false }),
        Operator::I32GeS => (false, Ge { signed: true }),
        Operator::I32GeU => (false, Ge { signed: false }),
        Operator::I64Ne => (true, Ne),
        Operator::I64LtS => (true, Lt { signed: true }),
        Operator::I64LtU => (true, Lt { signed: false }),
        Operator::I64LeS => (true, Le { signed: true }),
        Operator::I64LeU => (true, Le { signed: false }),
        Operator::I64GtS => (true, Gt { signed: true }),
        Operator::I64GtU => (true, Gt { signed: false }),
        Operator::I64GeS => (true, Ge { signed: true }),
        Operator::I64GeU => (true, Ge { signed: false }),
        _ => return None,
    })
}

/// `n OP i` as `i OP' n`.
fn flip(p: Pred) -> Pred {
    match p {
        Pred::Ne => Pred::Ne,
        Pred::Lt { signed } => Pred::Gt { signed },
        Pred::Le { signed } => Pred::Ge { signed },
        Pred::Gt { signed } => Pred::Lt { signed },
        Pred::Ge { signed } => Pred::Le { signed },
    }
}

/// One instruction of the guard, independent of the encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum G {
    LocalGet(u32),
    Const(i64),
    Add,
    Sub,
    And,
    Eqz,
    /// Comparisons, signed when `true` (the width is the guard's).
    Le(bool),
    Ge(bool),
    Lt(bool),
    Gt(bool),
    /// `i32.and` of two conditions.
    BothI32,
}

impl Guard {
    /// The entry test: leaves an `i32`, non-zero when the loop, entered with the current
    /// values of its locals, ends within `budget` iterations.
    ///
    /// With `i0` the induction variable on entry and `a = |c|`, the `k`-th test sees
    /// `i0 + k·c` (k ≥ 1; with the test before the update, see `budget` below). For `ne` the
    /// loop ends at the `k` with `k·a = D` (`D = n − i0`, or `i0 − n` when counting down), so
    /// `a ≤ D ≤ budget·a` and `a | D` suffice. For the ordered tests, `i` moves monotonically without wrapping for `budget`
    /// steps when `i0` is at least `budget·a` from the end of its range, and the condition
    /// fails by then when `i0 ± budget·a` is past `n`; counting down to an unsigned limit has
    /// its own test (below).
    pub(crate) fn code(&self) -> Vec<G> {
        let a = self.step.unsigned_abs() as i64;
        // Tested before the update, the first test sees `i0` itself: the tests after it are
        // those of a loop updating first, with one iteration less.
        let budget = self.budget - u64::from(self.pre);
        let ba = budget as i64 * a;
        let n = [match self.limit {
            Operand::Local(l) => G::LocalGet(l),
            Operand::Const(k) => G::Const(k),
        }];
        let i: &[G] = &[G::LocalGet(self.ivar)];
        let (max, min) = if self.wide {
            (i64::MAX, i64::MIN)
        } else {
            (i64::from(i32::MAX), i64::from(i32::MIN))
        };
        // As the width's bit pattern: `u32::MAX − ba` is a negative `i32`.
        let umax_minus_ba = if self.wide {
            (u64::MAX - ba as u64) as i64
        } else {
            i64::from((u32::MAX - ba as u32) as i32)
        };
        let mut c: Vec<G> = Vec::new();
        let mut put = |parts: &[&[G]]| {
            for p in parts {
                c.extend_from_slice(p);
            }
        };
        match self.pred {
            Pred::Ne => {
                let (x, y) = if self.step > 0 {
                    (&n[..], i)
                } else {
                    (i, &n[..])
                };
                put(&[
                    x,
                    y,
                    &[G::Sub, G::Const(a), G::Sub, G::Const(ba - a), G::Le(false)],
                ]);
                if a > 1 {
                    put(&[x, y, &[G::Sub, G::Const(a - 1), G::And, G::Eqz, G::BothI32]]);
                }
            }
            Pred::Lt { signed } | Pred::Le { signed } => {
                let bound = if signed { max - ba } else { umax_minus_ba };
                let end = match self.pred {
                    Pred::Lt { .. } => G::Ge(signed),
                    _ => G::Gt(signed),
                };
                put(&[i, &[G::Const(bound), G::Le(signed)]]);
                put(&[i, &[G::Const(ba), G::Add], &n, &[end, G::BothI32]]);
            }
            // Counting down to an unsigned limit (`i > n`, `i >= n`): a range test like the
            // signed one (`i0 ≥ budget·a`) would refuse the loops that start near zero, which
            // are most of them. The loop ends within the budget when `i0` starts at most
            // `budget·a` above `n`; it does not wrap below zero on the way when `n ≥ a − 1`
            // (`>`, `i0 > n`) or `n ≥ a` (`>=`): the last value that continues is then at
            // least `a`.
            Pred::Gt { signed: false } => {
                put(&[i, &n, &[G::Gt(false)]]);
                put(&[i, &n, &[G::Sub, G::Const(ba), G::Le(false), G::BothI32]]);
                if a > 1 {
                    put(&[&n, &[G::Const(a - 1), G::Ge(false), G::BothI32]]);
                }
            }
            Pred::Ge { signed: false } => {
                put(&[i, &n, &[G::Ge(false)]]);
                put(&[i, &n, &[G::Sub, G::Const(ba), G::Lt(false), G::BothI32]]);
                put(&[&n, &[G::Const(a), G::Ge(false), G::BothI32]]);
            }
            Pred::Gt { signed: true } | Pred::Ge { signed: true } => {
                let end = match self.pred {
                    Pred::Gt { .. } => G::Le(true),
                    _ => G::Lt(true),
                };
                put(&[i, &[G::Const(min + ba), G::Ge(true)]]);
                put(&[i, &[G::Const(ba), G::Sub], &n, &[end, G::BothI32]]);
            }
        }
        c
    }

    /// Whether a loop entered with `i0` and limit `n` runs at most `budget` iterations, by
    /// simulating its tests step by step — what [`Guard::code`] must imply (the tests run that
    /// code in an evaluator and compare).
    #[cfg(test)]
    pub(crate) fn admits(&self, i0: i64, n: i64) -> bool {
        let bits = if self.wide { 64 } else { 32 };
        let mask = if self.wide {
            u64::MAX
        } else {
            u64::from(u32::MAX)
        };
        let norm_u = |v: i64| (v as u64) & mask;
        let norm_s = |v: i64| ((v as u64) << (64 - bits)) as i64 >> (64 - bits);
        let mut i = norm_s(i0);
        for k in 0..self.budget {
            if !self.pre || k > 0 {
                i = norm_s(i.wrapping_add(self.step));
            }
            let go = match self.pred {
                Pred::Ne => norm_u(i) != norm_u(n),
                Pred::Lt { signed: true } => i < norm_s(n),
                Pred::Le { signed: true } => i <= norm_s(n),
                Pred::Gt { signed: true } => i > norm_s(n),
                Pred::Ge { signed: true } => i >= norm_s(n),
                Pred::Lt { signed: false } => norm_u(i) < norm_u(n),
                Pred::Le { signed: false } => norm_u(i) <= norm_u(n),
                Pred::Gt { signed: false } => norm_u(i) > norm_u(n),
                Pred::Ge { signed: false } => norm_u(i) >= norm_u(n),
            };
            if !go {
                return true;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Runs a guard's code as the engine would (two's complement at the guard's width).
    fn eval(g: &Guard, locals: &[(u32, i64)]) -> bool {
        let bits = if g.wide { 64 } else { 32 };
        let wrap = |v: i64| ((v as u64) << (64 - bits)) as i64 >> (64 - bits);
        let u = |v: i64| (v as u64) & (u64::MAX >> (64 - bits));
        let mut st: Vec<i64> = Vec::new();
        for op in g.code() {
            let top = |st: &mut Vec<i64>| (st.remove(st.len() - 2), st.pop().unwrap());
            let r = match op {
                G::LocalGet(l) => wrap(locals.iter().find(|(x, _)| *x == l).unwrap().1),
                G::Const(k) => wrap(k),
                G::Add => {
                    let (a, b) = top(&mut st);
                    wrap(a.wrapping_add(b))
                }
                G::Sub => {
                    let (a, b) = top(&mut st);
                    wrap(a.wrapping_sub(b))
                }
                G::And => {
                    let (a, b) = top(&mut st);
                    a & b
                }
                G::Eqz => i64::from(st.pop().unwrap() == 0),
                G::BothI32 => {
                    let (a, b) = top(&mut st);
                    i64::from(a != 0 && b != 0)
                }
                G::Le(s) | G::Ge(s) | G::Lt(s) | G::Gt(s) => {
                    let (a, b) = top(&mut st);
                    let o = if s { a.cmp(&b) } else { u(a).cmp(&u(b)) };
                    i64::from(match op {
                        G::Le(_) => o.is_le(),
                        G::Ge(_) => o.is_ge(),
                        G::Lt(_) => o.is_lt(),
                        _ => o.is_gt(),
                    })
                }
            };
            st.push(r);
        }
        assert_eq!(st.len(), 1);
        st[0] != 0
    }

    fn guards() -> Vec<Guard> {
        let mut v = Vec::new();
        for wide in [false, true] {
            for signed in [false, true] {
                for (pred, steps) in [
                    (Pred::Ne, &[1i64, -1, 2, -4, 8][..]),
                    (Pred::Lt { signed }, &[1, 3, 16]),
                    (Pred::Le { signed }, &[1, 7]),
                    (Pred::Gt { signed }, &[-1, -5]),
                    (Pred::Ge { signed }, &[-1, -2]),
                ] {
                    for &step in steps {
                        for (budget, pre) in [(5, false), (1000, false), (7, true)] {
                            v.push(Guard {
                                wide,
                                ivar: 0,
                                step,
                                pre,
                                limit: Operand::Local(1),
                                pred,
                                budget,
                                inner: 0,
                            });
                        }
                    }
                }
            }
        }
        v
    }

    fn edge_values(wide: bool) -> Vec<i64> {
        let (lo, hi) = if wide {
            (i64::MIN, i64::MAX)
        } else {
            (i64::from(i32::MIN), i64::from(i32::MAX))
        };
        let mut v = vec![0, 1, -1, 2, 5, 7, 8, 1000, 4000, -1000];
        for e in [lo, hi, if wide { -1 } else { i64::from(u32::MAX) }] {
            for d in -20..=20i64 {
                v.push(e.wrapping_add(d));
                v.push(e.wrapping_add(d * 1000));
            }
        }
        v
    }

    /// Where the guard lets a loop run unpolled, the loop ends within its budget — checked
    /// against a step-by-step simulation near every boundary.
    #[test]
    fn the_guard_admits_only_loops_that_end_within_budget() {
        let mut admitted = 0;
        for g in guards() {
            let vals = edge_values(g.wide);
            for &i0 in &vals {
                for &n in &vals {
                    if eval(&g, &[(0, i0), (1, n)]) {
                        admitted += 1;
                        assert!(g.admits(i0, n), "{g:?} i0={i0} n={n}");
                    }
                }
            }
        }
        assert!(
            admitted > 10_000,
            "the guard admits almost nothing: {admitted}"
        );
    }

    /// Ordinary short loops are admitted (the point of the guard).
    #[test]
    fn short_counted_loops_are_admitted() {
        for g in guards() {
            let a = g.step.unsigned_abs() as i64;
            let k = (g.budget as i64 - 1).min(3);
            let (i0, n) = match g.pred {
                Pred::Ne if g.step > 0 => (10, 10 + k * a),
                Pred::Ne => (10 + k * a, 10),
                Pred::Lt { .. } | Pred::Le { .. } => (0, k * a),
                Pred::Gt { .. } | Pred::Ge { .. } => (k * a + a, a),
            };
            assert!(eval(&g, &[(0, i0), (1, n)]), "{g:?} i0={i0} n={n}");
            assert!(g.admits(i0, n));
        }
    }

    proptest! {
        #[test]
        fn the_guard_is_sound_for_any_entry_values(i0 in any::<i64>(), n in any::<i64>(), near in -300i64..300) {
            for g in guards() {
                for (i0, n) in [(i0, n), (i0, i0.wrapping_add(near)), (n.wrapping_add(near), n)] {
                    if eval(&g, &[(0, i0), (1, n)]) {
                        prop_assert!(g.admits(i0, n), "{:?} i0={} n={}", g, i0, n);
                    }
                }
            }
        }
    }

    fn body(wat: &str) -> Vec<Operator<'static>> {
        let wasm = wat::parse_str(format!(
            "(module (memory 1) (func (param i32 i32 i64 i64) (local i32) {wat}))"
        ))
        .unwrap();
        let wasm: &'static [u8] = Box::leak(wasm.into_boxed_slice());
        for p in wasmparser::Parser::new(0).parse_all(wasm) {
            if let wasmparser::Payload::CodeSectionEntry(b) = p.unwrap() {
                let ops: Vec<_> = b
                    .get_operators_reader()
                    .unwrap()
                    .into_iter()
                    .map(Result::unwrap)
                    .collect();
                // Between the function's first `loop` and that loop's `end`.
                return ops[1..ops.len() - 2].to_vec();
            }
        }
        unreachable!()
    }

    #[test]
    fn loop_shapes_compilers_emit_are_recognised() {
        // for (i = ..; i != n; i++) — the update teed into the test (clang's usual shape).
        let g = analyze(&body(
            "(loop (i32.store (local.get 0) (i32.const 0))
               (br_if 0 (i32.ne (local.tee 0 (i32.add (local.get 0) (i32.const 1))) (local.get 1))))",
        ))
        .unwrap();
        assert_eq!(
            (g.ivar, g.step, g.limit, g.pred, g.wide),
            (0, 1, Operand::Local(1), Pred::Ne, false)
        );
        // A down-counter tested for zero.
        let g = analyze(&body(
            "(loop (local.set 4 (i32.add (local.get 4) (i32.const -1))) (br_if 0 (local.get 4)))",
        ))
        .unwrap();
        assert_eq!(
            (g.ivar, g.step, g.limit, g.pred),
            (4, -1, Operand::Const(0), Pred::Ne)
        );
        // An i64 index, limit on the left: n > i is i < n.
        let g = analyze(&body(
            "(loop (local.set 2 (i64.add (local.get 2) (i64.const 8)))
               (br_if 0 (i64.gt_s (local.get 3) (local.get 2))))",
        ))
        .unwrap();
        assert_eq!(
            (g.ivar, g.step, g.pred, g.wide),
            (2, 8, Pred::Lt { signed: true }, true)
        );
        // Leaving when a down-counter reaches zero, the way back unconditional (a `while`).
        let g = analyze(&body(
            "(loop (br_if 1 (i32.load (local.get 0)))
               (br_if 1 (i32.eqz (local.tee 4 (i32.add (local.get 4) (i32.const -1)))))
               (br 0))",
        ))
        .unwrap();
        assert_eq!((g.ivar, g.step, g.pred, g.pre), (4, -1, Pred::Ne, false));
        // The test before the update, leaving when `i >= n`: continues while `i < n`.
        let g = analyze(&body(
            "(loop (br_if 1 (i32.ge_s (local.get 0) (local.get 1)))
               (local.set 0 (i32.add (local.get 0) (i32.const 1)))
               (br 0))",
        ))
        .unwrap();
        assert_eq!((g.pred, g.pre), (Pred::Lt { signed: true }, true));
        // The way back first, then a branch out as the loop's last instruction; a second way
        // back after the test is fine too.
        assert!(
            analyze(&body(
                "(loop (local.set 0 (i32.add (local.get 0) (i32.const 4)))
               (br_if 0 (i32.ne (local.get 0) (local.get 1)))
               (br_if 0 (local.get 1))
               (br 1))",
            ))
            .is_some()
        );
        // Inner loops (v18): counted, with the inner loops named.
        let g = analyze(&body(
            "(loop (loop (br_if 0 (i32.load8_u (local.get 1))))
               (block (loop (br_if 1 (local.get 1)) (br 0)))
               (local.set 0 (i32.add (local.get 0) (i32.const 1)))
               (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
        ))
        .unwrap();
        assert_eq!((g.ivar, g.step, g.inner), (0, 1, 2));
        // Nested blocks and ifs (no way back inside them) are fine.
        assert!(analyze(&body(
            "(loop (block (br_if 0 (local.get 1)) (if (local.get 1) (then (nop)) (else (br 3))))
               (local.set 0 (i32.sub (local.get 0) (i32.const 2)))
               (br_if 0 (i32.gt_u (local.get 0) (i32.const 10))))",
        ))
        .is_some());
    }

    #[test]
    fn loops_that_are_not_counted_keep_their_poll() {
        for (why, wat) in [
            (
                "a call",
                "(loop (call 0 (i32.const 0) (i32.const 0) (i64.const 0) (i64.const 0)) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
            (
                "a way back before the test",
                "(loop (br_if 0 (local.get 1)) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
            (
                "a way back inside a block",
                "(loop (local.set 0 (i32.add (local.get 0) (i32.const 1))) (block (br_if 1 (i32.ne (local.get 0) (local.get 1)))))",
            ),
            (
                "the update after the way back",
                "(loop (br_if 1 (i32.ge_s (local.get 0) (local.get 1))) (if (local.get 1) (then (br 1))) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br 0))",
            ),
            (
                "leaving when a counter is not zero",
                "(loop (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 1 (local.get 0)) (br 0))",
            ),
            (
                "leaving when i != n (continuing while i == n)",
                "(loop (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 1 (i32.ne (local.get 0) (local.get 1))) (br 0))",
            ),
            (
                "the variable written twice",
                "(loop (local.set 0 (i32.add (local.get 0) (i32.const 1))) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
            (
                "the update inside an if",
                "(loop (if (local.get 1) (then (local.set 0 (i32.add (local.get 0) (i32.const 1))))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
            (
                "the limit written",
                "(loop (local.set 1 (i32.const 3)) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
            (
                "a step that is not a constant",
                "(loop (local.set 0 (i32.add (local.get 0) (local.get 1))) (br_if 0 (i32.ne (local.get 0) (i32.const 0))))",
            ),
            (
                "ne with a step not a power of two",
                "(loop (local.set 0 (i32.add (local.get 0) (i32.const 3))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
            (
                "lt counting down",
                "(loop (local.set 0 (i32.add (local.get 0) (i32.const -1))) (br_if 0 (i32.lt_s (local.get 0) (local.get 1))))",
            ),
            (
                "a data-dependent test",
                "(loop (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 0 (i32.load8_u (local.get 0))))",
            ),
            (
                "memory.fill",
                "(loop (memory.fill (i32.const 0) (i32.const 0) (local.get 1)) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
            (
                "an inner loop with a parameter",
                "(loop (i32.const 0) (loop (param i32) (drop)) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
            (
                "a branch table naming an inner loop",
                "(loop (loop (br_table 0 1 (local.get 1))) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
            (
                "an inner loop writing the induction variable",
                "(loop (loop (local.set 0 (i32.const 0)) (br_if 0 (local.get 1))) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
            (
                "an inner loop writing the limit",
                "(loop (loop (local.set 1 (i32.const 0)) (br_if 0 (local.get 0))) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
            (
                "a call in an inner loop",
                "(loop (loop (call 0 (i32.const 0) (i32.const 0) (i64.const 0) (i64.const 0)) (br_if 0 (local.get 1))) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br_if 0 (i32.ne (local.get 0) (local.get 1))))",
            ),
        ] {
            let ops = body(wat);
            assert_eq!(analyze(&ops), None, "{why}");
        }
    }
}
