#!/usr/bin/env bash
# The graft rl loop benchmark, on CPU: the CPU example (SmolLM2-135M-Instruct served by the
# embedded `graft serve`, the example agent in local envd sandboxes, the gateway in exact
# mode) run for a few steps twice, side by side:
#   baseline  rollout.max_staleness = 0: each step's rollouts wait for the previous
#             step's training and weight push;
#   overlap   rollout.max_staleness = 1: the next step's rollouts run while a step trains.
# So that every step trains, the tasks' reward is graded (shorter final answers score
# higher) and groups are taken whole (rollout.selection = "group"). Writes a table of the
# time per step split into rollout, reward, reconstruct, train and weight push (from each
# run's steps.jsonl), and the overlap's wall time against the baseline's, to
# target/bench-rl.md.
#
# Usage: bash scripts/bench-rl.sh [--update-docs] [--steps N]
#   --update-docs  also replaces the results in docs/BENCHMARKS.md (between the bench:rl
#   markers) with target/bench-rl.md.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

update_docs=0
steps=3
while [[ $# -gt 0 ]]; do
  case "$1" in
    --update-docs) update_docs=1 ;;
    --steps) steps="$2"; shift ;;
    *) echo "bench-rl: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

bash scripts/setup-libtorch.sh > /dev/null
bash scripts/setup-test-env.sh > /dev/null
cargo build --release --locked --bin graft --bin envd-agent < /dev/null
graft="${CARGO_TARGET_DIR:-$repo/target}/release/graft"
if [[ ! -f models/smollm2/config.json ]]; then
  gguf="$(bash scripts/setup-models.sh)"
  "$graft" model import --gguf "$gguf" --out models/smollm2
fi

work="$repo/target/bench-rl"
rm -rf "$work"
mkdir -p "$work"
# The example's tasks and agent, with a graded verifier: 1 / (1 + words in the final answer).
python3 - "$work/tasks.jsonl" <<'EOF'
import json, sys
reward = ("/mnt/py/bin/python -c 'import pathlib; "
          "w = len(pathlib.Path(\"final_answer.txt\").read_text().split()); print(1 / (1 + w))'")
with open("examples/rl/tasks.jsonl") as f, open(sys.argv[1], "w") as out:
    for line in f:
        t = json.loads(line)
        t["reward"] = {"command": reward, "parse": "stdout"}
        out.write(json.dumps(t) + "\n")
EOF
cp examples/rl/agent.py "$work/agent.py"

config() { # name staleness
  cat > "$work/$1.toml" <<EOF
[run]
out_dir = "$1"
steps = $steps
seed = 1
keep_checkpoints = 1

[tasks]
file = "tasks.jsonl"

[harness]
command = "/mnt/py/bin/python /mnt/rl/agent.py"
timeout_secs = 300
env = { AGENT_MAX_STEPS = "2", AGENT_MAX_TOKENS = "64" }
mounts = { "/mnt/py" = "$repo/.graft-test-env/sandbox" }

[backend]
model_dir = "$repo/models/smollm2"

[rollout]
tasks_per_step = 2
group_size = 4
max_group_size = 4
concurrency = 4
selection = "group"
max_staleness = $2

[trainer]
lr = 1e-5
EOF
}

declare -A wall
for run in baseline overlap; do
  staleness=0
  [[ $run == overlap ]] && staleness=1
  config "$run" "$staleness"
  echo "bench-rl: $run (max_staleness = $staleness), $steps steps"
  t0=$(date +%s.%N)
  GRAFT_LOG=warn "$graft" rl --config "$work/$run.toml" < /dev/null > "$work/$run.log" 2>&1 \
    || { tail -20 "$work/$run.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  wall[$run]=$(python3 -c "print($t1 - $t0)")
  rm -rf "$work/$run/checkpoints"   # SmolLM2's weights + optimizer state: 2 GB a step
done

python3 - "$work" "$steps" "${wall[baseline]}" "${wall[overlap]}" > "$work/table.md" <<'EOF'
import json, sys, pathlib
work, steps, wall_b, wall_o = pathlib.Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
def load(run):
    return [json.loads(l) for l in (work / run / "steps.jsonl").read_text().splitlines() if l.strip()]
base, over = load("baseline"), load("overlap")
def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0
rows = [
    ("rollout (wall: sandboxes, harness, reward, in parallel)", "rollout"),
    ("reconstruct (records → samples Parquet)", "reconstruct"),
    ("train (`graft train`: load, GRPO step, write checkpoint)", "train"),
    ("weight push (pause → flush → reload → continue)", "push"),
]
total = mean([sum(s["secs"][k] for _, k in rows) for s in base])
print("| phase (baseline run, mean per step) | seconds | share of step |")
print("|---|---|---|")
for name, k in rows:
    v = mean([s["secs"][k] for s in base])
    print(f"| {name} | {v:.3f} | {v / total:.1%} |")
print(f"| **step** | **{total:.2f}** | 100% |")
rollouts = sum(s["rollouts"] for s in base)
harness = mean([s["secs"]["harness_in_rollouts"] / max(1, s["rollouts"]) for s in base])
reward = mean([s["secs"]["reward_in_rollouts"] / max(1, s["rollouts"]) for s in base])
print()
print(f"Within a rollout ({rollouts} rollouts, 4 at a time): the harness ran {harness:.2f} s on average "
      f"(model calls included) and the reward command {reward:.2f} s.")
print()
print("| run | steps | wall s | s per step | vs baseline | trained steps | calls by weight version |")
print("|---|---|---|---|---|---|---|")
for run, log, wall in (("baseline: max_staleness = 0", base, wall_b), ("overlap: max_staleness = 1", over, wall_o)):
    versions = {}
    for s in log:
        for v, n in s.get("call_weight_versions", {}).items():
            versions[v] = versions.get(v, 0) + n
    trained = sum(1 for s in log if "log" in s["train"])
    vs = ", ".join(f"{k}: {v}" for k, v in sorted(versions.items()))
    print(f"| {run} | {len(log)} | {wall:.1f} | {wall / len(log):.2f} | {wall / wall_b:.2f}x | {trained} | {vs} |")
EOF

out="target/bench-rl.md"
{
  echo "Run $(date -u +%Y-%m-%dT%H:%MZ) with \`bash scripts/bench-rl.sh --steps $steps\` on $(nproc) cores"
  echo "($(uname -m), release build; wall times include graft rl's start: the embedded backend loading SmolLM2)."
  echo
  cat "$work/table.md"
} > "$out"

if [[ $update_docs == 1 ]]; then
  doc="docs/BENCHMARKS.md"
  begin='<!-- bench:rl:begin -->'
  end='<!-- bench:rl:end -->'
  if grep -qF "$begin" "$doc" && grep -qF "$end" "$doc"; then
    awk -v b="$begin" -v e="$end" -v f="$out" '
      $0 == b { print; while ((getline line < f) > 0) print line; skip = 1; next }
      $0 == e { skip = 0 }
      !skip { print }' "$doc" > "$doc.tmp" && mv "$doc.tmp" "$doc"
    echo "bench-rl: results in $doc replaced"
  else
    echo "bench-rl: $doc has no bench:rl markers; not updated" >&2
  fi
fi
cat "$out"
