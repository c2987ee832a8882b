"""`plan`, `fit` and `hardware` say what they are doing (issue 36): a status line on stderr, shown on
a terminal once the work takes over a second, nothing when piped; notices such as an unreachable hub
are said once, and the hub is then not asked again. The DeepSpeed op build says what it builds."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from trainfit.app import working as working_mod
from trainfit.app.working import working
from trainfit.core import progress

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=160), out


def test_the_status_line_shows_the_latest_step_on_a_terminal():
    con, out = _terminal()
    with working(con, "plan: checking cfg.yaml", after_s=0):
        progress.step("plan: planning stage 0 (grpo)")
    assert "plan: planning stage 0 (grpo)" in out.getvalue()


def test_quick_work_and_piped_output_show_no_status_line():
    con, out = _terminal()
    with working(con, "plan: checking cfg.yaml", after_s=60):  # done long before the line would show
        progress.step("plan: planning stage 0 (grpo)")
    assert out.getvalue() == ""
    piped = io.StringIO()
    with working(Console(file=piped, force_terminal=False), "plan: checking cfg.yaml", after_s=0):
        progress.step("plan: planning stage 0 (grpo)")
    assert piped.getvalue() == ""


def test_a_notice_is_printed_once_and_steps_outside_a_command_do_nothing():
    progress.step("nobody listens")  # the library used from Python: no output, no error
    con, out = _terminal()
    with working(con, "x", after_s=60):
        for _ in range(3):
            progress.notice("the hub could not be reached (test-notice-once)")
    assert out.getvalue().count("test-notice-once") == 1


@pytest.mark.parametrize("command, expected", [
    (["plan", str(EXAMPLES / "grpo_lora.yaml")], "plan: planning stage 0 (grpo)"),
    (["hardware", str(EXAMPLES / "grpo_lora.yaml")], "hardware: planning 8 x B200 180GB (card 9 of 9)"),
    (["fit", str(EXAMPLES / "grpo_lora.yaml"), "--gpu", "h100", "--json"], "plans searched on H100 80GB")])
def test_plan_fit_and_hardware_show_what_they_do(command, expected, tmp_path, monkeypatch):
    from trainfit.app import cli

    monkeypatch.chdir(tmp_path)  # fit writes grpo_lora-fit/ here
    monkeypatch.setattr(working_mod, "SHOW_AFTER_S", 0.0)  # shown at once, however fast the machine
    con, out = _terminal()
    monkeypatch.setattr(cli, "err_console", con)
    r = CliRunner().invoke(cli.app, command)
    assert r.exit_code in (0, 1), r.output
    assert expected in out.getvalue(), out.getvalue()[-500:]


def test_an_unreachable_hub_is_asked_once_and_said_once(monkeypatch):
    from huggingface_hub import HfApi, constants

    from trainfit.config import ConfigError
    from trainfit.models import hub

    calls = []

    def unreachable(self, repo, **kw):
        calls.append(repo)
        raise ConnectionError("no route to host")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRAINFIT_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "model_info", unreachable)
    monkeypatch.setattr(hub, "_unreachable", "")
    hub.ask_hub.cache_clear()
    said: list[str] = []
    try:
        with progress.listening(lambda text: None, said.append):
            for repo in ("someone/first-1b", "someone/second-1b", "Qwen/Qwen3-8B"):
                try:
                    hub.resolve_model(repo, catalog_ok=True)
                except ConfigError as e:
                    assert "could not be reached" in str(e)
    finally:
        hub.ask_hub.cache_clear()
    assert calls == ["someone/first-1b"]
    assert len([s for s in said if "could not be reached" in s]) == 1 and "catalog" in said[0]
    # The user's HF_HUB_OFFLINE wins: the hub is not asked at all.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "_unreachable", "")
    assert hub.resolve_model("Qwen/Qwen3-8B", catalog_ok=True).kind == "catalog" and calls == ["someone/first-1b"]


def test_the_deepspeed_op_build_says_what_it_builds_and_why(monkeypatch, capsys, tmp_path):
    from trainfit.train import zero

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(zero, "build_ops", lambda: print("(built)"))
    zero.main()
    first, built, last = capsys.readouterr().out.splitlines()
    assert first.startswith("building DeepSpeed's CPU ops (CPU Adam for ZeRO-Offload") and str(tmp_path) in first
    assert "minutes" in first and built == "(built)" and last == f"DeepSpeed ops cached in {tmp_path}"
