"""Config section for offline preference optimisation (stage dpo).

Part of the one schema in trainfit.config (which re-exports it); cross-field rules that involve it
are `dpo_errors` there. The loss math is trainfit/algos/preference.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainfit.config.base import _Section


class DPOConfig(_Section):
    loss_type: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo", "kto"] = Field("sigmoid", description=(
        "Preference loss: `sigmoid` (DPO, Rafailov et al. 2023), `ipo` (Azar et al. 2023), `hinge` (SLiC-style), "
        "`simpo` (Meng et al. 2024: reference-free, length-normalised, margin simpo_gamma), `orpo` (Hong et al. "
        "2024: reference-free, the chosen answer's NLL plus beta x the odds-ratio term), `kto` (Ethayarajh et al. "
        "2024: unpaired rows, each pair's chosen a desirable and its rejected an undesirable example, or data.path "
        "rows {prompt, completion, label: true|false} (TRL's unpaired shape, only kto reads them), against a batch KL "
        "reference point)."))
    beta: float = Field(0.1, gt=0.0, description=(
        "Strength: DPO/IPO/hinge/KTO's inverse temperature on the log-ratio to the reference (IPO's target margin "
        "is 1/(2 beta)), SimPO's reward scale, ORPO's weight of the odds-ratio term (its lambda)."))
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description=(
        "Probability that a pair's label is flipped (cDPO / robust DPO) for `sigmoid` and `simpo`; 0 = none."))
    simpo_gamma: float = Field(0.5, ge=0.0, description="SimPO's target reward margin gamma (in reward units, not / beta).")
    sft_weight: float = Field(0.0, ge=0.0, description=(
        "Weight of the chosen answer's token-mean NLL added to the loss (RPO's alpha, Pang et al. 2024); 0 = none. "
        "ORPO has its own NLL term."))
    desirable_weight: float = Field(1.0, gt=0.0, description="KTO: weight of desirable (chosen) rows' losses.")
    undesirable_weight: float = Field(1.0, gt=0.0, description="KTO: weight of undesirable (rejected) rows' losses.")
    reference: Literal["auto", "adapters_off", "copy", "none"] = Field("auto", description=(
        "Reference policy: `adapters_off` = the trained model with its LoRA/DoRA adapters disabled (no extra "
        "weights), `copy` = a frozen copy of the starting weights, `none` = no reference (simpo, orpo). `auto` = "
        "none for the reference-free losses, adapters_off with peft, else copy."))
    precompute_reference: bool = Field(False, description=(
        "Compute every training and held-out pair's reference log-probs in one pass before the first step and "
        "store them in the stage directory (a resumed run reads them back); training then holds only the policy "
        "(with full fine-tuning the frozen copy is freed)."))
