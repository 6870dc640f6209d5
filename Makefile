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

# The suite runs in two parts: on TEST_WORKERS pytest-xdist workers, whole modules to a worker and one thread
# each (tests/conftest.py), then the modules marked `serial` alone, on every core (the C++ kernels' threads,
# speed ratios). Both parts always run, and a failure in either fails the target; a part that selects nothing
# (pytest's exit status 5) is not a failure. MARKS narrows both to a marker expression (e.g. MARKS=model),
# PYTEST_ARGS goes to both.
TEST_WORKERS ?= 2
suite = failed=0; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial$(if $(1), and ($(1)))" $(PYTEST_ARGS) \
		|| [ $$? -eq 5 ] || failed=1; \
	$(PY) -m pytest -q -m "serial$(if $(1), and ($(1)))" $(PYTEST_ARGS) || [ $$? -eq 5 ] || failed=1; \
	exit $$failed

test: model kernels
	$(call suite,$(MARKS))

test-fast: model kernels
	$(call suite,not slow$(if $(MARKS), and ($(MARKS))))

# the suite as CPUs without and with fast bf16 run it: `--dtype auto` forced to each dtype in turn
test-dtypes: model kernels
	export RADIXRT_AUTO_DTYPE=float32; $(call suite,$(MARKS))
	export RADIXRT_AUTO_DTYPE=bfloat16; $(call suite,$(MARKS))

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
