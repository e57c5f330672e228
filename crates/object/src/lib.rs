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
    /// The `v` this build writes (and the oldest it reads).
    const VERSION: u32;
    /// The newest `v` this build reads (and writes where an object needs it: a [`Tree`] with
    /// a hard link is version 4, else with a file's time version 3, else with a chunked file
    /// version 2, else version 1).
    const NEWEST: u32 = Self::VERSION;
    /// Every κ this object refers to (its direct children in the closure).
    fn children(&self) -> Vec<Kappa>;
}

/// Why an object could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error("{0}, not a ferry object")]
    NotAnObject(&'static str),
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
    ferry_kappa::codec::check_depth(bytes)?;
    // Blobs are stored beside objects: name what was given instead, when it is one.
    if bytes.starts_with(b"\0asm") {
        return Err(ObjectError::NotAnObject("a WebAssembly module"));
    }
    let header: Header = serde_ipld_dagcbor::from_slice(bytes).map_err(|e| {
        if bytes.first().is_some_and(|b| b >> 5 != 5) {
            // Not even a CBOR map: raw bytes (a memory chunk, a saved stack, a file).
            ObjectError::NotAnObject("raw bytes (a memory chunk, a saved stack or a file)")
        } else {
            CodecError::Decode(format!("no kind/version header: {e}")).into()
        }
    })?;
    if header.kind != T::KIND {
        return Err(ObjectError::WrongKind {
            expected: T::KIND,
            found: header.kind,
        });
    }
    if !(T::VERSION..=T::NEWEST).contains(&header.v) {
        return Err(ObjectError::UnsupportedVersion {
            kind: T::KIND,
            found: header.v,
            supported: T::NEWEST,
        });
    }
    Ok(ferry_kappa::decode(bytes)?)
}

/// Decodes `bytes` as every object kind, discarding the results: the fuzzing entry point
/// (`fuzz/fuzz_targets/decode_objects.rs`, and the property test below on stable).
pub fn fuzz_decode(bytes: &[u8]) {
    let _ = decode::<Snapshot>(bytes);
    let _ = decode::<MemoryImage>(bytes);
    let _ = decode::<Tree>(bytes);
    let _ = decode::<WasiState>(bytes);
    let _ = decode::<OutputLog>(bytes);
    if let Ok(t) = decode::<Tree>(bytes) {
        let _ = t.check();
    }
    if let Ok(f) = decode::<FileChunks>(bytes) {
        let _ = f.check();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Snapshot {
        let (kind, v) = header::<Snapshot>();
        let k = Kappa::of(b"x");
        Snapshot {
            kind,
            v,
            program: "p.wasm".into(),
            module: k,
            instrumented: k,
            instrument_version: 2,
            memories: vec![k, k],
            globals: vec![GlobalValue {
                index: 0,
                ty: "i32".into(),
                bits: vec![1, 0, 0, 0],
            }],
            stack: k,
            entry: "_start".into(),
            wasi: k,
            profile: Profile {
                runtime: "ferry-host/1".into(),
                engine_class: "wasm-core-2+multi-memory".into(),
                capabilities: vec!["env".into()],
                host_bound: false,
            },
            parent: None,
            generation: 3,
            output: None,
            main: None,
        }
    }

    #[test]
    fn snapshot_round_trips_and_kind_is_checked() {
        let s = sample();
        let bytes = encode(&s);
        assert_eq!(decode::<Snapshot>(&bytes).unwrap(), s);
        assert!(matches!(
            decode::<MemoryImage>(&bytes),
            Err(ObjectError::WrongKind { .. })
        ));
    }

    proptest! {
        #[test]
        fn mutated_objects_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
                                       cut in any::<usize>()) {
            let mut bytes = encode(&sample());
            for (at, x) in flips {
                let n = bytes.len();
                bytes[at % n] ^= x;
            }
            let cut = cut % (bytes.len() + 1);
            fuzz_decode(&bytes[..cut]);
            fuzz_decode(&bytes);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            fuzz_decode(&bytes);
        }
    }
}
