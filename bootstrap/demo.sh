#!/usr/bin/env bash
# README command 1: set up this machine (once), build agentjet-peer, and run the demo as a
# real local swarm over libp2p on loopback: one server hosting the default model
# (SmolLM2-135M-Instruct) and training it, and one client running example (a), a Python
# math agent on OpenAI's SDK, on 2-digit additions. Prints the client's progress and the
# server's training steps; ends with a summary and the path of the reward curve.
#
# The whole demo (setup and build included) is held to about $AGENTJET_DEMO_MINUTES
# minutes (default 14): whatever the build left is the client's time for episodes, at
# least 3 minutes. On a fresh clone the first build takes about 8 minutes on an idle
# 2-core machine, which leaves about 5 minutes of episodes (some 450 episodes, 13 training
# steps). A busier machine builds slower and leaves fewer steps: run it again (the build
# is then done) or set AGENTJET_DEMO_MINUTES=25.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
budget=$(( ${AGENTJET_DEMO_MINUTES:-14} * 60 ))
bash bootstrap/setup.sh
eval "$(bash bootstrap/setup.sh --print-env)"
cargo build --release --bin agentjet-peer
peer=./target/release/agentjet-peer
demo=runs/demo
rm -rf "$demo"
mkdir -p "$demo"

# The server: trains on every 2 complete groups (of 8 episodes); its stdout goes to a file and, prefixed,
# to this terminal.
source bootstrap/local_swarm.sh
start_server "$demo" --model smollm2 --groups-per-step 2 --learning-rate 2e-5 \
  --warmup-steps 3 --max-batch 32

# The client: 8 episodes per task (one group), 16 at once, until the time is up.
left=$(( budget - ($(date +%s) - start) - 60 ))
[ "$left" -ge 180 ] || left=180
echo "client: running episodes for $left s"
"$peer" --role client --model smollm2 --bootstrap "$addr" --data-dir "$demo/client" \
  --listen /ip4/127.0.0.1/udp/0/quic-v1 \
  --agent "$AGENTJET_PYTHON examples/math_agent/agent.py" \
  --tasks examples/math_agent/tasks.jsonl --num-repeat 8 --concurrency 16 \
  --episode-timeout 120 --time-limit "$left" --run-dir "$demo/client-run" 2> "$demo/client.log"

stop_server
echo
echo "training steps: $(grep -c '^train step' "$demo/server.out" || true) (server log: $demo/server.out)"
echo "reward curve: $demo/server/runs/smollm2/reward.svg (per step: $demo/server/runs/smollm2/metrics.jsonl)"
echo "episodes: $demo/client-run/episodes.jsonl; agents' output: $demo/client-run/episodes/"
echo "demo finished in $(( ($(date +%s) - start) / 60 )) min $(( ($(date +%s) - start) % 60 )) s"
