#!/usr/bin/env bash
# Builds three more real programs for WASI that nobody here wrote (benchmarks and churn
# tests): the LZ4 and Brotli compression libraries, each under a small driver of ours
# (guests/lz4/driver.c, guests/brotli/driver.c), and the Lua 5.4 interpreter itself (lua.c via
# onelua.c) running guests/lua/bench.lua. Sources come from PyPI sdists fetched from the
# package index and pinned by SHA-256: lz4==4.4.4 (lz4libs/, BSD), Brotli==1.1.0 (c/, MIT),
# lupa==2.5 (third-party/lua54/, MIT). Nothing fetched is committed; the modules land in
#   ${FERRY_GUEST_CACHE:-$HOME/.cache/ferry/guests}/{lz4-bench,brotli-bench,lua}.wasm
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
. "$root/scripts/guest-lib.sh"
index="https://files.pythonhosted.org/packages"
common=(--target=wasm32-wasi -O2 -w -Wl,-z,stack-size=8388608 -Wl,--strip-debug)

# fetch NAME URL-PATH SHA256 -> path of the verified sdist in $tmp
fetch() {
    local file="$tmp/$1"
    curl -fsSL --retry 3 -o "$file" "$index/$2/$1"
    verify "$file" "$3"
    echo "$file"
}

# key_of WORDS...: the build key of a module made from these and this script
key_of() { build_key "$*" "$root/scripts/fetch-programs.sh" "$root/guests/common/workload.h"; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# --- LZ4 ---
lz4_sha="070fd0627ec4393011251a094e08ed9fdcc78cb4e7ab28f507638eee4e39abda"
dest="$cache/lz4-bench.wasm"
key="$(key_of "$lz4_sha" "$(cat "$root/guests/lz4/driver.c")")"
if up_to_date "$dest" "$key"; then
    echo "lz4-bench.wasm: cached ($dest)"
else
    sdist="$(fetch lz4-4.4.4.tar.gz c6/5a/945f5086326d569f14c84ac6f7fcc3229f0b9b1e8cc536b951fd53dfb9e1 "$lz4_sha")"
    tar -xzf "$sdist" -C "$tmp" lz4-4.4.4/lz4libs
    src="$tmp/lz4-4.4.4/lz4libs"
    clang "${common[@]}" -I"$src" -I"$root/guests/common" "$root/guests/lz4/driver.c" "$src/lz4.c" "$src/lz4hc.c" -o "$dest.tmp"
    built "$dest" "$key"
fi

# --- Brotli ---
brotli_sha="81de08ac11bcb85841e440c13611c00b67d3bf82698314928d0b676362546724"
dest="$cache/brotli-bench.wasm"
key="$(key_of "$brotli_sha" "$(cat "$root/guests/brotli/driver.c")")"
if up_to_date "$dest" "$key"; then
    echo "brotli-bench.wasm: cached ($dest)"
else
    sdist="$(fetch Brotli-1.1.0.tar.gz 2f/c2/f9e977608bdf958650638c3f1e28f85a1b075f075ebbe77db8555463787b "$brotli_sha")"
    tar -xzf "$sdist" -C "$tmp" Brotli-1.1.0/c
    src="$tmp/Brotli-1.1.0/c"
    echo "brotli-bench.wasm: building the Brotli workload for WASI (about 30 s)"
    clang "${common[@]}" -I"$src/include" -I"$root/guests/common" "$root/guests/brotli/driver.c" \
        "$src"/common/*.c "$src"/enc/*.c "$src"/dec/*.c -o "$dest.tmp"
    built "$dest" "$key"
fi

# --- Lua 5.4 ---
# WASI preview 1 has no setjmp/longjmp: Lua's error throw becomes abort() (a Lua error ends the
# program; bench.lua raises none and uses no coroutines, whose C-side yield also throws), and
# a stub <setjmp.h> keeps the host's header out. system() and tmpfile() fail cleanly.
lupa_sha="69c6a89f2b7b08a3040d7ed2a1eeccba37a31ddc92fa199339c53a2ae3c48c34"
dest="$cache/lua.wasm"
key="$(key_of "$lupa_sha")"
if up_to_date "$dest" "$key"; then
    echo "lua.wasm: cached ($dest)"
else
    sdist="$(fetch lupa-2.5.tar.gz d5/51/4e20b597795b58f840289042d87d65f0e33cdc73653a4c1c7026346e1725 "$lupa_sha")"
    tar -xzf "$sdist" -C "$tmp" lupa-2.5/third-party/lua54
    src="$tmp/lupa-2.5/third-party/lua54"
    mkdir -p "$tmp/stub"
    printf 'typedef int jmp_buf[1];\n' > "$tmp/stub/setjmp.h"
    printf '#include <stdio.h>\n#include <errno.h>\nint system(const char *c) { (void)c; return -1; }\nFILE *tmpfile(void) { errno = ENOTSUP; return 0; }\n' > "$tmp/stub/stubs.c"
    echo "lua.wasm: building the Lua 5.4 interpreter for WASI"
    clang "${common[@]}" -I"$tmp/stub" \
        -D'LUAI_THROW(L,c)=abort()' -D'LUAI_TRY(L,c,a)={ a }' -Dluai_jmpbuf=int \
        -DLUA_TMPNAMBUFSIZE=32 -D'lua_tmpnam(b,e)={ e = 1; }' \
        -D_WASI_EMULATED_SIGNAL -D_WASI_EMULATED_PROCESS_CLOCKS \
        "$src/onelua.c" "$tmp/stub/stubs.c" -lwasi-emulated-signal -lwasi-emulated-process-clocks \
        -o "$dest.tmp"
    built "$dest" "$key"
fi
