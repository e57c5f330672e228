//! The κ newtype: a BLAKE3-256 digest with its textual form `blake3:<64 hex>`.

use std::fmt;
use std::str::FromStr;

/// The content address of an object: BLAKE3-256 of its canonical bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Kappa([u8; 32]);

/// Why a string is not a κ.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KappaParseError {
    #[error("`{0}` is not a κ: expected `blake3:` followed by 64 hex digits")]
    Malformed(String),
}

impl Kappa {
    /// Text prefix of every κ.
    pub const PREFIX: &'static str = "blake3:";

    /// Hashes `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    /// Wraps a raw digest.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The 64 lower-case hex digits, without prefix.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// `blake3:` plus the first 12 hex digits, for human output.
    pub fn fmt_short(&self) -> String {
        format!("{}{}", Self::PREFIX, &self.to_hex()[..12])
    }

    /// Whether this κ's hex form starts with `prefix` (hex digits, `blake3:` optional).
    pub fn matches_prefix(&self, prefix: &str) -> bool {
        let p = prefix
            .strip_prefix(Self::PREFIX)
            .unwrap_or(prefix)
            .to_ascii_lowercase();
        self.to_hex().starts_with(&p)
    }
}

impl fmt::Display for Kappa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", Self::PREFIX, self.to_hex())
    }
}

impl fmt::Debug for Kappa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Kappa({})", self.fmt_short())
    }
}

impl FromStr for Kappa {
    type Err = KappaParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || KappaParseError::Malformed(s.to_owned());
        let hex_part = s.strip_prefix(Self::PREFIX).ok_or_else(bad)?;
        if hex_part.len() != 64 || !hex_part.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(hex_part.to_ascii_lowercase(), &mut out).map_err(|_| bad())?;
        Ok(Self(out))
    }
}

impl serde::Serialize for Kappa {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Kappa {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Kappa;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a 32-byte BLAKE3 digest")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Kappa, E> {
                let arr: [u8; 32] = v
                    .try_into()
                    .map_err(|_| E::invalid_length(v.len(), &self))?;
                Ok(Kappa(arr))
            }
        }
        d.deserialize_bytes(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_round_trip_and_refusals() {
        let k = Kappa::of(b"hello");
        assert_eq!(k.to_string().parse::<Kappa>(), Ok(k));
        assert!(k.to_string().starts_with("blake3:"));
        assert!("blake3:1234".parse::<Kappa>().is_err());
        assert!(k.to_hex().parse::<Kappa>().is_err(), "prefix is required");
        assert!(k.matches_prefix(&k.fmt_short()));
        assert!(k.matches_prefix(&k.to_hex()[..5]));
    }
}
