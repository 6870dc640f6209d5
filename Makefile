# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-dtypes model kernels venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

venv: $(STAMP)

model: $(STAMP)
	$(PY) -m radixrt.cli fetch-model

# the C++ CPU kernels, compiled once (about 50 s) and cached; a failed build fails this target, and
# only where no compiler (or no ninja) is found does the torch path run
kernels: $(STAMP)
	$(PY) -m radixrt.kernels.cpu_kernels

demo: model
	$(PY) examples/quickstart.py

test: model kernels
	$(PY) -m pytest -q

test-fast: model kernels
	$(PY) -m pytest -q -m "not slow"

# the suite as CPUs without and with fast bf16 run it: `--dtype auto` forced to each dtype in turn;
# PYTEST_ARGS narrows it (e.g. PYTEST_ARGS='-m model')
test-dtypes: model kernels
	RADIXRT_AUTO_DTYPE=float32 $(PY) -m pytest -q $(PYTEST_ARGS)
	RADIXRT_AUTO_DTYPE=bfloat16 $(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
