#!/bin/bash
# A guest updating pages of a big file in its mount (guests/wasm/pages.wasm), suspended after
# 3 s, resumed in place, suspended again after 2 s: the first suspend's `total_ms`, the
# resume's Admitting (where it compares the mount with the snapshot's tree), and the resumed
# run's suspend. usage: scripts/bench-guest-writes-resume.sh [FERRY_BIN] [SIZE_MIB]
# (docs/benchmarks.md, "The guest's own writes to a big file")
set -u
BIN=${1:-${CARGO_TARGET_DIR:-target}/release/ferry}; MIB=${2:-1024}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d "${TMPDIR:-/tmp}/ferry-guest-writes.XXXX"); mkdir $W/d; export FERRY_STORE=$W/s
trap 'rm -rf "$W"' EXIT
G=$ROOT/guests/wasm/pages.wasm
$BIN -v run --dir $W/d::/data $G -- /data/db.bin $MIB 100000 > /dev/null 2>$W/e1 & p=$!; sleep 3; kill -INT $p; wait $p
k=$(grep -o 'suspended blake3:[0-9a-f]*' $W/e1 | cut -d' ' -f2)
s1=$(grep 'snapshot written' $W/e1 | grep -o 'total_ms=[0-9]*')
$BIN -v resume --dir $W/d::/data $k > /dev/null 2>$W/e2 & p=$!; sleep 2; kill -INT $p; wait $p
a=$(grep ' admitting ' $W/e2 | awk '{print $1}' | tr -d s); r=$(grep ' restoring ' $W/e2 | awk '{print $1}' | tr -d s)
s2=$(grep 'snapshot written' $W/e2 | grep -o 'total_ms=[0-9]*.*')
echo "first suspend $s1; resume admitting $(echo "($r - $a)*1000" | bc | cut -d. -f1) ms; resumed run's suspend $s2"
