#!/usr/bin/env bash
# Sync between two stores over loopback, as `ferry push` and `ferry pull` do it: a guest
# holding MiB of random memory (incompressible: nothing for zstd or dedup to save) is
# suspended once into a durable store; then ROUNDS times: `ferry serve` on a fresh durable
# store, `push` to it, `pull` from it into a third fresh store. The space's store was written
# with direct I/O, so a pull reads it from the disk. Each figure is the command's whole run
# (closure walk, `missing` query, transfer, the receiver's checks, naming); the rate is the
# closure's bytes over that time. Both ends share this machine's cores. With TLS=both, each
# round runs twice, over HTTP and over HTTPS (a self-signed certificate made with openssl,
# trusted through FERRY_TLS_CA), side by side.
# usage: [TLS=both] scripts/bench-sync.sh [MiB=1024] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
mib=${1:-1024}
rounds=${2:-3}
. scripts/bench-lib.sh
work=$(mktemp -d /var/tmp/ferry-sync.XXXXXX)
server=
trap '[ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$work"' EXIT
export FERRY_TOKEN=bench-sync-token
FERRY_STORE=$work/a suspend_dirty "$mib" 0 "$work"

if [ "${TLS:-}" = both ]; then
    schemes="http https"
    self_signed_cert "$work"
    export FERRY_TLS_CA=$work/cert.pem
else
    schemes=http
fi

echo "| round | scheme | push | pull |"
echo "|---:|---|---:|---:|"
for r in $(seq "$rounds"); do
  for scheme in $schemes; do
    rm -rf "$work/b" "$work/c"
    sync
    tls=()
    [ "$scheme" = https ] && tls=(--tls-cert "$work/cert.pem" --tls-key "$work/key.pem")
    "$ferry" serve --listen 127.0.0.1:0 --store "$work/b" "${tls[@]}" >"$work/serve" 2>&1 &
    server=$!
    until grep -q 'listening on' "$work/serve" 2>/dev/null; do sleep 0.1; done
    url=$(grep -o 'https\?://[0-9.:]*' "$work/serve" | head -1)
    push=$(timed "$ferry" push --store "$work/a" "$k" --to "$url")
    sync
    pull=$(timed "$ferry" pull --store "$work/c" "$k" --from "$url")
    kill "$server"
    wait "$server" 2>/dev/null || true
    server=
    echo "| $r | $scheme | $push | $pull |"
  done
done
