#!/usr/bin/env bash
# How long `ferry --space A drain --to B` takes to move N running sessions off a space, one
# after another (`--parallel 1`, the default) and more at a time (PARALLEL, default "1 2 4"),
# side by side: two `ferry serve` on loopback (no etcd); each round starts N `dirty`
# guests of MIB MiB on A (each with bytes of its own, rewriting 1% of its pages every 100 ms),
# waits until all are ready, drains A to B, and prints the time the drain took and each
# move's pause (`paused … ms` in its progress); then kills the sessions on B and undoes the
# drain. The ways alternate, ROUNDS times each.
# usage: scripts/bench-drain.sh [SESSIONS=8] [MIB=64] [ROUNDS=2]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-8}
mib=${2:-64}
rounds=${3:-2}
parallel=${PARALLEL:-1 2 4}
. scripts/bench-lib.sh
guest=guests/wasm/dirty.wasm
work=$(mktemp -d /var/tmp/ferry-drain.XXXXXX)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
export FERRY_TOKEN=bench-drain FERRY_STORE="$work/client"
serve_space "$work/a"
a=$url
serve_space "$work/b"
b=$url
seed=0
median() { tr ' ' '\n' | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
for r in $(seq "$rounds"); do
    for p in $parallel; do
        for i in $(seq "$n"); do
            "$ferry" --space "$a" run --session "s$r-$p-$i" "$guest" -- "$mib" 100000 10 "$((seed += 1))" >/dev/null 2>&1
        done
        for i in $(seq "$n"); do
            until "$ferry" --space "$a" logs "s$r-$p-$i" 2>/dev/null | grep -q ready; do sleep 0.1; done
        done
        t0=$(date +%s%N)
        "$ferry" --space "$a" drain --to "$b" --parallel "$p" >/dev/null 2>"$work/drain.err"
        took=$(( ($(date +%s%N) - t0) / 1000000 ))
        paused=$(sed -n 's/.*: paused \([0-9]*\) ms.*/\1/p' "$work/drain.err" | tr '\n' ' ')
        moved=$(grep -c 'moved to' "$work/drain.err" || true)
        echo "round $r, --parallel $p: $moved of $n sessions moved in $took ms;" \
            "pauses (ms) median $(echo $paused | median), all: $paused"
        for i in $(seq "$n"); do
            "$ferry" --space "$b" kill "s$r-$p-$i" >/dev/null 2>&1 || true
        done
        "$ferry" --space "$a" drain --undo >/dev/null 2>&1
    done
done
