"""What a plan is made of: components (bytes per phase and in CPU RAM) and the phases of a step."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2 ** 30   # plans print bytes in GiB, the unit card sizes are marketed in


def gib(x: int) -> str:
    """Bytes as every plan figure is printed (the table, doctor's findings): GiB, two decimals."""
    return f"{x / GIB:,.2f}"


@dataclass
class Item:
    """One component: bytes on each GPU in each phase, and in CPU RAM per GPU process."""

    name: str
    group: str          # policy | reference | reward | value | rollout | activations | overhead
    rollout: int = 0
    train: int = 0
    cpu: int = 0
    note: str = ""
    # Freed by the optimizer step (zero_grad(set_to_none=True)): absent from the no-grad scoring
    # forwards, which run before a step's first backward.
    between_steps: bool = False


@dataclass
class Phase:
    name: str
    allocated: int      # what torch.cuda.max_memory_allocated would report
    total: int          # allocated + fragmentation + CUDA context (+ the vLLM envelope, already whole)
    step: str           # the sub-step that peaks
