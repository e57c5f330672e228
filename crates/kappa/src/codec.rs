//! The canonical codec: deterministic DAG-CBOR (RFC 8949 §4.2 core deterministic encoding as
//! profiled by IPLD's DAG-CBOR: shortest integers, definite lengths, map keys sorted by length
//! then bytes, no floats needed by ferry objects).
//!
//! [`decode`] bounds the input size and refuses any input whose re-encoding differs from the
//! input, so "canonical" is checked, not assumed.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Deepest nesting of arrays, maps and tags ferry will decode. Ferry's objects nest a few
/// levels; the limit keeps a hostile object from exhausting the stack of the decoder.
pub const MAX_DEPTH: usize = 32;

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
    #[error("object nests deeper than {MAX_DEPTH} levels, or is not well-formed CBOR")]
    TooDeep,
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
    check_depth(bytes)?;
    let value: T =
        serde_ipld_dagcbor::from_slice(bytes).map_err(|e| CodecError::Decode(e.to_string()))?;
    if encode(&value)? != bytes {
        return Err(CodecError::NotCanonical);
    }
    Ok(value)
}

/// Walks the CBOR item structure without recursion and refuses nesting deeper than
/// [`MAX_DEPTH`] (and indefinite lengths, which canonical encodings never use).
pub fn check_depth(bytes: &[u8]) -> Result<(), CodecError> {
    // Items still to read at each open level (the outermost level holds the one top item).
    let mut pending: Vec<u64> = vec![1];
    let mut at = 0usize;
    while let Some(left) = pending.last_mut() {
        if *left == 0 {
            pending.pop();
            continue;
        }
        *left -= 1;
        let b = *bytes.get(at).ok_or(CodecError::TooDeep)?;
        at += 1;
        let (major, info) = (b >> 5, b & 0x1f);
        let arg: u64 = match info {
            0..=23 => u64::from(info),
            24..=27 => {
                let n = 1usize << (info - 24);
                let raw = bytes.get(at..at + n).ok_or(CodecError::TooDeep)?;
                at += n;
                raw.iter().fold(0u64, |a, &x| (a << 8) | u64::from(x))
            }
            _ => return Err(CodecError::TooDeep),
        };
        match major {
            2 | 3 => {
                at = at
                    .checked_add(usize::try_from(arg).map_err(|_| CodecError::TooDeep)?)
                    .ok_or(CodecError::TooDeep)?;
            }
            4..=6 => {
                let items = match major {
                    4 => arg,
                    5 => arg.checked_mul(2).ok_or(CodecError::TooDeep)?,
                    _ => 1,
                };
                if items > bytes.len() as u64 || pending.len() > MAX_DEPTH {
                    return Err(CodecError::TooDeep);
                }
                pending.push(items);
            }
            _ => {}
        }
    }
    Ok(())
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
    fn deep_nesting_is_refused_before_decoding() {
        let mut deep = vec![0x81u8; 100_000];
        deep.push(0x01);
        assert!(matches!(
            decode::<Vec<u64>>(&deep),
            Err(CodecError::TooDeep)
        ));
        let ok = encode(&vec![vec![vec![1u64]]]).unwrap();
        assert_eq!(
            decode::<Vec<Vec<Vec<u64>>>>(&ok).unwrap(),
            vec![vec![vec![1u64]]]
        );
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
