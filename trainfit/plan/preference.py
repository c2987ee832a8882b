"""Planner pieces of the policy preference stage (stage dpo): its reference, precomputed log-probs, work.

memory._build sizes the policy as for every stage with both sides of every pair in a micro-batch
(stage_specs.pairs_per_forward; an unpaired KTO row puts one sequence, `sequences_per_sample`) and the
LM head at the answer positions only (train/dpo.py calls train/logprobs.sequence_logprobs); this module
adds what depends on dpo.reference and dpo.precompute_reference, mirroring DPOStage without importing the trainer.
"""

from __future__ import annotations

import os

from trainfit.data import sources
from trainfit.config import ConfigError, DataConfig, TrainConfig
from trainfit.plan.states import Parallel, model_states
from trainfit.tasks.pairs import is_unpaired
from trainfit.config.stages import dpo_reference, stage_spec


_UNPAIRED: dict = {}   # (source keys, file mtime) -> bool: `fit` plans many configs of one data set


def unpaired_rows(cfg) -> bool:
    """Whether stage dpo trains on KTO's unpaired rows (data.path's first row has completion and label;
    DPOStage decides the same way, preference.encode_policy_rows). Hub data from the local cache only;
    unreadable data: no (the planner then plans pairs, and `train` names the problem)."""
    d = cfg.data
    if not stage_spec(cfg.stage).unpaired_rows or cfg.dpo.loss_type != "kto" or d.path is None:
        return False
    mtime = os.path.getmtime(d.path) if os.path.isfile(d.path) else None
    key = (d.path, d.subset, d.split, d.revision, repr(d.columns), mtime)
    if key not in _UNPAIRED:
        try:
            with sources.local_only():
                rows = sources.read_rows(d, "pairs")
            _UNPAIRED[key] = bool(rows is not None and len(rows) and is_unpaired(rows[0]))
        except (ConfigError, OSError):
            return False
    return _UNPAIRED[key]


def sequences_per_sample(cfg) -> int:
    """Sequences one sample puts through the training forward: 2 for a pair, 1 for an unpaired row."""
    return 1 if unpaired_rows(cfg) else stage_spec(cfg.stage).pairs_per_forward


def train_pairs(t: TrainConfig, data: DataConfig, rows: int) -> int:
    """Pairs the stage trains on: made from the task (train.max_steps x global_batch_size of them) or the
    data's measured rows (`rows`; about the training split)."""
    return t.max_steps * t.global_batch_size if data.path is None else rows


def reference_items(cfg, facts, Item, items: list, substeps: dict, notes: list, score_fwd: int, mb: int,
                    rows: int) -> bool:
    """Add the reference's weights, its no-grad forward or the stored log-probs; returns whether a
    frozen copy of the policy is held while training (for the parameter counts)."""
    d, m = cfg.dpo, cfg.model
    mode = dpo_reference(d.loss_type, d.reference, cfg.peft.method)
    if mode == "none":
        notes.append(f"dpo.loss_type={d.loss_type} is reference-free: no reference model, no reference forward.")
        return False
    if d.precompute_reference:
        n = train_pairs(cfg.train, cfg.data, rows)
        items.append(Item("precomputed reference log-probs (fp32, 2 a pair)", "reference", cpu=8 * n,
                          note=f"about {n:,} training pairs + the held-out ones, also stored in the stage dir"))
        notes.append("dpo.precompute_reference: one no-grad pass over every pair before the first step "
                     + ("(with the frozen copy, freed before training)" if mode == "copy" else "(adapters off)")
                     + "; training holds only the policy.")
        if d.loss_type == "kto":   # z0 still needs the policy's log-probs of the step's mismatched rows
            substeps["kto z0 forward"] = [Item(f"policy forward for KTO's z0 (no grad, up to {mb} sequences)",
                                               "policy", train=score_fwd)]
        return False
    substeps["reference forward"] = [Item(f"reference forward (no grad, {mb} sequences)", "reference",
                                          train=score_fwd)]
    if mode == "adapters_off":
        notes.append("Reference policy = the base with adapters disabled: no extra weights.")
        return False
    # Copied before any parallel wrapper (train/dpo.py): whole on every rank, never sharded.
    ref = model_states(facts, dtype=m.dtype, trainable="none", par=Parallel())
    items.append(Item(f"reference policy (frozen copy, {m.dtype})", "reference", train=ref.weights, cpu=ref.cpu))
    return True


def pair_work(cfg, work: dict, facts, bp, seq: int) -> dict:
    """work_summary counted one sequence a sample: a pair is two (an unpaired KTO row one), and a live
    reference adds their no-grad forward (2 x active params x tokens)."""
    d, k = cfg.dpo, sequences_per_sample(cfg)
    tokens = k * bp.per_device_batch * seq                                # every sequence of the step
    live_ref = dpo_reference(d.loss_type, d.reference, cfg.peft.method) != "none" and not d.precompute_reference
    extra = (k - 1) * work["train_flops"] + (2 * facts.n_active_params * tokens if live_ref else 0)
    return {**work, "train_flops": work["train_flops"] + extra}
