"""The tiny runs the fault-injection harness (bench/faults.py) kills: one per stage, on the CPU, on preset:tiny,
with a checkpoint every step so a resume always has one to continue from, and few enough steps that the whole
harness fits in minutes on two cores.

Each stage is (overrides over BASE, whether an uninterrupted run repeats bit for bit, what is compared). The data
the runs read (preference pairs, a streamed corpus) is written into the harness's work folder by `prepare`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

BASE = {
    "model.name": "preset:tiny",
    "task.name": "arithmetic", "task.max_operand": 9, "task.num_eval": 8,
    "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.max_steps": 6, "train.save_every": 1,
    "train.keep_checkpoints": 2, "train.lr": 1e-3, "train.device": "cpu", "train.cpu_threads": 1,
    "grpo.num_generations": 4, "rollout.max_new_tokens": 4,
    "logging.tensorboard": "false", "logging.progress": "false", "logging.plot": "false",
    "logging.report_to": "none",
}
GRPO = {"grpo.num_iterations": 2, "grpo.beta": 0.05, "rollout.max_new_tokens": 5}
EXACT = ("every tensor of the final safetensors and every train/eval metrics row (timings aside) equal to the "
         "uninterrupted run's, bit for bit")

ASYNC = {"rollout.mode": "async", "rollout.max_staleness": 1, "rollout.sync_check": "never"}
ASYNC_COMPARED = dict(
    deterministic=False,
    compared="the step count, every train step's row exactly once (none lost or repeated), the policy version and "
             "staleness of each step, finite final weights; and bit for bit, counted apart",
    why_not_exact="not required bit for bit, as its rollout worker (a thread, or a child process) samples while the "
                  "trainer trains; the policy version each rollout is sampled with is pinned (rollout.max_staleness), "
                  "so the worker's timing should not change a result, and a run equal bit for bit shows it")


@dataclass(frozen=True)
class StageRun:
    name: str
    overrides: dict
    deterministic: bool = True
    compared: str = EXACT
    why_not_exact: str = ""
    needs_env: bool = False   # env.url is filled with a local HTTP environment service's address
    most_signals: int = 0     # a cap on the signals of each kind (0: as asked), for a stage too slow for more
    why_fewer: str = ""
    data: tuple = field(default_factory=tuple)   # files prepare() writes: "pairs", "corpus"


STAGES = {s.name: s for s in (
    StageRun("sft", {"stage": "sft"}),
    StageRun("pretrain-stream", {"stage": "pretrain", "task.name": "null", "data.streaming": "true",
                                 "data.max_seq_length": 16}, data=("corpus",)),
    StageRun("rm", {"stage": "rm", "task.name": "null", "data.eval_fraction": 0.25}, data=("pairs",)),
    StageRun("dpo", {"stage": "dpo", "task.name": "null", "data.eval_fraction": 0.25,
                     "dpo.precompute_reference": "true"}, data=("pairs",)),
    StageRun("grpo-sync", {"stage": "grpo", **GRPO}),
    StageRun("grpo-async", {"stage": "grpo", **GRPO, **ASYNC}, **ASYNC_COMPARED),
    StageRun("grpo-async-process", {"stage": "grpo", **GRPO, **ASYNC, "rollout.worker": "process"}, **ASYNC_COMPARED,
             most_signals=3, why_fewer="each start of its worker is a fresh interpreter (spawn): 10-30 s of imports "
                                       "per run or resume on two busy cores"),
    StageRun("ppo", {"stage": "ppo", "ppo.value_lr": 3e-3, "rollout.max_new_tokens": 5}),
    StageRun("agent-grpo-http", {"stage": "grpo", **GRPO, "env.type": "http", "rollout.max_turns": 2,
                                 "env.timeout_s": 10, "rollout.max_new_tokens": 6}, needs_env=True),
)}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pairs_file(path: Path, n: int = 48, seed: int = 0) -> Path:
    """Preference pairs a+b=: the chosen answer ends in " yes", the rejected one in " no"."""
    rng = random.Random(seed)
    sums = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n)]
    return _jsonl(path, [{"prompt": f"{a}+{b}=", "chosen": f"{a + b} yes", "rejected": f"{a + b} no"} for a, b in sums])


def corpus_file(path: Path, n: int = 40, seed: int = 0) -> Path:
    """Short documents for a streamed pretraining run (a JSONL file read through datasets' json builder)."""
    rng = random.Random(seed)
    words = "the a cat dog sat ran on under mat tree red blue quick slow and then".split()
    return _jsonl(path, [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(6, 14))) + "."}
                         for _ in range(n)])


def overrides_for(stage: StageRun, work: Path, run_dir: Path, env_url: str = "") -> dict:
    """The full key=value overrides of one run of `stage` into `run_dir`, its data written under `work`."""
    over = {**BASE, **stage.overrides, "run_dir": str(run_dir)}
    if "pairs" in stage.data:
        over["data.path"] = str(pairs_file(work / "pairs.jsonl"))
    if "corpus" in stage.data:
        over["data.path"] = str(corpus_file(work / "corpus.jsonl"))
    if stage.needs_env:
        over["env.url"] = env_url
    return over


def write_config(over: dict, path: Path) -> Path:
    """The run's config as YAML (validated by trainfit's own loader), for `trainfit train <path>`."""
    from trainfit.config import load_config, to_yaml

    path.write_text(to_yaml(load_config(None, [f"{k}={v}" for k, v in over.items()])))
    return path
