"""The per-backend tuning of kvjax's kernels and XLA paths, as one frozen value.

Every choice that is made for speed and not for correctness (which implementation "auto" picks, tile
sizes, split counts, Triton warps / stages, layouts) is a field of `Tuning`, with a measured default per
backend (`default`). Code that is traced reads the tuning in force, `current()`, when it is traced:

    from kvjax import tuning

    with tuning.override(auto_pallas={"decode_attention"}, prefill_blocks=(256, 256)):
        out = kvjax.generate(model, prompts, ...)

A `Tuning` is hashable, so a jitted program takes it as a static argument and enters it while tracing;
a different tuning is then a different compiled program, never a stale one:

    @functools.partial(jax.jit, static_argnames="t")
    def step(x, t: tuning.Tuning):
        with tuning.use(t):
            return ops.decode_attention(...)

    step(x, tuning.current())

The kvjax ops (`kvjax.ops`, `kvjax.pallas`) are not jitted themselves: called eagerly they read
`current()` at every call; called inside your own `jax.jit`, pass the tuning in as above, or the first
trace's tuning stays compiled in. The context is a `contextvars.ContextVar`: nested `use` / `override`
blocks restore the outer tuning on exit, and each thread (or asyncio task) has its own.

The measurements behind the defaults are in BENCHMARKS.md (sections named in each field's note).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax

from kvjax.errors import ConfigError

#: `Tuning.auto_prefill` values: the path `prefill_attention(implementation="auto")` takes for 16-bit inputs.
PREFILL_PATHS = ("xla", "dot_product_attention", "pallas")
#: `Tuning.slot_write` values: how `kvjax.slots.put_slots` writes one slot per (example, KV head).
SLOT_WRITES = ("scatter", "flat_scatter", "update_slice")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Speed knobs of kvjax's traced code. Frozen and hashable (a `jax.jit` static argument); build a
    variant with `dataclasses.replace` or, for the code below a block, `override(**fields)`.

    Dispatch of `implementation="auto"` (`kvjax.ops`):

    * `auto_pallas`: ops whose "auto" runs their Pallas kernel (names from `kvjax.ops._impl.PALLAS_OPS`).
      Only kernels tested compiled *and* measured faster than XLA on the backend are listed. GPU (H200,
      jax 0.11.2, Llama-3-8B heads, bf16): `block_sparse_decode_attention`, 1.29x / 1.65x / 3.23x its XLA
      reference at 8K / 32K / 128K cached tokens; the dense `decode_attention` kernel is 0.85x / 1.01x /
      1.04x XLA, so dense decode stays on XLA (BENCHMARKS.md, "Kernels, compiled, against XLA"). TPU: no
      measurement, nothing listed. CPU: nothing (interpret mode is for correctness only).
      `decode_append_attention` (`kvjax.ops.fused_decode`: one Triton kernel per layer for the new token's RoPE,
      its in-place cache write and the split-K attention, `kvjax.pallas.gpu_fused_decode`) and `rms_norm`
      (`kvjax.ops.norm`: each hidden-state RMSNorm as one Triton kernel, `kvjax.pallas.gpu_norm`): GPU, by the
      rules of docs/performance.md from the H200 run 13 (jax 0.11.2, Llama-3-8B shape, bf16): with both, a
      decode layer runs 12.3 launches instead of 26 and `full` at 1 x 32K steps in 5.86 ms instead of 7.61
      (131 -> 171 tok/s, 57% -> 74% of the read bandwidth), SnapKV 1024 in 4.62 ms instead of 4.92 (BENCHMARKS.md,
      "Run 13"). Listed, the runtime's decode takes the fused kernel on every layer `kvjax.runtime.step.fuses_decode`
      allows; a quantized cache's layer only with `auto_fused_quantized`.
      `linear` (`kvjax.ops.linear`: each of a layer's four weight products as one Triton kernel at decode's row
      counts, `kvjax.pallas.gpu_linear`, with the RMSNorm, the MLP's activation product and the residual adds
      fused in) is listed on no backend: a decode layer compiles to 6 launches for an H200 with the three, but on
      the H200 (run 13) its products took 1.8x (1 row) and 2.6x (16 rows) XLA's time at its best tile.
    * `auto_fused_quantized`: the quantized storages (`FUSED_QUANTIZED`: int8, fp8, int4, kivi2, kivi4) whose
      layers the fused kernel also takes under "auto" where `auto_pallas` lists `decode_append_attention`
      (`implementation="pallas"` takes them either way); True means all of them, False none. A storage is listed
      where the kernel passed its compiled tests on the GPU and was measured faster than the XLA path on it
      (docs/performance.md's rules). GPU: int8. On the H200 the kernel made an int8 cache's 1 x 32K `full` step
      1.81x faster than the XLA path (run 13: 5.86 against 10.60 ms), and after the fixes of the failures run 13
      found (a dot over fewer than 16 channels; XLA:GPU folding bf16 round trips on the XLA side) every int8 case
      passed its compiled tests (run 14: 153 of 154 passed, the one left an fp8 test too sensitive to XLA's
      rounding, since rescaled). fp8, int4 and KIVI wait for the device command's `quant_ab`, which times each
      storage on both paths. Elsewhere empty.
    * `auto_prefill`: the path `prefill_attention` takes for bfloat16 / float16 inputs without
      `return_lse` (one of `PREFILL_PATHS`; "xla" is the blockwise reference). GPU: "dot_product_attention"
      (cuDNN), 1.94x / 1.85x the XLA path at 8K / 32K tokens on an H200, equal within 5e-3.
    * `auto_causal_prefix`: `causal_prefix_attention` (a one-shot prefill from position 0) makes one causal
      `jax.nn.dot_product_attention` call for 16-bit inputs, instead of `prefill_attention`'s "auto" path.
      GPU: True, 4.4x / 5.6x / 6.5x the per-block masked cuDNN path at 4K / 8K / 32K tokens, a 32K `full`
      prefill of an 8B-shaped model 4.03 -> 1.25 s (BENCHMARKS.md, "One causal call per layer").

    XLA paths:

    * `prefill_blocks`: `(block_q, block_k)` tiles of the blockwise `prefill_attention` (and of
      `accumulated_scores` when `accumulated_blocks` is None). CPU: (128, 128), a score tile that stays in
      cache, at least as fast as 256 x 256 and faster than 512 x 1024 at 1K-8K tokens (issue 24);
      accelerators (512, 1024).
    * `accumulated_blocks`: `(block_q, block_k)` of H2O's `accumulated_scores` (None: `prefill_blocks`). CPU:
      (256, 256), 0.78x / 0.86x the time of 128 x 128 at 4K tokens, one thread, 8 / 2 and 9 / 3 heads.
    * `window_block_k`: key block of `window_scores`' two passes (1024 everywhere; not measured per backend).
    * `decode_keys_as_rows`: XLA decode attention computes `K q^T` (then a small transpose behind an
      optimization barrier) instead of `q K^T`. CPU: True, the cache streams at ~14 GB/s instead of ~10 GB/s
      on the 2-core VM (BENCHMARKS.md, "Decode layout").
    * `decode_dots_in_cache_dtype`: the XLA decode attention's two dots read K / V in their stored dtype with a
      float32 result (scores scaled after the dot, probabilities cast to the cache's dtype for `p V`), instead
      of casting K / V to float32 first. A GPU profile (BENCHMARKS.md, "The per-layer layout on an H200") shows
      a padded copy of K / V per step (1.67 ms of a 11.5 ms step at 32K). GPU: True (H200 run 12, 8B shape, bf16:
      `full` 86.6 -> 92.5 tok/s at 1 x 32K, 1,404 -> 1,541 tok/s at 16 x 8K, SnapKV 122.6 -> 121.9; the padded
      copy stayed, see `cache_slot_multiple`); elsewhere False. No effect on float32 caches.
    * `slot_write`: how one slot per (example, KV head) is written (`kvjax.slots.put_slots`: the decode step's
      append of the new token, in-place eviction): "scatter", one scatter with B and K as batch dimensions;
      "flat_scatter", one scatter into the buffer viewed as `[B * K * C, ...]` rows; "update_slice", one
      `dynamic_update_slice` per (example, head) when there are at most 64 of them (else "scatter"). Same
      result. A GPU profile (BENCHMARKS.md, "The per-layer layout on an H200") puts the batched scatter at
      74 us per layer whatever the cache length. "scatter" everywhere: on an H200 (run 12) "update_slice" took
      SnapKV 122.6 -> 128.3 tok/s at 1 x 32K but StreamingLLM 115.7 -> 93.1 (with `decode_dots_in_cache_dtype`)
      and 2.3x the kernels per step; "flat_scatter" changed nothing beyond noise.
    * `cache_slot_multiple`: the slots of a cache whose decode only appends (`full`, SnapKV and the other
      one-shot methods) are rounded up to a multiple of this (1: exact). A method that evicts in place keeps
      its exact capacity (its capacity is its budget). The extra slots stay invalid, masked like padding. A GPU
      profile shows a padded copy of the cache per step (`loop_pad_fusion`, 1.4-1.7 ms at 32K): XLA:GPU's compile
      for an H200 (`benchmarks/gpu_compile.py`) pads the split-K `p V` dot's 32,784 slots to 33,024 and copies
      every head's V padded; 256 removes it there, 128 does not (BENCHMARKS.md). 1 everywhere until an A/B on a
      GPU times it (the autotuned split may pad to another multiple).
    * `layer_slack`: how much larger than its layers' own sizes (`Method.layer_capacities`: `per_layer`, `lukv`,
      `duo_attention`, `pyramidkv`, skipped layers) a cache may be allocated so that fewer prefill programs compile:
      each distinct layer size compiles its own, and LU-KV's or `per_layer`'s layers can take one size each. The layers
      are grouped once per method, as the fewest groups whose largest members add at most this fraction of the slots at
      a long prompt (`kvjax.runtime.stages.merge_sizes`); each layer is allocated at its group's largest size (0: every
      layer at its own). The extra slots stay empty, masked like padding: every layer keeps the same tokens. 0.05
      everywhere: on the 2-core CPU VM at 1K tokens on SmolLM2-135M's shape (30 layers), LU-KV over a spread curve
      compiles 6 sizes for 3.9% more slots and `per_layer` with ratios spread over 0.1-0.9 11 for 4.9%, instead of 30
      each: a cold generation 116 -> 25 s and 114 -> 44 s (SnapKV's: 11 s; BENCHMARKS.md, "Per-layer sizes").
    * `topk_bisect_min_slots`: slot axes at least this long select by bisection instead of three `top_k`
      sorts (None: never). CPU: 256, since XLA:CPU's `top_k` is a full comparator sort and Quest's page choice
      over 2K pages cost more than attending the layer (BENCHMARKS.md, "Decode layout"). Same output.
    * `mlp_rows`: rows (tokens x batch) per MLP pass, None for the whole input at once. CPU: 512, 22% faster
      at 4K tokens on SmolLM2-135M's shapes, one thread (issue 24): the `[rows, intermediate]` activations
      stay in cache. Read by the model's decoder block.

    Pallas Triton kernels (`kvjax.pallas.gpu_attention`; their explicit arguments win over these):

    * `gpu_decode_block_k`: slots per block of the dense decode kernel (a power of two >= 16);
      `gpu_num_warps`, `gpu_num_stages`: Triton's warps and pipeline stages of both kernels;
      `gpu_target_programs`: programs per call the split count aims at when `num_splits` is None (about
      two waves of a 132-SM GPU at batch 1 with 8 KV heads). The defaults 64 / 4 / 2 / 256 are within 5% of
      the best of 36 settings at 32K tokens on an H200 (BENCHMARKS.md, "Kernels, compiled, against XLA").
    * `gpu_quantized_block_k`, `gpu_quantized_num_warps`, `gpu_quantized_num_stages`,
      `gpu_quantized_target_programs`: the same four for the kernels over a quantized cache
      (`kvjax.pallas.gpu_fused_decode` on int8 / fp8 / int4 / KIVI stores, `kvjax.pallas.gpu_quantized`); None:
      the plain kernel's value. A block of 8-bit codes holds half the bytes of a bf16 one, and each loop step of
      the kernel costs about as long whatever it holds. GPU: 128 slots (H200, run 14, 1 x 32K `full` on the fused
      kernel: the int8 step 5.75 -> 5.63 ms with 128-slot blocks against 64, 0.99x -> 1.02x bf16's; BENCHMARKS.md,
      "run 14"); warps, stages and programs the plain kernel's. `tile(quantized)` gives the first three in force,
      `target_programs(quantized)` the last.
    * `gpu_int8_pairs`: the quantized kernels read an int8 cache's value codes as int16 pairs of channels
      (`kvjax.pallas.gpu_planes.as_pairs`, a bitcast; same codes, same outputs), so that a V block reaches the
      `p V` dot through 16-bit shared memory instead of one byte a load. Compiled for an H200, the fused kernel's
      128-slot loop then has no byte loads and 6% fewer instructions (BENCHMARKS.md, "int8 codes read in pairs").
      With float16 dots (`gpu_f16_dots`, or a float16 model) the key codes are read in pairs too
      (`gpu_quantized.reads_key_pairs`): every dot operand then comes from 16-bit data, and the query is loaded
      with `ldmatrix` instead of 64-bit loads and register moves (BENCHMARKS.md, "int8 keys in pairs"). Off until
      a GPU times it.
    * `gpu_int4_pairs`: the quantized kernels read an int4 cache's key and value codes as int16 pairs of bytes
      (`kvjax.pallas.gpu_planes.as_pairs`, a bitcast; same codes), the query and the output in four channel
      planes. A block then reaches both dots from 16-bit data: the query through `ldmatrix` instead of 64-bit
      loads and register moves, the values through transposing `ldmatrix` instead of one byte a load. Compiled
      for an H200, the fused kernel's 128-slot loop falls from 1,484 to 1,127 SASS instructions a thread a step,
      its registers from 167 to 156 (BENCHMARKS.md, "int4 codes in pairs"). On, but not yet timed on a GPU:
      False reads bytes as before.
    * `gpu_unpack_asm`: the compiled quantized kernels turn int4 and KIVI codes into bf16 / fp16 with inline PTX
      (`kvjax.pallas.gpu_unpack`: a byte permute, a mask into the mantissa of 128, one packed `fma` per two codes;
      same values) instead of one integer-to-float `cvt` a code, a quarter-throughput instruction on Hopper.
      Compiled for an H200, int4's 128-slot loop loses its 256 `cvt` a thread and 17% of its instructions
      (BENCHMARKS.md, "Sub-byte codes unpacked by the exponent"). Not yet timed or run on a GPU: False takes the
      `cvt` path back. It also converts int8 codes where the dots are float16 (a float16 model's, or
      `gpu_f16_dots`).
    * `gpu_f16_dots`: the quantized kernels attend an int8 or fp8 cache of a bf16 model with float16 dots. The
      codes convert to float16 exactly in fewer instructions than to bf16 (int8 by `kvjax.pallas.gpu_unpack`'s
      inline PTX where `gpu_unpack_asm`: a sign flip and a byte permute into the mantissa of 1024, one packed `fma`
      per two codes; fp8 by the hardware's e4m3x2 -> f16x2 `cvt`). The query and the softmax weights round to
      float16 instead of bf16, 3 more bits: the query's entries after its 1 / sqrt(head_dim) scale must stay under
      65,504 in magnitude (under 2^-14 they lose bits), the weights are scaled so that none flushes to zero
      (`gpu_quantized.F16_TOP`). Against a float64 attention over the same codes the output errs 7-18x less.
      Compiled for an H200, the fused kernel's 128-slot loop a thread a step: int8 read in pairs 1,404 -> 1,026
      SASS instructions (165 registers; keys in pairs too), fp8 1,554 -> 1,204 (BENCHMARKS.md, "8-bit codes in
      float16", "int8 keys in pairs"). Off until a GPU times it (`fused_kernel_tiles.py`'s `:f16` tiles).
    * `gpu_sparse_chunk`: slots per step of the block-sparse kernel over its dense ranges (a power of two
      >= 16).
    * `gpu_linear_block_n`, `gpu_linear_block_k` (powers of two >= 16), `gpu_linear_num_warps`,
      `gpu_linear_num_stages`: the weight-product kernel's tile (`kvjax.pallas.gpu_linear`: output columns per
      program, rows of the matrix per loop step, Triton's warps and stages). 32 / 256 / 4 / 3 are not measured:
      the device command's `weight_products` stage times them against other tiles (issue 57).

    Pallas Mosaic TPU kernels (`kvjax.pallas.decode_attention`, `scoring`, `select`, `block_scoring`;
    compiled on TPU, interpreted elsewhere; not measured on a TPU yet, see `kvjax/pallas/COMPAT.md`):

    * `tpu_decode_block_k`, `tpu_decode_splits`: key block and split count of the decode kernel.
    * `tpu_score_block_q`, `tpu_score_block_k`: query rows per head and key slots per block of the
      column-probability kernel (`window_scores`, `accumulated_scores`).
    * `tpu_page_block`, `tpu_representative_block`: pages / memory blocks per grid step of the block
      scorers.
    * `tpu_topk_block_rows`, `tpu_topk_chunk`: rows per grid step and lanes per counting pass of the
      threshold top-k; `tpu_gather_block_rows`: rows per grid step of the DMA gather.
    """

    auto_pallas: frozenset[str] = frozenset()
    auto_prefill: str = "xla"
    auto_causal_prefix: bool = False
    auto_fused_quantized: frozenset[str] = frozenset()
    prefill_blocks: tuple[int, int] = (512, 1024)
    accumulated_blocks: tuple[int, int] | None = None
    window_block_k: int = 1024
    decode_keys_as_rows: bool = False
    decode_dots_in_cache_dtype: bool = False
    slot_write: str = "scatter"
    cache_slot_multiple: int = 1
    layer_slack: float = 0.05
    topk_bisect_min_slots: int | None = None
    mlp_rows: int | None = None
    gpu_decode_block_k: int = 64
    gpu_sparse_chunk: int = 64
    gpu_target_programs: int = 256
    gpu_num_warps: int = 4
    gpu_num_stages: int = 2
    gpu_quantized_block_k: int | None = None
    gpu_quantized_num_warps: int | None = None
    gpu_quantized_num_stages: int | None = None
    gpu_quantized_target_programs: int | None = None
    gpu_int8_pairs: bool = False
    gpu_int4_pairs: bool = True
    gpu_unpack_asm: bool = True
    gpu_f16_dots: bool = False
    gpu_linear_block_n: int = 32
    gpu_linear_block_k: int = 256
    gpu_linear_num_warps: int = 4
    gpu_linear_num_stages: int = 3
    tpu_decode_block_k: int = 512
    tpu_decode_splits: int = 2
    tpu_score_block_q: int = 128
    tpu_score_block_k: int = 512
    tpu_page_block: int = 256
    tpu_representative_block: int = 128
    tpu_topk_block_rows: int = 8
    tpu_topk_chunk: int = 2048
    tpu_gather_block_rows: int = 128

    def tile(self, quantized: bool = False) -> tuple[int, int, int]:
        """`(block_k, num_warps, num_stages)` of the Triton decode kernels over a plain or a quantized cache."""
        plain = (self.gpu_decode_block_k, self.gpu_num_warps, self.gpu_num_stages)
        if not quantized:
            return plain
        mine = (self.gpu_quantized_block_k, self.gpu_quantized_num_warps, self.gpu_quantized_num_stages)
        return tuple(p if q is None else q for p, q in zip(plain, mine, strict=True))

    def target_programs(self, quantized: bool = False) -> int:
        """Programs per call the Triton decode kernels' split count aims at over a plain or a quantized cache."""
        mine = self.gpu_quantized_target_programs
        return self.gpu_target_programs if not quantized or mine is None else mine

    def __post_init__(self) -> None:
        ops = self.auto_pallas
        if isinstance(ops, str) or not all(isinstance(o, str) for o in _iterable(ops, "auto_pallas")):
            raise ConfigError(f"Tuning.auto_pallas must be a set of op names, got {ops!r}")
        object.__setattr__(self, "auto_pallas", frozenset(ops))  # a set or list given: stored hashable
        if self.auto_prefill not in PREFILL_PATHS:
            raise ConfigError(f"Tuning.auto_prefill must be one of {list(PREFILL_PATHS)}, got {self.auto_prefill!r}")
        if self.slot_write not in SLOT_WRITES:
            raise ConfigError(f"Tuning.slot_write must be one of {list(SLOT_WRITES)}, got {self.slot_write!r}")
        object.__setattr__(self, "auto_fused_quantized", _storages(self.auto_fused_quantized))
        for name in ("auto_causal_prefix", "decode_keys_as_rows", "decode_dots_in_cache_dtype", "gpu_int8_pairs",
                     "gpu_int4_pairs", "gpu_unpack_asm", "gpu_f16_dots"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Tuning.{name} must be a bool, got {getattr(self, name)!r}")
        slack = self.layer_slack
        if isinstance(slack, bool) or not isinstance(slack, int | float) or not 0.0 <= slack < float("inf"):
            raise ConfigError(f"Tuning.layer_slack must be a finite number >= 0, got {slack!r}")
        for name in ("prefill_blocks", "accumulated_blocks"):
            value = getattr(self, name)
            if value is None and name == "accumulated_blocks":
                continue
            pair = tuple(_iterable(value, name))
            if len(pair) != 2 or not all(_positive_int(x) for x in pair):
                raise ConfigError(f"Tuning.{name} must be two positive ints (block_q, block_k), got {value!r}")
            object.__setattr__(self, name, pair)
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            optional = field.type == "int | None"
            if field.type in ("int", "int | None") and not (_positive_int(value) or (optional and value is None)):
                raise ConfigError(f"Tuning.{field.name} must be a positive int{' or None' * optional}, got {value!r}")
        for name in ("gpu_decode_block_k", "gpu_quantized_block_k", "gpu_sparse_chunk", "gpu_linear_block_n",
                     "gpu_linear_block_k"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ConfigError(f"Tuning.{name} must be a power of two >= 16 (a Triton tile), got {value}")


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


#: The quantized storages the fused decode kernel can take (`kvjax.quant.spec.SCHEME_BITS`' names; named here so
#: that the tuning imports nothing of `kvjax.quant`), for `Tuning.auto_fused_quantized`.
FUSED_QUANTIZED = ("int8", "fp8", "int4", "kivi2", "kivi4")


def _storages(value: Any) -> frozenset[str]:
    """`auto_fused_quantized` as a set of storage names: True all of `FUSED_QUANTIZED`, False none."""
    if isinstance(value, bool):
        return frozenset(FUSED_QUANTIZED) if value else frozenset()
    names = () if isinstance(value, str) else tuple(_iterable(value, "auto_fused_quantized"))
    if isinstance(value, str) or not all(isinstance(s, str) for s in names):
        raise ConfigError(f"Tuning.auto_fused_quantized must be a bool or a set of storage names, got {value!r}")
    unknown = sorted(set(names) - set(FUSED_QUANTIZED))
    if unknown:
        raise ConfigError(f"Tuning.auto_fused_quantized: unknown storage(s) {', '.join(unknown)}; the fused kernel "
                          f"takes {', '.join(FUSED_QUANTIZED)}")
    return frozenset(names)


def _iterable(value: Any, name: str) -> Any:
    try:
        return iter(value)
    except TypeError:
        raise ConfigError(f"Tuning.{name}: expected a collection, got {value!r}") from None


#: Per backend, the fields that differ from `Tuning()`'s (the accelerator-neutral values).
_BACKEND_FIELDS: dict[str, dict[str, Any]] = {
    "cpu": dict(prefill_blocks=(128, 128), accumulated_blocks=(256, 256), decode_keys_as_rows=True,
                topk_bisect_min_slots=256, mlp_rows=512),
    "gpu": dict(auto_pallas=frozenset({"block_sparse_decode_attention", "decode_append_attention", "rms_norm"}),
                auto_prefill="dot_product_attention",
                auto_causal_prefix=True, decode_dots_in_cache_dtype=True, auto_fused_quantized=frozenset({"int8"}),
                gpu_quantized_block_k=128),
    "tpu": dict(),
}
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


@functools.cache
def _default(backend: str) -> Tuning:
    return Tuning(**_BACKEND_FIELDS.get(backend, {}))


def default(backend: str | None = None) -> Tuning:
    """The measured defaults of `backend` ("cpu", "gpu" (or "cuda" / "rocm"), "tpu"); None: the running
    backend, `jax.default_backend()` (another plugin's backend gets `Tuning()`)."""
    if backend is None:
        return _default(_ALIASES.get(jax.default_backend(), jax.default_backend()))
    name = _ALIASES.get(backend, backend)
    if name not in _BACKEND_FIELDS:
        raise ConfigError(f"tuning.default: backend must be one of {sorted(_BACKEND_FIELDS)}, got {backend!r}")
    return _default(name)


_CURRENT: contextvars.ContextVar[Tuning | None] = contextvars.ContextVar("kvjax_tuning", default=None)


def current() -> Tuning:
    """The tuning in force: the innermost `use` / `override` block's, else `default()`."""
    t = _CURRENT.get()
    return default() if t is None else t


@contextlib.contextmanager
def use(t: Tuning) -> Iterator[Tuning]:
    """Makes `t` the current tuning inside the block (restored on exit, also on error); yields it."""
    if not isinstance(t, Tuning):
        raise ConfigError(f"tuning.use takes a kvjax.tuning.Tuning, got {type(t).__name__}")
    token = _CURRENT.set(t)
    try:
        yield t
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def override(**fields: Any) -> Iterator[Tuning]:
    """`use(current() with fields replaced)`; an unknown field name raises `ConfigError` naming it."""
    known = {f.name for f in dataclasses.fields(Tuning)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"tuning.override: unknown field(s) {', '.join(unknown)}; Tuning's fields are "
                          f"{', '.join(sorted(known))}")
    with use(dataclasses.replace(current(), **fields)) as t:
        yield t
