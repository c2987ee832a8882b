"""A reward file that loads in the trainer's process but fails in the async rollout worker's process
(rollout.worker=process), as a file that needs something only the trainer's process has would."""

import multiprocessing

if multiprocessing.current_process().name == "trainfit-rollout":
    raise RuntimeError("this reward file cannot be loaded in the rollout worker process")


def length_reward(prompts, completions, **fields):
    return [float(len(c)) for c in completions]
