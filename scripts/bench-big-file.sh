#!/bin/bash
# A big file in a mounted directory, changed in one place (a few bytes, by the host) between
# suspends: how much the store grows and how long each suspend takes (`total_ms`).
# usage: scripts/bench-big-file.sh [FERRY_BIN] [SIZE_MIB] [ROUNDS]
# (docs/benchmarks.md, "Big files changed in place"; the guest is guests/wasm/files.wasm)
set -u
BIN=${1:-${CARGO_TARGET_DIR:-target}/release/ferry}; MIB=${2:-256}; ROUNDS=${3:-3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d "${TMPDIR:-/tmp}/ferry-big-file.XXXX"); D=$W/data; mkdir -p $D
trap 'rm -rf "$W"' EXIT
head -c ${MIB}M /dev/urandom > $D/db.bin
export FERRY_STORE=$W/store
G=$ROOT/guests/wasm/files.wasm
sleep 2.2  # the file settled (the import cache trusts files 2 s old)
$BIN -v run --dir $D::/data $G -- /data 1000000 > $W/out 2> $W/err & p=$!
sleep 2; kill -INT $p; wait $p
k=$(grep -o 'suspended blake3:[0-9a-f]*' $W/err | tail -1 | cut -d' ' -f2)
echo "first: store $(du -sm $W/store | cut -f1) MiB; $(grep -o 'snapshot written.*' $W/err | grep -o 'total_ms[^,]*' | tail -1)"
for i in $(seq 1 $ROUNDS); do
  printf 'changed%d' $i | dd of=$D/db.bin bs=1 seek=$((i * MIB * 1024 * 1024 / (ROUNDS + 1))) conv=notrunc status=none
  $BIN -v resume --allow-changed-dirs --dir $D::/data $k >> $W/out 2> $W/err & p=$!
  sleep 2; kill -INT $p; wait $p
  k=$(grep -o 'suspended blake3:[0-9a-f]*' $W/err | tail -1 | cut -d' ' -f2)
  echo "round $i: store $(du -sm $W/store | cut -f1) MiB; $(grep -o 'snapshot written.*' $W/err | grep -o 'total_ms[^,]*' | tail -1)"
done
