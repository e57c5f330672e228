//! Valid modules generated from the fuzzer's bytes (wasm-smith, steered by coverage) must be
//! instrumented into valid modules or refused with a reason — never an internal error, never
//! a panic. Raw bytes (`instrument`) seldom get past the parser; these reach the transform.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let config = wasm_smith::Config {
        exceptions_enabled: true,
        bulk_memory_enabled: true,
        reference_types_enabled: true,
        gc_enabled: false,
        tail_call_enabled: false,
        threads_enabled: false,
        memory64_enabled: false,
        max_imports: 0,
        min_funcs: 1,
        ..wasm_smith::Config::default()
    };
    let mut u = arbitrary::Unstructured::new(data);
    let Ok(module) = wasm_smith::Module::new(config, &mut u) else {
        return;
    };
    let wasm = module.to_bytes();
    for out in [
        ferry_instrument::instrument_any(&wasm),
        ferry_instrument::instrument_any_counting(&wasm),
    ] {
        if let Err(ferry_instrument::InstrumentError::Internal(e)) = out {
            panic!("transform produced an invalid module: {e}");
        }
    }
});
