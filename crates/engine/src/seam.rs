//! The engine seam: what ferry needs from a WebAssembly engine. Both engines — wasmtime
//! ([`crate::jit`]) and wasmi ([`crate::interp`]) — implement these traits; the run loop,
//! capture and restore above them never know which engine runs.

use std::sync::Arc;

use crate::error::EngineError;
use crate::host::HostState;

/// Which engine runs guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineKind {
    /// wasmtime (Cranelift JIT), the default.
    Jit,
    /// wasmi, a pure-Rust interpreter: for hosts that forbid JIT, and the proof that
    /// snapshots are engine-neutral.
    Interp,
}

impl EngineKind {
    pub const ALL: [EngineKind; 2] = [EngineKind::Jit, EngineKind::Interp];

    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Jit => "jit",
            EngineKind::Interp => "interp",
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for EngineKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "jit" | "wasmtime" => Ok(EngineKind::Jit),
            "interp" | "wasmi" => Ok(EngineKind::Interp),
            _ => Err(format!("unknown engine `{s}` (expected `jit` or `interp`)")),
        }
    }
}

/// The value of a global, engine-neutral (floats and vectors as their bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    I32(i32),
    I64(i64),
    F32(u32),
    F64(u64),
    V128(u128),
}

/// Why a call into the guest did not return normally.
#[derive(Debug)]
pub enum Stop {
    /// The guest called `proc_exit` with this code.
    Exit(i32),
    /// The guest trapped (a WebAssembly trap: `unreachable`, an access out of bounds, the
    /// stack exhausted, …); the report says which, and where when the engine knows.
    Trap(TrapReport),
    /// A host function failed, or the call could not be made; the message says why.
    Fatal(String),
}

/// Frames of a trapped guest's call stack shown (a deep recursion would print thousands of
/// identical lines).
const FRAMES_SHOWN: usize = 8;

/// A trap as ferry reports it: its cause in the WebAssembly specification's wording, then
/// (from engines that give one) the guest's call stack, innermost first, by function name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrapReport {
    pub cause: String,
    /// The innermost frames (at most [`FRAMES_SHOWN`]).
    pub frames: Vec<TrapFrame>,
    /// How many frames the stack had in all.
    pub depth: usize,
}

/// One frame of a [`TrapReport`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrapFrame {
    /// Index of the function in the instrumented module.
    pub func: u32,
    pub name: Option<String>,
    /// Offset in the instrumented module (only with `FERRY_ADDRESS_MAP=1`).
    pub offset: Option<usize>,
}

impl TrapReport {
    /// A trap without a call stack.
    pub fn bare(cause: impl Into<String>) -> Self {
        Self {
            cause: cause.into(),
            frames: Vec::new(),
            depth: 0,
        }
    }

    /// The report of a trap whose call stack is `frames`, innermost first (all of them).
    pub fn with_frames(cause: impl Into<String>, mut frames: Vec<TrapFrame>) -> Self {
        let depth = frames.len();
        frames.truncate(FRAMES_SHOWN);
        Self {
            cause: cause.into(),
            frames,
            depth,
        }
    }

    /// Frames that run in a rewind copy (after a resume, until they return) are shown as the
    /// function they copy, as an uninterrupted run shows them: `wasm` is the instrumented
    /// module ([`ferry_instrument::frame_functions`]).
    pub fn name_rewind_copies(&mut self, wasm: &[u8]) {
        let unnamed: Vec<u32> = self
            .frames
            .iter()
            .filter(|f| f.name.is_none())
            .map(|f| f.func)
            .collect();
        if unnamed.is_empty() {
            return;
        }
        let Some(shown) = ferry_instrument::frame_functions(wasm, &unnamed) else {
            return;
        };
        let by_index: std::collections::HashMap<u32, (u32, Option<String>)> =
            unnamed.into_iter().zip(shown).collect();
        for f in self.frames.iter_mut().filter(|f| f.name.is_none()) {
            if let Some((func, name)) = by_index.get(&f.func) {
                (f.func, f.name) = (*func, name.clone());
            }
        }
    }
}

impl std::fmt::Display for TrapReport {
    /// A function without a name is given by its index in the instrumented module, which is
    /// not the program's own: no number is shown that the user could take for one of theirs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.cause)?;
        if self.frames.is_empty() {
            return Ok(());
        }
        f.write_str("\nguest call stack, innermost first:")?;
        for (i, fr) in self.frames.iter().enumerate() {
            match &fr.name {
                Some(name) => write!(f, "\n  {i}: {name}")?,
                None => write!(
                    f,
                    "\n  {i}: (no name: function {} of the instrumented module)",
                    fr.func
                )?,
            }
            if let Some(at) = fr.offset {
                write!(f, " at 0x{at:x}")?;
            }
        }
        if self.depth > self.frames.len() {
            write!(
                f,
                "\n  ... and {} outer frames",
                self.depth - self.frames.len()
            )?;
        }
        Ok(())
    }
}

/// An engine: turns module bytes into something it can instantiate.
pub(crate) trait Backend: Send + Sync + std::fmt::Debug {
    fn kind(&self) -> EngineKind;
    /// The engine classes (see [`crate::ENGINE_CLASS`]) whose snapshots this engine can run.
    fn engine_classes(&self) -> &'static [&'static str] {
        &[crate::ENGINE_CLASS]
    }
    /// Compiles (or, for an interpreter, decodes) the module `bytes` returns, asking for it
    /// only when it is needed (not on a cache hit). `cache_key` names the module for a
    /// machine-local compiled-code cache; `None` means do not cache.
    fn compile(
        &self,
        cache_key: Option<&str>,
        bytes: &mut dyn FnMut() -> Result<Vec<u8>, EngineError>,
        progress: &(dyn Fn(&str) + Sync),
    ) -> Result<Arc<dyn Compiled>, EngineError>;
}

/// A module an engine has compiled.
pub(crate) trait Compiled: Send + Sync {
    /// A fresh instance with ferry's host functions linked in. `instrumented` says whether the
    /// module carries the unwind machinery (`ferry:ctl`, `ferry:stack`, `ferry:state`,
    /// `ferry:sp`), which the host functions then use.
    fn instantiate(
        &self,
        host: HostState,
        instrumented: bool,
    ) -> Result<Box<dyn Instance>, EngineError>;
}

/// A live instance: exports by name, and the host state it owns.
pub(crate) trait Instance {
    fn host(&mut self) -> &mut HostState;
    /// Names of all exports.
    fn export_names(&mut self) -> Vec<String>;
    /// Whether a `() -> ()` or `() -> i32` function with this name is exported.
    fn has_func(&mut self, name: &str) -> bool;
    /// Calls the exported function `name`: `() -> ()`, or `() -> i32` (a reactor's entry that
    /// returns its exit code: `Some(code)`).
    fn call(&mut self, name: &str) -> Result<Option<i32>, Stop>;
    fn memory(&mut self, name: &str) -> Option<&[u8]>;
    fn memory_mut(&mut self, name: &str) -> Option<&mut [u8]>;
    /// Grows memory `name` by `pages` 64 KiB pages.
    fn grow(&mut self, name: &str, pages: u64) -> Result<(), String>;
    /// Replaces bytes `at..at + len` of memory `name` with a private copy-on-write mapping of
    /// `file` from `offset` (all page-aligned; the file at least that long). `Ok(false)`: not
    /// done, the memory is as it was (this engine's memories cannot be mapped). `Err`: the
    /// bytes were lost and the instance must not run.
    fn map_file(
        &mut self,
        name: &str,
        at: usize,
        file: &std::fs::File,
        offset: u64,
        len: usize,
    ) -> Result<bool, String> {
        let _ = (name, at, file, offset, len);
        Ok(false)
    }
    /// Whether the guest's memory 0 stays where it is for the instance's life, grown in place:
    /// another thread may then read it while the guest runs (pre-writing).
    fn memory_stays_put(&self) -> bool;
    /// The value of global `name` (`None`: no such global, or it holds a reference).
    fn global(&mut self, name: &str) -> Option<Value>;
    fn set_global(&mut self, name: &str, v: Value) -> Result<(), String>;
}
