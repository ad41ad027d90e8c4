"""Shared test setup: CPU, float32 matmuls at full precision, quick XLA compiles.

The suite is dominated by compiling many small programs, so XLA's expensive backend optimisation
passes are turned off (results are the same programs, compiled with less optimisation); subprocess
tests inherit these settings through the environment.
"""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test run, shared by the xdist workers (they inherit this environment
# from the controller, which imports this file first): many tests compile the same tiny-model programs, and a
# program another worker already built is read back instead of compiled again. Nothing carries between runs.
_RUN_CACHE = None  # the directory this process made (the controller's), removed when the run ends
if "KVJAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _RUN_CACHE = os.environ["KVJAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvjax-test-compile-")
# Tried and not kept: --xla_cpu_parallel_codegen_split_count=1 with --xla_cpu_copy_insertion_use_region_analysis=false
# took 9% less CPU on tests/methods/test_lagkv.py (3 interleaved pairs, 28.9 -> 26.4 s), but the split count moves
# float32 rounding (one EPIC golden logit by 2.5e-5, past the fixture's 2e-5).
from cpu_flags import FAST_COMPILE  # noqa: E402  (tests/ is on sys.path: pyproject's pythonpath)
from xdist_schedule import pytest_xdist_make_scheduler  # noqa: E402, F401  (the -n schedule: a module fixture built once)

# CPU-only flags, added on CPU only: on a GPU run (JAX_PLATFORMS=cuda) they made pytest exit 1 without a line
# of output on an H200.
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from kvjax.runtime.compile_cache import ensure_compilation_cache  # noqa: E402

ensure_compilation_cache()  # from the first program on, not only once a test reaches prefill


import pytest  # noqa: E402

from kvjax.runtime.compiled_memory import release_if_needed  # noqa: E402

# How often the mapping count is read: /proc/self/maps costs ~1.3 ms per thousand mappings (40 ms at 30,000,
# measured here), and one test adds a few hundred at most, far inside the half of the limit kept free.
_CHECK_EVERY = 8
_tests_run = [0]


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    """A test worker compiles thousands of programs; each holds memory mappings until JAX's caches drop it.
    Past half of `vm.max_map_count` LLVM's next mmap fails and the worker segfaults (a CI run lost one that
    way), so the caches are cleared between tests when the process nears the limit (checked every
    `_CHECK_EVERY` tests)."""
    yield
    _tests_run[0] += 1
    if _tests_run[0] % _CHECK_EVERY == 0:
        release_if_needed()


@pytest.fixture
def fresh_kernel_traces():
    """The fused decode kernel's jitted call (`kvjax.ops.fused_decode._kernel_once`) traced anew in this test and
    after it: a test that counts the kernel's traces, or monkeypatches what it traces, neither reads nor leaves a
    trace another test made (the cache is keyed by shapes and tuning, not by the functions patched)."""
    from kvjax.ops import fused_decode

    fused_decode._kernel_once.clear_cache()
    yield
    fused_decode._kernel_once.clear_cache()


def pytest_unconfigure(config):
    """The run's compilation cache goes with the run (~150 MB for the whole suite)."""
    if _RUN_CACHE is not None:
        import shutil

        shutil.rmtree(_RUN_CACHE, ignore_errors=True)


#: Node ids (as `pytest` prints them, from the repository root) left out of `make test`: tests/slow_tests.txt.
SLOW_LIST = pathlib.Path(__file__).with_name("slow_tests.txt")


def slow_test_ids() -> set[str]:
    return {line.strip() for line in SLOW_LIST.read_text().splitlines() if line.strip() and not line.startswith("#")}


#: Directories whose parametrized tests run their first case only in `make test` (the kernels against their XLA
#: references, the storage formats): each further case (dtype, GQA ratio, block size, scheme) compiles programs of
#: its own. `make test-all` runs every case.
FIRST_CASE_ONLY = ("tests/pallas/", "tests/quant/")


#: Modules of long tests (10-25 s each: whole generations at several layer sizes, on a mesh, on the fused kernel),
#: run first among the tests handed out one by one: under xdist a long test handed out last leaves the other worker
#: idle that long (a CI-tier run here ended with four minutes of tests/test_gpu_compile.py on one worker). Modules
#: with a module fixture, tests/test_gpu_compile.py among them, are handed out before these (tests/xdist_schedule.py).
RUN_FIRST = ("tests/runtime/test_layer_sizes.py", "tests/runtime/test_sharding.py",
             "tests/runtime/test_decode_fused.py")


def pytest_collection_modifyitems(config, items):
    """Marks `slow` (`make test` deselects them; `make test-all` runs all) the tests listed in tests/slow_tests.txt
    and, under `FIRST_CASE_ONLY`, every case of a parametrized test but its first; puts the `RUN_FIRST` modules'
    tests first."""
    slow = slow_test_ids()
    root = pathlib.Path(__file__).resolve().parents[1]
    first_seen: set[tuple[str, str]] = set()
    for item in items:
        path = pathlib.Path(str(item.path)).resolve()
        relative = path.relative_to(root).as_posix() if path.is_relative_to(root) else item.nodeid
        if f"{relative}::{item.name}" in slow:
            item.add_marker(pytest.mark.slow)
        elif relative.startswith(FIRST_CASE_ONLY) and hasattr(item, "callspec"):
            function = (relative, item.originalname)
            if function in first_seen:
                item.add_marker(pytest.mark.slow)
            first_seen.add(function)
    first = {module: rank for rank, module in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(RUN_FIRST)))  # stable otherwise
