#!/usr/bin/env bash
# README command 1: set up this machine (once), build agentjet-peer, and run the demo as a
# real local swarm over libp2p on loopback: one server hosting the default model
# (SmolLM2-135M-Instruct) and training it with GRPO, and one client running the math agent
# (examples/math_agent/plain_agent.py: Python's standard library, so each episode's process
# starts in ~50 ms) on additions of two numbers up to 30, 8 episodes per task.
#
# The episodes run until the server has taken $AGENTJET_DEMO_STEPS training steps
# (default 10), or for at most $AGENTJET_DEMO_MINUTES minutes (default 8), whichever comes
# first: how long setup and the build took does not change what the demo shows. Before the
# first episode and after the last step, 40 held-out additions (never trained on) are
# answered greedily by the served policy; the demo ends with both answers side by side,
# the reward by quarter of the run, and the path of the reward curve.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
steps=${AGENTJET_DEMO_STEPS:-10}
bound=$(( ${AGENTJET_DEMO_MINUTES:-8} * 60 ))
# The crates download while setup installs LibTorch (both mostly wait on the network).
# (Compiling beside it was tried: pip's unpacking and byte-compiling of torch is CPU work
# too, and setup and build together took 7 min 49 s against about 7 min one after the other.)
cargo fetch --quiet &
fetch=$!
bash bootstrap/setup.sh
wait $fetch || echo "cargo fetch failed; the build fetches what it needs"
eval "$(bash bootstrap/setup.sh --print-env)"
cargo build --release --bin agentjet-peer
built=$(date +%s)
peer=./target/release/agentjet-peer
demo=runs/demo
rm -rf "$demo"
mkdir -p "$demo"

# The server: one step per 4 complete groups (of 8 episodes), never more (a backlog would
# make steps long and the episodes they train stale), two passes over each step's batch;
# its stdout goes to $demo/server.out and, prefixed, to this terminal. The HTTP API on
# loopback is for the held-out questions only (the client goes through the swarm).
source bootstrap/local_swarm.sh
start_server "$demo" --model smollm2 --http 127.0.0.1:0 --groups-per-step 4 \
  --max-groups-per-step 4 --learning-rate 2e-5 --warmup-steps 2 --ppo-epochs 2 --max-batch 32
http=$(sed -n 's|^http at \(http://.*\)$|\1|p' "$demo/server.out" | head -n1)
heldout() {
  "$AGENTJET_PYTHON" examples/math_agent/heldout.py --base-url "$http" --label "$1" \
    --out "$demo/heldout-$1.json" | tee "$demo/heldout-$1.txt"
}
echo "held-out additions, answered greedily before training:"
heldout before

# The client: 8 episodes per task (one group), 8 at once (more only makes episodes the
# trainer cannot keep up with on 2 cores), until the server took $steps steps or the time
# bound passed; SIGTERM drains it (running episodes finish and are submitted).
metrics="$demo/server/runs/smollm2/metrics.jsonl"
echo "client: running episodes until the server took $steps training steps (at most $(( bound / 60 )) min)"
"$peer" --role client --model smollm2 --bootstrap "$addr" --data-dir "$demo/client" \
  --listen /ip4/127.0.0.1/udp/0/quic-v1 \
  --agent "$AGENTJET_PYTHON examples/math_agent/plain_agent.py" \
  --tasks examples/math_agent/tasks.jsonl --num-repeat 8 --concurrency 8 \
  --episode-timeout 120 --time-limit "$bound" --run-dir "$demo/client-run" \
  > "$demo/client.out" 2> "$demo/client.log" &
client=$!
tail -f "$demo/client.out" 2>/dev/null &
client_tail=$!
taken() { [ -f "$metrics" ] && grep -c . "$metrics" || echo 0; }
while kill -0 $client 2>/dev/null; do
  if [ "$(taken)" -ge "$steps" ]; then
    kill -TERM $client 2>/dev/null || true
    break
  fi
  sleep 1
done
wait $client || { kill $client_tail 2>/dev/null; cat "$demo/client.log" >&2; exit 1; }
kill $client_tail 2>/dev/null || true
wait $client_tail 2>/dev/null || true

echo
echo "held-out additions, answered greedily after training:"
heldout after
stop_server
echo
before=$(sed -n 's/^heldout before: //p' "$demo/heldout-before.txt")
after=$(sed -n 's/^heldout after: //p' "$demo/heldout-after.txt")
echo "== what training changed =="
echo "held-out (greedy): before: $before"
echo "                   after:  $after"
sed -n 's/^\(smollm2 .*\)$/reward (sampled):  \1/p' "$demo/client.out" | head -n1
echo "training steps: $(taken) (server log: $demo/server.out; per step: $metrics)"
echo "reward curve: $demo/server/runs/smollm2/reward.svg"
echo "episodes: $demo/client-run/episodes.jsonl; agents' output: $demo/client-run/episodes/"
end=$(date +%s)
echo "demo finished in $(( (end - start) / 60 )) min $(( (end - start) % 60 )) s" \
  "(setup and build $(( (built - start) / 60 )) min $(( (built - start) % 60 )) s)"
