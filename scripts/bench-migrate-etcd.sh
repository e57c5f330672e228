#!/usr/bin/env bash
# Live migration with and without owner records in etcd, side by side: `ferry bench --only
# migrate` (two `ferry serve` processes on loopback, the `dirty` guest moved while it runs)
# ROUNDS times each way, alternated; with etcd the commit point is a transaction in an etcd of
# this script's own (data in a temporary directory on this disk; `scripts/setup.sh` unpacks
# Debian's etcd).
# usage: scripts/bench-migrate-etcd.sh [SIZES=256,1024] [ROUNDS=2]
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=${1:-256,1024}
rounds=${2:-2}
. scripts/bench-lib.sh
etcd=$(command -v etcd || echo "${FERRY_TOOLS:-$HOME/.cache/ferry/tools}/etcd")
[ -x "$etcd" ] || { echo "no etcd: run scripts/setup.sh" >&2; exit 1; }
work=$(mktemp -d /var/tmp/ferry-migrate-etcd.XXXXXX)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
peer=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$etcd" --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$port" \
    --advertise-client-urls "http://127.0.0.1:$port" --listen-peer-urls "http://127.0.0.1:$peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "default=http://127.0.0.1:$peer" >"$work/etcd.log" 2>&1 &
etcd_pid=$!
trap 'kill $etcd_pid; wait $etcd_pid 2>/dev/null; rm -rf "$work"' EXIT
until curl -sf -X POST "http://127.0.0.1:$port/v3/kv/range" -d '{"key":"AA=="}' >/dev/null; do sleep 0.2; done
for r in $(seq "$rounds"); do
    echo "### round $r, without etcd"
    "$ferry" bench --only migrate --sizes "$sizes" | grep '^| [0-9]'
    echo "### round $r, with etcd"
    FERRY_BENCH_ETCD=http://127.0.0.1:$port "$ferry" bench --only migrate --sizes "$sizes" | grep '^| [0-9]'
done
