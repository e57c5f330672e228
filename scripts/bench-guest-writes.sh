#!/bin/bash
# A guest updating pages of a big file in its mount (guests/wasm/pages.wasm: 8 pages of 4 KiB
# per round, seven in the first 2 MiB, one in turn through the file), checkpointed every
# second: each checkpoint's `total_ms` (the first one, which stores the whole file, apart),
# and the whole run's wall time. SPIN is the guest's busy work per round (0: all I/O).
# usage: scripts/bench-guest-writes.sh [FERRY_BIN] [SIZE_MIB] [ROUNDS] [SPIN]
# (docs/benchmarks.md, "The guest's own writes to a big file")
set -u
BIN=${1:-${CARGO_TARGET_DIR:-target}/release/ferry}; MIB=${2:-1024}; ROUNDS=${3:-6000}
SPIN=${4:-1000000}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d "${TMPDIR:-/tmp}/ferry-guest-writes.XXXX"); mkdir -p $W/data
trap 'rm -rf "$W"' EXIT
export FERRY_STORE=$W/store
start=$(date +%s.%N)
$BIN -v run --checkpoint-every 1s --dir $W/data::/data $ROOT/guests/wasm/pages.wasm \
  -- /data/db.bin $MIB $ROUNDS $SPIN > $W/out 2> $W/err || { cat $W/err; exit 1; }
end=$(date +%s.%N)
ms=$(grep 'snapshot written' $W/err | grep -o 'total_ms=[0-9]*' | cut -d= -f2)
first=$(echo "$ms" | head -1)
rest=$(echo "$ms" | tail -n +2 | sort -n)
n=$(echo "$rest" | grep -c .)
echo "run $(echo "$end - $start" | bc) s ($(tail -1 $W/out)); first snapshot ${first} ms;" \
  "$n more: median $(echo "$rest" | sed -n "$(( (n + 1) / 2 ))p") ms, max $(echo "$rest" | tail -1) ms;" \
  "patched $(grep -c 'files_patched=1' $W/err), read whole $(grep 'snapshot written' $W/err | grep -c 'files_read=1')"
