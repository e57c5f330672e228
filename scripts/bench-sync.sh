#!/usr/bin/env bash
# Sync between two stores over loopback, as `ferry push` and `ferry pull` do it: a guest
# holding MiB of random memory (incompressible: nothing for zstd or dedup to save) is
# suspended once into a durable store; then ROUNDS times: `ferry serve` on a fresh durable
# store, `push` to it, `pull` from it into a third fresh store. The space's store was written
# with direct I/O, so a pull reads it from the disk. Each figure is the command's whole run
# (closure walk, `missing` query, transfer, the receiver's checks, naming); the rate is the
# closure's bytes over that time. Both ends share this machine's cores.
# usage: scripts/bench-sync.sh [MiB=1024] [ROUNDS=3]
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

echo "| round | push | pull |"
echo "|---:|---:|---:|"
for r in $(seq "$rounds"); do
    rm -rf "$work/b" "$work/c"
    sync
    "$ferry" serve --listen 127.0.0.1:0 --store "$work/b" >"$work/serve" 2>&1 &
    server=$!
    until grep -q 'listening on' "$work/serve" 2>/dev/null; do sleep 0.1; done
    url=$(grep -o 'http://[0-9.:]*' "$work/serve" | head -1)
    push=$(timed "$ferry" push --store "$work/a" "$k" --to "$url")
    sync
    pull=$(timed "$ferry" pull --store "$work/c" "$k" --from "$url")
    kill "$server"
    wait "$server" 2>/dev/null || true
    server=
    echo "| $r | $push | $pull |"
done
