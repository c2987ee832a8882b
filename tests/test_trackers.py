"""logging.report_to: each tracker gets the run's metrics (read back from its local store, offline),
a missing tracker package stops the run before training with the pip hint, and the config forms."""

from __future__ import annotations

import io
import json
import socket
import struct
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from conftest import tiny_config
from trainfit.app.cli import app
from trainfit.config import ConfigError, load_config
from trainfit.train.report import read_metrics
from trainfit.train.run import run_pipeline

QUIET = Console(file=io.StringIO())


@pytest.fixture
def no_network(monkeypatch):
    """Fail any connection that leaves the machine (loopback and Unix sockets stay allowed)."""
    real = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"a tracker tried to reach the network: {address}")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


def sft_run(tmp_path, tracker: str) -> dict[int, float]:
    """A 2-step tiny SFT run reporting to `tracker`; returns metrics.jsonl's {step: loss}."""
    # The shared tiny config turns the older `logging.tensorboard` switch off: keep it in agreement.
    cfg = tiny_config(tmp_path, "sft", **{"logging.report_to": f"[{tracker}]", "logging.project": "tf-test",
                                         "logging.run_name": "tiny",
                                         "logging.tensorboard": str(tracker == "tensorboard").lower()})
    run_pipeline(cfg, console=QUIET)
    return {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"}


def test_tensorboard_gets_the_losses(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = sft_run(tmp_path, "tensorboard")
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    got = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(got) == [1, 2] and all(abs(got[s] - losses[s]) < 1e-5 for s in (1, 2))


def _wandb_records(path: Path):
    """The records of a .wandb file (a LevelDB-style log: 7-byte file header, 32 KiB blocks, each
    record chunk with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:   # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero fill: the rest of this block is unused; records go on in the next one
            pos += 32768 - pos % 32768
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            yield buf
            buf = b""


def test_wandb_offline_gets_the_losses(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    losses = sft_run(tmp_path, "wandb")
    [run_file] = (tmp_path / "wb").glob("wandb/offline-run-*/run-*.wandb")
    got = {}
    for raw in _wandb_records(run_file):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            if "train/loss" in items:
                got[items["_step"]] = items["train/loss"]
    assert sorted(got) == [1, 2] and all(abs(got[s] - losses[s]) < 1e-5 for s in (1, 2))
    assert json.loads((tmp_path / "run" / "trackers.json").read_text())["wandb"] in run_file.name


def test_trackio_local_gets_the_losses(tmp_path, monkeypatch, no_network):
    pytest.importorskip("trackio")
    # trackio reads TRACKIO_DIR when imported: point every module's copy at the test's folder.
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "tk"))
    for name, mod in list(sys.modules.items()):
        if name.startswith("trackio") and hasattr(mod, "TRACKIO_DIR"):
            monkeypatch.setattr(mod, "TRACKIO_DIR", tmp_path / "tk")
    losses = sft_run(tmp_path, "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    assert (tmp_path / "tk").is_dir() and SQLiteStorage.get_runs("tf-test") == ["tiny"]
    got = {r["step"]: r["train/loss"] for r in SQLiteStorage.get_logs("tf-test", "tiny") if "train/loss" in r}
    assert sorted(got) == [1, 2] and all(abs(got[s] - losses[s]) < 1e-5 for s in (1, 2))


def test_mlflow_file_store_gets_the_losses(tmp_path, monkeypatch, no_network):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    losses = sft_run(tmp_path, "mlflow")
    client = MlflowClient()
    exp = client.get_experiment_by_name("tf-test")
    [run] = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "2"
    got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert sorted(got) == [1, 2] and all(abs(got[s] - losses[s]) < 1e-5 for s in (1, 2))


def test_a_tracker_that_cannot_start_is_a_config_error(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cfg = tiny_config(tmp_path, "sft", **{"logging.report_to": "mlflow"})
    with pytest.raises(ConfigError, match="logging.report_to=mlflow.*MLFLOW_TRACKING_URI"):
        run_pipeline(cfg, console=QUIET)
    assert not read_metrics(tmp_path / "run" / "metrics.jsonl")  # no step ran


def test_missing_tracker_package_exits_2_with_the_pip_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` now raises ImportError
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"stage: sft\nrun_dir: {tmp_path / 'run'}\nmodel: {{name: 'preset:tiny'}}\n"
                   "task: {name: arithmetic, max_operand: 9, num_eval: 8}\n"
                   "train: {max_steps: 1, global_batch_size: 8, micro_batch_size: 8, device: cpu}\n"
                   "logging: {progress: false, plot: false, report_to: [tensorboard, wandb]}\n")
    res = CliRunner().invoke(app, ["train", str(cfg)])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "logging.report_to" in text and "'wandb'" in text and "pip install 'trainfit[wandb]'" in text
    assert "Traceback" not in res.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()   # stopped before any training


@pytest.mark.parametrize("given,expected", [
    ({}, ["tensorboard"]),
    ({"logging.report_to": "none"}, []),
    ({"logging.report_to": "[]"}, []),
    ({"logging.report_to": "wandb,mlflow"}, ["wandb", "mlflow"]),
    ({"logging.report_to": "[trackio, trackio]"}, ["trackio"]),
    ({"logging.tensorboard": "false"}, []),                              # the older switch still works
    ({"logging.tensorboard": "true", "logging.report_to": "[tensorboard, wandb]"}, ["tensorboard", "wandb"]),
])
def test_report_to_forms(given, expected):
    cfg = load_config(None, [f"{k}={v}" for k, v in given.items()] + ["task.name=arithmetic"])
    assert cfg.logging.report_to == expected
    assert cfg.logging.tensorboard == ("tensorboard" in expected)


@pytest.mark.parametrize("given,words", [
    (["logging.report_to=neptune"], ["'neptune'", "tensorboard, wandb, trackio, mlflow"]),
    (["logging.report_to=[none, wandb]"], ["none", "only the trackers"]),
    (["logging.report_to=[wandb]", "logging.tensorboard=true"], ["logging.tensorboard=true", "contradicts"]),
])
def test_report_to_mistakes_name_the_key_and_the_fix(given, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, given + ["task.name=arithmetic"])
    assert all(w in str(e.value) for w in words), str(e.value)
