//! What a space receives from peers and clients is untrusted: object batches, JSON bodies,
//! output logs, policy files must never crash it or allocate without bound.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_space::fuzz_inputs(data);
});
