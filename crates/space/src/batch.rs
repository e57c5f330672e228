//! A batch of objects in one request body (`POST /v1/objects`): each entry is
//! `[32] κ, u8 codec (0 raw, 1 zstd), u64 length, u64 stored length, stored bytes`.

use ferry_kappa::Kappa;

use crate::MAX_OBJECT;

/// Appends one object to a batch, compressed when that saves at least an eighth.
pub(crate) fn push(out: &mut Vec<u8>, bytes: &[u8]) {
    let k = Kappa::of(bytes);
    let packed = zstd::bulk::compress(bytes, 1).unwrap_or_default();
    let (codec, body) = if !packed.is_empty() && packed.len() < bytes.len() - bytes.len() / 8 {
        (1u8, packed.as_slice())
    } else {
        (0u8, bytes)
    };
    out.extend_from_slice(k.as_bytes());
    out.push(codec);
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(body);
}

/// The objects of a batch, each re-hashed against its κ; any malformed or mismatching entry
/// refuses the whole batch.
pub(crate) fn decode(mut b: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut out = Vec::new();
    while !b.is_empty() {
        if b.len() < 49 {
            return Err("truncated entry header".into());
        }
        let k = Kappa::from_bytes(b[..32].try_into().expect("32 bytes"));
        let codec = b[32];
        let len = u64::from_le_bytes(b[33..41].try_into().expect("8 bytes"));
        let stored = u64::from_le_bytes(b[41..49].try_into().expect("8 bytes"));
        if len > MAX_OBJECT as u64 || stored > (b.len() - 49) as u64 {
            return Err(format!(
                "object {k}: {len} bytes claimed, {stored} stored: out of bounds"
            ));
        }
        let body = &b[49..49 + stored as usize];
        let bytes = match codec {
            0 if stored == len => body.to_vec(),
            1 => zstd::bulk::decompress(body, len as usize)
                .map_err(|e| format!("object {k}: {e}"))?,
            _ => {
                return Err(format!(
                    "object {k}: codec {codec}, {stored} of {len} bytes"
                ));
            }
        };
        let actual = Kappa::of(&bytes);
        if bytes.len() as u64 != len || actual != k {
            return Err(format!("object {k} hashes to {actual}: refused"));
        }
        out.push(bytes);
        b = &b[49 + stored as usize..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let mut b = Vec::new();
        push(&mut b, b"one");
        push(&mut b, &vec![0u8; 100_000]);
        let objs = decode(&b).unwrap();
        assert_eq!(objs, vec![b"one".to_vec(), vec![0u8; 100_000]]);
        for i in [0, 20, 32, 40, 48, 50, b.len() - 1] {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            assert!(decode(&bad).is_err(), "flipping byte {i} was not noticed");
        }
        assert!(decode(&b[..b.len() - 1]).is_err());
        let mut huge = b[..49].to_vec();
        huge[33..41].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode(&huge).unwrap_err().contains("out of bounds"));
    }
}
