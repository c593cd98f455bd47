#!/usr/bin/env bash
# The graft rl loop benchmark, on CPU: the CPU example (SmolLM2-135M-Instruct served by the
# embedded `graft serve`, the example agent in local envd sandboxes, the gateway in exact
# mode) run for a few steps three times, side by side in one invocation:
#   baseline  trainer.resident = false, rollout.max_staleness = 0: today's per-step loop
#             (each step loads the policy from the last checkpoint, takes one GRPO step,
#             writes a checkpoint, and the backend reloads it from disk);
#   resident  trainer.resident = true, max_staleness = 0: the trainer stays in memory, the
#             new weights are copied into the embedded graft serve in process, a checkpoint
#             is written every trainer.checkpoint_every (10) steps and after the last;
#   overlap   the resident loop with max_staleness = 1 (the next step's rollouts run while a
#             step trains).
# So that every step trains, the tasks' reward is graded (shorter final answers score
# higher) and groups are taken whole (rollout.selection = "group"). Writes a table of the
# time per step split into rollout, reconstruct, train, weight handoff and checkpoint (from
# each run's steps.jsonl), the reward command's time within the rollouts, and every run's
# wall time against the baseline's, to target/bench-rl.md.
#
# Usage: bash scripts/bench-rl.sh [--update-docs] [--steps N] [--debug]
#   --update-docs  also replaces the results in docs/BENCHMARKS.md (between the bench:rl
#   markers) with target/bench-rl.md.
#   --debug        use the debug build (no release build; libtorch is optimized either way,
#   graft's own code is not).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

update_docs=0
steps=3
profile=release
while [[ $# -gt 0 ]]; do
  case "$1" in
    --update-docs) update_docs=1 ;;
    --steps) steps="$2"; shift ;;
    --debug) profile=debug ;;
    *) echo "bench-rl: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

bash scripts/setup-libtorch.sh > /dev/null
bash scripts/setup-test-env.sh > /dev/null
if [[ $profile == release ]]; then
  cargo build --release --locked --bin graft --bin envd-agent < /dev/null
else
  cargo build --locked --features graft/testkit --bin graft --bin envd-agent < /dev/null   # the test build's features: no rebuild after it
fi
graft="${CARGO_TARGET_DIR:-$repo/target}/$profile/graft"
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

config() { # name staleness resident
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
resident = $3
EOF
}

declare -A wall
runs=(baseline resident overlap)
for run in "${runs[@]}"; do
  case $run in
    baseline) config "$run" 0 false ;;
    resident) config "$run" 0 true ;;
    overlap) config "$run" 1 true ;;
  esac
  echo "bench-rl: $run, $steps steps"
  t0=$(date +%s.%N)
  GRAFT_LOG=warn "$graft" rl --config "$work/$run.toml" < /dev/null > "$work/$run.log" 2>&1 \
    || { tail -20 "$work/$run.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  wall[$run]=$(python3 -c "print($t1 - $t0)")
  rm -rf "$work/$run/checkpoints" "$work/$run/weights"   # SmolLM2's weights + optimizer state: 2 GB each
done

python3 - "$work" "${wall[baseline]}" "${wall[resident]}" "${wall[overlap]}" > "$work/table.md" <<'EOF'
import json, sys, pathlib
work = pathlib.Path(sys.argv[1])
walls = dict(zip(["baseline", "resident", "overlap"], map(float, sys.argv[2:5])))
names = {
    "baseline": "baseline: per-step trainer, file push, max_staleness = 0",
    "resident": "resident trainer, in-memory handoff, max_staleness = 0",
    "overlap": "resident trainer, in-memory handoff, max_staleness = 1",
}
def load(run):
    return [json.loads(l) for l in (work / run / "steps.jsonl").read_text().splitlines() if l.strip()]
logs = {r: load(r) for r in walls}
def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0
phases = [("rollout", "rollout"), ("reconstruct", "reconstruct"), ("train", "train"),
          ("handoff", "push"), ("checkpoint", "checkpoint")]
print("Mean seconds per step by phase, from steps.jsonl. *rollout*: the wall time of a step's rollouts "
      "(sandboxes, harness, model calls, reward; 4 at a time). *train*: the baseline's load + GRPO step + "
      "checkpoint write; the resident's GRPO step. *handoff*: the baseline's push (pause, flush, reload "
      "from disk, continue); the resident's in-memory copy (between two decode steps, no pause). *checkpoint*: the "
      "resident's checkpoint writes (after the last step here), averaged over the steps.")
print()
print("| run | " + " | ".join(p for p, _ in phases) + " | reward per rollout | s per step (wall / steps) | train share of step | vs baseline |")
print("|---|" + "---|" * (len(phases) + 4))
base = walls["baseline"] / max(1, len(logs["baseline"]))
for r, log in logs.items():
    per_step = walls[r] / max(1, len(log))
    vals = [mean([s["secs"].get(k, 0.0) for s in log]) for _, k in phases]
    reward = mean([s["secs"]["reward_in_rollouts"] / max(1, s["rollouts"]) for s in log])
    share = vals[2] / per_step if per_step else 0.0
    print(f"| {names[r]} | " + " | ".join(f"{v:.3f}" for v in vals)
          + f" | {reward:.2f} | {per_step:.2f} | {share:.1%} | {per_step / base:.2f}x |")
print()
print("| run | steps | wall s | trained steps | calls by weight version | calls by staleness |")
print("|---|---|---|---|---|---|")
for r, log in logs.items():
    versions, stale = {}, {}
    for s in log:
        for v, n in s.get("call_weight_versions", {}).items():
            versions[v] = versions.get(v, 0) + n
        for v, n in s.get("call_staleness", {}).items():
            stale[v] = stale.get(v, 0) + n
    trained = sum(1 for s in log if "log" in s["train"])
    vs = ", ".join(f"{k}: {v}" for k, v in sorted(versions.items()))
    st = ", ".join(f"{k}: {v}" for k, v in sorted(stale.items()))
    print(f"| {r} | {len(log)} | {walls[r]:.1f} | {trained} | {vs} | {st} |")
EOF

out="target/bench-rl.md"
{
  echo "Run $(date -u +%Y-%m-%dT%H:%MZ) with \`bash scripts/bench-rl.sh --steps $steps$([[ $profile == debug ]] && echo ' --debug')\` on $(nproc) cores"
  echo "($(uname -m), $profile build; wall times include graft rl's start: the embedded backend loading SmolLM2, and the resident runs' trainer load)."
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
