#!/usr/bin/env bash
# Two snapshots of one guest through an S3-compatible bucket: a `dirty` guest holding MiB of
# random memory is suspended once its memory is filled, resumed for 2 s (rewriting
# PERMILLE/1000 of its pages every 100 ms) and suspended again; both snapshots are exported
# to one prefix of a bucket (`ferry export -o s3://…:v1`, then `:v2`) on moto's S3 server on
# a free local port (scripts/fetch-moto.sh; it checks every signature and keeps the objects
# in its memory, in Python: a stand-in for a store, not a measure of one), and v2 is imported
# into a fresh store. Prints each export's time and what it sent, and the import's time.
# FERRY=path picks the ferry binary.
# usage: scripts/bench-s3.sh [MiB=512] [PERMILLE=0]
set -euo pipefail
cd "$(dirname "$0")/.."
mib=${1:-512}
permille=${2:-0}
. scripts/bench-lib.sh
tools="${FERRY_TOOLS:-$HOME/.cache/ferry/tools}"
[ -x "$tools/moto/bin/moto_server" ] || { echo "run scripts/setup.sh first (moto missing)" >&2; exit 1; }
work=$(mktemp -d /var/tmp/ferry-s3.XXXXXX)
export FERRY_STORE=$work/store
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
INITIAL_NO_AUTH_ACTION_COUNT=3 "$tools/moto/bin/moto_server" -H 127.0.0.1 -p "$port" >"$work/moto.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$work"' EXIT
export AWS_ENDPOINT_URL="http://127.0.0.1:$port" AWS_REGION=us-east-1
# (A TCP probe: an HTTP request would use up one of the three unsigned calls.)
until (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do sleep 0.1; done
read -r AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY < <("$tools/moto/bin/python" - "$AWS_ENDPOINT_URL" <<'PY'
import boto3, json, sys
ep = sys.argv[1]
iam = boto3.client("iam", endpoint_url=ep, aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1")
iam.create_user(UserName="bench")
k = iam.create_access_key(UserName="bench")["AccessKey"]
iam.put_user_policy(UserName="bench", PolicyName="all", PolicyDocument=json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
boto3.client("s3", endpoint_url=ep, aws_access_key_id=k["AccessKeyId"],
             aws_secret_access_key=k["SecretAccessKey"], region_name="us-east-1").create_bucket(Bucket="bench")
print(k["AccessKeyId"], k["SecretAccessKey"])
PY
)
export AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY

"$ferry" run guests/wasm/dirty.wasm -- "$mib" 100000 "$permille" >"$work/out" 2>"$work/err1" &
pid=$!
until grep -q ready "$work/out" 2>/dev/null; do sleep 0.1; done
sleep 0.5
kill -INT "$pid"; wait "$pid" || true
k1=$(grep -o 'suspended blake3:[0-9a-f]*' "$work/err1" | cut -d' ' -f2)
"$ferry" resume "$k1" >>"$work/out" 2>"$work/err2" &
pid=$!
sleep 2
kill -INT "$pid"; wait "$pid" || true
k2=$(grep -o 'suspended blake3:[0-9a-f]*' "$work/err2" | cut -d' ' -f2)

# timed CMD...: runs it; prints the seconds it took and, after `;`, the end of the last line
# it said on stderr (what an export sent).
timed() {
    local t0 t1 said
    t0=$(date +%s.%N)
    "$@" 2>"$work/said" >/dev/null
    t1=$(date +%s.%N)
    said=$(tail -1 "$work/said")
    echo "$t0 $t1" | awk '{printf "%.2f s", $2 - $1}'
    echo " (${said##*; })"
}
e1=$(timed "$ferry" export "$k1" -o s3://bench/snaps:v1)
e2=$(timed "$ferry" export "$k2" -o s3://bench/snaps:v2)
i2=$(FERRY_STORE=$work/there timed "$ferry" import s3://bench/snaps:v2)
echo "$mib MiB, permille $permille: export v1 $e1; export v2 $e2; import v2 $i2"
