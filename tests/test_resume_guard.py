"""What --resume accepts (CPU, no training): a run dir with something to continue, and a config that changes only
keys that leave the run's math alone; train.max_steps=0 is no run at all; a second Ctrl-C aborts."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import tiny_config
from trainfit.config import ConfigError, load_config, to_yaml
from trainfit.train.interrupt import Aborted, StopSignals
from trainfit.train.resume import MAY_CHANGE, changed_keys, record
from trainfit.train.rundir import check_run_dir


def _flat(text: str) -> str:
    return " ".join(text.split())


def _invoke(*args):
    from trainfit.app.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def started_run(tmp_path: Path, **overrides):
    """A run dir as a run leaves it after its first checkpoint: config.yaml and checkpoints/latest."""
    cfg = tiny_config(tmp_path, "sft", **overrides)
    run = Path(cfg.run_dir)
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-000002")
    (run / "config.yaml").write_text(to_yaml(cfg))
    return cfg


def test_resume_without_a_checkpoint_exits_2_and_names_the_choices(tmp_path):
    config = tmp_path / "c.yaml"
    cfg = tiny_config(tmp_path, "sft")
    config.write_text(to_yaml(cfg))
    r = _invoke("train", config, "--resume")
    assert r.exit_code == 2 and "Traceback" not in r.output
    msg = _flat(r.output)
    assert "--resume: run_dir=" in msg and "holds no checkpoint and no finished stage" in msg
    assert "Drop --resume" in msg and "--resume-or-start" in msg
    assert not Path(cfg.run_dir).exists()   # refused before anything was written
    # --resume-or-start where there is nothing to continue is a fresh run: the dry run accepts it.
    assert _invoke("train", config, "--resume-or-start", "--dry-run").exit_code == 0


def test_resume_or_start_with_a_run_to_continue_is_a_resume(tmp_path):
    cfg = started_run(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(to_yaml(cfg))
    r = _invoke("train", config, "--resume-or-start", "train.global_batch_size=16", "--dry-run")
    assert r.exit_code == 2 and "train.global_batch_size: 8 -> 16" in _flat(r.output)


def test_changed_config_on_resume_names_each_key_with_both_values(tmp_path):
    cfg = started_run(tmp_path)
    changed = tiny_config(tmp_path, "sft", **{"train.global_batch_size": 16, "train.lr": 0.002,
                                               "train.eval_every": 5})
    with pytest.raises(ConfigError) as e:
        check_run_dir(changed.run_dir, resume=True, overwrite=False, cfg=changed)
    msg = str(e.value)
    assert "train.global_batch_size: 8 -> 16" in msg and "train.lr: 0.001 -> 0.002" in msg
    assert "train.eval_every" not in msg.split("A resume may change only")[0]   # allowed: not named as refused
    for key in MAY_CHANGE:   # the refusal lists what may change
        assert key.rstrip(".") in msg
    assert "train.global_batch_size=8" in msg   # the override that resumes as the run started
    assert (Path(cfg.run_dir) / "config.yaml").read_text() == to_yaml(cfg)


def test_allowed_changes_pass_and_are_recorded(tmp_path):
    cfg = started_run(tmp_path)
    new = tiny_config(tmp_path, "sft", **{"train.eval_every": 5, "logging.save_completions": 0,
                                           "train.save_every": 3, "distributed.timeout_s": 60})
    check_run_dir(new.run_dir, resume=True, overwrite=False, cfg=new)
    changes = changed_keys(cfg.model_dump(mode="json"), new.model_dump(mode="json"))
    assert sorted(k for k, _, _ in changes) == ["distributed.timeout_s", "logging.save_completions",
                                                 "train.eval_every", "train.save_every"]
    line = record(Path(cfg.run_dir), changes)
    assert "train.eval_every 0 -> 5" in line
    note = json.loads((Path(cfg.run_dir) / "resumed.jsonl").read_text())
    assert note["changed"]["train.eval_every"] == [0, 5]


def test_max_steps_changes_on_resume_only_under_a_constant_schedule(tmp_path):
    started_run(tmp_path / "cos")
    longer = tiny_config(tmp_path / "cos", "sft", **{"train.max_steps": 4})
    with pytest.raises(ConfigError) as e:
        check_run_dir(longer.run_dir, resume=True, overwrite=False, cfg=longer)
    assert "train.max_steps: 2 -> 4" in str(e.value) and "train.schedule=cosine" in str(e.value)
    started_run(tmp_path / "const", **{"train.schedule": "constant"})
    longer = tiny_config(tmp_path / "const", "sft", **{"train.schedule": "constant", "train.max_steps": 4})
    check_run_dir(longer.run_dir, resume=True, overwrite=False, cfg=longer)


def test_pipeline_stage_keys_are_named_as_overrides_name_them():
    old = {"stages": [{"stage": "sft", "train": {"max_steps": 5}}, {"stage": "grpo", "train": {"lr": 1e-5}}]}
    new = {"stages": [{"stage": "sft", "train": {"max_steps": 5}}, {"stage": "grpo", "train": {"lr": 2e-5}}]}
    assert changed_keys(old, new) == [("stages.1.train.lr", 1e-5, 2e-5)]


def test_max_steps_zero_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["task.name=arithmetic", "train.max_steps=0"])
    msg = str(e.value)
    assert "train.max_steps=0" in msg and "at least 1" in msg and "\n" not in msg.strip()


def test_a_second_sigint_aborts_at_once_and_sigterm_after_sigint_does_not():
    # The handlers before (Python's default, or SIG_IGN in a pytest-xdist worker) are the ones given back.
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() == signal.SIGINT   # the first one only asks
        os.kill(os.getpid(), signal.SIGTERM)       # torchrun's agent answers a Ctrl-C with SIGTERM: no abort
        assert stop.requested() == signal.SIGINT
        with pytest.raises(Aborted) as e:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):   # the handler runs between two bytecodes of this thread
                pass
        assert e.value.exit_code == 130
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before   # handlers given back


def test_ranks_stop_together_on_any_ranks_signal_and_a_forwarded_repeat_is_one_request(monkeypatch):
    from trainfit.core.dist import Ranks
    from trainfit.train import interrupt

    # This rank (1 of 2) saw nothing; the other rank's SIGTERM comes through the all-reduce: both stop.
    other = {"SIGINT": 0.0, "SIGTERM": 1.0}
    monkeypatch.setattr(interrupt, "all_reduce_sum", lambda values, ranks: {k: values[k] + other[k] for k in values})
    with StopSignals(Ranks(rank=1, world=2)) as stop:
        assert stop.requested() == signal.SIGTERM
        # torchrun's agent forwards the terminal's Ctrl-C to a rank that already had it: the same request.
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT


def test_ctrl_c_while_a_stage_loads_says_what_is_kept_and_how_to_continue(tmp_path, monkeypatch):
    # Ctrl-C before a training loop takes signals (torch importing, a model loading) used to exit 130 silently.
    import trainfit.train.run as run

    def interrupted_while_loading(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "run_pipeline", interrupted_while_loading)
    cfg = tiny_config(tmp_path, "sft", **{"train.device": "cpu"})
    config = tmp_path / "c.yaml"
    config.write_text(to_yaml(cfg))
    r = _invoke("train", config)
    assert r.exit_code == 130 and "Traceback" not in r.output
    msg = _flat(r.output)
    # Nothing to resume yet: the same command starts the run again, without --resume.
    assert "SIGINT: stopped before the next training step" in msg
    assert msg.endswith(f"Continue with: trainfit train {config}")
    # Interrupted again while resuming from a checkpoint: the command continues it.
    started_run(tmp_path, **{"train.device": "cpu"})
    r = _invoke("train", config, "--resume")
    assert r.exit_code == 130
    assert _flat(r.output).endswith(f"Continue with: trainfit train {config} --resume")


def test_ctrl_c_while_the_command_loads_exits_130_with_one_line(monkeypatch, capsys):
    # A SIGINT in the command's first instants (its modules importing) printed a KeyboardInterrupt traceback.
    import importlib.abc
    import sys

    from trainfit.app.main import main

    class InterruptedImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "trainfit.app.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "trainfit.app.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [InterruptedImport(), *sys.meta_path])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert err == "trainfit: interrupted (SIGINT) while starting; nothing was done\n"


def test_ctrl_c_while_typer_builds_the_command_exits_130_with_one_line(monkeypatch, capsys):
    # The CLI imported, but typer still turning the app into a click command (before any command runs,
    # so before click's own Ctrl-C handling): it printed typer's frames and exited 1.
    import typer.main

    from trainfit.app.main import STARTING, main

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(typer.main, "get_command", interrupted)
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 130
    assert capsys.readouterr().err == STARTING + "\n"
