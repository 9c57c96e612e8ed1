"""The peer side of `cargo bench --bench decode`: HF transformers (GGUF loader, float32 or bfloat16)
single-stream greedy decode of SmolLM2-135M-Instruct on the same prompt ids, on the same
machine, in the same run. Prints one JSON line.

usage: python benches/hf_decode.py MODEL_DIR GGUF_FILE PROMPT_IDS_JSON NEW_TOKENS REPEATS DTYPE
DTYPE: float32 or bfloat16
"""
import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

model_dir, gguf_file, ids_json, new_tokens, repeats, dtype = sys.argv[1:7]
new_tokens, repeats = int(new_tokens), int(repeats)
ids = torch.tensor([json.loads(ids_json)])
model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=getattr(torch, dtype)).eval()


def run(n):
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=2)
    return time.perf_counter() - t, out[0, ids.shape[1]:].tolist()


run(new_tokens)  # warm-up
decode_rates, tokens = [], None
for _ in range(repeats):
    t_first, _ = run(1)  # prefill + first token
    t_all, tokens = run(new_tokens)
    decode_rates.append((new_tokens - 1) / (t_all - t_first))
print(json.dumps({"decode_tok_s": statistics.median(decode_rates), "all": decode_rates,
                  "threads": torch.get_num_threads(), "tokens": tokens}))
