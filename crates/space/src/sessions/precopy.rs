//! What the pause of a move will cost, foreseen from its pre-copy rounds (docs/migration.md,
//! "A bound on the pause"): a move with `--max-pause` whose guest writes its memory about as
//! fast as the link to the destination carries it is given up *before* the guest is paused,
//! instead of pausing it for the whole bound and then giving up.

use std::time::{Duration, Instant};

/// Rounds smaller than this say little about the link's speed (a batch's round trip and the
/// destination's storing dominate them).
const MIN_MEASURED: u64 = 1 << 20;

/// One pre-copy round as the prediction sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Measured {
    /// When its checkpoint was taken (what it sent was written before then).
    pub at: Instant,
    /// Bytes it sent (what the destination lacked).
    pub bytes: u64,
    /// How long sending them took.
    pub send: Duration,
}

/// The final delta foreseen if the guest is paused `now`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Foreseen {
    pub bytes: u64,
    /// Bytes a second the link carried at best in the rounds.
    pub rate: f64,
    /// How long sending `bytes` at `rate` takes.
    pub time: Duration,
    /// Bytes a second the guest wrote (new since the round before) in the last round.
    pub writes: f64,
}

/// The final delta if the guest is paused `now`, after `rounds` (in order): what the guest
/// wrote since the last round's checkpoint, at the rate it wrote what the last round sent
/// (the bytes new at checkpoint *i* were written between checkpoints *i − 1* and *i*), and
/// no more than the first round sent (all of its memory); sent at the best rate a round of
/// at least 1 MiB reached. `None` when that cannot be told: fewer than two rounds, or no
/// round big enough to measure the link by.
pub(super) fn foresee(rounds: &[Measured], now: Instant) -> Option<Foreseen> {
    let [.., before, last] = rounds else {
        return None;
    };
    let rate = rounds
        .iter()
        .filter(|r| r.bytes >= MIN_MEASURED && !r.send.is_zero())
        .map(|r| r.bytes as f64 / r.send.as_secs_f64())
        .max_by(f64::total_cmp)?;
    let between = last.at.saturating_duration_since(before.at).as_secs_f64();
    let since = now.saturating_duration_since(last.at).as_secs_f64();
    let written = if between > 0.0 {
        last.bytes as f64 / between * since
    } else {
        last.bytes as f64
    };
    let bytes = (written as u64).min(rounds[0].bytes);
    Some(Foreseen {
        bytes,
        rate,
        time: Duration::from_secs_f64(bytes as f64 / rate),
        writes: if between > 0.0 {
            last.bytes as f64 / between
        } else {
            0.0
        },
    })
}

/// What a held guest is to write, as a share of what the link carries: each round then
/// sends at most about that share of the one before. (Half was tried first: a guest that
/// rewrites the same pages writes fewer *new* bytes the longer a round, so holding it back
/// shrinks the rounds less than in proportion, and such a move took 10 rounds instead of 6.)
const AIM: f64 = 0.25;

/// The first throttle of a move that converges by holding its guest back (`auto_converge`).
const FIRST_THROTTLE: u32 = 20;

/// The share of its time (percent) the guest is to be held from now on, in a move that
/// converges by holding it back, after a round foreseen `f` (its `time`: the longer of the
/// foresight and the round itself, see `migrate_steps`) — aiming at a final delta sent within
/// `goal` — whose bytes the guest wrote held `under` percent (the throttle set a round
/// earlier: what a round sends was written while the round before it was sent), and held
/// `now` percent since the round before. Kept while the delta fits the goal. Else the share
/// of its time the guest runs is cut, from what it ran while it wrote the round, to what
/// makes it write at most [`AIM`] of what the link carries, and at least by as much as the
/// delta overruns the goal (a guest that rewrites the same pages writes less that is new per
/// second the longer it is watched, so its measured rate says too little); and at least
/// halved when `now` was measured and still does not fit (a guest whose writes do not slow
/// as it is held is held ever more): [`FIRST_THROTTLE`] at first, at most
/// [`ferry_engine::MAX_THROTTLE`].
pub(super) fn next_throttle(f: &Foreseen, goal: Duration, under: u32, now: u32) -> u32 {
    if f.time <= goal || f.writes <= 0.0 {
        return now;
    }
    let ran = f64::from(100 - under.min(100)) / 100.0;
    let cut = (AIM * f.rate / f.writes).min(goal.as_secs_f64() / f.time.as_secs_f64());
    let may_run = cut.min(1.0) * ran;
    // (Less a hair, so that 40.000000001 is 40.)
    let wanted = ((1.0 - may_run) * 100.0 - 1e-6).ceil() as u32;
    let least = if now == 0 {
        FIRST_THROTTLE
    } else if under == now {
        100 - (100 - now.min(100)) / 2
    } else {
        now
    };
    wanted.max(least).min(ferry_engine::MAX_THROTTLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn round(start: Instant, at_ms: u64, mib: u64, send_ms: u64) -> Measured {
        Measured {
            at: start + Duration::from_millis(at_ms),
            bytes: mib * MIB,
            send: Duration::from_millis(send_ms),
        }
    }

    #[test]
    fn a_guest_writing_as_fast_as_the_link_carries_leaves_a_long_delta() {
        let t = Instant::now();
        // 1 GiB over 100 Mbit/s (~12 MB/s: 86 s), then 600 MiB written meanwhile (86 s).
        let rounds = [round(t, 0, 1024, 86_000), round(t, 86_000, 600, 50_000)];
        let f = foresee(&rounds, t + Duration::from_millis(86_000 + 50_000)).unwrap();
        // 600 MiB in 86 s, for the 50 s since: ~349 MiB, at ~12.5 MB/s: ~29 s.
        assert_eq!(f.bytes / MIB, 348);
        // The better of the two rounds' rates: 600 MiB in 50 s.
        assert!((f.rate - 600.0 * MIB as f64 / 50.0).abs() < 1.0, "{f:?}");
        assert!(
            f.time > Duration::from_secs(28) && f.time < Duration::from_secs(30),
            "{f:?}"
        );
    }

    #[test]
    fn a_guest_that_writes_little_leaves_a_short_delta() {
        let t = Instant::now();
        // 256 MiB in 1 s, then 2 MiB written in that second.
        let rounds = [round(t, 0, 256, 1_000), round(t, 1_000, 2, 20)];
        let f = foresee(&rounds, t + Duration::from_millis(1_030)).unwrap();
        assert_eq!(f.bytes, 2 * MIB * 30 / 1000);
        assert!(f.time < Duration::from_millis(5), "{f:?}");
    }

    #[test]
    fn the_delta_is_never_foreseen_larger_than_the_memory() {
        let t = Instant::now();
        let rounds = [round(t, 0, 64, 8_000), round(t, 8_000, 64, 8_000)];
        let f = foresee(&rounds, t + Duration::from_secs(60)).unwrap();
        assert_eq!(f.bytes, 64 * MIB);
        assert!(f.time >= Duration::from_secs(7) && f.time <= Duration::from_secs(9));
    }

    fn foreseen(ms: u64, rate: f64, writes: f64) -> Foreseen {
        Foreseen {
            bytes: (rate * ms as f64 / 1000.0) as u64,
            rate,
            time: Duration::from_millis(ms),
            writes,
        }
    }

    #[test]
    fn a_delta_within_the_goal_keeps_the_throttle() {
        let goal = Duration::from_millis(500);
        assert_eq!(next_throttle(&foreseen(400, 12e6, 10e6), goal, 0, 0), 0);
        assert_eq!(next_throttle(&foreseen(400, 12e6, 10e6), goal, 40, 40), 40);
    }

    #[test]
    fn a_guest_writing_near_the_links_rate_is_held_to_write_a_quarter_of_it() {
        let goal = Duration::from_millis(500);
        let f = foreseen(1_000, 12e6, 10e6);
        // Writes 10 MB/s, the link carries 12 MB/s: it may run 30% of its time.
        assert_eq!(next_throttle(&f, goal, 0, 0), 70);
        // The next round was written before the throttle took effect: it is kept.
        assert_eq!(next_throttle(&f, goal, 0, 70), 70);
        // Held 70% it still wrote 10 MB/s (as measured while held): it may run 9%.
        assert_eq!(next_throttle(&f, goal, 70, 70), 91);
    }

    #[test]
    fn a_delta_far_past_the_goal_cuts_the_guests_time_as_much() {
        let goal = Duration::from_millis(500);
        // It writes a tenth of what the link carries — as measured over a long round, less
        // than it writes over a short one — yet the delta is 4x the goal: it runs a quarter.
        let f = foreseen(2_000, 12e6, 1.2e6);
        assert_eq!(next_throttle(&f, goal, 0, 0), 75);
        // Held 50% while it wrote the round: it may run 12.5% of its time.
        assert_eq!(next_throttle(&f, goal, 50, 50), 88);
    }

    #[test]
    fn a_guest_that_still_does_not_fit_runs_at_most_half_as_much_as_before() {
        let goal = Duration::from_millis(500);
        // Barely past the goal, writing little: 20% at first…
        let slow = foreseen(520, 12e6, 1e6);
        assert_eq!(next_throttle(&slow, goal, 0, 0), 20);
        assert_eq!(next_throttle(&slow, goal, 0, 20), 20);
        // …then, measured at 20% and still past the goal, it runs half as much as before:
        // held 60%, then 80%, 90%.
        assert_eq!(next_throttle(&slow, goal, 20, 20), 60);
        assert_eq!(next_throttle(&slow, goal, 60, 60), 80);
        assert_eq!(next_throttle(&slow, goal, 80, 80), 90);
    }

    #[test]
    fn the_throttle_never_holds_the_guest_all_of_its_time() {
        let goal = Duration::from_millis(500);
        let f = foreseen(60_000, 1e6, 1e9);
        let most = ferry_engine::MAX_THROTTLE;
        assert_eq!(next_throttle(&f, goal, 0, 0), most);
        assert_eq!(next_throttle(&f, goal, 95, 95), most);
        assert_eq!(next_throttle(&f, goal, most, most), most);
    }

    #[test]
    fn nothing_is_foreseen_from_one_round_or_rounds_too_small_to_measure() {
        let t = Instant::now();
        assert_eq!(foresee(&[], t), None);
        assert_eq!(foresee(&[round(t, 0, 512, 4_000)], t), None);
        let tiny = [
            Measured {
                at: t,
                bytes: 4096,
                send: Duration::from_millis(3),
            },
            Measured {
                at: t + Duration::from_millis(10),
                bytes: 4096,
                send: Duration::from_millis(3),
            },
        ];
        assert_eq!(foresee(&tiny, t + Duration::from_millis(20)), None);
    }
}
