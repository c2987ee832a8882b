"""Parameter counts of a plan, one per model the stage holds, counted as the trainer counts them.

The trainer's start line (train/loop.describe_start) counts the parameters of the module its
optimizer trains (models.count_parameters: every parameter once, adapters included): the policy for
pretrain / sft / grpo, the reward model for rm (the backbone plus a [1, hidden] score head in place
of an untied LM head), and policy + critic for ppo (value_model.PolicyCritic; a critic that shares
the policy's base adds only its adapters and head). Frozen models (a reference copy, a reward
model scoring PPO's rollouts) are not in that line; the plan lists them apart so the two agree.

Quantized bases are counted in logical parameters (bitsandbytes stores two 4-bit values a byte, so
count_parameters on a loaded QLoRA model reports about half of the quantized linears).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trainfit.config.stages import stage_spec
from trainfit.config.words import count
from trainfit.models.shapes import ArchFacts
from trainfit.plan.states import States


@dataclass
class Count:
    model: str          # policy | critic | reward model | reference | ...
    params: int         # parameters of the module as loaded (adapters and score head included)
    trainable: int
    trained: bool       # in the trainer's optimizer (and its start line)
    note: str = ""


def loaded_params(facts: ArchFacts, adapters: int = 0, score_head: bool = False) -> int:
    """Parameters of a loaded model: its architecture, its adapters, and for a value / reward model a
    [1, hidden] score head (no bias) instead of the LM head (a tied head was never counted apart)."""
    return facts.n_params + adapters + ((facts.hidden - facts.n_lm_head) if score_head else 0)


def plan_counts(cfg, facts: ArchFacts, pol: States, ref_copy: bool, vf: Optional[ArchFacts] = None,
                val: Optional[States] = None, rf: Optional[ArchFacts] = None) -> list[Count]:
    """The models of a plan with their counts: the trained ones first (what the trainer's line sums)."""
    # Under peft the trainable parameters are the adapters (+ the score head of a reward model).
    peft = cfg.peft.method != "none"
    scalar_head = stage_spec(cfg.stage).saves == "reward_model"   # a reward model: one output per sequence
    adapters = pol.trainable_params - (facts.hidden if scalar_head else 0) if peft else 0
    if scalar_head:
        # peft's SEQ_CLS task keeps the score head twice (the original, frozen, and the trained copy in
        # modules_to_save), so the loaded model holds one more [1, hidden] than it trains.
        out = [Count("reward model", loaded_params(facts, adapters, score_head=True) + (facts.hidden if peft else 0),
                     pol.trainable_params, True, "the backbone + a [1, hidden] score head")]
    else:
        out = [Count("policy", loaded_params(facts, adapters), pol.trainable_params, True)]
    if vf is not None and val is not None:
        if cfg.ppo_shared_base():  # the critic's base is the policy's tensors: only its adapters and head are new
            out.append(Count("critic", val.trainable_params, val.trainable_params, True,
                             "shares the policy's base: its adapters + value head"))
        else:
            v_adapters = val.trainable_params - vf.hidden if peft else 0
            out.append(Count("critic", loaded_params(vf, v_adapters, score_head=True), val.trainable_params, True,
                             "backbone + value head"))
    if ref_copy:
        out.append(Count("reference", facts.n_params, 0, False, "frozen copy of the policy"))
    if rf is not None:
        out.append(Count("reward model", loaded_params(rf, score_head=True), 0, False, "frozen"))
    return out


def gpus_text(p) -> str:
    """The GPUs a plan is for, in words: "8 GPUs", or "1 training GPU + 1 rollout GPU" under a split."""
    split = p.devices   # distributed.rollout_gpus: the training and the rollout GPUs
    if split:
        return f"{count(len(split['train']), 'training GPU')} + {count(len(split['rollout']), 'rollout GPU')}"
    return count(p.world, "GPU")


def count_text(n: int) -> str:
    """A parameter count as the plan prints it: 7.07B, 156.0K."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else (f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K")


def describe(counts: list[Count]) -> str:
    """'policy 156.0K + critic 156.1K = 312.1K parameters trained (312.1K trainable); frozen: reference
    156.0K': the trained sum is what the trainer's start line prints."""
    trained = [c for c in counts if c.trained]
    total, trainable = sum(c.params for c in trained), sum(c.trainable for c in trained)
    if len(trained) == 1:
        head = f"Parameters ({trained[0].model}) {count_text(total)}, trainable {count_text(trainable)}"
    else:
        parts = " + ".join(f"{c.model} {count_text(c.params)}" for c in trained)
        head = f"Parameters: {parts} = {count_text(total)} trained together, trainable {count_text(trainable)}"
    frozen = [c for c in counts if not c.trained]
    if frozen:
        head += "; frozen: " + ", ".join(f"{c.model} {count_text(c.params)}" for c in frozen)
    return head
