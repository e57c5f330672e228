//! Which pages of a guest memory were written since the last snapshot, so a snapshot hashes
//! only those (DESIGN §3: unchanged chunks are neither re-hashed nor stored again).
//!
//! Linux (6.7+) tracks this exactly and per range: the memory is registered with a
//! `userfaultfd` in asynchronous write-protect mode (`UFFD_FEATURE_WP_ASYNC`: a write to a
//! protected page is resolved by the kernel itself, no handler thread, and the page is marked
//! written), and the `PAGEMAP_SCAN` ioctl on `/proc/self/pagemap` returns the written pages
//! and write-protects them again in one step. Unlike soft-dirty bits this is per range, so
//! several guests in one process (a space) do not disturb each other. Where any of it is
//! missing, [`Tracker::new`] fails and snapshots hash the whole memory, as before.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const UFFD_API: u64 = 0xAA;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
const UFFDIO_WRITEPROTECT_BIT: u64 = 1 << 0x06;

/// `_IOWR(type, nr, size)`.
const fn iowr(ty: u64, nr: u64, size: u64) -> u64 {
    (3 << 30) | (size << 16) | (ty << 8) | nr
}

const UFFDIO_API: u64 = iowr(0xAA, 0x3F, 24);
const UFFDIO_REGISTER: u64 = iowr(0xAA, 0x00, 32);
const UFFDIO_WRITEPROTECT: u64 = iowr(0xAA, 0x06, 24);
const PAGEMAP_SCAN: u64 = iowr(b'f' as u64, 16, 96);
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
const PAGE_IS_WRITTEN: u64 = 1 << 1;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

#[repr(C)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Registers `[start, start + len)` with `uffd` for write-protection and protects it.
///
/// # Safety
/// The range must be memory of this process that stays mapped while `uffd` is open.
unsafe fn protect(uffd: &OwnedFd, start: usize, len: usize) -> io::Result<()> {
    let mut reg = UffdioRegister {
        range: UffdioRange {
            start: start as u64,
            len: len as u64,
        },
        mode: UFFDIO_REGISTER_MODE_WP,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_REGISTER reads and writes a `struct uffdio_register` we own; the range
    // is the caller's.
    check(unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_REGISTER as _, &mut reg) })?;
    if reg.ioctls & UFFDIO_WRITEPROTECT_BIT == 0 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "write-protection is not available for this memory",
        ));
    }
    write_protect(uffd, start, len)
}

/// Write-protects `[start, start + len)`, a range registered with `uffd`.
fn write_protect(uffd: &OwnedFd, start: usize, len: usize) -> io::Result<()> {
    let mut wp = UffdioWriteprotect {
        range: UffdioRange {
            start: start as u64,
            len: len as u64,
        },
        mode: UFFDIO_WRITEPROTECT_MODE_WP,
    };
    // SAFETY: UFFDIO_WRITEPROTECT reads a `struct uffdio_writeprotect` we own; the kernel
    // refuses a range not registered with `uffd`.
    check(unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_WRITEPROTECT as _, &mut wp) })
}

/// Write tracking of one page-aligned range of this process's memory.
#[derive(Debug)]
pub struct Tracker {
    uffd: OwnedFd,
    pagemap: File,
    start: usize,
    len: usize,
}

impl Tracker {
    /// Starts tracking `[start, start + len)`: from now on, [`Tracker::take_written`] reports
    /// the pages written since the previous call (or since now).
    ///
    /// # Safety
    /// The range must be memory of this process that stays mapped while the tracker lives
    /// (a guest memory that is not moved or shrunk; when it is, drop the tracker first).
    pub unsafe fn new(start: *const u8, len: usize) -> io::Result<Self> {
        let page = page_size();
        let start = start as usize;
        if len == 0 || !start.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "range is not page-aligned",
            ));
        }
        // SAFETY: plain syscall; the result is a new fd we own, or -1.
        let mut fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) }
                as libc::c_int;
        if fd < 0 {
            // Unprivileged processes may still track their own user-mode writes.
            // SAFETY: as above.
            fd = unsafe {
                libc::syscall(
                    libc::SYS_userfaultfd,
                    libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY,
                )
            } as libc::c_int;
        }
        check(fd)?;
        // SAFETY: fd was just returned to us and is owned by nothing else.
        let uffd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut api = UffdioApi {
            api: UFFD_API,
            features: UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes a `struct uffdio_api` we own.
        check(unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_API as _, &mut api) })?;
        if api.features & UFFD_FEATURE_WP_ASYNC == 0 {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "no asynchronous userfaultfd write-protection",
            ));
        }
        // SAFETY: the range is the caller's (see # Safety).
        unsafe { protect(&uffd, start, len)? };
        let pagemap = File::open("/proc/self/pagemap")?;
        let mut t = Self {
            uffd,
            pagemap,
            start,
            len,
        };
        // Fails here (not at the first snapshot) if PAGEMAP_SCAN is missing.
        t.take_written()?;
        Ok(t)
    }

    /// Extends the tracked range to `len` bytes from its start (the memory grew). Writes to
    /// the new part are reported from now on; what was written there before is not.
    ///
    /// # Safety
    /// As for [`Tracker::new`], for the whole new range.
    pub unsafe fn grow(&mut self, len: usize) -> io::Result<()> {
        if len <= self.len {
            return Ok(());
        }
        if !len.is_multiple_of(page_size()) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "range is not page-aligned",
            ));
        }
        // SAFETY: the caller's (see # Safety).
        unsafe { protect(&self.uffd, self.start + self.len, len - self.len)? };
        self.len = len;
        Ok(())
    }

    /// Byte ranges `(offset, length)` of the tracked range written since the last call, in
    /// order, at page granularity; the pages are write-protected again in the same step.
    pub fn take_written(&mut self) -> io::Result<Vec<(usize, usize)>> {
        self.scan(PM_SCAN_WP_MATCHING)
    }

    /// As [`Tracker::take_written`], but the pages stay unprotected: further writes to them
    /// cost nothing, and they are reported again until they are protected
    /// ([`Tracker::protect`], or a `take_written`).
    pub fn peek_written(&mut self) -> io::Result<Vec<(usize, usize)>> {
        self.scan(0)
    }

    /// Write-protects `len` bytes at `offset` of the tracked range again: they count as not
    /// written from now on.
    pub fn protect(&mut self, offset: usize, len: usize) -> io::Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "range outside the tracked memory",
            ));
        }
        write_protect(&self.uffd, self.start + offset, len)
    }

    fn scan(&mut self, wp: u64) -> io::Result<Vec<(usize, usize)>> {
        let _ = &self.uffd; // registered for as long as the tracker lives
        let end = (self.start + self.len) as u64;
        let mut at = self.start as u64;
        let mut out = Vec::new();
        let mut regions = vec![PageRegion::default(); 512];
        while at < end {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags: wp | PM_SCAN_CHECK_WPASYNC,
                start: at,
                end,
                walk_end: 0,
                vec: regions.as_mut_ptr() as u64,
                vec_len: regions.len() as u64,
                max_pages: 0,
                category_inverted: 0,
                category_mask: PAGE_IS_WRITTEN,
                category_anyof_mask: 0,
                return_mask: PAGE_IS_WRITTEN,
            };
            // SAFETY: PAGEMAP_SCAN reads `arg` and writes at most `vec_len` regions into
            // `regions`, both ours.
            let n = unsafe { libc::ioctl(self.pagemap.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
            check(n)?;
            for r in &regions[..n as usize] {
                out.push((
                    (r.start - self.start as u64) as usize,
                    (r.end - r.start) as usize,
                ));
            }
            if arg.walk_end <= at {
                return Err(io::Error::other("PAGEMAP_SCAN made no progress"));
            }
            at = arg.walk_end;
        }
        Ok(out)
    }

    pub fn start(&self) -> usize {
        self.start
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An anonymous mapping, unmapped on drop.
    struct Map(*mut u8, usize);

    impl Drop for Map {
        fn drop(&mut self) {
            // SAFETY: unmapping the mapping this value made.
            unsafe { libc::munmap(self.0.cast(), self.1) };
        }
    }

    fn map(len: usize) -> Map {
        // SAFETY: a fresh private anonymous mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Map(p.cast(), len)
    }

    /// A tracker of the first `len` bytes of `m` (`None`: tracking is unavailable here, and
    /// this is not CI).
    fn tracker(m: &Map, len: usize) -> Option<Tracker> {
        // SAFETY: the mapping outlives the tracker (both live until the test ends).
        match unsafe { Tracker::new(m.0, len) } {
            Ok(t) => Some(t),
            Err(e) => {
                // CI runs on a machine that has it: there the test must not be skipped.
                assert!(
                    std::env::var_os("CI").is_none(),
                    "write tracking unavailable: {e}"
                );
                eprintln!("write tracking unavailable here ({e}); skipped");
                None
            }
        }
    }

    #[test]
    fn reports_exactly_the_pages_written_since_the_last_look() {
        let page = page_size();
        let m = map(64 * page);
        // SAFETY: writing inside our mapping.
        unsafe { m.0.add(3 * page).write(1) };
        let Some(mut t) = tracker(&m, m.1) else {
            return;
        };
        assert_eq!(t.take_written().expect("scan"), vec![]);
        // SAFETY: writing inside our mapping.
        unsafe {
            m.0.add(5 * page + 17).write(7);
            m.0.add(6 * page).write(7);
            m.0.add(40 * page + page - 1).write(7);
        }
        assert_eq!(
            t.take_written().expect("scan"),
            vec![(5 * page, 2 * page), (40 * page, page)]
        );
        assert_eq!(t.take_written().expect("scan"), vec![]);
        // A read is not a write; a page written again is reported again.
        // SAFETY: reading and writing inside our mapping.
        unsafe {
            let _ = m.0.add(10 * page).read_volatile();
            m.0.add(5 * page).write(9);
        }
        assert_eq!(t.take_written().expect("scan"), vec![(5 * page, page)]);
        // A peek leaves the pages written; protecting part of them clears that part.
        // SAFETY: writing inside our mapping.
        unsafe {
            m.0.add(8 * page).write(1);
            m.0.add(9 * page).write(1);
        }
        assert_eq!(t.peek_written().expect("scan"), vec![(8 * page, 2 * page)]);
        assert_eq!(t.peek_written().expect("scan"), vec![(8 * page, 2 * page)]);
        t.protect(8 * page, page).expect("protect");
        assert_eq!(t.peek_written().expect("scan"), vec![(9 * page, page)]);
        assert!(t.protect(63 * page, 2 * page).is_err());
        assert_eq!(t.take_written().expect("scan"), vec![(9 * page, page)]);
        assert_eq!(t.peek_written().expect("scan"), vec![]);
    }

    /// A memory that grew: the tracker follows it, and writes to the new part are reported
    /// alongside those to the old.
    #[test]
    fn a_grown_range_is_tracked_in_full() {
        let page = page_size();
        let m = map(64 * page);
        let Some(mut t) = tracker(&m, 16 * page) else {
            return;
        };
        // SAFETY: writing inside our mapping, outside the tracked range so far.
        unsafe { m.0.add(20 * page).write(1) };
        assert_eq!(t.take_written().expect("scan"), vec![]);
        // SAFETY: the mapping outlives the tracker.
        unsafe { t.grow(48 * page) }.expect("grow");
        assert_eq!(t.len(), 48 * page);
        // SAFETY: writing inside our mapping.
        unsafe {
            m.0.add(2 * page).write(1);
            m.0.add(30 * page).write(1);
            m.0.add(50 * page).write(1);
        }
        assert_eq!(
            t.take_written().expect("scan"),
            vec![(2 * page, page), (30 * page, page)]
        );
    }

    /// As after a restore that mapped chunks from a pack: part of the memory is a private
    /// mapping of a file. Pages read from it, pages never touched and anonymous pages are
    /// not written; a write to any of them (copy-on-write for the file's) is reported.
    #[test]
    fn reports_writes_to_pages_mapped_from_a_file() {
        use std::os::fd::AsRawFd;
        let page = page_size();
        let m = map(64 * page);
        let path = std::env::temp_dir().join(format!("ferry-dirty-{}", std::process::id()));
        std::fs::write(&path, vec![5u8; 32 * page]).expect("temp file");
        let f = std::fs::File::open(&path).expect("open");
        std::fs::remove_file(&path).expect("remove");
        // SAFETY: replaces pages 16..48 of our own mapping, as the restore does.
        let r = unsafe {
            libc::mmap(
                m.0.add(16 * page).cast(),
                32 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(r, libc::MAP_FAILED);
        // SAFETY: reading inside our mapping: these file pages are mapped before tracking.
        for p in 16..24 {
            assert_eq!(unsafe { m.0.add(p * page).read_volatile() }, 5);
        }
        let Some(mut t) = tracker(&m, m.1) else {
            return;
        };
        assert_eq!(t.take_written().expect("scan"), vec![]);
        // SAFETY: reading and writing inside our mapping.
        unsafe {
            assert_eq!(m.0.add(30 * page).read_volatile(), 5);
            m.0.add(17 * page + 3).write(1);
            m.0.add(40 * page).write(1);
            m.0.add(41 * page).write(1);
            m.0.add(50 * page).write(1);
        }
        assert_eq!(
            t.take_written().expect("scan"),
            vec![(17 * page, page), (40 * page, 2 * page), (50 * page, page)]
        );
        // SAFETY: reading inside our mapping: copied pages hold the writes, others the file.
        unsafe {
            assert_eq!(m.0.add(17 * page + 3).read_volatile(), 1);
            assert_eq!(m.0.add(17 * page + 4).read_volatile(), 5);
        }
        assert_eq!(t.take_written().expect("scan"), vec![]);
    }
}
