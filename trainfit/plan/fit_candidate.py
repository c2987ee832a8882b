"""A candidate of `trainfit fit` (a config, its plan and its step-time estimate) and how it is timed and told."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from trainfit.config import Config
from trainfit.plan import hardware, steptime
from trainfit.plan.memory import Plan
from trainfit.plan.states import DTYPE_BYTES

GiB = 2 ** 30
TIE = 0.01          # a change must buy more than 1% of estimated step time to beat fewer changes
PCIE_BPS = 25e9     # host<->GPU bytes/s, as hardware.roofline_step assumes for optimizer offload


@dataclass
class Candidate:
    cfg: Config
    plan: Plan
    step: hardware.StepTime
    tier: int
    overrides: dict[str, Any]     # dotted key -> value, against the user's config

    @property
    def fits(self) -> bool:
        return bool(self.plan.fits)

    @property
    def over(self) -> int:
        return self.plan.peak - (self.plan.budget or 0)


def override_list(ovs: dict[str, Any]) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in ovs.items()]


def knob_count(ovs: dict[str, Any]) -> int:
    """Changed knobs, counting a parallel setting (strategy, stage, offloads) or a method as one."""
    group = lambda k: "parallel" if k.startswith("distributed.") else (  # noqa: E731
        "method" if k in ("peft.method", "model.quantization") else k)
    return len({group(k) for k in ovs})


def estimate(p: Plan, cfg: Config, card: hardware.GPU, dense: Optional[Plan] = None) -> hardware.StepTime:
    """The step-time estimate of a plan (steptime.estimate: the roofline with measured efficiency
    constants, labelled with its basis), plus what its work summary leaves out: a step reads the full
    weights however they are partitioned or offloaded (bytes from `dense`, the config planned without
    ZeRO/offload); vLLM with too small a KV cache generates in waves, each re-reading the weights per
    token; HF generate under ZeRO-3/FSDP gathers the weights over the GPU link for every token, and
    with parameter offload over PCIe, which forward and backward then cross too."""
    work = dict(p.work)
    if dense is not None:
        work.update({k: dense.work[k] for k in ("train_bytes", "decode_bytes_per_step") if k in dense.work})
    waves = vllm_waves(p)
    if waves > 1 and work.get("decode_steps"):
        work["decode_steps"] = work["decode_steps"] * waves
    st = steptime.estimate(work, card, p.world)
    d, n, eng = cfg.distributed, max(1, p.world), cfg.engine()
    sharded = eng == "fsdp" or (eng == "deepspeed" and d.zero_stage == 3)
    weights = p.params * DTYPE_BYTES[cfg.model.dtype]
    hf_tokens = work.get("decode_steps", 0) if cfg.rollout.engine == "hf" else 0
    if sharded and n > 1:
        st.rollout += hf_tokens * weights * (n - 1) / n / (card.link_gbs * 1e9)
    if sharded and d.offload_params:
        st.rollout += hf_tokens * weights / n / PCIE_BPS
        if eng == "deepspeed":   # FSDP's copies are in its work summary (steptime.fsdp_offload_work)
            st.comm += 2 * p.accumulation * weights / n / PCIE_BPS
    return st


# rollout.py states the engine's KV capacity only in its note; parsed here rather than re-deriving
# its formula (one source of truth). tests/test_fit.py checks the pattern still matches.
_VLLM_NOTE = re.compile(r"\(([\d,]+) tokens; this step needs ([\d,]+)")


def vllm_waves(p: Plan) -> int:
    for note in p.notes:
        m = _VLLM_NOTE.search(note)
        if m:
            cap, need = (int(x.replace(",", "")) for x in m.groups())
            return max(1, math.ceil(need / max(cap, 1)))
    return 1
