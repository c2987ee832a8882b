# Two entry points: `make demo` and `make test`. Both create .venv and install everything.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev

.PHONY: demo test install bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned first so the package's own range resolves to the local CPU build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $@

$(DEVSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(STAMP)

# --overwrite: `make demo` again starts the demo afresh (a plain `trainfit train` into a finished run dir stops).
# One thread: the 0.16M-parameter model's matmuls are too small to split, and a second thread only
# adds synchronisation (SFT steps ~18x slower with 2 threads when anything else runs; same losses).
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/trainfit train examples/demo.yaml --overwrite

test: $(DEVSTAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.convert_smollm2
	$(BIN)/python -m bench.run all

clean:
	rm -rf $(VENV) runs .pytest_cache
