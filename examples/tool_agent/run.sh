#!/usr/bin/env bash
# Example (b), the calculator tool agent, learning through the swarm on this machine: one
# server hosting SmolLM2-135M-Instruct and training it (2 PPO epochs per step, every 2
# complete groups), one client running examples/tool_agent/agent.py (several turns with
# `tools` / `tool_calls`, temperature 0.7) on 2-digit multiplications, 8 episodes per task,
# for MINUTES of episodes (default 30). Ends with the client's summary: reward by quarter
# of the run, and how the turns merged into timelines (calls continued vs breaks).
#
#   bash examples/tool_agent/run.sh [MINUTES]
#
# runs/tool_agent/client-run/reward.svg: episode rewards over the run;
# runs/tool_agent/server/runs/smollm2/: the server's metrics.jsonl and reward.svg per step.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
minutes=${1:-30}
bash bootstrap/setup.sh
eval "$(bash bootstrap/setup.sh --print-env)"
cargo build --release --bin agentjet-peer
peer=./target/release/agentjet-peer
run=runs/tool_agent
rm -rf "$run"
mkdir -p "$run"
source bootstrap/local_swarm.sh
start_server "$run" --model smollm2 --groups-per-step 2 --learning-rate 2e-5 \
  --warmup-steps 3 --ppo-epochs 2 --max-batch 32
"$peer" --role client --model smollm2 --bootstrap "$addr" --data-dir "$run/client" \
  --listen /ip4/127.0.0.1/udp/0/quic-v1 \
  --agent "$AGENTJET_PYTHON examples/tool_agent/agent.py" \
  --tasks examples/tool_agent/tasks.jsonl --num-repeat 8 --concurrency 16 --epochs 20 \
  --episode-timeout 180 --time-limit $(( minutes * 60 )) --run-dir "$run/client-run" \
  2> "$run/client.log" | tee "$run/client.out"
stop_server
echo "training steps: $(grep -c '^train step' "$run/server.out" || true) (server log: $run/server.out)"
echo "reward curves: $run/client-run/reward.svg (episodes), $run/server/runs/smollm2/reward.svg (steps)"
