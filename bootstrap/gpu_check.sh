#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA GPU and PyTorch but no Rust toolchain or network
# (what a lent device machine is). Two steps:
#
#   bash bootstrap/gpu_check.sh prepare  # here: builds, then fills .gpu/ (git-ignored) with the
#                                        # stripped CUDA test and bench binaries and SmolLM2's
#                                        # config + tokenizer (~20 MB; the GGUF is too big to ship)
#   bash bootstrap/gpu_check.sh run      # there, from the checkout with .gpu/ beside it; writes
#                                        # logs under $OUT (default .gpu/out)
#
# `run`: tests/cuda.rs (CUDA vs CPU: logits, engine, training layouts, AdamW), then
# benches/random_model.py makes a SmolLM2-135M copy with random weights (same shapes, so the
# same compute; special tokens zeroed so greedy decoding never ends early), and the serving and
# actor_update benches run on it (ours and HF transformers on the same GPU, same run), and the
# lora bench's multi-adapter decode.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    set -e
    json=$(cargo test --release --no-run --test cuda --message-format=json 2>/dev/null; cargo bench --no-run --bench serving --bench actor_update --bench lora --message-format=json 2>/dev/null)
    mkdir -p .gpu/meta
    grep -q '^/.gpu/$' .git/info/exclude 2>/dev/null || echo "/.gpu/" >>.git/info/exclude
    for b in cuda serving actor_update lora; do
        exe=$(printf '%s\n' "$json" | grep "\"name\":\"$b\"" | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
        [ -n "$exe" ] || { echo "no $b binary built" >&2; exit 1; }
        strip -o ".gpu/$b" "$exe"
    done
    tmp=$(mktemp -d)
    ./target/release/agentjet-peer export --out "$tmp/m" >/dev/null
    cp "$tmp"/m/{config.json,tokenizer.json,tokenizer_config.json,generation_config.json} .gpu/meta/
    rm -rf "$tmp"
    du -sh .gpu
    ;;
run)
    OUT=${OUT:-.gpu/out}
    mkdir -p "$OUT"
    T0=$(date +%s)
    t() { echo "== $1 (t=$(($(date +%s) - T0)) s)"; }
    TORCH_DIR=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')
    NV=$(ls -d "$TORCH_DIR"/../nvidia/*/lib "$TORCH_DIR"/../nvidia/*/*/lib 2>/dev/null | tr '\n' ':')
    export LD_LIBRARY_PATH="$TORCH_DIR/lib:$NV${LD_LIBRARY_PATH:-}"
    export AGENTJET_PYTHON=$(command -v python3) AGENTJET_BENCH_DIR=$PWD/benches
    export AGENTJET_CACHE=${AGENTJET_CACHE:-/tmp/agentjet-cache} TRANSFORMERS_VERBOSITY=error TQDM_DISABLE=1
    nvidia-smi -L
    python3 -c 'import torch,transformers;print("torch", torch.__version__, "transformers", transformers.__version__)'
    ldd .gpu/cuda | grep -i "not found"
    t "CUDA tests"
    timeout 90 .gpu/cuda --test-threads 1 2>&1 | tee "$OUT/cuda.log" | tail -15
    t "random-weight SmolLM2"
    timeout 60 python3 benches/random_model.py .gpu/meta /tmp/smolrand 2>&1 | tail -1
    t "serving"
    timeout 220 .gpu/serving --bench --model /tmp/smolrand >"$OUT/serving.log" 2>&1
    echo "rc=$?"; grep -v '^RESULT' "$OUT/serving.log" | tail -30
    t "actor_update (default trace)"
    timeout 60 .gpu/actor_update --bench --model /tmp/smolrand >"$OUT/actor_default.log" 2>&1
    echo "rc=$?"; grep -v '^RESULT' "$OUT/actor_default.log" | tail -8
    t "actor_update (AppWorld-shaped trace)"
    timeout 100 .gpu/actor_update --bench --model /tmp/smolrand --turns 20 --prompt 300 --env 60 --gen 20 --group-size 8 >"$OUT/actor_appworld.log" 2>&1
    echo "rc=$?"; grep -v '^RESULT' "$OUT/actor_appworld.log" | tail -8
    t "lora: multi-adapter decode"
    timeout 60 .gpu/lora --bench --only-multi-adapter --model /tmp/smolrand >"$OUT/lora.log" 2>&1
    echo "rc=$?"; tail -8 "$OUT/lora.log"
    t "done"
    ;;
*)
    echo "usage: bash bootstrap/gpu_check.sh prepare|run" >&2
    exit 2
    ;;
esac
