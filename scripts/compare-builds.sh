#!/usr/bin/env bash
# Checks that a change changes no token: runs two builds of kestrel on the same kestrel-synth
# models (every family, FP16 and GPTQ formats, act-order, a sliding window) and compares their
# greedy text, greedy text under prompt-lookup speculation (verify passes), a prompt long enough
# for the chunked prefill, and perplexity (less its timing), byte for byte. Prints one line per
# case and exits 1 on any difference.
#   compare-builds.sh OLD_BUILD NEW_BUILD [DEVICE]    (DEVICE: cuda (default) or cpu)
# Models are written once with NEW_BUILD's kestrel-synth under ${WORK:-/tmp/compare-builds}.
set -uo pipefail
old="$1" new="$2" dev="${3:-cuda}"
work="${WORK:-/tmp/compare-builds}"
mkdir -p "$work"
synth="$new/kestrel-synth"
models=(
  "llama-fp16:--arch llama --shape tiny"
  "llama-g4:--arch llama --shape tiny --dtype gptq --bits 4 --group-size 32"
  "llama-g4-act:--arch llama --shape tiny --dtype gptq --bits 4 --group-size 32 --act-order"
  "llama-g3-asym:--arch llama --shape tiny --dtype gptq --bits 3 --group-size 64 --asym"
  "llama-g8:--arch llama --shape tiny --dtype gptq --bits 8 --group-size 128"
  "llama3-g2:--arch llama3 --shape tiny --dtype gptq --bits 2 --group-size 32"
  "mistral-win:--arch mistral --shape tiny --sliding-window 48 --dtype gptq --bits 4 --group-size 32"
  "qwen2-fp16:--arch qwen2 --shape tiny"
  "qwen3-g4:--arch qwen3 --shape tiny --dtype gptq --bits 4 --group-size 32"
  "opt-fp16:--arch opt --shape tiny"
  "opt-g4:--arch opt --shape tiny --dtype gptq --bits 4 --group-size 32"
)
text="The quick brown fox jumps over the lazy dog. "
long=""; for _ in $(seq 40); do long+="$text"; done
printf '%s' "$long" > "$work/long.txt"
printf 'one two three four five one two three four five one two three four five one two' > "$work/rep.txt"
bad=0
for m in "${models[@]}"; do
  name="${m%%:*}" args="${m#*:}"
  dir="$work/$name"
  [ -f "$dir/config.json" ] || "$synth" $args --out "$dir" --force >/dev/null 2>&1 \
    || { echo "compare-builds: $name: kestrel-synth failed"; bad=1; continue; }
  cases=(
    "greedy:generate -p Hello -n 48 --temp 0 --ignore-eos"
    "lookup:generate -f $work/rep.txt -n 48 --temp 0 --ignore-eos --spec lookup"
    "long-prompt:generate -f $work/long.txt -n 16 --temp 0 --ignore-eos"
    "sampled:generate -p Hello -n 32 --temp 0.8 --seed 7 --ignore-eos"
    "perplexity:perplexity -f $work/long.txt -c 128"
  )
  for c in "${cases[@]}"; do
    cname="${c%%:*}" cargs="${c#*:}"
    o1="$("$old/kestrel" $cargs -m "$dir" --device "$dev" 2>/dev/null)"; r1=$?
    o2="$("$new/kestrel" $cargs -m "$dir" --device "$dev" 2>/dev/null)"; r2=$?
    # perplexity's line ends with its own timing ("; 0.1 s, 8652 tokens/s)"): compare the rest
    o1="$(printf '%s' "$o1" | sed -E 's#; [0-9.]+ s, [0-9]+ tokens/s\)#)#')"
    o2="$(printf '%s' "$o2" | sed -E 's#; [0-9.]+ s, [0-9]+ tokens/s\)#)#')"
    if [ "$r1" != "$r2" ] || [ "$o1" != "$o2" ]; then
      echo "DIFF  $name $cname (exit $r1 / $r2)"; bad=1
      diff <(printf '%s\n' "$o1") <(printf '%s\n' "$o2") | head -5
    else
      echo "same  $name $cname (exit $r1, ${#o1} bytes)"
    fi
  done
done
exit $bad
