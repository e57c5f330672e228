#!/usr/bin/env bash
# Two snapshots of one guest through a container registry: a `dirty` guest holding MiB of
# random memory is suspended once its memory is filled, resumed for 2 s (rewriting PERMILLE/1000
# of its pages every 100 ms) and suspended again; both snapshots are exported into one OCI
# layout (tags v1, v2) and pushed with `skopeo copy` to Debian's `docker-registry` on a free
# local port. Prints the time of each push, the layers of v2 and the MiB v2 adds to v1's
# (what a registry has to receive the second time). Needs skopeo and the registry binary
# (scripts/setup.sh). FERRY=path picks the ferry binary, to compare builds side by side.
# With FILES_MiB > 0 the guest also has a mounted directory of that many MiB of random files
# (8 MiB each), to which a small file is added between the two snapshots.
# usage: scripts/bench-oci.sh [MiB=512] [PERMILLE=0] [FILES_MiB=0]
set -euo pipefail
cd "$(dirname "$0")/.."
mib=${1:-512}
permille=${2:-0}
files_mib=${3:-0}
. scripts/bench-lib.sh
registry=$(command -v docker-registry || echo "${FERRY_TOOLS:-$HOME/.cache/ferry/tools}/docker-registry")
[ -x "$registry" ] || { echo "run scripts/setup.sh first (docker-registry missing)" >&2; exit 1; }
work=$(mktemp -d /var/tmp/ferry-oci.XXXXXX)
export FERRY_STORE=$work/store
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
printf 'version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: 127.0.0.1:%s\n' \
    "$work/registry" "$port" >"$work/registry.yml"
"$registry" serve "$work/registry.yml" >"$work/registry.log" 2>&1 &
reg=$!
trap 'kill $reg 2>/dev/null; rm -rf "$work"' EXIT
until curl -sf "http://127.0.0.1:$port/v2/" >/dev/null; do sleep 0.1; done

mount=()
if [ "$files_mib" -gt 0 ]; then
    mkdir "$work/data"
    for i in $(seq 1 $((files_mib / 8))); do
        head -c $((8 << 20)) /dev/urandom >"$work/data/file-$i.bin"
    done
    mount=(--dir "$work/data::/data")
fi
"$ferry" run "${mount[@]}" guests/wasm/dirty.wasm -- "$mib" 100000 "$permille" >"$work/out" 2>"$work/err1" &
pid=$!
until grep -q ready "$work/out" 2>/dev/null; do sleep 0.1; done
sleep 0.5
kill -INT "$pid"; wait "$pid" || true
k1=$(grep -o 'suspended blake3:[0-9a-f]*' "$work/err1" | cut -d' ' -f2)
if [ "$files_mib" -gt 0 ]; then
    echo "added between the snapshots" >"$work/data/note.txt"
    mount+=(--allow-changed-dirs)
fi
"$ferry" resume "${mount[@]}" "$k1" >>"$work/out" 2>"$work/err2" &
pid=$!
sleep 2
kill -INT "$pid"; wait "$pid" || true
k2=$(grep -o 'suspended blake3:[0-9a-f]*' "$work/err2" | cut -d' ' -f2)
"$ferry" export "$k1" -o "oci:$work/layout:v1" 2>/dev/null
"$ferry" export "$k2" -o "oci:$work/layout:v2" 2>/dev/null

push() {
    local t0 t1
    t0=$(date +%s.%N)
    skopeo copy -q --dest-tls-verify=false "oci:$work/layout:$1" "docker://127.0.0.1:$port/bench:$1"
    t1=$(date +%s.%N)
    echo "$t0 $t1" | awk '{printf "%.2f s", $2 - $1}'
}
p1=$(push v1)
p2=$(push v2)
added=$(python3 - "$work/layout" <<'PY'
import json, sys
d = sys.argv[1]
index = json.load(open(f"{d}/index.json"))
layers = []
for m in index["manifests"]:
    manifest = json.load(open(f"{d}/blobs/sha256/{m['digest'][7:]}"))
    layers.append({l["digest"]: l["size"] for l in manifest["layers"]})
new = sum(s for dg, s in layers[1].items() if dg not in layers[0])
print(f"{len(layers[1])} layers, {new / 2**20:.1f} MiB of them new")
PY
)
echo "$mib MiB, permille $permille, $files_mib MiB of files: push v1 $p1, push v2 $p2; v2: $added"
