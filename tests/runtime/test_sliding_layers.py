"""Sliding-window layers as rings of their window (Gemma 3's local layers, Mistral / Phi-3 with a window) and
compression on a model that mixes them with full-attention layers.

Oracles: a NumPy reference of what a ring of C slots must hold after any sequence of chunks and tokens (the last C
positions, each at slot `p % C`, with its key); the plain forward's argmax, teacher-forced, for greedy decoding
with the full cache; the same model without a window when the sequence never outgrows it; `generate.prefill` for
the shared-prefill replay. Every registered method runs on a tiny Gemma-3-style model (a local layer, then a
global one; ragged batch; chunked prefill where the method allows it): the global layer is the method's cache,
the local layer keeps exactly the last `window` positions of each example.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import numpy as np
import pytest
from golden_cases import CHUNKED, FEW, METHODS, every_method
from learned_files import FILE_METHODS, for_model
from tiny import random_prompts, tiny_gemma3, tiny_model

import kvjax
from kvjax import cache as kvc
from kvjax import methods
from kvjax.errors import KvjaxError
from kvjax.methods.base import Method
from kvjax.models.config import RopeConfig
from kvjax.runtime.generate import bucket_length
from kvjax.runtime.stages import cache_layer_capacities

WINDOW = 8
PROMPTS = (31, 12, 40)
NEW = 9


def _ring_reference(capacity: int, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """What a ring of `capacity` slots holds after writing positions 0.. of each row: `pos [B, C]`, -1 empty."""
    pos = np.full((len(rows), capacity), -1)
    for b, written in enumerate(rows):
        for p in written:
            pos[b, p % capacity] = p
    return pos, np.minimum([len(r) for r in rows], capacity)


@pytest.mark.parametrize("capacity", [5, 8])
def test_ring_append_holds_the_last_positions(capacity):
    """Chunks of several sizes (one longer than the ring), ragged rows padded with -1, then single tokens."""
    rng = np.random.default_rng(capacity)
    batch, heads, dim = 2, 2, 4
    ring = kvc.init(batch, heads, capacity, dim, np.float32)
    keys = rng.standard_normal((batch, 64, heads, dim)).astype(np.float32)
    written: list[list[int]] = [[], []]
    for sizes in ((3, 2), (11, 7), (1, 0), (4, 4), (1, 1), (1, 1)):
        t = max(sizes)
        positions = np.full((batch, t), -1, np.int32)
        k = np.zeros((batch, t, heads, dim), np.float32)
        for b, n in enumerate(sizes):
            start = len(written[b])
            positions[b, :n] = np.arange(start, start + n)
            k[b, :n] = keys[b, start : start + n]
            written[b] += list(range(start, start + n))
        ring = kvc.ring_append(ring, k, k, positions)
        want_pos, want_len = _ring_reference(capacity, written)
        np.testing.assert_array_equal(np.asarray(ring.pos)[:, 0], want_pos)
        np.testing.assert_array_equal(np.asarray(ring.length), np.repeat(want_len[:, None], heads, 1))
        for b in range(batch):
            for slot, p in enumerate(want_pos[b]):
                if p >= 0:
                    np.testing.assert_array_equal(np.asarray(ring.k)[b, :, slot], keys[b, p])
        # The packed layout every other op reads: the valid slots are [0, length).
        valid = np.asarray(kvc.valid_mask(ring))
        np.testing.assert_array_equal(valid, np.arange(capacity) < np.asarray(ring.length)[..., None])


def test_full_cache_on_a_mixed_model_matches_the_forward():
    """Greedy decoding through the ring (window 8; prompts of 31, 12 and 40 tokens, 9 new) and the global layer's
    full cache equals the plain forward's teacher-forced argmax (one right-padded forward of every sequence)."""
    model = tiny_gemma3(window=WINDOW)
    prompts = random_prompts(7, PROMPTS)
    out = kvjax.generate(model, prompts, max_new_tokens=NEW, stop_at_eos=False)
    seqs = [p + t[:-1].tolist() for p, t in zip(prompts, out.tokens, strict=True)]
    width = max(map(len, seqs))
    ids = np.zeros((len(seqs), width), np.int32)
    positions = np.full((len(seqs), width), -1, np.int32)
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)], positions[b, : len(seq)] = seq, np.arange(len(seq))
    logits = np.asarray(model(ids, positions)[0])
    for b, prompt in enumerate(prompts):
        want = logits[b, len(prompt) - 1 : len(seqs[b])].argmax(-1)
        np.testing.assert_array_equal(out.tokens[b], want)


def test_a_sequence_shorter_than_the_window_gets_a_ring_of_its_own_length():
    """Window 64, prompt bucket 16 + 2 new tokens: 18 slots, and the same tokens as the model without a window."""
    windowed, plain = tiny_model(model_type="mistral", sliding_window=64), tiny_model(model_type="mistral")
    prompts = random_prompts(3, (3, 5))
    state = kvjax.prefill(windowed, prompts, max_new_tokens=2)
    assert [layer.capacity for layer in state.cache.layers] == [18, 18]
    got = kvjax.generate(windowed, prompts, max_new_tokens=2, stop_at_eos=False).tokens
    np.testing.assert_array_equal(got, kvjax.generate(plain, prompts, max_new_tokens=2, stop_at_eos=False).tokens)


def test_question_after_compression_fits_the_ring():
    """A question fed after compression (kvpress's query-agnostic layout) goes through the ring like the prompt:
    with the full cache it equals the question appended to the prompt."""
    model = tiny_gemma3(window=WINDOW)
    prompts, questions = random_prompts(7, (20, 9)), random_prompts(11, (5, 0))
    got = kvjax.generate(model, prompts, question_ids=questions, max_new_tokens=4, stop_at_eos=False)
    joined = [p + q for p, q in zip(prompts, questions, strict=True)]
    want = kvjax.generate(model, joined, max_new_tokens=4, stop_at_eos=False)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_shared_prefill_replay_on_a_mixed_model():
    from kvjax.runtime import decode, shared_prefill

    model = tiny_gemma3(window=WINDOW)
    prompts = random_prompts(7, PROMPTS)
    method = methods.get("snapkv", **METHODS["snapkv"])
    rec = shared_prefill.record(model, prompts)
    tokens, _, cache = decode(model, shared_prefill.prefill_from(model, rec, method, max_new_tokens=NEW),
                              max_new_tokens=NEW)
    want = kvjax.generate(model, prompts, method=method, max_new_tokens=NEW, return_cache=True)
    np.testing.assert_array_equal(np.asarray(tokens), want.tokens)
    assert kvc.positions_kept(cache) == kvc.positions_kept(want.cache)


def test_a_method_sees_the_global_layers_as_its_model():
    """On layers (local, global, local, local, global) a method's hooks run on the two global layers only, as
    layers 0 and 1 of 2 (PyramidKV's schedule, Quest's dense layers and ActQKV's budget run over them)."""
    seen: list[tuple[int, int]] = []

    @dataclasses.dataclass(frozen=True)
    class Probe(Method):  # keeps everything; reports the layer index and count its prefill hook is given
        name: ClassVar[str] = "probe"

        def prefill(self, cache, q, step):
            jax.debug.callback(lambda layer, n=step.num_layers: seen.append((int(layer), n)), step.layer)
            return super().prefill(cache, q, step)

    types = ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention")
    model = tiny_gemma3(num_layers=5, layer_types=types)
    kvjax.prefill(model, random_prompts(1, (20,)), method=Probe(), max_new_tokens=1)
    jax.effects_barrier()
    assert seen == [(0, 2), (1, 2)]


def _check_layers(name: str, cache, lengths, new: int, method) -> None:
    """The local layer: exactly the last `WINDOW` positions written of each example (all KV heads); the global
    layer: the method's own cache, allocated at its capacity (its own size where the method sizes each layer: the
    model's one global layer), holding only positions of the sequence."""
    kept = kvc.positions_kept(cache)
    for b, n in enumerate(lengths):
        last = n + new - 1  # the last generated token is not fed back
        assert all(heads == list(range(last - WINDOW, last)) for heads in kept[0][b]), (name, b, kept[0][b])
        assert all(set(heads) <= set(range(last)) for heads in kept[1][b]), name
    assert cache.layers[0].capacity == WINDOW
    bucket = bucket_length(max(lengths))
    own = cache_layer_capacities(method, bucket, new, 1)
    assert cache.layers[1].capacity == (own[0] if own else method.capacity(bucket, new)), name


@pytest.mark.parametrize("name", every_method(methods.available()))
def test_every_method_runs_on_a_mixed_model(name):
    """Ragged batch of three; prefill in chunks of 16 (across the window of 8) where the method allows it, else
    one shot or the method's own window (the one-shot rings are covered above)."""
    model = tiny_gemma3(window=WINDOW)
    prompts = random_prompts(7, PROMPTS)
    args = dict(METHODS[name])
    if "compression_ratios" in args:  # one per layer the method manages: this model has one global layer
        args["compression_ratios"] = args["compression_ratios"][: model.config.method_layers]
    if name in FILE_METHODS:  # a learned file per layer the method manages
        args = for_model(name, args, model.config.method_layers)
    method = methods.get(name, **args)
    out = kvjax.generate(model, prompts, method=method, max_new_tokens=NEW, return_cache=True, stop_at_eos=False,
                         chunk_size=16 if name in CHUNKED else None)
    assert out.tokens.shape == (3, NEW) and (out.tokens >= 0).all() and (out.tokens < 96).all()
    _check_layers(name, out.cache, PROMPTS, NEW, method)


@pytest.mark.parametrize("name", sorted({*FILE_METHODS, "per_layer"}))
def test_a_file_or_list_for_every_layer_is_refused_on_a_mixed_model(name):
    """A learned file (or `per_layer`'s ratios) holds one entry per layer the method manages, the global layers on
    a model with sliding-window layers (docs/models.md): one made for the model's every layer is refused before
    anything is traced, not read with the rows shifted."""
    model = tiny_gemma3(num_layers=3, window=WINDOW)
    assert model.config.method_layers == 1
    args = dict(METHODS[name])
    if name == "per_layer":
        args["compression_ratios"] = (0.5,) * model.config.num_layers
    else:
        args = for_model(name, args, model.config.num_layers)
    with pytest.raises(KvjaxError):
        kvjax.generate(model, random_prompts(7, PROMPTS[:1]), method=methods.get(name, **args), max_new_tokens=1)


def _family_model(family: str):
    """Tiny Qwen3 (QK-norm) or Phi-3 (LongRoPE, its long factors in force past 32 positions) model: the other
    families' configurations of the block, without windows."""
    if family == "qwen3":
        return tiny_model(model_type="qwen3")
    half = 16 // 2  # head_dim 16: one factor per rotary frequency
    longrope = RopeConfig(theta=10000.0, rope_type="longrope", original_max_position_embeddings=32,
                          short_factor=tuple(1.0 + 0.1 * i for i in range(half)),
                          long_factor=tuple(1.0 + 0.5 * i for i in range(half)))
    return tiny_model(model_type="phi3", rope=longrope)


# Each method on one of the two families, alternating in name order, so that both families meet every kind of
# method (half the compiles of running all on both: the family changes the projections and the rotary angles
# before a method sees q / k, not the method's own code).
FAMILY = {name: ("qwen3", "phi3")[i % 2] for i, name in enumerate(methods.available())}


def test_the_alternation_gives_each_family_a_share():
    """Both families run a third of the methods or more, chunked prefill among them on each."""
    for family in ("qwen3", "phi3"):
        assert sum(f == family for f in FAMILY.values()) >= len(FAMILY) // 3, family
        assert sum(FAMILY.get(name) == family for name in CHUNKED) >= 3, family


@pytest.mark.parametrize("name", every_method(methods.available(), FEW))
def test_every_method_runs_on_qwen3_or_phi3(name):
    """Every method end to end on another family (`FAMILY`: Qwen3 or Phi-3; ragged batch of three, chunked where
    allowed): tokens in range, every layer's kept positions real and within its capacity."""
    args = dict(METHODS[name])
    family = FAMILY[name]
    model = _family_model(family)
    if "compression_ratios" in args:
        args["compression_ratios"] = (list(args["compression_ratios"]) * model.config.num_layers)[
            : model.config.num_layers]
    method = methods.get(name, **args)
    out = kvjax.generate(model, random_prompts(11, PROMPTS), method=method, max_new_tokens=4, return_cache=True,
                         stop_at_eos=False, chunk_size=16 if name in CHUNKED else None)
    assert out.tokens.shape == (3, 4) and (out.tokens >= 0).all() and (out.tokens < 96).all(), family
    for layer in out.cache.layers:
        assert (np.asarray(layer.length) <= layer.capacity).all(), (name, family)
        for b, n in enumerate(PROMPTS):
            for heads in kvc.positions_kept(layer)[b]:
                assert set(heads) <= set(range(n + 3)), (name, family, b)
