# Shared by the bench-*.sh scripts (sourced, from the checkout's root): the ferry binary they
# run, a `dirty` guest suspended into a store, and spaces started for them.

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

# timed CMD...: how long CMD took, and the rate for the MiB it says it moved ("… (X MiB)" as
# push, pull and import say it, "X MiB of data" as export does). Its stderr goes to
# $work/log.
timed() {
    local t0 t1 mibs
    t0=$(date +%s.%N)
    "$@" 2>"$work/log" >/dev/null
    t1=$(date +%s.%N)
    mibs=$(grep -o '[0-9.]* MiB\( of data\|)\)' "$work/log" | grep -o '^[0-9.]*' | tail -1)
    echo "$t0 $t1 $mibs" | awk '{printf "%.2f s (%.0f MB/s)", $2 - $1, $3 * 1.048576 / ($2 - $1)}'
}

# self_signed_cert DIR: a self-signed ECDSA certificate for 127.0.0.1 (CA:FALSE, so that it
# serves as its own CA) in DIR/cert.pem, its key in DIR/key.pem.
self_signed_cert() {
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 \
        -subj /CN=bench -addext basicConstraints=critical,CA:FALSE \
        -addext subjectAltName=IP:127.0.0.1 -keyout "$1/key.pem" -out "$1/cert.pem" 2>/dev/null
}

# serve_space STORE [ARGS...]: starts `$ferry serve --listen 127.0.0.1:0 ARGS` on the store
# STORE (its stdout in STORE.out, its log in STORE.log), adds its pid to `pids` and sets
# `url` once it listens.
serve_space() {
    local store=$1
    shift
    FERRY_STORE="$store" "$ferry" serve --listen 127.0.0.1:0 "$@" >"$store.out" 2>"$store.log" &
    pids+=($!)
    until grep -q '^listening on' "$store.out" 2>/dev/null; do sleep 0.1; done
    url=$(sed -n 's/^listening on //p' "$store.out")
}
