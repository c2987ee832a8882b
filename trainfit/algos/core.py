"""Shared pieces of the algorithm math: masked reductions and the compute dtype."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

IGNORE_INDEX = -100  # label value that sft_loss skips (the Hugging Face convention)

Number = Union[int, float, Tensor]


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of `x` where `mask` is true, over `dim` (all elements when None)."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of `x` over the masked elements; 0 (not NaN) where no element is kept."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1).to(x.dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16 / fp16 are upcast to fp32; fp64 stays fp64 (tests use it for precision).
    return torch.promote_types(dtype, torch.float32)
