//! Output a lost run already wrote, not written twice.
//!
//! When ferry's stdout or stderr is a regular file, each snapshot a session records also notes
//! where that file ended ([`OutputMark`]). If the process then dies (a crash, `kill -9`, a
//! power cut) after writing more output, the file holds bytes past the mark that the resumed
//! guest will write again. Resuming such a *lost* session's last snapshot with the output
//! appended to the same file (`>>`), ferry compares what the guest writes with what the file
//! already holds past the mark: while they agree nothing is written (the bytes are there;
//! lines of ferry's own among them, `ferry: …`, are stepped over);
//! from the first byte that differs, or once the old bytes are used up, output is written as
//! usual. Nothing in the file is ever overwritten or removed: a guest that does not write the
//! same bytes again (clocks, randomness) gets a warning, and what the lost run wrote stays.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::{Arc, Mutex};

/// Where output file `fd` ended when a snapshot was recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputMark {
    pub fd: i32,
    pub dev: u64,
    pub ino: u64,
    pub end: u64,
    /// Bytes past `end` that a lost run wrote and the guest had not written again yet (a
    /// replay still under way when the snapshot was taken): the next resume goes on matching
    /// them, lost or not.
    pub tail: u64,
}

/// Device and inode of `fd` when it is a regular file.
fn regular_file(fd: i32) -> Option<(u64, u64)> {
    // SAFETY: fstat on a descriptor number with a zeroed buffer we own.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 || (st.st_mode & libc::S_IFMT) != libc::S_IFREG {
        return None;
    }
    Some((st.st_dev, st.st_ino))
}

/// Whether `fd` is open for appending (`>>`).
fn appending(fd: i32) -> bool {
    // SAFETY: F_GETFL on a descriptor number reads its flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    flags >= 0 && flags & libc::O_APPEND != 0
}

/// Where the next write to `fd` lands: the file's end when it is open for appending (its
/// offset says nothing until this process has written through it), else its offset.
fn end_of(fd: i32) -> Option<u64> {
    // SAFETY: fstat fills a zeroed buffer we own; lseek with SEEK_CUR only reads the offset.
    unsafe {
        if appending(fd) {
            let mut st: libc::stat = std::mem::zeroed();
            return (libc::fstat(fd, &mut st) == 0).then_some(st.st_size as u64);
        }
        u64::try_from(libc::lseek(fd, 0, libc::SEEK_CUR)).ok()
    }
}

/// One output file being replayed: its bytes from `start` on were written by the lost run.
#[derive(Debug)]
pub struct Replay {
    file: File,
    id: (u64, u64),
    start: u64,
    len: u64,
    /// Bytes of the old output matched so far.
    pos: u64,
    active: bool,
}

impl Replay {
    /// Where the guest's output logically ends in the file (the bytes past it, if any, are
    /// the lost run's, not yet matched).
    fn logical_end(&self) -> u64 {
        self.start + self.pos
    }

    /// Up to `n` of the lost run's bytes from the match position on.
    fn old_bytes(&self, n: usize) -> std::io::Result<Vec<u8>> {
        let n = n.min(usize::try_from(self.len - self.pos).unwrap_or(usize::MAX));
        let mut old = vec![0u8; n];
        self.file.read_exact_at(&mut old, self.start + self.pos)?;
        Ok(old)
    }

    /// How many leading bytes of `buf` the file already holds at the match position.
    fn matching(&self, buf: &[u8]) -> std::io::Result<usize> {
        let old = self.old_bytes(buf.len())?;
        Ok(old.iter().zip(buf).take_while(|(a, b)| a == b).count())
    }

    /// The length of a line of ferry's own (`ferry: …\n`, at most 1 KiB) starting at the match
    /// position, if there is one: with stderr in the same file as stdout, the lost run's
    /// messages (a checkpoint's, say) sit between its output bytes, and the guest will not
    /// write them again.
    fn own_line(&self) -> std::io::Result<Option<u64>> {
        const PREFIX: &[u8] = b"ferry: ";
        let old = self.old_bytes(1024)?;
        if !old.starts_with(PREFIX) {
            return Ok(None);
        }
        Ok(old.iter().position(|&b| b == b'\n').map(|i| i as u64 + 1))
    }
}

/// The replays of one resumed run (stdout and stderr share one when they are the same file).
#[derive(Debug, Clone, Default)]
pub struct Replays(Vec<(i32, Arc<Mutex<Replay>>)>);

impl Replays {
    /// Replays for the output files among fds 1 and 2 that `marks` (the session's last
    /// record) says ended earlier than they do now, opened for appending (`>>`) and the same
    /// files as then: all that follows the mark when the session was `lost`, else only a
    /// replay's unfinished tail.
    pub fn from_marks(marks: &[OutputMark], lost: bool) -> Self {
        let mut out: Vec<(i32, Arc<Mutex<Replay>>)> = Vec::new();
        for m in marks {
            let Some(id) = regular_file(m.fd) else {
                continue;
            };
            if id != (m.dev, m.ino) || !appending(m.fd) {
                continue;
            }
            if !lost && m.tail == 0 {
                continue;
            }
            if let Some((_, shared)) = out.iter().find(|(_, r)| r.lock().expect("replay").id == id)
            {
                let shared = shared.clone();
                out.push((m.fd, shared));
                continue;
            }
            // Read the file through a descriptor of our own: fd 1 is open for writing only.
            let Ok(file) = File::open(format!("/proc/self/fd/{}", m.fd)) else {
                continue;
            };
            let Ok(meta) = file.metadata() else {
                continue;
            };
            if (meta.dev(), meta.ino()) != id || meta.len() <= m.end {
                continue;
            }
            let len = if lost {
                meta.len() - m.end
            } else {
                m.tail.min(meta.len() - m.end)
            };
            out.push((
                m.fd,
                Arc::new(Mutex::new(Replay {
                    file,
                    id,
                    start: m.end,
                    len,
                    pos: 0,
                    active: true,
                })),
            ));
        }
        Self(out)
    }

    /// Bytes the lost run left past the marks (each file once).
    pub fn pending(&self) -> u64 {
        let mut seen = Vec::new();
        let mut total = 0;
        for (_, r) in &self.0 {
            let r = r.lock().expect("replay");
            if !seen.contains(&r.id) {
                seen.push(r.id);
                total += r.len - r.pos;
            }
        }
        total
    }

    /// `inner` (what fd `fd` is written through) wrapped to skip what the file already holds.
    pub fn wrap(&self, fd: i32, inner: Box<dyn Write + Send>) -> Box<dyn Write + Send> {
        match self.0.iter().find(|(f, _)| *f == fd) {
            Some((_, r)) => Box::new(ReplayWriter {
                inner,
                replay: r.clone(),
            }),
            None => inner,
        }
    }

    /// Where fds 1 and 2 end now, for the session's record of a snapshot: a file still being
    /// replayed ends where the guest's output has reached, not where the old bytes end.
    pub fn marks(&self) -> Vec<OutputMark> {
        let mut out = Vec::new();
        for fd in [1, 2] {
            let Some((dev, ino)) = regular_file(fd) else {
                continue;
            };
            let active = self
                .0
                .iter()
                .find(|(f, _)| *f == fd)
                .map(|(_, r)| r.lock().expect("replay"))
                .filter(|r| r.active)
                .map(|r| (r.logical_end(), r.len - r.pos));
            let (end, tail) = match active.or_else(|| end_of(fd).map(|at| (at, 0))) {
                Some(at) => at,
                None => continue,
            };
            out.push(OutputMark {
                fd,
                dev,
                ino,
                end,
                tail,
            });
        }
        out
    }
}

struct ReplayWriter {
    inner: Box<dyn Write + Send>,
    replay: Arc<Mutex<Replay>>,
}

impl Write for ReplayWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut r = self.replay.lock().expect("replay");
        if !r.active || buf.is_empty() {
            drop(r);
            return self.inner.write(buf);
        }
        let mut rest = buf;
        loop {
            let same = r.matching(rest)?;
            r.pos += same as u64;
            rest = &rest[same..];
            if rest.is_empty() || r.pos == r.len {
                break;
            }
            match r.own_line()? {
                Some(skip) => r.pos += skip,
                None => break,
            }
        }
        if r.pos == r.len {
            r.active = false;
        } else if !rest.is_empty() {
            r.active = false;
            eprintln!(
                "ferry: the resumed program's output differs from what the lost run wrote after \
                 its last snapshot; those {} bytes stay in the file and new output follows them",
                r.len - r.pos
            );
        }
        drop(r);
        self.inner.write_all(rest)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
