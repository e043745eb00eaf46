#!/usr/bin/env python3
"""Tiny random models of every family Kestrel runs, saved by transformers, and what transformers
computes on them: the golden data of tests/models/test_families.cpp.

For each family: a random model at a tiny shape (weights drawn wide enough that logits are far
from uniform, so greedy choices are not near-ties), saved with save_pretrained in float16; then
loaded back in float32 (the float16 values exactly) and run with eager attention over a fixed
prompt: the logits of every prompt position, and 24 greedy tokens after it.

Run where transformers and torch are installed (the GPU machine has both):
    python3 scripts/make-family-goldens.py OUT_DIR
then copy OUT_DIR/<family>/ to tests/data/families/<family>/.
"""
import json
import math
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

VOCAB = 320
PROMPT = [5, 17, 300, 42, 42, 7, 99, 250, 3, 61, 128, 200, 11, 12, 13, 310, 77, 5, 17, 300,
          8, 150, 271, 33]
NEW_TOKENS = 24

# head_dim 64 or 128 (the CUDA engine's), grouped-query attention (2 heads, 1 KV head).
common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
              bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(common, rms_norm_eps=1e-5, rope_theta=10000.0)),
    "llama3": (transformers.LlamaConfig, dict(
        common, rms_norm_eps=1e-5, head_dim=128, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
        rope_theta=500000.0)),
    "mistral": (transformers.MistralConfig, dict(common, rms_norm_eps=1e-5, sliding_window=8,
                                                 rope_theta=10000.0)),
    "qwen2": (transformers.Qwen2Config, dict(common, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                             tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": (transformers.Qwen3Config, dict(common, rms_norm_eps=1e-6, head_dim=128,
                                             rope_theta=1000000.0, tie_word_embeddings=False,
                                             attention_bias=False, use_sliding_window=False)),
    "opt": (transformers.OPTConfig, dict(vocab_size=VOCAB, hidden_size=128, ffn_dim=192,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         max_position_embeddings=128, do_layer_norm_before=True,
                                         word_embed_proj_dim=128, enable_bias=True,
                                         activation_function="relu", bos_token_id=2,
                                         eos_token_id=2, pad_token_id=1)),
}


def randomize(model, gen):
    # Every parameter redrawn: matrices with variance 1/fan_in (activations keep their scale
    # through the layers), norms near 1, biases small but not zero.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                fan_in = p.shape[1]
                std = 1.0 if "embed" in name else 1.0 / math.sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:  # norm weights
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)


def main():
    out = sys.argv[1]
    torch.manual_seed(0)
    report = {}
    for i, (name, (cls, kw)) in enumerate(FAMILIES.items()):
        cfg = cls(**kw)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        randomize(model, torch.Generator().manual_seed(1000 + i))
        d = os.path.join(out, name)
        model.half().save_pretrained(d)
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                   attn_implementation="eager").eval()
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            logits = ref(ids).logits[0]
            # Greedy by hand, the whole sequence recomputed each step: no cache, no generation
            # config (whose EOS would stop it).
            seq = list(PROMPT)
            for _ in range(NEW_TOKENS):
                seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
            gen = seq[len(PROMPT):]
        golden = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "prompt": PROMPT,
            "logits": [[round(float(x), 5) for x in row] for row in logits],
            "greedy": [int(t) for t in gen],
        }
        with open(os.path.join(d, "golden.json"), "w") as f:
            json.dump(golden, f)
        # Save only what the test reads: the model, its config and the golden data.
        for extra in ("generation_config.json",):
            p = os.path.join(d, extra)
            if os.path.exists(p):
                os.remove(p)
        top = logits[-1].topk(2).values
        report[name] = dict(greedy=golden["greedy"][:8], last_top2_gap=float(top[0] - top[1]))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
