#!/usr/bin/env bash
# Installs libtorch for the trainer (crate graft-trainer, tch 0.24) from PyPI and prints
# the LIBTORCH path on stdout (everything else goes to stderr), so callers can do
#   export LIBTORCH="$(bash scripts/setup-libtorch.sh)"
#
# tch 0.24 expects libtorch 2.11.0. PyPI's torch==2.11.0 wheel (the CUDA 13.0 build, the
# same one the GPU machines carry) holds the libtorch shared libraries; installed without
# its dependencies plus the CUDA runtime and CUPTI wheels of the 13.0 line it links and
# runs on CPU, and on a GPU machine libtorch_cuda finds the rest of CUDA there.
# The pins live here and only here. Idempotent: a stamp records them; a matching stamp
# skips the install (well under a second). About 540 MB to download, 1.3 GB installed.
# Needs python3.11 (or $PYTHON) and PyPI. GRAFT_TEST_ENV overrides the target directory
# (default .graft-test-env). $env_dir/libtorch is a stable link to the libtorch directory;
# .cargo/config.toml points LIBTORCH there, so plain cargo commands work after one run.
set -euo pipefail

TORCH_PKGS=(
  "torch==2.11.0"
  "nvidia-cuda-runtime==13.0.96"
  "nvidia-cuda-cupti==13.0.85"
)
PIP_VERSION="26.3"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
env_dir="${GRAFT_TEST_ENV:-$repo/.graft-test-env}"
python="${PYTHON:-python3.11}"
dir="$env_dir/torch"

libtorch_path() {
  "$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"] + "/torch")'
}

# ready PATH: links $env_dir/libtorch to PATH (relative, so the tree can move) and prints
# the link, the same path .cargo/config.toml gives cargo: torch-sys rebuilds whenever
# LIBTORCH changes, so scripts and plain cargo commands must agree on it.
ready() {
  local rel="${1#"$env_dir"/}"
  ln -sfn "$rel" "$env_dir/libtorch"
  echo "$env_dir/libtorch"
}

want="$("$python" --version 2>&1) ${TORCH_PKGS[*]}"
if [[ -f "$dir/.graft-stamp" && "$(cat "$dir/.graft-stamp")" == "$want" && -x "$dir/bin/python" ]]; then
  lt="$(libtorch_path)"
  if [[ -f "$lt/lib/libtorch_cpu.so" ]]; then
    echo "setup-libtorch: up to date" >&2
    ready "$lt"
    exit 0
  fi
fi
if ! command -v "$python" >/dev/null 2>&1; then
  echo "setup-libtorch: '$python' not found; install Python 3.11 or set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  echo "setup-libtorch: $python cannot make venvs (no ensurepip); on Debian: apt-get install python3.11-venv" >&2
  exit 1
fi
echo "setup-libtorch: installing ${TORCH_PKGS[*]} into $dir (about 540 MB)" >&2
rm -rf "$dir"
mkdir -p "$env_dir"
"$python" -m venv "$dir" >&2
"$dir/bin/python" -m pip install --quiet --disable-pip-version-check "pip==$PIP_VERSION" >&2
"$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "${TORCH_PKGS[@]}" >&2
lt="$(libtorch_path)"
if [[ ! -f "$lt/lib/libtorch_cpu.so" ]]; then
  echo "setup-libtorch: $lt/lib/libtorch_cpu.so is missing after the install; the torch wheel changed layout?" >&2
  exit 1
fi
printf '%s' "$want" > "$dir/.graft-stamp"
echo "setup-libtorch: ready" >&2
ready "$lt"
