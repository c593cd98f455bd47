#!/usr/bin/env bash
# graft on its embedded default, no server to run first. Builds graft (release), then:
#  1. the recording gateway: the scripted upstream and the gateway in front of it (local data
#     dir), a short client conversation through a session, and where the records went;
#  2. graft's main job, `graft rl` on one CPU (examples/rl/rl.toml): SmolLM2-135M-Instruct
#     served in process by `graft serve`, the example agent (openai SDK, one bash tool) in
#     local envd sandboxes, rewards from the tasks' verifiers, GRPO steps and weight pushes.
#     The run goes to rl-runs/demo-<time>/ (steps.jsonl: what each step did).
# Needs Rust (rustup), Python 3.11, root and bubblewrap for the sandboxes (installed when
# missing). The first run compiles graft (about 10 minutes on 2 cores) and fetches libtorch
# (PyPI's torch wheel, about 540 MB) and SmolLM2 (93 MB).
# Usage: bash scripts/demo.sh [--data-dir DIR]     GRAFT_DEMO_RL_STEPS (default 2): steps of part 2
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
LIBTORCH="$(bash scripts/setup-libtorch.sh)"
export LIBTORCH
# `graft demo` and the scripted upstream come with the `testkit` feature (not in the default build).
cargo build --release --locked --features graft/testkit --bin graft --bin envd-agent
graft="${CARGO_TARGET_DIR:-$repo/target}/release/graft"
"$graft" demo "$@"

echo
echo "== graft rl: GRPO in a real harness on one CPU (examples/rl/rl.toml) =="
bash scripts/setup-test-env.sh sandbox
if [[ ! -f models/smollm2/config.json ]]; then
  gguf="$(bash scripts/setup-models.sh)"
  "$graft" model import --gguf "$gguf" --out models/smollm2
fi
out="rl-runs/demo-$(date -u +%Y%m%dT%H%M%SZ)"
GRAFT_LOG="${GRAFT_LOG:-warn}" "$graft" rl --config examples/rl/rl.toml \
  --steps "${GRAFT_DEMO_RL_STEPS:-2}" --out-dir "$out"
echo "graft rl: the run is in $out (steps.jsonl, samples/, checkpoints/, data/: every call recorded)"
