//! Untrusted modules must be instrumented or refused with a reason, never crash the transform
//! or produce an invalid module.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(ferry_instrument::InstrumentError::Internal(e)) = ferry_instrument::instrument(data) {
        panic!("transform produced an invalid module: {e}");
    }
});
