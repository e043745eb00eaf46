#!/usr/bin/env bash
# compute-sanitizer over the GPU tests and a short `kestrel generate`, on a machine with a GPU
# and a build (scripts/build.sh). Any error a tool reports, and any failing test, fails the
# script.
#   gpu-sanitize.sh [BUILD_DIR [TOOL...]]
#     BUILD_DIR  default build
#     TOOL       memcheck (with --leak-check full), racecheck, initcheck, synccheck; default all
#                four, one after the other
# Logs: BUILD_DIR/gpu-sanitize/<tool>-<run>.log; one summary line per run on stdout.
#
# The runs, each a test binary with a gtest filter (or the CLI):
#   sessions   test_decoder_cuda: GPU sessions taking turns, decode runs, the decode graphs over
#              ranges of positions, GPU-vs-CPU logits for every format
#   memory     test_decoder_cuda: GpuMemory, the test that fills the GPU on purpose and loads
#              with what is left (the constructors that throw after allocating): memcheck only
#   ops        test_ops_cuda: norms, RoPE, decode attention, argmax and top-k sampling, the
#              captured RoPE + attention graphs
#   gemm_small test_gemm_small: the fused small-M GEMM over every format and M (memcheck), its
#              launch plans and epilogues (all tools; split-K counters, the cp.async ring)
#   gemv       test_gemv_cuda: epilogues, fused parts, fused input ops, residuals, the
#              specialized kernels, launch shapes, the fp16 GEMV, and 12 of the 64 GemvFormats
#              (each width at sym g128, asym act-order g32, sym act-order per-row)
#   prefill    test_prefill_cuda: dequantize, quantized GEMM and its slices, dense rows, the
#              prefill attention, RoPE rows, NLL, chunked prefill against token-by-token decode
#   families   test_families: every family's GPU forward against transformers (or its refusal)
#   spec       test_speculative: the rows' argmax on the device, verify passes replayed from
#              CUDA graphs (the device-position forms of the embedding, RoPE and attention
#              kernels) against host-launched ones, greedy lookup on the docs model
#   quantize   test_quantize_cuda: the GPU quantizer (Hessian, GPTQ factor and solve, RTN,
#              the --mse range search, relative error, a layer's forward with taps, mixed
#              precision's measuring and quantizing passes), and test_quantize's CUDA end-to-end
#              runs
#   generate   kestrel-synth tiny GPTQ models (4-bit g128 act-order; 3-bit asymmetric g64), then
#              `kestrel generate` of a 107-token prompt (dequantize + cuBLASLt path) and 24
#              tokens (decode graphs), greedy and sampled
# racecheck, initcheck and synccheck take the smaller sets (gemv, sessions and the chunked
# prefill's formats reduced, no families) as they run slower; initcheck only the runs that read
# no cuBLASLt output (below).
#   RUNS="sessions prefill"   limits any tool to those runs
#   FILTER='gtest filter'     replaces the runs' own filters (with RUNS naming one test binary)
#   PARALLEL=1                runs a tool's runs at once (the memory run still alone, last)
#   SHARDS=N                  cuts each test binary's run into N gtest shards run at once (one
#                             log; racecheck slows the tests 50-100x, and a device call is short)
#
# racecheck reports races inside cuBLASLt's own kernels (nvjet_*), which synchronise through
# Hopper's asynchronous barriers that racecheck does not model (docs/hardening.md). A run whose
# every reported race lies in an nvjet kernel passes, its count noted; any other race fails it.
# (Leaving those kernels uninstrumented, --kernel-name-exclude kns=nvjet, makes them fault
# under the tool.)
#
# API errors are not reported by the tool (--report-api-errors no): every CUDA call's status is
# checked by the code itself (KESTREL_CUDA_CHECK fails the test), and some tests make calls fail
# on purpose (allocations past the free memory).
set -uo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
shift || true
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck synccheck)

cs="$(command -v compute-sanitizer || true)"
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -n "$cs" ] || { [ -x "$c" ] && cs="$c"; }
done
[ -n "$cs" ] || { echo "gpu-sanitize: compute-sanitizer not found" >&2; exit 1; }
"$build/kestrel" devices 2>&1 | grep -q '^cuda: ' || { echo "gpu-sanitize: no usable GPU: $("$build/kestrel" devices 2>&1 | sed -n 's/^cuda unusable: //p')" >&2; exit 1; }
for b in tests/test_decoder_cuda tests/test_ops_cuda tests/test_gemv_cuda tests/test_prefill_cuda \
         tests/test_families tests/test_gemm_small tests/test_speculative tests/test_quantize_cuda \
         tests/test_quantize kestrel kestrel-synth; do
  [ -x "$build/$b" ] || { echo "gpu-sanitize: $build/$b is not built (scripts/build.sh)" >&2; exit 1; }
done

logs="$build/gpu-sanitize"
mkdir -p "$logs"
work="$(mktemp -d "${TMPDIR:-/tmp}/kestrel-gpu-sanitize.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# The test filters.
f_sessions='GpuSessions.*:GpuDecodeRun.*:*GpuDecodeGraphs.*:*GpuVsCpu.*'
f_sessions_small='GpuSessions.*:GpuDecodeRun.*:*GpuDecodeGraphs.*/defaults:*GpuVsCpu.*/fp16:*GpuVsCpu.*/q4_g128_act:*GpuVsCpu.*/q3_g128_act:*GpuVsCpu.*/q2_g64:*GpuVsCpu.*/q8_perchannel'
f_memory='GpuMemory.*'
f_ops='*'
f_gemv_full='GemvEpilogue.*:GemvFused.*:GemvInputOps.*:GemvResidual.*:GemvSpecialized.*:GemvShapes.*:GemvPrepare.*:GemvF16.*:*GemvFormats.*/b*_g128_sym:*GemvFormats.*/b*_g32_asym_act:*GemvFormats.*/b*_grow_sym_act'
f_gemv_small='GemvEpilogue.*:GemvInputOps.*:GemvSpecialized.*:GemvShapes.LaunchShapesAgree:*GemvFormats.*/b4_g128_sym:*GemvFormats.*/b3_g64_asym_act:*GemvFormats.*/b8_grow_sym'
f_prefill='*GemmFormats.*:GemmSlices.*:DenseLinear.*:*AttnPrefill.*:RopeRows.*:Nll.*:*Prefill.*'
f_prefill_small='*GemmFormats.*:GemmSlices.*:DenseLinear.*:*AttnPrefill.*:RopeRows.*:Nll.*:PrefillChunk.*:Formats/Prefill.*/q4_g128_act:Formats/Prefill.*/q3_g128:Formats/Prefill.*/q4_g128_hd128'
f_families='*Families.Gpu*'
f_gemm_small_full='*GpuGemmSmall*:GemmSmall*.Gpu*'
f_gemm_small_small='*GpuGemmSmallPlans*:GemmSmall*.Gpu*'
f_spec='SpecCuda.*'
f_quantize='*'
f_quantize_e2e='EndToEnd.Cuda*:*CudaFamilies.*'

runs_for() {  # runs_for TOOL: the runs this tool takes
  if [ -n "${RUNS:-}" ]; then echo "$RUNS"; return; fi
  case "$1" in
    memcheck) echo "sessions memory ops gemv gemm_small prefill families spec quantize generate" ;;
    # initcheck does not see what cuBLASLt writes (its Hopper kernels store through the tensor
    # memory accelerator): every read of a GEMM's output is reported as uninitialized
    # (scripts/initcheck-cublaslt.cu shows it on a bare cuBLASLt call). So initcheck takes the
    # runs that never read one.
    initcheck) echo "ops gemv gemm_small" ;;
    *) echo "sessions ops gemv gemm_small prefill spec quantize generate" ;;
  esac
}

# The models of the generate run, written once.
models_ready=0
make_models() {
  [ $models_ready -eq 1 ] && return 0
  "$build/kestrel-synth" --shape tiny --dtype gptq --bits 4 --group-size 128 --act-order \
    --seed 11 --out "$work/q4act" --quiet || return 1
  "$build/kestrel-synth" --shape tiny --dtype gptq --bits 3 --group-size 64 --asym \
    --seed 12 --out "$work/q3asym" --quiet || return 1
  models_ready=1
}
# Each model greedy and sampled; stops at the first failure.
generate_runs() {
  make_models || return 1
  local m
  for m in q4act q3asym; do
    echo "== $m greedy"
    "$cs" "$@" "$build/kestrel" generate -m "$work/$m" --device cuda -p "$prompt" -n 24 --temp 0 \
      --ignore-eos -q || return 1
    echo "== $m sampled"
    "$cs" "$@" "$build/kestrel" generate -m "$work/$m" --device cuda -p "$prompt" -n 24 \
      --temp 0.8 --top-k 20 --seed 5 --ignore-eos -q || return 1
  done
}
# Over 64 tokens, so that it runs through dequantize + cuBLASLt, not the fused small-M GEMM.
prompt="The river runs past the mill and under the old stone bridge, where the children wait for the boats that bring the bread and the letters from the town on the hill above the valley every morning, and the miller counts the sacks of grain while the water turns the wheel and the birds sing in the trees along the bank"

deferred=()
# One tool over one run; its verdict line goes to stdout and to $work/verdicts.
one_run() {  # one_run TOOL RUN
  local tool=$1 run=$2
  local opts=(--tool "$tool" --error-exitcode 86 --report-api-errors no --print-limit 50)
  [ "$tool" = memcheck ] && opts+=(--leak-check full)
  local gemv="$f_gemv_small" sessions="$f_sessions_small" prefill="$f_prefill_small"
  local gemm_small="$f_gemm_small_small" spec="$f_spec"
  [ "$tool" = memcheck ] && { gemv="$f_gemv_full"; sessions="$f_sessions"; prefill="$f_prefill"; gemm_small="$f_gemm_small_full"; }
  if [ -n "${FILTER:-}" ]; then
    gemv="$FILTER"; sessions="$FILTER"; prefill="$FILTER"; gemm_small="$FILTER"; spec="$FILTER"
  fi
  local log="$logs/$tool-$run.log" start=$SECONDS rc
  # A test binary under the tool, into OUT (default the run's log): in SHARDS gtest shards at
  # once, their logs joined in order.
  tests_run() {  # tests_run BINARY FILTER [OUT]
    local n="${SHARDS:-1}" i r=0 st pids=()
    local out="${3:-$log}"
    if [ "$n" -le 1 ] || [ "$run" = memory ]; then
      "$cs" "${opts[@]}" "$build/tests/$1" --gtest_filter="$2" > "$out" 2>&1
      return
    fi
    for ((i = 0; i < n; i++)); do
      GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i \
        "$cs" "${opts[@]}" "$build/tests/$1" --gtest_filter="$2" > "$out.$i" 2>&1 &
      pids+=($!)
    done
    # Each shard by its pid (wait -n loses children that end together). The tool's own exit
    # code for its reports (86) yields to any other failure (a crash, a failed test).
    for i in "${pids[@]}"; do
      wait "$i"; st=$?
      if [ $st -ne 0 ] && { [ $r -eq 0 ] || [ $r -eq 86 ]; }; then r=$st; fi
    done
    for ((i = 0; i < n; i++)); do echo "== shard $i of $n"; cat "$out.$i"; rm -f "$out.$i"; done > "$out"
    return $r
  }
  # The quantizer's two binaries, one log.
  quantize_run() {
    local r1 r2
    tests_run test_quantize_cuda "$f_quantize" "$log.1"; r1=$?
    tests_run test_quantize "$f_quantize_e2e" "$log.2"; r2=$?
    cat "$log.1" "$log.2" > "$log"; rm -f "$log.1" "$log.2"
    return $((r1 != 0 ? r1 : r2))
  }
  case "$run" in
    sessions) tests_run test_decoder_cuda "$sessions" ;;
    memory)   tests_run test_decoder_cuda "$f_memory" ;;
    ops)      tests_run test_ops_cuda "$f_ops" ;;
    gemv)     tests_run test_gemv_cuda "$gemv" ;;
    gemm_small) tests_run test_gemm_small "$gemm_small" ;;
    prefill)  tests_run test_prefill_cuda "$prefill" ;;
    families) tests_run test_families "$f_families" ;;
    spec)     tests_run test_speculative "$spec" ;;
    quantize) quantize_run ;;
    generate) generate_runs "${opts[@]}" > "$log" 2>&1 ;;
  esac
  rc=$?
  # A tool's verdict: its ERROR SUMMARY lines (one per process), the gtest result lines.
  local errors tests line
  # (racecheck writes RACECHECK SUMMARY lines, "0 hazards displayed (0 errors, 0 warnings)".)
  errors="$(grep -hE '(ERROR|RACECHECK) SUMMARY' "$log" \
            | grep -vE 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards' | head -3)"
  tests="$(grep -hoE '^\[  (PASSED|FAILED)  \] [0-9]+' "$log" |
           awk '{n[$2] += $4} END {for (k in n) printf "%s %d tests; ", k, n[k]}')"
  # racecheck: hazards all in cuBLASLt's nvjet kernels are noted, not counted (above).
  local races nvjet note=""
  races=$(grep -cE '(Read|Write) access at' "$log")
  nvjet=$(grep -E '(Read|Write) access at' "$log" | grep -c 'nvjet')
  if [ "$tool" = racecheck ] && [ -n "$errors" ] && [ "$races" -gt 0 ] && [ "$races" = "$nvjet" ] &&
     ! grep -q 'Internal Sanitizer Error' "$log"; then
    errors="" note="$races race reports, all in cuBLASLt's nvjet kernels; "
    # The tool's exit code for its reports; the tests' own verdict is in the log.
    [ $rc -eq 86 ] && ! grep -qE '^\[  FAILED  \]' "$log" && rc=0
  fi
  # Every test process that started must have ended (a shard that crashed has no summary).
  local started ended
  started=$(grep -cE '^\[==========\] Running [0-9]+ tests?' "$log")
  ended=$(grep -cE '^\[==========\] [0-9]+ tests? from .* ran\.' "$log")
  [ "$started" = "$ended" ] || errors="${errors}$((started - ended)) test process(es) ended early; "
  # A filter that matches nothing, or GPU tests skipped under the tool, check nothing.
  grep -qE '^\[==========\] Running [1-9]' "$log" || [ "$run" = generate ] ||
    errors="${errors}the filter matches no test; "
  grep -qE '^\[  SKIPPED \]' "$log" && errors="${errors}tests skipped (no usable GPU under the tool?); "
  if [ $rc -ne 0 ] || [ -n "$errors" ] || ! grep -qE '(ERROR|RACECHECK) SUMMARY' "$log"; then
    line="FAIL $tool $run (exit $rc, $((SECONDS - start)) s): ${errors:-no error summary} $tests -> $log"
  else
    line="ok   $tool $run ($((SECONDS - start)) s) $note$tests"
  fi
  echo "gpu-sanitize: $line" | tee -a "$work/verdicts"
}

for tool in "${tools[@]}"; do
  case "$tool" in
    memcheck|racecheck|initcheck|synccheck) ;;
    *) echo "gpu-sanitize: unknown tool $tool (memcheck, racecheck, initcheck, synccheck)" >&2; exit 1 ;;
  esac
  for run in $(runs_for "$tool"); do
    case "$run" in
      sessions|memory|ops|gemv|gemm_small|prefill|families|spec|quantize|generate) ;;
      *) echo "gpu-sanitize: unknown run $run" >&2; exit 1 ;;
    esac
  done
done
# The synthetic models are written before any run starts, so parallel runs share them.
case " $(for t in "${tools[@]}"; do runs_for "$t"; done) " in
  *" generate "*) make_models || { echo "gpu-sanitize: kestrel-synth failed" >&2; exit 1; } ;;
esac
touch "$work/verdicts"
for tool in "${tools[@]}"; do
  for run in $(runs_for "$tool"); do
    # The memory run fills the GPU on purpose: it runs alone, after the parallel ones.
    if [ -n "${PARALLEL:-}" ] && [ "$run" != memory ]; then
      one_run "$tool" "$run" &
    else
      deferred+=("$tool $run")
    fi
  done
done
wait
for d in "${deferred[@]}"; do one_run $d; done
status=0
grep -q '^gpu-sanitize: FAIL' "$work/verdicts" && status=1
echo "gpu-sanitize: $( [ $status -eq 0 ] && echo "clean" || echo "FAILED") (logs in $logs)"
exit $status
