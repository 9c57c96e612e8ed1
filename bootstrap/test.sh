#!/usr/bin/env bash
# README command 2: set up this machine (once; with the reference tools some tests compare
# against: HF transformers in the cached venv; Chromium, jq and curl from Debian when
# missing), check the code's form (rustfmt, clippy and rustdoc, warnings denied), then run
# the whole test suite. Ends with a table of each phase's time and each test binary's.
#
# Order: the builds share what they can. Clippy and rustdoc run in the release profile,
# so the C and C++ that build scripts compile (LibTorch's shim, aws-lc, zstd) are built
# once, for the tests' own build; the client-only binary comes first, so that the tests'
# build puts the full binary back in its place.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

phases=()
results=$(mktemp)
trap 'rm -f "$results"' EXIT
table() {
  echo
  echo "| phase | seconds |"
  echo "|---|---|"
  local total=0
  for p in "${phases[@]}"; do
    echo "| ${p%%|*} | ${p##*|} |"
    total=$(( total + ${p##*|} ))
  done
  # Each test binary's own time (libtest's "finished in"), from the test phase's output.
  python3 - "$results" <<'PY'
import re, sys
# A binary's own result is the last before the next binary starts (a test that re-runs
# its binary in a child process prints a result line of its own before it).
name, last = None, None
def flush():
    if name and last:
        print(f"| test {name} ({last.group(2)} passed, {last.group(3)} failed) | {float(last.group(4)):.0f} |")
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"\s+Running (\S+)", line)
    if m:
        flush()
        name, last = m.group(1), None
        crate = re.search(r"deps/(\w+)-[0-9a-f]+\)", line)
        if name == "unittests" and crate:
            name = f"unittests ({crate.group(1)})"
    m = re.search(r"test result: (\w+)\. (\d+) passed; (\d+) failed.*finished in ([\d.]+)s", line)
    if m:
        last = m
flush()
PY
  echo "| total | $total |"
}
phase() {
  local name=$1
  shift
  echo "[test] $name: $*"
  local t0
  t0=$(date +%s)
  local rc=0
  "$@" || rc=$?
  phases+=("$name|$(( $(date +%s) - t0 ))")
  if [ "$rc" -ne 0 ]; then
    echo "[test] $name failed (exit $rc)"
    table
    exit "$rc"
  fi
}

debian() {
  # Debian packages the tests use, installed only when missing: Chromium (the dashboard
  # test opens the page in it, headless), jq and curl (the shell agents), iproute2 and
  # iptables (the hosts in network namespaces of tests/e2e/network.rs and their NAT
  # routers).
  local missing=()
  command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
  command -v jq >/dev/null || missing+=(jq)
  command -v curl >/dev/null || missing+=(curl)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v iptables >/dev/null || missing+=(iptables)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[test] installing from Debian's packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

client_only() {
  # The client-only binary (no LibTorch), built in the main target folder so its
  # dependencies are the main build's (its own folder would build them all again), and
  # kept as a copy: the tests' build below puts the full binary back in its place.
  cargo build --release --no-default-features --bin agentjet-peer
  mkdir -p "$target_dir/client-only"
  cp "$target_dir/release/agentjet-peer" "$AGENTJET_CLIENT_ONLY_BIN"
}

run_tests() {
  # Libraries' unit tests and the integration tests (no examples: clippy checked that
  # they build; no doc tests: there are none). The e2e binary last, with more libtest
  # threads than the two lanes its tests hold (tests/common/mod.rs, `light` and `heavy`):
  # a test queued for the heavy lane then waits without taking a thread a light one could
  # run on.
  local others
  others=$(cargo metadata --format-version 1 --no-deps | python3 -c '
import json, sys
print(" ".join("--test " + t["name"] for p in json.load(sys.stdin)["packages"]
               for t in p["targets"] if "test" in t["kind"] and t["name"] != "e2e"))') || return 1
  # shellcheck disable=SC2086
  {
    cargo test --release --workspace --lib $others "$@" &&
      RUST_TEST_THREADS=16 cargo test --release -p agentjet --test e2e "$@"
  } 2>&1 | tee "$results"
  return "${PIPESTATUS[0]}"
}

phase "setup" bash bootstrap/setup.sh --reference
phase "debian packages" debian
phase "fmt" cargo fmt --all -- --check
target_dir=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
export AGENTJET_CLIENT_ONLY_BIN="$target_dir/client-only/agentjet-peer-client-only"
phase "client-only build" client_only
phase "build (tests)" cargo test --release --workspace --lib --tests --no-run
phase "clippy" cargo clippy --release --workspace --all-targets -- -D warnings
phase "clippy (client-only)" cargo clippy --release --no-default-features --lib --bins -- -D warnings
export RUSTDOCFLAGS="-D warnings"
phase "doc" cargo doc --release --workspace --no-deps
unset RUSTDOCFLAGS
phase "tests" run_tests "$@"
table
