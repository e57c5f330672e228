#!/usr/bin/env bash
# What `--pre-write` costs a guest that runs to its end (nothing suspends it): each guest run
# with and without `--pre-write D`, alternated ROUNDS times, each run in a fresh durable store.
# Prints the run times and the store's size after the run (what the passes wrote; a run that
# is never suspended names none of it).
#   heap 512 40      allocates 512 MiB, then rewrites all of it ~40 times
#   dirty 1024 30 50 fills 1 GiB with random bytes, then rewrites 5% of its pages per 100 ms
#   python loop.py   CPython 3.12 running guests/python/loop.py (if fetched: scripts/fetch-python.sh)
# usage: scripts/bench-pre-write.sh [D=500ms] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
every=${1:-500ms}
rounds=${2:-3}
. scripts/bench-lib.sh
work=$(mktemp -d /var/tmp/ferry-pre-write.XXXXXX)
trap 'rm -rf "$work"' EXIT
python=${FERRY_GUESTS:-$HOME/.cache/ferry/guests}/python-3.12.0.wasm

# one NAME OPTIONS...: runs ferry with OPTIONS in a fresh store; prints "S s, N MiB".
one() {
    rm -rf "$work/store"
    local t0 t1
    t0=$(date +%s.%N)
    FERRY_STORE=$work/store "$ferry" "$@" >/dev/null 2>"$work/log"
    t1=$(date +%s.%N)
    echo "$t0 $t1 $(du -sm "$work/store" | cut -f1)" | awk '{printf "%.2f s, %d MiB", $2 - $1, $3}'
}

echo "| guest | round | without | with \`--pre-write $every\` |"
echo "|---|---:|---:|---:|"
for r in $(seq "$rounds"); do
    for g in heap dirty python; do
        case $g in
            heap) args=(guests/wasm/heap.wasm -- 512 40) ;;
            dirty) args=(guests/wasm/dirty.wasm -- 1024 30 50) ;;
            python)
                [ -f "$python" ] || continue
                args=(--dir guests/python::/app "$python" /app/loop.py 8) ;;
        esac
        without=$(one run "${args[@]}")
        with=$(one run --pre-write "$every" "${args[@]}")
        echo "| $g | $r | $without | $with |"
    done
done
