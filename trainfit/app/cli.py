"""The `trainfit` command line: thin wrappers that parse, call the library, and print with rich."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from trainfit.config import Config, ConfigError, DistributedConfig, load_config, to_yaml, valid_keys, field_doc

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, fit and run LLM training (pretrain, SFT, RM, DPO, GRPO, PPO) on the hardware you have: CPU, "
                       "one GPU, or several GPUs and nodes.")
console = Console()
err_console = Console(stderr=True)


# Piped or redirected output has no terminal width; rich would assume 80 columns and wrap table cells
# one word per line. Wide enough for the plan/fit/hardware tables; COLUMNS still wins when set.
PIPED_WIDTH = 200


@app.callback()
def _every_command(ctx: typer.Context) -> None:
    import os

    from trainfit.core import quiet

    for c in (console, err_console):
        if not c.is_terminal and not os.environ.get("COLUMNS"):
            c.width = max(c.width, PIPED_WIDTH)
    # Library warnings (transformers, torch, peft, ...) are recorded, not printed, while a command runs.
    ctx.call_on_close(quiet.install().uninstall)


def fail(message: str, code: int = 2, as_json: bool = False) -> "typer.Exit":
    """Print a user-facing error as one paragraph (no traceback) and exit with `code`. Under --json the
    paragraph is a JSON object on stdout, {"error": ..., "exit_code": ...}: a script parsing the output
    parses a refusal too."""
    if as_json:
        print(json.dumps({"error": message, "exit_code": code}))
        raise typer.Exit(code)
    say_error(message)
    raise typer.Exit(code)


def say_error(message: str) -> None:
    """The one-paragraph error on stderr. The message is plain text: escaped, or rich would eat "[bnb]" in
    "trainfit[bnb]" as markup."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def load_or_exit(path: Optional[str], overrides: Optional[List[str]] = None, as_json: bool = False) -> Config:
    try:
        return load_config(path, overrides or [])
    except ConfigError as e:
        fail(str(e), as_json=as_json)


def gpu_or_exit(name: Optional[str], as_json: bool = False) -> None:
    """Exit 2 at once, before any planning, on a --gpu name the catalog does not hold (the paragraph of
    plan/hardware.find_gpu, the resolver every command plans with)."""
    if not name:
        return
    from trainfit.plan.hardware import UnknownGPU, find_gpu

    try:
        find_gpu(name)
    except UnknownGPU as e:
        fail(str(e), as_json=as_json)


@app.command()
def train(
    config: str = typer.Argument(..., help="YAML config file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides such as train.lr=1e-5."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in run_dir: finished stages are skipped, "
                                "an unfinished one continues from its latest checkpoint. Refused (exit 2) when run_dir "
                                "holds nothing to continue, or when the config changes a key the run's math depends "
                                "on (each is named; logging, eval/save cadence, max_steps under a constant schedule, "
                                "ranks and the like may change). Ctrl-C or SIGTERM during training checkpoints the "
                                "step reached and prints this command."),
    resume_or_start: bool = typer.Option(False, "--resume-or-start", help="--resume where run_dir holds a run to "
                                         "continue, else train from scratch (for job scripts that may be requeued)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Train from scratch into a run_dir that holds a "
                                   "finished or checkpointed run, discarding all of it first (refused where run_dir holds "
                                   "files a run does not write)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Make train's own check (config, what the trainer runs, "
                                 "packages, data, models, launch, run dir: the one `plan` makes too) and plan every "
                                 "stage, without loading weights or training; exit 0 when train would run, 1 when a "
                                 "stage does not fit a GPU named or detected, 2 when it would refuse."),
    fault: Optional[str] = typer.Option(None, "--fault", hidden=True, help="Fault injection for tests."),
) -> None:
    """Train pretrain, sft, rm, dpo, grpo or ppo (or a pipeline) on CPU, one GPU, or many GPUs/nodes (DDP, FSDP, ZeRO-1/2/3, CPU offload)."""
    cfg = load_or_exit(config, overrides)
    from trainfit.train.preflight import preflight
    from trainfit.train.rundir import resumable

    resume = resume or (resume_or_start and (overwrite or resumable(cfg.run_dir)))  # with --overwrite: refused

    # The check `plan` and the dry run make too (trainfit/train/preflight.py), before the run dir is cleared
    # or anything loads: a refused config changes nothing.
    try:
        ready = preflight(cfg, "dry-run" if dry_run else "train", resume=resume, overwrite=overwrite)
    except ConfigError as e:
        fail(str(e))
    for warning in ready.warnings:   # e.g. a disk short of what the run keeps (train/storage.py)
        err_console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    if dry_run:
        from trainfit.app.dryrun import describe

        for line in describe(cfg, ready):
            console.print(line, highlight=False, soft_wrap=True, markup=False)
    if ready.code:
        fail(ready.does_not_fit(config), code=ready.code)
    if dry_run:
        return
    from trainfit.core import dist

    launched = dist.launched_ranks()
    # Several ranks, or DeepSpeed (which needs a launcher's environment even for one process): relaunched
    # under torchrun before the trainer's imports below (transformers: ~4 s of CPU), which only the ranks use.
    if (cfg.world_size > 1 or cfg.engine() == "deepspeed") and launched is None:
        try:
            if overwrite:  # run_dir was checked by preflight
                _discard_previous_run(cfg.run_dir)
            # No --overwrite: the old run is gone already, and the ranks find the run dir clean.
            argv = ["train", config, *(overrides or []), *(["--resume"] if resume else []),
                    *(["--fault", fault] if fault else [])]
            raise typer.Exit(_relaunch(cfg.distributed, argv))
        except ConfigError as e:
            fail(str(e))
        finally:
            _note_library_warnings(cfg.run_dir)
    try:
        _train_in_this_process(cfg, config, overrides, resume=resume, overwrite=overwrite, fault=fault,
                               launched=launched)
    except KeyboardInterrupt:   # Ctrl-C while torch imports or a stage loads, before a loop takes signals
        if launched is None or launched.main:
            err_console.print(escape(f"SIGINT: stopped before the next training step (while loading); finished "
                                     f"stages and checkpoints are kept. Continue with: "
                                     f"{_continue_command(cfg, config, overrides)}"), highlight=False, soft_wrap=True)
        raise typer.Exit(130)


def _train_in_this_process(cfg: Config, config: str, overrides: Optional[List[str]], *, resume: bool,
                           overwrite: bool, fault: Optional[str], launched) -> None:
    """The run in this process (one process, or one rank under torchrun): its imports, the pipeline, and the
    answer to each way it can stop."""
    from trainfit.core import dist
    from trainfit.core.errors import EnvLost
    from trainfit.rollout.base import EngineError
    from trainfit.train import rundir
    from trainfit.train.interrupt import Aborted, Interrupted
    from trainfit.train.loop import OutOfMemoryAtMicroBatchOne
    from trainfit.train.nonfinite import NonFiniteStop
    from trainfit.train.run import run_pipeline

    main_rank = True
    try:
        if overwrite and launched is None:  # run_dir was checked by preflight; under a launcher, below
            _discard_previous_run(cfg.run_dir)
        ranks = dist.init(cfg)
        main_rank = ranks.main
        if overwrite and launched is not None:
            # Started under torchrun by hand: rank 0 discards, every rank waits for it (and for its refusal).
            refusal = None
            if ranks.main:
                try:
                    rundir.check_run_dir(cfg.run_dir, resume=resume, overwrite=overwrite)
                    _discard_previous_run(cfg.run_dir)
                except ConfigError as e:
                    refusal = str(e)
            refusal = dist.all_gather_objects(refusal, ranks)[0]
            if refusal:
                raise ConfigError(refusal)
        out = console if ranks.main else Console(quiet=True)
        run_pipeline(cfg, resume=resume, console=out, fault=fault, ranks=ranks)
        dist.shutdown(ranks)
    except ConfigError as e:
        fail(str(e))
    except (Interrupted, Aborted) as e:   # SIGINT / SIGTERM (train/interrupt.py): 130 / 143, as a shell says
        if main_rank:
            resume_cmd = _continue_command(cfg, config, overrides)
            err_console.print(escape(e.describe(resume_cmd) if isinstance(e, Interrupted) else
                                     f"{e}: stopped at once; the step in progress is lost, the latest checkpoint is "
                                     f"kept. Continue with: {resume_cmd}"), highlight=False, soft_wrap=True)
        if isinstance(e, Interrupted):
            dist.shutdown(ranks, code=e.exit_code)
        raise typer.Exit(e.exit_code)
    except OutOfMemoryAtMicroBatchOne:
        fail("out of memory even at micro-batch 1: this config does not fit the device. "
             + _plan_hint(cfg, config) + " Checkpoints written so far are intact; fix the config and run "
             "again with --resume.", code=1)
    except NonFiniteStop as e:   # train.max_bad_steps non-finite steps in a row, or non-finite weights not saved
        # Every rank stops at the same step (the guard's decision is reduced over ranks): rank 0 says it once,
        # and all leave the process group as a finished run does.
        if main_rank:
            say_error(str(e))
        dist.shutdown(ranks, code=e.exit_code)
        raise typer.Exit(e.exit_code)
    except EngineError as e:
        fail(f"rollout engine: {e} Checkpoints written so far are intact; after fixing the engine, run again "
             "with --resume.", code=1)
    except EnvLost as e:   # envs/groups.py: groups still losing episodes after env.group_retries
        fail(f"environment: {e} Checkpoints written so far are intact; once the service answers, run again "
             "with --resume.", code=1)
    finally:
        if main_rank:
            _note_library_warnings(cfg.run_dir)


def _continue_command(cfg: Config, config: str, overrides: Optional[List[str]]) -> str:
    """The command that continues an interrupted run: with --resume when there is something to resume, else the
    same command, which starts the run again."""
    from trainfit.train.rundir import resumable

    return shlex.join(["trainfit", "train", config, *(overrides or []),
                       *(["--resume"] if resumable(cfg.run_dir) else [])])


def _note_library_warnings(run_dir: str) -> None:
    """The library warnings this process recorded go to <run_dir>/warnings.log, said in one line."""
    from trainfit.core import quiet

    note = quiet.current().write_log(Path(run_dir) / "warnings.log") if Path(run_dir).is_dir() else None
    if note:
        err_console.print(f"[dim]{escape(note)}[/]", highlight=False, soft_wrap=True)


def _discard_previous_run(run_dir: str) -> None:
    """--overwrite: the previous run in run_dir goes whole (train/rundir.py), said in one line."""
    from trainfit.train import rundir

    if rundir.discard_previous_run(Path(run_dir)) is not None:
        console.print(f"--overwrite: discarded the previous run in {run_dir}", highlight=False)


def _relaunch(d: DistributedConfig, argv: list[str]) -> int:
    """Run `trainfit <argv>` under torchrun on this node; print every node's command when multi-node."""
    import os
    import signal
    import subprocess

    from trainfit.core import dist, threads

    port = dist.resolve_port(d)  # the launch itself was checked by preflight
    if d.num_nodes > 1:
        console.print("Run on each node (node_rank differs):", highlight=False)
        for line in dist.node_commands(d, argv, port):
            console.print(f"  {line}", highlight=False, soft_wrap=True)
    cmd = dist.torchrun_command(d, argv, port)
    console.print(f"launching {d.num_gpus} ranks on this node: {' '.join(cmd)}", highlight=False,
                  soft_wrap=True)
    # The ranks handle SIGINT / SIGTERM themselves (train/interrupt.py: checkpoint, then exit 128 + it); this
    # process waits for torchrun rather than kill it, forwards a SIGTERM sent to it alone, and ends as they do.
    proc = subprocess.Popen(cmd, env=threads.launch_env(dict(os.environ)))
    got: list[int] = []

    def note(signum, frame) -> None:
        got.append(signum)
        if signum == signal.SIGTERM:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 128 + got[0] if got and rc else rc


def _plan_hint(cfg: Config, path: str) -> str:
    """One sentence from the planner about the current config, if it can say anything."""
    try:
        from trainfit.plan import plan

        p = plan(cfg)
        return (f"The planner estimates a {p.peak / 2**30:.1f} GiB peak; `trainfit plan {path}` lists the "
                f"cheapest changes that fit and `trainfit fit {path}` writes a config that does.")
    except Exception:  # the hint must never hide the real error
        return f"Run `trainfit plan {path}` to see where the memory goes."


@app.command("config")
def show_config(
    config: str = typer.Argument(..., help="YAML config file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides such as train.lr=1e-5."),
) -> None:
    """Validate a config and print it resolved, with the derived batch arithmetic."""
    from trainfit.config import expand_stages

    cfg = load_or_exit(config, overrides)
    console.print(to_yaml(cfg), highlight=False)
    try:
        for stage_cfg in expand_stages(cfg):
            console.print(f"[bold]{stage_cfg.stage}[/]: {stage_cfg.batch_plan().describe()}")
    except ConfigError as e:
        fail(str(e))


@app.command()
def keys(prefix: str = typer.Argument("", help="Only keys starting with this.")) -> None:
    """List every config key with its documentation."""
    for k in valid_keys():
        if k.startswith(prefix):
            console.print(f"[bold]{k}[/]: {field_doc(k) or ''}", highlight=False)


# Sub-systems add their commands through a `register(app)` function. Imported at every start, so none of
# them imports torch, transformers or peft at its top (tests/test_layers.py): `trainfit --help` and a
# config error answer without them.
COMMAND_MODULES = ("trainfit.app.plan_commands", "trainfit.app.doctor.commands", "trainfit.app.serve.commands",
                   "trainfit.app.env_commands", "trainfit.app.data_commands", "trainfit.app.report_commands",
                   "trainfit.app.import_command")


def _register_optional_commands() -> None:
    import importlib

    for module in COMMAND_MODULES:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):  # the sub-system is not there (yet)
                continue
            raise
        mod.register(app)


_register_optional_commands()


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
