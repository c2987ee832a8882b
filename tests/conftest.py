"""Shared helpers: small configs on the tiny preset, the tiny model, an offline datasets cache, local
JSON services, and a CUDA skip for @pytest.mark.gpu tests."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from datasource_helpers import use_cache

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Some test modules point TRAINFIT_CACHE at a fresh folder when imported; this is the one the run
# started with (the user's cache, where the 7B/8B examples' traces may already be warm).
START_CACHE = os.environ.get("TRAINFIT_CACHE")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest worker per core (pytest-xdist): one torch thread each, and the runs
    # a test starts as subprocesses (CLI, torchrun ranks) inherit one thread too, so workers never
    # oversubscribe the cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # xdist's workers see COLUMNS=80 / LINES=24, which the CLI takes as the user's terminal width;
    # the suite runs as if piped. Each worker launches its torchrun rendezvous on its own port, so two
    # workers starting ranks at once never race for 29500 (distributed.master_port=auto reads it).
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)
    os.environ["MASTER_PORT"] = str(29500 + 17 * (1 + int(os.environ["PYTEST_XDIST_WORKER"].lstrip("gw") or 0)))
    # One planner cache for all workers of this run (entries are written atomically and keyed by their
    # content), so an architecture is traced once per run, not once per worker; test modules that want
    # a cache of their own set TRAINFIT_CACHE with setdefault and get this one.
    os.environ.setdefault("TRAINFIT_CACHE", os.path.join(
        tempfile.gettempdir(), f"trainfit-test-cache-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'run')}"))
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def send_json(handler, code: int, data: bytes) -> None:
    """Reply from a test HTTP server's request handler with a JSON body."""
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class JSONService:
    """A local HTTP service speaking JSON (trainfit/envs/http.py's protocol, or any POST-only API) on a free
    port of 127.0.0.1: each POST's body goes to `answer(path, body)`, whose dict is the 200 reply. A
    subclass that must reply otherwise (drop the connection, send garbage) overrides `handle`; one that
    keeps state sets it before calling this __init__, which starts serving."""

    def __init__(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):   # keep test output quiet
                pass

            def do_POST(self):
                outer.handle(self, json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}"))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def handle(self, handler: BaseHTTPRequestHandler, body: dict) -> None:
        send_json(handler, 200, json.dumps(self.answer(handler.path, body)).encode())

    def answer(self, path: str, body: dict) -> dict:
        return {}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def tiny_config(tmp_path, stage: str = "sft", **overrides):
    """A validated Config for a few fast steps on preset:tiny; `overrides` are dotted keys."""
    from trainfit.config import load_config

    base = {
        "stage": stage,
        "run_dir": str(tmp_path / "run"),
        "model": {"name": "preset:tiny"},
        "task": {"name": "arithmetic", "max_operand": 9, "num_eval": 16},
        "train": {"global_batch_size": 8, "micro_batch_size": 8, "max_steps": 2, "lr": 1e-3,
                  "device": "cpu"},
        "grpo": {"num_generations": 4},
        "rollout": {"max_new_tokens": 4},
        "logging": {"tensorboard": False, "progress": False, "plot": False},
    }
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()], base=base)


@pytest.fixture(scope="module")
def tiny_lm():
    """preset:tiny's random-init model (seed 0) and its tokenizer on the CPU, loaded once per module."""
    from trainfit.models.policy import load_policy

    cfg = tiny_config(Path("/tmp"), "sft")
    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"), seed=0)
    return loaded.model, loaded.tokenizer


@pytest.fixture
def datasets_cache(monkeypatch, tmp_path) -> Path:
    """An empty, offline datasets cache of the test's own (datasource_helpers.use_cache); its folder."""
    return use_cache(monkeypatch, tmp_path)


@pytest.fixture
def deepspeed_config_parser(monkeypatch):
    """DeepSpeed's own config validation (skips without deepspeed): parse(path, world) -> DeepSpeedConfig.
    The world size comes from an mpu stand-in, since torch.distributed is not initialised in a test."""
    def make():
        pytest.importorskip("deepspeed")
        from deepspeed.runtime import config as ds_config

        monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)

        class MPU:
            def __init__(self, world):
                self.world = world

            def get_data_parallel_world_size(self):
                return self.world

        return lambda path, world: ds_config.DeepSpeedConfig(str(path), mpu=MPU(world))
    return make


@pytest.fixture
def user_plan_cache(monkeypatch):
    """Offline, with the planner cache the run started with (see START_CACHE)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if START_CACHE is None:
        monkeypatch.delenv("TRAINFIT_CACHE", raising=False)
    else:
        monkeypatch.setenv("TRAINFIT_CACHE", START_CACHE)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache of the test's own (HF_HUB_CACHE), with hub lookups off. `.put(repo, files)`
    stores a snapshot of `files` ({name: text or bytes}, or a directory to copy) as the hub client
    would, so the repo resolves from the cache; `.catalog(cfg)` stores the catalog's config.json for
    every hub model a config loads (its architecture, no weights: enough for the checks and the plan)."""
    import shutil
    from types import SimpleNamespace

    from huggingface_hub import constants

    root = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read by huggingface_hub at import

    def put(repo: str, files) -> Path:
        repo_dir = root / ("models--" + repo.replace("/", "--"))
        snap = repo_dir / "snapshots" / ("0" * 40)
        if isinstance(files, (str, Path)):
            shutil.copytree(files, snap, dirs_exist_ok=True)
        else:
            snap.mkdir(parents=True, exist_ok=True)
            for name, data in files.items():
                (snap / name).write_bytes(data if isinstance(data, bytes) else data.encode())
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / "main").write_text("0" * 40)
        return snap

    def put_catalog(cfg) -> None:
        from trainfit.config import expand_stages
        from trainfit.models.catalog import catalog_entries, catalog_lookup

        for s in expand_stages(cfg):
            for name in (s.model.name, s.rl_models.reward_model, s.rl_models.value_model):
                stem = catalog_lookup(name) if name and not name.startswith(("preset:", "stage:")) else None
                if stem:
                    put(name, {"config.json": json.dumps(catalog_entries()[stem]["config"])})

    return SimpleNamespace(root=root, put=put, catalog=put_catalog)


@pytest.fixture
def target_machine(monkeypatch):
    """`target_machine(gpus, cpu_ram)`: the launch checks (train/launch.py) see the machine a config was
    planned for, whatever this one has: train.device=auto trains on CUDA, `gpus` devices are visible and
    the node has `cpu_ram` bytes of RAM (None: unknown). Tests whose subject is what a config does on its
    target card use it, so a GPU (or none) here changes nothing; the checks themselves are tested against
    a monkeypatched machine (test_distributed.py, test_deepspeed_offload.py)."""
    from trainfit.core import dist, machine

    def see(gpus: int, cpu_ram=None) -> None:
        monkeypatch.setattr(dist, "uses_cuda", lambda t: t.device != "cpu")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(machine, "cpu_ram", lambda: {"total": cpu_ram, "available": cpu_ram})
        roomy_disk(monkeypatch)

    return see


def roomy_disk(monkeypatch) -> None:
    """The run dir's disk as a training machine's, with room for the checkpoints of a 7-72B run: a dry run of a
    big config here is judged on the config, not on this machine's free space (the disk checks themselves are
    tested in test_storage_faults.py)."""
    from trainfit.train import storage

    monkeypatch.setattr(storage, "free_bytes", lambda path: 2 ** 50)


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_launcher_env_leaks():
    """A test that runs a launcher's code in this process (DeepSpeed's or accelerate's distributed set-up
    writes RANK / WORLD_SIZE into os.environ) must not make a later test's `trainfit train` believe it was
    started by torchrun: the launcher variables are put back as they were after every test."""
    before = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
