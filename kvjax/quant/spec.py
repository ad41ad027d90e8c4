"""`KVQuant`: the storage format of a quantized KV cache, chosen at `generate` / `prefill` time (`kv_dtype=`).

| scheme  | codes                  | scales (bfloat16 unless noted)                          | full precision    |
|---------|------------------------|---------------------------------------------------------|-------------------|
| `int8`  | int8, symmetric        | one per (token, head) (`channel_group` channels each)   | -                 |
| `fp8`   | float8 e4m3            | one float32 power of two per (example, head)            | -                 |
| `int4`  | 4 bits, two per byte   | scale + zero per (token, head) (asymmetric min / max)   | -                 |
| `kivi2` | 2 bits, four per byte  | keys: scale + zero per channel over `group_size` tokens | the `residual`    |
|         |                        | (KIVI); values: scale + zero per (token, head)          | newest tokens     |
| `kivi4` | 4 bits, two per byte   | as `kivi2`                                              | as `kivi2`        |

`kv_dtype=None` (or `"model"`) keeps today's cache in the model dtype. Strings name a scheme with its defaults
and optional overrides: `"kivi2"`, `"kivi2:group_size=32:residual=64"`, `"int4:channel_group=32"`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.errors import ConfigError

#: Bits per code of each scheme.
SCHEME_BITS = {"int8": 8, "fp8": 8, "int4": 4, "kivi2": 2, "kivi4": 4}
#: Names that mean "no quantization: the model dtype".
MODEL_DTYPE_NAMES = ("model", "none", "")

#: KIVI defaults. Tokens per key group: 64 (the paper's ablation runs 32 to 128). With bfloat16 scale + zero
#: per channel that is 0.5 bits per key value; values take one scale + zero per token and head (0.25 bits at
#: head_dim 128), so 2-bit KIVI stores 2.45 bits per value at 32K tokens (<= 0.16 of bfloat16, checked in
#: tests/quant/test_memory.py). The paper's 32-token groups would cost a whole bit per key value.
KIVI_GROUP = 64
#: KIVI: the newest tokens kept in full precision (the paper's residual length R = 128).
KIVI_RESIDUAL = 128


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """A quantized cache format (hashable: jitted programs take it as part of the cache's static structure).

    scheme:        one of `SCHEME_BITS`.
    group_size:    KIVI only: tokens per key quantization group (keys are quantized per channel over it).
    residual:      KIVI only: the newest tokens of each head kept in full precision (the model dtype). Once
                   more than `residual` are pending, the oldest `group_size` of them are quantized as one
                   group (flushed group by group); needs `residual >= group_size`.
    channel_group: per-token schemes (int8, int4, KIVI's values): channels sharing one scale (None: the head).
    """

    scheme: str
    group_size: int | None = None
    residual: int | None = None
    channel_group: int | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEME_BITS:
            raise ConfigError(f"kv_dtype: scheme must be one of {sorted(SCHEME_BITS)}, got {self.scheme!r}")
        for name in ("group_size", "residual", "channel_group"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"kv_dtype {self.scheme}: {name} must be a positive integer, got {value!r}")
        if self.kivi:
            group = self.group_size if self.group_size is not None else KIVI_GROUP
            residual = self.residual if self.residual is not None else KIVI_RESIDUAL
            object.__setattr__(self, "group_size", group)
            object.__setattr__(self, "residual", residual)
            if residual < group:
                raise ConfigError(
                    f"kv_dtype {self.scheme}: residual={residual} must be at least group_size={group} "
                    "(a group is quantized only once it is complete)"
                )
        else:
            for name in ("group_size", "residual"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"kv_dtype {self.scheme}: {name} applies to kivi2 / kivi4 only")
        if self.scheme == "fp8" and self.channel_group is not None:
            raise ConfigError("kv_dtype fp8: channel_group does not apply (one scale per head)")

    @property
    def bits(self) -> int:
        return SCHEME_BITS[self.scheme]

    @property
    def kivi(self) -> bool:
        return self.scheme.startswith("kivi")

    @property
    def per_head_scale(self) -> bool:
        """fp8: one scale per (example, KV head), no per-token leaves."""
        return self.scheme == "fp8"

    @property
    def packed(self) -> bool:
        """Sub-byte codes, several per uint8."""
        return self.bits < 8

    @property
    def ring(self) -> int:
        """Slots of the full-precision residual ring (KIVI): `residual + 1`, room for one more token before a flush."""
        return (self.residual or 0) + 1 if self.kivi else 0

    @property
    def name(self) -> str:
        """Canonical text form (`parse_kv_dtype(spec.name) == spec`): the scheme, then any non-default field."""
        extras = []
        defaults = KVQuant(self.scheme)
        for field in ("group_size", "residual", "channel_group"):
            if getattr(self, field) != getattr(defaults, field):
                extras.append(f"{field}={getattr(self, field)}")
        return ":".join([self.scheme, *extras])

    def quantizes_ring(self, capacity: int) -> bool:
        """Whether a sliding-window ring of `capacity` slots stores codes in this format. KIVI keeps at least the
        newest `residual - group_size + 1` tokens in full precision, so a window no longer than that is never
        quantized: such a ring stays in the model dtype (its size is the plain ring's). Every other ring, and every
        ring of a per-token scheme, is stored in the format."""
        return not self.kivi or capacity > self.residual - self.group_size + 1

    def channels(self, head_dim: int) -> int:
        """Channels per scale of a per-token layout (int8, int4, KIVI's values) at this head_dim."""
        return head_dim if self.channel_group is None else self.channel_group

    def check_head_dim(self, head_dim: int) -> None:
        """Raises a ConfigError naming the field when this format cannot store heads of `head_dim` channels."""
        per_byte = 8 // self.bits
        if head_dim % per_byte:
            raise ConfigError(f"kv_dtype {self.name}: head_dim={head_dim} is not a multiple of {per_byte} "
                              f"(values packed per byte)")
        if not self.per_head_scale and head_dim % self.channels(head_dim):
            raise ConfigError(f"kv_dtype {self.name}: channel_group={self.channel_group} does not divide "
                              f"head_dim={head_dim}")

    def bits_per_value(self, head_dim: int) -> float:
        """Stored bits per K / V value: codes plus scales and zero points, averaged over keys and values (the
        KIVI residual ring, a fixed `residual + 1` tokens per head, excluded: see `kvjax.quant.nbytes`)."""
        scale_bits = 16.0
        if self.per_head_scale:
            return float(self.bits)
        per_token = (2 if self.scheme != "int8" else 1) * scale_bits / self.channels(head_dim)
        if not self.kivi:
            return self.bits + per_token
        key = self.bits + 2 * scale_bits / self.group_size
        return (key + self.bits + per_token) / 2


def parse_kv_dtype(value: Any) -> KVQuant | None:
    """`kv_dtype=` as users give it: None / "model" (the model dtype), a `KVQuant`, or a string
    `"<scheme>[:field=value ...]"` (`KVQuant.name`)."""
    if value is None or isinstance(value, KVQuant):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"kv_dtype must be a string such as 'int8' or a KVQuant, got {type(value).__name__}")
    text = value.strip().lower()
    if text in MODEL_DTYPE_NAMES:
        return None
    scheme, *fields = text.split(":")
    kwargs: dict[str, int] = {}
    known = ("group_size", "residual", "channel_group")
    for field in fields:
        key, sep, number = field.partition("=")
        number = number.strip()
        # ASCII digits only: str.isdigit() also accepts digits int() refuses (superscripts) or reads (Arabic-Indic).
        if not sep or key not in known or not (number.isascii() and number.isdigit()):
            raise ConfigError(f"kv_dtype {value!r}: each option is field=integer with field one of {list(known)}, "
                              f"got {field!r}")
        if key in kwargs:
            raise ConfigError(f"kv_dtype {value!r}: {key} is given twice")
        kwargs[key] = int(number)
    if scheme not in SCHEME_BITS:
        raise ConfigError(f"kv_dtype must be 'model' or one of {sorted(SCHEME_BITS)} (with :field=value options), "
                          f"got {value!r}")
    return KVQuant(scheme, **kwargs)


def kv_dtype_name(value: Any) -> str:
    """The canonical name of a `kv_dtype=` value ("model" for the model dtype)."""
    spec = parse_kv_dtype(value)
    return "model" if spec is None else spec.name
