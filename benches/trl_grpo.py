"""TRL's GRPOTrainer on learn_addition's task: the peer of `cargo bench --bench learn_vs_trl`.

The same task as examples/learn_addition.rs: "What is a + b? Answer with the number only."
(a, b in 10..=99; SmolLM2's chat template), reward 1 when the last integer of the answer is
a + b, else 0; held-out greedy accuracy on the pairs learn_addition wrote (`--heldout`,
never trained on). Settings that have a TRL knob follow ours: 8 prompts x 8 samples per
step, learning rate, warmup steps, no weight decay, `--temperature`, at most 32 new
tokens, no KL (beta 0), clip 0.2 / 0.28, token-level loss ("dapo"), group-normalised
advantages, `--iterations` passes per generation batch (our PPO epochs), each in
`--mini-batches` optimizer steps (`steps_per_generation`; our mini-batches).

Prints `EVAL train_minutes=.. accuracy=.. step=..` at the start and every `--eval-every`
steps (minutes of training from the first step, the evaluations' own time not counted),
stops after `--minutes` of such training time, and ends with one JSON line.
"""

import argparse
import json
import random
import re
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def question(a, b):
    return [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]


def last_number(text):
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


def reward(completions, answer, **_):
    return [1.0 if last_number(c[0]["content"]) == a else 0.0 for c, a in zip(completions, answer)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="an HF model directory")
    p.add_argument("--heldout", required=True, help="JSON list of [a, b] pairs")
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--mini-batches", type=int, default=1,
                   help="optimizer steps per generation batch and iteration (our --mini-batches)")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.tasks % a.mini_batches:
        p.error(f"--tasks {a.tasks} does not split into {a.mini_batches} mini-batches of whole groups")
    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    heldout = [tuple(x) for x in json.load(open(a.heldout))]
    held = set(heldout)
    rng = random.Random(a.seed)
    rows = []
    while len(rows) < 50000:
        x, y = rng.randint(10, 99), rng.randint(10, 99)
        if (x, y) not in held:
            rows.append({"prompt": question(x, y), "answer": x + y})
    train = Dataset.from_list(rows)

    def evaluate():
        texts = [tok.apply_chat_template(question(x, y), add_generation_prompt=True, tokenize=False)
                 for x, y in heldout]
        right = 0
        model.eval()
        with torch.no_grad():
            for i in range(0, len(texts), 32):
                enc = tok(texts[i:i + 32], return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(**enc, do_sample=False, max_new_tokens=a.max_tokens,
                                     pad_token_id=tok.pad_token_id or tok.eos_token_id)
                for j, ids in enumerate(out[:, enc["input_ids"].shape[1]:]):
                    x, y = heldout[i + j]
                    right += last_number(tok.decode(ids, skip_special_tokens=True)) == x + y
        model.train()
        return right / max(1, len(heldout))

    evals = []

    class Clock(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.eval_s = 0.0

        def minutes(self):
            return (time.time() - self.t0 - self.eval_s) / 60.0

        def record(self, step, at=None):
            at = self.minutes() if at is None else at
            e0 = time.time()
            acc = evaluate()
            self.eval_s += time.time() - e0
            evals.append([at, acc, step])
            print(f"EVAL train_minutes={at:.3f} accuracy={acc:.4f} step={step}", flush=True)

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.time()
            self.record(0, at=0.0)

        def on_step_end(self, args, state, control, **kw):
            done = self.minutes() >= a.minutes
            if done or state.global_step % a.eval_every == 0:
                self.record(state.global_step)
            if done:
                control.should_training_stop = True

    cfg = GRPOConfig(
        output_dir=a.out,
        learning_rate=a.lr,
        weight_decay=0.0,
        warmup_steps=a.warmup_steps,
        lr_scheduler_type="constant_with_warmup",
        # One generation batch of tasks x group, split into --mini-batches optimizer steps
        # of whole groups, each taken --iterations times: our PPO epochs x mini-batches.
        per_device_train_batch_size=a.tasks * a.group // a.mini_batches,
        steps_per_generation=a.mini_batches,
        num_generations=a.group,
        max_completion_length=a.max_tokens,
        temperature=a.temperature,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=a.iterations,
        max_steps=100000,
        gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        seed=a.seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=train,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    print(json.dumps({"evals": evals, "steps": trainer.state.global_step,
                      "trl": __import__("trl").__version__}))


if __name__ == "__main__":
    main()
