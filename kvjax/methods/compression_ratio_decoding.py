"""`compression_ratio_decoding`: decode-time compression to a share of the tokens seen (kvpress's
`CompressionRatioDecodingPress`). It is `decoding` (every `compression_interval` generated tokens, 512, the cache is
cut back by the base's scores, "knorm") with a target that grows with the sequence:
`max(1, int(seen * (1 - target_compression_ratio)))` pairs (0.5), `seen` counting every token so far, kept or evicted.
As in kvpress, while that target is one pair the cache is compressed after every token. Defaults are kvpress 0.5.5's.

The target is kvpress's to the token. kvpress computes `seen * (1 - ratio)` in float64, and the rounding shows:
`1 - 0.8` is 0.19999999999999996, so at 1,000 tokens seen it keeps `int(199.99999999999994) = 199` pairs, where
the exact product is 200 (and so at every multiple of 5 tokens). A traced program has no float64 here, so the
product is taken in int32: `1 - ratio` is a fraction `a / D` with `D <= 10,000` plus an error `e` of float64 size.
Where `seen * a / D` is not a whole number it is at least `1 / D` from one, which `seen * e` and the product's
rounding cannot cross, so the target is its floor. Where it is a whole number `k` and `e < 0`, float64 rounds
`k - seen |e|` up to `k` only while `seen |e|` is at most half the float64 gap below `k`; the largest such `seen` of
each binade of `k` is found on the host, exactly (`round_up_limits`), and the program compares against it.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import ConfigError
from kvjax.methods.decoding import Decoding
from kvjax.methods.registry import register
from kvjax.validation import check_number

Array = jax.Array

#: The largest denominator of `1 - ratio` as a fraction (`seen % D * a` stays within int32).
MAX_DENOMINATOR = 10_000
#: The largest number of tokens seen that the int32 product covers.
MAX_SEEN = 2**31 - 1


def as_fraction(factor: float) -> tuple[int, int, Fraction]:
    """`(a, D, e)` with `factor == a / D + e` exactly, `D <= MAX_DENOMINATOR`, and `e` small enough that `seen * e`
    moves `seen * factor` less than `1 / (2 D)` for any int32 `seen`; `ConfigError` if no such fraction exists."""
    near = Fraction(factor).limit_denominator(MAX_DENOMINATOR)
    error = Fraction(factor) - near
    if abs(error) * MAX_SEEN * 2 * near.denominator >= 1:
        raise ConfigError(f"1 - target_compression_ratio = {factor!r} is no fraction with a denominator of at most "
                          f"{MAX_DENOMINATOR:,} (give the ratio with at most four decimals, or as a simple fraction)")
    return near.numerator, near.denominator, error


def round_up_limits(error: Fraction) -> np.ndarray:
    """`[32, 2]` int32: for a whole product `k` in binade `e` (`2^e <= k < 2^(e+1)`; column 1 where `k == 2^e`), the
    largest `seen` whose float64 product `k + seen * error` still rounds to `k` (all of them when `error >= 0`)."""
    limits = np.full((32, 2), MAX_SEEN, np.int64)
    if error < 0:
        for binade in range(32):
            for power_of_two in (0, 1):  # the float64 gap below k is 2^(e-52), below a power of two 2^(e-53)
                half_gap = Fraction(2) ** (binade - 53 - power_of_two)
                limits[binade, power_of_two] = min(MAX_SEEN, half_gap // -error)  # ties round to k: its bits are even
    return limits.astype(np.int32)


def float64_product_floor(seen: Array, numerator: int, denominator: int, limits: np.ndarray) -> Array:
    """`int(s * factor)` as Python computes it in float64, for int32 `seen` `[B]` >= 0, where
    `factor = numerator / denominator + error` and `limits = round_up_limits(error)`."""
    high, low = seen // denominator, seen % denominator
    whole = high * numerator + (low * numerator) // denominator  # floor(seen * numerator / denominator), exactly
    exact = (low * numerator) % denominator == 0
    binade = 31 - jax.lax.clz(jnp.maximum(whole, 1))
    power_of_two = (whole & (whole - 1)) == 0
    limit = jnp.asarray(limits)[binade, power_of_two.astype(jnp.int32)]
    return jnp.where(exact & (whole > 0) & (seen > limit), whole - 1, whole)


@register
@dataclasses.dataclass(frozen=True)
class CompressionRatioDecoding(Decoding):
    """`decoding` whose target is `max(1, int(seen * (1 - target_compression_ratio)))` pairs (0.5) of the `seen`
    tokens, every `compression_interval` (512) decode tokens, by `base`'s scores ("knorm")."""

    name = "compression_ratio_decoding"

    target_size: int = 1  # kvpress's fixed value: the target comes from target_compression_ratio
    target_compression_ratio: float = 0.5

    def check_own_hyperparameters(self) -> None:
        super().check_own_hyperparameters()
        if self.target_size != 1:
            raise ConfigError(f"{self.name}: target_size={self.target_size!r} is not used (the target is "
                              "target_compression_ratio of the tokens seen); leave it out, or use decoding")
        check_number(self.name, "target_compression_ratio", self.target_compression_ratio, 0)
        if not self.target_compression_ratio < 1:
            raise ConfigError(f"{self.name}: target_compression_ratio must be in [0, 1), got "
                              f"{self.target_compression_ratio!r}")
        as_fraction(1.0 - self.target_compression_ratio)

    def targets(self, seen: Array) -> Array:
        numerator, denominator, error = as_fraction(1.0 - self.target_compression_ratio)
        return jnp.maximum(1, float64_product_floor(seen, numerator, denominator, round_up_limits(error)))

    def largest_target(self, total: int) -> int:
        return max(1, int(total * (1.0 - self.target_compression_ratio)))


__all__ = ["CompressionRatioDecoding", "as_fraction", "float64_product_floor", "round_up_limits"]
