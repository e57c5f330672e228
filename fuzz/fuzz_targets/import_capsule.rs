//! A capsule from another machine is untrusted: importing arbitrary bytes must never crash or
//! allocate without bound.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_store::capsule::fuzz_import(data);
});
