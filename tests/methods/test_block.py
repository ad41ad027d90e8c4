"""Block (kvpress's BlockPress): kept positions against a NumPy reference of the block-by-block selection written
from kvpress's definition (the first `n_kept` positions, then each block scored together with the kept set, the
best `n_kept` kept, the base's protected tokens first) over KNorm, KeyDiff (the anchor of the scored set) and SnapKV
(the block's last queries, pooled along the kept-then-block order, with each `query_rope`); batching, generate end
to end, and the refusals."""

import math

import numpy as np
import pytest
from baseline_refs import Batch, assert_batch_equals_loop, generate_and_check, kept, pool, run_prefill, softmax
from reference_scorers import rope_matrix

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.common import QUERY_ROPE

RATIO, BLOCK = 0.6, 8


def block_select(n: int, n_kept: int, block: int, score) -> list[int]:
    """kvpress's BlockPress on one head: `score(members, start, end)` gives each member's score (a list) and the
    protected members (a set) when the block [start, end) is scored with the kept set."""
    chosen = list(range(n_kept))
    for start in range(n_kept, n, block):
        end = min(start + block, n)
        members = chosen + list(range(start, end))
        scores, protected = score(members, start, end)
        rank = [math.inf if m in protected else s for m, s in zip(members, scores, strict=True)]
        order = sorted(range(len(members)), key=lambda j: (-rank[j], j))  # best first, ties to the earlier
        chosen = [members[j] for j in order[:n_kept]]
    return sorted(chosen)


def key_scorer(batch: Batch, b: int, kh: int, base: str):
    keys = batch.k[b, :, kh].astype(np.float64)

    def score(members, start, end):
        chosen = keys[members]
        if base == "knorm":
            return [-float(np.linalg.norm(x)) for x in chosen], set()
        unit = chosen / np.linalg.norm(chosen, axis=-1, keepdims=True)
        anchor = unit.mean(0)
        return [-float(u @ anchor / np.linalg.norm(anchor)) for u in unit], set()

    return score


def snapkv_scorer(batch: Batch, b: int, kh: int, n: int, n_kept: int, window: int, kernel: int, query_rope: str):
    """SnapKV over the scored set: the block's last `window` queries (at most the block's own) vote over the
    members at or before them; the `min(window, n_kept)` latest members are protected; the others' votes are
    pooled in member order, a protected member counting as padding where it stands."""
    group = batch.n // batch.kv
    heads = range(kh * group, (kh + 1) * group)
    inv_freq = np.ones(batch.h // 2)

    def score(members, start, end):
        votes = np.zeros(len(members))
        rows = range(max(start, end - window), end)
        for p in rows:
            for head in heads:
                q = batch.q[b, p, head].astype(np.float64)
                if query_rope == "kvpress":
                    q = rope_matrix(n - end, inv_freq) @ q
                seen = [j for j, m in enumerate(members) if m <= p]
                logits = np.array([batch.k[b, members[j], kh] @ q for j in seen]) / math.sqrt(batch.h)
                votes[seen] += softmax(logits) / len(rows) / group
        protected = set(sorted(members)[-min(window, n_kept):])
        in_place = np.array([0.0 if m in protected else v for m, v in zip(members, votes, strict=True)])
        return list(pool(in_place, kernel, "avg")), protected

    return score


def n_kept_of(n: int, ratio: float = RATIO) -> int:
    return max(1, int(n * (1 - ratio)))


@pytest.mark.parametrize("base", ["knorm", "keydiff"])
def test_key_scorers_keep_the_best_of_each_block_and_the_kept_set(base):
    batch = Batch()  # prompts of 40, 23 and 31 tokens keep 16, 9 and 12: 3, 2 and 3 blocks of 8, the last partial
    out, _, _ = run_prefill(methods.get("block", compression_ratio=RATIO, block_size=BLOCK, base=base), batch)
    for b, n in enumerate(batch.lengths.tolist()):
        for kh in range(batch.kv):
            want = block_select(n, n_kept_of(n), BLOCK, key_scorer(batch, b, kh, base))
            assert kept(out, b, kh) == want, (base, b, kh)


@pytest.mark.parametrize("query_rope", QUERY_ROPE)
@pytest.mark.parametrize("block", [8, 2])
def test_snapkv_scores_each_block_with_its_own_window(query_rope, block):
    """The block's last queries vote over the kept keys and the block's; with `query_rope="kvpress"` they are first
    rotated on by the distance from the block's end to the prompt's. Blocks of 2 are shorter than the window, which
    is then the block's rows alone while the protected tokens reach into the kept set."""
    window, kernel = 3, 3
    batch = Batch()
    method = methods.get("block", compression_ratio=RATIO, block_size=block, query_rope=query_rope,
                         base_args={"window_size": window, "kernel_size": kernel})
    out, _, _ = run_prefill(method, batch)
    for b, n in enumerate(batch.lengths.tolist()):
        n_kept = n_kept_of(n)
        for kh in range(batch.kv):
            score = snapkv_scorer(batch, b, kh, n, n_kept, window, kernel, query_rope)
            assert kept(out, b, kh) == block_select(n, n_kept, block, score), (query_rope, block, b, kh)


def test_a_block_of_the_whole_prompt_is_the_base_itself():
    """One block covering everything after the first `n_kept` tokens scores the whole prompt at once: the base's own
    one-shot selection (KeyDiff's anchor is then the whole prompt's, SnapKV's window the prompt's last queries)."""
    batch = Batch()
    for base in ("keydiff", "snapkv"):
        args = {"window_size": 4} if base == "snapkv" else {}
        alone, _, _ = run_prefill(methods.get(base, compression_ratio=RATIO, **args), batch)
        blocked, _, _ = run_prefill(methods.get("block", compression_ratio=RATIO, block_size=64, base=base,
                                                base_args=args), batch)
        for b in range(len(batch.lengths)):
            for kh in range(batch.kv):
                assert kept(blocked, b, kh) == kept(alone, b, kh), (base, b, kh)


def test_budget_sizes_and_a_prompt_within_the_budget():
    method = methods.get("block", budget=12, block_size=BLOCK, base="knorm")
    out, _, _ = run_prefill(method, Batch(lengths=(40, 9, 12)))
    assert np.asarray(out.length)[:, 0].tolist() == [12, 9, 12]
    assert kept(out, 1, 0) == list(range(9)) and kept(out, 2, 1) == list(range(12))
    assert method.capacity(40, 3) == 15 and method.layer_capacities(40, 3, 4) is None


def test_batching_and_generate():
    """(Quantized storage under it: tests/quant/test_methods_quantized.py, as for every method.)"""
    assert_batch_equals_loop(methods.get("block", compression_ratio=RATIO, block_size=BLOCK, base="keydiff"),
                             Batch())
    assert_batch_equals_loop(methods.get("block", budget=10, block_size=4, base_args={"window_size": 3}), Batch())
    method = methods.get("block", compression_ratio=0.5, block_size=8, base="knorm")
    generate_and_check(method, prompt_kept=lambda layer, b: method.prompt_budget((40, 23, 31)[b]))


def test_refusals():
    with pytest.raises(ConfigError, match="query_rope"):
        methods.get("block", compression_ratio=0.5, query_rope="block")
    with pytest.raises(ConfigError, match="block_size"):
        methods.get("block", compression_ratio=0.5, block_size=0)
    with pytest.raises(ConfigError, match="expected_attention keeps statistics"):
        methods.get("block", compression_ratio=0.5, base="expected_attention")
    with pytest.raises(ConfigError, match="reads attention_lse"):
        methods.get("block", compression_ratio=0.5, base="observed_attention")
    for base in ("compactor", "non_causal_attention"):
        with pytest.raises(ConfigError, match=f"{base} scores every token with its own query"):
            methods.get("block", compression_ratio=0.5, base=base)
    with pytest.raises(ConfigError, match="chunked prefill"):
        generate_and_check(methods.get("block", compression_ratio=0.5, block_size=8, base="knorm"), chunk_size=16)
