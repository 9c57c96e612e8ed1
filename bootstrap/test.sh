#!/usr/bin/env bash
# README command 2: set up this machine (once; with the reference tools some tests compare
# against: HF transformers in the cached venv), check the code's form (rustfmt, clippy and
# rustdoc, warnings denied), then run the whole test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash bootstrap/setup.sh --reference
echo "[test] cargo fmt --check"
cargo fmt --all -- --check
echo "[test] cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
echo "[test] cargo clippy --no-default-features (the client-only build, without LibTorch)"
cargo clippy --no-default-features --lib --bins -- -D warnings
echo "[test] cargo doc --no-deps (warnings denied)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
cargo test --release --workspace "$@"
