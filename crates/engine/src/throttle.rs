//! Slowing a running guest down: a live migration whose guest writes its memory about as fast
//! as the link carries it never converges; held back to a share of its time, the guest writes
//! less per pre-copy round (QEMU calls this auto-converge). See [`Control::throttle`].
//!
//! The guest pays for the time it ran — computing or sleeping — by being held
//! `percent / (100 − percent)` of that time, in the host:
//! * a guest that computes is made to come to the host every [`TICK`] (a tick raises its poll
//!   flag; the guest unwinds, is held, and rewinds — or, in a WASI call or a `ferry.poll`, is
//!   held there without unwinding);
//! * a guest that sleeps (`poll_oneoff`) is held after the sleep, so its sleeps stretch (a sleep
//!   may always last longer than asked) and a guest pacing itself by relative sleeps slows too;
//! * a guest waiting for input (`fd_read`) is not charged for the wait.
//!
//! Its clocks are not touched: it sees the time it was held pass, as on a busy machine. Any
//! request (a checkpoint, a suspend) ends a hold at once.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::control::{Control, Request};

/// How often a computing guest is made to come to the host while it is throttled.
pub(crate) const TICK: Duration = Duration::from_millis(20);

/// The longest one hold lasts (a guest that ran long without coming to the host — it waited
/// in a host call not charged — is not held for all of it at once).
const MOST_HELD: Duration = Duration::from_secs(2);

/// How a hold waits: in slices this long, looking for a request or a change of the throttle.
const SLICE: Duration = Duration::from_millis(2);

/// The most a guest is held back to: it keeps at least 1% of its time.
pub const MAX_PERCENT: u32 = 99;

#[derive(Debug, Default)]
pub(crate) struct Throttle {
    /// Share of its time the guest is held, in percent (0: not throttled).
    percent: AtomicU32,
    /// A tick asked the guest to come to the host and be held.
    due: AtomicBool,
    /// Start of the time the guest has run and not yet paid for.
    since: Mutex<Option<Instant>>,
    /// Whether a ticker thread runs.
    ticking: AtomicBool,
    /// Total time held, in microseconds.
    held_us: AtomicU64,
}

impl Throttle {
    fn since(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.since.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Control {
    /// Holds the guest back to `100 − percent`% of its time from now on (`percent` at most
    /// [`MAX_PERCENT`]; 0 lets it run at full speed again). Takes effect within one [`TICK`]
    /// for a computing guest, after its current sleep for a sleeping one.
    pub fn throttle(self: &Arc<Self>, percent: u32) {
        let percent = percent.min(MAX_PERCENT);
        let t = &self.throttle;
        let was = t.percent.swap(percent, Ordering::SeqCst);
        if was == 0 && percent != 0 {
            *t.since() = Some(Instant::now());
        }
        if percent == 0 {
            t.due.store(false, Ordering::SeqCst);
            return;
        }
        if t.ticking
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            let weak = Arc::downgrade(self);
            let spawned = std::thread::Builder::new()
                .name("ferry-throttle".into())
                .spawn(move || tick(weak));
            if let Err(e) = spawned {
                t.ticking.store(false, Ordering::SeqCst);
                tracing::warn!("cannot start the throttle's ticker: {e}");
            }
        }
    }

    /// The share of its time the guest is held now, in percent.
    pub fn throttled(&self) -> u32 {
        self.throttle.percent.load(Ordering::SeqCst)
    }

    /// How long the guest has been held by the throttle in all.
    pub fn held(&self) -> Duration {
        Duration::from_micros(self.throttle.held_us.load(Ordering::SeqCst))
    }

    /// Whether a tick asked the guest to come to the host and be held.
    pub(crate) fn throttle_due(&self) -> bool {
        self.throttle.due.load(Ordering::SeqCst)
    }

    /// Holds the guest for the time it ran since it last paid, if it is throttled; returns
    /// at once when a request is made or the throttle is lifted. Called on the guest's
    /// thread, in the host.
    pub(crate) fn settle(&self) {
        let t = &self.throttle;
        let percent = t.percent.load(Ordering::SeqCst);
        if percent == 0 {
            t.due.store(false, Ordering::SeqCst);
            return;
        }
        let start = Instant::now();
        let ran = t
            .since()
            .map_or(Duration::ZERO, |s| start.saturating_duration_since(s));
        let owed = ran.mul_f64(f64::from(percent) / f64::from(100 - percent));
        let owed = owed.min(MOST_HELD);
        while start.elapsed() < owed {
            if self.pending() != Request::None || t.percent.load(Ordering::SeqCst) == 0 {
                break;
            }
            std::thread::sleep(SLICE.min(owed - start.elapsed().min(owed)));
        }
        let now = Instant::now();
        t.held_us
            .fetch_add((now - start).as_micros() as u64, Ordering::SeqCst);
        *t.since() = Some(now);
        t.due.store(false, Ordering::SeqCst);
    }

    /// The guest waited `from` until now for input: that time is not charged.
    pub(crate) fn not_charged(&self, from: Instant) {
        if self.throttled() == 0 {
            return;
        }
        let waited = from.elapsed();
        if let Some(s) = self.throttle.since().as_mut() {
            *s = (*s + waited).min(Instant::now());
        }
    }

    /// The guest runs again after a stop that was not its own time (a snapshot, a rewind).
    pub(crate) fn running_again(&self) {
        if self.throttled() != 0 {
            *self.throttle.since() = Some(Instant::now());
        }
    }
}

/// Raises the guest's poll flag every [`TICK`] while it is throttled.
fn tick(control: Weak<Control>) {
    loop {
        std::thread::sleep(TICK);
        let Some(c) = control.upgrade() else {
            return;
        };
        if c.throttled() == 0 {
            c.throttle.ticking.store(false, Ordering::SeqCst);
            // A throttle set again just before that store found the ticker still running.
            if c.throttled() != 0
                && c.throttle
                    .ticking
                    .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                continue;
            }
            return;
        }
        c.throttle.due.store(true, Ordering::SeqCst);
        c.raise_flag();
    }
}
