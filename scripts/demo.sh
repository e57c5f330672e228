#!/usr/bin/env bash
# The bundled example: run a CPython program, suspend it mid-loop (as Ctrl-C would), resume it
# in a new process, and compare with an uninterrupted run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# The build `cargo build --release` just made: under $CARGO_TARGET_DIR when that is set.
ferry="${FERRY:-${CARGO_TARGET_DIR:-$root/target}/release/ferry}"
[ -x "$ferry" ] || ferry="$root/target/release/ferry"
python="${FERRY_GUEST_CACHE:-$HOME/.cache/ferry/guests}/python-3.12.0.wasm"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export FERRY_STORE="$work/store"
mkdir -p "$work/app"
cp "$root/guests/python/loop.py" "$work/app/"

echo "== uninterrupted run"
"$ferry" run --dir "$work/app::/app" "$python" -- /app/loop.py 40 > "$work/plain.txt"
tail -n 2 "$work/plain.txt"

echo "== the same program, suspended and resumed in a new process"
"$ferry" run --dir "$work/app::/app" "$python" -- /app/loop.py 40 > "$work/moved.txt" 2> "$work/err.txt" &
pid=$!
sleep 1
kill -INT "$pid"
wait "$pid" || code=$?
cat "$work/err.txt"
[ "${code:-0}" = 75 ] || { echo "demo: expected exit 75 (suspended), got ${code:-0}" >&2; exit 1; }
snapshot="$(awk '/^suspended /{print $2}' "$work/err.txt")"
"$ferry" inspect "$snapshot"
"$ferry" resume --dir "$work/app::/app" "$snapshot" >> "$work/moved.txt"
tail -n 2 "$work/moved.txt"
if cmp -s "$work/plain.txt" "$work/moved.txt"; then
    echo "== identical output: $(wc -l < "$work/moved.txt") lines"
else
    echo "demo: outputs differ" >&2
    diff "$work/plain.txt" "$work/moved.txt" >&2 || true
    exit 1
fi
