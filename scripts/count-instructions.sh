#!/usr/bin/env bash
# Instruction counts of one steady-state workload under callgrind: the whole run, the guest's
# compiled code alone, and its hottest functions by name (docs/benchmarks.md, "instruction
# counts"). Counts, unlike times, do not move with this VM's speed, so builds and
# instrumentation variants are compared this way.
#
#   scripts/count-instructions.sh WORKLOAD [plain|instrumented] [TOP]
#
# WORKLOAD is a `ferry bench --workloads` word (sqlite, zstd, lz4, brotli, lua, cpu, ...).
# The compiled code is cached per binary and side in $FERRY_COUNT_CACHE (default
# ~/.cache/ferry/count): valgrind's CPU differs from the host's, so code compiled natively
# is not reused under valgrind, and compiling under callgrind would count Cranelift too;
# the first call compiles under `valgrind --tool=none`, later calls only count. Environment
# switches of the build being measured pass through; the cache is keyed by the binary, not
# by them, so give each variant of one binary its own FERRY_COUNT_CACHE (else its module is
# compiled under callgrind and the whole-run figure counts Cranelift; the guest-code figure
# stays right). FERRY=path/to/ferry picks another binary.
set -euo pipefail
cd "$(dirname "$0")/.."
workload=${1:?usage: scripts/count-instructions.sh WORKLOAD [plain|instrumented] [TOP]}
side=${2:-instrumented}
top=${3:-12}
ferry=${FERRY:-${CARGO_TARGET_DIR:-target}/release/ferry}
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }
[ -x "$ferry" ] || { echo "no ferry binary at $ferry (cargo build --release)" >&2; exit 2; }
case $side in plain|instrumented) ;; *) echo "side: plain or instrumented, not \`$side\`" >&2; exit 2;; esac

id=$(sha256sum "$ferry" | cut -c1-16)
export FERRY_CACHE="${FERRY_COUNT_CACHE:-$HOME/.cache/ferry/count}/$id-$side"
mkdir -p "$FERRY_CACHE"
bench=("$ferry" bench --only steady --pairs 1 --workloads "$workload" --side "$side")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ ! -e "$FERRY_CACHE/.compiled-$workload" ]; then
    echo "compiling $workload ($side) under valgrind once (minutes)..." >&2
    valgrind --tool=none --smc-check=all-non-file "${bench[@]}" >"$work/compile.log" 2>&1 \
        || { cat "$work/compile.log" >&2; exit 1; }
    touch "$FERRY_CACHE/.compiled-$workload"
fi
echo "counting $workload ($side)..." >&2
# FERRY_PERFMAP=1: wasmtime writes /tmp/perf-<pid>.map, which names the guest's functions.
FERRY_PERFMAP=1 valgrind --tool=callgrind --smc-check=all-non-file \
    --callgrind-out-file="$work/callgrind.out" "${bench[@]}" >"$work/run.log" 2>&1 \
    || { cat "$work/run.log" >&2; exit 1; }
pid=$(sed -n 's/^pid: //p' "$work/callgrind.out")
map=/tmp/perf-$pid.map
[ -f "$map" ] || { echo "no symbol map $map" >&2; exit 1; }
callgrind_annotate --auto=no --inclusive=no --threshold=100 "$work/callgrind.out" >"$work/annotate.txt" 2>/dev/null
cp "$map" "$work/perf.map" && rm -f "$map"
python3 - "$work/annotate.txt" "$work/perf.map" "$top" "$workload" "$side" <<'EOF'
import bisect, re, sys
annotate, pmap, top, workload, side = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
ranges = []
for line in open(pmap):
    parts = line.split(None, 2)
    if len(parts) == 3:
        ranges.append((int(parts[0], 16), int(parts[1], 16), parts[2].strip()))
ranges.sort()
starts = [r[0] for r in ranges]
total, guest, per = 0, 0, {}
in_table = False
for line in open(annotate):
    if 'PROGRAM TOTALS' in line:
        total = int(line.split()[0].replace(',', ''))
    if re.match(r'^Ir\s+file:function', line):
        in_table = True
        continue
    if not in_table:
        continue
    if line.startswith('---'):
        continue
    if not line.strip():
        break  # the per-function table ends at the first blank line
    m = re.match(r'\s*([\d,]+)\s+\([^)]*\)\s+\?\?\?:0x([0-9a-fA-F]+)', line)
    if not m:
        continue
    ir, addr = int(m.group(1).replace(',', '')), int(m.group(2), 16)
    i = bisect.bisect_right(starts, addr) - 1
    if i >= 0 and ranges[i][0] <= addr < ranges[i][0] + ranges[i][1]:
        guest += ir
        per[ranges[i][2]] = per.get(ranges[i][2], 0) + ir
print(f"{workload} ({side}): whole run {total / 1e9:.3f} x 10^9 instructions, guest code {guest / 1e9:.3f} x 10^9")
for name, ir in sorted(per.items(), key=lambda x: -x[1])[:top]:
    print(f"  {ir / 1e9:7.3f}  {name}")
EOF
