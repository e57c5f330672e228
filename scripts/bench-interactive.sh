#!/usr/bin/env bash
# How long an interactive session of a space takes to answer a typed line (docs/migration.md,
# "Interactive sessions"): two `ferry serve` of one etcd fleet (an etcd of this script's own),
# CPython 3.12 evaluating each line it reads and printing the result, run on A with
# `ferry --space A run -i --checkpoint-every 60s`, once without a standby and once with
# `--standby B`. With a standby, a line is taken once B holds it too and its answer is shown
# once B holds a checkpoint covering it: the guest waiting for the next line has that
# checkpoint taken at once. Prints the median, 90th percentile and largest time from writing a
# line to `run -i`'s stdin until its answer comes out of its stdout.
# usage: scripts/bench-interactive.sh [LINES=20]
set -euo pipefail
cd "$(dirname "$0")/.."
lines=${1:-20}
. scripts/bench-lib.sh
. scripts/etcd-lib.sh
work=$(mktemp -d /var/tmp/ferry-interactive.XXXXXX)
pids=()
trap 'kill "${pids[@]}" $etcd_pid 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
start_etcd "$work"
export FERRY_TOKEN=bench-interactive FERRY_STORE="$work/client"
"$ferry" python install 3.12 >/dev/null 2>&1 || { echo "cannot install Python 3.12" >&2; exit 1; }
serve_space "$work/a" --etcd "$etcd_url"
a=$url
serve_space "$work/b" --etcd "$etcd_url"
b=$url
mkdir "$work/script"
cat >"$work/script/answer.py" <<'EOF'
import sys
for line in sys.stdin:
    print("got", eval(line), flush=True)
EOF
FERRY="$ferry" SPACE="$a" STANDBY="$b" SCRIPT="$work/script/answer.py" LINES="$lines" python3 - <<'EOF'
import os, statistics, subprocess, time
ferry, space, standby, script = (os.environ[k] for k in ("FERRY", "SPACE", "STANDBY", "SCRIPT"))
lines = int(os.environ["LINES"])

def answers(extra):
    p = subprocess.Popen(
        [ferry, "--space", space, "run", "-i", "--checkpoint-every", "60s", *extra, script],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    # The first answer also waits for the start (and, with a standby, its first copy).
    p.stdin.write(b"0\n"); p.stdin.flush(); p.stdout.readline()
    took = []
    for i in range(1, lines + 1):
        t = time.monotonic()
        p.stdin.write(f"{i}*{i}\n".encode()); p.stdin.flush()
        got = p.stdout.readline()
        took.append((time.monotonic() - t) * 1000)
        assert got == f"got {i * i}\n".encode(), got
        time.sleep(0.2)
    p.stdin.close()
    assert p.wait() == 0
    return took

print("| standby | lines | median (ms) | p90 (ms) | max (ms) |")
print("|---|---:|---:|---:|---:|")
for name, extra in (("none", []), ("`--standby B`", ["--standby", standby])):
    t = sorted(answers(extra))
    print(f"| {name} | {len(t)} | {statistics.median(t):.0f} | {t[int(len(t) * 0.9)]:.0f} | {t[-1]:.0f} |")
EOF
