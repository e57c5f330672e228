#!/usr/bin/env bash
# Live migration over HTTP and over HTTPS, side by side: `ferry bench --only migrate` (two
# `ferry serve` processes on loopback, the `dirty` guest moved while it runs) ROUNDS times
# each way, alternated; the HTTPS spaces use a self-signed ECDSA certificate made with
# openssl, trusted through FERRY_TLS_CA.
# usage: scripts/bench-migrate-tls.sh [SIZES=256,1024] [ROUNDS=2]
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=${1:-256,1024}
rounds=${2:-2}
. scripts/bench-lib.sh
work=$(mktemp -d /var/tmp/ferry-migrate-tls.XXXXXX)
trap 'rm -rf "$work"' EXIT
self_signed_cert "$work"
for r in $(seq "$rounds"); do
    echo "### round $r, HTTP"
    "$ferry" bench --only migrate --sizes "$sizes" | grep '^| [0-9]'
    echo "### round $r, HTTPS"
    FERRY_TLS_CA=$work/cert.pem FERRY_BENCH_TLS_CERT=$work/cert.pem FERRY_BENCH_TLS_KEY=$work/key.pem \
        "$ferry" bench --only migrate --sizes "$sizes" | grep '^| [0-9]'
done
