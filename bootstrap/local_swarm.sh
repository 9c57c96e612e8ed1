# Sourced by scripts that run a local swarm on loopback (bootstrap/demo.sh,
# examples/tool_agent/run.sh): start_server starts `agentjet-peer --role server` with its
# output in DIR (server.out, server.log), echoes its steps prefixed with [server], and sets
# $server (its pid) and $addr (its bootstrap address) once it serves; stop_server drains it.
# Needs $peer (the agentjet-peer binary).

start_server() {
  local dir=$1
  shift
  "$peer" --role server --data-dir "$dir/server" --listen /ip4/127.0.0.1/udp/0/quic-v1 \
    "$@" > "$dir/server.out" 2> "$dir/server.log" &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  tail -f "$dir/server.out" 2>/dev/null | sed -u 's/^/[server] /' &
  tailer=$!
  addr=""
  for _ in $(seq 1 600); do
    addr=$(sed -n 's/^listening on //p' "$dir/server.out" | head -n1)
    grep -q '^serving model' "$dir/server.out" 2>/dev/null && [ -n "$addr" ] && return 0
    kill -0 $server 2>/dev/null || { cat "$dir/server.log" >&2; echo "the server did not start" >&2; exit 1; }
    sleep 0.2
  done
  echo "the server did not start within 2 minutes" >&2
  exit 1
}

stop_server() {
  sleep 3
  kill -TERM $server 2>/dev/null || true
  wait $server 2>/dev/null || true
  kill $tailer 2>/dev/null || true
  trap - EXIT
}
