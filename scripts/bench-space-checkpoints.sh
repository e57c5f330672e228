#!/usr/bin/env bash
# How long a space session's periodic checkpoints stop its guest (docs/benchmarks.md,
# "Checkpoints pre-written"): a `dirty` guest of MIB MiB (~1% of its pages rewritten per
# 100 ms) run on a fresh space (durable disk store) with `--checkpoint-every 3s` for ~14 s,
# alternately with the pass that copies the changed memory before each checkpoint (the
# default) and without it (FERRY_PRE_WRITE_CHECKPOINTS=off); prints each checkpoint's pause
# (`total_ms` of the space's "snapshot written" lines: from the safe point until the guest
# runs again).
#   scripts/bench-space-checkpoints.sh [MIB] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench-lib.sh
mib=${1:-1024}
rounds=${2:-2}
work=$(mktemp -d)
server=
trap '[ -n "$server" ] && kill $server 2>/dev/null; rm -rf "$work"' EXIT
echo bench-token >"$work/token"
export FERRY_TOKEN=bench-token
for i in $(seq "$rounds"); do
    for pass in off on; do
        rm -rf "$work/store" "$work/serve"
        FERRY_PRE_WRITE_CHECKPOINTS=$pass "$ferry" -v serve --listen 127.0.0.1:0 --store "$work/store" \
            --token-file "$work/token" >"$work/serve" 2>"$work/log" &
        server=$!
        until grep -q listening "$work/serve" 2>/dev/null; do sleep 0.1; done
        url=$(sed -n 's/^listening on //p' "$work/serve")
        "$ferry" --space "$url" run --checkpoint-every 3s guests/wasm/dirty.wasm -- "$mib" 130 10 >/dev/null
        sleep 14
        kill $server
        wait $server 2>/dev/null || true
        server=
        pauses=$(grep "snapshot written" "$work/log" | grep -o 'total_ms=[0-9]*' | cut -d= -f2 | paste -sd, -)
        echo "round $i, $mib MiB, pass before each checkpoint $pass: pauses (ms) $pauses"
    done
done
