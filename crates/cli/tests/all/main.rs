//! End-to-end tests of the `ferry` binary: what a user sees (output bytes, exit codes,
//! refusal messages). One test binary for the crate, as in wasmtime.

#![allow(clippy::unwrap_used)] // a test that cannot unwrap should fail loudly

mod capsule;
mod churn;
mod conformance;
mod engines;
mod fleet;
mod harness;
mod interactive;
mod migrate;
mod other_cpu;
mod python;
mod refusals;
mod space;
mod takeover;
mod terminal;
mod versions;
mod wasi_testsuite;
mod web;
