"""Quantized KV-cache storage: the format (`KVQuant`, `parse_kv_dtype`), the formulas (`codes`) and the per-layer
store (`QuantizedKV`) that `kvjax.cache.KVCache` holds as its `k` / `v` when `kv_dtype=` asks for one.

See docs/quantization.md for the schemes, their memory and how every cache op and method composes with them.
"""

from kvjax.quant.spec import KVQuant, kv_dtype_name, parse_kv_dtype
from kvjax.quant.storage import QuantizedKV, dequantize, is_quantized

__all__ = ["KVQuant", "QuantizedKV", "dequantize", "is_quantized", "kv_dtype_name", "parse_kv_dtype"]
