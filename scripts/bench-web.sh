#!/usr/bin/env bash
# The JavaScript space beside native ferry (docs/benchmarks.md, "The JavaScript space"):
#   scripts/bench-web.sh [ROUNDS] [MIB] [PARTS]
# 1. the conformance kit's CPython 3.12 snapshot (safe point 3,000,000), served by a space,
#    resumed to its end ROUNDS times each, alternated: natively (`ferry resume`, compiled code
#    cached), in Node (web/ferry-resume.mjs) and in a headless Chromium tab (web/browser.mjs);
# 2. a `dirty` guest of MIB MiB (default 256): its snapshot resumed in Node and suspended
#    there 3 s later (Ctrl-C), with the times Node reports (-v);
# 3. a running space session of that `dirty` guest taken over by Node (web/ferry-resume.mjs
#    --session: the space suspends it and lends it), given back 3 s later (Ctrl-C) and resumed
#    on the space: how long each move takes.
# PARTS: which of them, e.g. `1,3` (default all).
# Needs Node 24 and chromium-headless-shell (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench-lib.sh
rounds=${1:-3}
mib=${2:-256}
parts=,${3:-1,2,3},
node=${FERRY_NODE:-${FERRY_TOOLS:-$HOME/.cache/ferry/tools}/node-24.22.3/bin/node}
work=$(mktemp -d)
trap 'kill $server 2>/dev/null; rm -rf "$work"' EXIT
echo bench-token >"$work/token"
export FERRY_TOKEN=bench-token

"$ferry" conformance --only cpython --engine jit --keep "$work/kit" >/dev/null
k=$(python3 -c "import json,sys; print([s['snapshot'] for s in json.load(open(sys.argv[1]))['snapshots'] if s['point'] == 'safe point 3000000'][0])" "$work/kit/manifest.json")
"$ferry" serve --listen 127.0.0.1:0 --store "$work/kit" --token-file "$work/token" >"$work/serve" 2>/dev/null &
server=$!
until grep -q listening "$work/serve" 2>/dev/null; do sleep 0.1; done
url=$(sed -n 's/^listening on //p' "$work/serve")
FERRY_STORE="$work/here" "$ferry" pull "$k" --from "$url" >/dev/null 2>&1
FERRY_STORE="$work/here" "$ferry" resume "$k" >/dev/null 2>&1 # compile once
[[ $parts == *,1,* ]] && echo "CPython 3.12 snapshot $k, resumed to its end (s):"
for i in $(seq "$rounds"); do
    [[ $parts == *,1,* ]] || break
    t0=$(date +%s.%N); FERRY_STORE="$work/here" "$ferry" resume "$k" >/dev/null 2>&1; t1=$(date +%s.%N)
    "$node" web/ferry-resume.mjs --space "$url" "$k" >/dev/null 2>&1; t2=$(date +%s.%N)
    "$node" web/browser.mjs --space "$url" "$k" >/dev/null 2>&1; t3=$(date +%s.%N)
    echo "$i $t0 $t1 $t2 $t3" | awk '{printf "  round %d: native %.2f, Node %.2f, Chromium tab %.2f\n", $1, $3 - $2, $4 - $3, $5 - $4}'
done

if [[ $parts == *,2,* ]]; then
    echo "dirty guest of $mib MiB in Node (resume, then Ctrl-C after 3 s):"
    FERRY_STORE="$work/dirty" suspend_dirty "$mib" 10 "$work" >/dev/null
    FERRY_STORE="$work/dirty" "$ferry" push "$k" --to "$url" >/dev/null 2>&1
fi
for i in $(seq "$rounds"); do
    [[ $parts == *,2,* ]] || break
    "$node" web/ferry-resume.mjs -v --space "$url" "$k" >/dev/null 2>"$work/v" &
    pid=$!
    until grep -q "the guest runs" "$work/v" 2>/dev/null; do sleep 0.05; done
    sleep 3
    t0=$(date +%s.%N); kill -INT "$pid"; wait "$pid" || true; t1=$(date +%s.%N)
    ran=$(grep -o 'the guest runs ([0-9]* ms' "$work/v" | grep -o '[0-9]*')
    unwound=$(grep -o 'writing its snapshot ([0-9]* ms' "$work/v" | grep -o '[0-9]*')
    pushing=$(grep -o 'pushing [0-9]* objects ([0-9]* ms' "$work/v" | grep -o '([0-9]*' | tr -d '(')
    new=$(grep -o '[0-9]* objects, [0-9.]* MiB new' "$work/v")
    echo "$i $ran $unwound $pushing $t0 $t1" | awk -v new="$new" '{printf "  round %d: running after %.2f s; Ctrl-C to suspended %.2f s (snapshot written in %.2f s, then pushed: %s)\n", $1, $2 / 1000, $6 - $5, ($4 - $3) / 1000, new}'
done

[[ $parts == *,3,* ]] && echo "a running space session, dirty guest of $mib MiB, taken over by Node (pre-copy, lend, resume), given back after 3 s, resumed on the space:"
for i in $(seq "$rounds"); do
    [[ $parts == *,3,* ]] || break
    id=take$i
    "$ferry" --space "$url" run --session "$id" guests/wasm/dirty.wasm -- "$mib" 100000 10 >/dev/null 2>&1
    until "$ferry" --space "$url" logs "$id" 2>/dev/null | grep -q ready; do sleep 0.2; done
    sleep 1
    "$node" web/ferry-resume.mjs -v --lease 0 --space "$url" --session "$id" >/dev/null 2>"$work/t" &
    pid=$!
    until grep -q "the guest runs" "$work/t" 2>/dev/null; do sleep 0.02; done
    sleep 3
    t2=$(date +%s.%N); kill -INT "$pid"; wait "$pid" || true; t3=$(date +%s.%N)
    "$ferry" --space "$url" resume "$id" >/dev/null 2>&1; t4=$(date +%s.%N)
    "$ferry" --space "$url" kill "$id" >/dev/null 2>&1
    pre=$(grep -o 'pre-copied checkpoint [^ ]* ([0-9.]* MiB) while the session ran on ([0-9]* ms' "$work/t" | grep -o '([0-9.]*' | tr -d '(' | paste - - | awk '{n++; mib += $1; ms += $2; last = $1} END {printf "%d %.1f %d %.1f", n, mib, ms, last}')
    lend=$(grep -o 'the lend took [0-9]* ms' "$work/t" | grep -o '[0-9]*')
    runs=$(grep -o 'the guest runs ([0-9]* ms' "$work/t" | grep -o '[0-9]*')
    verified=$(grep -o 'verified [0-9.]* MiB' "$work/t" | grep -o '[0-9.]*')
    new=$(grep -o '[0-9]* objects, [0-9.]* MiB new' "$work/t")
    echo "$i $pre $lend $runs $verified $t2 $t3 $t4" | awk -v new="$new" '{printf "  round %d: pre-copy %d rounds, %.0f MiB in %.2f s (the last %.1f MiB; the guest running on the space); downtime %.2f s (lend %.2f s, then %.1f MiB fetched and the guest restored in %.2f s); Ctrl-C to given back %.2f s (%s); resumed on the space %.2f s\n", $1, $2, $3, $4 / 1000, $5, ($6 + $7) / 1000, $6 / 1000, $8 - $3, $7 / 1000, $10 - $9, new, $11 - $10}'
done
