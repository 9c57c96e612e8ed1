#!/usr/bin/env bash
# README command 2: set up this machine (once; with the reference tools some tests compare
# against: HF transformers in the cached venv), then run the whole test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash bootstrap/setup.sh --reference
cargo test --release --workspace "$@"
