"""XLA:CPU's quick-compile flags for the test suite, its subprocesses and `make eval`, in the installed jaxlib's terms.

An unknown flag in XLA_FLAGS aborts the process before any output, and jaxlib 0.11 (the GPU machines') no longer
knows `--xla_cpu_use_fusion_emitters`, so it is added for older jaxlibs only. `python tests/cpu_flags.py` prints
them (the Makefile's `eval`).
"""

from __future__ import annotations

import importlib.metadata


def _jaxlib_version() -> tuple[int, int]:
    major, minor = importlib.metadata.version("jaxlib").split(".")[:2]
    return int(major), int(minor)


#: The test suite's programs are small and many: XLA's expensive backend passes off (the same programs, compiled
#: with less optimisation). At level 0, a cheap float expression that XLA fuses into several consumers can round
#: differently in each copy (one ulp apart, jax 0.10.2 and 0.11.2): code that compares one float value in several
#: places must read one materialized copy (`kvjax.ops.select._above_and_tied`).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true" + (
    " --xla_cpu_use_fusion_emitters=false" if _jaxlib_version() < (0, 11) else "")


def with_devices(count: int) -> str:
    """`FAST_COMPILE` on `count` host devices (a subprocess's mesh)."""
    return f"--xla_force_host_platform_device_count={count} {FAST_COMPILE}"


if __name__ == "__main__":
    print(FAST_COMPILE)
