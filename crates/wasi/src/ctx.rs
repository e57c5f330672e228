//! The virtual WASI state of one guest, and its capture and restore.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::IsTerminal;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use ferry_kappa::Kappa;
use ferry_object::{FdState, Mount, WasiState};
use ferry_store::Store;

use crate::{Errno, path};

/// Time as the host sees it. Behind a trait so tests can be deterministic.
pub trait Clock: Send {
    /// Host monotonic time in ns (any origin).
    fn monotonic_ns(&self) -> u64;
    /// Wall-clock time in ns since the Unix epoch.
    fn realtime_ns(&self) -> u64;
}

/// The real host clock.
#[derive(Debug)]
pub struct HostClock(Instant);

impl Default for HostClock {
    fn default() -> Self {
        Self(Instant::now())
    }
}

impl Clock for HostClock {
    fn monotonic_ns(&self) -> u64 {
        self.0.elapsed().as_nanos() as u64
    }
    fn realtime_ns(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    }
}

/// Where the guest's standard streams go.
pub struct Stdio {
    pub stdin: Box<dyn Read + Send>,
    /// Raw fd behind `stdin`, so a blocked read can be interrupted by a suspend.
    pub stdin_fd: Option<i32>,
    pub stdout: Box<dyn Write + Send>,
    pub stderr: Box<dyn Write + Send>,
    /// Which of stdin, stdout, stderr are terminals: the guest sees those as ttys
    /// (`isatty`), the others as streams.
    pub terminals: [bool; 3],
    /// When stdout and stderr are recorded in an output log (sessions of a space), that log:
    /// snapshots then carry it.
    pub log: Option<crate::OutputBuffer>,
    /// When stdin is data stored rather than a stream ([`Stdio::with_input`]), or input sent
    /// while the guest runs as the last snapshot stored it: snapshots then carry it.
    pub input: Option<crate::input::StoredInput>,
    /// When stdin is input sent while the guest runs ([`Stdio::with_input_log`]): snapshots
    /// carry what it holds then ([`crate::input::store_log`]) and that it is still open.
    pub input_log: Option<crate::InputLog>,
}

impl Stdio {
    /// stdout (`i` 0) or stderr (1).
    pub(crate) fn output(&mut self, i: usize) -> &mut (dyn Write + Send) {
        if i == 0 {
            &mut *self.stdout
        } else {
            &mut *self.stderr
        }
    }
}

impl std::fmt::Debug for Stdio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Stdio")
    }
}

impl Stdio {
    /// Like [`Stdio::inherit`], for a resumed guest that had read `consumed` bytes of stdin:
    /// if stdin is a regular file, reading continues right after them (a pipe or terminal
    /// simply goes on).
    pub fn inherit_resumed(consumed: u64) -> Self {
        // SAFETY: fstat/lseek on fd 0 with a zeroed stat buffer we own.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(0, &mut st) == 0 && (st.st_mode & libc::S_IFMT) == libc::S_IFREG {
                libc::lseek(0, consumed as libc::off_t, libc::SEEK_SET);
            }
        }
        Self::inherit()
    }

    /// The process's own stdin, stdout and stderr. Stdin is read unbuffered: bytes the guest
    /// has not asked for stay in the pipe, so a suspend never strands them in a host buffer.
    pub fn inherit() -> Self {
        Self {
            stdin: Box::new(RawStdin),
            stdin_fd: Some(0),
            stdout: Box::new(std::io::stdout()),
            stderr: Box::new(std::io::stderr()),
            terminals: [
                std::io::stdin().is_terminal(),
                std::io::stdout().is_terminal(),
                std::io::stderr().is_terminal(),
            ],
            log: None,
            input: None,
            input_log: None,
        }
    }

    /// No stdin (reads see end of file); stdout and stderr appended to `log`.
    pub fn logged(log: crate::OutputBuffer) -> Self {
        Self {
            stdin: Box::new(std::io::empty()),
            stdin_fd: None,
            stdout: log.writer(crate::output::STDOUT),
            stderr: log.writer(crate::output::STDERR),
            terminals: [false; 3],
            log: Some(log),
            input: None,
            input_log: None,
        }
    }

    /// This with `data` (stored as `input`) as stdin instead, read from byte `consumed` on
    /// (what a resumed guest had read), then end of file.
    pub fn with_input(
        self,
        data: Vec<u8>,
        input: crate::input::StoredInput,
        consumed: u64,
    ) -> Self {
        let mut stdin = std::io::Cursor::new(data);
        stdin.set_position(consumed);
        let [_, out, err] = self.terminals;
        Self {
            stdin: Box::new(stdin),
            stdin_fd: None,
            terminals: [false, out, err],
            input: Some(input),
            ..self
        }
    }

    /// This with `log` as stdin instead, read from byte `consumed` on (what a resumed guest
    /// had read): input that arrives while the guest runs, until the log is ended. `input` is
    /// where a resumed snapshot carried the log (a prefix of `log`).
    pub fn with_input_log(
        self,
        log: crate::InputLog,
        input: Option<crate::input::StoredInput>,
        consumed: u64,
    ) -> Self {
        let [_, out, err] = self.terminals;
        Self {
            stdin: Box::new(log.reader(consumed)),
            stdin_fd: None,
            terminals: [false, out, err],
            input,
            input_log: Some(log),
            ..self
        }
    }
}

/// File descriptor 0, read with no buffering of our own.
#[derive(Debug)]
struct RawStdin;

impl Read for RawStdin {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            // SAFETY: reads into a buffer we own, at most its length, from fd 0.
            let n = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            // A signal for ferry (suspend, checkpoint) is not the guest's business.
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// A host directory granted to the guest at `guest_path`.
#[derive(Debug, Clone)]
pub struct MountSpec {
    pub guest_path: String,
    pub host_dir: PathBuf,
    pub read_only: bool,
    /// Pass-through: snapshots do not carry the directory's content (they are host-bound).
    pub host_bound: bool,
}

#[derive(Debug)]
pub(crate) struct MountRt {
    pub guest_path: String,
    /// Canonical host directory.
    pub root: PathBuf,
    pub read_only: bool,
    pub host_bound: bool,
    /// Mount-relative paths of files ferry's own stdout or stderr went to: not carried.
    pub not_carried: BTreeSet<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FdKind {
    Stdin,
    Stdout,
    Stderr,
    Preopen,
    File,
    Dir,
}

impl FdKind {
    fn name(self) -> &'static str {
        match self {
            FdKind::Stdin => "stdin",
            FdKind::Stdout => "stdout",
            FdKind::Stderr => "stderr",
            FdKind::Preopen => "preopen",
            FdKind::File => "file",
            FdKind::Dir => "dir",
        }
    }
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "stdin" => FdKind::Stdin,
            "stdout" => FdKind::Stdout,
            "stderr" => FdKind::Stderr,
            "preopen" => FdKind::Preopen,
            "file" => FdKind::File,
            "dir" => FdKind::Dir,
            _ => return None,
        })
    }
}

#[derive(Debug)]
pub(crate) struct Fd {
    pub kind: FdKind,
    pub mount: u32,
    /// Path inside the mount.
    pub path: String,
    pub fdflags: u16,
    pub read: bool,
    pub write: bool,
    /// Offset to restore when the host file is (re)opened.
    pub offset: u64,
    /// Open host file, opened lazily (after a restore) from `path`.
    pub file: Option<File>,
    /// `file`'s device and inode, once asked for ([`WasiCtx::records_writes`]).
    pub inode: Option<(u64, u64)>,
    /// A directory fd's host directory, held open so that `path` follows it when it is
    /// renamed ([`WasiCtx::refresh_dir`]).
    pub dir: Option<File>,
    /// A directory fd whose directory was removed while open: every lookup in it fails.
    pub removed: bool,
    /// A directory fd's listing being read (`fd_readdir` from cookie 0 to its end), and the
    /// count of name changes it was taken at ([`WasiCtx::name_changes`]).
    pub listing: Option<(u64, Vec<Listed>)>,
    /// The content last stored for `file` while no path names it ([`place`]), and the
    /// file's stamp then: not read again while the stamp is the same and settled.
    pub unnamed: Option<(crate::tree::Stamp, Kappa)>,
}

/// One entry of a directory as `fd_readdir` gives it: name, WASI file type, inode number.
pub(crate) type Listed = (String, u8, u64);

/// Where an open host file or directory is now.
#[derive(Debug, PartialEq, Eq)]
enum Place {
    /// At this path inside this mount.
    At(u32, String),
    /// Named by no path inside any mount: deleted, or replaced by a rename, while open.
    Gone,
    /// Not known (no `/proc` to ask): the recorded path stands.
    Unknown,
}

/// Most directory entries [`place`] looks through for another name of an open file whose own
/// name was deleted (a hard link).
const MAX_LINK_SEARCH: usize = 100_000;

/// Where the open host file or directory `h` is now, among `mounts` (its own, `mine`, first:
/// mounts may lie inside one another). The kernel keeps the name of an open file up to date
/// through renames (`/proc/self/fd`); the name is taken only while it still leads to the same
/// file. A file whose name was deleted but which has another (a hard link) is looked for.
fn place(h: &File, mounts: &[MountRt], mine: u32) -> Place {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::io::AsRawFd;
    let Ok(md) = h.metadata() else {
        return Place::Unknown;
    };
    if md.nlink() == 0 {
        return Place::Gone;
    }
    let same = |p: &Path| {
        std::fs::symlink_metadata(p).is_ok_and(|m| m.dev() == md.dev() && m.ino() == md.ino())
    };
    let Ok(name) = std::fs::read_link(format!("/proc/self/fd/{}", h.as_raw_fd())) else {
        return Place::Unknown;
    };
    if same(&name) {
        return within(mounts, mine, &name);
    }
    if md.is_dir() {
        return Place::Gone;
    }
    // Deleted under the name it was opened by, still linked under another.
    let mut budget = MAX_LINK_SEARCH;
    let mut order: Vec<usize> = (0..mounts.len()).collect();
    order.sort_by_key(|&i| i != mine as usize);
    for i in order {
        if let Some(p) = find_inode(&mounts[i].root, md.dev(), md.ino(), &mut budget, 0) {
            return within(mounts, mine, &p);
        }
    }
    Place::Gone
}

/// Which mount holds the host path `p`, and where in it: `mine` if it does, else the one
/// whose root is deepest.
fn within(mounts: &[MountRt], mine: u32, p: &Path) -> Place {
    let rel = |m: &MountRt| {
        if p == m.root {
            Some(String::new())
        } else {
            mount_relative(&m.root, p)
        }
    };
    if let Some(r) = mounts.get(mine as usize).and_then(rel) {
        return Place::At(mine, r);
    }
    mounts
        .iter()
        .enumerate()
        .filter_map(|(i, m)| rel(m).map(|r| (i, m.root.components().count(), r)))
        .max_by_key(|&(_, depth, _)| depth)
        .map_or(Place::Gone, |(i, _, r)| Place::At(i as u32, r))
}

/// A path under `dir` of the file with this device and inode, looking at most at `budget`
/// entries (not following links).
fn find_inode(dir: &Path, dev: u64, ino: u64, budget: &mut usize, depth: usize) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    if depth > crate::tree::MAX_DEPTH {
        return None;
    }
    for e in std::fs::read_dir(dir).ok()? {
        if *budget == 0 {
            return None;
        }
        *budget -= 1;
        let Ok(e) = e else { continue };
        let Ok(md) = e.metadata() else { continue };
        if md.dev() == dev && md.ino() == ino && md.is_file() {
            return Some(e.path());
        }
        if md.is_dir()
            && let Some(p) = find_inode(&e.path(), dev, ino, budget, depth + 1)
        {
            return Some(p);
        }
    }
    None
}

/// One guest's WASI state.
pub struct WasiCtx {
    pub(crate) args: Vec<String>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) mounts: Vec<MountRt>,
    pub(crate) fds: BTreeMap<u32, Fd>,
    pub(crate) clock: Box<dyn Clock>,
    /// Virtual monotonic time = host monotonic + this offset (may be negative).
    pub(crate) mono_offset: i128,
    pub(crate) stdio: Stdio,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub stdin_bytes: u64,
    /// Deadline of a sleep interrupted by a suspend (virtual ns).
    pub sleep_deadline: Option<u64>,
    /// Bytes written to stdout and stderr that a hung-up terminal refused, oldest first:
    /// carried by snapshots and shown by the resumed guest (see `WasiState::unshown_stdout`).
    pub(crate) unshown: [Vec<u8>; 2],
    /// Whether a suspend has been requested (checked while blocked).
    pub(crate) interrupt: Arc<dyn Fn() -> bool + Send + Sync>,
    /// Set by the engine while it re-enters a blocking call during a rewind.
    pub rewinding: bool,
    /// What the guest changed in its mounted files since the last snapshot took it.
    pub(crate) guest_writes: crate::written::GuestWrites,
    /// The files (device, inode) whose changes are recorded in `guest_writes`: the big ones
    /// the last snapshot stored in pieces ([`WasiCtx::record_writes_to`]).
    pub(crate) recorded: std::collections::HashSet<(u64, u64)>,
    /// Counts the guest's changes to the names in its mounts (files created, removed,
    /// renamed): a directory listing taken before one is not served any more.
    pub(crate) name_changes: u64,
    /// The device and inode numbers the guest is shown.
    pub(crate) inodes: crate::inodes::Inodes,
    /// The full 1 MiB pieces of the input log ([`Stdio::input_log`]) already stored, from
    /// its start: a snapshot stores only the pieces after them ([`crate::input::store_log`]).
    pub(crate) input_pieces: Vec<Kappa>,
}

impl std::fmt::Debug for WasiCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasiCtx")
            .field("args", &self.args)
            .field("fds", &self.fds)
            .finish()
    }
}

impl WasiCtx {
    /// A fresh context: stdio on fds 0–2, one preopen per mount from fd 3.
    pub fn new(
        args: Vec<String>,
        env: Vec<(String, String)>,
        mounts: Vec<MountSpec>,
        stdio: Stdio,
        clock: Box<dyn Clock>,
        interrupt: Arc<dyn Fn() -> bool + Send + Sync>,
    ) -> Result<Self, String> {
        let mut ctx = Self {
            args,
            env,
            mounts: Vec::new(),
            fds: BTreeMap::new(),
            mono_offset: 0,
            clock,
            stdio,
            stdout_bytes: 0,
            stderr_bytes: 0,
            stdin_bytes: 0,
            sleep_deadline: None,
            unshown: [Vec::new(), Vec::new()],
            interrupt,
            rewinding: false,
            guest_writes: Default::default(),
            recorded: Default::default(),
            name_changes: 0,
            inodes: Default::default(),
            input_pieces: Vec::new(),
        };
        for (i, kind) in [FdKind::Stdin, FdKind::Stdout, FdKind::Stderr]
            .into_iter()
            .enumerate()
        {
            ctx.fds.insert(i as u32, Fd::new(kind, 0, String::new()));
        }
        for (i, m) in mounts.into_iter().enumerate() {
            ctx.mounts.push(MountRt::open(m)?);
            ctx.fds.insert(
                3 + i as u32,
                Fd::new(FdKind::Preopen, i as u32, String::new()),
            );
        }
        Ok(ctx)
    }

    /// Rebuilds a context from a captured state. `mounts` are the destination's grants; every
    /// mount of the snapshot must be granted (matched by guest path).
    ///
    /// Open files and directories are opened again at once (the mounts must hold what the
    /// snapshot's trees hold), so that they follow renames from the start; a file no path
    /// named at the capture ([`FdState::unnamed`]) becomes an unnamed copy from `store`.
    pub fn restore(
        state: &WasiState,
        mounts: Vec<MountSpec>,
        stdio: Stdio,
        clock: Box<dyn Clock>,
        interrupt: Arc<dyn Fn() -> bool + Send + Sync>,
        store: &dyn Store,
    ) -> Result<Self, String> {
        match (state.stdin_open, &stdio.input_log) {
            (true, None) => {
                return Err("the guest reads input sent to its session while it runs \
                            (an interactive session), which this resume does not give it"
                    .into());
            }
            (false, Some(_)) => {
                return Err("this guest's stdin is not input sent while it runs".into());
            }
            _ => {}
        }
        if crate::input::StoredInput::of(state) != stdio.input {
            return Err(match state.stdin_input {
                Some(k) => format!(
                    "the guest reads its stdin from the stored input {k}, which this resume \
                     does not give it"
                ),
                None => "this guest's stdin is a stream, not stored input".into(),
            });
        }
        if state.unshown_stdout.len().max(state.unshown_stderr.len()) > MAX_UNSHOWN {
            return Err(format!(
                "the snapshot holds more than {MAX_UNSHOWN} bytes of output not yet shown, \
                 more than ferry ever keeps"
            ));
        }
        let mut ordered = Vec::new();
        for m in &state.mounts {
            let grant = mounts
                .iter()
                .find(|g| g.guest_path == m.guest_path)
                .ok_or_else(|| {
                    format!(
                        "the snapshot needs a directory mounted at `{}` (it was `{}`); \
                     grant one with --dir HOST::{}",
                        m.guest_path, m.host_hint, m.guest_path
                    )
                })?;
            // Whether it is carried is the snapshot's to say; the grant gives the directory.
            ordered.push(MountSpec {
                host_bound: m.host_bound,
                ..grant.clone()
            });
        }
        let mut ctx = Self::new(
            state.args.clone(),
            state.env.clone(),
            ordered,
            stdio,
            clock,
            interrupt,
        )?;
        for (rt, m) in ctx.mounts.iter_mut().zip(&state.mounts) {
            if m.not_carried.len() > ferry_object::MAX_NOT_CARRIED {
                return Err(format!(
                    "mount `{}` leaves out {} files (at most {} are allowed)",
                    m.guest_path,
                    m.not_carried.len(),
                    ferry_object::MAX_NOT_CARRIED
                ));
            }
            for p in &m.not_carried {
                if p.is_empty() || path::join("", p).is_err() {
                    return Err(format!(
                        "mount `{}` leaves out an unsafe path `{p}`",
                        m.guest_path
                    ));
                }
            }
            rt.not_carried = m.not_carried.iter().cloned().collect();
        }
        if state.stdin_open {
            ctx.input_pieces = crate::input::StoredInput::of(state)
                .map(|i| i.full_pieces(store))
                .unwrap_or_default();
        }
        ctx.fds.clear();
        for (n, fs) in &state.fds {
            let kind = FdKind::parse(&fs.what)
                .ok_or_else(|| format!("unknown fd kind `{}` in snapshot", fs.what))?;
            if !matches!(kind, FdKind::Stdin | FdKind::Stdout | FdKind::Stderr)
                && fs.mount as usize >= ctx.mounts.len()
            {
                return Err(format!(
                    "fd {n} refers to mount {} that does not exist",
                    fs.mount
                ));
            }
            path::join("", &fs.path).map_err(|_| format!("fd {n} has an unsafe path"))?;
            let mut fd = Fd::new(kind, fs.mount, fs.path.clone());
            (fd.fdflags, fd.read, fd.write, fd.offset) = (fs.fdflags, fs.read, fs.write, fs.offset);
            match (kind, fs.unnamed) {
                (_, None) => {}
                (FdKind::Dir, Some(k)) => {
                    if k != crate::tree::empty_kappa() {
                        return Err(format!(
                            "fd {n}: a directory removed while open holds nothing, but the \
                             snapshot gives it {k}"
                        ));
                    }
                    fd.removed = true;
                }
                (FdKind::File, Some(k)) => {
                    let root = &ctx.mounts[fs.mount as usize].root;
                    let mut f = crate::tree::open_unnamed(store, &k, root)
                        .map_err(|e| format!("fd {n}, a file deleted while open: {e}"))?;
                    f.seek(std::io::SeekFrom::Start(fs.offset))
                        .map_err(|e| format!("fd {n}: {e}"))?;
                    if fs.fdflags & crate::calls::FDFLAG_APPEND != 0 {
                        set_append(&f, true).map_err(|e| format!("fd {n}: {e}"))?;
                    }
                    fd.file = Some(f);
                }
                (_, Some(_)) => {
                    return Err(format!(
                        "fd {n} is a {}, which cannot be held deleted",
                        fs.what
                    ));
                }
            }
            ctx.fds.insert(*n, fd);
        }
        // Opened again now, not at first use: a rename before then is followed.
        let open: Vec<u32> = ctx
            .fds
            .iter()
            .filter(|(_, f)| f.file.is_none() && !f.removed)
            .map(|(n, _)| *n)
            .collect();
        for n in open {
            match ctx.fds[&n].kind {
                FdKind::File => {
                    let _ = ctx.file(n);
                }
                FdKind::Dir => {
                    let f = &ctx.fds[&n];
                    let dir = path::host_path(&ctx.mounts[f.mount as usize].root, &f.path, true)
                        .ok()
                        .and_then(|p| open_dir(&p));
                    ctx.fds.get_mut(&n).expect("listed").dir = dir;
                }
                _ => {}
            }
        }
        let roots: Vec<&Path> = ctx.mounts.iter().map(|m| m.root.as_path()).collect();
        ctx.inodes = crate::inodes::Inodes::restore(&state.inodes, &roots)?;
        let host_now = i128::from(ctx.clock.monotonic_ns());
        ctx.mono_offset = i128::from(state.monotonic_ns) - host_now;
        ctx.stdout_bytes = state.stdout_bytes;
        ctx.stderr_bytes = state.stderr_bytes;
        ctx.stdin_bytes = state.stdin_bytes;
        ctx.sleep_deadline = state.sleep_deadline_ns;
        ctx.unshown = [state.unshown_stdout.clone(), state.unshown_stderr.clone()];
        Ok(ctx)
    }

    /// The mounts, in order: `(guest path, canonical host dir, read-only)`.
    /// Each mount as a spec: guest path, canonical host directory, read-only, host-bound.
    pub fn mounts(&self) -> Vec<MountSpec> {
        self.mounts
            .iter()
            .map(|m| MountSpec {
                guest_path: m.guest_path.clone(),
                host_dir: m.root.clone(),
                read_only: m.read_only,
                host_bound: m.host_bound,
            })
            .collect()
    }

    /// Leaves these host files out of the mounts they lie in (ferry's own stdout and stderr
    /// when they are files in a mount: ferry writes to them after a snapshot, so carrying or
    /// comparing them would only make a resume refuse). At most
    /// [`ferry_object::MAX_NOT_CARRIED`] per mount are kept.
    pub fn leave_out(&mut self, files: &[PathBuf]) {
        for f in files {
            for m in &mut self.mounts {
                if let Some(rel) = mount_relative(&m.root, f)
                    && m.not_carried.len() < ferry_object::MAX_NOT_CARRIED
                {
                    m.not_carried.insert(rel);
                }
            }
        }
    }

    /// Per mount (in mount order), the host paths its snapshots leave out ([`Self::leave_out`]).
    pub fn not_carried(&self) -> Vec<Vec<PathBuf>> {
        self.mounts
            .iter()
            .map(|m| m.not_carried.iter().map(|p| m.root.join(p)).collect())
            .collect()
    }

    /// Captures the state. `trees` are the κ of each mount's content, in mount order. Each
    /// open file and directory is recorded where it is now (the guest may have renamed it);
    /// the content of a file no path names any more is stored in `store`
    /// ([`FdState::unnamed`]).
    pub fn capture(&mut self, trees: &[Kappa], store: &dyn Store) -> Result<WasiState, String> {
        let mut fds = Vec::new();
        let mut empty = None;
        for (n, fd) in self.fds.iter_mut() {
            if let Some(f) = fd.file.as_mut() {
                fd.offset = f.stream_position().map_err(|e| format!("fd {n}: {e}"))?;
            }
            let mut unnamed = None;
            if fd.follow(&self.mounts)
                && let Some(f) = fd.file.as_ref()
            {
                let stamp = crate::tree::Stamp::of_file(f);
                let k = match (&fd.unnamed, stamp) {
                    (Some((seen, k)), Some(now))
                        if *seen == now
                            && now.older_than(crate::tree::SETTLED)
                            && store.has(k).unwrap_or(false) =>
                    {
                        *k
                    }
                    _ => {
                        let what = format!("fd {n} (`{}`, deleted while open)", fd.path);
                        crate::tree::import_unnamed(store, f, &what).map_err(|e| e.to_string())?
                    }
                };
                fd.unnamed = stamp.map(|s| (s, k));
                unnamed = Some(k);
            }
            if fd.kind == FdKind::Dir && fd.removed {
                unnamed = Some(match empty {
                    Some(k) => k,
                    None => *empty.insert(crate::tree::empty(store).map_err(|e| e.to_string())?),
                });
            }
            fds.push((
                *n,
                FdState {
                    what: fd.kind.name().to_owned(),
                    mount: fd.mount,
                    path: fd.path.clone(),
                    offset: fd.offset,
                    fdflags: fd.fdflags,
                    read: fd.read,
                    write: fd.write,
                    unnamed,
                },
            ));
        }
        let roots: Vec<&Path> = self.mounts.iter().map(|m| m.root.as_path()).collect();
        let inodes = self.inodes.capture(&roots);
        // Input sent while the guest runs: all of it so far, read or not, as a blob (up to
        // 1 MiB) or in pieces, of which only the new ones are stored.
        let (stdin_input, stdin_open) = match &self.stdio.input_log {
            Some(log) => {
                let (input, ended) = crate::input::store_log(store, log, &mut self.input_pieces)
                    .map_err(|e| format!("stdin: {e}"))?;
                self.stdio.input = Some(input);
                (Some(input), !ended)
            }
            None => (self.stdio.input, false),
        };
        let (stdin_input, stdin_chunked) = match stdin_input {
            Some(i) => (Some(i.kappa), i.chunked),
            None => (None, false),
        };
        let (kind, v) = ferry_object::header::<WasiState>();
        Ok(WasiState {
            kind,
            v,
            args: self.args.clone(),
            env: self.env.clone(),
            mounts: self
                .mounts
                .iter()
                .zip(trees)
                .map(|(m, t)| Mount {
                    guest_path: m.guest_path.clone(),
                    host_hint: m.root.display().to_string(),
                    tree: *t,
                    read_only: m.read_only,
                    host_bound: m.host_bound,
                    not_carried: m.not_carried.iter().cloned().collect(),
                })
                .collect(),
            fds,
            monotonic_ns: self.monotonic_ns(),
            stdout_bytes: self.stdout_bytes,
            stderr_bytes: self.stderr_bytes,
            stdin_bytes: self.stdin_bytes,
            sleep_deadline_ns: self.sleep_deadline,
            unshown_stdout: self.unshown[0].clone(),
            unshown_stderr: self.unshown[1].clone(),
            stdin_input,
            stdin_open,
            stdin_chunked,
            inodes,
        })
    }

    /// Virtual monotonic time in ns: never goes backwards across suspend and resume.
    pub fn monotonic_ns(&self) -> u64 {
        (i128::from(self.clock.monotonic_ns()) + self.mono_offset).max(0) as u64
    }

    /// The output log stdout and stderr go to, if they are recorded.
    pub fn output_log(&self) -> Option<&crate::OutputBuffer> {
        self.stdio.log.as_ref()
    }

    /// Flushes stdout and stderr.
    pub fn flush(&mut self) {
        for i in 0..2 {
            let _ = self.show_unshown(i);
        }
        let _ = self.stdio.stdout.flush();
        let _ = self.stdio.stderr.flush();
    }

    /// Counts `n` bytes shown on stdout (`i` 0) or stderr (1).
    pub(crate) fn shown(&mut self, i: usize, n: u64) {
        if i == 0 {
            self.stdout_bytes += n;
        } else {
            self.stderr_bytes += n;
        }
    }

    /// Writes what a hung-up terminal refused on stdout (`i` 0) or stderr (1), if the stream
    /// takes it now: `Ok(true)` once nothing is left unshown.
    pub(crate) fn show_unshown(&mut self, i: usize) -> std::io::Result<bool> {
        if self.unshown[i].is_empty() {
            return Ok(true);
        }
        match self.stdio.output(i).write_all(&self.unshown[i]) {
            Ok(()) => {
                let n = self.unshown[i].len() as u64;
                self.unshown[i].clear();
                self.shown(i, n);
                Ok(true)
            }
            Err(e) if hung_up(&e) && self.stdio.terminals[1 + i] => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// What the guest changed in its mounted files since the last call, for a snapshot's
    /// import of them ([`crate::tree::ImportCache::use_guest_writes`]).
    pub fn take_guest_writes(&mut self) -> crate::written::GuestWrites {
        std::mem::take(&mut self.guest_writes)
    }

    /// Records from now on the guest's changes to these files (device, inode), for the next
    /// snapshot: the big files the last one stored in pieces
    /// ([`crate::tree::ImportCache::stored_in_pieces`]), or at a run's start those the
    /// store's import cache knows in pieces ([`crate::tree::ImportCache::saved_in_pieces_under`]).
    /// A record costs two `stat`s per write, and a file's timestamps then change at every
    /// write (a `stat` asks for fine-grained ones), so only files a snapshot would otherwise
    /// read whole are followed.
    pub fn record_writes_to(&mut self, files: std::collections::HashSet<(u64, u64)>) {
        self.recorded = files;
    }

    /// Closes every host file (before a capture's tree import, so all writes are visible).
    pub fn sync_files(&mut self) {
        for fd in self.fds.values_mut() {
            if let Some(f) = fd.file.as_mut() {
                let _ = f.flush();
            }
        }
    }

    pub(crate) fn fd(&mut self, n: u32) -> Result<&mut Fd, Errno> {
        self.fds.get_mut(&n).ok_or(Errno::Badf)
    }
}

impl MountRt {
    fn open(m: MountSpec) -> Result<Self, String> {
        let root = m
            .host_dir
            .canonicalize()
            .map_err(|e| format!("cannot mount `{}`: {e}", m.host_dir.display()))?;
        if !root.is_dir() {
            return Err(format!(
                "cannot mount `{}`: not a directory",
                m.host_dir.display()
            ));
        }
        if !m.guest_path.starts_with('/') && m.guest_path != "." {
            return Err(format!(
                "guest path `{}` must be absolute (or `.`)",
                m.guest_path
            ));
        }
        Ok(Self {
            guest_path: m.guest_path,
            root,
            read_only: m.read_only,
            host_bound: m.host_bound,
            not_carried: BTreeSet::new(),
        })
    }
}

impl Fd {
    /// Brings `mount` and `path` up to date with where the open file or directory is now
    /// ([`place`]); a directory found gone is marked `removed`. Whether no path names it any
    /// more (false for stdio, preopens, and anything not held open).
    pub(crate) fn follow(&mut self, mounts: &[MountRt]) -> bool {
        let handle = match self.kind {
            FdKind::File => self.file.as_ref(),
            FdKind::Dir => self.dir.as_ref(),
            _ => None,
        };
        match handle.map(|h| place(h, mounts, self.mount)) {
            Some(Place::At(m, p)) => (self.mount, self.path) = (m, p),
            Some(Place::Gone) => {
                self.removed |= self.kind == FdKind::Dir;
                return true;
            }
            Some(Place::Unknown) | None => {}
        }
        false
    }

    pub(crate) fn new(kind: FdKind, mount: u32, path: String) -> Self {
        Self {
            kind,
            mount,
            path,
            fdflags: 0,
            read: true,
            write: !matches!(kind, FdKind::Stdin),
            offset: 0,
            file: None,
            inode: None,
            dir: None,
            removed: false,
            listing: None,
            unnamed: None,
        }
    }
}

/// `file`'s path inside the directory `root` (both canonical), `/`-separated; `None` outside
/// it or for `root` itself.
pub(crate) fn mount_relative(root: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(root).ok()?;
    let parts: Vec<&str> = rel
        .components()
        .map(|c| match c {
            std::path::Component::Normal(s) => s.to_str(),
            _ => None,
        })
        .collect::<Option<_>>()?;
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// Most bytes a guest may write to a hung-up terminal before its suspend: beyond, its writes
/// fail as the terminal's do.
pub(crate) const MAX_UNSHOWN: usize = 1 << 20;

/// The error a terminal gives once it has hung up.
pub(crate) fn hung_up(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EIO)
}

/// The host directory at `p` held open (for [`place`]), if it can be.
pub(crate) fn open_dir(p: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(p)
        .ok()
}

/// Turns `O_APPEND` on or off on the open file `f`.
pub(crate) fn set_append(f: &File, on: bool) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    let fd = f.as_raw_fd();
    // SAFETY: `fd` is open for as long as `f` is borrowed; F_GETFL and F_SETFL take no
    // pointers.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let want = if on {
            flags | libc::O_APPEND
        } else {
            flags & !libc::O_APPEND
        };
        if libc::fcntl(fd, libc::F_SETFL, want) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
