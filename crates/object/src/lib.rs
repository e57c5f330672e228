//! The object kinds a ferry snapshot is made of, and their canonical encodings.
//!
//! Every structured object is a DAG-CBOR map with a `kind` and a `v` (format version) field;
//! [`decode`] checks both before it parses the rest, so a newer or foreign object is refused
//! with its kind and version named, never misread. Raw data — module bytes, memory chunks,
//! file contents, the saved stack — are *blobs*: their κ is BLAKE3 of the bytes themselves.
//! The format is specified in `docs/format.md`.

mod kinds;

pub use kinds::*;

use ferry_kappa::{CodecError, Kappa};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A structured object kind with a fixed name and version.
pub trait ObjectKind: Serialize + DeserializeOwned {
    /// The `kind` field, e.g. `ferry.snapshot`.
    const KIND: &'static str;
    /// The only `v` this build reads and writes.
    const VERSION: u32;
    /// Every κ this object refers to (its direct children in the closure).
    fn children(&self) -> Vec<Kappa>;
}

/// Why an object could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error("expected a `{expected}` object, found `{found}`")]
    WrongKind {
        expected: &'static str,
        found: String,
    },
    #[error(
        "`{kind}` object has format version {found}; this ferry reads version {supported} \
         (upgrade ferry, or take the snapshot again with this version)"
    )]
    UnsupportedVersion {
        kind: &'static str,
        found: u32,
        supported: u32,
    },
}

#[derive(serde::Deserialize)]
struct Header {
    kind: String,
    v: u32,
}

/// Encodes an object to canonical bytes.
pub fn encode<T: ObjectKind>(object: &T) -> Vec<u8> {
    ferry_kappa::encode(object).expect("ferry objects always encode")
}

/// Decodes and checks kind and version before the body.
pub fn decode<T: ObjectKind>(bytes: &[u8]) -> Result<T, ObjectError> {
    if bytes.len() > ferry_kappa::MAX_OBJECT_BYTES {
        return Err(CodecError::TooLarge(bytes.len()).into());
    }
    let header: Header = serde_ipld_dagcbor::from_slice(bytes)
        .map_err(|e| CodecError::Decode(format!("no kind/version header: {e}")))?;
    if header.kind != T::KIND {
        return Err(ObjectError::WrongKind {
            expected: T::KIND,
            found: header.kind,
        });
    }
    if header.v != T::VERSION {
        return Err(ObjectError::UnsupportedVersion {
            kind: T::KIND,
            found: header.v,
            supported: T::VERSION,
        });
    }
    Ok(ferry_kappa::decode(bytes)?)
}
