#!/usr/bin/env bash
# Resume to running, chunks mapped from their pack (FERRY_MAP_CHUNKS=on, the default) against
# copied (off), alternated in one run: a guest holding MiB of random memory is suspended once
# into a fresh durable store, then resumed ROUNDS times per mode, each in a new `ferry -v
# resume` process interrupted 2 s later. "cold" drops the page cache first (needs root: the
# chunks come from the disk); "warm" resumes right after (they are in the page cache).
# SWITCH=FERRY_CHECK_WHILE_RUNNING alternates that variable instead (post-copy on/off).
# A cell is "R" ms to running, or "R (C)" when mapped chunks were checked while the guest
# ran: C ms until that check ended (when the guest's first host call could go on).
# usage: [SWITCH=VAR] scripts/bench-resume-map.sh [MiB=1024] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
mib=${1:-1024}
rounds=${2:-3}
. scripts/bench-lib.sh
work=$(mktemp -d /var/tmp/ferry-map.XXXXXX)
trap 'rm -rf "$work"' EXIT
export FERRY_STORE=$work/store
suspend_dirty "$mib" 10 "$work"

switch=${SWITCH:-FERRY_MAP_CHUNKS}

# ms from ferry's start until the restored guest runs, as `ferry -v` logs it (and until the
# check of mapped chunks running beside it ended).
resume_ms() {
    env "$switch=$1" "$ferry" -v resume "$k" >/dev/null 2>"$work/r" &
    local p=$!
    sleep 2
    kill -INT "$p"
    wait "$p" || true
    awk '/ INFO running /{r = $1 * 1000}
         / INFO mapped chunks checked /{c = $1 * 1000}
         END {if (c) printf "%.0f (%.0f)", r, c; else printf "%.0f", r}' "$work/r"
}

echo "$switch=on against off"
echo "| round | on, cold (ms) | off, cold (ms) | on, warm (ms) | off, warm (ms) |"
echo "|---:|---:|---:|---:|---:|"
can_drop=$([ -w /proc/sys/vm/drop_caches ] && echo yes || echo no)
for r in $(seq "$rounds"); do
    row="| $r |"
    for mode in on off; do
        if [ "$can_drop" = yes ]; then
            sync
            echo 3 >/proc/sys/vm/drop_caches
            row="$row $(resume_ms $mode) |"
        else
            row="$row (not root) |"
        fi
    done
    for mode in on off; do
        resume_ms $mode >/dev/null
        row="$row $(resume_ms $mode) |"
    done
    echo "$row"
done
