#!/usr/bin/env bash
# Take-over by a standby (docs/migration.md, "Standby"): two `ferry serve` of one etcd fleet
# (an etcd of this script's own, data in a temporary directory), the `dirty` guest run on A
# with `--checkpoint-every 1s --standby B`; once B holds a checkpoint A is killed (SIGKILL)
# and the script measures how long until B runs the guest (its lease TTL, up to a second until
# B's next read of etcd, and B's resume of the copy).
# With MODE `replace`: three spaces, the guest run with `--standby auto`; once the chosen
# standby holds a checkpoint it is killed, and the script measures how long until A names
# the other space and that one holds a checkpoint (the rest of the dead standby's lease, up
# to 2 s until A's keeper looks, A's checkpoint and the copy sent).
# usage: scripts/bench-standby.sh [SIZES_MIB=64,256] [TTLS=2s,10s] [ROUNDS=2] [MODE=takeover|replace]
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=${1:-64,256}
ttls=${2:-2s,10s}
rounds=${3:-2}
mode=${4:-takeover}
. scripts/bench-lib.sh
. scripts/etcd-lib.sh
work=$(mktemp -d /var/tmp/ferry-standby.XXXXXX)
pids=()
trap 'kill "${pids[@]}" $etcd_pid 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
start_etcd "$work"
export FERRY_TOKEN=bench-standby
serve() { # serve NAME TTL: starts a space, sets `url`
    local out="$work/$1.out"
    FERRY_STORE="$work/$1" "$ferry" serve --listen 127.0.0.1:0 --etcd "$etcd_url" \
        --etcd-prefix "/bench/$n" --lease-ttl "$2" >"$out" 2>"$work/$1.log" &
    pids+=($!)
    last=$!
    until grep -q '^listening on' "$out" 2>/dev/null; do
        kill -0 "$last" 2>/dev/null || { echo "ferry serve failed:" >&2; cat "$work/$1.log" >&2; exit 1; }
        sleep 0.1
    done
    url=$(sed -n 's/^listening on //p' "$out")
}
field() { # field URL ID NAME
    curl -sf -H "Authorization: Bearer $FERRY_TOKEN" "$1/v1/sessions/$2" |
        python3 -c "import json,sys; print(json.load(sys.stdin).get('$3', ''))" 2>/dev/null || true
}
if [ "$mode" = replace ]; then
    echo "| memory (MiB) | lease TTL | run | standby killed → another holds a checkpoint (s) |"
else
    echo "| memory (MiB) | lease TTL | run | kill → running on the standby (s) |"
fi
echo "|---:|---:|---:|---:|"
n=0
for mib in ${sizes//,/ }; do
    for ttl in ${ttls//,/ }; do
        for r in $(seq "$rounds"); do
            n=$((n + 1))
            serve "a$n" "$ttl"
            a=$url
            a_pid=$last
            serve "b$n" "$ttl"
            b=$url
            b_pid=$last
            # The session on A; `standby` holds its checkpoints, `victim` is killed once it
            # holds one (and 3 s more, a few more checkpoints), and the time runs until `arrived`.
            if [ "$mode" = replace ]; then
                serve "c$n" "$ttl"
                c=$url
                c_pid=$last
                to=auto
            else
                to=$b
            fi
            "$ferry" --space "$a" run --session s --checkpoint-every 1s --standby "$to" \
                guests/wasm/dirty.wasm -- "$mib" 100000 10 >/dev/null 2>&1
            standby=$(field "$a" s standby)
            if [ "$mode" = replace ]; then
                if [ "$standby" = "$b" ]; then victim=$b_pid other=$c; else victim=$c_pid other=$b; fi
                arrived() { [ "$(field "$a" s standby)" = "$other" ] && [ "$(field "$other" s state)" = standby ]; }
            else
                victim=$a_pid
                arrived() { [ "$(field "$b" s state)" = running ]; }
            fi
            until [ "$(field "$standby" s state)" = standby ]; do sleep 0.2; done
            sleep 3
            kill -9 "$victim"
            wait "$victim" 2>/dev/null || true
            t0=$(date +%s.%N)
            until arrived; do sleep 0.02; done
            t1=$(date +%s.%N)
            echo "| $mib | $ttl | $r | $(python3 -c "print(f'{$t1 - $t0:.2f}')") |"
            kill "${pids[@]}" 2>/dev/null || true
            # Only the spaces: a bare `wait` would wait for etcd too.
            wait "${pids[@]}" 2>/dev/null || true
            pids=()
        done
    done
done
