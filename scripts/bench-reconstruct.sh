#!/usr/bin/env bash
# The reconstruct benchmark (reconstruct/benches/reconstruct.rs): merge_session and
# write_samples_parquet on one thread over a generated 10k-session dataset, each against a
# baseline measured side by side, plus Qwen3 re-tokenization when the test environment has
# the tokenizer. Writes the tables (with the machine and versions) to
# target/bench-reconstruct.md.
#
# Usage: bash scripts/bench-reconstruct.sh [--update-docs] [bench flags...]
#   bench flags go to the bench (--sessions N, --seed S, --chunk N, --reps N, --retok-secs S);
#   --update-docs  also replaces the Reconstruct results in docs/BENCHMARKS.md (between the
#   bench:reconstruct markers) with target/bench-reconstruct.md.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
out="target/bench-reconstruct.md"

update_docs=0
flags=()
for a in "$@"; do
  if [[ "$a" == "--update-docs" ]]; then update_docs=1; else flags+=("$a"); fi
done

mkdir -p target
raw="target/bench-reconstruct-table.md"
cmd=(cargo bench -p graft-reconstruct --bench reconstruct -- "${flags[@]}" --out "$raw")
echo "bench-reconstruct: ${cmd[*]}"
"${cmd[@]}" < /dev/null
shown="cargo bench -p graft-reconstruct --bench reconstruct${flags[*]:+ -- ${flags[*]}}"
{
  echo "Run $(date -u +%Y-%m-%dT%H:%MZ) with \`bash scripts/bench-reconstruct.sh${flags[*]:+ ${flags[*]}}\`"
  echo "(which ran \`$shown\`, plus \`--out\` to save the tables)."
  echo
  cat "$raw"
} > "$out"

if [[ $update_docs == 1 ]]; then
  doc="docs/BENCHMARKS.md"
  begin='<!-- bench:reconstruct:begin -->'
  end='<!-- bench:reconstruct:end -->'
  if grep -qF "$begin" "$doc" && grep -qF "$end" "$doc"; then
    awk -v b="$begin" -v e="$end" -v f="$out" '
      $0 == b { print; while ((getline line < f) > 0) print line; skip = 1; next }
      $0 == e { skip = 0 }
      !skip { print }' "$doc" > "$doc.tmp" && mv "$doc.tmp" "$doc"
    echo "bench-reconstruct: Reconstruct results in $doc replaced"
  else
    echo "bench-reconstruct: $doc has no bench:reconstruct markers; not updated" >&2
  fi
fi
echo "bench-reconstruct: results in $out"
