"""Chunk (kvpress's ChunkPress): kept positions against NumPy references of the base scoring each chunk alone
(KNorm, KeyDiff's per-chunk anchor, SnapKV's window of the chunk's own queries), each chunk's share, batching,
a quantized cache, generate end to end, and the refusals (a budget, a stateful base, chunked prefill)."""

import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    generate_and_check,
    kept,
    run_prefill,
    snapkv_keep,
    top_positions,
    window_votes,
)
from reference_scorers import keydiff, rope_matrix

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.chunk import QUERY_ROPE, chunk_shares

RATIO, CHUNK = 0.6, 8


def shares(n: int, chunk: int = CHUNK, ratio: float = RATIO) -> list[tuple[int, int]]:
    """`(start, tokens kept)` of each chunk of a prompt of `n` tokens, as kvpress counts them."""
    return [(s, max(1, int(min(chunk, n - s) * (1 - ratio)))) for s in range(0, n, chunk)]


def per_chunk(batch: Batch, b: int, kh: int, keep_of_chunk, ratio: float = RATIO) -> list[int]:
    n = int(batch.lengths[b])
    out = []
    for s, share in shares(n, ratio=ratio):
        m = min(CHUNK, n - s)
        out += [s + j for j in keep_of_chunk(s, m, share)]
    return sorted(out)


@pytest.mark.parametrize("base", ["knorm", "keydiff"])
def test_key_scorers_keep_each_chunks_best(base):
    batch = Batch()  # prompts of 40, 23 and 31 tokens: chunks of 8, the last partial but in the first
    out, _, _ = run_prefill(methods.get("chunk", compression_ratio=RATIO, chunk_length=CHUNK, base=base), batch)
    for b in range(len(batch.lengths)):
        for kh in range(batch.kv):
            def best(s, m, share, b=b, kh=kh):
                keys = batch.k[b, s : s + m, kh].astype(np.float64)
                if base == "knorm":
                    row = {j: -float(np.linalg.norm(keys[j])) for j in range(m)}
                else:  # the anchor is the chunk's mean unit key
                    scores = keydiff(batch.k[b, s : s + m].astype(np.float64), m)
                    row = dict(enumerate(scores[kh]))
                return top_positions(row, share)

            assert kept(out, b, kh) == per_chunk(batch, b, kh, best), (base, b, kh)


@pytest.mark.parametrize("query_rope", QUERY_ROPE)
def test_snapkv_scores_each_chunk_with_its_own_window(query_rope):
    """The chunk's last queries vote over its keys; with `query_rope="kvpress"` they are first rotated on by the
    distance from the chunk's end to the prompt's (as kvpress's SnapKV rotates them with the prompt's last rows)."""
    window, kernel, ratio = 3, 3, 0.25  # a share of 6 of 8: the window and 3 tokens by their votes
    batch = Batch()
    method = methods.get("chunk", compression_ratio=ratio, chunk_length=CHUNK, query_rope=query_rope,
                         base_args={"window_size": window, "kernel_size": kernel})
    out, _, step = run_prefill(method, batch)
    inv_freq = np.asarray(step.inv_freq, np.float64)
    for b in range(len(batch.lengths)):
        n = int(batch.lengths[b])
        for kh in range(batch.kv):
            def snap(s, m, share, b=b, kh=kh, n=n):
                pos = np.arange(m)[None]
                q = batch.q[b : b + 1, s : s + m].astype(np.float64)
                if query_rope == "kvpress":
                    q = q @ rope_matrix(n - (s + m), inv_freq).T
                k = batch.k[b : b + 1, s : s + m].transpose(0, 2, 1, 3)
                votes = window_votes(q, pos, k, np.broadcast_to(pos[:, None], k.shape[:3]),
                                     np.ones(k.shape[:3], bool), window, row_reduce="mean")
                return snapkv_keep(votes[0, kh], m, share, window, kernel, "avg")

            assert kept(out, b, kh) == per_chunk(batch, b, kh, snap, ratio), (query_rope, b, kh)


def test_shares_and_the_budget_the_cache_is_sized_for():
    method = methods.get("chunk", compression_ratio=RATIO, chunk_length=CHUNK, base="knorm")
    for n in (1, 7, 8, 9, 23, 40):
        want = sum(share for _, share in shares(n))
        assert method.prompt_budget(n) == want
        got = chunk_shares(np.asarray([n]), CHUNK, -(-n // CHUNK), RATIO)
        assert np.asarray(got)[0].tolist() == [share for _, share in shares(n)]
    out, _, _ = run_prefill(method, Batch())
    assert np.asarray(out.length)[:, 0].tolist() == [method.prompt_budget(n) for n in (40, 23, 31)]
    for ratio in (0.1, 0.3, 0.7, 0.9):  # kvpress's float64 int(), which float32 arithmetic can miss by one
        got = np.asarray(chunk_shares(np.asarray([40]), 16, 3, ratio))[0].tolist()
        assert got == [max(1, int(m * (1 - ratio))) for m in (16, 16, 8)], ratio


def test_batching_and_generate():
    """(Quantized storage under it: tests/quant/test_methods_quantized.py, as for every method.)"""
    assert_batch_equals_loop(methods.get("chunk", compression_ratio=RATIO, chunk_length=CHUNK, base="keydiff"),
                             Batch())
    method = methods.get("chunk", compression_ratio=0.5, chunk_length=16, base="knorm")
    generate_and_check(method, prompt_kept=lambda layer, b: method.prompt_budget((40, 23, 31)[b]))


def test_refusals():
    with pytest.raises(ConfigError, match="give compression_ratio"):
        methods.get("chunk", budget=12)
    with pytest.raises(ConfigError, match="query_rope"):
        methods.get("chunk", compression_ratio=0.5, query_rope="chunk")
    with pytest.raises(ConfigError, match="chunk_length"):
        methods.get("chunk", compression_ratio=0.5, chunk_length=0)
    with pytest.raises(ConfigError, match="expected_attention keeps statistics"):
        methods.get("chunk", compression_ratio=0.5, base="expected_attention")
    with pytest.raises(ConfigError, match="reads"):
        methods.get("chunk", compression_ratio=0.5, base="observed_attention")
    with pytest.raises(ConfigError, match="chunked prefill"):
        generate_and_check(methods.get("chunk", compression_ratio=0.5, chunk_length=8, base="knorm"), chunk_size=16)
