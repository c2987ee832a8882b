"""GPU catalog, GPU detection through NVML, and a roofline estimate of step time.

Catalog numbers are the vendors' data-sheet figures: memory as NVML reports the card's total
(slightly under the marketed GB), dense BF16 tensor throughput without sparsity (GeForce cards at
their FP32-accumulate rate, which is what BF16 training uses), memory bandwidth, and the per-GPU
bandwidth between GPUs of one node (NVLink where the SXM/HGX boards have it, else PCIe x16 of the card's
generation, one direction). `trainfit hardware` ranks the `ranked` cards, the ones a plan is usually
bought or rented for; the others are here so that --gpu and detection know them by name.

The roofline here takes every phase at max(FLOPs / peak FLOP/s, bytes moved / memory bandwidth), plus
gradient all-reduce over the GPU link. Real runs are slower (kernel efficiency, Python and kernel
launches, 2-3x in training and 100x+ in HF decoding), so what is ranked and printed is
steptime.estimate: this roofline corrected by constants measured on real GPUs, labelled with its basis.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Optional

from trainfit.config import ConfigError, HardwareConfig
from trainfit.core.nvml import gpu_facts

MiB = 1024 ** 2


class UnknownGPU(ConfigError, ValueError):
    """A GPU name the catalog does not hold: a user's mistake (ConfigError: exit 2 with the paragraph) and a
    bad value for the callers that only probe a name (ValueError: `from_device_name`, doctor)."""


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory: int          # bytes, as NVML reports the total
    bf16_tflops: float   # dense
    bandwidth_gbs: float  # HBM/GDDR GB/s
    link_gbs: float      # GPU-to-GPU GB/s per GPU within a node
    aliases: tuple = ()
    detected: bool = False
    free: Optional[int] = None
    ranked: bool = True  # among the setups `trainfit hardware` compares

    @property
    def memory_gb(self) -> float:
        return self.memory / 2**30


CATALOG: dict[str, GPU] = {g.key: g for g in [
    GPU("rtx3090", "RTX 3090 24GB", 24576 * MiB, 71.0, 936.0, 32.0, ("3090", "geforce rtx 3090")),
    GPU("rtx4090", "RTX 4090 24GB", 24564 * MiB, 165.2, 1008.0, 32.0, ("4090", "geforce rtx 4090")),
    GPU("l40s", "L40S 48GB", 46068 * MiB, 362.0, 864.0, 32.0, ("l40s-48gb",)),
    GPU("a100-40gb", "A100 40GB", 40960 * MiB, 312.0, 1555.0, 600.0, ("a100-sxm4-40gb", "a100 40gb")),
    GPU("a100-80gb", "A100 80GB", 81920 * MiB, 312.0, 2039.0, 600.0, ("a100", "a100-sxm4-80gb", "a100 80gb")),
    GPU("a800-80gb", "A800 80GB", 81920 * MiB, 312.0, 2039.0, 400.0, ("a800", "a800-sxm4-80gb")),
    GPU("h100-80gb", "H100 80GB", 81559 * MiB, 989.0, 3350.0, 900.0, ("h100", "h100-sxm", "h100 80gb hbm3")),
    GPU("h200", "H200 141GB", 143771 * MiB, 989.0, 4800.0, 900.0, ("h200-141gb", "h200 nvl", "h200-sxm")),
    GPU("b200", "B200 180GB", 183359 * MiB, 2250.0, 8000.0, 1800.0, ("b200-180gb",)),
    # Named, detected and planned, not ranked by `trainfit hardware` (that would add 4 plans a card).
    GPU("l4", "L4 24GB", 23034 * MiB, 121.0, 300.0, 32.0, ("l4-24gb",), ranked=False),
    GPU("l40", "L40 48GB", 46068 * MiB, 181.0, 864.0, 32.0, ("l40-48gb",), ranked=False),
    GPU("rtx-a6000", "RTX A6000 48GB", 49140 * MiB, 154.8, 768.0, 32.0, ("a6000", "rtx a6000 48gb"), ranked=False),
    GPU("h100-pcie", "H100 PCIe 80GB", 81559 * MiB, 756.0, 2000.0, 64.0, ("h100 pcie 80gb",), ranked=False),
    GPU("h800-80gb", "H800 80GB", 81559 * MiB, 989.0, 3350.0, 400.0, ("h800", "h800 80gb hbm3"), ranked=False),
]}
RANKED = tuple(g for g in CATALOG.values() if g.ranked)
SETUP_COUNTS = (1, 2, 4, 8)


def _norm(s: str) -> str:
    s = s.lower().replace("nvidia", "").replace("geforce", "").replace("tesla", "")
    return re.sub(r"[\s_\-]+", "", s)


def _names() -> dict[str, str]:
    """Every accepted spelling, normalised, to its catalog key: the key, the card's name and its aliases."""
    return {_norm(n): g.key for g in CATALOG.values() for n in (g.key, g.name, *g.aliases)}


def find_gpu(name: str, source: str = "--gpu") -> GPU:
    """A catalog GPU by its key, name or a listed alias, in any case and punctuation (`h200`, `H100-80GB`,
    `rtx-4090`, `NVIDIA A100-SXM4-40GB`), or a generic card from a memory size (`48GB`). Anything else
    raises UnknownGPU naming `source` (where the name came from) and the nearest catalog names: a name
    that only looks like a card (`a100-40`, `h1000`) is never taken for one."""
    key = _norm(name)
    names = _names()
    if key in names:
        return CATALOG[names[key]]
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(gb|gib)", key)
    if m:
        size = float(m.group(1)) * (1e9 if m.group(2) == "gb" else 1024 ** 3)
        return GPU(f"{m.group(1)}gb", f"generic {m.group(1)} GB", int(size), 312.0, 2000.0, 32.0)
    raise UnknownGPU(unknown_gpu(name, source))


def unknown_gpu(name: str, source: str = "--gpu") -> str:
    """The paragraph for a GPU name the catalog does not hold: the nearest names first, then the rest."""
    names = _names()
    near = list(dict.fromkeys(names[n] for n in difflib.get_close_matches(_norm(name), list(names), n=8, cutoff=0.5)))[:3]
    others = [k for k in CATALOG if k not in near]

    def card(k: str) -> str:
        return f"{k} ({CATALOG[k].name})"
    said = (f"nearest: {', '.join(card(k) for k in near)}; the others are {', '.join(others)}" if near
            else f"the catalog holds {', '.join(card(k) for k in CATALOG)}")
    size = f"{source} 48GB" if source.startswith("--") else f"{source}=48GB"
    return (f"{source} {name!r} is an unknown GPU: trainfit takes a catalog name or one of its listed aliases, in any "
            f"case and punctuation, never part of a name; {said}. Pass one of those, or for a card the catalog "
            f"lacks its memory, e.g. {size}.")


def from_device_name(name: str) -> Optional[GPU]:
    """The catalog card behind a driver's device name (NVML, torch.cuda.get_device_name): the exact names and
    aliases first, then the model number as a whole word ("NVIDIA H100 PCIe" is an H100, an "A100 80GB PCIe" an
    A100 80GB); None for a card the catalog lacks. Only for names a driver reports, never for --gpu."""
    try:
        return find_gpu(name)
    except ValueError:
        pass
    low = name.lower()
    for token, k in (("h200", "h200"), ("h100", "h100-pcie" if "pcie" in low else "h100-80gb"), ("h800", "h800-80gb"),
                     ("a800", "a800-80gb"), ("b200", "b200"), ("a100", "a100-40gb" if "40gb" in low else "a100-80gb"),
                     ("l40s", "l40s"), ("l40", "l40"), ("l4", "l4"), ("a6000", "rtx-a6000"),
                     ("4090", "rtx4090"), ("3090", "rtx3090")):
        if re.search(rf"\b{token}\b", low):
            return CATALOG[k]
    return None


def replan_as(card: GPU) -> "GPU | str":
    """How fit and the advice name a card to the planner again: a detected one as itself (its driver's name
    need not be one `find_gpu` takes, and its memory is the measured one), any other by its key."""
    return card if card.detected else card.key


def detect() -> list[GPU]:
    """GPUs visible through NVML: catalog numbers with the card's real total and free memory.
    Empty when there is no driver or no GPU."""
    out = []
    for g in gpu_facts()["gpus"]:
        base = from_device_name(g["name"])
        if base is None:  # a card the catalog lacks: its memory is real, speeds an A100-like guess
            base = GPU(_norm(g["name"]), g["name"], g["total_bytes"], 312.0, 2000.0, 32.0)
        out.append(GPU(base.key, g["name"], g["total_bytes"], base.bf16_tflops, base.bandwidth_gbs, base.link_gbs,
                       base.aliases, detected=True, free=g["free_bytes"]))
    return out


def resolve_gpu(name: "Optional[str | GPU]", hw: Optional[HardwareConfig] = None) -> tuple[Optional[GPU], str]:
    """The GPU to plan for and how it was chosen: --gpu, else hardware.gpu (`hw`), else NVML, else none. A GPU
    already resolved (`replan_as`) is taken as it is."""
    if isinstance(name, GPU):
        return name, "detected (NVML)" if name.detected else "--gpu"
    if name:
        return find_gpu(name), "--gpu"
    if hw is not None and hw.gpu:
        return find_gpu(hw.gpu, "hardware.gpu"), "hardware.gpu"
    found = detect()
    if found:
        return found[0], "detected (NVML)"
    return None, "none"


@dataclass
class StepTime:
    """Estimate of one optimizer step, in seconds, by phase, and what it rests on (`basis`: the plain
    roofline, or the efficiency constants of steptime.py and where they were measured)."""

    rollout: float
    train: float
    comm: float
    basis: str = "roofline, uncalibrated"
    # The rollout runs on GPUs of its own while the step trains (rollout.mode=async with
    # distributed.rollout_gpus and max_staleness >= 1): a step takes the longer of the two, not their sum.
    overlapped: bool = False

    @property
    def total(self) -> float:
        if self.overlapped:
            return max(self.rollout, self.train + self.comm)
        return self.rollout + self.train + self.comm


def roofline_step(work: dict, gpu: GPU, n_gpus: int) -> StepTime:
    """Seconds per step from a work summary (see memory.work_summary): FLOPs and bytes per GPU.

    rollout: prefill FLOPs, then decode steps each bounded by reading the weights and the KV cache
    (memory-bound) or by their FLOPs; train: forward/backward (and reference/old-log-prob) FLOPs;
    comm: ring all-reduce of the gradients, 2 (n-1)/n of their bytes over the GPU link per step.
    """
    flops = gpu.bf16_tflops * 1e12
    bw = gpu.bandwidth_gbs * 1e9
    rollout = work.get("prefill_flops", 0.0) / flops
    steps = work.get("decode_steps", 0)
    if steps:
        per_step = max(work["decode_flops_per_step"] / flops, work["decode_bytes_per_step"] / bw) + \
            work.get("decode_sync_s", 0.0)
        rollout += steps * per_step
    train = max(work.get("train_flops", 0.0) / flops, work.get("train_bytes", 0.0) / bw)
    comm = 0.0
    if n_gpus > 1:
        comm = 2 * (n_gpus - 1) / n_gpus * work.get("grad_bytes", 0) / (gpu.link_gbs * 1e9)
        comm *= work.get("comm_factor", 1.0)
    comm += work.get("offload_bytes", 0) / (25e9)  # PCIe to host for offloaded states, ~25 GB/s
    comm += work.get("push_bytes", 0) / (gpu.link_gbs * 1e9)  # async weight push to the rollout GPU
    return StepTime(rollout, train, comm, overlapped=bool(work.get("rollout_overlaps")))
