# Two commands: `make demo` and `make test`. Both create or reuse .venv in the repo root.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.eagle-trt-installed

.PHONY: setup demo test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt requirements-nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	# numpy 1.x for the bundled Triton 2.51 Python-backend stub (built against it), kept apart.
	$(PY) -m pip install -q --no-deps --target $(VENV)/triton-stub-numpy numpy==1.26.4
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The whole default build (graphs, parity bundles, Triton repository; engines where TensorRT is),
# then speculative vs autoregressive decoding on the built graphs and one streamed Triton request.
demo: setup
	$(PY) -m eagle_trt.build.demo

# Two pytest-xdist workers, one per core of the 2-core CI machine (each test process runs one
# PyTorch thread); worksteal keeps both busy to the end of the minutes-long SmolLM2 tests.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test: setup
	$(PYTEST) --durations=25

test-fast: setup
	$(PYTEST) -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache
