#!/usr/bin/env bash
# The soak benchmark (benches/load.rs --soak): one `graft gateway` (sync durability by
# default) in front of `graft scripted-upstream`, driven closed loop by 16 connections for
# --soak-secs, its RSS (VmRSS, VmHWM), the calls done and its data dir's size sampled every
# second, then sampled idle. Builds graft in release without default features (no libtorch)
# through `cargo bench --no-default-features`, runs `cargo bench --bench load -- --soak ...`, and writes the table with the machine, the
# date, the revision and the exact command to target/bench-soak.md.
#
# Usage: bash scripts/bench-soak.sh [--update-docs] [--as-baseline] [--arena-max N] [load flags...]
#   load flags go to the load generator, e.g. --soak-secs 60 --soak-connections 16
#   (`cargo bench --bench load -- --help` lists them).
#   --arena-max N  also runs the same soak with MALLOC_ARENA_MAX=N in the gateway's
#                  environment (glibc malloc arenas) and reports both runs.
#   --update-docs  replaces the "Soak" results of docs/BENCHMARKS.md with target/bench-soak.md
#                  (the block between the soak:results markers; with --as-baseline the block
#                  between the soak:baseline markers, for a run on the commit before a change).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
out="target/bench-soak.md"

update_docs=0
block="results"
arena_max=""
flags=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --update-docs) update_docs=1 ;;
    --as-baseline) block="baseline" ;;
    --arena-max) arena_max="$2"; shift ;;
    *) flags+=("$1") ;;
  esac
  shift
done

features=(--no-default-features)
# The scripted upstream may sit behind the graft package's `testkit` feature.
if grep -q '^testkit' Cargo.toml; then features+=(--features testkit); fi

start=$(date +%s)
# The revision being measured, taken before the build.
rev="$(git rev-parse --short HEAD 2>/dev/null || echo '(no commit)')$(git diff --quiet HEAD 2>/dev/null || echo ' + local changes')"
# graft in release without default features, built by `cargo bench` itself (the bench's
# CARGO_BIN_EXE_graft, target/release/graft): a separate `cargo build --release --bin graft`
# resolves the dependencies' features without the dev-dependencies and so builds a second
# copy of half the workspace.
cargo bench "${features[@]}" --bench load --no-run

mkdir -p target
runs=("")
if [[ -n "$arena_max" ]]; then runs+=("MALLOC_ARENA_MAX=$arena_max"); fi
body="target/bench-soak-body.md"
: > "$body"
cmds=()
for env in "${runs[@]}"; do
  raw="target/bench-soak-table${env:+-arena}.md"
  csv="target/bench-soak${env:+-arena}.csv"
  cmd=(cargo bench "${features[@]}" --bench load -- --soak --graft-bin target/release/graft
       "${flags[@]}" ${env:+--soak-gateway-env "$env"} --out "$raw" --soak-csv "$csv")
  echo "bench-soak: ${cmd[*]}"
  "${cmd[@]}" < /dev/null
  cmds+=("\`${cmd[*]}\`")
  {
    if [[ -n "$env" ]]; then echo "#### The same with \`$env\` in the gateway's environment"; echo; fi
    cat "$raw"
    echo
  } >> "$body"
done

cpu="$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
ran="${cmds[0]}"
for c in "${cmds[@]:1}"; do ran+=" and $c"; done
{
  echo "Run $(date -u +%Y-%m-%dT%H:%MZ) on graft $rev with \`bash scripts/bench-soak.sh$( ((update_docs)) && printf ' --update-docs')$([[ $block == baseline ]] && printf ' --as-baseline')${arena_max:+ --arena-max $arena_max}${flags[*]:+ ${flags[*]}}\`"
  echo "(which ran $ran)."
  echo
  echo "- machine: $(nproc) CPUs ($cpu), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr), $(ldd --version 2>&1 | head -1 | sed 's/^ldd //')"
  echo "- load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) (the machine is shared; calls/s moves with it, RSS much less)"
  echo "- $(rustc --version)"
  echo
  cat "$body"
} > "$out"

if [[ $update_docs == 1 ]]; then
  doc="docs/BENCHMARKS.md"
  begin="<!-- soak:$block:begin -->"
  end="<!-- soak:$block:end -->"
  if grep -qF "$begin" "$doc" && grep -qF "$end" "$doc"; then
    awk -v b="$begin" -v e="$end" -v f="$out" '
      $0 == b { print; while ((getline line < f) > 0) print line; skip = 1; next }
      $0 == e { skip = 0 }
      !skip { print }' "$doc" > "$doc.tmp" && mv "$doc.tmp" "$doc"
    echo "bench-soak: soak $block block of $doc replaced"
  else
    echo "bench-soak: $doc has no soak:$block markers; not updated" >&2
  fi
fi
echo "bench-soak: done in $(( $(date +%s) - start ))s; results in $out"
