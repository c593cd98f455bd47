#!/usr/bin/env bash
# The heavier tier's harness: ZeroClaw, only published as crates.io source. 0.8.7 declares
# rust-version 1.96 (the pinned toolchain is 1.95, which builds it), and plain
# `cargo install zeroclaw` would pick 0.1.7, so the version is exact. A debug build takes
# ~20 minutes on 2 cores (a ~1 GB binary); it goes to a cache OUTSIDE the clone, keyed by
# version, so a second run (or a second clone) costs nothing:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/graft/zeroclaw-<version>/bin/zeroclaw
# scripts/harness-matrix.sh finds it there (or at $ZEROCLAW_BIN).
# usage: bash scripts/setup-zeroclaw.sh      (CARGO_BUILD_JOBS=N to bound the build)
set -euo pipefail
version="0.8.7"
root="${XDG_CACHE_HOME:-$HOME/.cache}/graft/zeroclaw-$version"
if [[ -x "$root/bin/zeroclaw" ]] && "$root/bin/zeroclaw" --version >/dev/null 2>&1; then
  echo "setup-zeroclaw: up to date ($("$root/bin/zeroclaw" --version) in $root)"
  exit 0
fi
start=$(date +%s)
mkdir -p "$root"
# Outside the repository, so its rust-toolchain.toml does not apply to the build.
cd "${TMPDIR:-/tmp}"
cargo install zeroclaw --version "$version" --ignore-rust-version --locked --debug --root "$root"
"$root/bin/zeroclaw" --version
echo "setup-zeroclaw: built in $(( $(date +%s) - start ))s into $root"
