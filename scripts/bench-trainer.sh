#!/usr/bin/env bash
# The trainer benchmark (trainer/benches/trainer.rs): GRPO optimizer steps (forward,
# backward, AdamW over fp32 masters) against a bare forward + backward of the same batch
# measured in the same run, MFU against --peak-tflops, KV-cache sampling throughput, and
# the resident trainer against the per-step path (a step + checkpoint write + reload vs the
# step alone; the in-process weight handoff), on Qwen3 shapes with random weights. Writes
# target/bench-trainer.md.
#
# Usage: bash scripts/bench-trainer.sh [--update-docs] [bench flags...]
#   CPU default:  --shape tiny --batch 4 --seq 256 --steps 3
#   GPU (H200):   --shape qwen3-0.6b --shape qwen3-1.7b --batch 8 --seq 2048 --steps 5 --peak-tflops 989
#   --update-docs replaces the trainer results in docs/BENCHMARKS.md (between the
#   bench:trainer markers) with target/bench-trainer.md.
# On a GPU machine whose Python already has torch 2.11.0 (+cu130), GRAFT_TORCH_FROM_PYTHON=1
# runs the binary against that libtorch (its CUDA libraries sit next to it) instead of the
# CPU-only set from scripts/setup-libtorch.sh.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
update_docs=0
flags=()
for a in "$@"; do
  if [[ "$a" == "--update-docs" ]]; then update_docs=1; else flags+=("$a"); fi
done
[[ ${#flags[@]} -gt 0 ]] || flags=(--shape tiny --batch 4 --seq 256 --steps 3)
if [[ "${GRAFT_TORCH_FROM_PYTHON:-}" == 1 ]]; then
  LIBTORCH="$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
  export LD_LIBRARY_PATH="$LIBTORCH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  LIBTORCH="$(bash scripts/setup-libtorch.sh)"
fi
export LIBTORCH
mkdir -p target
raw="$repo/target/bench-trainer-table.md"
cmd=(cargo bench -p graft-trainer --bench trainer -- "${flags[@]}" --out "$raw")
echo "bench-trainer: ${cmd[*]}"
"${cmd[@]}" < /dev/null
{
  echo "Run $(date -u +%Y-%m-%d) on $(nproc) cores ($(uname -m)), $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ //')."
  echo
  echo "\`bash scripts/bench-trainer.sh ${flags[*]}\`"
  echo
  cat "$raw"
} > target/bench-trainer.md
cat target/bench-trainer.md
if [[ $update_docs == 1 ]]; then
  python3 - <<'PY'
import re
doc = open("docs/BENCHMARKS.md").read()
new = open("target/bench-trainer.md").read().strip()
pat = re.compile(r"(<!-- bench:trainer:start -->\n).*?(\n<!-- bench:trainer:end -->)", re.S)
if not pat.search(doc):
    raise SystemExit("docs/BENCHMARKS.md has no bench:trainer markers")
open("docs/BENCHMARKS.md", "w").write(pat.sub(lambda m: m.group(1) + new + m.group(2), doc))
PY
  echo "bench-trainer: docs/BENCHMARKS.md updated"
fi
