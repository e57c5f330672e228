#!/usr/bin/env bash
# Builds the C test guests with Debian's clang + wasi-libc into guests/wasm/.
# Needs: clang lld wasi-libc libclang-rt-14-dev-wasm32 (scripts/setup.sh installs them).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$here/wasm"
for src in "$here"/c/*.c; do
    name="$(basename "$src" .c)"
    clang --target=wasm32-wasi -O2 -Wl,--strip-debug -Wl,-z,stack-size=8388608 -o "$here/wasm/$name.wasm" "$src"
done
echo "built: $(ls "$here/wasm" | tr '\n' ' ')"
