#!/usr/bin/env bash
# Builds a zstd compression workload for WASI, a real C library nobody here wrote (benchmarks
# and churn tests). The single-file zstd library (zstd.c, BSD) ships in the sdist of the PyPI
# package zstandard==0.25.0, fetched with pip and pinned by SHA-256; guests/zstd/driver.c is
# ours. Nothing fetched is committed: the module lands in the guest cache:
#   ${FERRY_GUEST_CACHE:-$HOME/.cache/ferry/guests}/zstd-bench.wasm
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
. "$root/scripts/guest-lib.sh"
sdist_sha="7713e1179d162cf5c7906da876ec2ccb9c3a9dcbdffef0cc7f70c3667a205f0b"
dest="$cache/zstd-bench.wasm"
flags=(--target=wasm32-wasi -O2 -w -DZSTD_DISABLE_ASM -DZSTD_NO_TRACE
    -Wl,-z,stack-size=8388608 -Wl,--strip-debug)
key="$(build_key "$sdist_sha ${flags[*]}" "$root/guests/zstd/driver.c" \
    "$root/guests/common/workload.h" "$root/scripts/fetch-zstd.sh")"
if up_to_date "$dest" "$key"; then
    echo "zstd-bench.wasm: cached ($dest)"
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: zstandard==0.25.0 -d "$tmp"
verify "$tmp/zstandard-0.25.0.tar.gz" "$sdist_sha"
tar -xzf "$tmp/zstandard-0.25.0.tar.gz" -C "$tmp" zstandard-0.25.0/zstd
src="$tmp/zstandard-0.25.0/zstd"
# The amalgamation turns on multi-threading unless it is built by Emscripten; WASI p1 has no
# threads, so that line is dropped from the temporary copy.
sed -i 's|^#define ZSTD_MULTITHREAD$|/* ZSTD_MULTITHREAD off for WASI */|' "$src/zstd.c"
echo "zstd-bench.wasm: building the zstd workload for WASI (about 30 s)"
clang "${flags[@]}" -I"$src" -I"$root/guests/common" "$root/guests/zstd/driver.c" "$src/zstd.c" -o "$dest.tmp"
built "$dest" "$key"
