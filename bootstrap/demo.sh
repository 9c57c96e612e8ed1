#!/usr/bin/env bash
# README command 1: set up this machine (once), build agentjet-peer, and chat with the
# default model (SmolLM2-135M-Instruct) on the CPU, or CUDA if LibTorch finds a GPU.
# Until the swarm lands, the demo is local generation; the swarm demo replaces it later.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash bootstrap/setup.sh
cargo build --release --bin agentjet-peer
for prompt in "What is the capital of France?" "Give me three short tips for learning to program."; do
  echo
  echo "> $prompt"
  ./target/release/agentjet-peer generate --model smollm2 --prompt "$prompt" --max-tokens 128
done
