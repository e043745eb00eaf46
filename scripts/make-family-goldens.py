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

import numpy as np
import safetensors.torch
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


def pack_gptq(src, dst, group, act_order, gen):
    """The FP16 model at src as a GPTQ checkpoint at dst, packed here from the GPTQ format's
    definition (AutoGPTQ's "gptq" v1 layout: symmetric 4-bit, zero 8 stored as 7, codes packed
    along K into int32 [K/8, N], zeros along N, g_idx from the act-order permutation), with
    round-to-nearest codes. Returns the dequantized weights, name -> float32 [N, K], which the
    reference model runs with."""
    sd = safetensors.torch.load_file(os.path.join(src, "model.safetensors"))
    out, deq = {}, {}
    for name, t in sd.items():
        if not (t.dim() == 2 and name.endswith(".weight") and ".layers." in name):
            out[name] = t
            continue
        W = t.float()
        N, K = W.shape
        perm = torch.randperm(K, generator=gen) if act_order else torch.arange(K)
        g_idx = torch.empty(K, dtype=torch.int64)
        g_idx[perm] = torch.arange(K) // group  # the i-th column in act order is in group i // group
        G = K // group
        scales = torch.empty(G, N)
        for gi in range(G):
            cols = (g_idx == gi).nonzero().flatten()
            scales[gi] = (W[:, cols].abs().amax(dim=1) / 7).clamp(min=1e-6)
        scales = scales.half()
        sc = scales.float()[g_idx].T  # [N, K]: each weight's scale
        q = torch.clamp(torch.round(W / sc) + 8, 0, 15).to(torch.int64)
        deq[name] = (q - 8).float() * sc
        qT = q.T.numpy().astype(np.uint64)  # [K, N]
        packed = np.zeros((K // 8, N), dtype=np.uint64)
        for j in range(8):
            packed |= qT[j::8] << np.uint64(4 * j)
        prefix = name[: -len(".weight")]
        out[prefix + ".qweight"] = torch.from_numpy(packed.astype(np.uint32).view(np.int32))
        zeros = np.full((G, N // 8), 0x77777777, dtype=np.uint32)  # zero 8, stored minus one
        out[prefix + ".qzeros"] = torch.from_numpy(zeros.view(np.int32))
        out[prefix + ".scales"] = scales
        out[prefix + ".g_idx"] = g_idx.to(torch.int32)
    os.makedirs(dst, exist_ok=True)
    safetensors.torch.save_file(out, os.path.join(dst, "model.safetensors"),
                                metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                  "desc_act": act_order, "sym": True,
                                  "checkpoint_format": "gptq"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return deq


def reference(d, weights=None):
    """Logits of every prompt position and 24 greedy tokens, transformers in float32 over the
    model at d (with `weights` replacing its linears' where given)."""
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    if weights:
        params = dict(ref.named_parameters())
        with torch.no_grad():
            for name, w in weights.items():
                params[name].copy_(w)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = ref(ids).logits[0]
        # Greedy by hand, the whole sequence recomputed each step: no cache, no generation
        # config (whose EOS would stop it).
        seq = list(PROMPT)
        for _ in range(NEW_TOKENS):
            seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt": PROMPT,
        "logits": [[round(float(x), 5) for x in row] for row in logits],
        "greedy": seq[len(PROMPT):],
    }


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
        golden = reference(d)
        with open(os.path.join(d, "golden.json"), "w") as f:
            json.dump(golden, f)
        # Save only what the test reads: the model, its config and the golden data.
        for extra in ("generation_config.json",):
            p = os.path.join(d, extra)
            if os.path.exists(p):
                os.remove(p)
        report[name] = dict(greedy=golden["greedy"][:8])
        # The same model GPTQ-packed (act-order on two families), against transformers running
        # its dequantized weights.
        act = name in ("llama", "qwen3")
        q = d + "-gptq"
        deq = pack_gptq(d, q, 32, act, torch.Generator().manual_seed(2000 + i))
        with open(os.path.join(q, "golden.json"), "w") as f:
            json.dump(reference(d, deq), f)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
