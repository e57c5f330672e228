//! One module per subcommand.

pub mod bench;
pub mod capsule;
pub mod conformance;
pub mod inspect;
pub mod oci;
pub mod ps;
pub mod python;
pub mod remote;
pub mod resume;
pub mod rm;
pub mod run;
pub mod signal;
pub mod space;
pub mod store;

/// `b` bytes in MiB, for messages.
pub fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}
