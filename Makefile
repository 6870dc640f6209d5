# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast model kernels venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

venv: $(STAMP)

model: $(STAMP)
	$(PY) -m radixrt.cli fetch-model

# the C++ CPU kernels, compiled once (about 50 s) and cached; without a compiler the torch path runs
kernels: $(STAMP)
	$(PY) -m radixrt.kernels.cpu_kernels

demo: model
	$(PY) examples/quickstart.py

test: model kernels
	$(PY) -m pytest -q

test-fast: model kernels
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
