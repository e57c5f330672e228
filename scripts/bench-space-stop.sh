#!/usr/bin/env bash
# How long a space takes to stop (SIGTERM: it suspends its running sessions first) and to
# have them running again once it starts (docs/benchmarks.md, "Stopping a space"): N `dirty`
# guests of MIB MiB each (~1% of their pages rewritten per 100 ms tick) run on a fresh space
# (durable disk store) with `--checkpoint-every 5s`, stopped 3 s in; then the space started
# again until `ps` shows all N running. ROUNDS times.
#   scripts/bench-space-stop.sh [N] [MIB] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench-lib.sh
n=${1:-2}
mib=${2:-256}
rounds=${3:-3}
work=$(mktemp -d)
server=
trap '[ -n "$server" ] && kill -9 $server 2>/dev/null; rm -rf "$work"' EXIT
echo bench-token >"$work/token"
export FERRY_TOKEN=bench-token
ms() { date +%s%N | cut -b1-13; }
start_space() {
    rm -f "$work/serve"
    "$ferry" serve --listen 127.0.0.1:0 --store "$work/store" --token-file "$work/token" \
        >"$work/serve" 2>>"$work/log" &
    server=$!
    until grep -q listening "$work/serve" 2>/dev/null; do sleep 0.02; done
    url=$(sed -n 's/^listening on //p' "$work/serve")
}
for r in $(seq "$rounds"); do
    rm -rf "$work/store"
    start_space
    for i in $(seq "$n"); do
        "$ferry" --space "$url" run --session "d$i" --checkpoint-every 5s \
            guests/wasm/dirty.wasm -- "$mib" 100000 10 >/dev/null 2>&1
    done
    sleep 3
    t0=$(ms)
    kill -TERM $server
    wait $server || true
    t1=$(ms)
    start_space
    until [ "$("$ferry" --space "$url" ps 2>/dev/null | grep -c ' running ')" = "$n" ]; do
        sleep 0.02
    done
    t2=$(ms)
    echo "round $r, $n x $mib MiB: SIGTERM to exit $((t1 - t0)) ms; start to all running $((t2 - t1)) ms"
    kill -9 $server
    wait $server 2>/dev/null || true
    server=
done
