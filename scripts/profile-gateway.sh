#!/usr/bin/env bash
# Where a call's CPU goes: drives one `graft gateway` (and, as the baseline, the scripted
# upstream it forwards to) closed loop with the load generator's soak mode, samples both
# processes with `perf record` (software cpu-clock, DWARF call graphs), and prints the CPU
# each spends per call, split into the pipeline's phases by the functions on the stack.
#
# Usage: bash scripts/profile-gateway.sh [--durability sync|async] [--secs N] [--connections N]
# Needs perf (Debian: linux-perf). Writes target/profile/{gateway,upstream}.perf.data and
# target/profile/phases.md.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
durability=async
secs=8
connections=16
while [[ $# -gt 0 ]]; do
  case "$1" in
    --durability) durability="$2"; shift 2 ;;
    --secs) secs="$2"; shift 2 ;;
    --connections) connections="$2"; shift 2 ;;
    *) echo "profile-gateway: unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v perf > /dev/null || { echo "profile-gateway: perf is not installed (apt-get install linux-perf)" >&2; exit 1; }
out=target/profile
mkdir -p "$out"
cargo build --release --locked --features graft/testkit --bin graft --bench load >&2
bench="$(ls -t target/release/deps/load-* | grep -v '\.d$' | head -1)"
log="$out/soak.log"
# The soak: load for secs+4 s (1 s warm-up before sampling, the rest as margin).
"$bench" --graft-bin target/release/graft --soak --soak-secs $((secs + 4)) --soak-idle-secs 1 \
  --soak-connections "$connections" --soak-durability "$durability" > "$out/soak.md" 2> "$log" &
soak=$!
for _ in $(seq 1 300); do grep -q 'load: soak: gateway' "$log" 2>/dev/null && break; sleep 0.1; done
gw_pid="$(sed -n 's/.*(pid \([0-9]*\),.*/\1/p' "$log" | head -1)"
up_pid="$(pgrep -f 'graft scripted-upstream' | head -1)"
sleep 1
calls_before="$(curl -s "$(sed -n 's/.*load: soak: gateway \(http[^ ]*\).*/\1/p' "$log" | head -1)/metrics" | awk '/^graft_records_total/ {print $2}')"
perf record -q -e cpu-clock -F 997 --call-graph dwarf,16384 -p "$gw_pid" -o "$out/gateway.perf.data" -- sleep "$secs" 2> /dev/null &
p1=$!
perf record -q -e cpu-clock -F 997 --call-graph dwarf,16384 -p "$up_pid" -o "$out/upstream.perf.data" -- sleep "$secs" 2> /dev/null &
p2=$!
wait $p1 $p2
calls_after="$(curl -s "$(sed -n 's/.*load: soak: gateway \(http[^ ]*\).*/\1/p' "$log" | head -1)/metrics" | awk '/^graft_records_total/ {print $2}')"
wait $soak || true
calls=$(( ${calls_after%.*} - ${calls_before%.*} ))
echo "profile-gateway: $calls calls in ${secs}s ($durability, $connections connections)" >&2
python3 scripts/profile-phases.py --calls "$calls" --secs "$secs" --hz 997 \
  "$out/gateway.perf.data" "$out/upstream.perf.data" | tee "$out/phases.md"
