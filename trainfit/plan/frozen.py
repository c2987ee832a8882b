"""RL's frozen models (a reference copy of the policy, the reward model) per rank, as train/frozen.py spreads them.

Whole on every rank under one process, DDP and ZeRO-1/2; sharded like the trained module when it is sharded
over several ranks (`Config.frozen_sharding`, the trainer's rule): the trained rows' shard arithmetic
(states.model_states at the run's Parallel: 1/N of the weights, in CPU RAM with `Config.frozen_offload`)
and, in their forwards, the layers gathered whole as the policy's are in training.
"""

from __future__ import annotations

import dataclasses

from trainfit.config import Config
from trainfit.plan.items import Item
from trainfit.plan.states import Parallel, States, model_states


def frozen_states(cfg: Config, par: Parallel, facts, **kw) -> States:
    """A frozen model's states on one rank (`kw`: model_states' dtype, head_params, drop_lm_head); its shard
    in CPU RAM with `Config.frozen_offload`."""
    spread = dataclasses.replace(par, offload_params=cfg.frozen_offload()) if cfg.frozen_sharding() else Parallel()
    return model_states(facts, trainable="none", par=spread, **kw)


def gathered_items(par: Parallel, st: States, group: str) -> list[Item]:
    """A sharded frozen model's forward: its layers all-gathered whole, as the policy's in training."""
    return [Item(f"{par.sharding} gathered layers ({group})", group, train=st.gathered,
                 note="the layer computed + the prefetched one")] if st.gathered else []


def frozen_notes(cfg: Config, par: Parallel, spread: list[str], whole: list[str]) -> list[str]:
    """Where the frozen models live, per engine: `spread` are those train/frozen.py shards with the policy
    (the reference copy, the reward model), `whole` those always loaded whole (DPO's reference, a
    simulated user). Nothing to say on one rank."""
    if par.world < 2:
        return []
    out = []
    if spread and cfg.frozen_sharding():
        where = " (in CPU RAM, a layer at a time copied over)" if cfg.frozen_offload() else ""
        out.append(f"Frozen models are sharded like the policy ({', '.join(spread)}): {par.sharding} over "
                   f"{par.world} ranks, 1/{par.world} of their weights per rank{where}, a layer at a time "
                   "gathered in their forwards.")
    elif spread:
        engine = {"ddp": "DDP", "deepspeed": f"DeepSpeed ZeRO-{par.zero_stage}"}.get(par.engine, par.engine)
        whole = spread + whole
        out.append(f"Frozen models are whole on every rank ({', '.join(whole)}), as {engine} keeps the trained "
                   "weights; FSDP or ZeRO-3 would shard the reference copy and the reward model.")
        return out
    if whole and par.zero_stage == 3:
        out.append(f"Frozen models are whole on every rank ({', '.join(whole)}): the stage loads them outside "
                   f"{par.sharding}, which partitions only the models it trains and the reference copy and reward "
                   "model of PPO / GRPO.")
    return out
