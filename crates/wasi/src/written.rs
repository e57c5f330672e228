//! What the guest changed in its mounted files since the last snapshot, so that a snapshot of
//! a big file the guest wrote a few pages of reads those pages again, not the whole file.
//!
//! Every write, resize or allocation the guest makes through ferry's WASI is recorded by the
//! file's inode: the 1 MiB pieces ([`FILE_CHUNK_SIZE`]) it touched, and the file's
//! [`Stamp`] (device, inode, length, modification and status-change times) just before and
//! just after it. Consecutive records of one file form a chain only while each one's
//! `before` is the previous one's `after`: a change ferry did not make in between (another
//! program, a truncating `path_open`, a failed write) breaks it, and a file whose chain is
//! broken, or whose stamp at the snapshot is not the chain's last `after`, is read whole as
//! before. The import ([`crate::tree::ImportCache`]) takes a chain that starts at the stamp
//! it stored the file's pieces at and ends at the file's stamp now: the pieces the chain
//! names are read again, the others are the stored ones.
//!
//! What this cannot see (limits.md): another program writing the same file within the same
//! few microseconds as one of the guest's own writes (between the two stamps of one record),
//! or, on a kernel without fine-grained timestamps (Linux before 6.13), within the same
//! timestamp tick.

use std::collections::{BTreeMap, HashMap};

use ferry_object::FILE_CHUNK_SIZE;

use crate::tree::Stamp;

/// Most files a [`GuestWrites`] follows at once; writes to others are not recorded (those
/// files are read whole at the next snapshot).
const MAX_FILES: usize = 65_536;
/// Most separate runs of touched pieces one file's record keeps; past that the record is
/// dropped (the file is read whole).
const MAX_RUNS: usize = 65_536;

/// The guest's changes to its mounted files since the last snapshot took them
/// ([`crate::WasiCtx::take_guest_writes`]), by (device, inode).
#[derive(Debug, Default)]
pub struct GuestWrites {
    files: HashMap<(u64, u64), Written>,
}

/// One file's chain of changes.
#[derive(Debug)]
pub(crate) struct Written {
    /// The file's stamp before the first change of the chain.
    pub before: Stamp,
    /// The file's stamp after the last change of the chain.
    pub after: Stamp,
    /// Touched pieces, as runs: first piece → one past the last.
    runs: BTreeMap<u64, u64>,
    /// A change ferry did not see came between two of the chain's.
    broken: bool,
}

impl Written {
    /// Whether piece `i` may differ from what it was at `before`.
    pub fn touched(&self, i: u64) -> bool {
        self.runs
            .range(..=i)
            .next_back()
            .is_some_and(|(_, &end)| i < end)
    }

    /// Marks bytes `start..end` as touched.
    fn touch(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let piece = u64::from(FILE_CHUNK_SIZE);
        let (mut first, mut last) = (start / piece, (end - 1) / piece + 1);
        // Runs that overlap or adjoin this one merge into it.
        while let Some((&s, &e)) = self.runs.range(..=last).next_back() {
            if e < first {
                break;
            }
            first = first.min(s);
            last = last.max(e);
            self.runs.remove(&s);
        }
        self.runs.insert(first, last);
        if self.runs.len() > MAX_RUNS {
            self.broken = true;
            self.runs.clear();
        }
    }
}

impl GuestWrites {
    /// Records one change of the guest's to a file: its stamps before and after, and the
    /// bytes it wrote (none for a resize: the bytes between the two lengths count as
    /// touched either way). `None` for a stamp that could not be taken, and a change that
    /// failed, record nothing: the file's stamp then no longer matches its chain, which is
    /// what makes the next snapshot read it whole.
    pub(crate) fn record(&mut self, before: Stamp, after: Stamp, wrote: Option<(u64, u64)>) {
        if (before.dev, before.ino) != (after.dev, after.ino) {
            return;
        }
        let full = self.files.len() >= MAX_FILES;
        let w = match self.files.entry((before.dev, before.ino)) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(_) if full => return,
            std::collections::hash_map::Entry::Vacant(v) => v.insert(Written {
                before,
                after: before,
                runs: BTreeMap::new(),
                broken: false,
            }),
        };
        if w.after != before {
            w.broken = true;
        }
        if w.broken {
            w.runs.clear();
            return;
        }
        w.touch(before.len.min(after.len), before.len.max(after.len));
        if let Some((start, end)) = wrote {
            w.touch(start, end);
        }
        w.after = after;
    }

    /// The unbroken chain of the file with this stamp now, if the guest's changes account
    /// for every change since the chain began.
    pub(crate) fn chain_to(&self, now: &Stamp) -> Option<&Written> {
        self.files
            .get(&(now.dev, now.ino))
            .filter(|w| !w.broken && w.after == *now)
    }

    /// How many files have a record.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether no file has a record.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }
}
