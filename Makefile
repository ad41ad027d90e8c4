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
PYTEST_ARGS ?= -n 2 -q

.PHONY: install install-test test eval lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PIP) install -q $(TORCH) --extra-index-url $(TORCH_INDEX)
	$(PIP) install -q -e ".[test]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

test: install-test
	$(PY) -m ruff check kvjax tests examples
	$(PY) -m pytest $(PYTEST_ARGS)

# A sweep of the main methods at two budgets on the embedded kvjax-tiny model (configs/tiny_sweep.py);
# results are resumable under results/tiny_sweep. `python -m kvjax.demo` is the older throughput demo.
eval: install
	$(PY) -m kvjax.eval --config=configs/tiny_sweep.py

lint: install-test
	$(PY) -m ruff check kvjax tests examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
