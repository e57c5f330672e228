//! κ — content addresses — and the canonical codec every ferry object is written in.
//!
//! `κ = BLAKE3-256(canonical bytes)`, printed as `blake3:<64 hex>`. The canonical bytes of a
//! value are its deterministic DAG-CBOR encoding ([`codec`]): one value, one byte string, on
//! every host. Decoding re-encodes and refuses input that is not already canonical, so two
//! different byte strings can never claim to be the same object.

pub mod codec;
mod kappa;

pub use codec::{CodecError, MAX_OBJECT_BYTES, decode, encode};
pub use kappa::{Kappa, KappaParseError};
