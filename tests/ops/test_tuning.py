"""`kvjax.tuning`: one frozen tuning value, read when code is traced, changed only through a context.

Oracles: the per-backend defaults are the measured values BENCHMARKS.md names (restated here); a changed
tuning must retrace a jitted program that takes it as a static argument (counted traces, the kernel reached
or not), and every knob the ops read must change the traced program while the result stays the same.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import slots, tuning
from kvjax.errors import ConfigError
from kvjax.ops import attention, blocks, scoring, select
from kvjax.pallas import block_scoring as pallas_blocks
from kvjax.pallas import gpu_attention, gpu_linear, gpu_quantized
from kvjax.pallas import scoring as pallas_scoring
from kvjax.pallas import select as pallas_select

pallas_decode = importlib.import_module("kvjax.pallas.decode_attention")  # the package exports its function

B, N, K, H, C, T = 2, 4, 2, 16, 64, 32


def _decode_case(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, N, H)), dtype)
    k = jnp.asarray(rng.standard_normal((B, K, C, H)), dtype)
    v = jnp.asarray(rng.standard_normal((B, K, C, H)), dtype)
    k_pos = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, K, C))
    k_valid = jnp.asarray(np.arange(C)[None, None] < np.array([[C], [40]])[:, :, None].repeat(K, 1))
    return q, jnp.asarray([C, 40], jnp.int32), k, v, k_pos, k_valid


def _prefill_case(dtype=jnp.float32):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
    k = jnp.asarray(rng.standard_normal((B, K, C, H)), dtype)
    v = jnp.asarray(rng.standard_normal((B, K, C, H)), dtype)
    q_pos = jnp.broadcast_to(jnp.arange(C - T, C, dtype=jnp.int32), (B, T))
    k_pos = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, K, C))
    return q, q_pos, k, v, k_pos, k_pos >= 0


def test_defaults_per_backend_are_the_measured_ones():
    cpu, gpu, tpu = tuning.default("cpu"), tuning.default("gpu"), tuning.default("tpu")
    assert cpu.prefill_blocks == (128, 128) and cpu.accumulated_blocks == (256, 256)
    assert cpu.decode_keys_as_rows and cpu.topk_bisect_min_slots == 256 and cpu.mlp_rows == 512
    assert cpu.auto_pallas == frozenset() and cpu.auto_prefill == "xla" and not cpu.auto_causal_prefix
    # run 13 (H200): the fused decode and RMSNorm kernels joined; of the quantized caches int8 takes the kernel under
    # "auto" (run 13: 1.81x its XLA path; run 14: its compiled tests passed), with 128-slot blocks (run 14)
    assert gpu.auto_pallas == {"block_sparse_decode_attention", "decode_append_attention", "rms_norm"}
    assert gpu.auto_prefill == "dot_product_attention"
    assert gpu.auto_fused_quantized == {"int8"} and not cpu.auto_fused_quantized and not tpu.auto_fused_quantized
    assert gpu.tile(quantized=True) == (128, 4, 2) and gpu.tile() == (64, 4, 2)
    assert cpu.tile(quantized=True) == cpu.tile() == tpu.tile(quantized=True)
    # int8 read in pairs and the quantized kernels' own program target: unmeasured, so off / the plain kernel's
    assert not gpu.gpu_int8_pairs and gpu.target_programs(quantized=True) == gpu.target_programs() == 256
    assert tuning.Tuning(gpu_quantized_target_programs=392).target_programs(True) == 392
    assert gpu.auto_causal_prefix and gpu.prefill_blocks == (512, 1024) and gpu.accumulated_blocks is None
    assert not gpu.decode_keys_as_rows and gpu.topk_bisect_min_slots is None and gpu.mlp_rows is None
    assert gpu.decode_dots_in_cache_dtype and not cpu.decode_dots_in_cache_dtype and gpu.slot_write == "scatter"
    assert gpu.cache_slot_multiple == cpu.cache_slot_multiple == 1
    assert (gpu.gpu_decode_block_k, gpu.gpu_num_warps, gpu.gpu_num_stages, gpu.gpu_target_programs) == (64, 4, 2, 256)
    assert tpu == tuning.Tuning()
    assert tuning.default("cuda") is gpu and tuning.default() == tuning.default(jax.default_backend())
    with pytest.raises(ConfigError, match="'metal'"):
        tuning.default("metal")


def test_tuning_is_a_hashable_value_checked_when_built():
    a = tuning.Tuning(auto_pallas={"decode_attention"}, prefill_blocks=[8, 16])
    b = tuning.Tuning(auto_pallas=frozenset({"decode_attention"}), prefill_blocks=(8, 16))
    assert a == b and hash(a) == hash(b) and isinstance(a.auto_pallas, frozenset)
    assert a != tuning.Tuning()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.auto_prefill = "pallas"
    bad = [("prefill_blocks", (0, 8)), ("auto_prefill", "cudnn"), ("gpu_decode_block_k", 24),
           ("gpu_quantized_block_k", 96), ("gpu_quantized_num_warps", 0),
           ("tpu_decode_splits", 0), ("mlp_rows", -1), ("auto_pallas", "decode_attention"),
           ("decode_keys_as_rows", 1), ("accumulated_blocks", (8,)), ("gpu_linear_block_k", 100)]
    for field, value in bad:
        with pytest.raises(ConfigError, match=field):
            tuning.Tuning(**{field: value})


def test_fused_quantized_storages_are_a_set_true_is_all_and_unknown_ones_are_named():
    """`auto_fused_quantized` holds storage names (True: every storage the fused kernel takes, False: none), the
    same names as `kvjax.quant`'s schemes; a bare string or an unknown storage is refused with its value."""
    from kvjax.quant.spec import SCHEME_BITS

    assert tuning.FUSED_QUANTIZED == tuple(SCHEME_BITS)
    assert tuning.Tuning(auto_fused_quantized=True).auto_fused_quantized == frozenset(SCHEME_BITS)
    assert tuning.Tuning(auto_fused_quantized=False).auto_fused_quantized == frozenset()
    some = tuning.Tuning(auto_fused_quantized=["int8", "kivi2"])
    assert some.auto_fused_quantized == {"int8", "kivi2"} and hash(some) == hash(
        tuning.Tuning(auto_fused_quantized=frozenset({"kivi2", "int8"})))
    with pytest.raises(ConfigError, match="auto_fused_quantized.*'int8'"):
        tuning.Tuning(auto_fused_quantized="int8")
    with pytest.raises(ConfigError, match="unknown storage.*int3"):
        tuning.Tuning(auto_fused_quantized={"int8", "int3"})


def test_override_nests_restores_and_names_unknown_fields():
    base = tuning.current()
    assert base == tuning.default()
    with tuning.override(window_block_k=8) as outer:
        assert tuning.current() is outer and outer.window_block_k == 8
        with tuning.override(prefill_blocks=(4, 4)):
            assert tuning.current().window_block_k == 8 and tuning.current().prefill_blocks == (4, 4)
        assert tuning.current() is outer
        with pytest.raises(RuntimeError), tuning.use(tuning.default("gpu")):
            raise RuntimeError
        assert tuning.current() is outer
    assert tuning.current() == base
    with pytest.raises(ConfigError, match="unknown field.*prefil_blocks"), tuning.override(prefil_blocks=(4, 4)):
        pass
    with pytest.raises(ConfigError, match="Tuning"), tuning.use({"window_block_k": 8}):
        pass


def test_each_thread_has_its_own_tuning():
    seen = {}

    def worker(name, **fields):
        with tuning.override(**fields):
            barrier.wait()  # both threads inside their own override at once
            seen[name] = tuning.current().window_block_k
            barrier.wait()
        seen[name + "_after"] = tuning.current()

    barrier = threading.Barrier(2)
    with tuning.override(window_block_k=4):
        threads = [threading.Thread(target=worker, args=("a",), kwargs=dict(window_block_k=8)),
                   threading.Thread(target=worker, args=("b",), kwargs=dict(window_block_k=16))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert tuning.current().window_block_k == 4
    assert seen["a"] == 8 and seen["b"] == 16 and seen["a_after"] == seen["b_after"] == tuning.default()


def test_a_changed_tuning_recompiles_instead_of_being_ignored(monkeypatch):
    """The jitted-program pattern (tuning static, entered while tracing): an op compiled under one tuning,
    called again under an override, runs the other implementation; back under the first, the first program
    is reused without a trace."""
    traces, kernel_calls = [], []
    real_kernel = pallas_decode.decode_attention
    monkeypatch.setattr(pallas_decode, "decode_attention",
                        lambda *a, **kw: kernel_calls.append(1) or real_kernel(*a, **kw))

    @functools.partial(jax.jit, static_argnames="t")
    def attend(q, q_pos, k, v, k_pos, k_valid, t: tuning.Tuning):
        traces.append(t)
        with tuning.use(t):
            return attention.decode_attention(q, q_pos, k, v, k_pos, k_valid)

    case = _decode_case()
    with tuning.override(auto_pallas=frozenset()):
        xla = attend(*case, t=tuning.current())
    assert len(traces) == 1 and not kernel_calls
    with tuning.override(auto_pallas={"decode_attention"}):
        kernel = attend(*case, t=tuning.current())
        assert len(traces) == 2 and len(kernel_calls) == 1  # retraced: the kernel ran
        attend(*case, t=tuning.current())
    with tuning.override(auto_pallas=frozenset()):
        again = attend(*case, t=tuning.current())
    assert len(traces) == 2 and len(kernel_calls) == 1  # both programs cached, neither stale
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(xla), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(xla))


def test_the_module_level_knobs_are_gone():
    """The old mutable per-backend tables no longer exist, and no module of `kvjax.ops` / `kvjax.pallas`
    defines a new one (a module-level dict or set naming a backend)."""
    from kvjax.ops import _impl

    for module, name in [(_impl, "AUTO_PALLAS"), (_impl, "AUTO_PREFILL"), (_impl, "AUTO_CAUSAL_PREFIX"),
                         (attention, "PREFILL_BLOCKS"), (attention, "KEYS_AS_ROWS"),
                         (scoring, "ACCUMULATED_BLOCKS"), (select, "BISECT_MIN_SLOTS"),
                         (gpu_attention, "_TARGET_PROGRAMS")]:
        assert not hasattr(module, name), f"{module.__name__}.{name}"
    root = pathlib.Path(kvjax.__file__).parent
    for path in [*(root / "ops").glob("*.py"), *(root / "pallas").glob("*.py")]:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict | ast.Set):
                literal = node.value.keys if isinstance(node.value, ast.Dict) else node.value.elts
                names = {c.value for c in literal if isinstance(c, ast.Constant)}
                assert not names & {"cpu", "gpu", "tpu"}, f"{path.name}:{node.lineno} is a per-backend table"


def _quantized_decode_case(dtype=jnp.float32, scheme="int8"):
    """`_decode_case` with K / V in `scheme` stores (`kvjax.quant.storage.quantize`, each head's valid slots)."""
    from kvjax.quant import KVQuant, storage

    q, q_pos, k, v, k_pos, k_valid = _decode_case(dtype)
    length = jnp.sum(k_valid, axis=-1).astype(jnp.int32)
    qk, qv = (storage.quantize(KVQuant(scheme), role, x, length, dtype) for role, x in (("k", k), ("v", v)))
    return q, q_pos, qk, qv, k_pos, k_valid


@functools.cache
def _cases() -> dict:
    rng = np.random.default_rng(2)
    scores = jnp.asarray(rng.standard_normal((B, K, 300)), jnp.float32)
    return dict(
        d=_decode_case(), d16=_decode_case(jnp.bfloat16), p=_prefill_case(), p16=_prefill_case(jnp.bfloat16),
        dq=_quantized_decode_case(), dq16=_quantized_decode_case(jnp.bfloat16),
        dq4=_quantized_decode_case(scheme="int4"),
        scores=scores, valid=scores > -1,
        pages=(jnp.asarray(rng.standard_normal((B, K, 2, H)), jnp.float32), -jnp.ones((B, K, 40, H)),
               jnp.ones((B, K, 40, H))),
        reps=(jnp.ones((B, 8)), jnp.asarray(rng.standard_normal((B, 300, 8)), jnp.float32)),
        sparse=(jnp.asarray([[[0, 16], [32, 48]]] * B, jnp.int32), jnp.full((B, K), 2, jnp.int32),
                jnp.asarray([[[[0, 8], [56, 64]]] * K] * B, jnp.int32)),
        lin=(jnp.asarray(rng.standard_normal((1, 512)), jnp.float32),
             jnp.asarray(rng.standard_normal((512, 128)), jnp.float32)),
    )


def _qk(c: dict) -> tuple:
    """A prefill case's q, q_pos, k, k_pos, k_valid (the scoring ops' operands)."""
    q, q_pos, k, _, k_pos, k_valid = c["p"]
    return q, q_pos, k, k_pos, k_valid


def _causal(c: dict):
    q, _, k, v, _, _ = c["p16"]
    return attention.causal_prefix_attention(q, k.swapaxes(1, 2)[:, :T], v.swapaxes(1, 2)[:, :T], jnp.asarray([T, 20]))


#: (field, a value other than the CPU default, the call that reads it). Each call's traced program must
#: change with the value, its result must not (beyond float rounding). `mlp_rows` is read by the model,
#: `cache_slot_multiple` by `generate` on the host (tests/test_slots.py), `auto_fused_quantized` by the runtime's
#: decode step with the fused kernel listed (tests/runtime/test_decode_fused.py).
KNOBS = [
    ("auto_pallas", {"decode_attention"}, lambda c: attention.decode_attention(*c["d"])),
    ("auto_prefill", "dot_product_attention", lambda c: attention.prefill_attention(*c["p16"])),
    ("auto_causal_prefix", True, _causal),
    ("prefill_blocks", (8, 16), lambda c: attention.prefill_attention(*c["p"])),
    ("accumulated_blocks", (8, 16), lambda c: scoring.accumulated_scores(*_qk(c))),
    ("window_block_k", 16, lambda c: scoring.window_scores(*_qk(c), window=4)),
    ("decode_keys_as_rows", False, lambda c: attention.decode_attention(*c["d"])),
    ("decode_dots_in_cache_dtype", True, lambda c: attention.decode_attention(*c["d16"])),
    ("slot_write", "flat_scatter", lambda c: slots.put_slots(c["d"][2], jnp.full((B, K), 3, jnp.int32), 1.0)),
    ("topk_bisect_min_slots", None, lambda c: select.topk_keep(c["scores"], c["valid"], 40, capacity=48)),
    ("gpu_decode_block_k", 32, lambda c: gpu_attention.decode_attention(*c["d"])),
    ("gpu_target_programs", 4, lambda c: gpu_attention.decode_attention(*c["d"], block_k=16)),
    ("gpu_num_warps", 8, lambda c: gpu_attention.decode_attention(*c["d"])),
    ("gpu_num_stages", 3, lambda c: gpu_attention.block_sparse_decode_attention(*c["d"], *c["sparse"], block_size=16)),
    ("gpu_quantized_block_k", 32, lambda c: gpu_quantized.decode_attention(*c["dq"])),
    ("gpu_quantized_num_warps", 8, lambda c: gpu_quantized.decode_attention(*c["dq"])),
    ("gpu_quantized_num_stages", 3, lambda c: gpu_quantized.decode_attention(*c["dq"])),
    ("gpu_quantized_target_programs", 4, lambda c: gpu_quantized.decode_attention(*c["dq"], block_k=16)),
    ("gpu_int8_pairs", True, lambda c: gpu_quantized.decode_attention(*c["dq"])),
    ("gpu_f16_dots", True, lambda c: gpu_quantized.decode_attention(*c["dq16"])),
    ("gpu_int4_pairs", False, lambda c: gpu_quantized.decode_attention(*c["dq4"])),
    ("gpu_sparse_chunk", 16, lambda c: gpu_attention.block_sparse_decode_attention(*c["d"], *c["sparse"],
                                                                                   block_size=16)),
    ("gpu_linear_block_n", 64, lambda c: gpu_linear.linear(*c["lin"])),
    ("gpu_linear_block_k", 128, lambda c: gpu_linear.linear(*c["lin"])),
    ("gpu_linear_num_warps", 8, lambda c: gpu_linear.linear(*c["lin"])),
    ("gpu_linear_num_stages", 2, lambda c: gpu_linear.linear(*c["lin"])),
    ("tpu_decode_block_k", 16, lambda c: pallas_decode.decode_attention(*c["d"])),
    ("tpu_decode_splits", 1, lambda c: pallas_decode.decode_attention(*c["d"], block_k=16)),
    ("tpu_score_block_q", 8, lambda c: pallas_scoring.accumulated_scores(*_qk(c))),
    ("tpu_score_block_k", 16, lambda c: pallas_scoring.window_scores(*_qk(c), window=4)),
    ("tpu_page_block", 16, lambda c: pallas_blocks.page_scores(*c["pages"])),
    ("tpu_representative_block", 64, lambda c: blocks.representative_scores(*c["reps"], implementation="pallas")),
    ("tpu_topk_block_rows", 16, lambda c: pallas_select.topk_keep(c["scores"], c["valid"], 40, capacity=48)),
    ("tpu_topk_chunk", 128, lambda c: pallas_select.topk_keep(c["scores"], c["valid"], 40, capacity=48)),
    ("tpu_gather_block_rows", 16, lambda c: pallas_select.gather_rows(c["d"][2], c["d"][3],
                                                                      jnp.zeros((B, K, 40), jnp.int32))),
]


def test_every_field_but_the_models_is_covered():
    fields = {f.name for f in dataclasses.fields(tuning.Tuning)}
    # `auto_fused_quantized` acts with the fused kernel listed: tests/runtime/test_decode_fused.py; `gpu_unpack_asm`
    # in a compiled kernel only (its Triton IR: tests/pallas/test_pallas_gpu_lowering.py); `layer_slack` sizes the
    # cache on the host (tests/runtime/test_layer_sizes.py)
    assert fields - {name for name, *_ in KNOBS} == {"mlp_rows", "cache_slot_multiple", "auto_fused_quantized",
                                                      "gpu_unpack_asm", "layer_slack"}


@pytest.mark.parametrize("field,value,call", KNOBS, ids=[k[0] for k in KNOBS])
def test_each_knob_changes_the_traced_program_not_the_result(field, value, call):
    """Traced and run under the CPU defaults and with the one field changed: the program differs (the op
    reads the field when traced), the output does not. Each trace wraps `call` anew: `make_jaxpr` and `jit`
    cache on the function, and would hand back the first tuning's program."""
    cases = _cases()

    def run() -> tuple[str, object]:
        program = jax.jit(lambda c: call(c)).trace(cases)
        return str(program.jaxpr), program.lower().compile()(cases)

    with tuning.use(tuning.default("cpu")):
        changed = dataclasses.replace(tuning.current(), **{field: value})
        assert getattr(changed, field) != getattr(tuning.current(), field)
        before, want = run()
        with tuning.use(changed):
            after, got = run()
    assert before != after, f"{field} is not read by the traced code"
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        atol = 3e-2 if w.dtype == jnp.bfloat16 else 2e-5
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=atol)
