#!/usr/bin/env bash
# Export and import of a capsule, as `ferry export` and `ferry import` do it: a guest holding
# MiB of random memory (incompressible) is suspended once into a durable store; then ROUNDS
# times: `ferry export` of its snapshot to a file (written, `fsync`ed and renamed), and
# `ferry import` of that file into a fresh durable store. The snapshot's packs were written
# with direct I/O and exports read them with direct I/O, so every export reads them from the
# disk; the capsule an import reads is in the page cache (just written). Each figure is the
# whole command; the rate is the closure's bytes over that time.
# usage: scripts/bench-capsule.sh [MiB=1024] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
mib=${1:-1024}
rounds=${2:-3}
. scripts/bench-lib.sh
work=$(mktemp -d /var/tmp/ferry-capsule.XXXXXX)
trap 'rm -rf "$work"' EXIT
FERRY_STORE=$work/a suspend_dirty "$mib" 0 "$work"

echo "| round | export | import |"
echo "|---:|---:|---:|"
for r in $(seq "$rounds"); do
    rm -rf "$work/b" "$work/cap.ferry"
    sync
    export=$(timed "$ferry" export --store "$work/a" "$k" -o "$work/cap.ferry")
    sync
    import=$(timed "$ferry" import --store "$work/b" "$work/cap.ferry")
    echo "| $r | $export | $import |"
done
