#!/usr/bin/env bash
# One GPU device command (<= 9 min): every stage is bounded by a share of a global deadline, and each
# writes its own file under $OUT as it goes, so a stage cut off keeps what it measured.
#
#   bash benchmarks/device_gpu.sh            # on the GPU machine, from the repository root; OUT=<folder>
#   SMOKE=1 OUT=/tmp/smoke bash benchmarks/device_gpu.sh     # here, on CPU: every stage on its tiny shapes
#
# STAGES default: issue 57's command after run 14 (docs/performance.md, "What the next GPU session runs"), in this
# order, with the time each is expected to take on an H200 (its cap in brackets):
#   env (5 s [20]);
#   tests57 (every kernel the new rows run, compiled: fused decode with int4 / KIVI, its merge, RMSNorm, weight
#   products, float16 dots on the standalone quantized kernel; 8 workers, ~85 s for its 181 tests [100; 240 in the
#   CPU smoke, interpreted: 104 s under jax 0.10.2, 183 s under the GPU machines' 0.11.2]; run 14: 153 of 154
#   passed, the one left a test whose logits amplified XLA's excess precision, since rescaled);
#   tests57_exact (tests57's quantized cases with --xla_allow_excess_precision=false; only after a tests57 that
#   named a failure, which its -v output does as each comes, cut short by its cap or not; ~40 s [90]);
#   kernel_tiles (the fused decode kernel alone, int8 then bf16, one layer's call at a time over 8 tiles at 1 x 32K,
#   int8 also over 5 reading its value codes in pairs (Tuning.gpu_int8_pairs), one of them with float16 dots
#   (Tuning.gpu_f16_dots), then the tuning's and the fastest tile at 8K and LONG: us a call, % of copy; ~125 s [140]);
#   kernel_tiles_old (bf16's tuned row of kernel_tiles on the code before the kernels selected masked logits instead
#   of zeroing non-finite keys, .old_guard staged by `bash benchmarks/stage_old.sh e3c68ae .old_guard` and carried:
#   old and new in one command; ~20 s [40]);
#   quant_blocks (the int8 closing figure on the defaults, which now give int8 the fused kernel with 128-slot
#   blocks: bf16 and int8 at 1 x 32K, and int8 at kernel_tiles' fastest tile, pairs or not, float16 dots or not; its first row is also the second-call
#   check of run 14's recompile, fixed since; ~60 s [100]);
#   graphs_today (decode_profile.py --hlo_only, today's flags: launches per step and in each layer (a second compile
#   cut to one layer), graph regions and ms per step of full and SnapKV 1024 at 1 x 32K on the defaults, ~55 s [100]);
#   graphs_flags (graphs_today's rows under +WHILE, +WHILE unrolled, CONCURRENT_REGIONS, ~35 s each [45]; item 4's
#   A/B, never reached on the defaults in runs 13-14);
#   quant_ab (int4, KIVI-2 and fp8 at 1 x 32K on the XLA path and on the fused dequantizing kernel: which other
#   storages `auto_fused_quantized` should list (int8's was run 13's 1.81x); what is left, ~100 s [240]);
#   unpack_ab (int4 and KIVI-2 codes unpacked by kvjax.pallas.gpu_unpack's inline PTX against one cvt a code, the
#   `:cvt` tile, int4's codes read as int16 pairs against bytes, the `:bytes` tile, then fp8 with float16 dots
#   against bf16, the `:f16` tile: the fused kernel alone at the tuning's
#   tile, 1 x 32K, its output against the XLA path's; what is left after quant_ab, ~60 s [85]; else first in the
#   second command);
#   verdict (decode_bars.py: each closing figure against its bar, bars.md; decode_choices.py: the kernels, tiles,
#   command buffers and quantized storages the rows choose, choices.md; 2 s).
# Expected ~540 s of the 540 s deadline (TOTAL_S) when tests57 passes; quant_ab takes what is left (fp8, last, may
# not fit), and unpack_ab what quant_ab leaves.
# Run 14's second-call stage alone: STAGES=second_call (a fresh process per XLA_FLAGS variant).
# Run 14's command (every closing figure; all met, the int8 speed-up by 2-3%):
#   STAGES="env tests57 tests57_exact bars bars_old quant57 quant_blocks graphs_profile graphs_today verdict graphs_flags"
#   GRAPH_TODAY_TUNINGS=";$XLA_PATH,$AB_BEST", QUANT_BLOCK_TUNINGS="$FUSED_QUANT;$FUSED_QUANT,gpu_decode_block_k=128;
#   ..." (run 14's tiles: the plain and quantized kernels shared gpu_decode_block_k then; a quantized cache's block is
#   gpu_quantized_block_k since); bars (the XLA path (XLA_PATH) against the defaults row by row in one process: 1 x 32K full and
# SnapKV 1024 with their 32K prefill, 1 x LONG full, 16 x 8K full, 1 x 32K StreamingLLM 1024, ~175 s [210]);
# bars_old (1 x 32K full and its prefill on main before issue 57, .old57 carried, 40 s [50]); quant57 (bf16 / KIVI-2
# / int8 on the fused kernel, FUSED_QUANT, 1 x 32K and the largest batch at 32K, 100 s [110]); quant_blocks (bf16
# and int8 at 1 x 32K on the fused kernel: 64- and 128-slot blocks, three stages, twice the programs, ~80 s [100]);
# graphs_profile (run 11's profile of `full` at 1 x 32K again on the defaults, command buffers on under the
# profiler, 40 s [60]).
# The second command, with the machine still warm (STAGES="weight_products fused_decode xla_flags verdict gpu_compile"
# TOTAL_S=<seconds left - 40>): weight_products (item 5: each weight product of the 8B layer and the LM head alone at
# 1 and 16 rows, XLA's against the weight-product kernel at PRODUCT_TILES, as a fraction of copy, ~115 s [135]); fused_decode
# (the runtime's decode with the fused kernel forced on against off, bf16 and int8 caches at 1 x 32K, plus the
# kernel in the script's own loop for its logits against XLA, ~130 s [150]); xla_flags (the command-buffer
# variants' effective XLA options, 10 s [45]); gpu_compile (launches per step compiled for this GPU and
# compile-only for an H200 [50 each]).
# Others of issue 57: quant_long (item 6 whole: bf16 / int8 / int4 / KIVI-2, alone and with SnapKV 1024, 1 x and
# the largest batch at 32K and LONG, ~6 min alone); graphs_streaming (StreamingLLM 1024 at 1 x 32K on the XLA path,
# KERNELS_12 and KERNELS_6, launches and ms per step, ~30 s [45]); tests_linear (the weight-product kernel's tests
# alone, ~40 s [60]); split_k_ab (full and SnapKV without split-K GEMMs, XLA path and fused kernel, ~45 s [60]);
# graphs_ab (graphs_today then graphs_flags).
# The earlier commands' stages: kernels (copy bandwidth, kernels compiled vs XLA, the dense
# kernel's knobs, prefill attention XLA vs cuDNN); tests (the GPU kernel tests, compiled); e2e_32k (8B-shaped
# end to end, every method); e2e_128k (the same at LONG tokens); e2e_32k_pallas (the decode kernel inside
# the model). Also: e2e_32k_flags (full and StreamingLLM at 32K under E2E_XLA_FLAGS,
# default dynamic-slice fusion on, against e2e_32k of the same command); vs_kvpress (kvjax against kvpress on
# the GPU, a random Llama-3.2-1B-shaped bf16 model; kvpress and the transformers it pins are carried as wheels
# in .whl/ and installed into KVPRESS_SITE, see benchmarks/README.md); layer_slicing (layer_slicing.py: the
# stacked-layer loop laid out four ways, HLO texts in $OUT/hlo.tgz); e2e_32k_masked (one-shot prefills through
# the per-block masked cuDNN path). (e2e_32k_unroll went with the stacked layout: the decode step is unrolled.)
# vs_kvpress_masked: vs_kvpress with --masked_prefill (the per-block path, the GPU default before run 6),
# written to vs_kvpress_gpu_masked.json.
# suite (not in the default list): the test suite under JAX_PLATFORMS=cuda, `pytest -v -n 6` so a failure
# is named the moment it happens and a time bound loses none; SUITE_PATHS picks test paths (default tests),
# SUITE_S bounds it (default 400 s); wheels in .whl_suite/ (ml-collections, gguf: kvjax needs them and the
# GPU image lacks them) are installed into /tmp/kvjax_suite_site first.
# Per-layer layout (issue 43), one command: layout_new (throughput.py --plan: 1 x 32K full / snapkv / streaming_llm
# at budget 1024 with a timed prefill, 16 x 8K, 1 x LONG, the largest batch at 32K); layout_old (the stacked code of
# 257fc3f, unpacked by `benchmarks/stage_old.sh` into .old/ and carried: accelerator.py e2e of full / snapkv at 32K,
# today's default decode); retrieval (accelerator.py e2e at 32K: full, quest, infllm, actqkv); hf (transformers'
# generate, throughput.py --hf); gpu_tests (tests/ops + tests/pallas compiled under cuda).
# E2E_METHODS narrows e2e_32k; VS_ARGS adds vs_kvpress flags; KERNEL_ARGS adds accelerator.py flags to kernels.
# engine (not in the default list): benchmarks/engine.py --gpu, the engine against static batching (issue 56).
# TOTAL_S bounds the whole command.
set -u
# The device tool brings back at most 8 files from $OUT: the stages write into a folder beside it, packed after each
# stage into $OUT/results.tgz, with log.txt, bars.md and choices.md copied out to read at once.
RETURN=${OUT:-/tmp/kvjax_device}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/kvjax_stages.XXXXXX")
mkdir -p "$RETURN"
pack() {
  tar czf "$RETURN/results.tgz" -C "$OUT" .
  for f in log.txt bars.md choices.md; do
    if [[ -f $OUT/$f ]]; then cp "$OUT/$f" "$RETURN/"; fi  # a run without `verdict` has no bars.md: not a failure
  done
}
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 KVJAX_COMPILATION_CACHE_DIR=off
PY=${PY:-python3}
SMOKE_FLAG=${SMOKE:+--smoke}  # SMOKE=1: every benchmark stage on its tiny CPU shapes (checks the plumbing here)
DEADLINE=$(( $(date +%s) + ${TOTAL_S:-540} ))
pick() { if [[ -n ${SMOKE:-} ]]; then echo "$2"; else echo "$1"; fi; }  # pick GPU_VALUE SMOKE_VALUE
left() { echo $(( DEADLINE - $(date +%s) )); }
# stage NAME MAX_SECONDS CMD...: runs CMD for at most min(MAX_SECONDS, time left), logging to $OUT/log.txt.
stage() {
  local name=$1 max=$2; shift 2
  local t; t=$(left); (( t > max )) && t=$max
  if (( t < 20 )); then echo "== $name: skipped, ${t}s left" | tee -a "$OUT/log.txt"; return; fi
  echo "== $name (<= ${t}s) $(date +%T)" | tee -a "$OUT/log.txt"
  timeout --signal=KILL "$t" "$@" 2>&1 | grep -v "DeprecationWarning\|warnings.warn" | tee -a "$OUT/log.txt"
  local rc=${PIPESTATUS[0]}
  printf -v "rc_$name" %s "$rc"  # rc_<stage>, for a later stage that depends on it
  echo "== $name: rc $rc at $(date +%T)" | tee -a "$OUT/log.txt"
  pack
}

# flags_of VARIANT [FLAG...]: xla_flags.py's flags of VARIANT and the FLAGs, blank-free (XLA reads a value that does
# not start with "--", even " ", as a file name and aborts: today's variant adds no flag).
flags_of() { local v=$1; shift; echo $($PY benchmarks/xla_flags.py --print=$v) "$@"; }

# install_wheels DIR TARGET: the carried wheels in DIR (no index, no dependencies) into TARGET.
install_wheels() {
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl 2>&1 \
    | tail -3 | tee -a "$OUT/log.txt"
}

STAGES=${STAGES:-env tests57 tests57_exact kernel_tiles kernel_tiles_old quant_blocks graphs_today graphs_flags quant_ab unpack_ab verdict}
LONG=${LONG:-129024}
# The A/B stages' variants: kvjax.tuning fields (`;` between variants, "" = the defaults), and the combination
# the later stages compare with the defaults.
# Run 12 measured the dots / slot_write knobs (BENCHMARKS.md). Its `loop_pad_fusion` is the slot axis padded for
# the split-K `p V` dot (benchmarks/gpu_compile.py, XLA:GPU's compile for an H200 on a CPU: every KV head's V copied
# at 33,024 slots per layer at 1 x 32K); cache_slot_multiple=256 removes it there, 128 does not.
AB_DEFAULT=";cache_slot_multiple=256;auto_pallas=decode_attention+block_sparse_decode_attention"
AB_BEST=${AB_BEST:-cache_slot_multiple=256}
# The XLA path: the GPU's default until run 13 put the fused decode and RMSNorm kernels in it (kvjax.tuning).
XLA_PATH="auto_pallas=block_sparse_decode_attention"
# The fused decode kernel with the RMSNorm kernel (the GPU's default since run 13): 12 launches per layer in the
# compile for an H200 (BENCHMARKS.md).
KERNELS_12="auto_pallas=block_sparse_decode_attention+decode_append_attention+rms_norm"
# With the weight-product kernel too (kvjax.pallas.gpu_linear: the norms, the activation product and the residual adds
# fused into the products, the decode kernel reading the q|k|v projection as it is): 6 per layer compiled.
KERNELS_6="$KERNELS_12+linear"
# the quantized caches on the fused decode kernel, which dequantizes int8 / int4 / KIVI in place (bf16 takes it too)
FUSED_QUANT="auto_pallas=decode_attention+block_sparse_decode_attention+decode_append_attention,auto_fused_quantized=true"
for name in $STAGES; do
  case $name in
  env) stage env 20 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv;
    $PY -c 'import sys, jax, jaxlib, flax; print(sys.version.split()[0], jax.__version__, jaxlib.__version__, flax.__version__, jax.devices())'" ;;
  kernels) stage kernels 150 $PY benchmarks/accelerator.py --parts=${KERNEL_PARTS:-bandwidth,kernels,tune,prefill} \
    ${KERNEL_ARGS:-} --out="$OUT/accelerator_kernels.json" ;;
  tests) stage tests 70 env JAX_PLATFORMS=cuda XLA_FLAGS=--xla_backend_optimization_level=2 \
    $PY -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/pallas/test_pallas_gpu_attention.py ;;
  e2e_32k) stage e2e_32k 220 $PY benchmarks/accelerator.py --parts=e2e --isolate=no --contexts=32768 \
    ${E2E_METHODS:+--methods=$E2E_METHODS} --time_budget_s=170 --out="$OUT/accelerator_e2e_32k.json" ;;
  e2e_128k) stage e2e_128k 400 $PY benchmarks/accelerator.py --parts=e2e --isolate=no --contexts=$LONG \
    --prefill_repeats=0 --e2e_repeats=3 --methods=${LONG_METHODS:-full,snapkv,streaming_llm,lagkv,sagekv,ahakv,actqkv} \
    --time_budget_s=$(( $(left) - ${LONG_RESERVE_S:-60} )) --out="$OUT/accelerator_e2e_128k.json" ;;
  e2e_32k_pallas) stage e2e_32k_pallas 90 $PY benchmarks/accelerator.py --parts=e2e --isolate=no --contexts=32768 \
    --attention=pallas --methods=full,snapkv,streaming_llm --time_budget_s=40 \
    --out="$OUT/accelerator_e2e_32k_pallas.json" ;;
  e2e_32k_flags) stage e2e_32k_flags 120 env XLA_FLAGS="${E2E_XLA_FLAGS:---xla_gpu_enable_dynamic_slice_fusion=true}" \
    $PY benchmarks/accelerator.py --parts=e2e --isolate=no --contexts=32768 --methods=full,streaming_llm \
    --time_budget_s=60 --out="$OUT/accelerator_e2e_32k_flags.json" ;;
  layer_slicing) stage layer_slicing 200 $PY benchmarks/layer_slicing.py --hlo_dir=/tmp/kvjax_hlo \
    ${SLICING_ARGS:-} --out="$OUT/layer_slicing.json"; tar czf "$OUT/hlo.tgz" -C /tmp/kvjax_hlo . 2>/dev/null ;;
  e2e_32k_masked) stage e2e_32k_masked 120 $PY benchmarks/accelerator.py --parts=e2e --isolate=no --contexts=32768 \
    --masked_prefill --methods=${MASKED_METHODS:-full,snapkv} --time_budget_s=60 \
    --out="$OUT/accelerator_e2e_32k_masked.json" ;;
  suite)
    if compgen -G ".whl_suite/*.whl" > /dev/null; then install_wheels .whl_suite /tmp/kvjax_suite_site; fi
    stage suite ${SUITE_S:-400} env PYTHONPATH=$PYTHONPATH:/tmp/kvjax_suite_site JAX_PLATFORMS=cuda \
      XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -v -p no:cacheprovider -p no:benchmark \
      -W ignore::DeprecationWarning -n 6 ${SUITE_PATHS:-tests} ;;
  vs_kvpress|vs_kvpress_masked)
    KVPRESS_SITE=${KVPRESS_SITE:-/tmp/kvpress_site}
    [[ $name == vs_kvpress_masked ]] && masked=--masked_prefill || masked=
    [[ -d $KVPRESS_SITE/kvpress ]] || install_wheels .whl "$KVPRESS_SITE"
    stage $name 300 $PY benchmarks/vs_kvpress.py --device=gpu --shape=llama-3.2-1b --dtype=bfloat16 \
      --kvpress_python=$PY --kvpress_path="$KVPRESS_SITE" --contexts=${VS_CONTEXTS:-4096,8192,1024} \
      --methods=${VS_METHODS:-full,snapkv_0.5,streaming_llm_0.75,knorm_0.5,lagkv_0.5} --repeats=3 \
      --time_budget_s=${VS_BUDGET_S:-200} $masked ${VS_ARGS:-} --out="$OUT/${name/vs_kvpress/vs_kvpress_gpu}.json" ;;
  layout_new) stage layout_new ${LAYOUT_S:-200} $PY benchmarks/throughput.py $SMOKE_FLAG --time_budget_s=$(( ${LAYOUT_S:-200} - 35 )) \
    --plan="${LAYOUT_PLAN:-1x32768p:full,snapkv@1024,streaming_llm@1024;16x8192:full;1x$LONG:full;maxx32768:full,snapkv@1024}" \
    --new_tokens=${NEW_TOKENS:-32} --repeats=2 --out="$OUT/throughput_new.json" ;;
  layout_old) stage layout_old ${OLD_S:-70} env PYTHONPATH=$PWD/.old:$PWD/.old/benchmarks $PY .old/benchmarks/accelerator.py \
    $SMOKE_FLAG --parts=e2e --isolate=no --contexts=${OLD_CONTEXTS:-32768} --methods=full,snapkv --new_tokens=33 \
    --e2e_repeats=2 --prefill_repeats=1 --time_budget_s=$(( ${OLD_S:-70} - 30 )) --out="$OUT/accelerator_old_32k.json" ;;
  retrieval) stage retrieval ${RETRIEVAL_S:-100} $PY benchmarks/accelerator.py $SMOKE_FLAG --parts=e2e --isolate=no \
    --contexts=${RETRIEVAL_CONTEXTS:-32768} --methods=${RETRIEVAL_METHODS:-full,quest,infllm,actqkv} --new_tokens=33 \
    --e2e_repeats=2 --prefill_repeats=0 --time_budget_s=$(( ${RETRIEVAL_S:-100} - 35 )) \
    --out="$OUT/accelerator_retrieval_32k.json" ;;
  hf) stage hf ${HF_S:-55} $PY benchmarks/throughput.py $SMOKE_FLAG --hf --contexts=${HF_CONTEXTS:-32768} \
    --batches=${HF_BATCHES:-1} --new_tokens=16 --out="$OUT/throughput_hf.json" ;;
  ab_decode)  # the decode step's fixed costs (BENCHMARKS.md, "The per-layer layout on an H200"): tunings A/B, one process
    stage ab_decode ${AB_S:-170} $PY benchmarks/throughput.py $SMOKE_FLAG --tunings="${AB_TUNINGS:-$AB_DEFAULT}" \
      --plan="${AB_PLAN:-1x32768:full,snapkv@1024,streaming_llm@1024}" --new_tokens=${NEW_TOKENS:-32} --repeats=2 \
      --time_budget_s=$(( ${AB_S:-170} - 25 )) --out="$OUT/ab_decode.json" ;;
  ab_long)  # the other bars' shapes, defaults against AB_BEST
    stage ab_long ${AB_LONG_S:-130} $PY benchmarks/throughput.py $SMOKE_FLAG --tunings=";$AB_BEST" \
      --plan="${AB_LONG_PLAN:-1x32768:streaming_llm@1024;16x8192:full;1x$LONG:full}" --new_tokens=${NEW_TOKENS:-32} \
      --repeats=2 --time_budget_s=$(( ${AB_LONG_S:-130} - 25 )) --out="$OUT/ab_long.json" ;;
  ab_gemm)  # XLA's cuBLAS GEMV instead of its Triton GEMM fusions for the weights' dots, defaults and AB_BEST
    stage ab_gemm ${AB_GEMM_S:-90} env XLA_FLAGS="${GEMM_XLA_FLAGS:---xla_gpu_enable_triton_gemm=false}" \
      $PY benchmarks/throughput.py $SMOKE_FLAG --tunings=";$AB_BEST" --plan="${AB_PLAN:-1x32768:full,snapkv@1024}" \
      --new_tokens=${NEW_TOKENS:-32} --repeats=2 --time_budget_s=$(( ${AB_GEMM_S:-90} - 25 )) --out="$OUT/ab_gemm.json" ;;
  ab_profile)  # where the step's time goes under AB_BEST
    stage ab_profile ${AB_PROFILE_S:-70} $PY benchmarks/decode_profile.py $SMOKE_FLAG --methods=full,snapkv \
      --tuning="$AB_BEST" --out="$OUT/ab_profile.json" ;;
  compile) stage compile ${COMPILE_S:-120} $PY benchmarks/compile_8b.py $SMOKE_FLAG --methods=${COMPILE_METHODS:-full,snapkv} \
    --out="$OUT/compile_8b.json" ;;
  engine)  # continuous batching against static batching (benchmarks/engine.py): 8B shape bf16, long generations
    # (answers 16-16K; full, decoding@1024, decoding@1024 over int8) and long prompts (4K-32K); ENGINE_WORKLOADS /
    # ENGINE_METHODS split it over several commands (every row is written as it ends)
    stage engine ${ENGINE_S:-540} $PY benchmarks/engine.py $SMOKE_FLAG --gpu \
      --workloads=${ENGINE_WORKLOADS:-long_generations,long_prompts} --methods=${ENGINE_METHODS:-full,decoding,decoding:int8} \
      ${ENGINE_ARGS:-} --time_budget_s=$(( ${ENGINE_S:-540} - 60 )) --out="$OUT/engine_gpu.json" ;;
  gpu_tests) stage gpu_tests ${GPU_TESTS_S:-60} env JAX_PLATFORMS=${TEST_PLATFORM:-cuda} XLA_PYTHON_CLIENT_PREALLOCATE=false \
    $PY -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -n ${TEST_WORKERS:-8} \
    ${GPU_TEST_PATHS:-tests/pallas/test_pallas_gpu_attention.py} ;;
  xla_flags) stage xla_flags ${XLA_FLAGS_S:-$(pick 45 300)} $PY benchmarks/xla_flags.py --out="$OUT/xla_flags.json" ;;
  tests57)  # every kernel the bars' new rows run, compiled: fused decode, its merge, RMSNorm, weight products
    stage tests57 ${TESTS57_S:-$(pick 100 240)} env JAX_PLATFORMS=$(pick cuda cpu) XLA_PYTHON_CLIENT_PREALLOCATE=false \
    $PY -m pytest -v -rfE -p no:cacheprovider -W ignore::DeprecationWarning -n ${TEST_WORKERS:-8} ${TESTS57_PATHS:-tests/pallas/test_pallas_gpu_fused_decode.py tests/pallas/test_pallas_gpu_dot_sizes.py tests/pallas/test_pallas_gpu_attention.py::test_split_merge_kernel_equals_the_xla_merge tests/pallas/test_pallas_gpu_norm.py tests/pallas/test_pallas_gpu_linear.py tests/pallas/test_pallas_gpu_quantized.py::test_8bit_codes_attended_with_float16_dots} ;;
  tests57_exact)  # tests57's quantized cases with XLA:GPU's excess precision off: run 13's one-code-off failures
    # (int8 / fp8 / int4 codes) are XLA folding a bf16 convert and back into the float32 value inside a fusion
    # (its SimplifyFPConversions, seen in the H200 compile of `kvjax.quant.codes.asymmetric`); they pass here if so.
    # Only after a tests57 that named a failure (-v names each result as it comes, so a tests57 cut short by its cap
    # still does): skipped when it passed, and when it ran out of time with none (its remaining cases would again).
    if ! sed -n '/^== tests57 (/,/^== tests57: rc/p' "$OUT/log.txt" | grep -qE '(^|\] )(FAILED|ERROR) '; then
      echo "== tests57_exact: skipped, tests57 (rc ${rc_tests57:-none}) named no failure" | tee -a "$OUT/log.txt"
      continue
    fi
    stage tests57_exact ${TESTS57_S:-$(pick 90 150)} env JAX_PLATFORMS=$(pick cuda cpu) XLA_PYTHON_CLIENT_PREALLOCATE=false \
    XLA_FLAGS="--xla_allow_excess_precision=false ${XLA_FLAGS:-}" $PY -m pytest -q -rfE -p no:cacheprovider \
    -W ignore::DeprecationWarning -n ${TEST_WORKERS:-8} -k "quant or int4 or int8 or fp8 or kivi" \
    tests/pallas/test_pallas_gpu_fused_decode.py ;;
  tests_linear) stage tests_linear ${TESTS_LINEAR_S:-60} env JAX_PLATFORMS=$(pick cuda cpu) \
    XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    tests/pallas/test_pallas_gpu_linear.py ;;
  weight_products)  # each weight product alone, XLA's against the linear kernel's tiles, as a fraction of copy
    stage weight_products ${PRODUCTS_S:-135} $PY benchmarks/weight_products.py $SMOKE_FLAG --rows=${PRODUCT_ROWS:-1,16} \
      --tiles=${PRODUCT_TILES:-32:256:4:3,64:128:4:3,16:512:4:4} --time_budget_s=$(( ${PRODUCTS_S:-135} - 20 )) \
      --out="$OUT/weight_products.json" ;;
  fused_decode) stage fused_decode ${FUSED_S:-150} $PY benchmarks/fused_decode.py ${SMOKE:+--quick} \
    --contexts=${FUSED_CONTEXTS:-$(pick 32768 64)} --kv_dtypes=${FUSED_DTYPES:-model,int8} \
    --impls=${FUSED_IMPLS:-runtime,runtime_pallas,pallas} \
    --time_budget_s=$(( ${FUSED_S:-150} - 35 )) --out="$OUT/fused_decode.json" ;;
  graphs_today|graphs_flags|graphs_ab)  # decode_profile.py --hlo_only (launches, graph regions, ms per step) at 1 x 32K,
    # one process per XLA_FLAGS variant (flags are read once per process). graphs_today: today's flags on the defaults
    # (GRAPH_TODAY_TUNINGS, `;` between variants, empty = the defaults; with the one-layer compile that splits a step's
    # launches into each layer's and the rest, the "<= 12 per layer" bar's figure; run 14 added the XLA path with
    # cache_slot_multiple=256, ";$XLA_PATH,$AB_BEST": run 12's padded copy of V gone); graphs_flags: +WHILE, +WHILE unrolled,
    # CONCURRENT_REGIONS (GRAPH_VARIANTS) on the defaults (GRAPH_FLAGS_TUNINGS); graphs_ab: both
    case $name in graphs_today) variants=today ;; graphs_flags) variants=${GRAPH_VARIANTS:-while while_unroll concurrent} ;;
      *) variants="today ${GRAPH_VARIANTS:-while while_unroll concurrent}" ;; esac
    for v in $variants; do
      [[ $v == today ]] && tunings="${GRAPH_TODAY_TUNINGS-}" \
        || tunings="${GRAPH_FLAGS_TUNINGS-}"
      stage graphs_$v $([[ $v == today ]] && echo ${GRAPH_TODAY_S:-100} || echo ${GRAPH_S:-45}) \
        env XLA_FLAGS="$(flags_of $v ${XLA_FLAGS:-})" \
        $PY benchmarks/decode_profile.py $SMOKE_FLAG --hlo_only $([[ $v == today ]] || echo --no_shallow) \
        --methods=${GRAPH_METHODS:-full,snapkv} --tunings="$tunings" --new_tokens=33 --repeats=2 \
        --out="$OUT/graphs_$v.json"
    done ;;
  bars)  # issue 57's closing figures: the XLA path against the defaults (BARS_TUNINGS), row by row in
    # one process on the same weights, the furthest bars first (128K needs +50% over run 12): 1 x 32K full and
    # SnapKV 1024 with a timed prefill, 1 x LONG full, 16 x 8K full, 1 x 32K StreamingLLM 1024; a planned row
    # starts only with 45 s left for both variants
    stage bars ${BARS_S:-210} $PY benchmarks/throughput.py $SMOKE_FLAG --tunings="${BARS_TUNINGS-$XLA_PATH;}" \
      --plan="${BARS_PLAN:-$(pick "1x32768p:full,snapkv@1024;1x$LONG:full;16x8192:full;1x32768:streaming_llm@1024" \
        "1x64p:full,snapkv@16;1x128:full;4x64:full;1x64:streaming_llm@16")}" --new_tokens=33 --repeats=2 \
      --time_budget_s=$(( ${BARS_S:-210} - 45 )) --out="$OUT/bars.json" ;;
  bars_old)  # the "today" of the bars: main before issue 57 (b00e9b7), unpacked by `benchmarks/stage_old.sh b00e9b7
    # .old57` and carried; 1 x 32K full with its prefill, the reference of "prefill within 10% of today"
    if [[ ! -d .old57/kvjax ]]; then echo "== bars_old: skipped, no .old57 (stage_old.sh b00e9b7 .old57, then carry it)" \
      | tee -a "$OUT/log.txt"; continue; fi
    stage bars_old ${BARS_OLD_S:-50} env PYTHONPATH=$PWD/.old57:$PWD/.old57/benchmarks $PY .old57/benchmarks/throughput.py \
      $SMOKE_FLAG --plan="${BARS_OLD_PLAN:-$(pick 1x32768p:full 1x64p:full)}" --new_tokens=33 --repeats=2 \
      --out="$OUT/bars_old.json" ;;
  verdict)  # the closing figures against their bars, from this folder's JSON (benchmarks/decode_bars.py: bars.md),
    # and what they choose by docs/performance.md's rules (decode_choices.py: choices.md)
    $PY benchmarks/decode_bars.py $SMOKE_FLAG "$OUT" 2>&1 | tee -a "$OUT/log.txt"
    $PY benchmarks/decode_choices.py "$OUT" 2>&1 | tee "$OUT/choices.md" | tee -a "$OUT/log.txt"; pack ;;
  graphs_streaming)  # StreamingLLM 1024 (evicts in place) at 1 x 32K: the XLA path against the fused one, 9 launches
    # per layer compiled (its eviction decided before the fused kernel writes the token into the evicted slot)
    stage graphs_streaming ${STREAMING_S:-45} $PY benchmarks/decode_profile.py $SMOKE_FLAG --hlo_only --no_shallow \
      --methods=streaming_llm --tunings="$XLA_PATH;$KERNELS_12;$KERNELS_6" --new_tokens=33 --repeats=2 \
      --out="$OUT/graphs_streaming.json" ;;
  graphs_profile)  # run 11's profile again, graphs on under the profiler: where a step's time goes on the path
    # with every kernel (PROFILE_TUNINGS; `;` adds variants, an empty one is the defaults)
    stage graphs_profile ${PROFILE_S:-60} env XLA_FLAGS="$(flags_of profile ${PROFILE_XLA_FLAGS:-} ${XLA_FLAGS:-})" \
    $PY benchmarks/decode_profile.py $SMOKE_FLAG --methods=${PROFILE_METHODS:-full} --new_tokens=9 \
    --tunings="${PROFILE_TUNINGS-}" --out="$OUT/graphs_profile.json" ;;
  quant57) stage quant57 ${QUANT_S:-110} $PY benchmarks/throughput.py $SMOKE_FLAG --kv_dtypes=${QUANT_DTYPES:-model,kivi2,int8} \
    --tunings="${QUANT_TUNING:-$FUSED_QUANT}" \
    --plan="${QUANT_PLAN:-$(pick "1x32768:full;maxx32768:full" "1x64:full;maxx64:full")}" --new_tokens=17 --repeats=2 \
    --time_budget_s=$(( ${QUANT_S:-110} - 25 )) --out="$OUT/quant_cache.json" ;;
  split_k_ab)  # GEMMs without split-K (xla_flags.py's no_split_k): the fused path's residual adds fold into the GEMMs
    # (12 launches per layer compiled for an H200, 14 with split-K); against graphs_today and fused_decode's rows
    stage split_k_ab ${SPLIT_K_S:-60} env XLA_FLAGS="$(flags_of no_split_k ${XLA_FLAGS:-})" \
      $PY benchmarks/decode_profile.py $SMOKE_FLAG --hlo_only --no_shallow --methods=${GRAPH_METHODS:-full,snapkv} \
      --tunings="$XLA_PATH;auto_pallas=decode_append_attention+block_sparse_decode_attention;$KERNELS_12" --new_tokens=33 \
      --repeats=2 --out="$OUT/split_k_ab.json" ;;
  gpu_compile)  # the launches per step XLA:GPU compiles, for this GPU (autotuned) and compile-only for an H200
    # (benchmarks/gpu_compile.py: the compile-only counts are what a CPU machine measures; this checks them)
    for target in $(pick "attached h200" h200); do
      # here (SMOKE) jax must not try the CUDA plugin as a backend: it serves the compile-only device only
      stage gpu_compile_$target ${GPU_COMPILE_S:-50} env ${SMOKE:+JAX_PLATFORMS=cpu} $PY benchmarks/gpu_compile.py \
        $SMOKE_FLAG --target=$target \
        --methods=${GPU_COMPILE_METHODS:-full,snapkv} \
        --tunings="$XLA_PATH;$XLA_PATH,cache_slot_multiple=256;$XLA_PATH,cache_slot_multiple=1024;auto_pallas=decode_append_attention+block_sparse_decode_attention;$KERNELS_12;$KERNELS_6" \
        --out="$OUT/gpu_compile_$target.json"
    done ;;
  kernel_tiles)  # the fused decode kernel alone, one layer's call at a time (benchmarks/fused_kernel_tiles.py): int8
    # and bf16 at 1 x 32K over TILES (block_k:warps:stages:programs), then the tuning's and the fastest tile at 8K and
    # LONG, as a fraction of copy (item 5's attention). Run 14's int8 step gained 2% from 64- to 128-slot blocks: a
    # loop step of the kernel costs about as long whatever its block holds; which tile streams int8 fastest? The
    # `:pairs` tiles read int8's value codes as int16 pairs (compiled for an H200: no byte loads, 6% fewer loop
    # instructions at 128 slots, 127 registers at 64: four programs an SM, one wave at 528 programs); `:pairs:f16`
    # with float16 dots too (an exact int8 -> f16 by a sign flip and a byte permute: 18% fewer loop instructions)
    stage kernel_tiles ${KERNEL_TILES_S:-140} $PY benchmarks/fused_kernel_tiles.py $SMOKE_FLAG \
      --kv_dtypes=${KERNEL_TILES_DTYPES:-int8,model} --contexts=$(pick 8192,32768,$LONG 48,64) \
      ${SMOKE:+--tiles=16:4:2:4,16:4:2:4:pairs,16:4:2:4:pairs:f16} --time_budget_s=$(( ${KERNEL_TILES_S:-140} - 15 )) --out="$OUT/fused_kernel_tiles.json" ;;
  kernel_tiles_old)  # the same kernel alone on the code before its masked-logit select (e3c68ae: K zeroed where not
    # finite, 929 PTX instructions a loop step against 656), unpacked by `benchmarks/stage_old.sh e3c68ae .old_guard`
    # and carried: bf16 at 1 x 32K at the tuning's tile, against kernel_tiles' first bf16 row
    if [[ ! -d .old_guard/kvjax ]]; then echo "== kernel_tiles_old: skipped, no .old_guard (stage_old.sh e3c68ae \
.old_guard, then carry it)" | tee -a "$OUT/log.txt"; continue; fi
    stage kernel_tiles_old ${KERNEL_TILES_OLD_S:-40} env PYTHONPATH=$PWD/.old_guard:$PWD/.old_guard/benchmarks \
      $PY .old_guard/benchmarks/fused_kernel_tiles.py $SMOKE_FLAG --kv_dtypes=model --tiles=$(pick 64:4:2:256 16:4:2:4) \
      --contexts=$(pick 32768 64) --time_budget_s=$(( ${KERNEL_TILES_OLD_S:-40} - 15 )) \
      --out="$OUT/fused_kernel_tiles_old.json" ;;
  unpack_ab)  # kvjax.pallas.gpu_unpack (Tuning.gpu_unpack_asm, on): int4 / KIVI-2 codes into bf16 by a byte permute,
    # a mask into the mantissa of 128 and one packed fma per two codes, against one cvt a code (`:cvt`, the asm off;
    # compiled for an H200 the int4 loop loses its 256 I2F a thread): the fused kernel alone at the quantized tile
    # (the GPU's 128:4:2:256; the CPU's in the smoke), 1 x 32K; its output against the XLA path's
    # (decode_choices.py: the assembly stays if right and no slower on both). Then fp8 at the same tile with
    # float16 dots (`:f16`, Tuning.gpu_f16_dots: e4m3 -> f16 is one cvt for two codes, 23% fewer loop instructions).
    # int4 also a byte at a time (`:bytes`, Tuning.gpu_int4_pairs=False; read as int16 pairs, its loop has 24% fewer
    # instructions and no register moves; decode_choices.py: the pairs stay if right and no slower)
    stage unpack_ab ${UNPACK_AB_S:-85} $PY benchmarks/fused_kernel_tiles.py $SMOKE_FLAG --kv_dtypes=int4,kivi2,fp8 \
      --tiles=$(pick 128:4:2:256:cvt,128:4:2:256:bytes,128:4:2:256:f16 64:4:2:256:cvt,64:4:2:256:bytes,64:4:2:256:f16) \
      --contexts=$(pick 32768 64) \
      --time_budget_s=$(( ${UNPACK_AB_S:-85} - 15 )) --out="$OUT/fused_kernel_tiles_unpack.json" ;;
  quant_blocks)  # the closing figure on the defaults: bf16 and int8 at 1 x 32K `full`, both on the fused kernel since
    # the GPU's tuning lists int8 (run 14: 128-slot blocks 1.02x bf16's step), then int8 at kernel_tiles' fastest
    # tile (bf16 under the same tuning text, which names only quantized-cache fields: a second bf16 row on the
    # defaults, the spread of the pair's reference). The first row (bf16, defaults)
    # of this fresh process is also run 14's second-call check (decode_second_s, second_call_compiles)
    best=$([[ -f $OUT/fused_kernel_tiles.json ]] && $PY benchmarks/fused_kernel_tiles.py --print_best int8 \
      "$OUT/fused_kernel_tiles.json")
    stage quant_blocks ${QUANT_BLOCKS_S:-100} $PY benchmarks/throughput.py $SMOKE_FLAG --kv_dtypes=model,int8 \
      --tunings="${QUANT_BLOCK_TUNINGS:-${best:+;$best}}" \
      --plan="$(pick 1x32768:full 1x64:full)" --new_tokens=33 --repeats=2 \
      --time_budget_s=$(( ${QUANT_BLOCKS_S:-100} - 20 )) --out="$OUT/quant_blocks.json" ;;
  second_call)  # run 14: the second call of the first fused-kernel program in a process took about its compile time
    # more than the later calls (187-500 ms a step against 5.7): jax 0.11 recompiled it, since loading Pallas' TPU
    # module while the first call traced added an option to the trace context (found on the CPU under 0.11.2,
    # tests/runtime/test_trace_context.py; kvjax.ops._impl now loads the kernel modules first). bf16 `full` at
    # 1 x 32K on the defaults, one fresh process per XLA_FLAGS variant (SECOND_CALL_VARIANTS), each row keeping its
    # second call's seconds and the XLA compiles it ran (throughput.py: decode_second_s, second_call_compiles)
    for v in ${SECOND_CALL_VARIANTS:-today}; do
      stage second_call_$v ${SECOND_CALL_S:-60} env XLA_FLAGS="$(flags_of $v ${XLA_FLAGS:-})" \
        $PY benchmarks/throughput.py $SMOKE_FLAG --tunings="" --plan="$(pick 1x32768:full 1x64:full)" --new_tokens=33 \
        --repeats=1 --out="$OUT/second_call_$v.json"
    done ;;
  quant_ab)  # each storage on the XLA path and on the fused dequantizing kernel, 1 x 32K `full`: which ones
    # `auto_fused_quantized` should hand the kernel (decode_choices.py; int8 is listed from run 13's 1.81x). Item
    # 6's storages first (int4, KIVI-2), fp8 last: the stage takes what the command has left
    stage quant_ab ${QUANT_AB_S:-240} $PY benchmarks/throughput.py $SMOKE_FLAG \
      --kv_dtypes=${QUANT_AB_DTYPES:-int4,kivi2,fp8} --tunings="$XLA_PATH;$FUSED_QUANT" \
      --plan="$(pick 1x32768:full 1x64:full)" --new_tokens=17 --repeats=2 --time_budget_s=$(( ${QUANT_AB_S:-240} - 20 )) \
      --out="$OUT/quant_ab.json" ;;
  quant_long) stage quant_long ${QUANT_LONG_S:-400} $PY benchmarks/throughput.py $SMOKE_FLAG \
    --kv_dtypes=${QUANT_DTYPES:-model,int8,int4,kivi2} \
    --tunings="${QUANT_TUNING:-$FUSED_QUANT}" \
    --plan="${QUANT_LONG_PLAN:-$(pick "1x32768:full,snapkv@1024;1x$LONG:full,snapkv@1024;maxx32768:full,snapkv@1024;maxx$LONG:full,snapkv@1024" "1x64:full,snapkv@16;maxx64:full,snapkv@16")}" \
    --new_tokens=17 --repeats=2 --time_budget_s=$(( ${QUANT_LONG_S:-400} - 30 )) --out="$OUT/quant_long.json" ;;
  *) echo "unknown stage $name"; exit 2 ;;
  esac
done
echo "== done at $(date +%T), $(left)s before the deadline" | tee -a "$OUT/log.txt"
pack
