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
    })
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
