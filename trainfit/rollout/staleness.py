"""What an asynchronous rollout worker samples with and holds (rollout.mode=async), shared by the worker
(train/async_rollout.py) and the planner (plan/rollout.py, `async_items`), so the plan sizes what runs.

Rollout r is sampled by policy version `sampled_version(r, k, start)`. The worker holds one copy of the
trainable tensors (its module; frozen tensors are shared with the trainer), up to `held_snapshots(k)`
more copies of them (weights pushed while it samples, waiting for the rollouts that need them), and up to
`queued_rollouts(k)` sampled rollouts waiting for the trainer, in CPU RAM. A worker in a process of its own
(rollout.worker=process, train/async_process.py) also holds a push buffer (one more copy of the trainable
tensors, in shared memory), loads a whole policy at its start before it takes the trainer's shared frozen
tensors, and runs an interpreter of its own (WORKER_PROCESS_RUNTIME).
"""

from __future__ import annotations

# A queued sample in CPU RAM per token, as the trainer keeps it: input_ids and loss_mask as Python lists
# (8-byte pointers each), the int objects of generated ids (28 bytes; small ints and the prompt's ids, shared by
# a group, are not counted again) and the behaviour log-probs (fp32) of a stale sample.
QUEUE_BYTES_PER_TOKEN = 8 + 8 + 4
QUEUE_BYTES_PER_NEW_TOKEN = 28
# A rollout worker process's own resident memory besides tensors: Python, torch, transformers, trainfit, the
# tokenizer and the task (VmRSS of the child after its start with preset:tiny, torch 2.13 CPU: 0.36 GiB).
WORKER_PROCESS_RUNTIME = int(0.36 * 1024 ** 3)


def sampled_version(rnd: int, k: int, start: int = 0) -> int:
    """The policy version (rollouts consumed) that samples rollout `rnd` with max_staleness `k`, the worker
    starting at version `start` (0, or the rollout a resumed stage reaches first): the oldest the bound
    allows, never before the start."""
    return max(start, rnd - k)


def held_snapshots(k: int) -> int:
    """Pushed weights the worker can hold besides its copy. With k <= 1 every push lands while it waits for
    it (none). With k >= 2, when the trainer takes rollout s and pushes version s, the copy may still hold
    version s - k (rollout s's), so versions s - k + 1 .. s wait as snapshots: k of them."""
    return k if k >= 2 else 0


def queued_rollouts(k: int) -> int:
    """Sampled rollouts waiting for the trainer at most: rollout r needs version r - k, pushed when the
    trainer takes rollout r - k, so the worker is never more than k rollouts ahead."""
    return k


def queue_bytes(rows: int, seq: int, new_tokens: int) -> int:
    """CPU RAM of one queued rollout of `rows` samples of `seq` tokens, `new_tokens` of them generated."""
    return rows * (seq * QUEUE_BYTES_PER_TOKEN + new_tokens * QUEUE_BYTES_PER_NEW_TOKEN)
