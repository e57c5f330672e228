#!/usr/bin/env bash
# Live migration over a link of a given rate: `ferry bench --only migrate` (two `ferry serve`
# processes on loopback, the `dirty` guest moved while it runs) with loopback's traffic held to
# each RATE by an HTB qdisc (tc), as a link between two machines would hold it; then without.
# This kernel has no netem, so the link adds no delay: rate only. FERRY_BENCH_MAX_PAUSE_MS=N
# gives each move that --max-pause (a move given up for it is a row saying why),
# FERRY_BENCH_AUTO_CONVERGE=1 --auto-converge. Needs root; the qdisc is
# removed at the end (and on Ctrl-C). Do not run it beside the tests: they use loopback too.
# usage: scripts/bench-migrate-rate.sh [RATES=1gbit,100mbit] [SIZES=256] [ROUNDS=1]
set -euo pipefail
cd "$(dirname "$0")/.."
rates=${1:-1gbit,100mbit}
sizes=${2:-256}
rounds=${3:-1}
. scripts/bench-lib.sh
command -v tc >/dev/null || { echo "tc is needed (Debian: apt-get install iproute2)" >&2; exit 1; }
unlimit() { tc qdisc del dev lo root 2>/dev/null || true; }
trap unlimit EXIT
limit() {
    unlimit
    tc qdisc add dev lo root handle 1: htb default 1
    # A burst of 1 MiB: loopback sends up to 64 KiB at once (its MTU), far above a real
    # link's 1.5 KB frames, so HTB needs room to keep the rate.
    tc class add dev lo parent 1: classid 1:1 htb rate "$1" ceil "$1" burst 1m cburst 1m
}
for r in $(seq "$rounds"); do
    for rate in ${rates//,/ } unlimited; do
        echo "### round $r, loopback at $rate"
        if [ "$rate" = unlimited ]; then unlimit; else limit "$rate"; fi
        "$ferry" bench --only migrate --sizes "$sizes" | grep '^| [0-9]\|foreseen\|held back' || true
    done
done
