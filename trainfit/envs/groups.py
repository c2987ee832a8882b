"""GRPO groups of episodes, kept whole when the environment service restarts or goes away for a while.

    eps = run_groups(make_env, flat_examples, engine, tokenizer, group_size=G, group_retries=2,
                     seeds=seeds, max_turns=4, ...)           # the rest as run_episodes takes

A group's advantages compare its G episodes with each other, so a group must not train on some episodes
of one attempt and lose the others to a restarted service. An episode that fails with EnvLost (the
service no longer knows it, or stayed unreachable through its request's retries, trainfit/envs/http.py)
marks its whole group for sampling again: all G episodes, fresh environments, the same examples and
seeds (so the same policy turns wherever the environment answers as before). Groups without a lost
episode are kept as they are. After `group_retries` such rounds a group still losing episodes stops the
run with the service's own message (URL, attempts, seconds, last error).

Held-out evaluation runs its greedy episodes as groups of one (train/evaluate.py): an episode lost to a
restart is played again rather than counted as a failure the policy did not make.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from trainfit.core.errors import EnvLost

from .episodes import Episode, run_episodes

log = logging.getLogger(__name__)


def lost_groups(episodes: Sequence[Episode], group_size: int) -> list[int]:
    """Indexes of the groups (consecutive runs of `group_size` episodes) with a lost episode."""
    return sorted({i // group_size for i, ep in enumerate(episodes) if ep.lost})


TRAINING = "the step is not trained on part of a group"


def run_groups(make_env: Callable[[], Any], examples: Sequence[Any], engine, tokenizer, *, group_size: int,
               group_retries: int, seeds: Sequence[int], why: str = TRAINING, **kw) -> list[Episode]:
    """run_episodes over whole groups: groups that lost an episode are sampled again, whole. `why`: what the
    final error says is protected by stopping (a training step's groups; evaluation's scores)."""
    if group_size < 1 or len(examples) % group_size:
        raise ValueError(f"{len(examples)} episodes are not whole groups of {group_size}.")
    eps = run_episodes(make_env, examples, engine, tokenizer, seeds=seeds, **kw)
    for attempt in range(group_retries + 1):
        lost = lost_groups(eps, group_size)
        if not lost:
            return eps
        first = next(ep.error for ep in eps if ep.lost)
        if attempt == group_retries:
            raise EnvLost(f"{len(lost)} of {len(eps) // group_size} groups still lost episodes after sampling them "
                           f"again {group_retries} time{'s' if group_retries != 1 else ''} (env.group_retries); {why}. "
                           f"First error: {first}")
        log.warning("sampling %d group(s) again, whole (%d of %d): %s", len(lost), attempt + 1, group_retries, first)
        idx = [g * group_size + k for g in lost for k in range(group_size)]
        again = run_episodes(make_env, [examples[i] for i in idx], engine, tokenizer, seeds=[seeds[i] for i in idx],
                             **kw)
        for i, ep in zip(idx, again):
            eps[i] = ep
    return eps
