"""DuoAttention: the pattern loader (round trip on generated files in the official layout, clear refusals) and kept
positions against a NumPy reference written from the paper (streaming heads = the lowest-scoring heads or those
below a threshold; they keep sinks + a recent window, retrieval heads everything), at prefill, in a ragged batch,
through decode (streaming heads evict their oldest non-sink token) and in the cache's per-layer allocation."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from baseline_refs import Batch, assert_batch_equals_loop, kept, run_prefill
from learned_files import duo_pattern, head_scores
from tiny import random_prompts, tiny_model

import kvjax
from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.base import CacheSpec
from kvjax.methods.duo_attention import load_attention_pattern, write_attention_pattern
from kvjax.runtime import step
from kvjax.runtime.generate import TRACE_COUNTS


def ref_streaming(scores: np.ndarray, ratio: float | None = None, threshold: float | None = None) -> np.ndarray:
    """The paper's split: a head streams when its (clipped) gate is among the `round(L K r)` lowest, or below the
    threshold. Loops, float64."""
    s = np.clip(np.asarray(scores, np.float64), 0, 1)
    flat = [(s[i, j], i, j) for i in range(s.shape[0]) for j in range(s.shape[1])]
    out = np.zeros(s.shape, bool)
    if threshold is not None:
        for v, i, j in flat:
            out[i, j] = v < threshold
        return out
    for _, i, j in sorted(flat)[: round(len(flat) * ratio)]:
        out[i, j] = True
    return out


def ref_kept(positions: list[int], streaming: bool, sink: int, recent: int) -> list[int]:
    """Streaming head: positions below `sink` and the `recent` newest other positions; else everything."""
    if not streaming:
        return sorted(positions)
    sinks = [p for p in positions if p < sink]
    others = sorted(p for p in positions if p >= sink)
    return sorted(sinks + others[max(0, len(others) - recent):])


def _prefill_window(n: int, sink: int, recent: int) -> list[int]:
    return sorted({p for p in range(n) if p < sink or p > n - 1 - recent})


def test_pattern_round_trip(tmp_path):
    scores = np.array([[0.25, -0.01, 1.5], [0.75, 0.5, 0.125]])
    write_attention_pattern(tmp_path, scores, sink_size=64, recent_size=256, model_name="models/Meta-Llama-3.1-8B")
    text = (tmp_path / "full_attention_heads.tsv").read_text().splitlines()
    assert len(text) == 2 and all(len(row.split("\t")) == 3 for row in text)  # one row per layer, tab-separated
    got = load_attention_pattern(tmp_path)
    np.testing.assert_array_equal(got.scores, np.clip(scores, 0, 1))
    assert (got.sink_size, got.recent_size, got.model_name) == (64, 256, "models/Meta-Llama-3.1-8B")


def test_official_config_fields_are_read(tmp_path):
    """The official config.json holds the whole training run's arguments; only the sizes and the name matter."""
    np.savetxt(tmp_path / "full_attention_heads.tsv", head_scores(3, 2), delimiter="\t")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_name": "models/Llama-3-8B", "lr": 0.02, "sink_size": 128, "recent_size": 256, "threshold": 0.5,
        "deploy_sink_size": None, "sparsity": None}))
    got = load_attention_pattern(tmp_path)
    assert got.scores.shape == (3, 2) and (got.sink_size, got.recent_size) == (128, 256)


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.75, 0.875, 1.0])
def test_streaming_heads_are_the_lowest_scores(ratio):
    scores = head_scores(4, 2)
    method = methods.get("duo_attention", patterns=duo_pattern(4, 2), head_compression_ratio=ratio)
    np.testing.assert_array_equal(method.streaming, ref_streaming(scores, ratio))
    # kvpress's evaluation passes the leaderboard ratio as compression_ratio
    alias = methods.get("duo_attention", patterns=duo_pattern(4, 2), compression_ratio=ratio) if ratio < 1 else method
    np.testing.assert_array_equal(alias.streaming, method.streaming)


def test_threshold_picks_heads_below_it():
    method = methods.get("duo_attention", patterns=duo_pattern(4, 2), threshold=0.4)
    np.testing.assert_array_equal(method.streaming, ref_streaming(head_scores(4, 2), threshold=0.4))


@pytest.mark.parametrize("ratio", [0.25, 0.75])
def test_prefill_keeps_sinks_and_window_on_streaming_heads(ratio):
    batch = Batch(kv=2)
    method = methods.get("duo_attention", patterns=duo_pattern(4, 2, sink_size=3, recent_size=5),
                         head_compression_ratio=ratio)
    streaming = ref_streaming(head_scores(4, 2), ratio)
    for layer in range(4):
        out, _, _ = run_prefill(method, batch, layer=layer)
        for b, n in enumerate(batch.lengths):
            for k in range(batch.kv):
                want = _prefill_window(int(n), 3, 5) if streaming[layer, k] else list(range(int(n)))
                assert kept(out, b, k) == want, (layer, b, k)
        assert_batch_equals_loop(method, batch, layer=layer)


def test_sizes_from_arguments_override_the_file():
    batch = Batch(kv=2)
    method = methods.get("duo_attention", patterns=duo_pattern(4, 2), head_compression_ratio=1.0, sink_size=1,
                         recent_size=3)
    out, _, _ = run_prefill(method, batch, layer=0)
    assert kept(out, 0, 0) == _prefill_window(40, 1, 3)


def test_ratio_zero_keeps_everything():
    batch = Batch(kv=2)
    out, _, _ = run_prefill(methods.get("duo_attention", patterns=duo_pattern(4, 2), head_compression_ratio=0.0),
                            batch)
    for b, n in enumerate(batch.lengths):
        assert all(kept(out, b, k) == list(range(int(n))) for k in range(2))


def test_generate_ragged_batch_against_reference():
    """End to end (prefill in one shot and in chunks, then decode): per layer and head, the kept positions equal
    the reference over every position the head saw; a layer without retrieval heads is allocated small."""
    sink, recent, new, lengths = 2, 6, 5, (31, 12, 40)
    method = methods.get("duo_attention", patterns=duo_pattern(2, 2, sink_size=sink, recent_size=recent),
                         head_compression_ratio=0.75)
    streaming = ref_streaming(head_scores(2, 2), 0.75)
    assert streaming[1].all() and not streaming[0].all()  # layer 1 streams only, layer 0 is mixed
    model = tiny_model(num_layers=2)
    for chunk in (None, 16):
        before = TRACE_COUNTS["decode_step"]
        out = kvjax.generate(model, random_prompts(7, lengths), method=method, max_new_tokens=new, return_cache=True,
                             stop_at_eos=False, chunk_size=chunk)
        assert TRACE_COUNTS["decode_step"] - before <= 1
        caps = [layer.capacity for layer in out.cache.layers]
        assert caps[1] == sink + recent + 1 and caps[0] >= max(lengths) + new, caps
        for li, layer in enumerate(out.cache.layers):
            for b, n in enumerate(lengths):
                seen = list(range(n + new - 1))  # the prompt and the generated tokens fed back
                for k in range(2):
                    assert kept(layer, b, k) == ref_kept(seen, streaming[li, k], sink, recent), (chunk, li, b, k)


def test_generate_example_shorter_than_the_window():
    method = methods.get("duo_attention", patterns=duo_pattern(2, 2, sink_size=2, recent_size=6),
                         head_compression_ratio=1.0)
    out = kvjax.generate(tiny_model(num_layers=2), random_prompts(3, (3, 20)), method=method, max_new_tokens=4,
                         return_cache=True, stop_at_eos=False)
    for layer in out.cache.layers:
        assert kept(layer, 0, 0) == list(range(6))  # 3 + 3 fed back: under sinks + window, nothing evicted
        assert kept(layer, 1, 1) == ref_kept(list(range(23)), True, 2, 6)


# ---- refusals -------------------------------------------------------------------------------------------------


def test_missing_files_name_the_path(tmp_path):
    with pytest.raises(ConfigError, match="full_attention_heads.tsv"):
        methods.get("duo_attention", patterns=str(tmp_path / "nowhere"))
    write_attention_pattern(tmp_path, head_scores(2, 2), sink_size=2, recent_size=6)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        methods.get("duo_attention", patterns=str(tmp_path))
    with pytest.raises(ConfigError, match="needs patterns="):
        methods.get("duo_attention")


def test_malformed_files_are_refused(tmp_path):
    write_attention_pattern(tmp_path, head_scores(2, 2), sink_size=2, recent_size=6)
    (tmp_path / "config.json").write_text(json.dumps({"recent_size": 6}))
    with pytest.raises(ConfigError, match="sink_size"):
        methods.get("duo_attention", patterns=str(tmp_path))
    write_attention_pattern(tmp_path, head_scores(2, 2), sink_size=2, recent_size=6)
    (tmp_path / "full_attention_heads.tsv").write_text("0.5\tx\n")
    with pytest.raises(ConfigError, match="full_attention_heads.tsv"):
        methods.get("duo_attention", patterns=str(tmp_path))


@pytest.mark.parametrize("dims", [(3, 2), (2, 4)])
def test_a_pattern_for_another_model_is_refused_before_tracing(dims):
    method = methods.get("duo_attention", patterns=duo_pattern(*dims), model="tiny")
    with pytest.raises(ConfigError, match=r"full_attention_heads\.tsv.*the model 'tiny' has 2 layers"):
        kvjax.generate(tiny_model(num_layers=2), random_prompts(7, (12,)), method=method, max_new_tokens=2)
    spec = CacheSpec(batch=1, kv_heads=2, capacity=8, num_heads=4, head_dim=16, num_layers=2, dtype=jnp.float32)
    with pytest.raises(ConfigError, match="duo_"):
        step.init_cache(method, spec)


def test_model_name_mismatch_is_refused():
    with pytest.raises(ConfigError, match=r"config\.json.*models/tiny.*Llama-3-8B"):
        methods.get("duo_attention", patterns=duo_pattern(2, 2), model="meta-llama/Llama-3-8B")
    methods.get("duo_attention", patterns=duo_pattern(2, 2), model="org/TINY")  # the base name, any case


@pytest.mark.parametrize("args", [
    dict(budget=8), dict(head_compression_ratio=0.5, compression_ratio=0.5), dict(head_compression_ratio=1.5),
    dict(threshold=0.5, head_compression_ratio=0.5), dict(recent_size=0), dict(sink_size=-1),
])
def test_bad_hyperparameters(args):
    with pytest.raises(ConfigError, match="duo_attention"):
        methods.get("duo_attention", patterns=duo_pattern(2, 2), **args)


def test_one_compile_per_shape_bucket():
    """Other prompts of the same bucket (and batch) reuse the prefill and decode programs."""
    method = methods.get("duo_attention", patterns=duo_pattern(2, 2), head_compression_ratio=0.5)
    model = tiny_model(num_layers=2)
    kvjax.generate(model, random_prompts(1, (30, 20)), method=method, max_new_tokens=3)
    before = dict(TRACE_COUNTS)
    kvjax.generate(model, random_prompts(2, (25, 31)), method=method, max_new_tokens=3)
    assert TRACE_COUNTS == before
