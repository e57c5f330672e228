//! End-to-end tests of the `ferry` binary: what a user sees (output bytes, exit codes,
//! refusal messages). One test binary for the crate, as in wasmtime.

mod churn;
mod harness;
mod python;
mod refusals;
