//! What a space counts for its operators: `GET /v1/metrics`, in Prometheus' text exposition
//! format (version 0.0.4; docs/api.md, "Metrics").
//!
//! Counters count events since the space started (a restart starts them at zero again, which
//! Prometheus' `rate` and `increase` allow for); gauges are read from the sessions at each
//! scrape. Nothing here names a session: the series stay as few as the states and outcomes,
//! however many sessions a space runs.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::api::State;

/// Upper bounds (seconds) of the buckets of every duration histogram here.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A histogram of durations with the [`BUCKETS`] bounds.
#[derive(Debug, Default)]
pub struct Histogram {
    /// Observations per bucket (not cumulative); the last one is `+Inf`.
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut Text, name: &str, help: &str) {
        out.head(name, "histogram", help);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c.load(Ordering::Relaxed);
            let le = BUCKETS.get(i).map_or("+Inf".to_owned(), |b| b.to_string());
            out.line(&format!("{name}_bucket{{le=\"{le}\"}}"), seen as f64);
        }
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        out.line(&format!("{name}_sum"), sum);
        out.line(&format!("{name}_count"), seen as f64);
    }
}

/// How a session's guest ended, as [`Metrics::ended`] counts it.
#[derive(Debug, Clone, Copy)]
pub enum Ended {
    Exited,
    Failed,
    Killed,
}

/// The counters of one space. Each is counted where its event happens (the sessions, the
/// server); [`Metrics::render`] writes them with the gauges of the moment.
#[derive(Debug, Default)]
pub struct Metrics {
    pub sessions_started: AtomicU64,
    /// Sessions whose guest ended here: exited, failed, killed.
    ended: [AtomicU64; 3],
    /// Snapshots written here: checkpoints (the guest ran on) and suspends.
    pub checkpoints: AtomicU64,
    pub suspends: AtomicU64,
    pub snapshot_failures: AtomicU64,
    /// From the safe point that served a request until its snapshot was written.
    pub snapshot_write: Histogram,
    /// Moves of sessions out of this space, committed and aborted.
    pub moves_committed: AtomicU64,
    pub moves_aborted: AtomicU64,
    /// How long each committed move out paused its guest.
    pub move_pause: Histogram,
    /// How long guests were held back (`auto_converge`) while moves out copied them, in ms.
    pub move_held_ms: AtomicU64,
    /// Moves into this space committed.
    pub moves_in: AtomicU64,
    /// Sessions this space took over as their standby; sessions of this space that their
    /// standby took over (fenced here).
    pub takeovers: AtomicU64,
    pub fenced: AtomicU64,
    /// Checkpoints sent to standbys: taken, and attempts that failed.
    pub standby_taken: AtomicU64,
    pub standby_failed: AtomicU64,
    /// Objects (and their bytes) received from peers and clients, each verified.
    pub objects_received: AtomicU64,
    pub object_bytes_received: AtomicU64,
}

/// What the sessions hold at the moment of a scrape.
#[derive(Debug, Default)]
pub struct Gauges {
    /// Sessions in each state.
    pub states: Vec<(State, u64)>,
    /// Output written by guests that is not shown yet: it waits for a standby to take the
    /// checkpoint that holds it.
    pub output_held_bytes: u64,
    /// Sessions whose standby takes none of their checkpoints now, or which have none
    /// although their space chooses one.
    pub standby_failing: u64,
    /// Sessions whose end waits for etcd.
    pub end_waiting: u64,
    /// Among running sessions with periodic checkpoints: the longest time since one had a
    /// snapshot written (or started) here.
    pub oldest_checkpoint_age: Option<Duration>,
    pub draining: bool,
    /// In a fleet: how long ago this space's etcd lease was last granted or renewed.
    pub lease_renewed_age: Option<Duration>,
}

impl Metrics {
    pub fn ended(&self, how: Ended) {
        self.ended[how as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The text of `GET /v1/metrics`.
    pub fn render(&self, g: Option<&Gauges>) -> String {
        let mut out = Text::default();
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64;
        out.head(
            "ferry_build_info",
            "gauge",
            "The ferry version serving (always 1).",
        );
        out.line(
            &format!(
                "ferry_build_info{{version=\"{}\"}}",
                env!("CARGO_PKG_VERSION")
            ),
            1.0,
        );
        out.head(
            "ferry_objects_received_total",
            "counter",
            "Objects received from clients and peers, each verified before it was stored.",
        );
        out.line("ferry_objects_received_total", n(&self.objects_received));
        out.head(
            "ferry_object_bytes_received_total",
            "counter",
            "Bytes of the objects received (as stored, uncompressed).",
        );
        out.line(
            "ferry_object_bytes_received_total",
            n(&self.object_bytes_received),
        );
        let Some(g) = g else {
            // An object store only: no sessions to count.
            return out.0;
        };
        out.head(
            "ferry_sessions",
            "gauge",
            "Sessions this space holds, by state.",
        );
        for (state, count) in &g.states {
            out.line(
                &format!("ferry_sessions{{state=\"{}\"}}", state.name()),
                *count as f64,
            );
        }
        out.head(
            "ferry_sessions_started_total",
            "counter",
            "Sessions started here (ferry run against this space).",
        );
        out.line("ferry_sessions_started_total", n(&self.sessions_started));
        out.head(
            "ferry_sessions_ended_total",
            "counter",
            "Sessions whose guest ended here, by how.",
        );
        for (how, c) in ["exited", "failed", "killed"].iter().zip(&self.ended) {
            out.line(
                &format!("ferry_sessions_ended_total{{how=\"{how}\"}}"),
                n(c),
            );
        }
        out.head(
            "ferry_snapshots_total",
            "counter",
            "Snapshots written here: checkpoints (the guest ran on) and suspends.",
        );
        out.line(
            "ferry_snapshots_total{why=\"checkpoint\"}",
            n(&self.checkpoints),
        );
        out.line("ferry_snapshots_total{why=\"suspend\"}", n(&self.suspends));
        out.head(
            "ferry_snapshot_failures_total",
            "counter",
            "Snapshots that could not be written (the guest kept running).",
        );
        out.line("ferry_snapshot_failures_total", n(&self.snapshot_failures));
        self.snapshot_write.render(
            &mut out,
            "ferry_snapshot_write_seconds",
            "From the safe point that served a checkpoint or suspend until its snapshot was \
             written (the guest is stopped meanwhile).",
        );
        out.head(
            "ferry_checkpoint_oldest_age_seconds",
            "gauge",
            "Among running sessions with periodic checkpoints: the longest time since one had \
             a snapshot written (or started) here.",
        );
        let age = g.oldest_checkpoint_age.unwrap_or_default();
        out.line("ferry_checkpoint_oldest_age_seconds", age.as_secs_f64());
        out.head(
            "ferry_migrations_total",
            "counter",
            "Moves of sessions out of this space, by outcome (an aborted move leaves the \
             session here).",
        );
        out.line(
            "ferry_migrations_total{outcome=\"committed\"}",
            n(&self.moves_committed),
        );
        out.line(
            "ferry_migrations_total{outcome=\"aborted\"}",
            n(&self.moves_aborted),
        );
        self.move_pause.render(
            &mut out,
            "ferry_migration_pause_seconds",
            "How long each committed move out of this space paused its guest.",
        );
        out.head(
            "ferry_migration_held_seconds_total",
            "counter",
            "How long guests were held back (--auto-converge) while moves out of this space \
             copied them, whatever the moves' outcome.",
        );
        out.line(
            "ferry_migration_held_seconds_total",
            n(&self.move_held_ms) / 1000.0,
        );
        out.head(
            "ferry_migrations_in_total",
            "counter",
            "Moves of sessions into this space committed.",
        );
        out.line("ferry_migrations_in_total", n(&self.moves_in));
        out.head(
            "ferry_takeovers_total",
            "counter",
            "Sessions this space took over as their standby (their owner's etcd lease ran \
             out).",
        );
        out.line("ferry_takeovers_total", n(&self.takeovers));
        out.head(
            "ferry_fenced_total",
            "counter",
            "Sessions of this space that their standby took over: stopped here.",
        );
        out.line("ferry_fenced_total", n(&self.fenced));
        out.head(
            "ferry_standby_checkpoints_total",
            "counter",
            "Checkpoints sent to standbys: taken, and attempts that failed (tried again).",
        );
        out.line(
            "ferry_standby_checkpoints_total{result=\"taken\"}",
            n(&self.standby_taken),
        );
        out.line(
            "ferry_standby_checkpoints_total{result=\"failed\"}",
            n(&self.standby_failed),
        );
        out.head(
            "ferry_output_held_bytes",
            "gauge",
            "Guest output written but not shown yet: it waits for a standby to take the \
             checkpoint that holds it.",
        );
        out.line("ferry_output_held_bytes", g.output_held_bytes as f64);
        out.head(
            "ferry_sessions_standby_failing",
            "gauge",
            "Sessions whose standby takes none of their checkpoints now, or that have none \
             although this space chooses one.",
        );
        out.line("ferry_sessions_standby_failing", g.standby_failing as f64);
        out.head(
            "ferry_sessions_end_waiting",
            "gauge",
            "Sessions whose guest stopped but whose end waits for etcd to answer.",
        );
        out.line("ferry_sessions_end_waiting", g.end_waiting as f64);
        out.head(
            "ferry_draining",
            "gauge",
            "1 while this space is being drained (ferry drain), else 0.",
        );
        out.line("ferry_draining", if g.draining { 1.0 } else { 0.0 });
        if let Some(age) = g.lease_renewed_age {
            out.head(
                "ferry_etcd_lease_renewed_age_seconds",
                "gauge",
                "How long ago this space's etcd lease was last granted or renewed (past the \
                 lease's TTL, standbys take its sessions over).",
            );
            out.line("ferry_etcd_lease_renewed_age_seconds", age.as_secs_f64());
        }
        out.0
    }
}

/// Prometheus text being written.
#[derive(Default)]
struct Text(String);

impl Text {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn line(&mut self, series: &str, value: f64) {
        let _ = writeln!(self.0, "{series} {value}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every sample line parses as `name{labels} value`, each family has its HELP and TYPE,
    /// and a histogram's buckets are cumulative up to its count.
    #[test]
    fn the_text_is_prometheus_exposition_format() {
        let m = Metrics::default();
        m.snapshot_write.observe(Duration::from_micros(700));
        m.snapshot_write.observe(Duration::from_millis(30));
        m.snapshot_write.observe(Duration::from_secs(60));
        m.checkpoints.fetch_add(2, Ordering::Relaxed);
        m.ended(Ended::Killed);
        let g = Gauges {
            states: vec![(State::Running, 3), (State::Exited, 1)],
            lease_renewed_age: Some(Duration::from_millis(1500)),
            ..Gauges::default()
        };
        let text = m.render(Some(&g));
        let mut families = std::collections::BTreeSet::new();
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{l}");
                assert!(families.insert(name.to_owned()), "twice: {l}");
                continue;
            }
            if l.starts_with("# HELP ") {
                continue;
            }
            let (series, value) = l.rsplit_once(' ').unwrap();
            value.parse::<f64>().unwrap();
            let name = series.split('{').next().unwrap();
            assert!(
                families.iter().any(|f| name == f
                    || ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|s| name.strip_suffix(s) == Some(f))),
                "{l}: no TYPE before"
            );
        }
        for want in [
            "ferry_snapshot_write_seconds_bucket{le=\"0.001\"} 1",
            "ferry_snapshot_write_seconds_bucket{le=\"0.05\"} 2",
            "ferry_snapshot_write_seconds_bucket{le=\"30\"} 2",
            "ferry_snapshot_write_seconds_bucket{le=\"+Inf\"} 3",
            "ferry_snapshot_write_seconds_count 3",
            "ferry_snapshot_write_seconds_sum 60.0307",
            "ferry_snapshots_total{why=\"checkpoint\"} 2",
            "ferry_sessions_ended_total{how=\"killed\"} 1",
            "ferry_sessions_ended_total{how=\"exited\"} 0",
            "ferry_sessions{state=\"running\"} 3",
            "ferry_etcd_lease_renewed_age_seconds 1.5",
        ] {
            assert!(text.lines().any(|l| l == want), "{want} missing:\n{text}");
        }
        // An object store only: the object counters, no session families.
        let bare = m.render(None);
        assert!(bare.contains("ferry_objects_received_total 0"));
        assert!(!bare.contains("ferry_sessions"));
    }
}
