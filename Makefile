# Two entry points: `make run` (demo) and `make test` (whole suite). Both bootstrap .venv idempotently.
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
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m hicache.demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/transfer.py $(ARGS)

bench-storage: $(STAMP)
	$(BIN)/python benchmarks/storage.py $(ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
