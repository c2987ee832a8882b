"""Held-out success of a computer-use policy on MiniWoB++, per task and per turn (what `cua_tiny`'s summary
gives as one number), greedy and optionally sampled at the rollout temperature.

    trainfit env serve miniwob --tasks click-test,focus-text,click-dialog --port 8767 --pool 32 &
    .venv/bin/python -m bench.cua_eval runs/cua_tiny/0-sft/final --episodes 150
    .venv/bin/python -m bench.cua_eval runs/cua_tiny/final --episodes 150 --sampled 4 rollout.max_turns=2

The model plays instances 0..N-1 of the evaluation split (MiniWoB seeds never trained on; the tasks in
turn, as examples/data/cua_tiny_eval.jsonl lists them) against the service at the config's env.url, with
the config's rollout settings (any `key=value` after the model overrides them, before or after the
options). `--sampled K` also plays each of the first instances K times at rollout.temperature: the
success GRPO's samples see, and pass@K (an instance solved by at least one of its K episodes), the room
GRPO has above greedy.
Prints one line per mode: overall success, then per task the success and the share solved by the
first click (`t1`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from trainfit.config.io import load_config
from trainfit.config.schema import expand_stages
from trainfit.envs import run_episodes
from trainfit.train.run import build_stage

TASKS = ("click-test", "focus-text", "click-dialog")


def _examples(base, n: int, tasks: tuple[str, ...]) -> list:
    """Evaluation instances 0..n-1, the tasks in turn (the example's eval file's order)."""
    return [dataclasses.replace(base, fields={**base.fields, "miniwob_task": tasks[s % len(tasks)], "seed": s,
                                              "split": "eval"}) for s in range(n)]


def _report(name: str, episodes: list, examples: list, group: int = 1) -> str:
    ok = [bool(e.info.get("success")) and not e.failed for e in episodes]
    by, first = collections.defaultdict(list), collections.defaultdict(list)
    for e, x, good in zip(episodes, examples, ok):
        by[x.fields["miniwob_task"]].append(good)
        first[x.fields["miniwob_task"]].append(good and e.turns == 1)
    line = f"{name}: success {sum(ok) / len(ok):.3f} (n={len(ok)})"
    if group > 1:
        solved = [any(ok[i:i + group]) for i in range(0, len(ok), group)]
        line += f", pass@{group} {sum(solved) / len(solved):.3f}"
    return line + "  " + "  ".join(f"{t} {sum(v) / len(v):.2f} (t1 {sum(first[t]) / len(v):.2f})" for t, v in by.items())


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line; options and key=value overrides may come in any order after the model."""
    ap = argparse.ArgumentParser(prog="python -m bench.cua_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model dir (a run's final/ or a checkpoint)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.max_turns=2")
    ap.add_argument("--config", default="examples/cua_tiny.yaml")
    ap.add_argument("--episodes", type=int, default=150, help="evaluation instances played greedily")
    ap.add_argument("--sampled", type=int, default=0, help="also play each of the first --sampled-instances this many times at the rollout temperature")
    ap.add_argument("--sampled-instances", type=int, default=60)
    ap.add_argument("--tasks", default=",".join(TASKS))
    # Intermixed: plain parse_args fills the positionals from their first run only, so an override after
    # an option (`<model> --episodes 150 rollout.max_turns=2`) would be "unrecognized".
    return ap.parse_intermixed_args(argv)


def main() -> None:
    a = parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(a.config, ["stages=[{stage: grpo}]", f"model.name={a.model}", f"run_dir={tmp}", *a.overrides])
        scfg = expand_stages(cfg)[0]
        _, stage, _ = build_stage(scfg, Path(tmp))
        r = scfg.rollout

        def play(examples: list, greedy: bool, first_seed: int) -> list:
            out = []
            for i in range(0, len(examples), 32):   # 32 at a time: one browser each with --pool 32
                chunk = examples[i:i + 32]
                out += run_episodes(stage.make_env, chunk, stage.engine, stage.tokenizer,
                                    seeds=[first_seed + i + j for j in range(len(chunk))], greedy=greedy,
                                    max_turns=r.max_turns, max_new_tokens=r.max_new_tokens,
                                    max_prompt_length=r.max_prompt_length, max_episode_tokens=scfg.episode_tokens(),
                                    max_observation_tokens=scfg.env.max_observation_tokens, processor=stage.vision,
                                    max_images=r.max_images_per_episode)
            return out

        began = time.monotonic()
        examples = _examples(stage.task.eval_examples()[0], a.episodes, tuple(a.tasks.split(",")))
        print(_report("greedy", play(examples, True, 0), examples), flush=True)
        if a.sampled:
            repeated = [x for x in examples[: a.sampled_instances] for _ in range(a.sampled)]
            print(_report(f"sampled T={r.temperature:g}", play(repeated, False, 10 ** 6), repeated, a.sampled))
        print(f"{time.monotonic() - began:.0f} s, max_turns {r.max_turns}, max_images_per_episode {r.max_images_per_episode}")


if __name__ == "__main__":
    main()
