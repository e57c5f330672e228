//! The canonical codec: deterministic DAG-CBOR (RFC 8949 §4.2 core deterministic encoding as
//! profiled by IPLD's DAG-CBOR: shortest integers, definite lengths, map keys sorted by length
//! then bytes, no floats needed by ferry objects).
//!
//! [`decode`] bounds the input size and refuses any input whose re-encoding differs from the
//! input, so "canonical" is checked, not assumed.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Largest encoded object ferry will decode (64 MiB). Memory chunks are far smaller; this only
/// bounds what an untrusted peer can make us allocate.
pub const MAX_OBJECT_BYTES: usize = 64 << 20;

/// Why bytes could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("could not encode object: {0}")]
    Encode(String),
    #[error("object is not valid DAG-CBOR for this kind: {0}")]
    Decode(String),
    #[error("object is {0} bytes, more than the limit of {MAX_OBJECT_BYTES}")]
    TooLarge(usize),
    #[error("object bytes are valid but not canonical (re-encoding differs)")]
    NotCanonical,
}

/// Encodes `value` to its canonical bytes.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
    serde_ipld_dagcbor::to_vec(value).map_err(|e| CodecError::Encode(e.to_string()))
}

/// Decodes canonical bytes, refusing oversized or non-canonical input.
pub fn decode<T: Serialize + DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    if bytes.len() > MAX_OBJECT_BYTES {
        return Err(CodecError::TooLarge(bytes.len()));
    }
    let value: T =
        serde_ipld_dagcbor::from_slice(bytes).map_err(|e| CodecError::Decode(e.to_string()))?;
    if encode(&value)? != bytes {
        return Err(CodecError::NotCanonical);
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Sample {
        name: String,
        n: u64,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        map: BTreeMap<String, u32>,
        opt: Option<i64>,
    }

    proptest! {
        #[test]
        fn round_trip_is_identity(name in ".{0,20}", n: u64, data in proptest::collection::vec(any::<u8>(), 0..64),
                                  map in proptest::collection::btree_map(".{0,8}", any::<u32>(), 0..6), opt: Option<i64>) {
            let s = Sample { name, n, data, map, opt };
            let bytes = encode(&s).unwrap();
            let back: Sample = decode(&bytes).unwrap();
            prop_assert_eq!(&back, &s);
            prop_assert_eq!(encode(&back).unwrap(), bytes);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode::<Sample>(&bytes);
        }
    }

    #[test]
    fn non_canonical_integer_is_refused() {
        // 0x18 0x01 encodes 1 in two bytes; canonical is the single byte 0x01.
        assert!(matches!(
            decode::<u64>(&[0x18, 0x01]),
            Err(CodecError::NotCanonical | CodecError::Decode(_))
        ));
        assert_eq!(decode::<u64>(&[0x01]).unwrap(), 1);
    }
}
