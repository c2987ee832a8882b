"""Two runs of a short cua_tiny-like config (SFT, then multi-turn GRPO against the MiniWoB++ service) with the
same train.seed give the same metrics, bit for bit: losses, rewards, held-out success. Their episodes run
concurrently on a pool smaller than a GRPO step's batch, so browsers are shared and episodes replayed,
and the two runs meet other browser histories; none of that may show in the numbers (make test-cua;
train.device=cpu)."""

from __future__ import annotations

import json

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
# What depends on the machine's speed or memory, not on the run's arithmetic.
TIMING = ("time", "sec", "_s", "tok_per", "per_s", "mem", "gib", "elapsed", "wall", "throughput")


def _numbers(path) -> list[dict]:
    return [{k: v for k, v in row.items() if not any(t in k.lower() for t in TIMING)} for row in read_metrics(path)]


def test_same_seed_same_metrics(tmp_path):
    from rich.console import Console

    pool = BrowserPool(2)       # 4 episodes a GRPO step on 2 browsers: shared, replayed
    service = MiniWoBService(TASKS, pool, episode_timeout_s=600)
    server = EnvServer(service).start()
    try:
        rows, written, _ = write_expert_rows(service, TASKS, range(4), tmp_path / "data")
        assert written == 12
        base = yaml.safe_load(open("examples/cua_tiny.yaml"))
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
    finally:
        server.stop()
        pool.close()
    (sft_a, grpo_a), (sft_b, grpo_b) = runs
    assert [r["loss"] for r in sft_a if "loss" in r] and [r["reward"] for r in grpo_a if "reward" in r]
    assert sft_a == sft_b and grpo_a == grpo_b
    summary = [json.loads((tmp_path / n / "summary.json").read_text())["accuracy"] for n in ("a", "b")]
    assert summary[0] == summary[1]
