"""Two runs of a short cua_tiny-like config (SFT, then multi-turn GRPO against the MiniWoB++ service) with the
same train.seed give the same metrics, bit for bit: losses, rewards, held-out success. Their episodes run
concurrently on a pool smaller than a GRPO step's batch, so browsers are shared and episodes replayed,
and the two runs meet other browser histories; none of that may show in the numbers (make test-cua;
train.device=cpu)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.cua

from cua_helpers import BrowserPool, EnvServer, MiniWoBService  # noqa: E402  (skips without Chromium)
from trainfit.config import load_config  # noqa: E402
from trainfit.envs.miniwob_rows import write_expert_rows  # noqa: E402
from trainfit.train.report import read_metrics  # noqa: E402
from trainfit.train.run import run_pipeline  # noqa: E402

TASKS = ["click-test", "focus-text", "click-dialog"]
SFT_STEPS, SFT_LR = 40, 1e-2   # enough for valid clicks: GRPO's episodes reach the browser, rewards differ
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cua_tiny.yaml"


def _machine(key: str) -> bool:
    """Metrics of the machine's speed and memory, not of the run's arithmetic."""
    return key == "time" or key.startswith("time_") or key in ("step_time", "tokens_per_s") or key.endswith("_gib")


def _numbers(path) -> list[dict]:
    """Every metrics row but the memory reports, without the machine's timings and memory."""
    return [{k: v for k, v in row.items() if not _machine(k)} for row in read_metrics(path) if row["kind"] != "memory"]


def _first_difference(a: list[dict], b: list[dict]) -> str:
    for x, y in zip(a, b):
        keys = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        if keys:
            return f"step {x.get('step')} ({x.get('kind')}): " + ", ".join(f"{k} {x.get(k)} != {y.get(k)}" for k in keys)
    return f"{len(a)} rows != {len(b)} rows"


def test_same_seed_same_metrics(tmp_path):
    from rich.console import Console

    pool = BrowserPool(2)       # 4 episodes a GRPO step on 2 browsers: shared, replayed
    service = MiniWoBService(TASKS, pool, episode_timeout_s=600)
    server = EnvServer(service).start()
    try:
        rows, written, _ = write_expert_rows(service, TASKS, range(4), tmp_path / "data")
        assert written == 12
        base = yaml.safe_load(EXAMPLE.read_text())
        base["env"]["url"] = server.url
        base["task"]["num_eval"] = 3
        base["rollout"]["max_turns"] = 2
        base["logging"] = {"tensorboard": False, "progress": False, "plot": False, "save_transcripts": 0}
        sft, grpo = base["stages"]
        sft["data"] = {"path": str(rows), "eval_fraction": 0.0}
        sft["train"].update(max_steps=SFT_STEPS, lr=SFT_LR, global_batch_size=8, micro_batch_size=8, warmup_steps=0,
                            eval_every=SFT_STEPS)
        grpo["train"].update(max_steps=2, global_batch_size=4, micro_batch_size=4, eval_every=2)
        grpo["grpo"].update(num_generations=2, num_iterations=1)
        runs = []
        for name in ("a", "b"):
            base["run_dir"] = str(tmp_path / name)
            run_pipeline(load_config(None, [], base=base), console=Console(quiet=True))
            runs.append([_numbers(tmp_path / name / stage / "metrics.jsonl") for stage in ("0-sft", "1-grpo")])
        replays = pool.stats()["replays"]
    finally:
        server.stop()
        pool.close()
    (sft_a, grpo_a), (sft_b, grpo_b) = runs
    steps = [r for r in grpo_a if "reward" in r]
    assert len(steps) == 2 and [r for r in sft_a if "loss" in r]
    # The episodes were real: valid clicks with differing rewards (a learning signal), on shared browsers.
    assert any(r["reward_std"] > 0 for r in steps) and replays > 0
    assert sft_a == sft_b and grpo_a == grpo_b, _first_difference(sft_a + grpo_a, sft_b + grpo_b)
    summary = [json.loads((tmp_path / n / "summary.json").read_text())["accuracy"] for n in ("a", "b")]
    assert summary[0] == summary[1]
