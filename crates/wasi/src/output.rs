//! A guest's stdout and stderr recorded as one append-only event log (the `ferry.log` record
//! encoding), shared between the guest's thread, which appends, and readers that follow it.

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Stream tag of a stdout record.
pub const STDOUT: u8 = 1;
/// Stream tag of a stderr record.
pub const STDERR: u8 = 2;
/// Bytes of a record header: stream tag and little-endian u32 length.
pub const RECORD_HEADER: usize = 5;
/// Largest output log ferry records or accepts (1 GiB).
pub const MAX_LOG: u64 = 1 << 30;

#[derive(Debug, Default)]
struct Inner {
    bytes: Vec<u8>,
    /// Set once no more output will come (the guest stopped); wakes followers.
    closed: bool,
    /// Length of the log this one started from (a snapshot's): what follows was written in
    /// this run, and may differ from what an earlier run of the guest wrote past it.
    base: usize,
    /// Record boundaries past `base`, at least [`MARK_EVERY`] apart, found while placing
    /// readers ([`OutputBuffer::read_on`]): placing one scans from the mark before it.
    marks: Vec<usize>,
}

/// Bytes between two of a log's marks (1 MiB): placing a reader reads at most about that many
/// bytes' record headers.
const MARK_EVERY: usize = 1 << 20;

/// The log: cheap to clone (all clones share it).
#[derive(Debug, Clone, Default)]
pub struct OutputBuffer(Arc<(Mutex<Inner>, Condvar)>);

impl OutputBuffer {
    /// A log that starts with `bytes` (the output recorded in a snapshot).
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        let b = Self::default();
        let mut g = b.lock();
        g.base = bytes.len();
        g.bytes = bytes;
        drop(g);
        b
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.0.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends one record. Output beyond [`MAX_LOG`] is refused with an error the guest sees
    /// as a failed write (nothing is silently dropped).
    pub fn append(&self, stream: u8, data: &[u8]) -> std::io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let mut g = self.lock();
        if (g.bytes.len() + RECORD_HEADER + data.len()) as u64 > MAX_LOG {
            return Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "the session's output log is full (1 GiB)",
            ));
        }
        g.bytes.push(stream);
        g.bytes
            .extend_from_slice(&(data.len() as u32).to_le_bytes());
        g.bytes.extend_from_slice(data);
        drop(g);
        self.0.1.notify_all();
        Ok(())
    }

    /// Appends encoded `records` that a writer elsewhere (a client running the guest) placed
    /// at byte `at` of the log, and returns the log's new length. Bytes the log already holds
    /// from `at` on must be the same (a retry after a lost answer appends nothing twice); what
    /// follows them must be whole records, and the log stays within [`MAX_LOG`].
    pub fn append_at(&self, at: u64, records: &[u8]) -> Result<u64, AppendAtError> {
        let mut g = self.lock();
        let len = g.bytes.len() as u64;
        if at > len {
            return Err(AppendAtError::Gap { len });
        }
        let start = at as usize;
        let held = &g.bytes[start..];
        let overlap = held.len().min(records.len());
        if held[..overlap] != records[..overlap] {
            return Err(AppendAtError::Differs { at: len });
        }
        let rest = &records[overlap..];
        if rest.is_empty() {
            return Ok(len);
        }
        Records::check(rest).map_err(AppendAtError::Malformed)?;
        if len + rest.len() as u64 > MAX_LOG {
            return Err(AppendAtError::Full);
        }
        g.bytes.extend_from_slice(rest);
        let len = g.bytes.len() as u64;
        drop(g);
        self.0.1.notify_all();
        Ok(len)
    }

    /// Length of the encoded log.
    pub fn len(&self) -> u64 {
        self.lock().bytes.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the encoded log.
    pub fn bytes(&self) -> Vec<u8> {
        self.lock().bytes.clone()
    }

    /// The encoded log from `from` on, at most about `max` bytes (whole records only, but at
    /// least one), and whether the log is closed. `from` past the end yields nothing.
    pub fn read_from(&self, from: u64, max: usize) -> (Vec<u8>, bool) {
        let g = self.lock();
        let start = (from as usize).min(g.bytes.len());
        let rest = &g.bytes[start..];
        let mut end = 0;
        for (at, r) in Records::new(rest).offsets() {
            if end > 0 && at + RECORD_HEADER + r > max {
                break;
            }
            end = at + RECORD_HEADER + r;
        }
        (rest[..end].to_vec(), g.closed)
    }

    /// [`OutputBuffer::read_from`] for a reader that read up to `from` before — perhaps from
    /// an earlier run of the guest, whose output past this log's start (its snapshot) came
    /// out otherwise when the guest redid it (a crash, a reclaim), so that `from` may fall
    /// inside a record here. Returns where the reader goes on — `from` itself when it is a
    /// record boundary here, else the first boundary past it (at most the log's end) — with
    /// the records from there and whether the log is closed.
    pub fn read_on(&self, from: u64, max: usize) -> (u64, Vec<u8>, bool) {
        let start = self.place(from);
        let (bytes, closed) = self.read_from(start, max);
        (start, bytes, closed)
    }

    /// The first record boundary at or past `from` (`from` itself past the end).
    fn place(&self, from: u64) -> u64 {
        let mut g = self.lock();
        let len = g.bytes.len();
        let Ok(from) = usize::try_from(from) else {
            return from;
        };
        if from <= g.base || from >= len {
            return from as u64;
        }
        // Every boundary from `base` on is one of this run's records.
        let before = g.marks.partition_point(|&m| m <= from);
        let mut at = before.checked_sub(1).map_or(g.base, |i| g.marks[i]);
        while at < from {
            let header: [u8; 4] = g.bytes[at + 1..at + RECORD_HEADER]
                .try_into()
                .expect("a whole record header");
            at += RECORD_HEADER + u32::from_le_bytes(header) as usize;
            let last = g.marks.last().copied().unwrap_or(g.base);
            if at >= last + MARK_EVERY && at < len {
                g.marks.push(at);
            }
        }
        at.min(len) as u64
    }

    /// Waits until the log is longer than `len` or closed, or `timeout` passes.
    pub fn wait_beyond(&self, len: u64, timeout: Duration) {
        let g = self.lock();
        let _ = self
            .0
            .1
            .wait_timeout_while(g, timeout, |i| i.bytes.len() as u64 <= len && !i.closed);
    }

    /// No more output will come: followers stop waiting.
    pub fn close(&self) {
        self.lock().closed = true;
        self.0.1.notify_all();
    }

    /// Reopens a closed log (the session runs again).
    pub fn reopen(&self) {
        self.lock().closed = false;
    }

    /// A writer that appends `stream` records.
    pub fn writer(&self, stream: u8) -> Box<dyn Write + Send> {
        Box::new(StreamWriter {
            log: self.clone(),
            stream,
        })
    }
}

struct StreamWriter {
    log: OutputBuffer,
    stream: u8,
}

impl Write for StreamWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.log.append(self.stream, buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Why [`OutputBuffer::append_at`] refused bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppendAtError {
    #[error("the log holds {len} bytes; the output must go on from there")]
    Gap { len: u64 },
    #[error("the output differs from what the log already holds (it holds {at} bytes)")]
    Differs { at: u64 },
    #[error("the output is not whole records: {0}")]
    Malformed(String),
    #[error("the session's output log is full (1 GiB)")]
    Full,
}

/// The records of an encoded log, in order: `(stream, bytes)`. A truncated or malformed tail
/// ends the iteration; [`Records::check`] says whether the whole input was well-formed.
#[derive(Debug, Clone)]
pub struct Records<'a> {
    rest: &'a [u8],
    at: usize,
}

impl<'a> Records<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes, at: 0 }
    }

    /// `(offset of the record, length of its data)` for each whole record.
    fn offsets(self) -> impl Iterator<Item = (usize, usize)> + 'a {
        let mut it = self;
        std::iter::from_fn(move || {
            let at = it.at;
            it.next().map(|(_, d)| (at, d.len()))
        })
    }

    /// Checks that `bytes` is a sequence of whole records with known stream tags, and returns
    /// the total stdout and stderr bytes.
    pub fn check(bytes: &[u8]) -> Result<(u64, u64), String> {
        let mut it = Records::new(bytes);
        let (mut out, mut err) = (0u64, 0u64);
        for (stream, data) in it.by_ref() {
            match stream {
                STDOUT => out += data.len() as u64,
                STDERR => err += data.len() as u64,
                s => return Err(format!("record with unknown stream tag {s}")),
            }
        }
        if !it.rest.is_empty() {
            return Err(format!("truncated record at byte {}", it.at));
        }
        Ok((out, err))
    }
}

impl<'a> Iterator for Records<'a> {
    type Item = (u8, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.len() < RECORD_HEADER {
            return None;
        }
        let n = u32::from_le_bytes(self.rest[1..5].try_into().expect("4 bytes")) as usize;
        if self.rest.len() - RECORD_HEADER < n {
            return None;
        }
        let stream = self.rest[0];
        let data = &self.rest[RECORD_HEADER..RECORD_HEADER + n];
        self.rest = &self.rest[RECORD_HEADER + n..];
        self.at += RECORD_HEADER + n;
        Some((stream, data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_reads_stop_at_record_boundaries() {
        let log = OutputBuffer::default();
        log.writer(STDOUT).write_all(b"hello ").expect("write");
        log.writer(STDERR).write_all(b"oops\n").expect("write");
        log.writer(STDOUT).write_all(b"world\n").expect("write");
        let all = log.bytes();
        assert_eq!(Records::check(&all), Ok((12, 5)));
        let got: Vec<_> = Records::new(&all).collect();
        assert_eq!(
            got,
            vec![
                (STDOUT, &b"hello "[..]),
                (STDERR, &b"oops\n"[..]),
                (STDOUT, &b"world\n"[..])
            ]
        );
        // A small `max` still yields one whole record, never a partial one.
        let (first, closed) = log.read_from(0, 1);
        assert_eq!(first.len(), RECORD_HEADER + 6);
        assert!(!closed);
        let (rest, _) = log.read_from(first.len() as u64, 1 << 20);
        assert_eq!(rest.len(), all.len() - first.len());
        assert!(Records::check(&all[..all.len() - 1]).is_err());
        assert!(Records::check(&[9, 0, 0, 0, 0]).is_err());
        log.close();
        assert!(log.read_from(0, 10).1);
    }

    #[test]
    fn a_reader_placed_inside_a_record_of_a_redone_run_goes_on_at_the_next_boundary() {
        // A snapshot's log, then this run's records.
        let log = OutputBuffer::from_bytes(record(STDOUT, b"before\n"));
        let base = log.len();
        log.writer(STDOUT)
            .write_all(b"redone, longer\n")
            .expect("write");
        log.writer(STDERR).write_all(b"then this\n").expect("write");
        let second = base + (RECORD_HEADER + 15) as u64;
        // At a boundary (or up to the snapshot's end): read on from there.
        for at in [0, base, second] {
            let (start, bytes, _) = log.read_on(at, 1 << 20);
            assert_eq!(start, at);
            assert_eq!(bytes.len() as u64, log.len() - at);
        }
        // Inside a record this run wrote: the next boundary, whole records from it.
        for at in [base + 1, base + 7, second - 1] {
            let (start, bytes, _) = log.read_on(at, 1 << 20);
            assert_eq!(start, second, "from {at}");
            assert_eq!(
                Records::new(&bytes).collect::<Vec<_>>(),
                vec![(STDERR, &b"then this\n"[..])]
            );
        }
        // Inside the last record: the end, nothing to show yet.
        let (start, bytes, _) = log.read_on(log.len() - 2, 1 << 20);
        assert_eq!((start, bytes.len()), (log.len(), 0));
        // Past the end: as asked (the reader waits for more).
        assert_eq!(log.read_on(log.len() + 9, 1 << 20).0, log.len() + 9);
        // Placed after a reader further on: scanned from the snapshot's end again.
        assert_eq!(log.read_on(base + 2, 1 << 20).0, second);
        // A long run: readers are placed from the mark before them.
        let big = OutputBuffer::from_bytes(Vec::new());
        let mut w = big.writer(STDOUT);
        for i in 0..200_000u32 {
            w.write_all(format!("line {i}\n").as_bytes())
                .expect("write");
        }
        let all = big.bytes();
        let bounds: Vec<u64> = Records::new(&all)
            .offsets()
            .map(|(at, _)| at as u64)
            .collect();
        for &b in bounds
            .iter()
            .rev()
            .step_by(997)
            .chain(bounds.iter().step_by(1009))
        {
            assert_eq!(big.read_on(b, 64).0, b);
            let next = bounds.get(bounds.partition_point(|&x| x <= b + 3));
            assert_eq!(big.read_on(b + 3, 64).0, next.copied().unwrap_or(big.len()));
        }
        assert!(big.lock().marks.len() >= 2, "{}", big.lock().marks.len());
    }

    fn record(stream: u8, data: &[u8]) -> Vec<u8> {
        let mut v = vec![stream];
        v.extend_from_slice(&(data.len() as u32).to_le_bytes());
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn appends_at_an_offset_once_and_refuses_gaps_and_differences() {
        let log = OutputBuffer::from_bytes(record(STDOUT, b"before\n"));
        let base = log.len();
        let a = record(STDOUT, b"one\n");
        let b = record(STDERR, b"two\n");
        assert_eq!(log.append_at(base, &a), Ok(base + a.len() as u64));
        // A retry of the same bytes, and a retry that carries more, append nothing twice.
        assert_eq!(log.append_at(base, &a), Ok(base + a.len() as u64));
        let ab = [a.clone(), b.clone()].concat();
        let end = base + ab.len() as u64;
        assert_eq!(log.append_at(base, &ab), Ok(end));
        assert_eq!(
            log.bytes(),
            [record(STDOUT, b"before\n"), ab.clone()].concat()
        );
        // Past the end: the log says where to go on from.
        assert_eq!(
            log.append_at(end + 5, &a),
            Err(AppendAtError::Gap { len: end })
        );
        // Other bytes where the log holds some: refused, nothing appended.
        assert_eq!(
            log.append_at(base, &record(STDOUT, b"uno\n")),
            Err(AppendAtError::Differs { at: end })
        );
        // Not whole records after the overlap.
        assert!(matches!(
            log.append_at(end, &a[..a.len() - 1]),
            Err(AppendAtError::Malformed(_))
        ));
        assert!(matches!(
            log.append_at(end, &[7, 0, 0, 0, 0]),
            Err(AppendAtError::Malformed(_))
        ));
        assert_eq!(log.len(), end);
    }
}
