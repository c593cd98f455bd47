#!/usr/bin/env bash
# graft's GPU check: the trainer and `graft serve` measured against transformers on one GPU,
# every figure one JSON line in OUTDIR/figures.jsonl. Three commands:
#
#   bash scripts/gpu-check.sh pack
#       Here, on the build machine: `cargo build --profile ship` of the graft binary and of
#       the trainer bench (crate graft-trainer, bench `trainer`), each xz-compressed into
#       .gpu/ (git-ignored) with .gpu/manifest.json (commit, sizes, sha256); fails if .gpu/
#       is not under 64 MiB, what the device tool carries.
#   bash scripts/gpu-check.sh run OUTDIR
#       On the GPU machine (Python with torch + transformers, no Rust, no network):
#       decompresses .gpu/ with Python's lzma into a scratch folder, points LD_LIBRARY_PATH
#       at that Python's torch/lib (graft's libtorch and its CUDA backend), and runs
#       scripts/gpu/check.py: the bf16 matmul peak; the trainer bench on Qwen3-0.6B, 1.7B and
#       4B shapes, each against transformers' own training step on the same shape; graft
#       serve against transformers generate at batch 1, 32, 128, 256 (logprob agreement,
#       decode tok/s, nvidia-smi dmon, the engine's own report, the weight push through
#       /update_weights_from_disk from /dev/shm); peak GPU memory per part. Each part under
#       its own `timeout`, the whole within 510 s (GRAFT_GPU_CHECK_BUDGET_S).
#       GRAFT_GPU_CHECK_TINY=1: the tiny plan instead (a smoke run, about a minute);
#       GRAFT_GPU_CHECK_PLAN=serve: serve, the engine and 4B only (a second, shorter run).
#   bash scripts/gpu-check.sh cpu OUTDIR
#       The same pipeline, tiny plan, on this machine's CPU, with the binaries built here
#       (graft: $GRAFT_GPU_CHECK_GRAFT, else target/ship/graft; the bench:
#       $GRAFT_GPU_CHECK_BENCH, else the newest target/ship/deps/trainer-*) and the test
#       env's transformers venv (.graft-test-env/hf-bench, which scripts/bench-decode.sh
#       makes). Without that venv the transformers side is skipped with a `skipped` line;
#       without a bench binary, the bench is. About a minute on 2 cores.
#
# Environment: GRAFT_GPU_CHECK_PYTHON (the Python: run's default python3, cpu's default the
# hf-bench venv, else python3), GRAFT_GPU_BIN (run: the packed folder, default .gpu),
# GRAFT_GPU_CHECK_BUDGET_S (seconds for the whole run), GRAFT_GPU_CHECK_THREADS (cpu:
# threads per side, default 2). Exit status: 0 when every part that ran succeeded.
# What each figure line means: scripts/gpu/check.py's docstring and docs/BENCHMARKS.md.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
check="$repo/scripts/gpu/check.py"
limit_mib=64

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

# torch_probe PY: prints that Python's torch directory when it imports torch and
# transformers; fails otherwise.
torch_probe() {
  "$1" -c 'import os, torch, transformers; print(os.path.dirname(torch.__file__))' 2>/dev/null
}

pack() {
  local dir="$repo/.gpu" target="${CARGO_TARGET_DIR:-$repo/target}"
  cargo build --profile ship -p graft --bin graft < /dev/null
  local msgs bench
  msgs="$(mktemp)"
  cargo build --profile ship -p graft-trainer --bench trainer --bench engine --message-format=json-render-diagnostics < /dev/null > "$msgs"
  executable() {
    python3 -c '
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[2] and "bench" in m["target"]["kind"] and m.get("executable"):
        print(m["executable"])' "$msgs" "$1"
  }
  local engine
  bench="$(executable trainer)"
  engine="$(executable engine)"
  rm -f "$msgs"
  if [[ -z "$bench" || ! -x "$bench" ]]; then
    echo "gpu-check: cargo named no trainer bench executable" >&2
    exit 1
  fi
  rm -rf "$dir"
  mkdir -p "$dir"
  xz -T0 -6 -c "$target/ship/graft" > "$dir/graft.xz"
  xz -T0 -6 -c "$bench" > "$dir/trainer-bench.xz"
  xz -T0 -6 -c "$engine" > "$dir/engine-bench.xz"
  local rev dirty=false
  rev="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
  if [[ -n "$(git status --porcelain --untracked-files=no -- '*.rs' '*Cargo.toml' Cargo.lock 2>/dev/null)" ]]; then dirty=true; fi
  python3 - "$dir" "$rev" "$dirty" "$("$target/ship/graft" --version)" "$target/ship/graft" "$bench" "$engine" <<'EOF'
import hashlib, json, os, sys, time
d, rev, dirty, version, graft, bench, engine = sys.argv[1:]
def entry(src, xz):
    return {"bytes": os.path.getsize(src), "xz_bytes": os.path.getsize(os.path.join(d, xz)),
            "sha256": hashlib.sha256(open(src, "rb").read()).hexdigest()}
json.dump({"commit": rev, "uncommitted_rust_changes": dirty == "true", "version": version, "profile": "ship",
           "packed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "files": {"graft": entry(graft, "graft.xz"), "trainer-bench": entry(bench, "trainer-bench.xz"),
                     "engine-bench": entry(engine, "engine-bench.xz")}},
          open(os.path.join(d, "manifest.json"), "w"), indent=2)
EOF
  local bytes
  bytes="$(du -sb "$dir" | cut -f1)"
  ls -l "$dir" >&2
  if (( bytes >= limit_mib * 1024 * 1024 )); then
    echo "gpu-check: .gpu/ is $((bytes / 1024 / 1024)) MiB, not under ${limit_mib} MiB; the device tool carries 64 MiB in all" >&2
    exit 1
  fi
  echo "gpu-check: .gpu/ packed: $((bytes / 1024)) KiB (commit ${rev:0:10}$([[ $dirty == true ]] && echo ', with uncommitted Rust changes'))" >&2
}

# run_check PLAN OUTDIR GRAFT BENCH PY HF_PY HF_MISSING MANIFEST WORK
run_check() {
  local plan="$1" out="$2" graft="$3" bench="$4" py="$5" hf_py="$6" hf_missing="$7" manifest="$8" work="$9"
  local budget=()
  if [[ -n "${GRAFT_GPU_CHECK_BUDGET_S:-}" ]]; then budget=(--budget "$GRAFT_GPU_CHECK_BUDGET_S"); fi
  "$py" "$check" --plan "$plan" --graft "$graft" --bench "$bench" --hf-python "$hf_py" \
    --hf-missing "$hf_missing" --manifest "$manifest" --work "$work" ${budget[@]+"${budget[@]}"} --out "$out"
}

run() {
  local out="$1" bin="${GRAFT_GPU_BIN:-$repo/.gpu}" py="${GRAFT_GPU_CHECK_PYTHON:-python3}"
  if [[ ! -f "$bin/graft.xz" ]]; then
    echo "gpu-check: no $bin/graft.xz; run 'bash scripts/gpu-check.sh pack' on the build machine and carry .gpu" >&2
    exit 1
  fi
  mkdir -p "$out"
  out="$(cd "$out" && pwd)"
  local work
  work="$(mktemp -d "${TMPDIR:-/tmp}/graft-gpu-check.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" EXIT
  mkdir -p "$work/bin"
  for b in graft trainer-bench engine-bench; do
    if [[ -f "$bin/$b.xz" ]]; then
      "$py" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$bin/$b.xz" "$work/bin/$b"
      chmod +x "$work/bin/$b"
    fi
  done
  local torch_dir hf_py="" hf_missing=""
  if torch_dir="$(torch_probe "$py")"; then
    hf_py="$py"
    export LD_LIBRARY_PATH="$torch_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  else
    hf_missing="$py does not import torch and transformers"
    echo "gpu-check: $hf_missing: graft finds no libtorch and the transformers side is skipped" >&2
  fi
  local bench=""
  [[ -x "$work/bin/trainer-bench" ]] && bench="$work/bin/trainer-bench"
  [[ -x "$work/bin/engine-bench" ]] && export GRAFT_GPU_CHECK_ENGINE_BENCH="$work/bin/engine-bench"
  local plan=full
  [[ "${GRAFT_GPU_CHECK_TINY:-0}" == 1 ]] && plan=tiny
  [[ -n "${GRAFT_GPU_CHECK_PLAN:-}" ]] && plan="$GRAFT_GPU_CHECK_PLAN"
  local rc=0
  run_check "$plan" "$out" "$work/bin/graft" "$bench" "$py" "$hf_py" "$hf_missing" "$bin/manifest.json" "$work" || rc=$?
  echo "gpu-check: figures in $out/figures.jsonl (exit $rc)" >&2
  return "$rc"
}

cpu() {
  local out="$1" target="${CARGO_TARGET_DIR:-$repo/target}" env_dir="${GRAFT_TEST_ENV:-$repo/.graft-test-env}"
  local graft="${GRAFT_GPU_CHECK_GRAFT:-$target/ship/graft}"
  if [[ ! -x "$graft" ]]; then
    echo "gpu-check: no graft binary at $graft; build it (cargo build --profile ship -p graft --bin graft) or set GRAFT_GPU_CHECK_GRAFT" >&2
    exit 1
  fi
  local bench="${GRAFT_GPU_CHECK_BENCH:-}"
  if [[ -z "$bench" ]]; then
    bench="$(ls -t "$target"/ship/deps/trainer-* 2>/dev/null | while read -r f; do [[ -x "$f" && ! "$f" == *.d ]] && { echo "$f"; break; }; done || true)"
  fi
  if [[ -z "${GRAFT_GPU_CHECK_ENGINE_BENCH:-}" ]]; then
    GRAFT_GPU_CHECK_ENGINE_BENCH="$(ls -t "$target"/ship/deps/engine-* 2>/dev/null | while read -r f; do [[ -x "$f" && ! "$f" == *.d ]] && { echo "$f"; break; }; done || true)"
    export GRAFT_GPU_CHECK_ENGINE_BENCH
  fi
  local py="${GRAFT_GPU_CHECK_PYTHON:-}" hf_py="" hf_missing=""
  if [[ -z "$py" ]]; then
    py="$env_dir/hf-bench/bin/python"
    [[ -x "$py" ]] || py=python3
  fi
  if torch_probe "$py" > /dev/null; then
    hf_py="$py"
  else
    hf_missing="$py does not import torch and transformers (the venv .graft-test-env/hf-bench has both: scripts/bench-decode.sh makes it)"
    echo "gpu-check: $hf_missing; the transformers side is skipped" >&2
  fi
  mkdir -p "$out"
  out="$(cd "$out" && pwd)"
  local work
  work="$(mktemp -d "${TMPDIR:-/tmp}/graft-gpu-check.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" EXIT
  local threads="${GRAFT_GPU_CHECK_THREADS:-2}" rc=0
  GRAFT_DEVICE=cpu CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads" \
    run_check tiny "$out" "$graft" "$bench" "$py" "$hf_py" "$hf_missing" "" "$work" || rc=$?
  echo "gpu-check: figures in $out/figures.jsonl (exit $rc)" >&2
  return "$rc"
}

case "${1:-}" in
  pack) pack ;;
  run|cpu)
    if [[ $# -ne 2 ]]; then echo "gpu-check: $1 takes one OUTDIR (see --help)" >&2; exit 2; fi
    "$1" "$2" ;;
  -h|--help) usage ;;
  *) echo "gpu-check: pack, run OUTDIR or cpu OUTDIR (see --help)" >&2; exit 2 ;;
esac
