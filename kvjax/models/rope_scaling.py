"""RoPE inverse frequencies for the ``rope_type``s kvjax supports: default, linear, llama3, yarn, longrope, and
kvjax's own freq_factors (llama.cpp's per-frequency factors: each base frequency divided by its factor).

The maths follows transformers' rope initialisers step by step in float32 (python floats for the
scalar parts), so the frequencies equal Hugging Face's to within an ulp. Positions are
rotated in HF's rotate-half layout by :mod:`kvjax.rope`; this module only computes frequencies.
"""

from __future__ import annotations

import math

import numpy as np

from kvjax.models.config import ModelConfig, RopeConfig

__all__ = ["longrope_uses_long", "rope_frequencies", "rope_frequencies_for"]


def _pos_freqs(theta: float, dim: int) -> np.ndarray:
    """``theta ** (arange(0, dim, 2) / dim)`` rounded to float32.

    The exponents are float32 as in HF; the power is taken in float64 and rounded once, which is
    what torch's float32 ``pow`` returns except for rare 1-ulp differences.
    """
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float64(theta) ** exponents.astype(np.float64)).astype(np.float32)


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    """``1 / theta ** (arange(0, dim, 2) / dim)`` in float32, as HF computes it."""
    return np.float32(1.0) / _pos_freqs(theta, dim)


def _llama3(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    inv_freq = _base_inv_freq(rope.theta, dim)
    factor = rope.factor
    low_freq_factor = rope.low_freq_factor
    high_freq_factor = rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    assert factor is not None and low_freq_factor is not None
    assert high_freq_factor is not None and old_context_len is not None
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept, and the band
    # in between interpolated smoothly.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(old_context_len) / wavelen - np.float32(low_freq_factor)) / np.float32(
        high_freq_factor - low_freq_factor
    )
    smoothed = (np.float32(1.0) - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0


def _yarn(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    base = rope.theta
    original_max = rope.original_max_position_embeddings
    assert original_max is not None
    factor = rope.factor
    if factor is None:  # HF: the ratio of the extended to the pretrained context
        factor = max_position_embeddings / original_max

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1
    truncate = True if rope.truncate is None else rope.truncate

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = _pos_freqs(base, dim)
    inv_freq_extrapolation = np.float32(1.0) / pos_freqs
    inv_freq_interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    ramp = np.clip(ramp, np.float32(0.0), np.float32(1.0))
    extrapolation_factor = np.float32(1.0) - ramp
    inv_freq = (
        inv_freq_interpolation * (np.float32(1.0) - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq.astype(np.float32), float(attention_factor)


def longrope_uses_long(rope: RopeConfig, length: int | None) -> bool:
    """Whether LongRoPE rotates a sequence of `length` tokens with its long factors: past the pretrained context,
    as transformers decides from the positions of a forward call."""
    assert rope.original_max_position_embeddings is not None
    return length is not None and length > rope.original_max_position_embeddings


def _longrope(rope: RopeConfig, dim: int, max_position_embeddings: int, length: int | None) -> tuple[np.ndarray, float]:
    original = rope.original_max_position_embeddings
    assert original is not None and rope.short_factor is not None and rope.long_factor is not None
    factor = rope.factor if rope.factor is not None else max_position_embeddings / original
    attention_factor = rope.attention_factor
    if attention_factor is None:  # the paper's suggestion, as transformers takes it
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(rope.long_factor if longrope_uses_long(rope, length) else rope.short_factor, np.float32)
    return (np.float32(1.0) / (ext * _pos_freqs(rope.theta, dim))).astype(np.float32), float(attention_factor)


def rope_frequencies_for(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int, length: int | None = None
) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the attention scaling for ``rope``.

    The scaling multiplies cos and sin (HF's ``attention_scaling``): yarn's mscale-derived factor and LongRoPE's
    attention factor, 1.0 for the other types. ``length``: the longest sequence the frequencies will rotate, for
    LongRoPE's choice of factors (None: the short ones).
    """
    if rope.rope_type == "longrope":
        return _longrope(rope, head_dim, max_position_embeddings, length)
    if rope.rope_type == "default":
        return _base_inv_freq(rope.theta, head_dim), 1.0
    if rope.rope_type == "linear":
        assert rope.factor is not None
        return _base_inv_freq(rope.theta, head_dim) / np.float32(rope.factor), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, head_dim)
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim, max_position_embeddings)
    if rope.rope_type == "freq_factors":
        assert rope.freq_factors is not None
        return _base_inv_freq(rope.theta, head_dim) / np.asarray(rope.freq_factors, np.float32), 1.0
    raise AssertionError(f"unreachable rope_type {rope.rope_type!r}")  # RopeConfig validates it


def rope_frequencies(
    config: ModelConfig, length: int | None = None, *, local: bool = False
) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32) and attention scaling for a model: of its global layers,
    or with ``local`` of its sliding-window layers (their own RoPE where the config gives one)."""
    rope = config.rope_local if local and config.rope_local is not None else config.rope
    return rope_frequencies_for(rope, config.head_dim, config.max_position_embeddings, length)
