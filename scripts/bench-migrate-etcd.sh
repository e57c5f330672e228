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
. scripts/etcd-lib.sh
work=$(mktemp -d /var/tmp/ferry-migrate-etcd.XXXXXX)
trap 'kill $etcd_pid 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
start_etcd "$work"
for r in $(seq "$rounds"); do
    echo "### round $r, without etcd"
    "$ferry" bench --only migrate --sizes "$sizes" | grep '^| [0-9]'
    echo "### round $r, with etcd"
    FERRY_BENCH_ETCD=$etcd_url "$ferry" bench --only migrate --sizes "$sizes" | grep '^| [0-9]'
done
