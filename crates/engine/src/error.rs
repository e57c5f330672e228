use ferry_kappa::Kappa;

/// A step of the resume transition (DESIGN §1.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Resolving,
    Verifying,
    Admitting,
    Restoring,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Resolving => "resolving",
            Stage::Verifying => "verifying",
            Stage::Admitting => "admitting",
            Stage::Restoring => "restoring",
        })
    }
}

/// The exit code of a guest that trapped (C's `abort()`, an access out of bounds):
/// 128 + SIGABRT, as `wasmtime run` ends it, so a crash is told from a host failure.
pub const EXIT_TRAPPED: i32 = 134;

/// Why preparing, running, capturing or resuming a guest failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Instrument(#[from] ferry_instrument::InstrumentError),
    #[error(transparent)]
    Imports(#[from] crate::ImportError),
    #[error(transparent)]
    Store(#[from] ferry_store::StoreError),
    #[error("compiling the module failed: {0}")]
    Compile(String),
    #[error("instantiating the module failed: {0}")]
    Instantiate(String),
    /// A WebAssembly trap in the guest: `ferry run` then exits [`EXIT_TRAPPED`], as
    /// `wasmtime run` does.
    #[error("guest trapped: {0}")]
    Trap(String),
    /// A host function failed while the guest ran, or the host could not drive it.
    #[error("the host failed while the guest ran: {0}")]
    Host(String),
    #[error("resume refused while {stage}: {reason}")]
    Refused { stage: Stage, reason: String },
    #[error("snapshot {0} could not be written: {1}")]
    Capture(String, String),
    #[error("{0}")]
    Io(String),
    /// Stopped at a safe point without a snapshot, as asked
    /// ([`Control::end_without_snapshot`](crate::Control::end_without_snapshot)): this one
    /// could not be written.
    #[error("stopped without a snapshot ({0})")]
    Unsaved(String),
}

impl EngineError {
    pub(crate) fn refused(stage: Stage, reason: impl std::fmt::Display) -> Self {
        Self::Refused {
            stage,
            reason: reason.to_string(),
        }
    }

    pub(crate) fn missing(stage: Stage, what: &str, k: &Kappa) -> Self {
        Self::refused(stage, format!("{what} {k} is missing from the store"))
    }
}
