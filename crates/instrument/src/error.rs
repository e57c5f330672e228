use thiserror::Error;

/// Why a module could not be made suspendable. Each variant says what to do about it.
#[derive(Debug, Error)]
pub enum InstrumentError {
    #[error("not a WebAssembly module (the file does not start with the `\\0asm` magic)")]
    NotWasm,
    #[error(
        "this is a WebAssembly component; ferry runs core modules (wasm32-wasip1 command modules)"
    )]
    Component,
    #[error("invalid WebAssembly module: {0}")]
    Invalid(String),
    #[error("module uses a WebAssembly feature ferry cannot suspend yet: {0}")]
    Unsupported(String),
    #[error(
        "module has no `_start` export: ferry runs WASI command modules (and reactors that \
         export `_initialize`, with `--invoke`)"
    )]
    NoStart,
    #[error("internal error: instrumented module does not validate ({0}); please report this")]
    Internal(String),
}

impl From<wasmparser::BinaryReaderError> for InstrumentError {
    fn from(e: wasmparser::BinaryReaderError) -> Self {
        Self::Invalid(e.to_string())
    }
}
