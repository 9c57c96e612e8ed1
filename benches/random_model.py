"""Writes a model directory with the architecture and tokenizer of SRC_DIR and freshly drawn
random weights (normal, std = the config's initializer_range), for speed benchmarks on a
machine the real weights cannot be copied to (the device machine's transfer limit is below
SmolLM2's 98 MB GGUF). Compute per token is the weights' shape, not their values, so the
speed of both sides is that of the real model; the outputs are noise.

The special tokens' embedding rows (tied to the output layer in SmolLM2) are zeroed, so their
logits are exactly 0 while the maximum over 49k random logits is far above: greedy decoding
never samples end-of-sequence and every request runs to its max_tokens, on both sides.

usage: python benches/random_model.py SRC_DIR OUT_DIR [SEED]
SRC_DIR: config.json and tokenizer files (tokenizer.json, tokenizer_config.json,
         generation_config.json), e.g. `agentjet-peer export` output without its weights.
"""
import json
import os
import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

src, out = sys.argv[1], sys.argv[2]
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
torch.manual_seed(seed)
config = AutoConfig.from_pretrained(src)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
special = [t["id"] for t in json.load(open(os.path.join(src, "tokenizer.json")))["added_tokens"]]
with torch.no_grad():
    emb = model.get_input_embeddings().weight
    emb[special] = 0
    if not config.tie_word_embeddings:
        model.get_output_embeddings().weight[special] = 0
os.makedirs(out, exist_ok=True)
model.save_pretrained(out, safe_serialization=True)
for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
    if os.path.exists(os.path.join(src, name)):
        shutil.copy(os.path.join(src, name), os.path.join(out, name))
print(json.dumps({"out": out, "parameters": sum(p.numel() for p in model.parameters()), "zeroed": special}))
