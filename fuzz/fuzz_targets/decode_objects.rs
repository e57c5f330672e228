//! Untrusted bytes from a peer or a damaged store must never crash a decoder.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_object::fuzz_decode(data);
});
