"""The peer side of `cargo bench --bench models`: HF transformers 5.x on random-weight models
shaped like the 2026 families, on the same machine in the same run. Prints one JSON line.

usage:
  python benches/hf_models.py build FAMILY OUT_DIR
      writes a random model of FAMILY's shape (and a byte-level tokenizer) to OUT_DIR
  python benches/hf_models.py decode MODEL_DIR DTYPE STREAMS NEW_TOKENS PROMPT_TOKENS
      greedy decode of STREAMS prompts at once (every one runs NEW_TOKENS tokens)
  python benches/hf_models.py train MODEL_DIR SEQS TOKENS
      forward + backward of SEQS sequences of TOKENS tokens (float32)

FAMILY: qwen3_0_6b (Qwen3-0.6B's config), qwen3_5_0_8b (Qwen3.5-0.8B's text config),
qwen3_moe_small (Qwen3-MoE's layer with fewer, narrower layers: the real ones do not fit a
2-core, 24 GB machine).
"""
import json
import statistics
import sys
import time

import torch

SHAPES = {
    "qwen3_0_6b": ("qwen3", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_5_0_8b": ("qwen3_5_text", dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=16, tie_word_embeddings=True, max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                         "partial_rotary_factor": 0.25})),
    "qwen3_moe_small": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=384, norm_topk_prob=True,
        tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def build(family, out):
    from transformers import AutoConfig, AutoModelForCausalLM
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    model_type, kw = SHAPES[family]
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(out)
    # A byte-level tokenizer (the bench feeds token ids; a tokenizer is only loaded).
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(f"{out}/tokenizer.json")
    return {"out": out, "parameters": sum(p.numel() for p in model.parameters())}


def load(model_dir, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


def prompts(n, tokens, vocab):
    g = torch.Generator().manual_seed(1)
    return torch.randint(300, vocab - 1, (n, tokens), generator=g)


def decode(model_dir, dtype, streams, new_tokens, prompt_tokens):
    model = load(model_dir, dtype)
    ids = prompts(streams, prompt_tokens, model.config.get_text_config().vocab_size)

    def run(n):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    run(2)  # warm-up
    t_first = run(1)
    t_all = run(new_tokens)
    return {"decode_tok_s": streams * (new_tokens - 1) / (t_all - t_first),
            "threads": torch.get_num_threads()}


def train(model_dir, seqs, tokens):
    model = load(model_dir, "float32").train()
    ids = prompts(seqs, tokens, model.config.get_text_config().vocab_size)

    def step():
        logits = model(ids).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])
        (-lp.mean()).backward()

    step()  # warm-up
    times = []
    for _ in range(3):
        model.zero_grad()  # outside the clock, as ours
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return {"train_tok_s": seqs * tokens / statistics.median(times), "all": times,
            "threads": torch.get_num_threads()}


mode = sys.argv[1]
if mode == "build":
    out = build(sys.argv[2], sys.argv[3])
elif mode == "decode":
    out = decode(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
elif mode == "train":
    out = train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
else:
    sys.exit(f"unknown mode {mode!r}")
print(json.dumps(out))
