"""Verifiable tasks (examples for SFT, prompts and rewards for GRPO) and reward functions.

    task = build_task(cfg.task)
    ex = task.train_example(i)                     # deterministic in (task.seed, i)
    fns = resolve_rewards(cfg.task, task)          # [(name, fn)], `default` = task.reward_funcs()
    weights = resolve_weights(cfg.task, task)      # one per fn
    total, per_fn = score(fns, weights, prompts, completions, examples)
    accuracy = mean(task.is_correct(c, ex) for c, ex in zip(completions, task.eval_examples()))
"""

from __future__ import annotations

from trainfit.config import ConfigError

from .arithmetic import ArithmeticTaggedTask, ArithmeticTask
from .base import Example, RewardFn, Task
from .jsonl_task import JsonlTask
from .math_reward import math_verify
from .rewards import (BUILTIN_REWARDS, exact_match, format_reward, gather_fields, load_reward,
                      numeric_match, resolve_rewards, resolve_weights, score)

TASK_NAMES = ("arithmetic", "arithmetic_tagged", "jsonl", "dataset", "shapes")


def build_task(task_cfg) -> Task:
    """The task named by `task_cfg.name` (a `TaskConfig`). Raises ConfigError for unknown names."""
    name = task_cfg.name
    if name in ("arithmetic", "arithmetic_tagged"):
        cls = ArithmeticTask if name == "arithmetic" else ArithmeticTaggedTask
        return cls(seed=task_cfg.seed, num_eval=task_cfg.num_eval, max_operand=task_cfg.max_operand,
                   num_operands=task_cfg.num_operands, operations=task_cfg.operations, chat=task_cfg.chat,
                   num_train=task_cfg.num_train)
    if name in ("jsonl", "dataset"):  # rows from task.path (tasks/jsonl_task.py)
        if not task_cfg.path:
            raise ConfigError(f"task.name={name} needs task.path, the rows with `prompt` or `messages` and "
                              "`answer` (a JSONL or parquet file, a dataset folder or a hub id).")
        return JsonlTask(task_cfg.path, eval_path=task_cfg.eval_path, seed=task_cfg.seed,
                         num_eval=task_cfg.num_eval, chat=task_cfg.chat, source=task_cfg, name=name)
    if name == "shapes":  # images: for vision-language models (tasks/shapes.py)
        from .shapes import ShapesTask

        return ShapesTask(seed=task_cfg.seed, num_eval=task_cfg.num_eval, chat=task_cfg.chat)
    if name is None:
        raise ConfigError(f"task.name is not set; choose one of {', '.join(TASK_NAMES)}.")
    raise ConfigError(f"Unknown task.name {name!r}; valid names are {', '.join(TASK_NAMES)} "
                      "(jsonl and dataset read your own rows from task.path).")


__all__ = ["ArithmeticTask", "ArithmeticTaggedTask", "BUILTIN_REWARDS", "Example", "JsonlTask",
           "RewardFn", "TASK_NAMES", "Task", "build_task", "exact_match", "format_reward",
           "gather_fields", "load_reward", "math_verify", "numeric_match", "resolve_rewards", "resolve_weights",
           "score"]
