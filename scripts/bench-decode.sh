#!/usr/bin/env bash
# The decode benchmark, on CPU: `graft serve` against Hugging Face transformers' `generate`
# on the same weights (SmolLM2-135M-Instruct as `graft model import` writes it from the
# GGUF scripts/setup-models.sh fetches: config.json + safetensors + tokenizer; both sides
# load that directory, float32), side by side in one run, greedy, both on the same number
# of threads (--threads, default 2: OMP_NUM_THREADS / MKL_NUM_THREADS for graft serve's
# libtorch, torch.set_num_threads for transformers).
#   graft serve   `graft serve --model DIR --listen 127.0.0.1:0 --max-batch 8` (GRAFT_DEVICE=cpu);
#                 batch B is B concurrent SGLang `/generate` requests (`input_ids`,
#                 temperature 0, ignore_eos, max_new_tokens N), timed from the first sent to
#                 the last answered;
#   transformers  AutoModelForCausalLM (dtype float32, attention "sdpa" unless --attn eager),
#                 `generate` on a left-padded batch of B copies of the prompt, do_sample
#                 False, min_new_tokens = max_new_tokens = N, no end-of-sequence token (so
#                 both sides take the argmax even when it is <|im_end|>: the same tokens).
# The prompt is one chat-templated question, the same ids on both sides. Each side runs with
# N = 1 (3 times, the median) and N tokens; decode tokens/s = B * (N - 1) / (t_N - t_1), so
# prefill, HTTP and start-up cancel out. R rounds, alternating which side goes first; the
# table shows medians.
# Writes target/bench-decode.md (machine, date, versions, the command, the table).
#
# --context C measures decode with C cached prompt tokens instead: the prompt is one
# chat-templated user message, filler text (a fixed paragraph repeated, cut at a word) then
# the question, C tokens in all (or a few fewer: the exact count is printed). Prefill of such
# a prompt takes seconds to tens of seconds and varies, so t_N - t_1 is not used: the tokens
# are timed as they come, and each side runs once a round (N tokens):
#   graft serve   `/generate` with "stream": true (an SSE event per token); decode tokens/s =
#                 B * (N - 1) / (the latest N-th token over the B requests - the latest
#                 first token), from the arrival times of each request's events;
#   transformers  `generate` with a streamer that records when each token is put; decode
#                 tokens/s = B * (N - 1) / (last put - the first new token's put).
# Writes target/bench-decode-context.md (graft serve's log: target/bench-decode-context-serve.log).
#
# transformers runs from a venv of its own, .graft-test-env/hf-bench (GRAFT_TEST_ENV
# overrides the parent), made here when missing or when its pins changed (a stamp records
# them): PyPI's torch 2.11.0 (the libtorch graft links; it pulls its CUDA packages, about
# 4.5 GB, unused here) and transformers 5.24.0 (the version scripts/hf-model-fixtures.py
# made the reference logits with). Needs python3.11 (or $PYTHON) and PyPI.
#
# Usage: bash scripts/bench-decode.sh [--batches 1,8] [--tokens 64] [--rounds 3]
#          [--threads 2] [--attn sdpa|eager] [--context C] [--graft PATH] [--update-docs]
#   --context C    decode with a C-token prompt, timed from streamed tokens (above; default
#                  off: the 41-token question and t_N - t_1);
#   --graft PATH   the graft binary (default target/release/graft, built when missing);
#   --update-docs  also replaces the results in docs/BENCHMARKS.md (between the
#                  bench:decode markers) with target/bench-decode.md; with --context,
#                  those between the bench:decode-context markers, with
#                  target/bench-decode-context.md (not updated when the markers are missing).
set -euo pipefail

HF_PKGS=(
  "torch==2.11.0"
  "transformers==5.24.0"
  "safetensors==0.8.0"
)
PIP_VERSION="26.3"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
env_dir="${GRAFT_TEST_ENV:-$repo/.graft-test-env}"
python="${PYTHON:-python3.11}"
out="target/bench-decode.md"

batches="1,8"
tokens=64
rounds=3
threads=2
attn=sdpa
context=0
graft=""
update_docs=0
shown=(bash scripts/bench-decode.sh)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --batches|--tokens|--rounds|--threads|--attn|--context|--graft)
      if [[ $# -lt 2 ]]; then echo "bench-decode: $1 needs a value" >&2; exit 2; fi
      case "$1" in
        --batches) batches="$2" ;;
        --tokens) tokens="$2" ;;
        --rounds) rounds="$2" ;;
        --threads) threads="$2" ;;
        --attn) attn="$2" ;;
        --context) context="$2" ;;
        --graft) graft="$2" ;;
      esac
      shown+=("$1" "$2")
      shift ;;
    --update-docs) update_docs=1; shown+=("$1") ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-decode: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ "$attn" != sdpa && "$attn" != eager ]]; then
  echo "bench-decode: --attn takes sdpa or eager, not '$attn'" >&2
  exit 2
fi
if ! [[ "$context" =~ ^[0-9]+$ ]]; then
  echo "bench-decode: --context takes a number of prompt tokens, not '$context'" >&2
  exit 2
fi
context=$((10#$context))

# The transformers venv.
hf="$env_dir/hf-bench"
want="$("$python" --version 2>&1) ${HF_PKGS[*]}"
if [[ -f "$hf/.graft-stamp" && "$(cat "$hf/.graft-stamp")" == "$want" && -x "$hf/bin/python" ]]; then
  echo "bench-decode: $hf up to date" >&2
else
  if ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    echo "bench-decode: '$python' cannot make venvs; install Python 3.11 (on Debian: apt-get install python3.11-venv) or set PYTHON=/path/to/python3.11" >&2
    exit 1
  fi
  echo "bench-decode: installing ${HF_PKGS[*]} into $hf (about 4.5 GB with torch's CUDA packages)" >&2
  started=$SECONDS
  rm -rf "$hf"
  mkdir -p "$env_dir"
  "$python" -m venv "$hf" >&2
  "$hf/bin/python" -m pip install --quiet --disable-pip-version-check "pip==$PIP_VERSION" >&2
  "$hf/bin/python" -m pip install --quiet --disable-pip-version-check "${HF_PKGS[@]}" >&2
  printf '%s' "$want" > "$hf/.graft-stamp"
  echo "bench-decode: $hf ready in $((SECONDS - started)) s" >&2
fi

# graft, its libtorch, and the model directory both sides load.
bash scripts/setup-libtorch.sh > /dev/null
if [[ -z "$graft" ]]; then
  graft="${CARGO_TARGET_DIR:-$repo/target}/release/graft"
  if [[ ! -x "$graft" ]]; then
    cargo build --release -p graft --bin graft < /dev/null
  fi
fi
if [[ ! -x "$graft" ]]; then
  echo "bench-decode: no graft binary at $graft; build it (cargo build --release -p graft --bin graft) or pass --graft PATH" >&2
  exit 1
fi
model="models/smollm2"
if [[ ! -f "$model/config.json" ]]; then
  gguf="$(bash scripts/setup-models.sh)"
  "$graft" model import --gguf "$gguf" --out "$model"
fi

mkdir -p target
rev="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [[ -n "$(git status --porcelain --untracked-files=no -- '*.rs' '*Cargo.toml' Cargo.lock 2>/dev/null)" ]]; then rev="$rev (+ uncommitted Rust changes)"; fi
table="target/bench-decode-table.md"
extra=()
if (( context > 0 )); then
  # Files of their own, so a --context run leaves the default run's results alone.
  out="target/bench-decode-context.md"
  table="target/bench-decode-context-table.md"
  extra=(--context "$context" --serve-log target/bench-decode-context-serve.log)
  echo "bench-decode: batches $batches, $tokens tokens, $rounds rounds, $threads threads, $attn attention, a $context-token prompt, streamed" >&2
else
  echo "bench-decode: batches $batches, $tokens tokens, $rounds rounds, $threads threads, $attn attention" >&2
fi
OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads" GRAFT_DEVICE=cpu \
  "$hf/bin/python" scripts/bench_decode.py \
  --graft "$graft" --model "$model" --batches "$batches" --tokens "$tokens" \
  --rounds "$rounds" --threads "$threads" --attn "$attn" ${extra[@]+"${extra[@]}"} --out "$table"
{
  echo "Run $(date -u +%Y-%m-%dT%H:%MZ) with \`${shown[*]}\` on $(nproc) cores"
  echo "($(uname -m), $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ //')),"
  echo "graft $("$graft" --version | cut -d' ' -f2) from the checkout at $rev, libtorch from scripts/setup-libtorch.sh."
  echo
  cat "$table"
} > "$out"
cat "$out"

if [[ $update_docs == 1 ]]; then
  doc="docs/BENCHMARKS.md"
  what=decode
  if (( context > 0 )); then what=decode-context; fi
  begin="<!-- bench:$what:begin -->"
  end="<!-- bench:$what:end -->"
  if grep -qF "$begin" "$doc" && grep -qF "$end" "$doc"; then
    awk -v b="$begin" -v e="$end" -v f="$out" '
      $0 == b { print; while ((getline line < f) > 0) print line; skip = 1; next }
      $0 == e { skip = 0 }
      !skip { print }' "$doc" > "$doc.tmp" && mv "$doc.tmp" "$doc"
    echo "bench-decode: $what results in $doc replaced"
  else
    echo "bench-decode: $doc has no bench:$what markers ($begin / $end); not updated" >&2
  fi
fi
echo "bench-decode: results in $out"
