"""Generation: `prefill`, `decode`, `generate`."""

from kvjax.runtime.generate import (
    TRACE_COUNTS,
    GenerationResult,
    PrefillState,
    bucket_length,
    decode,
    generate,
    prefill,
)

__all__ = ["TRACE_COUNTS", "GenerationResult", "PrefillState", "bucket_length", "decode", "generate", "prefill"]
