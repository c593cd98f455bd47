#!/usr/bin/env bash
# The whole test suite, from a clean clone: installs the real clients the tests drive
# (Python SDKs and harnesses, the Node SDK; see scripts/setup-test-env.sh), then runs
# formatting, lints, and every test in the workspace.
# Usage: bash scripts/test.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
start=$(date +%s)
bash scripts/setup-test-env.sh
cargo fmt --all -- --check
cargo clippy --locked --workspace --all-targets -- -D warnings
cargo test --locked --workspace
echo "scripts/test.sh: all green in $(( $(date +%s) - start ))s"
