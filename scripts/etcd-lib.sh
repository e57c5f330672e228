# Shared by the bench scripts that need an etcd of their own (sourced, from the checkout's
# root): checks that there is one to run (`scripts/setup.sh` fetches it), and `start_etcd DIR`
# runs it on free local ports with its data in DIR/etcd (its log in DIR/etcd.log), sets
# `etcd_url` and `etcd_pid`, and returns once it answers. The caller stops it.

etcd=$(command -v etcd || echo "${FERRY_TOOLS:-$HOME/.cache/ferry/tools}/etcd")
[ -x "$etcd" ] || { echo "no etcd: run scripts/setup.sh" >&2; exit 1; }
etcd_pid=

# A TCP port free on 127.0.0.1 now.
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_etcd() {
    local dir=$1 port peer
    port=$(free_port)
    peer=$(free_port)
    "$etcd" --data-dir "$dir/etcd" --listen-client-urls "http://127.0.0.1:$port" \
        --advertise-client-urls "http://127.0.0.1:$port" --listen-peer-urls "http://127.0.0.1:$peer" \
        --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
        --initial-cluster "default=http://127.0.0.1:$peer" >"$dir/etcd.log" 2>&1 &
    etcd_pid=$!
    etcd_url=http://127.0.0.1:$port
    until curl -sf -X POST "$etcd_url/v3/kv/range" -d '{"key":"AA=="}' >/dev/null; do
        kill -0 "$etcd_pid" 2>/dev/null || { echo "etcd failed:" >&2; cat "$dir/etcd.log" >&2; exit 1; }
        sleep 0.2
    done
}
