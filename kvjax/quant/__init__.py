"""Quantized KV-cache storage: the format (`KVQuant`, `parse_kv_dtype`), the formulas (`codes`) and the per-layer
store (`QuantizedKV`) that `kvjax.cache.KVCache` holds as its `k` / `v` when `kv_dtype=` asks for one.

See docs/eval.md ("Quantized KV cache") for the formats, their bits per value and measured scores, and
docs/design.md for how the sliding-window rings store them.
"""

from kvjax.quant.spec import KVQuant, kv_dtype_name, parse_kv_dtype
from kvjax.quant.storage import QuantizedKV, dequantize, is_quantized

__all__ = ["KVQuant", "QuantizedKV", "dequantize", "is_quantized", "kv_dtype_name", "parse_kv_dtype"]
