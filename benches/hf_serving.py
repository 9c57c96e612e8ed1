"""The peer side of `cargo bench --bench serving`: HF transformers batched greedy `generate`
(float32 or bfloat16) of SmolLM2-135M-Instruct (or the bench's --model) on the same prompt
ids, 128 new tokens each, at each concurrency (batch size), in the same run. Prints one
JSON line.

usage: python benches/hf_serving.py MODEL_DIR GGUF_FILE PROMPTS_JSON NEW_TOKENS CONCURRENCIES_JSON DTYPE
GGUF_FILE: the GGUF file inside MODEL_DIR, or "" for an HF model directory
PROMPTS_JSON: a list of token-id lists (at least max(concurrency) of them)
"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

model_dir, gguf_file, prompts_json, new_tokens, conc_json, dtype = sys.argv[1:7]
new_tokens = int(new_tokens)
prompts = json.loads(prompts_json)
# The same device as ours: CUDA when there is one (ours takes it then too), else the CPU.
device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file or None, dtype=getattr(torch, dtype)).eval().to(device)
PAD = 2


def batch(ids_list):
    width = max(len(p) for p in ids_list)
    ids = torch.full((len(ids_list), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(ids_list), width), dtype=torch.long)
    for i, p in enumerate(ids_list):  # left padding, as decoder-only batching needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def run(c, n):
    ids, mask = batch(prompts[:c])
    ids, mask = ids.to(device), mask.to(device)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=PAD)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


run(2, 4)  # warm-up
out = {}
for c in json.loads(conc_json):
    ttft = run(c, 1)  # the whole batch's first token arrives together
    total = run(c, new_tokens)
    out[str(c)] = {"tok_s": c * new_tokens / total, "ttft_s": ttft, "wall_s": total}
print(json.dumps(out))
