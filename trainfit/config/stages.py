"""The stage table, started: what each stage holds, reads and saves, for the doors that must decide per stage.

Shared code (config rules, the planner, train/run.py, runnable.py, datacheck.py) reads a stage's
description here instead of comparing its name, so adding a stage is its module plus one entry. Below
plan/ and config (imports nothing from trainfit), so every layer may read it. Stages not listed get
`DEFAULT` (their behaviour is still decided where it always was; issue 22 moves them here).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSpec:
    name: str
    reads_pairs: bool = False        # trains on preference pairs (data.path rows or pairs made from task.name)
    outputs_policy: bool = True      # its final dir is a policy the next pipeline stage continues from
    saves: str = "policy"            # final dir: "policy" (a causal LM) | "reward_model" (a sequence classifier)
    reference: str = "never"         # "never" | "dpo" (decided by dpo.reference: adapters_off | copy | none)
    trained_label: str = ""          # what the trainer's parameter count covers, e.g. "reward model "
    pairs_per_forward: int = 1       # sequences a sample puts through the training forward
    stage_class: str = ""            # "module:Class" of its train/ stage, for stages built from the table


STAGES: dict[str, StageSpec] = {
    "rm": StageSpec("rm", reads_pairs=True, outputs_policy=False, saves="reward_model",
                    trained_label="reward model ", pairs_per_forward=2),
    "dpo": StageSpec("dpo", reads_pairs=True, reference="dpo", pairs_per_forward=2,
                     stage_class="trainfit.train.dpo:DPOStage"),
}


def stage_spec(name: str) -> StageSpec:
    return STAGES.get(name) or StageSpec(name)


# Which dpo.loss_type values compare with a reference (the algos registry, trainfit/algos/preference.py,
# says the same; tests/test_dpo.py checks they agree). Kept here so config needs no torch.
DPO_REFERENCE_FREE = ("simpo", "orpo")


def dpo_reference(loss_type: str, reference: str, peft_method: str) -> str:
    """dpo.reference resolved: none | adapters_off | copy."""
    if reference != "auto":
        return reference
    if loss_type in DPO_REFERENCE_FREE:
        return "none"
    return "adapters_off" if peft_method != "none" else "copy"
