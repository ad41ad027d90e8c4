"""NonCausalAttention: kept positions against a NumPy float64 reference of kvpress's `NonCausalAttnPress` (chunk
votes from position 0, each treatment of a partial last chunk, times `||v||`, pooled over 3, z-scored over the
example's heads), batching, Ada-KV over it, generate end to end, and the refusal of a chunked prefill."""

import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    assert_keeps_everything,
    assert_same_set,
    generate_and_check,
    kept,
    run_prefill,
)
from reference_scorers import non_causal_attention

from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.common import PARTIAL_CHUNK

BUDGET = 11


@pytest.mark.parametrize("partial", [None, *PARTIAL_CHUNK])
@pytest.mark.parametrize("chunk", [8, 64])
def test_keeps_the_reference_scores(partial, chunk):
    """Prompts of 40, 23 and 31 tokens: chunks of 8 end each in a partial chunk but the first; one chunk of 64 is
    partial for every example."""
    batch = Batch()
    args = {"chunk_size": chunk} | ({} if partial is None else {"partial_chunk": partial})
    out, _, _ = run_prefill(methods.get("non_causal_attention", budget=BUDGET, **args), batch)
    for b, n in enumerate(batch.lengths):
        scores = non_causal_attention(batch.q[b].astype(np.float64), batch.k[b].astype(np.float64),
                                      batch.v[b].astype(np.float64), int(n), chunk=chunk, partial=partial or "fill")
        for k in range(batch.kv):
            row = dict(enumerate(scores[k]))
            want = sorted(sorted(row, key=lambda j: (-row[j], j))[:BUDGET])
            assert_same_set(kept(out, b, k), want, row, tol=1e-3)


def test_the_attention_is_compactors():
    """With no sinks and no leverage (`blending=0`), Compactor keeps what this method keeps."""
    batch = Batch()
    alone, _, _ = run_prefill(methods.get("non_causal_attention", budget=BUDGET, chunk_size=8), batch)
    blended, _, _ = run_prefill(methods.get("compactor", budget=BUDGET, chunk_size=8, blending=0.0,
                                            sink_size_start=0, sink_size_end=0), batch)
    for b in range(len(batch.lengths)):
        for k in range(batch.kv):
            assert kept(alone, b, k) == kept(blended, b, k)


def test_batching_adakv_and_a_budget_above_the_prompt():
    batch = Batch()
    assert_batch_equals_loop(methods.get("non_causal_attention", compression_ratio=0.6, chunk_size=8), batch)
    assert_keeps_everything(methods.get("non_causal_attention", budget=50, chunk_size=8), batch)
    out, _, _ = run_prefill(methods.get("adakv", budget=12, base="non_causal_attention",
                                        base_args={"chunk_size": 8}), batch)
    lengths = np.asarray(out.length)  # the z-scores compare across heads: they get different counts
    assert (lengths.sum(axis=1) == batch.kv * 12).all() and (lengths[:, 0] != lengths[:, 1]).any()


def test_generate_end_to_end():
    generate_and_check(methods.get("non_causal_attention", budget=9, chunk_size=8),
                       prompt_kept=lambda layer, b: 9)


def test_chunked_prefill_and_bad_hyperparameters_are_refused():
    with pytest.raises(ConfigError, match="chunked prefill"):
        generate_and_check(methods.get("non_causal_attention", budget=12, chunk_size=8), chunk_size=16)
    with pytest.raises(ConfigError, match="chunk_size"):
        methods.get("non_causal_attention", budget=12, chunk_size=0)
    with pytest.raises(ConfigError, match="partial_chunk"):
        methods.get("non_causal_attention", budget=12, partial_chunk="pad")
    with pytest.raises(ConfigError, match="budget"):
        methods.get("non_causal_attention")
