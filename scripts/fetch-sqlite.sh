#!/usr/bin/env bash
# Builds the SQLite shell for WASI, a real C program nobody here wrote (benchmarks and churn
# tests). The SQLite amalgamation (public domain) ships inside the npm package sqlite3@6.0.1
# as deps/sqlite-autoconf-3520000.tar.gz; the package is fetched from the npm registry and
# pinned by SHA-256. Nothing is committed: the built module lands in the guest cache:
#   ${FERRY_GUEST_CACHE:-$HOME/.cache/ferry/guests}/sqlite3-3.52.0.wasm
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
. "$root/scripts/guest-lib.sh"
tgz_sha="ab8d044a93e05bd031d7ea75547c7fa60387cdc259d27f93c0e3e2832c4b1df9"
url="https://registry.npmjs.org/sqlite3/-/sqlite3-6.0.1.tgz"
dest="$cache/sqlite3-3.52.0.wasm"
flags=(--target=wasm32-wasi -O2
    -D_WASI_EMULATED_SIGNAL -D_WASI_EMULATED_MMAN -D_WASI_EMULATED_PROCESS_CLOCKS
    -D_WASI_EMULATED_GETPID -DSQLITE_OMIT_LOAD_EXTENSION -DSQLITE_THREADSAFE=0
    -DSQLITE_OMIT_WAL -DSQLITE_NOHAVE_SYSTEM -DSQLITE_TEMP_STORE=3
    -Wl,-z,stack-size=8388608 -Wl,--strip-debug)
libs=(-lwasi-emulated-signal -lwasi-emulated-mman -lwasi-emulated-process-clocks -lwasi-emulated-getpid)
# The build is keyed by the source, the stubs and the flags.
key="$(build_key "$tgz_sha ${flags[*]} ${libs[*]}" "$root/guests/sqlite/wasi_stubs.c" \
    "$root/guests/sqlite/wasi_shim.h" "$root/scripts/fetch-sqlite.sh")"
if up_to_date "$dest" "$key"; then
    echo "sqlite3-3.52.0.wasm: cached ($dest)"
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
if command -v curl >/dev/null; then
    curl -fsSL --retry 3 -o "$tmp/sqlite3.tgz" "$url"
else
    (cd "$tmp" && npm pack --silent sqlite3@6.0.1 >/dev/null && mv sqlite3-6.0.1.tgz sqlite3.tgz)
fi
verify "$tmp/sqlite3.tgz" "$tgz_sha"
tar -xzf "$tmp/sqlite3.tgz" -C "$tmp" package/deps/sqlite-autoconf-3520000.tar.gz
tar -xzf "$tmp/package/deps/sqlite-autoconf-3520000.tar.gz" -C "$tmp"
src="$tmp/sqlite-autoconf-3520000"
echo "sqlite3-3.52.0.wasm: building the SQLite shell for WASI (about 20 s)"
clang "${flags[@]}" -include "$root/guests/sqlite/wasi_shim.h" "$src/shell.c" "$src/sqlite3.c" "$root/guests/sqlite/wasi_stubs.c" \
    "${libs[@]}" -o "$dest.tmp"
built "$dest" "$key"
