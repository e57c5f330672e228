//! A store's `cache/import-cache` file is read back by the next run: damaged or altered bytes
//! must be dropped, never crash it.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ferry_wasi::tree::ImportCache::decode(data);
});
