//! A run's lease on the tag it exports to (`--export-to`, `--export-lease`): the file
//! `ferry-leases/TAG` of the layout, written when the run starts and again every quarter of
//! its time to live. A run resumed from the tag elsewhere waits until the lease has not been
//! renewed for its time to live (or was given up), so that a session never runs in two
//! places: a run that cannot renew it for half that time suspends itself first. See
//! docs/format.md, "Leases".

use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use ferry_space::s3::Condition;
use serde::{Deserialize, Serialize};

use super::{Claim, Layout, OciRef, TakenOver, epoch_of, tagged};

/// The lease file's format.
const LEASE_FORMAT: u64 = 1;

/// Added to a lease's time to live before it counts as lapsed: a bucket tells times to the
/// second, so an age read from them may be up to a second long on each side.
const CLOCK_SLACK: Duration = Duration::from_secs(2);

/// The shortest time to live a lease may have (renewed every quarter of it).
pub const MIN_TTL: Duration = Duration::from_secs(2);

/// What `ferry-leases/TAG` says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    #[serde(rename = "ferry.lease")]
    format: u64,
    /// The run holding it ([`Claim::writer`]).
    writer: String,
    /// The epoch that run writes the tag with.
    epoch: u64,
    /// How long after its last renewal the lease lapses.
    ttl_ms: u64,
    /// How the run ended (`suspended`, `exited(CODE)`), once it has: the lease is then free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ended: Option<String>,
}

/// A lease as found in the layout.
#[derive(Debug, Clone)]
struct Seen {
    record: Record,
    etag: Option<String>,
    /// When it was last written, by the layout's clock.
    modified: Option<SystemTime>,
    age: Duration,
}

impl Seen {
    fn ttl(&self) -> Duration {
        Duration::from_millis(self.record.ttl_ms)
    }

    /// Whether the run that holds it may still be running.
    fn live(&self) -> bool {
        self.record.ended.is_none() && self.age < self.ttl() + CLOCK_SLACK
    }
}

/// Where the lease of `tag` is in its layout (a tag read from a layout is untrusted: one that
/// is no OCI tag names no file).
pub(super) fn file(tag: &str) -> Result<String> {
    if !super::valid_tag(tag) {
        bail!("`{tag}` is not an OCI tag (letters, digits, `_`, `.`, `-`; at most 128)");
    }
    Ok(format!("ferry-leases/{tag}"))
}

/// The lease of `tag` in `layout`, if there is one.
fn read(layout: &Layout, tag: &str) -> Result<Option<Seen>> {
    let name = file(tag)?;
    let Some((_, v, etag)) = layout.read_json(&name)? else {
        return Ok(None);
    };
    let record: Record = serde_json::from_value(v)
        .with_context(|| format!("{} is not a ferry lease", layout.name(&name)))?;
    if record.format != LEASE_FORMAT {
        bail!(
            "{} is a lease of format {}; this ferry knows format {LEASE_FORMAT}",
            layout.name(&name),
            record.format
        );
    }
    // Gone between the two looks: the lease is free.
    let Some(head) = layout.stat_file(&name)? else {
        return Ok(None);
    };
    Ok(Some(Seen {
        record,
        etag,
        modified: head.modified,
        age: head.age(),
    }))
}

/// A run's lease on its tag, held until [`TagLease::end`] (or until it lapses).
pub struct TagLease {
    layout: Layout,
    tag: String,
    record: Record,
    etag: Option<String>,
}

impl std::fmt::Debug for TagLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TagLease")
            .field("place", &self.layout.place())
            .field("tag", &self.tag)
            .field("record", &self.record)
            .finish()
    }
}

impl TagLease {
    /// Takes the lease of `to`'s tag for the run of `claim`, fixing the claim's epoch (the one
    /// after the tag's and the lease's, if it has none yet). Unless `force`, refused while
    /// another run holds it (renewed within its time to live and not ended), and when a
    /// later epoch than the claim's took it ([`TakenOver`]: this run was taken over).
    pub fn take(to: &OciRef, claim: &mut Claim, ttl: Duration, force: bool) -> Result<TagLease> {
        let tag = to.tag.clone().context("a lease needs a tag")?;
        let layout = Layout::open(&to.place)?;
        layout.start()?;
        let _turn = layout.lock_index()?;
        let seen = read(&layout, &tag)?;
        let mut epoch = match claim.epoch {
            Some(e) => e,
            None => {
                let index = layout.read_json("index.json")?;
                let entry = index
                    .as_ref()
                    .and_then(|(_, v, _)| tagged(v["manifests"].as_array()?, &tag).map(epoch_of));
                entry.unwrap_or(0) + 1
            }
        };
        if let Some(s) = seen.as_ref().filter(|s| s.record.writer != claim.writer) {
            if claim.epoch.is_some() && s.record.epoch > epoch && !force {
                return Err(TakenOver {
                    tag,
                    writer: s.record.writer.clone(),
                    epoch: s.record.epoch,
                }
                .into());
            }
            if s.live() && !force {
                bail!(
                    "tag `{tag}` of {} is held by a run that is still going (writer {}, its \
                     lease renewed {} s ago, lapsing {} s after that): the session runs there. \
                     Suspend it there first, or resume it with --take-over to stop it at its \
                     next renewal",
                    layout.place(),
                    s.record.writer,
                    s.age.as_secs(),
                    s.ttl().as_secs()
                );
            }
            epoch = epoch.max(s.record.epoch + 1);
        }
        claim.epoch = Some(epoch);
        let record = Record {
            format: LEASE_FORMAT,
            writer: claim.writer.clone(),
            epoch,
            ttl_ms: ttl.as_millis() as u64,
            ended: None,
        };
        let mut lease = TagLease {
            layout,
            tag,
            record,
            etag: None,
        };
        let condition = match &seen {
            None => Some(Condition::Absent),
            Some(s) => s.etag.as_deref().map(Condition::Unchanged),
        };
        match lease.write(condition.unwrap_or(Condition::Always))? {
            Some(etag) => lease.etag = etag,
            None => bail!(
                "another run took the lease of tag `{}` of {} at the same moment",
                lease.tag,
                lease.layout.place()
            ),
        }
        Ok(lease)
    }

    /// The lease's time to live.
    pub fn ttl(&self) -> Duration {
        Duration::from_millis(self.record.ttl_ms)
    }

    /// Where and which: `tag `T` of PLACE`.
    pub fn describe(&self) -> String {
        format!("tag `{}` of {}", self.tag, self.layout.place())
    }

    /// The layout, as messages name it.
    pub fn place(&self) -> String {
        self.layout.place()
    }

    /// Writes the lease again (its time to live starts anew); `Err(TakenOver)` (as the
    /// error's cause) if another run has taken it.
    pub fn renew(&mut self) -> Result<()> {
        let _turn = self.layout.lock_index()?;
        let lost = |s: Option<Seen>| -> anyhow::Error {
            match s {
                Some(s) => TakenOver {
                    tag: self.tag.clone(),
                    writer: s.record.writer,
                    epoch: s.record.epoch,
                }
                .into(),
                None => anyhow::anyhow!(
                    "the lease of tag `{}` was deleted from {}",
                    self.tag,
                    self.layout.place()
                ),
            }
        };
        let mine = |s: &Seen| {
            s.record.writer == self.record.writer
                && s.record.epoch == self.record.epoch
                && s.record.ended.is_none()
        };
        // Without the ETag of its last write (a directory; a store that gave none) the lease
        // is read first: in a directory under the lock, in a bucket on the ETag read.
        let mut etag = match (&self.layout, &self.etag) {
            (Layout::Bucket(..), Some(etag)) => Some(etag.clone()),
            _ => match read(&self.layout, &self.tag)? {
                Some(s) if mine(&s) => s.etag,
                other => return Err(lost(other)),
            },
        };
        let mut tried_again = false;
        loop {
            let condition = etag
                .as_deref()
                .map_or(Condition::Always, Condition::Unchanged);
            if let Some(written) = self.write(condition)? {
                self.etag = written;
                return Ok(());
            }
            // Changed since: by this run's own write whose answer was lost (then its ETag is
            // taken and the write made again, once), or by another run.
            match read(&self.layout, &self.tag)? {
                Some(s) if mine(&s) && !tried_again => {
                    etag = s.etag;
                    tried_again = true;
                }
                other => return Err(lost(other)),
            }
        }
    }

    /// Gives the lease up, saying how the run ended (`suspended`, `exited(0)`): a run resumed
    /// from the tag takes it at once.
    pub fn end(&mut self, how: &str) -> Result<()> {
        self.record.ended = Some(how.to_owned());
        self.renew()
    }

    fn write(&self, condition: Condition<'_>) -> Result<Option<Option<String>>> {
        let bytes = serde_json::to_vec(&self.record)?;
        self.layout
            .write_small_tagged(&file(&self.tag)?, &bytes, condition)
    }
}

/// `ferry resume LAYOUT:TAG --export-to LAYOUT`: before the tag is imported, waits until no
/// run holds its lease — the run that held it ended (and said so), or has not renewed it
/// for its time to live (its machine is gone or cut off: a run that cannot renew suspends
/// itself within half of that) — telling `say` that it waits. Refused when the lease is
/// renewed twice meanwhile, or taken by another writer (the session runs there), or when the
/// run that held it exited (its end would run again); `take_over`: no wait, nothing refused.
pub fn await_lease(r: &OciRef, take_over: bool, say: &mut dyn FnMut(String)) -> Result<()> {
    if take_over {
        return Ok(());
    }
    let layout = Layout::open(&r.place)?;
    let Some(tag) = tag_of(&layout, r)? else {
        return Ok(());
    };
    let start = Instant::now();
    let mut first: Option<Seen> = None;
    // Renewals seen while waiting: one may be a write sent before the holder was cut off
    // that landed after (its answer lost, so the holder counts from the one before); a
    // second one means the holder goes on.
    let (mut last_written, mut renewals) = (None, 0);
    loop {
        let Some(s) = read(&layout, &tag)? else {
            return Ok(());
        };
        match s.record.ended.as_deref() {
            Some(how) if how.starts_with("exited") => bail!(
                "the session of tag `{tag}` of {} {how} (writer {}) after its last export: \
                 resuming that export would run its end again (--take-over to resume it anyway)",
                layout.place(),
                s.record.writer
            ),
            Some(_) => return Ok(()),
            None => {}
        }
        if !s.live() {
            if first.is_some() {
                say(format!(
                    "the lease of tag `{tag}` lapsed after {} s: taking the session over",
                    start.elapsed().as_secs()
                ));
            }
            return Ok(());
        }
        if first.is_some() && s.modified > last_written {
            renewals += 1;
        }
        last_written = s.modified;
        match &first {
            Some(f) if s.record.writer != f.record.writer || renewals >= 2 => bail!(
                "tag `{tag}` of {} is held by a run that is still going (writer {} renewed \
                 its lease while this one waited): the session runs there. Suspend it there \
                 first, or resume it with --take-over to stop it at its next renewal",
                layout.place(),
                s.record.writer
            ),
            Some(_) => {}
            None => {
                let left = (s.ttl() + CLOCK_SLACK).saturating_sub(s.age);
                say(format!(
                    "tag `{tag}` of {} is held by a run (writer {}, its lease renewed {} s \
                     ago): waiting up to {} s for the lease to lapse, in case that run's \
                     machine is gone or cut off (--take-over: do not wait)",
                    layout.place(),
                    s.record.writer,
                    s.age.as_secs(),
                    left.as_secs() + 1
                ));
                first = Some(s.clone());
            }
        }
        // A lease renewed by nobody lapses within its time to live; a bound anyway, should
        // the layout's clock stand still.
        if start.elapsed() > 2 * (s.ttl() + CLOCK_SLACK) + Duration::from_secs(10) {
            bail!(
                "the lease of tag `{tag}` of {} did not lapse in {} s",
                layout.place(),
                start.elapsed().as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Says on stderr, when a run holds the lease of `r`'s tag, that importing or resuming it
/// without taking its session over (no `--export-to` there) makes a copy of its last export.
pub fn say_if_copy(r: &OciRef) {
    match copy_note(r) {
        Ok(Some(note)) => eprintln!("ferry: {note}"),
        Ok(None) => {}
        Err(e) => tracing::warn!("could not read the lease of {}: {e:#}", r.name()),
    }
}

fn copy_note(r: &OciRef) -> Result<Option<String>> {
    let layout = Layout::open(&r.place)?;
    let Some(tag) = tag_of(&layout, r)? else {
        return Ok(None);
    };
    Ok(read(&layout, &tag)?.filter(Seen::live).map(|s| {
        format!(
            "tag `{tag}` of {} is held by a run that is still going (writer {}, its lease \
             renewed {} s ago): this is a copy of its last export, not the session (`ferry \
             resume {} --export-to {}` waits to take the session over)",
            layout.place(),
            s.record.writer,
            s.age.as_secs(),
            r.name(),
            r.layout_name()
        )
    }))
}

/// The writer holding the lease of `tag` in `layout`, if it is live.
pub(super) fn live_holder(layout: &Layout, tag: &str) -> Result<Option<String>> {
    Ok(read(layout, tag)?
        .filter(Seen::live)
        .map(|s| s.record.writer))
}

/// The tag `r` names, or the one tag of its layout (as an import takes it).
fn tag_of(layout: &Layout, r: &OciRef) -> Result<Option<String>> {
    if let Some(t) = &r.tag {
        return Ok(Some(t.clone()));
    }
    let index = layout.read_json("index.json")?;
    Ok(index.and_then(|(_, v, _)| match v["manifests"].as_array() {
        Some(m) if m.len() == 1 => m[0]["annotations"][super::REF_NAME]
            .as_str()
            .map(str::to_owned),
        _ => None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::oci::Place;

    fn claim(writer: &str, epoch: Option<u64>) -> Claim {
        Claim {
            writer: writer.into(),
            epoch,
        }
    }

    /// Tag `t` of a directory layout in a new temporary directory.
    fn layout() -> (tempfile::TempDir, OciRef) {
        let dir = tempfile::tempdir().unwrap();
        let to = OciRef {
            place: Place::Dir(dir.path().to_owned()),
            tag: Some("t".into()),
        };
        (dir, to)
    }

    /// The lease file made `secs` older than it is (as if not renewed since).
    fn age(dir: &std::path::Path, secs: u64) {
        let f = std::fs::File::options()
            .write(true)
            .open(dir.join("ferry-leases/t"))
            .unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(secs))
            .unwrap();
    }

    #[test]
    fn a_live_lease_keeps_other_runs_out_until_it_lapses_or_ends() {
        let (dir, to) = layout();
        let ttl = Duration::from_secs(10);
        let mut a = claim("a", None);
        let mut lease_a = TagLease::take(&to, &mut a, ttl, false).unwrap();
        assert_eq!(a.epoch, Some(1), "the one after the tag's (none yet)");
        lease_a.renew().unwrap();
        // Another run is kept out while the lease is live; its own run takes it again.
        let mut b = claim("b", Some(2));
        let e = TagLease::take(&to, &mut b, ttl, false).unwrap_err();
        assert!(
            format!("{e:#}").contains("is held by a run that is still going (writer a"),
            "{e:#}"
        );
        TagLease::take(&to, &mut claim("a", Some(1)), ttl, false).unwrap();
        // Waiting for it: it lapses once not renewed for its time to live.
        age(dir.path(), 5);
        let mut said = Vec::new();
        let waited = std::thread::spawn({
            let to = to.clone();
            move || {
                let r = await_lease(&to, false, &mut |s| said.push(s));
                (r, said)
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        age(dir.path(), 20);
        let (r, said) = waited.join().unwrap();
        r.unwrap();
        assert!(said[0].contains("waiting up to"), "{said:?}");
        assert!(said[1].contains("lapsed after"), "{said:?}");
        // Lapsed: taken, with an epoch after the lease's; the run that held it finds it lost.
        let mut b = claim("b", Some(1));
        let _lease_b = TagLease::take(&to, &mut b, ttl, false).unwrap();
        assert_eq!(b.epoch, Some(2));
        let lost = lease_a.renew().unwrap_err();
        assert_eq!(
            lost.downcast_ref::<TakenOver>(),
            Some(&TakenOver {
                tag: "t".into(),
                writer: "b".into(),
                epoch: 2
            })
        );
        // A's local resume is refused: a later epoch took the tag.
        let e = TagLease::take(&to, &mut claim("a", Some(1)), ttl, false).unwrap_err();
        assert!(e.downcast_ref::<TakenOver>().is_some(), "{e:#}");
    }

    #[test]
    fn an_ended_lease_is_free_and_an_exit_is_not_taken_over() {
        let (dir, to) = layout();
        let ttl = Duration::from_secs(10);
        await_lease(&to, false, &mut |s| panic!("{s}")).unwrap();
        let mut lease = TagLease::take(&to, &mut claim("a", None), ttl, false).unwrap();
        // Renewals seen while waiting: the run goes on, the wait is refused.
        let waited = std::thread::spawn({
            let to = to.clone();
            move || await_lease(&to, false, &mut |_| {})
        });
        for _ in 0..2 {
            std::thread::sleep(Duration::from_millis(1100));
            lease.renew().unwrap();
        }
        let e = waited.join().unwrap().unwrap_err();
        assert!(
            format!("{e:#}").contains("renewed its lease while this one waited"),
            "{e:#}"
        );
        await_lease(&to, true, &mut |s| panic!("{s}")).unwrap();
        lease.end("suspended").unwrap();
        await_lease(&to, false, &mut |s| panic!("{s}")).unwrap();
        let mut lease = TagLease::take(&to, &mut claim("b", Some(2)), ttl, false).unwrap();
        lease.end("exited(3)").unwrap();
        let e = await_lease(&to, false, &mut |_| {}).unwrap_err();
        assert!(
            format!("{e:#}").contains("exited(3) (writer b) after its last export"),
            "{e:#}"
        );
        await_lease(&to, true, &mut |_| {}).unwrap();
        // A lease file of an unknown format is refused, not taken as free.
        std::fs::write(
            dir.path().join("ferry-leases/t"),
            br#"{"ferry.lease": 2, "writer": "c", "epoch": 9, "ttl_ms": 1000}"#,
        )
        .unwrap();
        let e = await_lease(&to, false, &mut |_| {}).unwrap_err();
        assert!(format!("{e:#}").contains("of format 2"), "{e:#}");
        // A tag read from a layout names no file outside `ferry-leases` (no path escapes).
        let escape = OciRef {
            tag: Some("../../x".into()),
            ..to
        };
        let e = TagLease::take(&escape, &mut claim("d", None), ttl, true).unwrap_err();
        assert!(format!("{e:#}").contains("is not an OCI tag"), "{e:#}");
        assert!(!dir.path().parent().unwrap().join("x").exists());
    }
}
