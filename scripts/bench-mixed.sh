#!/usr/bin/env bash
# The decode speed of a mixed-precision model against what its formats predict (issue #46):
# uniform 3-, 4- and 8-bit g128 models of one shape and a mixed one (attention 3-bit, gate/up
# 4-bit, down 8-bit: GPTQModel `dynamic` rules) are made with kestrel-synth and benchmarked in
# one run, alternating, twice. A decode step of the mixed model should cost what its linears'
# parameters cost in each uniform model:
#
#   t_predicted = sum over formats f of (share of the quantized parameters in f) * t_uniform(f)
#
# (the step's other work, attention, embeddings, norms and the FP16 head, is the same in every
# model and so adds up to itself). Prints each model's median tok/s and the mixed model's
# measured over predicted speed.
#
# usage: scripts/bench-mixed.sh BUILD_DIR [SHAPE (7b)] [WORK_DIR (a temporary one)]
set -euo pipefail
B=${1:?usage: scripts/bench-mixed.sh BUILD_DIR [SHAPE] [WORK_DIR]}
SHAPE=${2:-7b}
if [ -n "${3:-}" ]; then
  W=$3
  mkdir -p "$W"
else  # four models of the shape (about 20 GB at 7b): gone when the script ends, however it ends
  W=$(mktemp -d)
  trap 'rm -rf "$W"' EXIT
fi
synth() { "$B/kestrel-synth" --shape "$SHAPE" --dtype gptq --group-size 128 --quiet --force "$@"; }
synth --bits 3 --out "$W/u3"
synth --bits 4 --out "$W/u4"
synth --bits 8 --out "$W/u8"
synth --bits 4 --out "$W/mixed" --dynamic \
  '{"+:.*\\.self_attn\\..*": {"bits": 3}, "+:.*\\.mlp\\.down_proj": {"bits": 8}}'

for round in 1 2; do
  for m in u3 u4 u8 mixed; do
    "$B/kestrel" bench -m "$W/$m" -p 16 -n 128 -r 3 -o json > "$W/$m.$round.json"
  done
done

python3 - "$W" <<'EOF'
import json, os, statistics, struct, sys
w = sys.argv[1]

def tps(m):
    s = []
    for r in (1, 2):
        s += json.load(open(f"{w}/{m}.{r}.json"))["gen_tokens_per_s"]["samples"]
    return statistics.median(s)

def params_by_bits(m):
    """Quantized parameters per bit width, from the checkpoint's qweight shapes [K*bits/32, N]."""
    cfg = json.load(open(f"{w}/{m}/config.json"))
    qc = cfg.get("quantization_config", {})
    out = {}
    for f in sorted(os.listdir(f"{w}/{m}")):
        if not f.endswith(".safetensors"):
            continue
        with open(f"{w}/{m}/{f}", "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if not name.endswith(".qweight"):
                continue
            base = name[: -len(".qweight")]
            rows, cols = t["shape"]
            scales = header[base + ".scales"]["shape"]  # [groups, N]
            # bits from the packing: K = groups * group_size for g128 models (K a multiple of 128)
            K = scales[0] * 128
            bits = rows * 32 // K
            out[bits] = out.get(bits, 0) + K * cols
    return out

speed = {m: tps(m) for m in ("u3", "u4", "u8", "mixed")}
mix = params_by_bits("mixed")
total = sum(mix.values())
pred_t = sum(n / total / speed[f"u{b}"] for b, n in mix.items())
for m, v in speed.items():
    print(f"{m:6s} {v:9.1f} tok/s")
print("mixed: " + ", ".join(f"{b}-bit {100 * n / total:.1f}%" for b, n in sorted(mix.items())) +
      " of the quantized parameters")
print(f"predicted {1 / pred_t:.1f} tok/s, measured {speed['mixed']:.1f}: "
      f"{100 * speed['mixed'] * pred_t:.1f}% of the prediction")
EOF
