#!/usr/bin/env bash
# graft on its embedded default: builds graft, starts the scripted upstream and the
# recording gateway in front of it (local data dir), runs a short client conversation
# through a session, and prints where the records went. Needs Rust (rustup) and Python 3.11
# (graft links libtorch for `graft train`; scripts/setup-libtorch.sh installs it once).
# Usage: bash scripts/demo.sh [--data-dir DIR]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
LIBTORCH="$(bash scripts/setup-libtorch.sh)"
export LIBTORCH
cargo build --release --locked --bin graft
exec "$repo/target/release/graft" demo "$@"
