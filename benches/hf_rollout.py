"""The peer side of `cargo bench --bench rollout`: the same agentic episodes run with HF
transformers as a careful user writes the loop by hand: every turn, the prompts of all
concurrent episodes are left-padded into one batch and `generate` produces the fixed
number of greedy tokens; then each episode appends its answer and its next environment
tokens. No prefix cache (HF `generate` has none across calls). Prints one JSON line.

usage: python benches/hf_rollout.py MODEL_DIR GGUF_FILE TRACE_JSON DTYPE
TRACE_JSON: {"episodes": [{"task": [ids], "env": [[ids] per turn]}], "new_tokens": N,
             "concurrency": C}
"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

model_dir, gguf_file, trace_path, dtype = sys.argv[1:5]
with open(trace_path) as f:
    trace = json.load(f)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(
    model_dir, gguf_file=gguf_file or None, dtype=getattr(torch, dtype)
).eval().to(device)
PAD = 2
new_tokens = trace["new_tokens"]


def batch(ids_list):
    width = max(len(p) for p in ids_list)
    ids = torch.full((len(ids_list), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(ids_list), width), dtype=torch.long)
    for i, p in enumerate(ids_list):  # left padding, as decoder-only batching needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


def turn(prompts):
    ids, mask = batch(prompts)
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD)
    return out[:, ids.shape[1]:].tolist(), ids.numel()


turn([trace["episodes"][0]["task"][:16]])  # warm-up
episodes = trace["episodes"]
conc = trace["concurrency"]
call_s, prefill, answers = [], 0, [None] * len(episodes)
sync()
t0 = time.perf_counter()
for start in range(0, len(episodes), conc):
    group = list(range(start, min(start + conc, len(episodes))))
    prompts = {i: list(episodes[i]["task"]) + list(episodes[i]["env"][0]) for i in group}
    answers_of = {i: [] for i in group}
    for t in range(len(episodes[group[0]]["env"])):
        t1 = time.perf_counter()
        outs, computed = turn([prompts[i] for i in group])
        sync()
        dt = time.perf_counter() - t1
        prefill += computed
        for i, o in zip(group, outs):
            call_s.append(dt)  # every call of the batch waits for the whole batch
            answers_of[i].append(o)
            if t + 1 < len(episodes[i]["env"]):
                prompts[i] = prompts[i] + o + list(episodes[i]["env"][t + 1])
    for i in group:
        answers[i] = answers_of[i]
sync()
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "call_s": call_s, "prefill_tokens": prefill, "answers": answers}))
