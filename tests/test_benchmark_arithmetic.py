"""The device command's arithmetic against oracles: the bytes a decode step reads (worked out by hand from the
model's config), which every "fraction of bandwidth" divides by the step's time; the largest batch after an out of
memory (against a known largest); a row's peak memory (against a device whose high-water mark is known)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_util as bu  # noqa: E402
import throughput  # noqa: E402

from kvjax.models.loader import param_shapes  # noqa: E402
from kvjax.models.model import DecoderLM  # noqa: E402


def _weights_read(c) -> int:
    """float32 weights a step reads, by hand: per layer q, k, v, o, gate, up, down and two norms; the final norm,
    the LM head and the embedding table's one row (untied)."""
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * (
        c.hidden_size) + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    return 4 * (c.num_layers * per_layer + c.hidden_size + c.hidden_size * c.vocab_size + c.hidden_size)


@pytest.mark.parametrize("kv_dtype, key_bytes", [(None, 4 * 16), ("int8", 16 + 2)])  # a head's key: f32, or codes
def test_throughput_bytes_per_step_count_the_cache_the_step_reads(monkeypatch, kv_dtype, key_bytes):
    """A row's bytes per step: the weights, the keys and values (int8: codes and one bf16 scale a token) and the
    slots' positions, which the XLA path's mask and the fused kernel read with them (an int32 a slot and KV head:
    1.5% of an int8 cache at 8B's heads, 5% of KIVI-2's), and the lengths."""
    config = bu.tiny_config()
    assert not config.tie_word_embeddings and config.head_dim == 16
    model = DecoderLM(config, {n: jnp.zeros(s, jnp.float32) for n, s in param_shapes(config).items()},
                      dtype=jnp.float32)
    batch, context, new = 2, 64, 4

    def fake_state(model, method, batch, context, new, kv_dtype=None):  # the allocated cache, nothing compiled
        capacity = throughput.gen.cache_capacity(method, context, new, quantized=kv_dtype is not None)
        return types.SimpleNamespace(cache=throughput.gen.init_cache(method, model.config, batch, capacity,
                                                                     model.dtype, kv_dtype))

    monkeypatch.setattr(throughput, "synthetic_state", fake_state)
    monkeypatch.setattr(throughput.gen, "decode", lambda model, state, **_: (None, None, state.cache))
    args = types.SimpleNamespace(new_tokens=new, repeats=1)
    row = throughput.decode_row(model, "full", None, context, batch, args, 1e9, False, kv_dtype)
    slots = batch * config.num_kv_heads * (context + new)  # `full` holds the prompt and the new tokens
    per_layer = slots * (2 * key_bytes + 4) + batch * config.num_kv_heads * 4  # K, V, positions; lengths
    assert row["cache_capacity"] == context + new
    assert row["bytes_per_step"] == _weights_read(config) + config.num_layers * per_layer
    assert row["fraction_of_copy_bandwidth"] == pytest.approx(row["bytes_per_step"] / (row["step_ms"] / 1e3) / 1e9)


@pytest.mark.parametrize("estimate, fits", [(121, 110), (19, 17), (3, 1)])
def test_largest_batch_after_an_out_of_memory_is_within_a_tenth_of_the_one_that_fits(monkeypatch, estimate, fits):
    """A `max` row whose estimated batch runs out of memory steps down until one runs: the batch it reports is
    within a tenth of the largest that fits (here `fits`, the oracle), not half of it, and the row names the last
    batch that failed. KIVI-2's bar is the ratio of two such batches."""
    tried = []

    def fake_row(model, name, budget, context, batch, *rest):
        tried.append(batch)
        if batch > fits:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return dict(method=name, budget=budget, context=context, batch=batch, tokens_per_s=1.0, step_ms=1.0)

    monkeypatch.setattr(throughput, "decode_row", fake_row)
    monkeypatch.setattr(throughput, "largest_batch", lambda *a, **k: estimate)
    monkeypatch.setattr(throughput.kvm, "get", lambda name, **k: None)
    monkeypatch.setattr(throughput.bu, "write", lambda *a, **k: None)
    rows: list = []
    args = types.SimpleNamespace(new_tokens=17, memory_fraction=0.9, max_batch=1024, out="-", dtype="bfloat16")
    throughput.run_row(args, types.SimpleNamespace(config=None), rows, None, None, "", None, None, 32768, False,
                       "full", None)
    (row,) = rows
    assert 0.9 * fits <= row["batch"] <= fits and tried[0] == estimate and tried[-1] == row["batch"]
    assert row["out_of_memory_at"] > fits and row["auto_batch"]


def test_a_rows_peak_memory_is_its_own_or_none(monkeypatch):
    """The device's peak memory is the process's high-water mark, never reset: a row that stays under an earlier
    row's peak has no peak of its own to report (before, a 1-row int8 row after a 19-row bf16 one reported the
    bf16 row's), and one that raises it reports it. The device here: a mark that rises with what each row holds."""
    held = {"peak": 0}
    monkeypatch.setattr(throughput, "peak_bytes", lambda: held["peak"])

    def fake_state(model, method, batch, context, new, kv_dtype=None):
        cache = throughput.gen.init_cache(method, model.config, batch, context + new, model.dtype, kv_dtype)
        held["peak"] = max(held["peak"], cache.nbytes)
        return types.SimpleNamespace(cache=cache)

    config = bu.tiny_config()
    model = DecoderLM(config, {n: jnp.zeros(s, jnp.float32) for n, s in param_shapes(config).items()},
                      dtype=jnp.float32)
    monkeypatch.setattr(throughput, "synthetic_state", fake_state)
    monkeypatch.setattr(throughput.gen, "decode", lambda model, state, **_: (None, None, state.cache))
    args = types.SimpleNamespace(new_tokens=4, repeats=1)
    big, small, bigger = (throughput.decode_row(model, "full", None, 64, batch, args, None, False)
                          for batch in (4, 1, 8))
    assert big["peak_bytes"] == big["cache_bytes"] and bigger["peak_bytes"] == bigger["cache_bytes"]
    assert small["peak_bytes"] is None and small["process_peak_bytes"] == big["cache_bytes"] > small["cache_bytes"]


def test_a_decode_loop_that_recompiles_is_not_timed():
    """`decode_profile._timed` (the step times the command-buffer A/B chooses by): a loop after the first that
    compiles (as run 14's second call did) is left out and run again, and counted. Oracle: a stand-in decode that
    compiles a fresh program and sleeps 0.2 s on its second call, 0.01 s otherwise; the old median took the 0.2 s."""
    import time

    import decode_profile
    import jax

    from kvjax import methods as kvm

    model = bu.random_model(bu.model_config("tiny"), "float32")
    calls = []

    def decode(model, state, **_):
        calls.append(1)
        if len(calls) in (1, 2):  # the first call and the second compile
            jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # a new function: a new compile
        time.sleep(0.2 if len(calls) == 2 else 0.01)
        return None, None, jnp.zeros(2)

    ms, compiles = decode_profile._timed(model, kvm.get("full"), 64, 5, repeats=2, decode=decode)
    assert compiles == 1 and len(calls) == 4  # the first call, the compiling one, two timed
    assert 0.01 / 4 * 1e3 <= ms < 0.1 / 4 * 1e3  # 10 ms over the loop's 4 steps, never the 200 ms call's
