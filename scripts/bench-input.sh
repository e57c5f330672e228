#!/usr/bin/env bash
# What a checkpoint of an interactive session costs once it has received a lot of input
# (docs/migration.md, "Interactive sessions"): one `ferry serve`, the `lines` guest run with
# `ferry --space A run -i --stdin FILE` (FILE: MIB MiB of 200-byte lines, which the guest reads
# a line every ~30 ms, so nearly all of it stays unread — and carried), then ROUNDS
# `ferry --space A checkpoint` in a row, each timed from the request until the snapshot is
# written, and a move to a second space B (`migrate`: its pause, and its time in all). The
# session's input ends at once (this script's stdin is /dev/null), which changes nothing
# here: a snapshot carries the input received, read or not.
# With FERRYS="OLD NEW" (two ferry binaries) both are measured, one after the other, on the
# same input; default: the one built here.
# usage: scripts/bench-input.sh [MIB=256] [ROUNDS=5]
set -euo pipefail
cd "$(dirname "$0")/.."
mib=${1:-256}
rounds=${2:-5}
ferrys=${FERRYS:-${CARGO_TARGET_DIR:-target}/release/ferry}
for FERRY in $ferrys; do
    . scripts/bench-lib.sh # checks that $FERRY is there, and sets `ferry` to it
done
guest=guests/wasm/lines.wasm
work=$(mktemp -d /var/tmp/ferry-input.XXXXXX)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
export FERRY_TOKEN=bench-input
python3 - "$work/input.txt" "$mib" <<'EOF'
import sys
path, mib = sys.argv[1], int(sys.argv[2])
line = lambda i: f"{i:08} {'z' * (180 + i % 11)}\n".encode()
with open(path, "wb") as f:
    n, i = 0, 0
    while n < mib << 20:
        b = line(i)
        f.write(b)
        n, i = n + len(b), i + 1
EOF
echo "input: $(du -m "$work/input.txt" | cut -f1) MiB"
ferry_n=0
for FERRY in $ferrys; do
    . scripts/bench-lib.sh
    serve_space "$work/b-$ferry_n"
    b=$url
    serve_space "$work/a-$((ferry_n += 1))"
    export FERRY_STORE="$work/client"
    "$ferry" --space "$url" run -i --stdin "$work/input.txt" --session s \
        --checkpoint-every 1h "$guest" </dev/null >/dev/null 2>/dev/null &
    pids+=($!)
    until "$ferry" --space "$url" ps 2>/dev/null | grep -q 'running'; do sleep 0.1; done
    took=()
    for _ in $(seq "$rounds"); do
        t0=$(date +%s%N)
        "$ferry" --space "$url" checkpoint s >/dev/null
        took+=($(( ($(date +%s%N) - t0) / 1000000 )))
    done
    moved=$("$ferry" --space "$url" migrate s --to "$b" 2>&1 | sed -n 's/.*\(paused .*\)/\1/p')
    echo "$ferry: checkpoints (ms, first to last): ${took[*]}; a move: $moved"
    kill "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
    pids=()
done
