use std::path::PathBuf;

use ferry_kappa::Kappa;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("object {0} is not in the store")]
    NotFound(Kappa),
    #[error(
        "object {kappa} is corrupt: its bytes hash to {actual} (at {where_}); \
         run `ferry store verify` and fetch the object again"
    )]
    Corrupt {
        kappa: Kappa,
        actual: Kappa,
        where_: String,
    },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("ref `{name}` changed concurrently (expected {expected}, found {found})")]
    CasMismatch {
        name: String,
        expected: String,
        found: String,
    },
    #[error("`{0}` is not a valid ref name")]
    BadRefName(String),
    #[error("ref file `{0}` is malformed")]
    BadRef(String),
    #[error("pack file is damaged: {0}; run `ferry store verify`")]
    BadPack(String),
    #[error("object {kappa} is {actual} bytes, expected {expected}")]
    WrongLength {
        kappa: Kappa,
        expected: usize,
        actual: usize,
    },
    #[error("`{0}` is not a κ or a κ prefix (give at least 4 hex digits)")]
    BadPrefix(String),
    #[error("no object in the store starts with `{0}`")]
    NoMatch(String),
    #[error("`{0}` matches {1} objects; give more digits")]
    Ambiguous(String, usize),
    #[error("remote store: {0}")]
    Remote(String),
    /// A remote store refused an object whose bytes do not hash to its κ; `kappa` is the
    /// object it names (the space's `Ferry-Refused-Object` header), `why` its reason.
    #[error("remote store: {why}")]
    RemoteRefusedObject { kappa: Kappa, why: String },
    #[error(
        "the store at {} is in use by another ferry process (a running session, `ferry serve`, \
         an import, …); run this again when nothing else uses it",
        .0.display()
    )]
    InUse(PathBuf),
}

impl StoreError {
    /// Wraps an I/O error of `op` on `path`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { op, path, source }
    }

    /// `Ok` if `bytes`, read for `kappa` at `where_`, hash to it; else [`Self::Corrupt`].
    pub fn check_hash(
        kappa: &Kappa,
        bytes: &[u8],
        where_: impl FnOnce() -> String,
    ) -> Result<(), Self> {
        Self::check_actual(kappa, Kappa::of(bytes), where_)
    }

    /// [`Self::check_hash`] for bytes already hashed (streamed) to `actual`.
    pub fn check_actual(
        kappa: &Kappa,
        actual: Kappa,
        where_: impl FnOnce() -> String,
    ) -> Result<(), Self> {
        if actual == *kappa {
            return Ok(());
        }
        Err(Self::Corrupt {
            kappa: *kappa,
            actual,
            where_: where_(),
        })
    }
}
