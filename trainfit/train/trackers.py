"""Experiment trackers a run reports its metrics to (`logging.report_to`), rank 0 only.

One small class per tracker behind one interface: `log(step, scalars)` with scalars named
`<kind>/<metric>` (kind = train, eval, memory, oom), and `close()`. `MetricsLogger` (report.py)
writes metrics.jsonl itself and fans every row out to these. The optional ones are extras:

    pip install 'trainfit[wandb]'     # Weights & Biases (WANDB_MODE=offline logs locally)
    pip install 'trainfit[trackio]'   # Trackio: local SQLite under TRACKIO_DIR, `trackio show`
    pip install 'trainfit[mlflow]'    # MLflow client (MLFLOW_TRACKING_URI chooses the server / store)

Each tracker run is one stage; its id is kept in the stage dir (trackers.json) so `--resume`
continues the same run where the tracker supports it.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Optional, Protocol

from trainfit.config import Config, ConfigError, LoggingConfig

# tracker -> (module it needs, what to do when its run cannot start)
OPTIONAL = {
    "wandb": ("wandb", "run `wandb login`, or set WANDB_MODE=offline to log to local files"),
    "trackio": ("trackio", "check TRACKIO_DIR (or TRACKIO_SPACE_ID when logging to a Space)"),
    "mlflow": ("mlflow", "set MLFLOW_TRACKING_URI (e.g. http://host:5000 or sqlite:///mlflow.db), or "
               "MLFLOW_ALLOW_FILE_STORE=true to use a local ./mlruns folder"),
}


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...
    def close(self) -> None: ...


def require(report_to: list[str]) -> None:
    """Raise ConfigError (exit 2) naming the key, the tracker and the pip extra when a tracker's
    package is not importable: called before anything trains."""
    for name in report_to:
        if name not in OPTIONAL:
            continue
        try:
            importlib.import_module(OPTIONAL[name][0])
        except ImportError as e:
            raise ConfigError(
                f"logging.report_to includes {name!r} but its package cannot be imported ({e}); install it "
                f"with `pip install 'trainfit[{name}]'`, or remove {name!r} from logging.report_to.") from None


class TensorBoard:
    def __init__(self, stage_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(stage_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, cfg: Config, stage_dir: Path, name: str, run_id: Optional[str]):
        import wandb

        kw = {} if os.environ.get("WANDB_DIR") else {"dir": str(stage_dir)}
        self.run = wandb.init(project=cfg.logging.project, name=name, config=cfg.model_dump(mode="json"),
                              id=run_id, resume="allow" if run_id else None, reinit="create_new", **kw)
        self.id = self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    def __init__(self, cfg: Config, name: str, resume: bool):
        import trackio

        self.trackio = trackio
        # Local unless the user points it at a Space (TRACKIO_SPACE_ID); no system sampling thread.
        self.run = trackio.init(project=cfg.logging.project, name=name, config=cfg.model_dump(mode="json"),
                                resume="allow" if resume else "never", embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)
        self.id = name

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
        from trackio import context_vars

        if context_vars.current_run.get() is self.run:  # as trackio.finish() does
            context_vars.current_run.set(None)


class MLflow:
    """Through `MlflowClient` (no global active run): the experiment is logging.project."""

    def __init__(self, cfg: Config, name: str, run_id: Optional[str]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        if run_id is None:
            exp = self.client.get_experiment_by_name(cfg.logging.project)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(cfg.logging.project)
            run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in _flatten(cfg.model_dump(mode="json")).items()]
            for i in range(0, len(params), 100):  # the API takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[i:i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.id = run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.id)


def _flatten(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def run_name(logging: LoggingConfig, run_dir: str, stage_dir: Path) -> str:
    """logging.run_name, else the run dir's name; a pipeline's stages add their folder (0-sft, 1-grpo)."""
    base = logging.run_name or Path(run_dir).resolve().name
    return base if stage_dir.resolve() == Path(run_dir).resolve() else f"{base}-{stage_dir.name}"


def build(cfg: Config, stage_dir: Path, *, resume: bool) -> list[Tracker]:
    """Start every tracker of logging.report_to for this stage (call on rank 0 only). A tracker whose
    run cannot start raises ConfigError with the tracker's usual fix, before any step runs."""
    require(cfg.logging.report_to)
    ids_path = stage_dir / "trackers.json"
    ids = json.loads(ids_path.read_text()) if resume and ids_path.is_file() else {}
    name = run_name(cfg.logging, cfg.run_dir, stage_dir)
    out: list[Tracker] = []
    try:
        for t in cfg.logging.report_to:
            try:
                if t == "tensorboard":
                    out.append(TensorBoard(stage_dir))
                elif t == "wandb":
                    out.append(WandB(cfg, stage_dir, name, ids.get("wandb")))
                elif t == "trackio":
                    out.append(Trackio(cfg, name, resume and "trackio" in ids))
                elif t == "mlflow":
                    out.append(MLflow(cfg, name, ids.get("mlflow")))
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - the library's own reason, with the usual fix
                raise ConfigError(f"logging.report_to={t}: could not start a {t} run ({type(e).__name__}: "
                                  f"{str(e).strip()[:300]}); {OPTIONAL.get(t, ('', 'check the run dir'))[1]}, or "
                                  f"remove {t!r} from logging.report_to.") from None
    except ConfigError:
        for tr in out:
            tr.close()
        raise
    ids = {t: getattr(tr, "id") for t, tr in zip(cfg.logging.report_to, out) if hasattr(tr, "id")}
    if ids:
        stage_dir.mkdir(parents=True, exist_ok=True)
        ids_path.write_text(json.dumps(ids))
    return out
