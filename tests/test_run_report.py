"""The run report (report.html) and the episode replay (replay.html), read back from the figure JSON the page
embeds (what plotly.js draws) and compared with metrics.jsonl and transcripts.jsonl. Real CPU runs (train.device=cpu):
the demo cut to a few steps, and multi-turn GRPO on the tiny VLM against a local screen service.
tests/test_report_browser.py opens the same pages in headless Chromium."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from PIL import Image

# plotly is a core dependency; the GPU machine's kit leaves it out (its 10 MB do not fit the 64 MiB that
# travel there), and the trainer goes on without the page there. Everywhere else these run.
pytest.importorskip("plotly")

from report_helpers import assert_curves_hold_metrics, demo_run, screen_run
from trainfit.envs.cua_actions import parse_action
from trainfit.train import report_html
from trainfit.train.report_data import MAX_POINTS, extreme_indices, thin
from trainfit.train.report import read_metrics

FIGURE = re.compile(r'<script type="application/json" data-figure="([^"]+)">(.*?)</script>', re.S)


def figures(page: Path) -> dict[str, dict]:
    return {k: json.loads(v.replace("<\\/", "</")) for k, v in FIGURE.findall(page.read_text())}


def traces(fig: dict, **meta) -> list[dict]:
    return [t for t in fig["data"] if all(t.get("meta", {}).get(k) == v for k, v in meta.items())]


def test_demo_report_holds_the_runs_numbers_and_is_rewritten_at_each_evaluation(tmp_path, monkeypatch):
    seen = []
    original = report_html.refresh

    def recording(stage_dir, console=None):
        out = original(stage_dir, console)
        seen.append(figures(out))
        return out

    monkeypatch.setattr(report_html, "refresh", recording)
    run = tmp_path / "demo"
    r = demo_run(run)
    assert r.exit_code == 0, r.output + repr(r.exception)
    # SFT evaluates mid-stage at step 2 (of 4), GRPO at step 1 (of 2); then the end of the run.
    assert len(seen) == 3
    first = traces(seen[0]["fig-curves"], metric="accuracy", stage="0-sft")[0]
    assert first["x"] == [0, 2] and not traces(seen[0]["fig-curves"], stage="1-grpo")
    # Mid-stage the plan comes from the stage's plan row (its memory row is written at the end).
    (early,) = traces(seen[0]["fig-memory"], stage="0-sft", phase="train", what="planned")
    (plan_row,) = [m for m in read_metrics(run / "0-sft" / "metrics.jsonl") if m["kind"] == "plan"]
    assert early["y"] == [plan_row["planned_train_gib"]] * 2 and plan_row["step"] == 0
    assert "capacity_gib" not in plan_row   # a card's memory only on CUDA
    figs = figures(run / "report.html")
    assert figs == seen[-1]
    assert_curves_hold_metrics(figs["fig-curves"]["data"], run)
    offset = 0
    for name in ("0-sft", "1-grpo"):
        rows = read_metrics(run / name / "metrics.jsonl")
        train = [m for m in rows if m["kind"] == "train"]
        # Planned memory per phase as a line over the stage, measured peaks per step as points.
        (mem,) = [m for m in rows if m["kind"] == "memory"]
        phases = ["train"] if name == "0-sft" else ["rollout", "scoring", "train"]
        for ph in phases:
            (plan,) = traces(figs["fig-memory"], stage=name, phase=ph, what="planned")
            assert plan["y"] == [mem[f"planned_{ph}_gib"]] * 2 and plan["x"] == [offset, offset + train[-1]["step"]]
            (used,) = traces(figs["fig-memory"], stage=name, phase=ph, what="used")
            assert used["y"] == [m[f"cpu_rss_sampled_{ph}_gib"] for m in train]
        # Step time by bucket, stacked per step.
        for bucket in ("forward_backward", "optimizer") + (("generate",) if name == "1-grpo" else ()):
            (bar,) = traces(figs["fig-time"], stage=name, bucket=bucket)
            assert bar["y"] == [m[f"time_{bucket}_s"] for m in train]
        offset += train[-1]["step"]
    (tput,) = traces(figs["fig-throughput"], metric="tokens_per_s", stage="0-sft")
    sft_rows = read_metrics(run / "0-sft" / "metrics.jsonl")
    assert tput["y"] == [m["tokens_per_s"] for m in sft_rows if m["kind"] == "train"]
    page = (run / "report.html").read_text()
    assert "global batch 64 = micro 64 x accumulation 1 x devices 1" in page
    assert "2 prompts x 8 generations per step" in page
    assert "replay.html" not in page   # single-turn GRPO keeps no episodes
    assert "<script src=" not in page and "cdn" not in page.lower().split("<script>")[0]   # plotly.js is inlined


def _rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_long_series_are_thinned_but_keep_their_spikes_and_dips(tmp_path):
    n = 20_000
    loss = [1.0 + 0.001 * (i % 7) for i in range(n)]
    loss[12_345], loss[777] = 1000.0, -5.0
    _rows(tmp_path / "metrics.jsonl", [{"step": i + 1, "kind": "train", "loss": v} for i, v in enumerate(loss)])
    out = report_html.write_report(tmp_path)
    (t,) = traces(figures(out)["fig-curves"], metric="loss")
    assert len(t["x"]) <= MAX_POINTS < n and t["meta"]["points"] == n
    pts = dict(zip(t["x"], t["y"]))
    assert pts[12_346] == 1000.0 and pts[778] == -5.0 and t["x"] == sorted(t["x"])
    # Every bucket keeps its own min and max: thinning never moves a value to another step.
    assert all(loss[x - 1] == y for x, y in pts.items())
    assert list(extreme_indices([3.0, 1.0, 2.0])) == [0, 1, 2] and thin([1, 2], [5, 6]) == ([1, 2], [5, 6])


def test_oom_retries_and_resumes_are_marked(tmp_path):
    _rows(tmp_path / "metrics.jsonl", [
        {"step": 1, "kind": "train", "loss": 2.0}, {"step": 1, "kind": "oom", "micro_batch_size": 2, "message": "oom!"},
        {"step": 2, "kind": "train", "loss": 1.5}, {"step": 2, "kind": "resume", "checkpoint": "ckpt/step-2"},
        {"step": 3, "kind": "train", "loss": 1.0}])
    figs = figures(report_html.write_report(tmp_path))
    ev = figs["fig-curves"]["layout"]["meta"]["events"]
    assert [(e["kind"], e["step"]) for e in ev] == [("oom", 1), ("resume", 2)]
    assert {s["x0"] for s in figs["fig-curves"]["layout"]["shapes"]} >= {1, 2}
    page = (tmp_path / "report.html").read_text()
    assert "oom!" in page and "resumed from ckpt/step-2" in page


def test_cuda_rows_draw_peaks_against_the_plan_and_the_cards_capacity(tmp_path):
    plan = {"planned_rollout_gib": 20.0, "planned_scoring_gib": 21.0, "planned_train_gib": 30.0, "capacity_gib": 79.2}
    _rows(tmp_path / "metrics.jsonl", [{"step": 0, "kind": "plan", **plan}] + [
        {"step": s, "kind": "train", "gpu_mem_peak_gib": 31.0 + s, "gpu_mem_peak_rollout_gib": 19.0 + s,
         "gpu_mem_peak_scoring_gib": 20.5, "gpu_mem_peak_train_gib": 29.0 + s} for s in (1, 2, 3)])
    fig = figures(report_html.write_report(tmp_path))["fig-memory"]
    (cap,) = traces(fig, what="capacity")
    assert cap["y"] == [79.2, 79.2] and cap["x"] == [0, 3]
    (used,) = traces(fig, phase="train", what="used")
    assert used["y"] == [30.0, 31.0, 32.0] and used["meta"]["key"] == "gpu_mem_peak_train_gib"
    assert traces(fig, phase="rollout", what="planned")[0]["y"] == [20.0, 20.0]
    assert "GPU max_memory_allocated" in fig["layout"]["title"]["text"]


def test_report_command(tmp_path):
    from typer.testing import CliRunner

    from trainfit.app.cli import app

    r = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "holds no metrics.jsonl" in " ".join(r.output.split()) and "Traceback" not in r.output
    _rows(tmp_path / "0-sft" / "metrics.jsonl", [{"step": 1, "kind": "train", "loss": 2.0}])
    r = CliRunner().invoke(app, ["report", str(tmp_path), "--out", str(tmp_path / "r.html")])
    assert r.exit_code == 0, r.output
    assert traces(figures(tmp_path / "r.html")["fig-curves"], metric="loss", stage="0-sft")[0]["y"] == [2.0]


def _shot(folder: Path, name: str, size, colour=(255, 255, 255)) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    sha = (name * 64)[:64]
    Image.new("RGB", size, colour).save(folder / f"{sha[:32]}.png")
    return sha


def test_replay_draws_clicks_shows_penalties_and_puts_failures_first(tmp_path):
    screens = tmp_path / "screens"
    a = _shot(screens, "a", (160, 120))
    click = {"step": 3, "reward": 1.0, "turns": 1, "end": "done", "messages": [
        {"role": "user", "content": "Click it.<image>", "image_hashes": [a]},
        {"role": "assistant", "content": "I see it. click(40, 50)"}]}
    typed = {"step": 3, "reward": 0.5, "turns": 1, "end": "done", "messages": [
        {"role": "user", "content": "Type.<image>", "image_hashes": [a]},
        {"role": "assistant", "content": 'type("hello")'}]}
    bad = {"step": 2, "reward": -0.1, "turns": 1, "end": "max_turns", "messages": [
        {"role": "user", "content": "Click it.<image>", "image_hashes": [a]},
        {"role": "assistant", "content": "click(400, 50)"}]}
    chat = {"step": 1, "reward": 0.0, "turns": 1, "end": "done", "messages": [
        {"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "<tool_call>calc</tool_call>"},
        {"role": "tool", "content": "5"}]}
    _rows(tmp_path / "transcripts.jsonl", [click, typed, bad, chat])
    _rows(tmp_path / "metrics.jsonl", [{"step": 1, "kind": "train", "loss": 1.0}])
    report_html.write_report(tmp_path)
    assert 'href="replay.html"' in (tmp_path / "report.html").read_text()
    page = (tmp_path / "replay.html").read_text()
    rewards = [float(x) for x in re.findall(r'<section id="ep-\d+" class="episode \w+" data-reward="([^"]+)"', page)]
    assert rewards == [-0.1, 0.0, 0.5, 1.0]
    sections = page.split("<section")[1:]
    # A click outside the 160 x 120 screen is the parser's penalty, word for word.
    assert html.escape(parse_action("click(400, 50)", 160, 120).message) in sections[0]
    assert '<circle class="click" cx="40" cy="50"' in sections[3] and 'viewBox="0 0 160 120"' in sections[3]
    assert "action: click(40, 50)" in sections[3] and "I see it. click(40, 50)" in sections[3]
    assert "type: hello" in sections[2]
    assert f'src="screens/{a[:32]}.png"' in sections[3]
    # The text-only episode reads as a chat: every message with its role, no screenshot.
    assert 'class="msg tool"' in sections[1] and "<img" not in sections[1] and "&lt;tool_call&gt;calc" in sections[1]


def test_screen_keeper_keeps_the_kept_episodes_screenshots_scaled(tmp_path):
    from trainfit.data.image_parts import IMAGES_KEY
    from trainfit.envs.base import StepResult
    from trainfit.train.screens import MAX_SIDE, ScreenKeeper

    class Env:
        def __init__(self):
            self.closed = False

        def reset(self, ex):
            return [{"role": "user", "content": "<image>", "image_hashes": [ex * 64],
                     IMAGES_KEY: [Image.new("RGB", (2 * MAX_SIDE, MAX_SIDE), (9, 9, 9))]}]

        def step(self, action):
            return StepResult([{"role": "user", "content": "<image>", "image_hashes": ["c" * 64],
                                IMAGES_KEY: [Image.new("RGB", (10, 10))]}], 0.0, True)

        def close(self):
            self.closed = True

    keeper = ScreenKeeper(Env, ["a"])
    kept, other = keeper.make_env(), keeper.make_env()
    msgs = kept.reset("a")
    res = kept.step("click(1, 1)")
    other.reset("b")
    other.close()
    assert set(keeper.images) == {"a" * 64, "c" * 64}   # the other episode's screenshot is not held
    records = [{"messages": msgs + res.observation}]
    assert keeper.save(records, tmp_path) == 2 and keeper.save(records, tmp_path) == 0
    with Image.open(tmp_path / f"{'a' * 32}.png") as im:
        assert max(im.size) == MAX_SIDE
    assert json.loads((tmp_path / f"{'a' * 32}.json").read_text())["size"] == [2 * MAX_SIDE, MAX_SIDE]
    assert not (tmp_path / f"{'c' * 32}.json").exists()


def test_multi_turn_screen_run_keeps_and_replays_its_screenshots(tmp_path):
    r = screen_run(tmp_path / "run")
    assert r.exit_code == 0, r.output + repr(r.exception)
    run = tmp_path / "run"
    records = [json.loads(x) for x in (run / "transcripts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4   # logging.save_transcripts=4 a step, two steps
    hashes = {h for rec in records for m in rec["messages"] for h in m.get("image_hashes") or []}
    assert hashes and all((run / "screens" / f"{h[:32]}.png").is_file() for h in hashes)
    page = (run / "replay.html").read_text()
    assert len(re.findall(r'<section id="ep-\d+"', page)) == 8
    assert all(int(n) >= 1 for n in re.findall(r'data-shots="(\d+)"', page))
    assert 'href="replay.html"' in (run / "report.html").read_text()


def test_report_phases_are_the_meters_and_a_report_never_imports_torch():
    import subprocess
    import sys

    from trainfit.train.memstats import PHASES
    from trainfit.train.report_data import PHASES as DRAWN

    assert DRAWN == PHASES
    code = "import sys, trainfit.app.report_commands, trainfit.train.report_html; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _killed_train(args: list[str]) -> int:
    """`trainfit train ARGS` in a forked child that a --fault kills (no fresh interpreter's imports)."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_train_child, args=(args,))
    child.start()
    child.join(300)
    return child.exitcode


def _train_child(args: list[str]) -> None:
    import io
    import sys

    sys.stdout = sys.stderr = io.StringIO()
    from trainfit.app.cli import app

    app(["train", *args], prog_name="trainfit")


def test_a_real_resume_and_out_of_memory_retry_are_marked(tmp_path):
    import signal

    from typer.testing import CliRunner

    from trainfit.app.cli import app

    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"stage: sft\nrun_dir: {tmp_path / 'run'}\nmodel: {{name: 'preset:tiny'}}\n"
                   "task: {name: arithmetic, max_operand: 9, num_eval: 8}\n"
                   "train: {device: cpu, max_steps: 3, global_batch_size: 8, micro_batch_size: 8, save_every: 2,"
                   " lr: 1e-3}\n"
                   "logging: {progress: false, report_to: none}\n")
    assert _killed_train([str(cfg), "--fault", "kill_after_step:2"]) == -signal.SIGKILL
    r = CliRunner().invoke(app, ["train", str(cfg), "--resume", "--fault", "oom_at_micro:1"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    figs = figures(tmp_path / "run" / "report.html")
    ev = [(e["kind"], e["step"]) for e in figs["fig-curves"]["layout"]["meta"]["events"]]
    assert ev == [("resume", 2), ("oom", 2)]
    assert "resumed from" in (tmp_path / "run" / "report.html").read_text()
