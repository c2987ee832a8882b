"""Short real runs for the run report's tests: a demo-like SFT -> GRPO pipeline, and multi-turn GRPO on
the tiny VLM against a local screen service (trainfit/envs/http.py's protocol) that sends screenshots."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

from conftest import JSONService
from trainfit.train.report import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def screen(button_x: int, size=(160, 120)):
    """A white page with one blue button at (button_x, 50), 40 x 20 pixels."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(im).rectangle([button_x, 50, button_x + 40, 70], fill=(40, 90, 200))
    return im


def _png(button_x: int) -> str:
    buf = io.BytesIO()
    screen(button_x).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


class ScreenService(JSONService):
    """Opens each episode with a screenshot; a reply holding a click(...) gets another screenshot and
    reward 0.5, anything else the penalty text and -0.1; the episode is done after its second turn."""

    def __init__(self):
        self.turns: dict[str, int] = {}
        super().__init__()

    def answer(self, path, body):
        if path == "/reset":
            eid = f"e{len(self.turns)}"
            self.turns[eid] = 0
            return {"episode_id": eid, "observation": [{"role": "user", "content": [
                {"type": "text", "text": "Click the button."}, {"type": "image", "image": _png(20)}]}]}
        if path == "/step":
            eid = body.get("episode_id", "")
            self.turns[eid] = self.turns.get(eid, 0) + 1
            ok = bool(re.search(r"click\(", body.get("action", "")))
            done = self.turns[eid] >= 2
            obs = [{"role": "user", "content": [{"type": "text", "text": "Screen:"},
                                                {"type": "image", "image": _png(20 + 40 * self.turns[eid])}]}]
            if not ok:
                obs = [{"role": "user", "content": "penalty: write one action such as click(x, y)."}]
            return {"observation": [] if done else obs, "reward": 0.5 if ok else -0.1, "done": done}
        return {}


def train(args: list[str]):
    from typer.testing import CliRunner

    from trainfit.app.cli import app

    return CliRunner().invoke(app, ["train", *args])


def demo_run(run_dir: Path):
    """examples/demo.yaml cut to a few CPU steps, evaluated along the way (report.html at each evaluation)."""
    return train([str(ROOT / "examples/demo.yaml"), "train.device=cpu", f"run_dir={run_dir}", "logging.progress=false",
                  "logging.report_to=none", "task.num_eval=8", "stages.0.train.max_steps=4",
                  "stages.0.train.eval_every=2", "stages.0.train.save_every=0", "stages.1.train.max_steps=2",
                  "stages.1.train.global_batch_size=16", "stages.1.train.micro_batch_size=16",
                  "stages.1.train.eval_every=1", "stages.1.train.save_every=0"])


def assert_curves_hold_metrics(curves: list[dict], run: Path) -> None:
    """The report's curves (plotly traces tagged meta.metric and meta.stage) of a `demo_run` hold each stage's
    loss, grad_norm and accuracy from its metrics.jsonl, the steps counted on from the stages before."""
    offset = 0
    for name in ("0-sft", "1-grpo"):
        rows = read_metrics(run / name / "metrics.jsonl")
        for metric, kind in (("loss", "train"), ("grad_norm", "train"), ("accuracy", "eval")):
            want = [m for m in rows if m["kind"] == kind and metric in m]
            (t,) = [t for t in curves if (t.get("meta") or {}).get("metric") == metric and t["meta"]["stage"] == name]
            assert t["x"] == [m["step"] + offset for m in want] and t["y"] == [m[metric] for m in want], (name, metric)
        offset += [m for m in rows if m["kind"] == "train"][-1]["step"]


def screen_run(run_dir: Path):
    """Multi-turn GRPO on preset:vlm-tiny against a ScreenService of its own: two steps, 8 episodes each."""
    cfg = run_dir.parent / f"{run_dir.name}.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text("stage: grpo\n")
    service = ScreenService()
    try:
        return train([str(cfg), "model.name=preset:vlm-tiny", "task.name=jsonl",
                      f"task.path={ROOT / 'examples/data/cua_tiny_tasks.jsonl'}", "task.chat=true", "task.num_eval=0",
                      "env.type=http", f"env.url={service.url}", "env.timeout_s=30", "rollout.max_turns=2",
                      "rollout.max_new_tokens=8", "rollout.max_prompt_length=256", "rollout.max_images_per_episode=1",
                      "env.max_observation_tokens=64", "train.device=cpu", "train.max_steps=2",
                      "train.global_batch_size=8", "train.micro_batch_size=8", "grpo.num_generations=4",
                      "logging.save_transcripts=4", "logging.progress=false", "logging.report_to=none",
                      f"run_dir={run_dir}"])
    finally:
        service.close()
