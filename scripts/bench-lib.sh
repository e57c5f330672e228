# Shared by the bench-*.sh scripts (sourced, from the checkout's root): the ferry binary they
# run, and a `dirty` guest suspended into a store.

ferry=${FERRY:-${CARGO_TARGET_DIR:-target}/release/ferry}
[ -x "$ferry" ] || { echo "build first: cargo build --release ($ferry missing)" >&2; exit 1; }
[ -f guests/wasm/dirty.wasm ] || { echo "run guests/build.sh first" >&2; exit 1; }

# suspend_dirty MIB PERMILLE DIR: runs `dirty MIB 100000 PERMILLE` (MIB of random memory, then
# PERMILLE/1000 of its pages rewritten every 100 ms) in the store $FERRY_STORE until it has
# filled its memory, suspends it, and sets `k` to the snapshot. DIR holds its output.
suspend_dirty() {
    local mib=$1 permille=$2 dir=$3 pid
    "$ferry" run guests/wasm/dirty.wasm -- "$mib" 100000 "$permille" >"$dir/out" 2>"$dir/err" &
    pid=$!
    until grep -q ready "$dir/out" 2>/dev/null; do sleep 0.2; done
    sleep 1
    kill -INT "$pid"
    wait "$pid" || true
    k=$(grep -o 'suspended blake3:[0-9a-f]*' "$dir/err" | cut -d' ' -f2)
    echo "snapshot $k of a $mib MiB guest"
}
