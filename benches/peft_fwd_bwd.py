"""HF PEFT's forward + backward over packed rows, the peer of `cargo bench --bench lora`.

argv: MODEL_DIR ROWS_JSON RANK ROUNDS THREADS. Each row is one sequence (ids) with the
positions whose next-token log-probability is scored (from), the scored tokens (tok) and
their advantages (adv); the loss is -sum(adv * logprob) / scored tokens, as ours. LoRA of
RANK on every linear layer (alpha 2 x RANK), float32, `logits_to_keep` = the scored
positions (HF's cheapest head). Prints per-round times and `PEFT_FWD_BWD <median s>`.
"""
import json
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model_dir, rows_path, rank, rounds, threads = sys.argv[1:6]
rank, rounds, threads = int(rank), int(rounds), int(threads)
torch.set_num_threads(threads)
rows = json.load(open(rows_path))
base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
cfg = LoraConfig(
    r=rank,
    lora_alpha=2 * rank,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lora_dropout=0.0,
)
model = get_peft_model(base, cfg)
model.train()
total = sum(len(r["tok"]) for r in rows)
times = []
for i in range(rounds + 1):
    t0 = time.perf_counter()
    for r in rows:
        ids = torch.tensor([r["ids"]])
        frm = torch.tensor(r["from"])
        out = model(input_ids=ids, logits_to_keep=frm)
        lp = torch.log_softmax(out.logits[0].float(), -1)
        lp = lp.gather(1, torch.tensor(r["tok"]).unsqueeze(1)).squeeze(1)
        loss = -(lp * torch.tensor(r["adv"])).sum() / total
        loss.backward()
    secs = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    print(f"  peft round {i}: {secs:.2f} s")
    if i > 0:
        times.append(secs)
times.sort()
print(f"PEFT_FWD_BWD {times[len(times) // 2]}")
