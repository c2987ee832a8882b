"""Each rank's resident bytes under FSDP2 (or ZeRO-3), per plan component, as `trainfit train` builds them.

    python -m torch.distributed.run --nproc_per_node=4 tests/fsdp_shard_bytes.py cfg.yaml OUT [key=value ...]

Every rank builds the stage (train/run.build_stage) and wraps it with its optimizer (train/loop._training),
as a run does, then takes one optimizer step on zero gradients so AdamW's moments exist, and writes
OUT/rank<r>.json: the bytes of its local shards (a DTensor's `to_local()`), its replicated buffers and
its optimizer state, by the names the planner gives its rows (tests/test_fsdp_adapters.py compares them).
Under DeepSpeed ZeRO-3 only the frozen models' partitions are reported (the stage builds them; no step).
With distributed.offload_params=true the gradients come from a real backward (FSDP2 reduce-scatters them and
moves their shards to CPU RAM), and each rank also says where its shards, gradients and moments live.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from trainfit.config import load_config
from trainfit.core import dist
from trainfit.train import fsdp
from trainfit.train.loop import _training
from trainfit.train.run import build_stage


def local_bytes(tensors) -> int:
    out = 0
    for t in tensors:
        # A ZeRO-3 parameter is empty outside a forward: its `ds_tensor` is this rank's partition.
        t = t.to_local() if isinstance(t, DTensor) else getattr(t, "ds_tensor", t)
        out += t.numel() * t.element_size()
    return out


def uneven_bytes(params, world: int) -> int:
    """Whole bytes of the tensors that do not split evenly over the ranks (FSDP2 shards dim 0 in chunks of
    ceil(d0 / world); ZeRO-3 pads each flattened tensor to a multiple of world), so their shards differ
    in size between ranks."""
    out = 0
    for p in params:
        numel = getattr(p, "ds_numel", None)
        if numel is not None:
            out += numel * p.element_size() if numel % world else 0
        elif p.shape and p.shape[0] % world:
            out += p.numel() * p.element_size()
    return out


def model_bytes(model, optimizer, world: int) -> dict[str, int]:
    """{frozen: frozen parameters + buffers, trainable: trainable parameters, optimizer: their AdamW
    moments}, and what may make a rank's share differ from 1/world of the whole: buffers (replicated)
    and unevenly split tensors, frozen and trainable."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    moments = [v for p in trainable for k, v in optimizer.state.get(p, {}).items() if k != "step"] if optimizer else []
    grads = [p.grad for p in trainable if p.grad is not None]
    held = [t.to_local() if isinstance(t, DTensor) else t for t in [*params, *grads, *moments]]
    return {"frozen": local_bytes(frozen) + local_bytes(model.buffers()), "trainable": local_bytes(trainable),
            "optimizer": local_bytes(moments), "grads": local_bytes(grads), "buffers": local_bytes(model.buffers()),
            "uneven_frozen": uneven_bytes(frozen, world), "uneven_trainable": uneven_bytes(trainable, world),
            "devices": sorted({t.device.type for t in held}), "pinned": any(t.is_pinned() for t in held)}


def main() -> None:
    cfg, out = load_config(sys.argv[1], sys.argv[3:]), Path(sys.argv[2])
    ranks = dist.init(cfg)
    loaded, stage, _ = build_stage(cfg, out / "stage", ranks)
    report, optimizer = {}, None
    if cfg.engine() == "fsdp":
        tr = _training(cfg, loaded, ranks)
        if cfg.distributed.offload_params:   # the gradients as FSDP2 leaves them: reduce-scattered, offloaded
            tr.model(input_ids=torch.arange(1, 9).view(1, 8)).logits.float().square().mean().backward()
        else:
            for p in tr.params:
                p.grad = torch.zeros_like(p)
        tr.optimizer.step()
        model, optimizer = tr.model, tr.optimizer
        parts = {"policy": model.policy, "value": model.critic} if hasattr(model, "critic") else {"policy": model}
        report = {name: model_bytes(m, optimizer, ranks.world) for name, m in parts.items()}
        report["offloaded"] = fsdp.offloaded(model)
    for name, frozen_model in (("reference", getattr(stage, "ref_model", None)),
                               ("reward", getattr(stage, "reward_model", None))):
        if frozen_model is not None:
            report[name] = model_bytes(frozen_model, optimizer, ranks.world)
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(report))
    dist.barrier(ranks)


if __name__ == "__main__":
    main()
