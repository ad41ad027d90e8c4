"""SimLayerKV: the laziness score and the kept positions against a NumPy float64 reference, per example of a ragged
batch; off by default and for short prompts; batching; chunked prefill deciding as the one-shot prefill does."""

import jax
import numpy as np
import pytest
from baseline_refs import (
    Batch,
    assert_batch_equals_loop,
    assert_keeps_everything,
    generate_and_check,
    kept,
    run_prefill,
)
from reference_scorers import simlayerkv

import kvjax
from kvjax import methods
from kvjax.errors import ConfigError
from kvjax.methods.simlayerkv import prompt_ends_here


def reference(batch, **args):
    return [simlayerkv(batch.q[b].astype(np.float64), batch.k[b].astype(np.float64), int(n), **args)
            for b, n in enumerate(batch.lengths)]


@pytest.mark.parametrize("args", [dict(n_recent=8, n_initial=2), dict(n_last=3, n_recent=6, n_initial=4),
                                  dict(n_last=2, n_recent=20, n_initial=1)])
def test_lazy_layers_keep_the_reference_positions(args):
    batch = Batch(lengths=(40, 23, 31, 36))
    min_length = args["n_initial"] + args["n_recent"] + args.get("n_last", 1)
    eligible = sorted(s for (s, _), n in zip(reference(batch, **args), batch.lengths, strict=True) if n > min_length)
    # a threshold between two examples' scores: some examples' layer is lazy, some not
    threshold = float((eligible[0] + eligible[1]) / 2)
    method = methods.get("simlayerkv", lazy_threshold=threshold, **args)
    out, cache, step = run_prefill(method, batch)
    _, n = prompt_ends_here(step)
    got = np.asarray(jax.jit(method.laziness)(cache, batch.qj(), step, n))
    lazy = trimmed = 0
    for b, (score, want) in enumerate(reference(batch, lazy_threshold=threshold, **args)):
        if batch.lengths[b] > min_length:
            np.testing.assert_allclose(got[b], score, rtol=1e-5, atol=1e-6)
            lazy += score > threshold
        trimmed += len(want) < batch.lengths[b]
        for k in range(batch.kv):
            assert kept(out, b, k) == want, (b, k)
    assert 0 < lazy == trimmed < len(eligible)


def test_threshold_one_and_short_prompts_keep_everything():
    assert_keeps_everything(methods.get("simlayerkv"), Batch())
    assert_keeps_everything(methods.get("simlayerkv", lazy_threshold=1.0, n_recent=4), Batch())
    # n <= n_initial + n_recent + n_last is never trimmed, even at threshold 0
    assert_keeps_everything(methods.get("simlayerkv", lazy_threshold=0.0, n_recent=35, n_initial=4), Batch())


def test_threshold_zero_trims_every_long_prompt():
    batch = Batch()
    out, _, _ = run_prefill(methods.get("simlayerkv", lazy_threshold=0.0, n_recent=10, n_initial=3), batch)
    for b, n in enumerate(batch.lengths):
        for k in range(batch.kv):
            assert kept(out, b, k) == [0, 1, 2, *range(n - 9, n)]


def test_batch_equals_loop():
    batch = Batch(lengths=(40, 23, 31, 36))
    scores = sorted(s for s, _ in reference(batch, n_recent=8, n_initial=2))
    method = methods.get("simlayerkv", lazy_threshold=float((scores[1] + scores[2]) / 2), n_recent=8, n_initial=2)
    assert_batch_equals_loop(method, batch)


def test_bad_hyperparameters():
    for args, field in [(dict(lazy_threshold=1.5), "lazy_threshold"), (dict(lazy_threshold=-0.1), "lazy_threshold"),
                        (dict(n_last=0), "n_last"), (dict(n_initial=-1), "n_initial"),
                        (dict(n_recent=1), "n_recent"), (dict(n_recent=3, n_last=3), "n_recent"),
                        (dict(budget=8), "lazy_threshold="), (dict(compression_ratio=0.5), "lazy_threshold=")]:
        with pytest.raises(ConfigError, match=field):
            methods.get("simlayerkv", **args)


def test_end_to_end_chunked_generate_trims_long_prompts():
    # threshold 0: every layer of a prompt longer than 2 + 8 + 1 is lazy; 32 ends exactly on a chunk boundary
    lengths = (40, 32, 23, 10)
    method = methods.get("simlayerkv", lazy_threshold=0.0, n_recent=8, n_initial=2)
    generate_and_check(method, lengths, chunk_size=16,
                       prompt_kept=lambda layer, b: 2 + 7 if lengths[b] > 11 else lengths[b])


@pytest.mark.parametrize("threshold", [0.3, 0.5])
def test_chunked_prefill_decides_as_one_shot(threshold):
    from tiny import tiny_model

    model = tiny_model(num_heads=8, num_kv_heads=2, num_layers=3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (40, 32, 23)]
    method = methods.get("simlayerkv", lazy_threshold=threshold, n_recent=8, n_initial=2)
    held = [kvjax.cache.positions_kept(kvjax.generate(model, prompts, method=method, max_new_tokens=1,
                                                      return_cache=True, chunk_size=chunk).cache)
            for chunk in (None, 16)]
    assert held[0] == held[1]
    counts = {len(layer[b][0]) for layer in held[0] for b in range(3)}
    assert 9 in counts and len(counts) > 1  # some layers lazy, some not
