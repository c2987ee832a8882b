"""Config section for offline preference optimisation (stage dpo).

Part of the one schema in trainfit.config (which re-exports it); cross-field rules that involve it
are `dpo_errors` there. The loss math is trainfit/algos/preference.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from trainfit.config.base import _Section


class DPOConfig(_Section):
    loss_type: Literal["sigmoid", "robust", "ipo", "hinge", "simpo", "orpo", "kto"] = Field("sigmoid", description=(
        "Preference loss: `sigmoid` (DPO, Rafailov et al. 2023), `robust` (robust DPO, Chowdhury et al. 2024: "
        "unbiased under labels flipped with probability dpo.label_smoothing), `ipo` (Azar et al. 2023), "
        "`hinge` (SLiC-style), "
        "`simpo` (Meng et al. 2024: reference-free, length-normalised, margin simpo_gamma), `orpo` (Hong et al. "
        "2024: reference-free, the chosen answer's NLL plus beta x the odds-ratio term), `kto` (Ethayarajh et al. "
        "2024: unpaired rows, each pair's chosen a desirable and its rejected an undesirable example, or data.path "
        "rows {prompt, completion, label: true|false} (TRL's unpaired shape, only kto reads them), against a batch KL "
        "reference point)."))
    beta: float = Field(0.1, gt=0.0, description=(
        "Strength: DPO/IPO/hinge/KTO's inverse temperature on the log-ratio to the reference (IPO's target margin "
        "is 1/(2 beta)), SimPO's reward scale, ORPO's weight of the odds-ratio term (its lambda)."))
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description=(
        "Probability that a pair's label is flipped, for `sigmoid` and `simpo` the expected loss over the flip "
        "(conservative DPO, cDPO; TRL 1.16's sigmoid ignores its label_smoothing), for `robust` the flip robust DPO "
        "corrects for (TRL's loss_type robust); 0 = none."))
    ipo_normalize: bool = Field(False, description=(
        "`ipo` on length-normalised log-probs (each side's sum divided by its answer's token count), as TRL's "
        "IPO. Default false: the paper's sequence sums. A TRL IPO beta b on answers of about L tokens is "
        "beta ~ b / L here (same target margin; the loss reads ~L^2 larger), or set this to true and keep b."))
    simpo_gamma: float = Field(0.5, ge=0.0, description="SimPO's target reward margin gamma (in reward units, not / beta).")
    sft_weight: float = Field(0.0, ge=0.0, description=(
        "Weight of the chosen answer's token-mean NLL added to the loss (RPO's alpha, Pang et al. 2024); 0 = none. "
        "ORPO has its own NLL term."))
    sft_mean: Literal["pair", "token"] = Field("pair", description=(
        "How sft_weight's NLL is averaged: `pair` = each chosen answer's token mean, then the mean over pairs "
        "(every pair weighs the same); `token` = the NLL summed over all the step's chosen tokens / their count "
        "(longer answers weigh more), TRL's rpo_alpha when TRL's batch is the whole step."))
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


def dpo_errors(cfg: Any) -> list[tuple[str, str]]:
    """Rules between the dpo section and the rest of the config (stage dpo)."""
    out: list[tuple[str, str]] = []
    d, lt = cfg.dpo, cfg.dpo.loss_type
    needs_ref = lt not in DPO_REFERENCE_FREE
    if not needs_ref and d.reference in ("adapters_off", "copy"):
        out.append(("tf.dpo_reference", f"dpo.reference={d.reference} with dpo.loss_type={lt}: {lt} is reference-free, "
                    "so a reference would only cost memory; set dpo.reference=auto (or none)."))
    if needs_ref and d.reference == "none":
        out.append(("tf.dpo_reference", f"dpo.reference=none with dpo.loss_type={lt}, which compares the policy with a "
                    "reference; set dpo.reference=auto, or a reference-free loss_type (simpo, orpo)."))
    if d.reference == "adapters_off" and cfg.peft.method == "none":
        out.append(("tf.dpo_reference", "dpo.reference=adapters_off needs adapters to switch off: set peft.method=lora "
                    "(or dora), or dpo.reference=copy (or auto) for full fine-tuning."))
    if d.precompute_reference and not needs_ref:
        out.append(("tf.dpo_reference", f"dpo.precompute_reference=true with the reference-free dpo.loss_type={lt}: "
                    "there is nothing to precompute; set dpo.precompute_reference=false."))
    if d.label_smoothing > 0 and lt not in ("sigmoid", "robust", "simpo"):
        out.append(("tf.dpo_smoothing", f"dpo.label_smoothing={d.label_smoothing} applies to loss_type sigmoid, "
                    "robust and simpo, "
                    f"not {lt}; set dpo.label_smoothing=0."))
    if d.ipo_normalize and lt != "ipo":
        out.append(("tf.dpo_ipo_normalize", f"dpo.ipo_normalize=true applies to dpo.loss_type=ipo, not {lt}; "
                    "set dpo.ipo_normalize=false (simpo and orpo are length-normalised already)."))
    if d.sft_weight > 0 and lt in ("orpo", "kto"):
        out.append(("tf.dpo_sft_weight", f"dpo.sft_weight={d.sft_weight} with dpo.loss_type={lt}: "
                    + ("ORPO's loss already holds the chosen answer's NLL" if lt == "orpo" else
                       "KTO's rows are unpaired (no chosen answer)") + "; set dpo.sft_weight=0."))
    if lt == "kto" and cfg.train.global_batch_size < 2:
        out.append(("tf.dpo_kto_batch", "dpo.loss_type=kto estimates its KL reference point from mismatched rows of "
                    f"the step, which needs train.global_batch_size >= 2 (got {cfg.train.global_batch_size})."))
    return out
