#!/usr/bin/env bash
# The load benchmark (benches/load.rs): the scripted upstream directly, graft (sync and async
# durability) and LiteLLM's proxy in front of the same upstream, side by side in one run, plus
# graft async driven with Responses and Anthropic Messages streams that it translates to the
# Chat-only upstream (the "Translated streaming" table).
# Builds release, installs the LiteLLM proxy into its own venv (.graft-test-env/litellm-proxy,
# idempotent), runs `cargo bench --bench load`, and writes the results with the machine, the
# date, the versions and the exact command to target/bench.md.
#
# Usage: bash scripts/bench.sh [--update-docs] [load flags...]
#   load flags go to the load generator (see `cargo bench --bench load -- --help`),
#   e.g. --phase-secs 3 --max-secs 3 for a quick run; --translated-rates 0 skips the
#   translated-streaming phase.
#   --update-docs  also replaces the results section of docs/BENCHMARKS.md with target/bench.md.
# GRAFT_BENCH_NO_LITELLM=1 skips LiteLLM (no venv install, no --litellm).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
env_dir="${GRAFT_TEST_ENV:-$repo/.graft-test-env}"
python="${PYTHON:-python3.11}"
venv_dir="$env_dir/litellm-proxy"
out="target/bench.md"

update_docs=0
flags=()
for a in "$@"; do
  if [[ "$a" == "--update-docs" ]]; then update_docs=1; else flags+=("$a"); fi
done

# litellm==1.110.2 is the version the client tests pin. Its `proxy` extra names a
# `litellm-proxy==1.110.2` distribution that is not published, so `litellm[proxy]==1.110.2`
# does not resolve; the proxy itself ships inside the litellm wheel (litellm/proxy), and these
# are the other requirements of that extra (from the wheel's METADATA, Python 3.11 markers),
# except litellm-enterprise: the extra pins 0.1.83.post1, which is not published either; 0.1.83 is.
LITELLM_PKGS=(
  "litellm==1.110.2"
  "gunicorn>=23.0.0,<24.0" "uvicorn>=0.33.0,<1.0" "granian>=2.7.4,<3.0" "uvloop>=0.22.1,<1.0"
  "fastapi>=0.136.3,<1.0" "starlette>=1.0.1,<2.0" "backoff>=2.2.1,<3.0" "pyyaml>=6.0.3,<7.0"
  "rq>=2.7.0,<3.0" "orjson>=3.11.6,<4.0" "hiredis>=3.0.0,<4.0" "apscheduler>=3.11.2,<4.0"
  "fastapi-sso>=0.19.0,<1.0" "pyjwt>=2.13.0,<3.0" "python-multipart>=0.0.27,<1.0"
  "cryptography>=49.0.0,<51.0" "pynacl>=1.6.2,<2.0" "websockets>=15.0.1,<16.0"
  "boto3>=1.43.117,<2.0" "azure-identity>=1.25.2,<2.0" "azure-storage-blob>=12.28.0,<13.0"
  "mcp>=2.3.0,<3" "httpx2>=2.10.0,<3" "pydantic>=2.12.0,<3" "litellm-enterprise==0.1.83"
  "restrictedpython>=8.5,<9.0" "rich>=13.9.4,<14.0" "inquirerpy>=0.3.4,<1.0"
  "tomlkit>=0.13.3,<1.0" "polars>=1.38.1,<2.0" "soundfile>=0.12.1,<1.0"
  "pyroscope-io>=0.8.16,<1.0" "expression>=5.6.0,<6.0" "backports-zstd>=1.0.0,<2.0"
  "semver>=3.0.4,<4"
)

ensure_litellm() {
  local want
  want="$("$python" --version 2>&1) ${LITELLM_PKGS[*]}"
  if [[ -f "$venv_dir/.graft-stamp" && "$(cat "$venv_dir/.graft-stamp")" == "$want" && -x "$venv_dir/bin/litellm" ]]; then
    echo "bench: LiteLLM proxy venv up to date ($venv_dir)"
    return 0
  fi
  echo "bench: installing the LiteLLM proxy into $venv_dir"
  rm -rf "$venv_dir"
  mkdir -p "$env_dir"
  "$python" -m venv "$venv_dir"
  "$venv_dir/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$venv_dir/bin/python" -m pip install --quiet --disable-pip-version-check "${LITELLM_PKGS[@]}"
  printf '%s' "$want" > "$venv_dir/.graft-stamp"
}

start=$(date +%s)
# The revision being measured, taken before the build (a long run can outlive a commit).
rev="$(git rev-parse --short HEAD 2>/dev/null || echo '(no commit)')$(git diff --quiet 2>/dev/null || echo ' + local changes')"
# The load generator drives `graft scripted-upstream`, which needs the `testkit` feature.
cargo build --release --features testkit --bin graft

litellm_flag=()
litellm_version="not run"
if [[ "${GRAFT_BENCH_NO_LITELLM:-0}" != "1" ]]; then
  ensure_litellm
  litellm_flag=(--litellm --litellm-bin "${venv_dir#"$repo"/}/bin/litellm")
  litellm_version="litellm $("$venv_dir/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))') (proxy, $("$venv_dir/bin/python" --version 2>&1))"
fi

mkdir -p target
raw="target/bench-table.md"
cmd=(cargo bench --features testkit --bench load -- "${flags[@]}" "${litellm_flag[@]}" --out "$raw")
echo "bench: ${cmd[*]}"
"${cmd[@]}" < /dev/null

cpu="$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
{
  echo "Run $(date -u +%Y-%m-%dT%H:%MZ) with \`bash scripts/bench.sh${flags[*]:+ ${flags[*]}}\`"
  echo "(which ran \`${cmd[*]}\`)."
  echo
  echo "- machine: $(nproc) CPUs ($cpu), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr)"
  echo "- graft $rev, $(rustc --version)"
  echo "- LiteLLM: $litellm_version"
  echo
  cat "$raw"
} > "$out"

if [[ $update_docs == 1 ]]; then
  doc="docs/BENCHMARKS.md"
  begin='<!-- bench:results:begin -->'
  end='<!-- bench:results:end -->'
  if grep -qF "$begin" "$doc" && grep -qF "$end" "$doc"; then
    awk -v b="$begin" -v e="$end" -v f="$out" '
      $0 == b { print; while ((getline line < f) > 0) print line; skip = 1; next }
      $0 == e { skip = 0 }
      !skip { print }' "$doc" > "$doc.tmp" && mv "$doc.tmp" "$doc"
    echo "bench: results section of $doc replaced"
  else
    echo "bench: $doc has no results markers; not updated" >&2
  fi
fi
echo "bench: done in $(( $(date +%s) - start ))s; results in $out"
