"""Run a config: one stage, or a pipeline of stages (e.g. SFT then GRPO), each from the last's model.

    trainfit train examples/demo.yaml            # SFT then GRPO on a tiny preset, CPU
    trainfit train examples/demo.yaml --resume   # continue after a crash or Ctrl-C, from the latest checkpoint
    trainfit train cfg.yaml distributed.num_gpus=4   # re-launches itself: torchrun --nproc_per_node 4
    torchrun --nproc_per_node 4 -m trainfit.app.cli train cfg.yaml distributed.num_gpus=4   # the same, by hand

Layout: <run_dir>/config.yaml (resolved; a resume keeps it and lists what it changed in resumed.jsonl),
<run_dir>/<i>-<stage>/ per stage (metrics.jsonl,
tensorboard/, checkpoints/, final/), <run_dir>/metrics.png, report.html (replay.html) and summary.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.markup import escape

from trainfit.config import Config, ConfigError, LoggingConfig, expand_stages, to_yaml
from trainfit.config.stages import stage_spec
from trainfit.core.dist import Ranks, SINGLE
from trainfit.core.threads import apply as apply_threads
from trainfit.models.policy import count_parameters, resolve_device
from trainfit.models.runnable import not_trainable
from trainfit.train import report_html, trackers
from trainfit.train.faults import Faults
from trainfit.train.interrupt import Interrupted, StopSignals
from trainfit.train.loop import describe_start, train_stage
from trainfit.train.memstats import PHASES
from trainfit.train.preflight import no_rm_stage
from trainfit.train.resume import record as record_resume, resume_changes
from trainfit.train.rundir import check_resumable
from trainfit.train.report import memory_table, plot_run, print_table, read_metrics, summary_table, time_breakdown
from trainfit.train.stage import StageResult, stage_class
from trainfit.train.storage import guarded_write

DONE = "DONE"


def run_pipeline(cfg: Config, *, resume: bool = False, console: Optional[Console] = None,
                 fault: Optional[str] = None, ranks: Ranks = SINGLE) -> list[StageResult]:
    """Run every stage of `cfg` in order. Under torchrun every rank calls this; rank 0 writes files."""
    console = console or Console()
    if ranks.world != cfg.world_size:
        raise ConfigError(f"the config asks for {cfg.world_size} ranks (distributed.num_gpus x num_nodes) but this "
                          f"process runs as {ranks.world}; start it with `trainfit train` (which launches torchrun) "
                          "or under torchrun with that many processes.")
    faults = Faults(fault)
    stages = expand_stages(cfg)
    for scfg in stages:  # a missing tracker package stops the run before any stage trains
        trackers.require(scfg.logging.report_to)
    run_dir = Path(cfg.run_dir)
    if resume:   # something to continue, and no key changed that its checkpoints depend on (train/resume.py)
        check_resumable(cfg.run_dir, cfg)
    kept = resume and (run_dir / "config.yaml").is_file()   # a resumed run keeps the config it started with
    if ranks.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not kept:
            (run_dir / "config.yaml").write_text(to_yaml(cfg))
        note = record_resume(run_dir, resume_changes(cfg)) if kept else None
        if note:
            console.print(escape(note), highlight=False)
    saved = "config.yaml kept from the run it continues" if kept else "resolved config saved as config.yaml"
    console.print(f"run dir: {run_dir}  ({saved})" + (f"; {ranks.world} ranks" if ranks.distributed else ""))
    with StopSignals(ranks) as stop:   # SIGINT / SIGTERM: checkpoint the step reached, raise Interrupted
        results = _run_stages(stages, run_dir, resume=resume, console=console, faults=faults, ranks=ranks, stop=stop)
    if ranks.main:
        _finish(cfg.logging, stages, results, run_dir, console)
    return results


def _run_stages(stages: list[Config], run_dir: Path, *, resume: bool, console: Console, faults: Faults,
                ranks: Ranks, stop: StopSignals) -> list[StageResult]:
    results: list[StageResult] = []
    previous: Optional[Path] = None
    reward_dir: Optional[Path] = None   # the last rm stage's final dir, for rl_models.reward_model=stage:rm
    for i, scfg in enumerate(stages):
        signum = stop.requested() if i else None   # asked during the last stage's end: the next one does not start
        if signum is not None:
            raise Interrupted(signum, 0, None, f"{i}-{scfg.stage}")
        stage_dir = run_dir / f"{i}-{scfg.stage}" if len(stages) > 1 else run_dir
        if scfg.rl_models.reward_model == "stage:rm":
            if reward_dir is None:
                raise no_rm_stage(i, scfg.stage)
            scfg = scfg.model_copy(update={"rl_models": scfg.rl_models.model_copy(
                update={"reward_model": str(reward_dir)})})
        if previous is not None:  # continue from the previous stage's model
            # Its weights, its architecture and its tokenizer: init/config_overrides applied to stage 0 only.
            scfg = scfg.model_copy(update={"model": scfg.model.model_copy(update={
                "name": str(previous), "init": "pretrained", "config_overrides": {}, "tokenizer": None})})
        done_marker = stage_dir / DONE
        if resume and done_marker.exists():
            result = StageResult(**_read_done(done_marker))
            console.print(f"stage {i} ({scfg.stage}) already finished; skipping")
        else:
            result = run_stage(scfg, stage_dir, resume=resume, console=console, faults=faults, ranks=ranks,
                               stop=stop)
            if ranks.main:
                with guarded_write(f"stage {i}'s end marker", stage_dir / "checkpoints", done_marker,
                                   kept=f"its final model is saved in {result.final_dir}"):
                    _write_done(done_marker, result)
        results.append(result)
        if stage_spec(scfg.stage).outputs_policy:  # a reward model is no policy: the next stage continues from the last policy
            previous = result.final_dir.resolve()
        else:
            reward_dir = result.final_dir.resolve()
    return results


def build_stage(cfg: Config, stage_dir: Path, ranks: Ranks = SINGLE):
    """Load the models and wire the stage for `cfg` (no training): (loaded model, stage, device). The stage's
    class comes from the stage table (config/stages.py)."""
    reason = not_trainable(cfg)  # the one place that says what the trainer runs (fit/export use it too)
    if reason:
        raise ConfigError(reason)
    device = resolve_device(cfg.train.device)
    loaded, stage = stage_class(stage_spec(cfg.stage)).build(cfg, stage_dir, ranks, device)
    return loaded, stage, device


def run_stage(cfg: Config, stage_dir: Path, *, resume: bool, console: Console, faults: Faults,
              ranks: Ranks = SINGLE, stop: Optional[StopSignals] = None) -> StageResult:
    loaded, stage, device = build_stage(cfg, stage_dir, ranks)
    console.print(describe_start(cfg, loaded, device), highlight=False)
    # Chosen from the loaded model's size (its init does not depend on the thread count), before any step.
    threads = apply_threads(cfg.train.cpu_threads, params=count_parameters(loaded.model)[0], device=device,
                            local_ranks=cfg.distributed.num_gpus if ranks.distributed else 1,
                            worker_process=cfg.rollout.mode == "async" and cfg.rollout.worker == "process")
    if threads:
        console.print(f"[dim]{threads}[/]", highlight=False)
    # What the data sources fed (trainfit/data/sources/): "read 7473 rows of openai/gsm8k[main] train: ...".
    for note in [*stage.data_notes, *getattr(stage.task, "notes", [])]:
        console.print(f"[dim]data: {escape(note)}[/]", highlight=False)   # escape: openai/gsm8k[main] is no markup
    head = stage.head   # train.fused_head as resolved (auto -> liger or off)
    if head != "off" or cfg.train.fused_head != "auto":
        console.print(f"[dim]LM head: {'fused, ' + head if head != 'off' else 'plain'} "
                      f"(train.fused_head={cfg.train.fused_head})[/]", highlight=False)
    if ranks.main:
        if not (resume and (stage_dir / "config.yaml").is_file()):
            (stage_dir / "config.yaml").write_text(to_yaml(cfg))
        if not resume:
            (stage_dir / "completions.jsonl").unlink(missing_ok=True)

    def save_final(path: Path, state_dict=None) -> Path:
        return stage.save_final(path, state_dict=state_dict)

    try:
        return train_stage(cfg, loaded, stage, stage_dir, resume=resume, console=console, faults=faults,
                           save_final=save_final, ranks=ranks, stop=stop)
    finally:   # however it ended: the last step, train.stop_at_accuracy, or an error
        stage.close()


def _write_done(path: Path, r: StageResult) -> None:
    path.write_text(json.dumps({"stage_dir": str(r.stage_dir), "final_dir": str(r.final_dir),
                                "first_eval": r.first_eval, "last_eval": r.last_eval, "steps": r.steps,
                                "seconds": r.seconds}))


def _read_done(path: Path) -> dict:
    d = json.loads(path.read_text())
    return {**d, "stage_dir": Path(d["stage_dir"]), "final_dir": Path(d["final_dir"])}


def _finish(logging: LoggingConfig, stages: list[Config], results: list[StageResult], run_dir: Path,
            console: Console) -> None:
    """Print the summary tables and write summary.json: numbers as numbers (accuracies as fractions,
    seconds, GiB, errors as fractions), formatting only in the printed tables."""
    rows, accs = [], []
    for scfg, r in zip(stages, results):
        metrics = read_metrics(r.stage_dir / "metrics.jsonl")
        train_rows = [m for m in metrics if m["kind"] == "train"]
        last = train_rows[-1] if train_rows else {}
        mem = [m for m in metrics if m["kind"] == "memory"]
        acc_b, acc_a = r.first_eval.get("accuracy"), r.last_eval.get("accuracy")
        rows.append({"stage": scfg.stage, "steps": r.steps, "seconds": float(r.seconds),
                     "accuracy_before": acc_b, "accuracy_after": acc_a,
                     "loss": last.get("loss"), "reward": last.get("reward"), "output": str(r.final_dir),
                     "memory": _memory_summary(mem[-1]) if mem else None})
        if not stage_spec(scfg.stage).outputs_policy:  # its accuracy ranks pairs; the chain is the policy's task accuracy
            continue
        if not accs and acc_b is not None:
            accs.append(("before " + scfg.stage, acc_b))
        if acc_a is not None:
            accs.append(("after " + scfg.stage, acc_a))
    print_table(console, summary_table(rows))
    mem_table = memory_table(rows)
    if mem_table is not None:
        print_table(console, mem_table)
    for row in rows:
        line = time_breakdown(row)
        if line:
            console.print(line, highlight=False)
    if accs:
        console.print("held-out accuracy: " + "  ->  ".join(f"{name} {_pct(a)}" for name, a in accs), highlight=False)
    summary = {"stages": rows, "accuracy": {name: a for name, a in accs}, "finished": time.time()}
    # Every stage finished: a full disk here loses no training, and --resume only writes these again.
    finished = "every stage finished and its final model is saved (the summary table's output column)"
    with guarded_write("the run's summary", run_dir / "checkpoints", run_dir / "summary.json", kept=finished):
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if logging.plot:
        names = [(f"{i}-{s.stage}", r.stage_dir) for i, (s, r) in enumerate(zip(stages, results))]
        with guarded_write("the run's figure", run_dir / "checkpoints", run_dir / "metrics.png", kept=finished):
            png = plot_run(names, run_dir / "metrics.png")
        console.print(f"plot: {png}")
        report = report_html.refresh(run_dir, console)
        if report is not None:
            console.print(f"report: {report}  (open it in a browser; `trainfit report {run_dir}` rewrites it)")


def _memory_summary(row: dict) -> dict:
    """A stage's metrics.jsonl memory row (memstats.memory_row) back into its nested form."""
    phases = {}
    for ph in PHASES:
        if f"used_{ph}_gib" in row or f"planned_{ph}_gib" in row:
            phases[ph] = {"planned_gib": row.get(f"planned_{ph}_gib"), "used_gib": row.get(f"used_{ph}_gib"),
                          "error": row.get(f"error_{ph}")}
    out = {"basis": row.get("basis"), "phases": phases,
           "time_s": {k[5:-2]: v for k, v in row.items() if k.startswith("time_") and k.endswith("_s")}}
    for k in ("reserved_gib", "process_peak_rss_gib", "plan_error"):
        if k in row:
            out[k] = row[k]
    return out


def _pct(x: Optional[float]) -> str:
    return "" if x is None else f"{100 * x:.1f}%"
