//! WASI calls against a byte-slice memory: what a guest would observe.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::{Clock, Errno, HostError, MountSpec, Stdio, WasiCtx};

/// A clock the test moves by hand.
#[derive(Clone, Default)]
struct FakeClock(Arc<AtomicU64>);

impl Clock for FakeClock {
    fn monotonic_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
    fn realtime_ns(&self) -> u64 {
        1_700_000_000_000_000_000
    }
}

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Stdio with no input, stdout to `out`, stderr nowhere; no terminals.
fn stdio_to(out: Box<dyn Write + Send>) -> Stdio {
    Stdio {
        stdin: Box::new(std::io::empty()),
        stdin_fd: None,
        terminals: [false; 3],
        log: None,
        input: None,
        input_log: None,
        stdout: out,
        stderr: Box::new(std::io::sink()),
    }
}

fn ctx(mounts: Vec<MountSpec>, clock: FakeClock, out: Buf, interrupt: Arc<AtomicBool>) -> WasiCtx {
    let stdio = stdio_to(Box::new(out));
    WasiCtx::new(
        vec!["prog".into(), "arg".into()],
        vec![("K".into(), "V".into())],
        mounts,
        stdio,
        Box::new(clock),
        Arc::new(move || interrupt.load(Ordering::SeqCst)),
    )
    .unwrap()
}

/// A context running `prog` with no environment and no mounts over `stdio`.
fn with_stdio(stdio: Stdio, interrupt: Arc<dyn Fn() -> bool + Send + Sync>) -> WasiCtx {
    WasiCtx::new(
        vec!["prog".into()],
        vec![],
        vec![],
        stdio,
        Box::new(FakeClock::default()),
        interrupt,
    )
    .unwrap()
}

fn put_str(mem: &mut [u8], at: usize, s: &str) -> (i64, i64) {
    mem[at..at + s.len()].copy_from_slice(s.as_bytes());
    (at as i64, s.len() as i64)
}

/// Writes `text` to stdout with `fd_write` (one iovec at 0, the text at 100, the count to
/// 200): the errno and the count written.
fn write_stdout(c: &mut WasiCtx, mem: &mut [u8], text: &str) -> (i32, u32) {
    let (p, n) = put_str(mem, 100, text);
    mem[0..4].copy_from_slice(&(p as u32).to_le_bytes());
    mem[4..8].copy_from_slice(&(n as u32).to_le_bytes());
    let errno = c.call("fd_write", mem, &[1, 0, 1, 200]).unwrap();
    (errno, u32::from_le_bytes(mem[200..204].try_into().unwrap()))
}

#[test]
fn stdout_bytes_are_written_and_counted() {
    let out = Buf::default();
    let mut c = ctx(vec![], FakeClock::default(), out.clone(), Arc::default());
    let mut mem = vec![0u8; 1024];
    assert_eq!(write_stdout(&mut c, &mut mem, "hello\n"), (0, 6));
    assert_eq!(&out.0.lock().unwrap()[..], b"hello\n");
    assert_eq!(c.stdout_bytes, 6);
    // An iovec pointing outside memory is EFAULT, not a crash.
    mem[0..4].copy_from_slice(&5000u32.to_le_bytes());
    assert_eq!(
        c.call("fd_write", &mut mem, &[1, 0, 1, 200]).unwrap(),
        Errno::Fault as i32
    );
}

/// A terminal that has hung up: every write fails with `EIO`.
struct HungUp;

impl Write for HungUp {
    fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
        Err(std::io::Error::from_raw_os_error(libc::EIO))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a guest writes to a terminal that hung up (while the suspend the hangup asks for is
/// on its way) is kept, carried by the snapshot and shown first after the resume, before
/// anything the guest writes next: no line is lost.
#[test]
fn output_refused_by_a_hung_up_terminal_is_shown_after_the_resume() {
    let write = |c: &mut WasiCtx, text: &str| {
        let done = write_stdout(c, &mut [0u8; 1024], text);
        assert_eq!(done, (0, text.len() as u32), "taken as written");
    };
    let mut stdio = stdio_to(Box::new(HungUp));
    stdio.terminals = [true; 3];
    let mut c = with_stdio(stdio, Arc::new(|| false));
    write(&mut c, "round 19\n");
    write(&mut c, "round 20\n");
    assert_eq!(c.stdout_bytes, 0, "nothing was shown");
    let state = c.capture(&[], &ferry_store::MemStore::new()).unwrap();
    assert_eq!(state.unshown_stdout, b"round 19\nround 20\n");
    let resumed = |state: &ferry_object::WasiState, out: Box<dyn Write + Send>| {
        WasiCtx::restore(
            state,
            vec![],
            stdio_to(out),
            Box::new(FakeClock::default()),
            Arc::new(|| false),
            &ferry_store::MemStore::new(),
        )
    };
    let out = Buf::default();
    let mut r = resumed(&state, Box::new(out.clone())).unwrap();
    write(&mut r, "round 21\n");
    assert_eq!(
        &out.0.lock().unwrap()[..],
        b"round 19\nround 20\nround 21\n"
    );
    assert_eq!(r.stdout_bytes, 27);
    // A guest that ends before writing again still shows it.
    let out = Buf::default();
    let mut r = resumed(&state, Box::new(out.clone())).unwrap();
    r.flush();
    assert_eq!(&out.0.lock().unwrap()[..], b"round 19\nround 20\n");
    // A snapshot from elsewhere claiming more than ferry keeps is refused.
    let mut big = state.clone();
    big.unshown_stderr = vec![b'x'; (1 << 20) + 1];
    let refused = resumed(&big, Box::new(std::io::sink()));
    assert!(refused.unwrap_err().contains("not yet shown"));
    // Not a terminal: the error is the guest's, as before.
    let mut c = ctx(vec![], FakeClock::default(), Buf::default(), Arc::default());
    c.stdio.stdout = Box::new(HungUp);
    let (errno, _) = write_stdout(&mut c, &mut [0u8; 1024], "x");
    assert_eq!(errno, Errno::Io as i32);
}

#[test]
fn monotonic_clock_continues_across_capture_and_restore() {
    let clock = FakeClock::default();
    clock.0.store(5_000_000_000, Ordering::SeqCst);
    let mut c = ctx(vec![], clock.clone(), Buf::default(), Arc::default());
    clock.0.store(9_000_000_000, Ordering::SeqCst);
    let state = c.capture(&[], &ferry_store::MemStore::new()).unwrap();
    assert_eq!(state.monotonic_ns, 9_000_000_000, "captured virtual time");
    // The new host's monotonic clock is far behind: the guest's must not go back.
    let fresh = FakeClock::default();
    let mut r = WasiCtx::restore(
        &state,
        vec![],
        stdio_to(Box::new(std::io::sink())),
        Box::new(fresh.clone()),
        Arc::new(|| false),
        &ferry_store::MemStore::new(),
    )
    .unwrap();
    let mut mem = vec![0u8; 64];
    assert_eq!(r.call("clock_time_get", &mut mem, &[1, 0, 8]).unwrap(), 0);
    assert_eq!(
        u64::from_le_bytes(mem[8..16].try_into().unwrap()),
        9_000_000_000
    );
    fresh.0.store(10, Ordering::SeqCst);
    assert_eq!(r.call("clock_time_get", &mut mem, &[1, 0, 8]).unwrap(), 0);
    assert_eq!(
        u64::from_le_bytes(mem[8..16].try_into().unwrap()),
        9_000_000_010
    );
}

/// Guest memory holding one relative clock subscription of 1 s at address 0 (for
/// `poll_oneoff(0, 100, 1, 300)`: events at 100, their count at 300).
fn one_second_sleep() -> Vec<u8> {
    let mut mem = vec![0u8; 512];
    mem[8] = 0;
    mem[16..20].copy_from_slice(&1u32.to_le_bytes());
    mem[24..32].copy_from_slice(&1_000_000_000u64.to_le_bytes());
    mem
}

#[test]
fn a_sleep_interrupted_by_a_suspend_keeps_its_deadline() {
    let clock = FakeClock::default();
    let interrupt = Arc::new(AtomicBool::new(true));
    let mut c = ctx(vec![], clock.clone(), Buf::default(), interrupt.clone());
    let mut mem = one_second_sleep();
    let r = c.call("poll_oneoff", &mut mem, &[0, 100, 1, 300]);
    assert!(matches!(r, Err(HostError::Unwind)));
    assert_eq!(c.sleep_deadline, Some(1_000_000_000));
    // Rewound into the same call 0.9 s later (virtual): it sleeps only what is left.
    interrupt.store(false, Ordering::SeqCst);
    clock.0.store(1_000_000_000, Ordering::SeqCst);
    c.rewinding = true;
    assert_eq!(
        c.call("poll_oneoff", &mut mem, &[0, 100, 1, 300]).unwrap(),
        0
    );
    assert_eq!(u32::from_le_bytes(mem[300..304].try_into().unwrap()), 1);
    assert_eq!(c.sleep_deadline, None);
}

/// A sleep re-entered by a rewind (after a resume or a checkpoint) still answers a new
/// suspend request at once, keeping its deadline. (It used to ignore requests until the
/// sleep ended: a guest resumed into `sleep(3600)` could not be suspended for an hour.)
#[test]
fn a_rewound_sleep_can_be_suspended_again() {
    let clock = FakeClock::default();
    let interrupt = Arc::new(AtomicBool::new(false));
    let mut c = ctx(vec![], clock.clone(), Buf::default(), interrupt.clone());
    let mut mem = one_second_sleep();
    c.sleep_deadline = Some(1_000_000_000);
    c.rewinding = true;
    interrupt.store(true, Ordering::SeqCst);
    // Were the request ignored, the sleep would end when this moves the clock past it.
    let mover = {
        let clock = clock.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(500));
            clock.0.store(2_000_000_000, Ordering::SeqCst);
        })
    };
    let r = c.call("poll_oneoff", &mut mem, &[0, 100, 1, 300]);
    assert!(matches!(r, Err(HostError::Unwind)), "{r:?}");
    assert_eq!(
        c.sleep_deadline,
        Some(1_000_000_000),
        "the deadline is kept"
    );
    mover.join().unwrap();
}

/// Stdio whose stdin is the read end of a new pipe (stdout and stderr nowhere), and the
/// pipe's write end, the caller's to close.
fn stdin_from_a_pipe() -> (Stdio, i32) {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: a new pipe.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let stdio = Stdio {
        // SAFETY: the pipe's read end, owned from here on.
        stdin: Box::new(unsafe { std::fs::File::from_raw_fd(fds[0]) }),
        stdin_fd: Some(fds[0]),
        terminals: [false; 3],
        log: None,
        input: None,
        input_log: None,
        stdout: Box::new(std::io::sink()),
        stderr: Box::new(std::io::sink()),
    };
    (stdio, fds[1])
}

/// A signal landing on the guest's thread while it waits for stdin (the very SIGINT that asks
/// for a suspend may) is not input: the wait goes on and the suspend is served. (It used to
/// be taken for input: a read then blocked until input or end of file came, and the snapshot
/// held what that read returned.)
#[test]
fn a_signal_during_a_stdin_wait_is_not_input() {
    extern "C" fn ignore(_: libc::c_int) {}
    // SAFETY: a handler that does nothing, installed without SA_RESTART.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = ignore as extern "C" fn(libc::c_int) as usize;
        assert_eq!(libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut()), 0);
    }
    let (stdio, write_end) = stdin_from_a_pipe();
    let interrupt = Arc::new(AtomicBool::new(false));
    let flag = interrupt.clone();
    let mut c = with_stdio(stdio, Arc::new(move || flag.load(Ordering::SeqCst)));
    // SAFETY: this thread's own id.
    let me = unsafe { libc::pthread_self() };
    let flag = interrupt.clone();
    let helper = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        // SAFETY: signals a live thread (the test waits for this one before returning).
        unsafe { libc::pthread_kill(me, libc::SIGUSR2) };
        std::thread::sleep(std::time::Duration::from_millis(50));
        flag.store(true, Ordering::SeqCst);
        // Input never comes; the pipe closes much later.
        std::thread::sleep(std::time::Duration::from_secs(2));
        // SAFETY: the write end, owned by this thread.
        unsafe { libc::close(write_end) };
    });
    let mut mem = vec![0u8; 128];
    // One iovec at 0: 16 bytes at 64; the count goes to 32.
    mem[0..4].copy_from_slice(&64u32.to_le_bytes());
    mem[4..8].copy_from_slice(&16u32.to_le_bytes());
    let started = std::time::Instant::now();
    let r = c.call("fd_read", &mut mem, &[0, 0, 1, 32]);
    assert!(matches!(r, Err(HostError::Unwind)), "{r:?}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(1),
        "waited {:?} for input that was never coming",
        started.elapsed()
    );
    helper.join().unwrap();
}

/// Reads up to 16 bytes of stdin with `fd_read` (one iovec at 0 pointing at 64; the count
/// to 32): what it read.
fn read_stdin(c: &mut WasiCtx, mem: &mut [u8]) -> Result<Vec<u8>, HostError> {
    mem[0..4].copy_from_slice(&64u32.to_le_bytes());
    mem[4..8].copy_from_slice(&16u32.to_le_bytes());
    assert_eq!(
        c.call("fd_read", mem, &[0, 0, 1, 32])?,
        Errno::Success as i32
    );
    let n = u32::from_le_bytes(mem[32..36].try_into().unwrap()) as usize;
    Ok(mem[64..64 + n].to_vec())
}

/// Input sent while the guest runs: a read waits for it and can be suspended while it does;
/// the snapshot carries all input so far, read or not, and that more may come; the restored
/// guest reads on from where it was, waits for the rest, and sees the end once it is sent.
#[test]
fn input_sent_while_the_guest_runs_goes_with_its_snapshot() {
    use crate::InputLog;
    let store = ferry_store::MemStore::new();
    let log = InputLog::new(b"first\n".to_vec(), false);
    let interrupt = Arc::new(AtomicBool::new(false));
    let flag = interrupt.clone();
    let stdio = stdio_to(Box::new(std::io::sink())).with_input_log(log.clone(), None, 0);
    let mut c = with_stdio(stdio, Arc::new(move || flag.load(Ordering::SeqCst)));
    let mut mem = vec![0u8; 128];
    assert_eq!(read_stdin(&mut c, &mut mem).unwrap(), b"first\n");
    // Nothing more yet: the read waits, and a suspend asked for meanwhile unwinds it.
    let flag = interrupt.clone();
    let asker = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        flag.store(true, Ordering::SeqCst);
    });
    let r = read_stdin(&mut c, &mut mem);
    assert!(matches!(r, Err(HostError::Unwind)), "{r:?}");
    asker.join().unwrap();
    // Sent after the guest last read, before the snapshot: carried unread.
    log.append(None, b"second\n", false, |_, _| {
        Ok::<(), crate::InputError>(())
    })
    .unwrap();
    let state = c.capture(&[], &store).unwrap();
    assert!(state.stdin_open);
    assert_eq!(state.stdin_bytes, 6);
    let k = state.stdin_input.expect("the input travels as a blob");
    assert_eq!(
        ferry_store::Store::get(&store, &k).unwrap(),
        b"first\nsecond\n"
    );

    // Restored without the input: refused, saying why.
    let refused = WasiCtx::restore(
        &state,
        vec![],
        stdio_to(Box::new(std::io::sink())),
        Box::new(FakeClock::default()),
        Arc::new(|| false),
        &store,
    )
    .unwrap_err();
    assert!(refused.contains("input sent to its session"), "{refused}");

    // Restored with a log holding that blob: reads on from byte 6, then waits for more.
    let again = InputLog::new(ferry_store::Store::get(&store, &k).unwrap(), false);
    let stdio = stdio_to(Box::new(std::io::sink())).with_input_log(
        again.clone(),
        Some(crate::StoredInput::blob(k)),
        state.stdin_bytes,
    );
    let mut r = WasiCtx::restore(
        &state,
        vec![],
        stdio,
        Box::new(FakeClock::default()),
        Arc::new(|| false),
        &store,
    )
    .unwrap();
    assert_eq!(read_stdin(&mut r, &mut mem).unwrap(), b"second\n");
    let sender = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(30));
        again
            .append(None, b"third", true, |_, _| Ok::<(), crate::InputError>(()))
            .unwrap();
    });
    assert_eq!(read_stdin(&mut r, &mut mem).unwrap(), b"third");
    assert_eq!(read_stdin(&mut r, &mut mem).unwrap(), b"", "then its end");
    sender.join().unwrap();
    let state = r.capture(&[], &store).unwrap();
    assert!(!state.stdin_open, "an ended input is carried as ended");
    assert_eq!(state.stdin_bytes, 18);
}

/// A context with `dir` mounted (read-write, carried) at `/data`, as fd 3.
fn mounted_at_data(dir: &std::path::Path) -> WasiCtx {
    let m = MountSpec {
        guest_path: "/data".into(),
        host_dir: dir.into(),
        read_only: false,
        host_bound: false,
    };
    ctx(
        vec![m],
        FakeClock::default(),
        Buf::default(),
        Arc::default(),
    )
}

/// Setting times without `LOOKUP_FOLLOW` sets a symlink's own, not its target's; linking
/// through a link that leads nowhere finds no file (the official suite's `symlink_filestat`
/// and `path_link`).
#[test]
fn symlinks_themselves_and_what_they_lead_to() {
    use std::os::unix::fs::MetadataExt;
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("file"), "x").unwrap();
    std::os::unix::fs::symlink("file", d.path().join("link")).unwrap();
    std::os::unix::fs::symlink("nowhere", d.path().join("dangling")).unwrap();
    let mut c = mounted_at_data(d.path());
    let mut mem = vec![0u8; 4096];
    let file_mtime = std::fs::metadata(d.path().join("file")).unwrap().mtime();
    let (p, n) = put_str(&mut mem, 100, "link");
    // path_filestat_set_times(fd 3, no follow, "link", atim 0, mtim 1e9 ns, MTIM)
    let r = c.call(
        "path_filestat_set_times",
        &mut mem,
        &[3, 0, p, n, 0, 1_000_000_000, 4],
    );
    assert_eq!(r.unwrap(), 0);
    let link = std::fs::symlink_metadata(d.path().join("link")).unwrap();
    assert_eq!(link.mtime(), 1, "the link's own time");
    assert_eq!(
        std::fs::metadata(d.path().join("file")).unwrap().mtime(),
        file_mtime,
        "its target untouched"
    );
    // path_link(fd 3, follow, "dangling", fd 3, "new")
    let (p, n) = put_str(&mut mem, 100, "dangling");
    let (q, k) = put_str(&mut mem, 200, "new");
    let r = c.call("path_link", &mut mem, &[3, 1, p, n, 3, q, k]);
    assert_eq!(r.unwrap(), Errno::Noent as i32);
    assert!(std::fs::symlink_metadata(d.path().join("new")).is_err());
}

/// `path_symlink` makes a link whose relative target stays inside the mount, at the mount's
/// top level too (it used to refuse `lnk -> sub` there as climbing out: `ENOTCAPABLE`), and
/// refuses one climbing out (`ENOTCAPABLE`) or absolute (`EPERM`).
#[test]
fn symlinks_the_guest_makes_stay_in_the_mount() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("sub")).unwrap();
    let mut c = mounted_at_data(d.path());
    let mut mem = vec![0u8; 4096];
    for (target, link, want) in [
        ("sub", "lnk", Errno::Success),
        ("x.txt", "sub/l2", Errno::Success),
        ("../sub", "sub/l3", Errno::Success),
        ("./sub/../sub", "l4", Errno::Success),
        ("../outside", "l5", Errno::Notcapable),
        ("../../outside", "sub/l6", Errno::Notcapable),
        ("/etc", "l7", Errno::Perm),
    ] {
        let (t, tl) = put_str(&mut mem, 100, target);
        let (p, n) = put_str(&mut mem, 200, link);
        // path_symlink(target, fd 3, link)
        let r = c.call("path_symlink", &mut mem, &[t, tl, 3, p, n]).unwrap();
        assert_eq!(r, want as i32, "{link} -> {target}");
        let made = std::fs::read_link(d.path().join(link));
        assert_eq!(made.is_ok(), want == Errno::Success, "{link}");
    }
    assert_eq!(
        std::fs::read_link(d.path().join("lnk")).unwrap(),
        std::path::Path::new("sub")
    );
}

#[test]
fn files_in_a_mount_and_no_way_out() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("in.txt"), "contents").unwrap();
    let mut c = mounted_at_data(d.path());
    let mut mem = vec![0u8; 4096];
    let (p, n) = put_str(&mut mem, 100, "in.txt");
    // path_open(fd 3, follow, path, oflags 0, rights read, 0, fdflags 0, out)
    assert_eq!(
        c.call("path_open", &mut mem, &[3, 1, p, n, 0, 2, 0, 0, 200])
            .unwrap(),
        0
    );
    let fd = u32::from_le_bytes(mem[200..204].try_into().unwrap()) as i64;
    mem[0..4].copy_from_slice(&1000u32.to_le_bytes());
    mem[4..8].copy_from_slice(&100u32.to_le_bytes());
    assert_eq!(c.call("fd_read", &mut mem, &[fd, 0, 1, 300]).unwrap(), 0);
    assert_eq!(&mem[1000..1008], b"contents");
    for escape in ["../outside", "/etc/passwd", "a/../../x"] {
        let (p, n) = put_str(&mut mem, 2000, escape);
        let r = c
            .call("path_open", &mut mem, &[3, 1, p, n, 0, 2, 0, 0, 200])
            .unwrap();
        assert_eq!(r, Errno::Notcapable as i32, "{escape}");
    }
    // Sockets are never granted: no descriptor is one.
    assert_eq!(
        c.call("sock_accept", &mut mem, &[3, 0, 0]).unwrap(),
        Errno::Notsock as i32
    );
    assert_eq!(
        c.call("sock_shutdown", &mut mem, &[99, 0]).unwrap(),
        Errno::Badf as i32
    );
    // The capture names the file's offset; a restore reopens it there.
    let state = c
        .capture(
            &[ferry_kappa::Kappa::of(b"tree")],
            &ferry_store::MemStore::new(),
        )
        .unwrap();
    let f = fd_state(&state, fd);
    assert_eq!((f.path.as_str(), f.offset), ("in.txt", 8));
}

/// What a captured state records of descriptor `fd`.
fn fd_state(state: &ferry_object::WasiState, fd: i64) -> &ferry_object::FdState {
    &state
        .fds
        .iter()
        .find(|(n, _)| i64::from(*n) == fd)
        .expect("the fd is captured")
        .1
}

/// A file ferry has just written itself from a stored object (a runtime's standard library)
/// is known at once: even the first import after it (a fresh file, its times not settled)
/// does not read it, and the tree is the same as a reading import's.
#[test]
fn a_file_ferry_wrote_itself_is_not_read_again() {
    use crate::tree::{ImportCache, import, import_cached};
    let store = ferry_store::MemStore::new();
    let dir = tempfile::tempdir().unwrap();
    for len in [50_000, (3 << 20) + 7] {
        let zip: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::write(dir.path().join("python315.zip"), &zip).unwrap();
        let mut cache = ImportCache::default();
        cache
            .remember_written(&store, &dir.path().join("python315.zip"), &zip)
            .unwrap();
        let tree =
            import_cached(&store, &dir.path().canonicalize().unwrap(), &mut cache, &[]).unwrap();
        assert_eq!(cache.files_read(), 0, "{len} bytes");
        assert_eq!(tree, import(&store, dir.path()).unwrap(), "{len} bytes");
    }
}

#[test]
fn a_cached_import_reads_only_files_that_changed() {
    use crate::tree::{ImportCache, import, import_cached};
    let store = ferry_store::MemStore::new();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    std::fs::write(dir.path().join("a.txt"), b"first").unwrap();
    std::fs::write(dir.path().join("sub/b.bin"), vec![7; 100_000]).unwrap();

    let mut cache = ImportCache::trusting_recent_files();
    let k1 = import_cached(&store, dir.path(), &mut cache, &[]).unwrap();
    assert_eq!(
        k1,
        import(&store, dir.path()).unwrap(),
        "same tree as uncached"
    );
    assert_eq!(cache.files_read(), 2);
    assert_eq!(
        import_cached(&store, dir.path(), &mut cache, &[]).unwrap(),
        k1
    );
    assert_eq!(cache.files_read(), 2, "nothing changed: nothing read");

    // Same length, new content: the times differ, so it is read again. (The modification
    // time is set apart explicitly: this cache trusts even files written within the same
    // timestamp tick, which the default one does not.)
    std::fs::write(dir.path().join("a.txt"), b"other").unwrap();
    std::fs::File::options()
        .write(true)
        .open(dir.path().join("a.txt"))
        .unwrap()
        .set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
        .unwrap();
    let k2 = import_cached(&store, dir.path(), &mut cache, &[]).unwrap();
    assert_eq!(cache.files_read(), 3);
    assert_ne!(k2, k1);
    assert_eq!(k2, import(&store, dir.path()).unwrap());

    // A file written just now is trusted by the default cache only where any later change
    // is sure to give it a later time (multigrain timestamps); elsewhere it is read every
    // time until its times are 2 s old.
    let mut cautious = ImportCache::default();
    import_cached(&store, dir.path(), &mut cautious, &[]).unwrap();
    import_cached(&store, dir.path(), &mut cautious, &[]).unwrap();
    let fine = crate::tree::fine_grained_times(dir.path());
    assert_eq!(cautious.files_read(), if fine { 2 } else { 4 });
    if fine {
        // A write at once after each import is still seen: same length, within the same
        // tick as the import's `stat`.
        for i in 0..200u32 {
            std::fs::write(dir.path().join("a.txt"), format!("{:05}", i % 100_000)).unwrap();
            let k = import_cached(&store, dir.path(), &mut cautious, &[]).unwrap();
            assert_eq!(cautious.files_read(), 3 + u64::from(i), "write {i} unseen");
            assert_eq!(k, import(&store, dir.path()).unwrap());
        }
    }
}

/// What one run's cache remembers survives encoding: a later run that starts from it reads
/// nothing unchanged, and reads a file that changed since. Bytes that are not a saved cache
/// decode to nothing, without panicking.
#[test]
fn a_saved_import_cache_spares_the_next_run_its_reads() {
    use crate::tree::{ImportCache, import_cached};
    let store = ferry_store::MemStore::new();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    std::fs::write(root.join("lib.zip"), vec![1; 200_000]).unwrap();
    std::fs::write(root.join("data.txt"), b"v1").unwrap();
    let mut first = ImportCache::trusting_recent_files();
    let k = import_cached(&store, &root, &mut first, &[]).unwrap();
    assert_eq!(first.files_read(), 2);
    let saved = first.encode();

    let mut next = ImportCache::decode(&saved).expect("a saved cache");
    assert_eq!(import_cached(&store, &root, &mut next, &[]).unwrap(), k);
    assert_eq!(next.files_read(), 0, "unchanged files are not read again");
    std::fs::write(root.join("data.txt"), b"v2").unwrap();
    let mut after = ImportCache::decode(&saved).unwrap();
    assert_ne!(import_cached(&store, &root, &mut after, &[]).unwrap(), k);
    assert_eq!(after.files_read(), 1, "only the changed file is read");

    // What a resume compares: the same κ, nothing stored, unchanged files not read.
    let mut probe = ImportCache::decode(&saved).unwrap();
    let stored = ferry_store::Store::list(&store).unwrap().len();
    let now = crate::tree::tree_kappa(&store, &root, &mut probe, &[]).unwrap();
    assert_eq!(
        now,
        import_cached(&store, &root, &mut ImportCache::default(), &[]).unwrap()
    );
    assert_eq!(probe.files_read(), 1, "only the changed file is read");
    std::fs::write(root.join("data.txt"), b"v3").unwrap();
    let mut probe = ImportCache::decode(&saved).unwrap();
    let before = ferry_store::Store::list(&store).unwrap().len();
    assert_ne!(
        crate::tree::tree_kappa(&store, &root, &mut probe, &[]).unwrap(),
        now
    );
    assert_eq!(
        ferry_store::Store::list(&store).unwrap().len(),
        before,
        "nothing stored"
    );
    assert!(stored <= before);

    assert!(ImportCache::decode(b"").is_none());
    assert!(ImportCache::decode(&saved[..saved.len() - 1]).is_none());
    let mut longer = saved.clone();
    longer.push(0);
    assert!(ImportCache::decode(&longer).is_none());
    let mut other_version = saved.clone();
    other_version[8] = 1;
    assert!(ImportCache::decode(&other_version).is_none());
}

proptest::proptest! {
    #[test]
    fn arbitrary_bytes_never_make_an_import_cache_panic(
        data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)
    ) {
        let _ = crate::tree::ImportCache::decode(&data);
        let mut framed = b"FERRYIMC\x02\x00\x00\x00".to_vec();
        framed.extend_from_slice(&data);
        let _ = crate::tree::ImportCache::decode(&framed);
    }
}

#[test]
fn a_mounted_file_over_the_limit_is_refused_before_it_is_read() {
    let store = ferry_store::MemStore::new();
    let dir = tempfile::tempdir().unwrap();
    let f = std::fs::File::create(dir.path().join("huge.bin")).unwrap();
    f.set_len(crate::tree::MAX_FILE + 1).unwrap(); // sparse: no disk, no memory
    let e = crate::tree::import(&store, dir.path()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("huge.bin")
            && msg.contains(&format!("{}-byte file", crate::tree::MAX_FILE + 1)),
        "{msg}"
    );
    assert!(
        ferry_store::Store::list(&store).unwrap().is_empty(),
        "nothing stored"
    );
}

/// A file over [`crate::tree::MAX_BLOB_FILE`] is stored as 1 MiB chunks (a version 2 tree, the
/// zeros one object), hashes to the same tree without being stored (what a resume compares),
/// and comes back byte for byte, sparse where it was zeros.
#[test]
fn a_file_over_a_mib_is_stored_in_chunks_and_comes_back_whole() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let store = ferry_store::MemStore::new();
    let dir = tempfile::tempdir().unwrap();
    let len = (24 << 20) + 5;
    let marks: [(u64, &[u8]); 3] = [(0, b"start"), (len / 2, b"middle"), (len - 3, b"end")];
    let f = std::fs::File::create(dir.path().join("big.bin")).unwrap();
    f.set_len(len).unwrap();
    for (at, bytes) in marks {
        f.write_all_at(bytes, at).unwrap();
    }
    std::fs::write(dir.path().join("small.txt"), "small").unwrap();
    let k = crate::tree::import(&store, dir.path()).unwrap();
    let tree: ferry_object::Tree =
        ferry_object::decode(&ferry_store::Store::get(&store, &k).unwrap()).unwrap();
    assert_eq!(tree.v, 3, "chunked, with times");
    assert_eq!(tree.entries["big.bin"].mode, ferry_object::MODE_FILE_CHUNKS);
    assert_eq!(tree.entries["small.txt"].mode, ferry_object::MODE_FILE);
    let file: ferry_object::FileChunks = ferry_object::decode(
        &ferry_store::Store::get(&store, &tree.entries["big.bin"].object).unwrap(),
    )
    .unwrap();
    assert_eq!((file.len, file.chunks.len()), (len, 25));
    // Zeros, three marked chunks, the short last one, the FileChunks, the blob and the tree.
    let objects = ferry_store::Store::list(&store).unwrap().len();
    assert!(objects <= 8, "{objects} objects");
    let mut cache = crate::tree::ImportCache::default();
    assert_eq!(
        crate::tree::tree_kappa(&ferry_store::MemStore::new(), dir.path(), &mut cache, &[])
            .unwrap(),
        k
    );
    let back = tempfile::tempdir().unwrap();
    crate::tree::materialize(&store, &k, back.path()).unwrap();
    let b = std::fs::File::open(back.path().join("big.bin")).unwrap();
    assert_eq!(b.metadata().unwrap().len(), len);
    assert!(b.metadata().unwrap().blocks() * 512 < 8 << 20, "holes kept");
    for (at, bytes) in marks {
        let mut got = vec![0u8; bytes.len()];
        b.read_exact_at(&mut got, at).unwrap();
        assert_eq!(got, bytes);
    }
    assert_eq!(crate::tree::import(&store, back.path()).unwrap(), k);
}

/// A big file changed in one place costs the next snapshot one new piece, not the file
/// again; a snapshot taken when files up to 1 GiB were one blob still matches its unchanged
/// directory, and no longer once the directory changes.
#[test]
fn a_big_file_changed_in_one_place_stores_one_piece_and_older_trees_still_match() {
    use crate::tree::{ImportCache, import_cached, matches_tree, tree_kappa};
    use std::os::unix::fs::FileExt;
    let store = ferry_store::MemStore::new();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let big: Vec<u8> = (0..40u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    std::fs::write(root.join("db.bin"), &big).unwrap();
    std::fs::write(root.join("small.txt"), "small").unwrap();
    let first = import_cached(&store, &root, &mut ImportCache::default(), &[]).unwrap();
    let bytes = |s: &ferry_store::MemStore| -> u64 {
        let st: &dyn ferry_store::Store = s;
        st.list()
            .unwrap()
            .iter()
            .map(|k| st.get(k).unwrap().len() as u64)
            .sum()
    };
    let before = bytes(&store);
    assert!(before >= 40 << 20, "{before}");
    std::fs::File::options()
        .write(true)
        .open(root.join("db.bin"))
        .unwrap()
        .write_all_at(b"changed", 17 << 20)
        .unwrap();
    let second = import_cached(&store, &root, &mut ImportCache::default(), &[]).unwrap();
    assert_ne!(second, first);
    let added = bytes(&store) - before;
    assert!(
        added > 1 << 20 && added < (1 << 20) + 8192,
        "one 1 MiB piece, the piece list and the tree: {added} bytes"
    );

    // The older form: the same directory hashed as ferry before 2026-12-03 stored it.
    let mut older = ImportCache::default().in_legacy_form();
    let legacy = tree_kappa(&store, &root, &mut older, &[]).unwrap();
    assert_ne!(legacy, second, "one blob, not pieces");
    let tree: ferry_object::Tree = ferry_object::decode(
        &crate::tree::import_cached(
            &store,
            &root,
            &mut ImportCache::default().in_legacy_form(),
            &[],
        )
        .map(|k| ferry_store::Store::get(&store, &k).unwrap())
        .unwrap(),
    )
    .unwrap();
    assert_eq!((tree.v, tree.entries["db.bin"].mode.as_str()), (1, "file"));
    let mut cache = ImportCache::default();
    assert!(matches_tree(&store, &root, &mut cache, &[], &second).unwrap());
    assert!(matches_tree(&store, &root, &mut cache, &[], &legacy).unwrap());
    assert!(!matches_tree(&store, &root, &mut cache, &[], &first).unwrap());
    std::fs::write(root.join("small.txt"), "changed").unwrap();
    assert!(!matches_tree(&store, &root, &mut cache, &[], &legacy).unwrap());
}

/// A tree written back into a directory is known to the next import without reading it
/// (the same tree), and a write to one of its files at once after, of the same length, is
/// still seen. A blob over 1 MiB from an older tree is not remembered (its κ is not what an
/// import gives now). (Whether a write in the same coarse timestamp tick would be seen
/// without the back-dating cannot be tested here: this kernel's ext4 gives a change after
/// a `stat` a fine-grained time.)
#[test]
fn files_written_back_are_known_without_reading_and_a_later_write_is_still_seen() {
    use crate::tree::{ImportCache, import, import_cached, materialize, remember_tree};
    use std::os::unix::fs::FileExt;
    let store = ferry_store::MemStore::new();
    let src = tempfile::tempdir().unwrap();
    std::fs::create_dir(src.path().join("sub")).unwrap();
    std::fs::write(src.path().join("a.txt"), "first").unwrap();
    let big: Vec<u8> = (0..(3u32 << 20) + 5).map(|i| (i % 253) as u8).collect();
    std::fs::write(src.path().join("sub/big.bin"), &big).unwrap();
    std::os::unix::fs::symlink("a.txt", src.path().join("link")).unwrap();
    // Times the tree carries, settled (a recent one is trusted only with multigrain times).
    let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    for f in ["a.txt", "sub/big.bin"] {
        set_modified(&src.path().join(f), hour_ago);
    }
    let k = import(&store, src.path()).unwrap();

    let back = tempfile::tempdir().unwrap();
    let root = back.path().join("data");
    let mut cache = ImportCache::default();
    materialize(&store, &k, &root).unwrap();
    assert_eq!(remember_tree(&store, &k, &root, &mut cache).unwrap(), 2);
    let root = root.canonicalize().unwrap();
    let mut next = ImportCache::decode(&cache.encode()).unwrap();
    assert_eq!(import_cached(&store, &root, &mut next, &[]).unwrap(), k);
    assert_eq!(next.files_read(), 0, "nothing read");
    std::fs::File::options()
        .write(true)
        .open(root.join("sub/big.bin"))
        .unwrap()
        .write_all_at(b"x", 2 << 20)
        .unwrap();
    let mut next = ImportCache::decode(&cache.encode()).unwrap();
    let changed = import_cached(&store, &root, &mut next, &[]).unwrap();
    assert_eq!(next.files_read(), 1, "the written file is read");
    assert_ne!(changed, k);
    assert_eq!(changed, import(&store, &root).unwrap());

    // A tree of the older form: the big file one blob.
    let legacy = import_cached(
        &store,
        &src.path().canonicalize().unwrap(),
        &mut ImportCache::default().in_legacy_form(),
        &[],
    )
    .unwrap();
    let again = tempfile::tempdir().unwrap();
    let mut cache = ImportCache::default();
    materialize(&store, &legacy, again.path()).unwrap();
    assert_eq!(
        remember_tree(&store, &legacy, again.path(), &mut cache).unwrap(),
        1,
        "only the small file"
    );
    let mut next = ImportCache::decode(&cache.encode()).unwrap();
    let again = again.path().canonicalize().unwrap();
    assert_eq!(
        import_cached(&store, &again, &mut next, &[]).unwrap(),
        import(&store, &again).unwrap(),
        "today's form"
    );
    assert_eq!(next.files_read(), 1);
}

/// Gives the file at `p` the modification time `t`.
fn set_modified(p: &std::path::Path, t: std::time::SystemTime) {
    std::fs::File::options()
        .write(true)
        .open(p)
        .unwrap()
        .set_times(std::fs::FileTimes::new().set_modified(t))
        .unwrap()
}

/// What changed in a directory since its tree, as a refused resume shows it: files changed
/// (content or executable bit), missing and added, in nested directories too, a few named
/// and all counted; nothing for an unchanged directory, in today's form or an older one.
#[test]
fn the_differences_from_a_tree_are_named() {
    use crate::tree::{ImportCache, differences, import, import_cached};
    use std::os::unix::fs::PermissionsExt;
    let store = ferry_store::MemStore::new();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    std::fs::create_dir(root.join("sub")).unwrap();
    std::fs::write(root.join("a.txt"), "a").unwrap();
    std::fs::write(root.join("sub/b.txt"), "b").unwrap();
    std::fs::write(root.join("big.bin"), vec![7u8; (3 << 20) + 1]).unwrap();
    std::os::unix::fs::symlink("a.txt", root.join("link")).unwrap();
    let k = import(&store, &root).unwrap();
    let legacy = import_cached(
        &store,
        &root,
        &mut ImportCache::default().in_legacy_form(),
        &[],
    )
    .unwrap();
    let diff = |want, limit| {
        differences(&store, &root, want, &mut ImportCache::default(), &[], limit).unwrap()
    };
    assert_eq!(diff(&k, 5), (vec![], 0));
    assert_eq!(diff(&legacy, 5), (vec![], 0));

    std::fs::remove_file(root.join("a.txt")).unwrap();
    std::fs::write(root.join("sub/b.txt"), "B").unwrap();
    std::fs::set_permissions(root.join("big.bin"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(root.join("new.txt"), "new").unwrap();
    let all = vec![
        "`a.txt` missing".to_owned(),
        "`big.bin` changed".to_owned(),
        "`sub/b.txt` changed".to_owned(),
        "`new.txt` added".to_owned(),
    ];
    assert_eq!(diff(&k, 5), (all.clone(), 4));
    assert_eq!(diff(&legacy, 5), (all.clone(), 4));
    assert_eq!(diff(&k, 2), (all[..2].to_vec(), 4));
}

/// A tree carries its files' modification times (to the nanosecond, before 1970 too): a
/// directory written back from it has them, and so the same tree; a file only touched is a
/// difference a resume names; a tree of the form before times (version 1 or 2) still matches
/// its unchanged directory; a file no path names keeps its time too.
#[test]
fn files_keep_their_modification_times() {
    use crate::tree::{
        ImportCache, differences, import, import_unnamed, matches_tree, materialize, open_unnamed,
    };
    use std::os::unix::fs::MetadataExt;
    use std::time::{Duration, UNIX_EPOCH};
    let store = ferry_store::MemStore::new();
    let src = tempfile::tempdir().unwrap();
    let root = src.path().canonicalize().unwrap();
    std::fs::create_dir(root.join("sub")).unwrap();
    let times = [
        (
            "a.txt",
            UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789),
        ),
        ("sub/b.txt", UNIX_EPOCH - Duration::new(86_400, 5)),
        ("big.bin", UNIX_EPOCH + Duration::new(1_000_000_000, 1)),
    ];
    for (name, t) in times {
        let len = if name == "big.bin" { (2 << 20) + 3 } else { 3 };
        std::fs::write(root.join(name), vec![b'x'; len]).unwrap();
        set_modified(&root.join(name), t);
    }
    let mtime = |p: &std::path::Path| {
        let md = std::fs::metadata(p).unwrap();
        (md.mtime(), md.mtime_nsec())
    };
    let k = import(&store, &root).unwrap();
    let tree: ferry_object::Tree =
        ferry_object::decode(&ferry_store::Store::get(&store, &k).unwrap()).unwrap();
    assert_eq!(tree.v, 3);
    assert_eq!(
        tree.entries["a.txt"].mtime_ns,
        Some(1_700_000_000_123_456_789)
    );
    assert_eq!(tree.entries["sub"].mtime_ns, None, "directories carry none");

    let back = tempfile::tempdir().unwrap();
    materialize(&store, &k, back.path()).unwrap();
    for (name, _) in times {
        assert_eq!(
            mtime(&back.path().join(name)),
            mtime(&root.join(name)),
            "{name}"
        );
    }
    assert_eq!(
        mtime(&back.path().join("sub/b.txt")),
        (-86_401, 999_999_995)
    );
    assert_eq!(import(&store, back.path()).unwrap(), k, "the same tree");

    // Only touched: the content is the same, the tree is not.
    let mut cache = ImportCache::default();
    assert!(matches_tree(&store, &root, &mut cache, &[], &k).unwrap());
    let before_times =
        crate::tree::import_cached(&store, &root, &mut cache.without_times(), &[]).unwrap();
    assert_ne!(before_times, k);
    set_modified(
        &root.join("a.txt"),
        UNIX_EPOCH + Duration::from_secs(1_800_000_000),
    );
    let mut cache = ImportCache::default();
    assert!(!matches_tree(&store, &root, &mut cache, &[], &k).unwrap());
    assert!(
        matches_tree(&store, &root, &mut cache, &[], &before_times).unwrap(),
        "a tree without times ignores them"
    );
    let (named, n) = differences(&store, &root, &k, &mut cache, &[], 5).unwrap();
    assert_eq!(
        (named, n),
        (
            vec!["`a.txt` touched (same content, another modification time)".to_owned()],
            1
        )
    );

    // A file no path names.
    let f = std::fs::File::open(root.join("sub/b.txt")).unwrap();
    let u = import_unnamed(&store, &f, "b").unwrap();
    let again = open_unnamed(&store, &u, back.path()).unwrap();
    let md = again.metadata().unwrap();
    assert_eq!((md.mtime(), md.mtime_nsec()), (-86_401, 999_999_995));
}

/// A file with several names in a tree (hard links) is stored once, under its first name in
/// path order; the others name that path, and written back they are names of one file
/// again, giving the same tree. A name changed into a copy is a difference; a tree of the
/// form before links still matches; a link to what the tree does not hold as a file is
/// refused.
#[test]
fn hard_links_come_back_as_one_file() {
    use crate::tree::{ImportCache, differences, import, import_cached, matches_tree, materialize};
    use ferry_object::{MODE_FILE, MODE_LINK, Tree, TreeEntry};
    use std::os::unix::fs::MetadataExt;
    let store = ferry_store::MemStore::new();
    let src = tempfile::tempdir().unwrap();
    let root = src.path().canonicalize().unwrap();
    std::fs::create_dir_all(root.join("a/deep")).unwrap();
    std::fs::write(root.join("b.txt"), "shared").unwrap();
    std::fs::hard_link(root.join("b.txt"), root.join("a/deep/c.txt")).unwrap();
    std::fs::hard_link(root.join("b.txt"), root.join("z.txt")).unwrap();
    std::fs::write(root.join("alone.txt"), "alone").unwrap();
    let k = import(&store, &root).unwrap();
    let get = |k: &ferry_kappa::Kappa| -> Tree {
        ferry_object::decode(&ferry_store::Store::get(&store, k).unwrap()).unwrap()
    };
    let top = get(&k);
    let deep = get(&get(&top.entries["a"].object).entries["deep"].object);
    assert_eq!(
        deep.entries["c.txt"].mode, MODE_FILE,
        "the first name in path order"
    );
    for name in ["b.txt", "z.txt"] {
        assert_eq!(top.entries[name].mode, MODE_LINK, "{name}");
        assert_eq!(
            ferry_store::Store::get(&store, &top.entries[name].object).unwrap(),
            b"a/deep/c.txt"
        );
    }
    assert_eq!((top.v, deep.v), (4, 3));

    let back = tempfile::tempdir().unwrap();
    materialize(&store, &k, back.path()).unwrap();
    let ino = |p: &str| std::fs::metadata(back.path().join(p)).unwrap().ino();
    assert_eq!(ino("b.txt"), ino("a/deep/c.txt"));
    assert_eq!(ino("z.txt"), ino("a/deep/c.txt"));
    assert_ne!(ino("alone.txt"), ino("b.txt"));
    assert_eq!(
        std::fs::metadata(back.path().join("z.txt"))
            .unwrap()
            .nlink(),
        3
    );
    assert_eq!(import(&store, back.path()).unwrap(), k, "the same tree");
    let mut cache = ImportCache::default();
    let before_links = import_cached(&store, &root, &mut cache.without_times(), &[]).unwrap();
    assert!(matches_tree(&store, &root, &mut cache, &[], &before_links).unwrap());

    // A name made a copy of the same content is no longer the same file.
    std::fs::remove_file(back.path().join("z.txt")).unwrap();
    std::fs::write(back.path().join("z.txt"), "shared").unwrap();
    let (named, n) = differences(&store, back.path(), &k, &mut cache, &[], 5).unwrap();
    assert_eq!(
        (named, n),
        (
            vec!["`z.txt` changed (no longer another name of `a/deep/c.txt`)".to_owned()],
            1
        )
    );

    // A link to a path the tree does not hold as a file is refused.
    let bad = |first: &[u8]| {
        let mut entries = std::collections::BTreeMap::new();
        entries.insert(
            "x".to_owned(),
            TreeEntry {
                mode: MODE_LINK.into(),
                object: ferry_store::Store::put(&store, first).unwrap(),
                mtime_ns: None,
            },
        );
        entries.insert(
            "a".to_owned(),
            TreeEntry {
                mode: ferry_object::MODE_DIR.into(),
                object: top.entries["a"].object,
                mtime_ns: None,
            },
        );
        ferry_store::Store::put(
            &store,
            &ferry_object::encode(&Tree {
                kind: "ferry.tree".into(),
                v: 4,
                entries,
            }),
        )
        .unwrap()
    };
    for first in [
        &b"/etc/passwd"[..],
        b"../b.txt",
        b"a/deep",
        b"a/deep/none",
        b"x",
    ] {
        let out = tempfile::tempdir().unwrap();
        let e = materialize(&store, &bad(first), out.path()).unwrap_err();
        assert!(
            e.to_string().contains("which is not a file of the tree"),
            "{}: {e}",
            String::from_utf8_lossy(first)
        );
    }
}

/// Pre-storing a directory stores and remembers its settled files, so an import after it
/// reads none; a file modified just now is left to the import; told to stop, it stores
/// nothing more.
#[test]
fn pre_storing_spares_the_import_its_reads_but_not_a_fresh_file() {
    use crate::tree::{ImportCache, import, import_cached};
    let store = ferry_store::MemStore::new();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    std::fs::create_dir(root.join("sub")).unwrap();
    std::fs::write(root.join("sub/big.bin"), vec![5u8; (3 << 20) + 1]).unwrap();
    std::fs::write(root.join("a.txt"), "a").unwrap();

    let stopped = ImportCache::trusting_recent_files()
        .pre_store(&store, &root, &[], &|| true)
        .unwrap();
    assert!(stopped.is_empty());

    let mut own = ImportCache::trusting_recent_files();
    let found = own.pre_store(&store, &root, &[], &|| false).unwrap();
    assert_eq!(found.len(), 2);
    assert!(
        own.pre_store(&store, &root, &[], &|| false)
            .unwrap()
            .is_empty(),
        "known"
    );
    let mut snapshot = ImportCache::default();
    snapshot.update_from_stored(&found, &store);
    assert_eq!(
        import_cached(&store, &root, &mut snapshot, &[]).unwrap(),
        import(&store, &root).unwrap()
    );
    assert_eq!(snapshot.files_read(), 0);

    // A piece of the big file deleted meanwhile (a prune): that file is not taken, the
    // small one is.
    let pieces = ferry_store::MemStore::new();
    let mut again = ImportCache::trusting_recent_files();
    let found = again.pre_store(&pieces, &root, &[], &|| false).unwrap();
    let piece = ferry_kappa::Kappa::of(&vec![5u8; 1 << 20]);
    ferry_store::Store::remove(&pieces, &piece).unwrap();
    let mut partial = ImportCache::default();
    partial.update_from_stored(&found, &pieces);
    assert_eq!(partial.len(), 1);

    // With the real settling time, files written just now are not pre-stored.
    assert!(
        ImportCache::default()
            .pre_store(&store, &root, &[], &|| false)
            .unwrap()
            .is_empty()
    );
}

/// A tree whose entries do not fit its version, or a chunked file whose chunks do not fit
/// its length, is refused when materialized.
#[test]
fn a_tree_or_chunked_file_that_does_not_add_up_is_refused() {
    use ferry_object::{FileChunks, MODE_FILE_CHUNKS, Tree, TreeEntry};
    let store = ferry_store::MemStore::new();
    let put = |b: &[u8]| ferry_store::Store::put(&store, b).unwrap();
    let (kind, v) = ferry_object::header::<FileChunks>();
    let short = FileChunks {
        kind,
        v,
        len: crate::tree::MAX_BLOB_FILE + 1,
        chunk_size: ferry_object::FILE_CHUNK_SIZE,
        chunks: vec![put(b"x")],
    };
    let file = put(&ferry_object::encode(&short));
    let timed = |v: u32, mode: &str, object, mtime_ns| {
        let mut entries = std::collections::BTreeMap::new();
        entries.insert(
            "f".to_owned(),
            TreeEntry {
                mode: mode.into(),
                object,
                mtime_ns,
            },
        );
        put(&ferry_object::encode(&Tree {
            kind: "ferry.tree".into(),
            v,
            entries,
        }))
    };
    let tree = |v, mode, object| timed(v, mode, object, None);
    let sub = put(&ferry_object::encode(&Tree {
        kind: "ferry.tree".into(),
        v: 1,
        entries: Default::default(),
    }));
    let cases = [
        (
            tree(1, MODE_FILE_CHUNKS, file),
            "which a version 1 tree does not have",
        ),
        (
            tree(2, "file", put(b"x")),
            "whose entries make it version 1",
        ),
        (tree(2, MODE_FILE_CHUNKS, file), "lists 1 chunks, not 2"),
        (
            tree(3, "file", put(b"x")),
            "whose entries make it version 1",
        ),
        (
            timed(2, "file", put(b"x"), Some(7)),
            "whose entries make it version 3",
        ),
        (
            timed(3, "dir", sub, Some(7)),
            "is a dir with a modification time",
        ),
        (
            tree(3, ferry_object::MODE_LINK, put(b"g")),
            "which a version 3 tree does not have",
        ),
        (
            timed(4, ferry_object::MODE_LINK, put(b"g"), Some(7)),
            "is a link with a modification time",
        ),
        (tree(5, "file", put(b"x")), "format version 5"),
    ];
    for (k, why) in cases {
        let out = tempfile::tempdir().unwrap();
        let e = crate::tree::materialize(&store, &k, out.path()).unwrap_err();
        assert!(e.to_string().contains(why), "{e}");
    }
}

/// Files ferry's output went to are left out of a mount's tree and named in the snapshot;
/// a snapshot naming an unsafe path, or too many, is refused.
#[test]
fn files_left_out_of_a_mount() {
    use crate::tree::{ImportCache, import_cached};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    std::fs::create_dir(root.join("sub")).unwrap();
    for f in ["data.txt", "out.txt", "sub/err.txt"] {
        std::fs::write(root.join(f), f).unwrap();
    }
    let mut c = mounted_at_data(&root);
    c.leave_out(&[
        root.join("out.txt"),
        root.join("sub/err.txt"),
        std::path::PathBuf::from("/elsewhere/x.txt"),
    ]);
    let skip = c.not_carried();
    assert_eq!(
        skip,
        vec![vec![root.join("out.txt"), root.join("sub/err.txt")]]
    );
    let store = ferry_store::MemStore::new();
    let with = import_cached(&store, &root, &mut ImportCache::default(), &[]).unwrap();
    let without = import_cached(&store, &root, &mut ImportCache::default(), &skip[0]).unwrap();
    std::fs::remove_file(root.join("out.txt")).unwrap();
    std::fs::remove_file(root.join("sub/err.txt")).unwrap();
    let bare = import_cached(&store, &root, &mut ImportCache::default(), &[]).unwrap();
    assert_ne!(with, without);
    assert_eq!(
        without, bare,
        "the tree is the directory without those files"
    );

    let mut state = c
        .capture(&[without], &ferry_store::MemStore::new())
        .unwrap();
    assert_eq!(state.mounts[0].not_carried, ["out.txt", "sub/err.txt"]);
    let restore = |state: &ferry_object::WasiState| {
        let grant = MountSpec {
            guest_path: "/data".into(),
            host_dir: root.clone(),
            read_only: false,
            host_bound: false,
        };
        WasiCtx::restore(
            state,
            vec![grant],
            stdio_to(Box::new(std::io::sink())),
            Box::new(FakeClock::default()),
            Arc::new(|| false),
            &ferry_store::MemStore::new(),
        )
    };
    let r = restore(&state).unwrap();
    assert_eq!(r.not_carried(), skip, "carried on by the resumed run");
    state.mounts[0].not_carried = vec!["../../etc/passwd".into()];
    let err = restore(&state).unwrap_err();
    assert!(err.contains("unsafe path"), "{err}");
    state.mounts[0].not_carried = (0..17).map(|i| format!("f{i}")).collect();
    let err = restore(&state).unwrap_err();
    assert!(err.contains("at most 16"), "{err}");
}

/// The guest's own changes through `fd`: `fd_pwrite` of `data` at `off` (None: `fd_write` at
/// the file's position). Memory: iovec at 0, data from 1000, count to 200.
fn guest_write(c: &mut WasiCtx, mem: &mut [u8], fd: i64, data: &[u8], off: Option<u64>) {
    mem[1000..1000 + data.len()].copy_from_slice(data);
    mem[0..4].copy_from_slice(&1000u32.to_le_bytes());
    mem[4..8].copy_from_slice(&(data.len() as u32).to_le_bytes());
    let r = match off {
        Some(off) => c.call("fd_pwrite", mem, &[fd, 0, 1, off as i64, 200]),
        None => c.call("fd_write", mem, &[fd, 0, 1, 200]),
    };
    assert_eq!(r.unwrap(), 0);
}

/// Opens `name` in the mount at fd 3 for reading and writing (`fdflags` e.g. append); its fd.
fn open_rw(c: &mut WasiCtx, mem: &mut [u8], name: &str, fdflags: i64) -> i64 {
    let (p, n) = put_str(mem, 100, name);
    // rights: read (2) | write (64) | seek (4)
    let r = c.call(
        "path_open",
        mem,
        &[3, 1, p, n, 0, 2 | 4 | 64, 0, fdflags, 200],
    );
    assert_eq!(r.unwrap(), 0);
    u32::from_le_bytes(mem[200..204].try_into().unwrap()) as i64
}

/// A big file the guest changes in a few places through ferry's WASI is read again only in
/// the pieces it touched, and the tree is the one a full read gives: writes at a position
/// and at an offset, an append, shrinking and growing. A change the guest did not make
/// (another program's) breaks the chain, and the file is read whole again.
#[test]
fn a_big_file_the_guest_changed_is_read_again_only_where_it_changed() {
    use crate::tree::{ImportCache, import, import_cached};
    use std::os::unix::fs::FileExt;
    let store = ferry_store::MemStore::new();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let big: Vec<u8> = (0..(12u32 << 20) + 5)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    std::fs::write(root.join("db.bin"), &big).unwrap();
    let mut c = mounted_at_data(&root);
    let mut mem = vec![0u8; 1 << 16];
    let mut cache = ImportCache::default();
    let read = Arc::new(std::sync::atomic::AtomicU64::new(0));
    cache.count_bytes_into(Some(read.clone()));
    let snapshot = |c: &mut WasiCtx, cache: &mut ImportCache| {
        read.store(0, Ordering::SeqCst);
        cache.use_guest_writes(c.take_guest_writes());
        let k = import_cached(&store, &root, cache, &[]).unwrap();
        cache.forget_guest_writes();
        c.record_writes_to(cache.stored_in_pieces());
        assert_eq!(
            k,
            import(&store, &root).unwrap(),
            "the tree a full read gives"
        );
        (
            cache.files_read(),
            cache.files_patched(),
            read.load(Ordering::SeqCst),
        )
    };
    assert_eq!(snapshot(&mut c, &mut cache), (1, 0, big.len() as u64));

    let fd = open_rw(&mut c, &mut mem, "db.bin", 0);
    guest_write(&mut c, &mut mem, fd, b"at five", Some(5 << 20));
    guest_write(&mut c, &mut mem, fd, b"at the start", None);
    // Across a piece boundary: two pieces.
    guest_write(&mut c, &mut mem, fd, &[9; 100], Some((8 << 20) - 50));
    assert_eq!(
        snapshot(&mut c, &mut cache),
        (1, 1, 4 << 20),
        "pieces 0, 5, 7 and 8 read again"
    );
    assert_eq!(
        snapshot(&mut c, &mut cache),
        (1, 1, 0),
        "nothing changed: nothing read"
    );

    // Appended: the last piece, 5 bytes then, 2,005 now.
    let app = open_rw(&mut c, &mut mem, "db.bin", 1);
    guest_write(&mut c, &mut mem, app, &[3; 2000], None);
    assert_eq!(snapshot(&mut c, &mut cache), (1, 2, 2005));
    // Shrunk to 3 MiB + 10 bytes, then grown to 6 MiB (zeros), then one byte written at
    // 1 MiB: what was there must not come back.
    assert_eq!(
        c.call("fd_filestat_set_size", &mut mem, &[fd, (3 << 20) + 10])
            .unwrap(),
        0
    );
    assert_eq!(
        c.call("fd_filestat_set_size", &mut mem, &[fd, 6 << 20])
            .unwrap(),
        0
    );
    guest_write(&mut c, &mut mem, fd, b"x", Some(1 << 20));
    assert_eq!(
        snapshot(&mut c, &mut cache),
        (1, 3, 4 << 20),
        "pieces 1 and 3 to 5"
    );
    assert_eq!(
        c.call("fd_allocate", &mut mem, &[fd, 0, (7 << 20) + 1])
            .unwrap(),
        0
    );
    assert_eq!(
        snapshot(&mut c, &mut cache),
        (1, 4, (1 << 20) + 1),
        "the grown tail"
    );

    // Another program's change between two of the guest's: read whole.
    std::fs::File::options()
        .write(true)
        .open(root.join("db.bin"))
        .unwrap()
        .write_all_at(b"host", 2 << 20)
        .unwrap();
    guest_write(&mut c, &mut mem, fd, b"guest", Some(4 << 20));
    assert_eq!(snapshot(&mut c, &mut cache), (2, 4, (7 << 20) + 1));
    // After the guest's last change, with no change of the guest's since: read whole too.
    guest_write(&mut c, &mut mem, fd, b"guest", Some(4 << 20));
    std::fs::File::options()
        .write(true)
        .open(root.join("db.bin"))
        .unwrap()
        .write_all_at(b"host", 6 << 20)
        .unwrap();
    assert_eq!(snapshot(&mut c, &mut cache), (3, 4, (7 << 20) + 1));
    // The chain starts again from there.
    guest_write(&mut c, &mut mem, fd, b"guest", Some(4 << 20));
    assert_eq!(snapshot(&mut c, &mut cache), (3, 5, 1 << 20));
    assert!(c.take_guest_writes().is_empty());

    // Only files the last snapshot stored in pieces are followed: not a small one, not one
    // before any snapshot.
    std::fs::write(root.join("small.txt"), "small").unwrap();
    snapshot(&mut c, &mut cache);
    let small = open_rw(&mut c, &mut mem, "small.txt", 0);
    guest_write(&mut c, &mut mem, small, b"x", Some(0));
    assert!(c.take_guest_writes().is_empty());
    guest_write(&mut c, &mut mem, fd, b"guest", Some(4 << 20));
    assert_eq!(c.take_guest_writes().len(), 1);
    let mut fresh = mounted_at_data(&root);
    let fd = open_rw(&mut fresh, &mut mem, "db.bin", 0);
    guest_write(&mut fresh, &mut mem, fd, b"guest", Some(4 << 20));
    assert!(fresh.take_guest_writes().is_empty());
}

/// A file the guest changed that turns out shorter than its stamp said when its pieces are
/// read again (another program cut it during the snapshot) is not patched: the import reads
/// it whole instead of failing.
#[test]
fn a_patch_of_a_file_cut_short_meanwhile_gives_way_to_a_full_read() {
    use crate::tree::{ImportCache, Sink, Stamp, import_cached, patch_chunked};
    let store = ferry_store::MemStore::new();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let path = root.join("f");
    std::fs::write(&path, vec![5u8; 3 << 20]).unwrap();
    let mut c = mounted_at_data(&root);
    let mut mem = vec![0u8; 1 << 16];
    let mut cache = ImportCache::default();
    let tree = import_cached(&store, &root, &mut cache, &[]).unwrap();
    c.record_writes_to(cache.stored_in_pieces());
    let tree: ferry_object::Tree =
        ferry_object::decode(&ferry_store::Store::get(&store, &tree).unwrap()).unwrap();
    let base = tree.entries["f"].object;
    let fd = open_rw(&mut c, &mut mem, "f", 0);
    guest_write(&mut c, &mut mem, fd, b"changed", Some(2 << 20));
    let writes = c.take_guest_writes();
    let now = Stamp::of(&std::fs::metadata(&path).unwrap());
    let chain = writes.chain_to(&now).expect("an unbroken chain");
    let whole = patch_chunked(Sink::Store(&store), &path, &now, base, chain, None).unwrap();
    assert!(
        whole.is_some(),
        "patched while the file is as its stamp says"
    );
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(5 << 19)
        .unwrap();
    let cut = patch_chunked(Sink::Store(&store), &path, &now, base, chain, None).unwrap();
    assert!(cut.is_none());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// Whatever the guest and another program do to a big file, in any order, each import
    /// gives the tree a full read of the directory gives.
    #[test]
    fn a_patched_import_always_equals_a_full_read(
        ops in proptest::collection::vec((0u8..6, 0u64..(5 << 20), 1usize..3000), 1..40),
        every in 1usize..6,
    ) {
        use crate::tree::{ImportCache, import, import_cached};
        use std::os::unix::fs::FileExt;
        let store = ferry_store::MemStore::new();
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::write(root.join("f"), vec![1u8; (3 << 20) + 77]).unwrap();
        let mut c = mounted_at_data(&root);
        let mut mem = vec![0u8; 1 << 16];
        let mut cache = ImportCache::default();
        let fd = open_rw(&mut c, &mut mem, "f", 0);
        let app = open_rw(&mut c, &mut mem, "f", 1);
        for (n, (op, at, len)) in ops.into_iter().enumerate() {
            let data = vec![(n % 250) as u8 + 2; len];
            match op {
                0 => guest_write(&mut c, &mut mem, fd, &data, Some(at)),
                1 => guest_write(&mut c, &mut mem, fd, &data, None),
                2 => guest_write(&mut c, &mut mem, app, &data, None),
                3 => {
                    let r = c.call("fd_filestat_set_size", &mut mem, &[fd, at as i64]);
                    proptest::prop_assert_eq!(r.unwrap(), 0);
                }
                4 => std::fs::File::options()
                    .write(true)
                    .open(root.join("f"))
                    .unwrap()
                    .write_all_at(&data, at)
                    .unwrap(),
                _ => {
                    let r = c.call("fd_seek", &mut mem, &[fd, at as i64, 0, 300]);
                    proptest::prop_assert_eq!(r.unwrap(), 0);
                }
            }
            if n % every == 0 {
                cache.use_guest_writes(c.take_guest_writes());
                let k = import_cached(&store, &root, &mut cache, &[]).unwrap();
                cache.forget_guest_writes();
                c.record_writes_to(cache.stored_in_pieces());
                proptest::prop_assert_eq!(k, import(&store, &root).unwrap());
            }
        }
    }
}

/// A guest's view of one mounted directory, by WASI calls: what the descriptor tests need.
struct Guest {
    c: WasiCtx,
    mem: Vec<u8>,
}

impl Guest {
    /// A guest restored from `state` with `dir` granted at `/data`.
    fn restored(
        state: &ferry_object::WasiState,
        dir: &std::path::Path,
        store: &dyn ferry_store::Store,
    ) -> Self {
        let grant = MountSpec {
            guest_path: "/data".into(),
            host_dir: dir.into(),
            read_only: false,
            host_bound: false,
        };
        let c = WasiCtx::restore(
            state,
            vec![grant],
            stdio_to(Box::new(std::io::sink())),
            Box::new(FakeClock::default()),
            Arc::new(|| false),
            store,
        )
        .unwrap();
        Self {
            c,
            mem: vec![0u8; 8192],
        }
    }

    /// Calls `name` with `args`, the strings in `strs` placed in memory first (each replaced
    /// in `args`, at the position of a `-1`, by its pointer and length); its errno.
    fn call(&mut self, name: &str, args: &[i64], strs: &[&str]) -> i32 {
        let mut full = Vec::new();
        let mut next = strs.iter();
        let mut at = 1000;
        for &a in args {
            if a == -1 {
                let s = next.next().expect("a string for each -1");
                let (p, n) = put_str(&mut self.mem, at, s);
                at += 512;
                full.extend([p, n]);
            } else {
                full.push(a);
            }
        }
        self.c.call(name, &mut self.mem, &full).unwrap()
    }

    /// `path_open` of `name` under directory fd `dir`: the new fd, or the errno as an error.
    fn open(&mut self, dir: i64, name: &str, oflags: i64) -> Result<i64, i32> {
        // Read and write rights; a directory is opened with `OFLAG_DIRECTORY` (2) and read only.
        let rights = if oflags & 2 != 0 { 2 } else { 2 | 64 };
        match self.call(
            "path_open",
            &[dir, 1, -1, oflags, rights, 0, 0, 200],
            &[name],
        ) {
            0 => Ok(i64::from(u32::from_le_bytes(
                self.mem[200..204].try_into().unwrap(),
            ))),
            e => Err(e),
        }
    }

    fn write(&mut self, fd: i64, text: &str) {
        put_str(&mut self.mem, 3000, text);
        self.mem[0..4].copy_from_slice(&3000u32.to_le_bytes());
        self.mem[4..8].copy_from_slice(&(text.len() as u32).to_le_bytes());
        assert_eq!(
            self.c
                .call("fd_write", &mut self.mem, &[fd, 0, 1, 300])
                .unwrap(),
            0
        );
    }

    /// Everything `fd` reads from offset 0.
    fn read_all(&mut self, fd: i64) -> String {
        assert_eq!(
            self.c
                .call("fd_seek", &mut self.mem, &[fd, 0, 0, 300])
                .unwrap(),
            0
        );
        self.mem[0..4].copy_from_slice(&3000u32.to_le_bytes());
        self.mem[4..8].copy_from_slice(&1000u32.to_le_bytes());
        assert_eq!(
            self.c
                .call("fd_read", &mut self.mem, &[fd, 0, 1, 300])
                .unwrap(),
            0
        );
        let n = u32::from_le_bytes(self.mem[300..304].try_into().unwrap()) as usize;
        String::from_utf8(self.mem[3000..3000 + n].to_vec()).unwrap()
    }
}

/// Descriptors outlive the names they were opened by, as on Linux, and a snapshot keeps them:
/// a file renamed while open is captured where it is now (also when only another hard link
/// is left); one replaced by a rename is carried in the snapshot and restored as an unnamed
/// copy at its offset, leaving no trace in the directory; a directory renamed while open
/// resolves names where it is now, and one removed answers `ENOENT`, after a restore too.
#[test]
fn descriptors_outlive_their_names() {
    let d = tempfile::tempdir().unwrap();
    let store = ferry_store::MemStore::new();
    let mut g = Guest {
        c: mounted_at_data(d.path()),
        mem: vec![0u8; 8192],
    };
    let (creat, dir, trunc) = (1, 2, 8);
    // Renamed while open.
    let a = g.open(3, "a.txt", creat | trunc).unwrap();
    g.write(a, "one\n");
    assert_eq!(
        g.call("path_rename", &[3, -1, 3, -1], &["a.txt", "b.txt"]),
        0
    );
    // Replaced by a rename while open.
    let cfg = g.open(3, "cfg", creat | trunc).unwrap();
    g.write(cfg, "old config\n");
    std::fs::write(d.path().join("cfg.new"), "new config\n").unwrap();
    assert_eq!(
        g.call("path_rename", &[3, -1, 3, -1], &["cfg.new", "cfg"]),
        0
    );
    // Its name deleted, another hard link left.
    let h = g.open(3, "h1", creat).unwrap();
    g.write(h, "linked\n");
    assert_eq!(g.call("path_link", &[3, 0, -1, 3, -1], &["h1", "h2"]), 0);
    assert_eq!(g.call("path_unlink_file", &[3, -1], &["h1"]), 0);
    // A directory renamed while open, and one removed.
    assert_eq!(g.call("path_create_directory", &[3, -1], &["d"]), 0);
    let dd = g.open(3, "d", dir).unwrap();
    assert_eq!(g.call("path_rename", &[3, -1, 3, -1], &["d", "e"]), 0);
    g.open(dd, "x", creat).unwrap();
    assert!(
        d.path().join("e/x").exists(),
        "looked up where the directory is now"
    );
    assert_eq!(g.call("path_create_directory", &[3, -1], &["gone"]), 0);
    let gone = g.open(3, "gone", dir).unwrap();
    assert_eq!(g.call("path_remove_directory", &[3, -1], &["gone"]), 0);
    assert_eq!(g.open(gone, "y", creat), Err(Errno::Noent as i32));
    // A mount's own directory is not moved.
    assert_eq!(
        g.call("path_rename", &[3, -1, 3, -1], &[".", "elsewhere"]),
        Errno::Busy as i32
    );

    let tree = ferry_kappa::Kappa::of(b"tree");
    let state = g.c.capture(&[tree], &store).unwrap();
    let fd = |n: i64| fd_state(&state, n);
    assert_eq!((fd(a).path.as_str(), fd(a).unnamed), ("b.txt", None));
    assert_eq!((fd(h).path.as_str(), fd(h).unnamed), ("h2", None));
    assert_eq!(fd(dd).path, "e");
    let carried = fd(cfg)
        .unnamed
        .expect("the replaced file's content is carried");
    assert_eq!(fd(cfg).offset, 11);
    assert_eq!(
        fd(gone).unnamed,
        Some(crate::tree::empty(&store).unwrap()),
        "a removed directory is recorded as such"
    );
    assert!(ferry_object::ObjectKind::children(&state).contains(&carried));

    // Restored from the snapshot (into the same directory: it holds what the tree would).
    let before: Vec<_> = std::fs::read_dir(d.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    let mut r = Guest::restored(&state, d.path(), &store);
    assert_eq!(
        r.read_all(cfg),
        "old config\n",
        "the replaced file, as it was"
    );
    r.write(cfg, "more\n");
    assert_eq!(r.read_all(cfg), "old config\nmore\n");
    assert_eq!(
        std::fs::read_to_string(d.path().join("cfg")).unwrap(),
        "new config\n"
    );
    r.write(a, "two\n");
    assert_eq!(
        std::fs::read_to_string(d.path().join("b.txt")).unwrap(),
        "one\ntwo\n"
    );
    r.write(h, "still\n");
    assert_eq!(
        std::fs::read_to_string(d.path().join("h2")).unwrap(),
        "linked\nstill\n"
    );
    r.open(dd, "z", creat).unwrap();
    assert!(d.path().join("e/z").exists());
    assert_eq!(r.open(gone, "y", creat), Err(Errno::Noent as i32));
    // Renamed after the restore, before any use: followed too.
    assert_eq!(
        r.call("path_rename", &[3, -1, 3, -1], &["b.txt", "c.txt"]),
        0
    );
    let again = r.c.capture(&[tree], &store).unwrap();
    let fd2 = |n: i64| fd_state(&again, n);
    assert_eq!(fd2(a).path, "c.txt");
    assert!(
        fd2(cfg).unnamed.is_some() && fd2(cfg).unnamed != Some(carried),
        "written since"
    );
    let after: Vec<_> = std::fs::read_dir(d.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        before.len(),
        after.len(),
        "the unnamed copy is in no directory"
    );
}

/// `fd_readdir` reads a directory once per listing (from cookie 0), not once per bufferful,
/// yet shows what reading it each time would: a name the guest creates meanwhile is there.
#[test]
fn a_directory_is_listed_once_per_pass_and_changes_by_the_guest_show() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("many")).unwrap();
    for i in 0..300 {
        std::fs::write(d.path().join(format!("many/f{i:03}")), b"").unwrap();
    }
    let mut g = Guest {
        c: mounted_at_data(d.path()),
        mem: vec![0u8; 8192],
    };
    let dir = g.open(3, "many", 2).unwrap();
    // Reads the whole listing in 256-byte bufferfuls; `between` runs after the first one.
    let list = |g: &mut Guest, between: &mut dyn FnMut(&mut Guest)| -> Vec<String> {
        let (mut names, mut cookie, mut first) = (Vec::new(), 0u64, true);
        loop {
            let r = g.c.call(
                "fd_readdir",
                &mut g.mem,
                &[dir, 4000, 256, cookie as i64, 300],
            );
            assert_eq!(r.unwrap(), 0);
            let n = u32::from_le_bytes(g.mem[300..304].try_into().unwrap()) as usize;
            let mut at = 0;
            while at + 24 <= n {
                let e = &g.mem[4000 + at..4000 + n];
                let len = u32::from_le_bytes(e[16..20].try_into().unwrap()) as usize;
                if 24 + len > e.len() {
                    break; // cut short: asked for again from its cookie
                }
                names.push(String::from_utf8(e[24..24 + len].to_vec()).unwrap());
                cookie = u64::from_le_bytes(e[0..8].try_into().unwrap());
                at += 24 + len;
            }
            if first {
                between(g);
                first = false;
            }
            if n < 256 {
                return names;
            }
        }
    };
    let plain = list(&mut g, &mut |_| {});
    assert_eq!(plain.len(), 302);
    assert!(plain.windows(2).skip(2).all(|w| w[0] < w[1]), "sorted");
    // Served from the listing taken at cookie 0: a file another program adds is not seen...
    let other = list(&mut g, &mut |_| {
        std::fs::write(d.path().join("many/g-other"), b"").unwrap();
    });
    assert_eq!(other.len(), 302);
    // ...one the guest creates is, as a fresh read would show it (and a resume would).
    let created = list(&mut g, &mut |g| {
        g.open(3, "many/h-guest", 1).unwrap();
    });
    assert_eq!(created.len(), 304);
    assert_eq!(created.last().unwrap(), "h-guest");
}

/// Host errors reach the guest as the WASI errno a program checks for: a rename between two
/// mounts on different file systems is `EXDEV` (so a `mv` copies instead), running out of
/// descriptors is `EMFILE`; the rest keep their own names too.
#[test]
fn host_errors_keep_their_names() {
    use std::io::Error;
    for (raw, want) in [
        (libc::EXDEV, Errno::Xdev),
        (libc::EMFILE, Errno::Mfile),
        (libc::ENFILE, Errno::Nfile),
        (libc::EBUSY, Errno::Busy),
        (libc::EDQUOT, Errno::Dquot),
        (libc::EAGAIN, Errno::Again),
        (libc::EINTR, Errno::Intr),
        (libc::ETXTBSY, Errno::Txtbsy),
        (libc::EMLINK, Errno::Mlink),
        (libc::ENOMEM, Errno::Nomem),
    ] {
        assert_eq!(Errno::from(Error::from_raw_os_error(raw)), want, "{raw}");
    }
    // Two mounts on two file systems, where this machine has a second one (tmpfs).
    let shm = std::path::Path::new("/dev/shm");
    let a = tempfile::tempdir().unwrap();
    let Ok(b) = tempfile::tempdir_in(shm) else {
        return;
    };
    use std::os::unix::fs::MetadataExt;
    if std::fs::metadata(a.path()).unwrap().dev() == std::fs::metadata(b.path()).unwrap().dev() {
        return;
    }
    std::fs::write(a.path().join("f"), b"x").unwrap();
    let mount = |dir: &std::path::Path, at: &str| MountSpec {
        guest_path: at.into(),
        host_dir: dir.into(),
        read_only: false,
        host_bound: false,
    };
    let mut g = Guest {
        c: ctx(
            vec![mount(a.path(), "/a"), mount(b.path(), "/b")],
            FakeClock::default(),
            Buf::default(),
            Arc::default(),
        ),
        mem: vec![0u8; 8192],
    };
    assert_eq!(
        g.call("path_rename", &[3, -1, 4, -1], &["f", "f"]),
        Errno::Xdev as i32
    );
}

/// `poll_oneoff` on stdin (a stream) answers when input is there, not at once: with a clock
/// subscription beside it, the clock fires while stdin stays empty; input makes stdin ready;
/// a suspend asked for while it waits unwinds it, keeping the deadline for the rewind.
#[test]
fn polling_stdin_waits_for_input() {
    let (stdio, write_end) = stdin_from_a_pipe();
    let interrupt = Arc::new(AtomicBool::new(false));
    let flag = interrupt.clone();
    // The host's clock: the wait is real.
    let mut c = WasiCtx::new(
        vec!["prog".into()],
        vec![],
        vec![],
        stdio,
        Box::new(crate::HostClock::default()),
        Arc::new(move || flag.load(Ordering::SeqCst)),
    )
    .unwrap();
    let mut mem = vec![0u8; 1024];
    // Subscription 0 (userdata 7): stdin readable; 1 (userdata 9): 30 ms on the monotonic
    // clock. Events at 256, their count at 512.
    let subs = |mem: &mut Vec<u8>| {
        mem[..96].fill(0);
        mem[0..8].copy_from_slice(&7u64.to_le_bytes());
        mem[8] = 1;
        mem[48..56].copy_from_slice(&9u64.to_le_bytes());
        mem[48 + 8] = 0;
        mem[48 + 16..48 + 20].copy_from_slice(&1u32.to_le_bytes());
        mem[48 + 24..48 + 32].copy_from_slice(&30_000_000u64.to_le_bytes());
    };
    let events = |mem: &Vec<u8>| -> Vec<u64> {
        let n = u32::from_le_bytes(mem[512..516].try_into().unwrap()) as usize;
        (0..n)
            .map(|i| u64::from_le_bytes(mem[256 + 32 * i..264 + 32 * i].try_into().unwrap()))
            .collect()
    };
    subs(&mut mem);
    let started = std::time::Instant::now();
    assert_eq!(
        c.call("poll_oneoff", &mut mem, &[0, 256, 2, 512]).unwrap(),
        0
    );
    assert_eq!(events(&mem), [9], "the clock, not stdin");
    assert!(started.elapsed() >= std::time::Duration::from_millis(30));
    // SAFETY: the write end, owned by this test.
    assert_eq!(
        unsafe { libc::write(write_end, b"x".as_ptr().cast(), 1) },
        1
    );
    subs(&mut mem);
    assert_eq!(
        c.call("poll_oneoff", &mut mem, &[0, 256, 2, 512]).unwrap(),
        0
    );
    assert_eq!(events(&mem), [7], "stdin has input");
    // Read it, then wait again with a suspend asked for.
    mem[600..604].copy_from_slice(&700u32.to_le_bytes());
    mem[604..608].copy_from_slice(&1u32.to_le_bytes());
    assert_eq!(c.call("fd_read", &mut mem, &[0, 600, 1, 620]).unwrap(), 0);
    interrupt.store(true, Ordering::SeqCst);
    subs(&mut mem);
    let r = c.call("poll_oneoff", &mut mem, &[0, 256, 2, 512]);
    assert!(matches!(r, Err(HostError::Unwind)), "{r:?}");
    assert!(
        c.sleep_deadline.is_some(),
        "the deadline is kept for the rewind"
    );
    // SAFETY: the write end, owned by this test.
    unsafe { libc::close(write_end) };
}

/// The device and inode numbers the guest sees stay the same across a move: resumed into a
/// fresh directory, where the host gives every file new ones, each file the guest had seen
/// (by `path_filestat_get` or `fd_filestat_get`, renamed by it since or not) shows the
/// numbers it showed before, in `fd_readdir` too; hard links still share theirs, and a file
/// first seen after the move shows numbers no other file shows.
#[test]
fn inode_numbers_stay_the_same_across_a_move() {
    let store = ferry_store::MemStore::new();
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("sub")).unwrap();
    std::fs::write(d.path().join("a.txt"), "a").unwrap();
    std::fs::write(d.path().join("sub/b.txt"), "b").unwrap();
    std::fs::hard_link(d.path().join("a.txt"), d.path().join("z.txt")).unwrap();
    std::fs::write(d.path().join("listed.txt"), "l").unwrap();
    let stat = |g: &mut Guest, name: &str| -> Result<(u64, u64), i32> {
        match g.call("path_filestat_get", &[3, 0, -1, 500], &[name]) {
            0 => Ok((
                u64::from_le_bytes(g.mem[500..508].try_into().unwrap()),
                u64::from_le_bytes(g.mem[508..516].try_into().unwrap()),
            )),
            e => Err(e),
        }
    };
    let fstat = |g: &mut Guest, fd: i64| -> (u64, u64) {
        assert_eq!(g.call("fd_filestat_get", &[fd, 500], &[]), 0);
        (
            u64::from_le_bytes(g.mem[500..508].try_into().unwrap()),
            u64::from_le_bytes(g.mem[508..516].try_into().unwrap()),
        )
    };
    // The inode number `fd_readdir` gives for `name` in the mount's own directory.
    let listed = |g: &mut Guest, name: &str| -> u64 {
        assert_eq!(g.call("fd_readdir", &[3, 4000, 2000, 0, 300], &[]), 0);
        let n = u32::from_le_bytes(g.mem[300..304].try_into().unwrap()) as usize;
        let mut at = 0;
        while at + 24 <= n {
            let e = &g.mem[4000 + at..4000 + n];
            let len = u32::from_le_bytes(e[16..20].try_into().unwrap()) as usize;
            if &e[24..24 + len] == name.as_bytes() {
                return u64::from_le_bytes(e[8..16].try_into().unwrap());
            }
            at += 24 + len;
        }
        panic!("{name} not listed");
    };
    let mut g = Guest {
        c: mounted_at_data(d.path()),
        mem: vec![0u8; 8192],
    };
    let a = stat(&mut g, "a.txt").unwrap();
    let sub = stat(&mut g, "sub").unwrap();
    let b = stat(&mut g, "sub/b.txt").unwrap();
    assert_eq!(stat(&mut g, "z.txt").unwrap(), a, "one file, two names");
    let l = listed(&mut g, "listed.txt");
    assert_eq!(stat(&mut g, "listed.txt").unwrap(), (a.0, l), "as listed");
    let fd = g.open(3, "a.txt", 0).unwrap();
    assert_eq!(fstat(&mut g, fd), a);
    let root = fstat(&mut g, 3);
    // Renamed by the guest after it saw it.
    assert_eq!(
        g.call("path_rename", &[3, -1, 3, -1], &["sub/b.txt", "sub/c.txt"]),
        0
    );
    let tree = crate::tree::import(&store, d.path()).unwrap();
    let state = g.c.capture(&[tree], &store).unwrap();
    assert!(!state.inodes.is_empty());

    // Written anew elsewhere: the host's numbers differ.
    let back = tempfile::tempdir().unwrap();
    crate::tree::materialize(&store, &tree, back.path()).unwrap();
    use std::os::unix::fs::MetadataExt;
    let host_ino = std::fs::metadata(back.path().join("a.txt")).unwrap().ino();
    assert_ne!(host_ino, a.1, "the host gave the file a new number");
    let mut r = Guest::restored(&state, back.path(), &store);
    assert_eq!(stat(&mut r, "a.txt").unwrap(), a);
    assert_eq!(stat(&mut r, "z.txt").unwrap(), a);
    assert_eq!(stat(&mut r, "sub").unwrap(), sub);
    assert_eq!(
        stat(&mut r, "sub/c.txt").unwrap(),
        b,
        "followed through the rename"
    );
    assert_eq!(listed(&mut r, "listed.txt"), l);
    assert_eq!(fstat(&mut r, fd), a, "the descriptor opened again");
    assert_eq!(fstat(&mut r, 3), root);
    // A file first seen after the move shows numbers of its own.
    let new = r.open(3, "new.txt", 1).unwrap();
    let shown = fstat(&mut r, new);
    assert_eq!(shown.0, a.0, "the same device as the mount's other files");
    assert!(![a, sub, b, root].contains(&shown));
    assert_eq!(stat(&mut r, "new.txt").unwrap(), shown);
}
