"""Which of a node's GPUs train and which run the asynchronous rollout worker (distributed.rollout_gpus).

One function decides it, read by the trainer (train/grpo.py places the worker's copy of the policy on
`rollout_device`), the planner (plan/memory.py sizes each device) and fit / hardware (plan/split.py
times the splits), so what is planned and what runs cannot drift apart.

The training processes take the first GPUs of the node (local rank r trains on GPU r, as torchrun and a
single process do: cuda:0 first); the rollout GPUs are the last ones. With num_gpus=2 and rollout_gpus=1:
GPU 0 trains, GPU 1 samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trainfit.config.words import count


@dataclass(frozen=True)
class DeviceSplit:
    """GPU indices of one node by role; `rollout` is empty when every GPU trains (and, with
    rollout.mode=async, the worker shares the trainer's device)."""

    train: tuple[int, ...]
    rollout: tuple[int, ...]

    @property
    def separate(self) -> bool:
        """Whether the rollout worker has GPUs of its own."""
        return bool(self.rollout)

    def describe(self) -> str:
        if not self.rollout:
            return f"{count(len(self.train), 'GPU')} train and roll out in turn"
        return f"{_gpus(self.train)} train, {_gpus(self.rollout)} the rollout worker"


def _gpus(ids: tuple[int, ...]) -> str:
    return ("GPU " if len(ids) == 1 else "GPUs ") + ", ".join(map(str, ids))


def device_split(num_gpus: int, rollout_gpus: int) -> DeviceSplit:
    """The split of `num_gpus` GPUs of a node with `rollout_gpus` of them for the rollout worker: the
    first num_gpus - rollout_gpus train, the rest roll out. Raises ValueError when no GPU is left to
    train (the config rules refuse that first, with the fix)."""
    if not 0 <= rollout_gpus < num_gpus:
        raise ValueError(f"rollout_gpus={rollout_gpus} must be at least 0 and below num_gpus={num_gpus}")
    cut = num_gpus - rollout_gpus
    return DeviceSplit(tuple(range(cut)), tuple(range(cut, num_gpus)))


def rollout_device(split: DeviceSplit, train_device: str) -> str:
    """The device the rollout worker's copy of the policy lives on: the first rollout GPU when the split
    gives it one (`cuda:1`), else the trainer's own device (`train_device`, e.g. `cpu`)."""
    return f"cuda:{split.rollout[0]}" if split.rollout else train_device


def shared_gpu_note(mode: str, split: DeviceSplit, device: str) -> Optional[str]:
    """What the plan says of rollout.mode=async on one GPU (`device` is the trainer's, e.g. `cuda:0`; the
    planner passes `cuda` for the card it plans), or None. It runs: the worker's thread samples on the same
    card as the trainer, but their kernels share the card's default stream, so sampling queues behind
    training and the step time is planned as sync's (no overlap)."""
    if mode != "async" or split.separate or device.split(":")[0] == "cpu":
        return None
    return (f"rollout.mode=async with distributed.rollout_gpus=0: the rollout worker shares {device} with the "
            "trainer, so sampling queues behind training (step time planned as in turn). For a GPU of its own "
            "set distributed.num_gpus=2 and distributed.rollout_gpus=1.")
