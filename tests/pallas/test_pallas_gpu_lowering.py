"""The GPU kernels lower for CUDA (Pallas -> Triton IR) from this CPU host: `jax.export` with
`platforms=["cuda"]` runs the Pallas Triton lowering, which rejects primitives without a Triton rule and
arrays whose sizes are not powers of two. It does not run Triton's compile to PTX nor say anything about
speed (`benchmarks/accelerator.py` does both on a GPU).

Llama-3-8B-like heads (head_dim 128, GQA 4:1 and 7:1), 1K (and 1000) slots, bf16 and f32."""

import jax
import jax.numpy as jnp
import pytest

from kvjax.errors import ConfigError
from kvjax.pallas import gpu_attention as kernels

B, K, C, H = 1, 2, 1024, 128
S = jax.ShapeDtypeStruct
TRITON = "__gpu$xla.gpu.triton"


def _cuda_module(jitted, *args) -> str:
    """`jitted` exported for CUDA, its MLIR. The lowering is for an H200 named as the context's abstract device:
    jax 0.11's Pallas Triton lowering asks the device for its compute capability, and this host has none (0.10's
    did not ask)."""
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]  # Triton calls carry no export guarantee
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=h200)):
        return jax.export.export(jitted, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()


def _lowers(fn, *args) -> None:
    assert TRITON in _cuda_module(jax.jit(fn), *args)


@pytest.mark.parametrize("g,dtype,per_query_head", [(4, jnp.bfloat16, False), (7, jnp.bfloat16, True),
                                                     (4, jnp.float32, True)])
def test_dense_kernel_lowers(g, dtype, per_query_head):
    valid = S((B, K, g, C) if per_query_head else (B, K, C), jnp.bool_)
    args = (S((B, K * g, H), dtype), S((B,), jnp.int32), S((B, K, C, H), dtype), S((B, K, C, H), dtype),
            S((B, K, C), jnp.int32), valid)
    _lowers(lambda *a: kernels.decode_attention(*a, interpret=False), *args)
    _lowers(lambda *a: kernels.decode_attention(*a, sliding_window=64, return_weights=True, interpret=False), *args)
    ragged = (args[0], args[1], S((B, K, 1000, H), dtype), S((B, K, 1000, H), dtype), S((B, K, 1000), jnp.int32),
              S(valid.shape[:-1] + (1000,), jnp.bool_))  # no block multiple: the last block is clamped
    _lowers(lambda *a: kernels.decode_attention(*a, interpret=False), *ragged)


@pytest.mark.parametrize("g,dtype,block", [(4, jnp.bfloat16, 64), (7, jnp.float32, 16)])
def test_sparse_kernel_lowers(g, dtype, block):
    args = (S((B, K * g, H), dtype), S((B,), jnp.int32), S((B, K, C, H), dtype), S((B, K, C, H), dtype),
            S((B, K, C), jnp.int32), S((B, K, C), jnp.bool_), S((B, K, 6), jnp.int32), S((B, K), jnp.int32),
            S((B, K, 2, 2), jnp.int32))
    _lowers(lambda *a: kernels.block_sparse_decode_attention(*a, block_size=block, interpret=False), *args)


def test_head_dim_must_be_a_power_of_two_when_compiled():
    args = (jnp.zeros((1, 4, 96)), jnp.zeros((1,), jnp.int32), jnp.zeros((1, 1, 64, 96)), jnp.zeros((1, 1, 64, 96)),
            jnp.zeros((1, 1, 64), jnp.int32), jnp.ones((1, 1, 64), bool))
    with pytest.raises(ConfigError, match="head_dim"):
        kernels.decode_attention(*args, interpret=False)


@pytest.mark.parametrize("slots", [C, 1000, 131072])
def test_dense_kernel_lowers_on_one_layer_buffer(slots):
    """One layer's `[B, K, C, H]` buffer as the operand (a ragged capacity read without padding, 128K slots)."""
    dtype = jnp.bfloat16
    args = (S((B, K * 4, H), dtype), S((B,), jnp.int32), S((B, K, slots, H), dtype), S((B, K, slots, H), dtype),
            S((B, K, slots), jnp.int32), S((B, K, slots), jnp.bool_))
    _lowers(lambda q, qp, k, v, kp, kv: kernels.decode_attention(q, qp, k, v, kp, kv, interpret=False), *args)


@pytest.mark.parametrize("scheme,slots", [("int8", C), ("fp8", 1000), ("int4", 1000), ("kivi2", C), ("kivi4", 4096)])
def test_quantized_kernel_lowers(scheme, slots):
    """The fused-dequantization kernel (`kvjax.pallas.gpu_quantized`) on the 8B head shape: codes, scales and
    KIVI's per-group rows as Triton operands (its ring is attended in XLA)."""
    from kvjax.pallas import gpu_quantized
    from kvjax.quant import KVQuant
    from kvjax.quant import storage as st

    spec, dtype = KVQuant(scheme), jnp.bfloat16
    k, v = (jax.eval_shape(lambda r=r: st.empty(spec, r, B, K, slots, H, dtype)) for r in ("k", "v"))
    args = (S((B, K * 4, H), dtype), S((B,), jnp.int32), k, v, S((B, K, slots), jnp.int32), S((B, K, slots), jnp.bool_))
    _lowers(lambda *a: gpu_quantized.decode_attention(*a, interpret=False), *args)


@pytest.mark.parametrize("store,g,slots", [("plain", 4, C), ("plain", 7, 1000), ("int8", 4, 1000), ("fp8", 4, 1000),
                                           ("int4", 4, 1000), ("evict_fp8", 4, C), ("ring_fp8", 7, 1000),
                                           ("int4", 7, C), ("kivi2", 4, 1000), ("kivi4", 7, C),
                                           ("gathered", 4, C), ("evict", 4, C), ("evict_int8", 7, 1000),
                                           ("ring", 4, 1000), ("ring_int4", 4, C)])
def test_fused_decode_kernel_lowers(store, g, slots):
    """The fused decode kernel (`kvjax.pallas.gpu_fused_decode`: RoPE, the in-place write, split-K attention) on
    the 8B head shape, the cache operands aliased to its outputs."""
    _assert_fused_decode_lowers(store, g, slots)


def test_fused_decode_kernel_lowers_for_kivi2_and_fp8():
    """KIVI-2's and fp8's cases of the test above, in CI (which runs its first case only): their whole-step
    compile for the H200 (tests/test_gpu_compile.py) is `slow`, so this keeps their kernels lowered for CUDA."""
    _assert_fused_decode_lowers("kivi2", 4, 1000)
    _assert_fused_decode_lowers("fp8", 4, 1000)


def _assert_fused_decode_lowers(store: str, g: int, slots: int) -> None:
    from kvjax.pallas import gpu_fused_decode
    from kvjax.quant import KVQuant
    from kvjax.quant import storage as st

    dtype = jnp.bfloat16
    scheme = store.removeprefix("evict_").removeprefix("ring_") if store not in ("evict", "ring") else "plain"
    if scheme in ("int8", "fp8", "int4", "kivi2", "kivi4"):
        k, v = (jax.eval_shape(lambda r=r: st.empty(KVQuant(scheme), r, B, K, slots, H, dtype)) for r in ("k", "v"))
    else:
        k = v = S((B, K, slots, H), dtype)
    listed = S((B, K, 300), jnp.int32) if store == "gathered" else None
    evict = S((B, K), jnp.int32) if store.startswith("evict") else None  # StreamingLLM's in-place eviction

    def fn(q, k_new, v_new, position, inv, k, v, pos, length, listed, evict):
        return gpu_fused_decode.decode_append_attention(q, k_new, v_new, position, inv, k, v, pos, length,
                                                        sliding_window=4096, slots=listed, query_scale=0.5,
                                                        evict=evict, ring=store.startswith("ring"),
                                                        interpret=False)

    args = (S((B, K * g, H), dtype), S((B, K, H), dtype), S((B, K, H), dtype), S((B,), jnp.int32),
            S((H // 2,), jnp.float32), k, v, S((B, K, slots), jnp.int32), S((B, K), jnp.int32), listed, evict)
    module = _cuda_module(jax.jit(fn, donate_argnums=(5, 6, 7)), *args)
    assert TRITON in module and "output_operand_alias" in module


@pytest.mark.parametrize("store", ["int8", "evict_int8", "ring_int8"])
def test_fused_decode_kernel_lowers_reading_int8_in_pairs(store):
    """`Tuning.gpu_int8_pairs`: the int8 value codes as an int16 operand `[B, K, C, H / 2]`, still aliased to the
    output, and the kernel's planes split and joined in registers (Triton's split / join)."""
    from kvjax import tuning
    from kvjax.pallas import gpu_fused_decode
    from kvjax.quant import KVQuant
    from kvjax.quant import storage as st

    dtype, slots = jnp.bfloat16, 1000
    k, v = (jax.eval_shape(lambda r=r: st.empty(KVQuant("int8"), r, B, K, slots, H, dtype)) for r in ("k", "v"))
    evict = S((B, K), jnp.int32) if store.startswith("evict") else None

    def fn(q, k_new, v_new, position, inv, k, v, pos, length, evict):
        return gpu_fused_decode.decode_append_attention(q, k_new, v_new, position, inv, k, v, pos, length,
                                                        evict=evict, ring=store.startswith("ring"),
                                                        int8_pairs=True, interpret=False)

    args = (S((B, K * 4, H), dtype), S((B, K, H), dtype), S((B, K, H), dtype), S((B,), jnp.int32),
            S((H // 2,), jnp.float32), k, v, S((B, K, slots), jnp.int32), S((B, K), jnp.int32), evict)
    module = _cuda_module(jax.jit(fn, donate_argnums=(5, 6, 7)), *args)
    assert TRITON in module and "output_operand_alias" in module
    assert f"tensor<{B}x{K}x{slots}x{H // 2}xi16>" in module
    with tuning.override(gpu_int8_pairs=True):  # the standalone quantized kernel too
        from kvjax.pallas import gpu_quantized

        q = (S((B, K * 4, H), dtype), S((B,), jnp.int32), k, v, S((B, K, slots), jnp.int32),
             S((B, K, slots), jnp.bool_))
        assert "xi16>" in _cuda_module(jax.jit(lambda *a: gpu_quantized.decode_attention(*a, interpret=False)), *q)


def _quantized_modules(scheme: str, dtype, fused: bool = True) -> list[str]:
    """Under the current tuning, the CUDA modules of the fused decode kernel (where `fused`) and the standalone
    quantized kernel over `scheme` stores of 1000 slots in `dtype`."""
    from kvjax.pallas import gpu_fused_decode, gpu_quantized
    from kvjax.quant import KVQuant
    from kvjax.quant import storage as st

    slots = 1000
    k, v = (jax.eval_shape(lambda r=r: st.empty(KVQuant(scheme), r, B, K, slots, H, dtype)) for r in ("k", "v"))
    alone = (S((B, K * 4, H), dtype), S((B,), jnp.int32), k, v, S((B, K, slots), jnp.int32),
             S((B, K, slots), jnp.bool_))
    modules = [_cuda_module(jax.jit(lambda *a: gpu_quantized.decode_attention(*a, interpret=False)), *alone)]
    if fused:
        args = (S((B, K * 4, H), dtype), S((B, K, H), dtype), S((B, K, H), dtype), S((B,), jnp.int32),
                S((H // 2,), jnp.float32), k, v, S((B, K, slots), jnp.int32), S((B, K), jnp.int32))
        modules.insert(0, _cuda_module(
            jax.jit(lambda *a: gpu_fused_decode.decode_append_attention(*a, interpret=False)), *args))
    return modules


@pytest.mark.parametrize("scheme", ["int4", "kivi2", "int8"])
def test_sub_byte_codes_lower_with_the_unpack_assembly(scheme):
    """`Tuning.gpu_unpack_asm` (on by default): both quantized kernels compiled for CUDA carry `gpu_unpack`'s PTX
    for int4 and KIVI-2 codes (no `cvt` a code), and not where it is off or the codes are whole bytes. int4 codes
    read as int16 pairs of bytes (`Tuning.gpu_int4_pairs`, on by default) take one text for each nibble plane of
    the low and of the high bytes (two pairs an instance), read as bytes one a nibble plane (four bytes)."""
    from kvjax import tuning

    assert tuning.Tuning().gpu_unpack_asm and tuning.default("gpu").gpu_unpack_asm
    assert tuning.Tuning().gpu_int4_pairs and tuning.default("gpu").gpu_int4_pairs
    planes = {"int4": 4, "kivi2": 4, "int8": 0}[scheme]
    for module in _quantized_modules(scheme, jnp.bfloat16):  # one text a plane (K's and V's share it: interned)
        assert module.count("lop3.b32 kvj_a") == planes, scheme
        assert module.count("prmt.b32 kvj_a, kvj_w, 0, 0x4341") == (scheme == "int4"), scheme  # pairs' high nibbles
    if scheme == "int4":
        with tuning.override(gpu_int4_pairs=False):
            assert [m.count("lop3.b32 kvj_a") for m in _quantized_modules(scheme, jnp.bfloat16)] == [2, 2]
    with tuning.override(gpu_unpack_asm=False):
        assert not any("kvj_a" in module for module in _quantized_modules(scheme, jnp.bfloat16))


@pytest.mark.parametrize("scheme,pairs", [("int8", True), ("int8", False), ("fp8", False)])
def test_8bit_codes_lower_with_float16_dots(scheme, pairs):
    """`Tuning.gpu_f16_dots`: both quantized kernels lower for CUDA with float16 dots over int8 and fp8 codes, int8's
    through `gpu_unpack`'s int8 assembly (one text for four bytes; read in pairs, keys and values alike, one each
    for the low and high bytes of int16 pairs), which they carry only where the flag asks."""
    from kvjax import tuning

    def modules(asked: bool) -> list[str]:
        with tuning.override(gpu_f16_dots=asked, gpu_int8_pairs=pairs):
            return _quantized_modules(scheme, jnp.bfloat16)

    texts = 0 if scheme == "fp8" else 2 if pairs else 1
    assert [m.count("xor.b32 kvj_u") for m in modules(True)] == [texts, texts]
    assert not any("kvj_u" in m for m in modules(False))


def test_a_float16_models_int8_codes_lower_with_the_int8_assembly():
    """A float16 model's dots are float16 already: its int8 codes take `gpu_unpack`'s int8 assembly whatever
    `gpu_f16_dots` says, under `gpu_unpack_asm` (on by default)."""
    from kvjax import tuning

    [module] = _quantized_modules("int8", jnp.float16, fused=False)
    assert module.count("xor.b32 kvj_u") == 1
    with tuning.override(gpu_unpack_asm=False):
        assert "kvj_u" not in _quantized_modules("int8", jnp.float16, fused=False)[0]


@pytest.mark.parametrize("g,splits", [(4, 32), (7, 5), (1, 1)])
def test_split_merge_kernel_lowers(g, splits):
    args = (S((B, K, splits, 16, H), jnp.float32), S((B, K, splits, 16), jnp.float32),
            S((B, K, splits, 16), jnp.float32))
    _lowers(lambda a, m, l: kernels.merge_split_heads(a, m, l, g, jnp.bfloat16, interpret=False), *args)


@pytest.mark.parametrize("width,plus_one", [(4096, False), (3584, True)])
def test_rms_norm_kernel_lowers(width, plus_one):
    from kvjax.pallas import gpu_norm

    args = (S((2, width), jnp.bfloat16), S((width,), jnp.bfloat16))
    _lowers(lambda x, w: gpu_norm.rms_norm(x, w, 1e-6, plus_one, interpret=False), *args)
    _lowers(lambda x, w, r: gpu_norm.rms_norm(x, w, 1e-6, plus_one, residual=r, interpret=False), *args, args[0])


@pytest.mark.parametrize("rows,dtype", [(1, jnp.bfloat16), (16, jnp.bfloat16), (5, jnp.float32)])
def test_linear_kernel_lowers(rows, dtype):
    from kvjax.pallas import gpu_linear

    args = (S((rows, 4096), dtype), S((4096, 6144), dtype), S((4096,), dtype), S((rows, 6144), dtype))
    _lowers(lambda x, w, nw, r: gpu_linear.linear(x, w, norm_weight=nw, residual=r, interpret=False), *args)
    _lowers(lambda x, w, nw, r: gpu_linear.linear(x, w, norm_weight=nw, bias=nw[:6144 // 2].repeat(2),
                                                  interpret=False), *args)
    _lowers(lambda x, w, nw, r: gpu_linear.linear(x, w, norm_weight=nw, plus_one=True, interpret=False), *args)
    _lowers(lambda x, w, nw, r: gpu_linear.linear(x, w, block_n=64, block_k=128, interpret=False), *args)


@pytest.mark.parametrize("rows", [1, 16])
def test_lm_head_kernel_lowers(rows):
    """The LM head with its final norm, float32 logits from bf16 weights: Llama-3's 128,256-token vocabulary."""
    from kvjax.pallas import gpu_linear

    args = (S((rows, 4096), jnp.bfloat16), S((4096, 128256), jnp.bfloat16), S((4096,), jnp.bfloat16))
    _lowers(lambda x, w, nw: gpu_linear.linear(x, w, norm_weight=nw, out_dtype=jnp.float32, interpret=False), *args)
    # Tied (Gemma 3: 262,144 x 640, its `1 + weight` norm): the embedding table's rows, read whole.
    args = (S((rows, 640), jnp.bfloat16), S((262144, 640), jnp.bfloat16), S((640,), jnp.bfloat16))
    _lowers(lambda x, w, nw: gpu_linear.linear(x, w, norm_weight=nw, plus_one=True, out_dtype=jnp.float32,
                                               transposed=True, interpret=False), *args)


@pytest.mark.parametrize("rows,activation", [(1, "silu"), (16, "gelu_pytorch_tanh")])
def test_gated_linear_kernel_lowers(rows, activation):
    from kvjax.pallas import gpu_linear

    args = (S((rows, 2, 14336), jnp.bfloat16), S((14336, 4096), jnp.bfloat16), S((rows, 4096), jnp.bfloat16))
    _lowers(lambda x, w, r: gpu_linear.linear(x, w, gated=activation, residual=r, interpret=False), *args)


def test_fused_decode_kernel_with_qk_norm_lowers():
    from kvjax.pallas import gpu_fused_decode

    g, slots = 4, 1024
    args = (S((B, K * g, H), jnp.bfloat16), S((B, K, H), jnp.bfloat16), S((B, K, H), jnp.bfloat16), S((B,), jnp.int32),
            S((H // 2,), jnp.float32), S((B, K, slots, H), jnp.bfloat16), S((B, K, slots, H), jnp.bfloat16),
            S((B, K, slots), jnp.int32), S((B, K), jnp.int32), S((H,), jnp.bfloat16), S((H,), jnp.bfloat16))

    def fn(q, k_new, v_new, position, inv, k, v, pos, length, qn, kn):
        return gpu_fused_decode.decode_append_attention(q, k_new, v_new, position, inv, k, v, pos, length,
                                                        qk_norm=(qn, kn, 1e-6, False), interpret=False)

    _lowers(fn, *args)
