#!/usr/bin/env bash
# README command 2: set up this machine (once; with the reference tools some tests compare
# against: HF transformers in the cached venv; Chromium, jq and curl from Debian when
# missing), check the code's form (rustfmt, clippy and rustdoc, warnings denied), then run
# the whole test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash bootstrap/setup.sh --reference
# Debian packages the tests use, installed only when missing: Chromium (the dashboard test
# opens the page in it, headless), jq and curl (the shell agents).
missing=()
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
command -v jq >/dev/null || missing+=(jq)
command -v curl >/dev/null || missing+=(curl)
if [ ${#missing[@]} -gt 0 ]; then
  echo "[test] installing from Debian's packages: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "[test] cargo fmt --check"
cargo fmt --all -- --check
echo "[test] cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
echo "[test] cargo clippy --no-default-features (the client-only build, without LibTorch)"
cargo clippy --no-default-features --lib --bins -- -D warnings
echo "[test] cargo doc --no-deps (warnings denied)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
# The client-only binary (no LibTorch), built here in the main target folder so its
# dependencies are the main build's (its own folder would build them all again), and kept
# as a copy: the tests' build below puts the full binary back in its place.
echo "[test] cargo build --release --no-default-features (the client-only binary)"
cargo build --release --no-default-features --bin agentjet-peer
target_dir=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
mkdir -p "$target_dir/client-only"
cp "$target_dir/release/agentjet-peer" "$target_dir/client-only/agentjet-peer-client-only"
export AGENTJET_CLIENT_ONLY_BIN="$target_dir/client-only/agentjet-peer-client-only"
cargo test --release --workspace "$@"
