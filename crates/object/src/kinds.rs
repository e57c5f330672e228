//! The object kinds. Field names are part of the format: change them only with a version bump.

use std::collections::BTreeMap;

use ferry_kappa::Kappa;
use serde::{Deserialize, Serialize};

use crate::ObjectKind;

/// Size of a memory chunk: one WebAssembly page.
pub const CHUNK_SIZE: u32 = 65536;

macro_rules! kind {
    ($t:ty, $name:literal, $v:literal, |$s:ident| $children:expr) => {
        impl ObjectKind for $t {
            const KIND: &'static str = $name;
            const VERSION: u32 = $v;
            fn children(&self) -> Vec<Kappa> {
                let $s = self;
                $children
            }
        }
    };
}

/// A suspended guest: everything needed to continue it, by κ.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    pub kind: String,
    pub v: u32,
    /// Human name of the program (file name), for `ps` and `inspect`.
    pub program: String,
    /// The original module (blob).
    pub module: Kappa,
    /// The suspendable module derived from it (blob) and the transform version that made it.
    pub instrumented: Kappa,
    pub instrument_version: u32,
    /// One memory image per original memory.
    pub memories: Vec<Kappa>,
    /// Mutable globals by original index.
    pub globals: Vec<GlobalValue>,
    /// The saved call stack (blob): frames as written by the instrumented module.
    pub stack: Kappa,
    /// The export whose call the saved stack belongs to: `_start`, or `ferry:start` when the
    /// guest was suspended inside its start function.
    pub entry: String,
    /// Virtual WASI state (a `ferry.wasi` object).
    pub wasi: Kappa,
    /// What this snapshot needs from the host that resumes it.
    pub profile: Profile,
    /// The previous snapshot of the same run, if any.
    pub parent: Option<Kappa>,
    /// How many times this run has been suspended or checkpointed before, this one included.
    pub generation: u64,
    /// The guest's whole output so far (a `ferry.log` object), for guests whose output a
    /// space records (sessions of `ferry serve`); absent when the output went straight to a
    /// terminal or pipe. Absent fields are not encoded, so snapshots without it keep their κ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<Kappa>,
    /// For a WASI reactor (no `_start`): the export the run calls after `_initialize`, an
    /// `() -> i32` or `() -> ()` function whose result is the exit code. Absent for commands
    /// (`_start`), and then not encoded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main: Option<String>,
}
kind!(Snapshot, "ferry.snapshot", 1, |s| {
    let mut c = vec![s.module, s.instrumented, s.stack, s.wasi];
    c.extend(s.memories.iter().copied());
    c.extend(s.parent);
    c.extend(s.output);
    c
});

/// Size of an output-log chunk.
pub const LOG_CHUNK_SIZE: u32 = 65536;

/// A guest's output event log: stdout and stderr writes in order, as records
/// `[u8 stream (1 stdout, 2 stderr)][u32 LE length][bytes]`, cut into chunks of
/// `chunk_size` bytes (every chunk full but the last), so consecutive snapshots of a session
/// share all but their last chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputLog {
    pub kind: String,
    pub v: u32,
    pub len: u64,
    pub chunk_size: u32,
    pub chunks: Vec<Kappa>,
}
kind!(OutputLog, "ferry.log", 1, |s| s.chunks.clone());

/// `P(S)`: what a host must provide to resume a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Host contract version, e.g. `ferry-host/1`.
    pub runtime: String,
    /// Engine class: the Wasm features the instrumented module needs.
    pub engine_class: String,
    /// Capabilities the guest had: `mount:/guest/path`, `env`, `stdin`.
    pub capabilities: Vec<String>,
    /// `true` if the snapshot depends on something of the host that took it.
    pub host_bound: bool,
}

/// One mutable global's value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GlobalValue {
    pub index: u32,
    /// `i32`, `i64`, `f32`, `f64` or `v128`.
    pub ty: String,
    /// Little-endian bits (4, 8 or 16 bytes).
    #[serde(with = "serde_bytes")]
    pub bits: Vec<u8>,
}

/// A linear memory, chunked: only non-zero chunks are listed, zero chunks cost nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryImage {
    pub kind: String,
    pub v: u32,
    /// Length in bytes (a multiple of the page size).
    pub len: u64,
    pub chunk_size: u32,
    /// `(chunk index, κ of the chunk blob)`, ascending by index.
    pub chunks: Vec<(u32, Kappa)>,
}
kind!(MemoryImage, "ferry.memory", 1, |s| s
    .chunks
    .iter()
    .map(|(_, k)| *k)
    .collect());

/// A directory tree: names to files and subtrees. Version 1 holds every file as one blob;
/// version 2 (only a tree with a chunked file: a file's content as a [`FileChunks`]) is what
/// makes a ferry that does not know chunked files refuse the tree instead of misreading it;
/// version 3 (a tree with a file's modification time, [`TreeEntry::mtime_ns`]) the same for
/// times, and version 4 (a tree with a [`MODE_LINK`] entry: another name of a file) for hard
/// links.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tree {
    pub kind: String,
    pub v: u32,
    pub entries: BTreeMap<String, TreeEntry>,
}
impl crate::ObjectKind for Tree {
    const KIND: &'static str = "ferry.tree";
    const VERSION: u32 = 1;
    const NEWEST: u32 = 4;
    fn children(&self) -> Vec<Kappa> {
        self.entries.values().map(|e| e.object).collect()
    }
}

/// Tree entry modes: a file (one blob), an executable file, the same two held as a
/// [`FileChunks`], a subtree, a symlink (its target as the blob), another name of a file
/// the tree holds under an earlier path (a hard link; that path, from the tree's root with
/// `/` between names, as the blob).
pub const MODE_FILE: &str = "file";
pub const MODE_EXEC: &str = "exec";
pub const MODE_FILE_CHUNKS: &str = "file-chunks";
pub const MODE_EXEC_CHUNKS: &str = "exec-chunks";
pub const MODE_DIR: &str = "dir";
pub const MODE_SYMLINK: &str = "symlink";
pub const MODE_LINK: &str = "link";

impl Tree {
    /// The version a tree with these entries has: 4 if one of them is a [`MODE_LINK`], else
    /// 3 if one of them has a modification time, else 2 if one of them is a chunked file,
    /// else 1.
    pub fn version_for(entries: &BTreeMap<String, TreeEntry>) -> u32 {
        if entries.values().any(|e| e.mode == MODE_LINK) {
            4
        } else if entries.values().any(|e| e.mtime_ns.is_some()) {
            3
        } else if entries.values().any(TreeEntry::chunked) {
            2
        } else {
            1
        }
    }

    /// Refuses an entry mode this version does not have, a time on an entry that is not a
    /// file, and a tree whose version its entries do not call for (each content has one
    /// tree, so one κ).
    pub fn check(&self) -> Result<(), String> {
        for (name, e) in &self.entries {
            let known = [MODE_FILE, MODE_EXEC, MODE_DIR, MODE_SYMLINK].contains(&e.mode.as_str())
                || (self.v >= 2 && e.chunked())
                || (self.v >= 4 && e.mode == MODE_LINK);
            if !known {
                return Err(format!(
                    "tree entry `{name}` has mode `{}`, which a version {} tree does not have",
                    e.mode, self.v
                ));
            }
            if e.mtime_ns.is_some()
                && (e.mode == MODE_DIR || e.mode == MODE_SYMLINK || e.mode == MODE_LINK)
            {
                return Err(format!(
                    "tree entry `{name}` is a {} with a modification time (only files have one)",
                    e.mode
                ));
            }
        }
        if self.v != Self::version_for(&self.entries) {
            return Err(format!(
                "a version {} tree whose entries make it version {}",
                self.v,
                Self::version_for(&self.entries)
            ));
        }
        Ok(())
    }
}

/// One entry of a [`Tree`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TreeEntry {
    /// `file`, `exec` (executable file), `file-chunks` / `exec-chunks` (the same, the object
    /// a [`FileChunks`]), `dir`, `symlink` (target as the blob) or `link` (the path of the
    /// file's first name as the blob: [`MODE_LINK`]).
    pub mode: String,
    pub object: Kappa,
    /// A file's modification time, in nanoseconds since the Unix epoch (before it:
    /// negative); absent for directories, symlinks and links, and in trees before version 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtime_ns: Option<i64>,
}

impl TreeEntry {
    /// Whether the entry is a file held as a [`FileChunks`].
    pub fn chunked(&self) -> bool {
        self.mode == MODE_FILE_CHUNKS || self.mode == MODE_EXEC_CHUNKS
    }
}

/// Size of a chunk of a [`FileChunks`] (1 MiB).
pub const FILE_CHUNK_SIZE: u32 = 1 << 20;
/// Largest file a [`FileChunks`] holds (1 TiB: its list of chunks stays within an object's
/// size limit).
pub const MAX_CHUNKED_FILE: u64 = 1 << 40;

/// A file too large to be one blob, as the blobs of its consecutive chunks: every chunk
/// `chunk_size` bytes but the last. Chunks alike (zeros) are one object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileChunks {
    pub kind: String,
    pub v: u32,
    pub len: u64,
    pub chunk_size: u32,
    pub chunks: Vec<Kappa>,
}
kind!(FileChunks, "ferry.file", 1, |s| s.chunks.clone());

impl FileChunks {
    /// The `len` bytes whose consecutive [`FILE_CHUNK_SIZE`] pieces are `chunks`.
    pub fn new(len: u64, chunks: Vec<Kappa>) -> Self {
        let (kind, v) = header::<Self>();
        Self {
            kind,
            v,
            len,
            chunk_size: FILE_CHUNK_SIZE,
            chunks,
        }
    }

    /// Refuses a chunk size other than [`FILE_CHUNK_SIZE`], a length over
    /// [`MAX_CHUNKED_FILE`] or a chunk count that does not match the length.
    pub fn check(&self) -> Result<(), String> {
        if self.chunk_size != FILE_CHUNK_SIZE {
            return Err(format!(
                "chunked file with {}-byte chunks (ferry uses {FILE_CHUNK_SIZE})",
                self.chunk_size
            ));
        }
        if self.len > MAX_CHUNKED_FILE {
            return Err(format!(
                "chunked file of {} bytes (at most {MAX_CHUNKED_FILE})",
                self.len
            ));
        }
        let want = self.len.div_ceil(u64::from(self.chunk_size));
        if self.chunks.len() as u64 != want {
            return Err(format!(
                "chunked file of {} bytes lists {} chunks, not {want}",
                self.len,
                self.chunks.len()
            ));
        }
        Ok(())
    }

    /// The length of chunk `i`.
    pub fn chunk_len(&self, i: usize) -> u64 {
        let size = u64::from(self.chunk_size);
        (self.len - i as u64 * size).min(size)
    }
}

/// The virtual WASI state of a guest at a safe point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WasiState {
    pub kind: String,
    pub v: u32,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub mounts: Vec<Mount>,
    pub fds: Vec<(u32, FdState)>,
    /// Virtual monotonic clock (ns) at capture; resumes continue from here.
    pub monotonic_ns: u64,
    /// Bytes the guest has written to stdout and stderr and read from stdin so far.
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub stdin_bytes: u64,
    /// A sleep in progress (absolute virtual monotonic deadline, ns), if suspended inside one.
    pub sleep_deadline_ns: Option<u64>,
    /// What the guest wrote to stdout / stderr on a terminal that had hung up (the writes
    /// failed there while the suspend the hangup asks for was on its way): not yet shown, so
    /// written first when the resumed guest next writes there or ends. Absent when empty, so
    /// snapshots without any encode as before; a ferry that predates the fields refuses them.
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "serde_bytes")]
    pub unshown_stdout: Vec<u8>,
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "serde_bytes")]
    pub unshown_stderr: Vec<u8>,
    /// The guest's whole stdin as a blob, when it was given as data rather than a stream (a
    /// space session run with `--stdin FILE`): a resume anywhere reads on from `stdin_bytes`
    /// into it. Absent otherwise, so other snapshots encode as before; a ferry that predates
    /// the field refuses an object carrying it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin_input: Option<Kappa>,
    /// `stdin_input` is input sent to the guest while it runs (an interactive session of a
    /// space) and more may come: a resume reads on from `stdin_bytes` and then waits for the
    /// rest, rather than meeting the end of its stdin. Absent when false, so other snapshots
    /// encode as before; a ferry that predates the field refuses an object carrying it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stdin_open: bool,
    /// `stdin_input` names a [`FileChunks`] (the input in 1 MiB pieces), not a blob: input
    /// sent to an interactive session over 1 MiB, so a snapshot taken after more arrived
    /// stores (and a standby or move sends) only the pieces that are new. Absent when false,
    /// so other snapshots encode as before; a ferry that predates the field refuses an
    /// object carrying it (rather than reading the list of pieces as the input).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stdin_chunked: bool,
    /// The device and inode numbers the guest was shown for files and directories of its
    /// mounts, by where they are at capture: a resume shows the same numbers for them,
    /// whatever the destination's own are. Sorted by mount and path, at most
    /// [`MAX_INODE_NAMES`]. Absent when empty, so other snapshots encode as before; a ferry
    /// that predates the field refuses an object carrying it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inodes: Vec<InodeName>,
}
kind!(WasiState, "ferry.wasi", 1, |s| s
    .mounts
    .iter()
    .map(|m| m.tree)
    .chain(s.stdin_input)
    .chain(s.fds.iter().filter_map(|(_, f)| f.unnamed))
    .collect());

/// A host directory mounted into the guest, as it was when the snapshot was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mount {
    pub guest_path: String,
    /// The host directory at capture: a hint for humans, never authority.
    pub host_hint: String,
    /// Content of the directory at capture (the empty tree when `host_bound`).
    pub tree: Kappa,
    pub read_only: bool,
    /// A pass-through mount (`ferry run --bind`): the guest used the host's directory as it
    /// was, and the snapshot does not carry its content. Absent when false, so snapshots
    /// without one encode as before; a ferry that predates the field refuses the object.
    #[serde(default, skip_serializing_if = "is_false")]
    pub host_bound: bool,
    /// Files in the directory that ferry's own stdout or stderr went to during the run
    /// (`ferry run prog > out.txt` inside a mount): mount-relative paths, at most
    /// [`MAX_NOT_CARRIED`]. The tree leaves them out and a resume does not compare them —
    /// ferry appends to them after the snapshot. Absent when empty, as for `host_bound`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_carried: Vec<String>,
}

/// A file or directory of a mount and the device and inode numbers the guest knows it by
/// ([`WasiState::inodes`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InodeName {
    /// Index into [`WasiState::mounts`].
    pub mount: u32,
    /// Path inside the mount (`/`-separated, no `..`; empty: the mount's own directory).
    pub path: String,
    pub dev: u64,
    pub ino: u64,
}

/// Most names a snapshot keeps inode numbers for ([`WasiState::inodes`]).
pub const MAX_INODE_NAMES: usize = 100_000;

/// Most files one mount may leave out of its tree ([`Mount::not_carried`]).
pub const MAX_NOT_CARRIED: usize = 16;

fn is_false(b: &bool) -> bool {
    !*b
}

/// One open file descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FdState {
    /// `stdin`, `stdout`, `stderr`, `preopen`, `file`, `dir`.
    pub what: String,
    pub mount: u32,
    /// Path inside the mount (`/`-separated, no `..`).
    pub path: String,
    pub offset: u64,
    /// WASI fdflags (append, nonblock, …).
    pub fdflags: u16,
    pub read: bool,
    pub write: bool,
    /// The file or directory no path in the mounts names any more: deleted, or replaced by a
    /// rename, while the guest held it open (`path` is then where it was). A tree: for a file,
    /// one entry [`UNNAMED_ENTRY`] holding its content (a file or file-chunks entry); for a
    /// directory, the empty tree (only an empty one can be removed). A resume gives the fd
    /// an unnamed copy of the file, or a directory in which every lookup fails. Absent
    /// otherwise, so other snapshots encode as before; a ferry that predates the field
    /// refuses an object carrying it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unnamed: Option<Kappa>,
}

/// The one entry of an [`FdState::unnamed`] tree of a file.
pub const UNNAMED_ENTRY: &str = "content";

/// Builds the `kind`/`v` pair for a new object of kind `T`.
pub fn header<T: ObjectKind>() -> (String, u32) {
    (T::KIND.to_owned(), T::VERSION)
}
