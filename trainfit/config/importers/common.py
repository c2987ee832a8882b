"""What every importer shares: the record of what was mapped, computed and dropped (`Imported`), the
mapping through the one table of peer keys (config/peer_keys.py), and trainfit's batch arithmetic.

trainfit's batch is defined once (config/schema.py BatchPlan): train.global_batch_size samples (GRPO:
completions) per optimizer step on all GPUs, train.micro_batch_size per forward on one GPU, accumulation
derived = global / (micro x GPUs), and a GRPO group whole on one GPU. Each importer works out the peer's
global batch in those words and `settle_batch` makes it one trainfit accepts, saying each step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from trainfit.config.base import ConfigError, round_up
from trainfit.config.peer_keys import PEER_KEYS, PeerKey
from trainfit.config.schema import Config, validate
from trainfit.config.stages import stage_spec
from trainfit.config.train import TrainConfig
from trainfit.config.words import count
from trainfit.config.importers.values import NotCarried, converter

# `--from` names and the peer names of the table.
PEERS = {"trl": "TRL", "verl": "verl", "openrlhf": "OpenRLHF", "llamafactory": "LLaMA-Factory"}
# grpo's fields PPO reads too (config/rl.py PPOConfig): the clip ranges, loss aggregation and KL estimator.
PPO_READS_GRPO = ("grpo.epsilon", "grpo.epsilon_high", "grpo.loss_type", "grpo.kl_estimator")
# data's fields that say what SFT, DPO and RM rows are; RL stages read prompts from task.* instead.
DATA_ROWS = ("data.path", "data.columns", "data.template", "data.subset", "data.split", "data.packing")


@dataclass
class Mapped:
    peer_key: str
    peer_value: Any
    key: str
    value: Any
    note: str = ""


@dataclass
class Computed:
    key: str
    value: Any
    formula: str


@dataclass
class Dropped:
    peer_key: str
    peer_value: Any
    why: str


@dataclass
class Imported:
    """A peer config carried over: the trainfit values, and key by key how each came to be."""

    tool: str                       # trl | verl | openrlhf | llamafactory
    stage: str
    stage_from: str                 # what decided the stage, in the peer's words
    source: str = ""
    source_link: str = ""           # a `# source: URL` line of the peer file (the fixtures keep theirs so)
    values: dict[str, Any] = field(default_factory=dict)
    mapped: list[Mapped] = field(default_factory=list)
    computed: list[Computed] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    defaults: dict[str, Any] = field(default_factory=dict)   # peer keys the config leaves out, read at the peer's default

    @property
    def peer(self) -> str:
        return PEERS[self.tool]

    def set(self, key: str, value: Any) -> None:
        old = self.values.get(key)
        self.values[key] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value

    def compute(self, key: str, value: Any, formula: str) -> None:
        self.set(key, value)
        self.computed.append(Computed(key, value, formula))

    def drop(self, peer_key: str, value: Any, why: str) -> None:
        self.dropped.append(Dropped(peer_key, value, why))

    def config(self) -> dict:
        """The nested trainfit config (stage first), as written."""
        out: dict = {"stage": self.stage}
        for dotted, value in sorted(self.values.items(), key=lambda kv: (kv[0].count("."), kv[0])):
            node = out
            *parents, last = dotted.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        return out

    def as_json(self) -> dict:
        return {"tool": self.tool, "source": self.source, "stage": self.stage, "stage_from": self.stage_from,
                "mapped": [asdict(m) for m in self.mapped], "computed": [asdict(c) for c in self.computed],
                "dropped": [asdict(d) for d in self.dropped], "peer_defaults": self.defaults, "config": self.config()}


def reader(im: Imported, args: dict[str, Any], defaults: dict[str, Any]):
    """get(key): the peer's value, else the peer's default (recorded in im.defaults, so it is said)."""
    def get(key: str) -> Any:
        if key in args:
            return args[key]
        if key in defaults:
            im.defaults[key] = defaults[key]
        return defaults.get(key)
    return get


def rows_for(peer: str, key: str, stage: str) -> list[PeerKey]:
    """The table's rows for a peer key that apply to `stage`, the stage's own section first."""
    return sorted((r for r in PEER_KEYS if r.peer == peer and r.key == key and _applies(r.trainfit, stage)),
                  key=lambda r: r.trainfit.split(".")[0] != stage)


def _applies(key: str, stage: str) -> bool:
    spec = stage_spec(stage)
    section, rl = key.split(".")[0], spec.rollout
    if key in ("data.packing", "train.padding_free"):
        return spec.packs if key == "data.packing" else spec.padding_free
    if section == "grpo":
        return stage == "grpo" or (stage == "ppo" and key in PPO_READS_GRPO)
    if section in ("ppo", "dpo"):
        return section == stage
    if section == "rl_models":
        return stage == "ppo"      # the reward model and the critic are PPO's (config/stages.py)
    if section in ("task", "rollout"):
        return rl
    return not (rl and key in DATA_ROWS)


def map_keys(im: Imported, args: dict[str, Any], handled: set[str], drops: dict[str, str]) -> None:
    """Carry every peer key the importer did not handle itself through the table; what has no row, or whose
    value does not carry, is dropped with why (the importer's `drops`, the row's own words, or none)."""
    for k, v in args.items():
        if k in handled:
            continue
        rows = rows_for(im.peer, k, im.stage)
        if not rows:
            other = [r.trainfit for r in PEER_KEYS if r.peer == im.peer and r.key == k]
            im.drop(k, v, dropped_why(k, drops) or (f"means {other[0]} in trainfit, which stage {im.stage} does not "
                                                    "read" if other else "no trainfit key means it"))
            continue
        row = rows[0]
        if isinstance(v, str) and "$" in v:
            im.drop(k, v, "the shell sets it when the script runs; write the value itself")
            continue
        if row.carried == "-":
            im.drop(k, v, row.convert or row.note or "computed from other keys, which this config does not give")
            continue
        try:
            out = converter(row.carried)(v)
        except NotCarried as e:
            im.drop(k, v, str(e))
            continue
        for key, value in (out.items() if isinstance(out, dict) else [("", out)]):
            im.set(key or row.trainfit, value)
            im.mapped.append(Mapped(k, v, key or row.trainfit, value, "; ".join(filter(None, (row.convert, row.note)))))


def dropped_why(key: str, drops: dict[str, str]) -> str:
    """An importer's reason for a key it drops: by the whole key, or by a prefix written with a trailing dot."""
    if key in drops:
        return drops[key]
    best = max((p for p in drops if p.endswith(".") and key.startswith(p)), key=len, default=None)
    return drops[best] if best else ""


def settle_batch(im: Imported, *, global_: int, micro: int, world: int, group: int, global_formula: str,
                 micro_formula: str) -> None:
    """Set train.global_batch_size and train.micro_batch_size from the peer's numbers, as trainfit accepts them:
    the global batch a multiple of GPUs x group (whole GRPO groups on every GPU), the micro-batch a divisor of
    the per-GPU batch; each change said with its arithmetic."""
    unit = world * group
    gb = round_up(max(global_, 1), unit)
    why = "" if gb == global_ else (f"; rounded up from {global_} to a multiple of {unit} ({count(world, 'GPU')} x "
                                    f"{group} generations: whole groups on every GPU)" if group > 1 else
                                    f"; rounded up from {global_} to a multiple of the GPUs ({world})")
    per_dev = gb // world
    mb = max(d for d in range(1, min(max(micro, 1), per_dev) + 1) if per_dev % d == 0)
    lowered = "" if mb == micro else f"; lowered from {micro}: it must divide the per-GPU batch {per_dev}"
    im.compute("train.global_batch_size", gb, global_formula + why)
    im.compute("train.micro_batch_size", mb, f"{micro_formula}{lowered}; accumulation derived: {gb} / ({mb} x "
                                              f"{count(world, 'GPU')}) = {per_dev // mb}")
    if world > 1:
        im.set("distributed.num_gpus", im.values.get("distributed.num_gpus", world))


def trainer_batch(im: Imported, get, world: int, world_from: str, group: int = 1) -> None:
    """transformers' Trainer (TRL, LLaMA-Factory): per_device_train_batch_size x gradient_accumulation_steps x
    processes per optimizer step; TRL's GRPO counts completions in it, so the prompts are that / num_generations."""
    pdb, ga = get("per_device_train_batch_size"), get("gradient_accumulation_steps")
    unit = "completions" if group > 1 else "samples"
    settle_batch(im, global_=pdb * ga * world, micro=pdb, world=world, group=group,
                 global_formula=f"per_device_train_batch_size {pdb} x gradient_accumulation_steps {ga} x "
                 f"{count(world, 'process', 'processes')} ({world_from}) = {pdb * ga * world} {unit} per optimizer step"
                 + (f" = {pdb * ga * world // group} prompts x num_generations {group}" if group > 1 else ""),
                 micro_formula=f"per_device_train_batch_size {pdb}")


def steps_from_samples(im: Imported, *, epochs: float, samples: Optional[int], per_step: int, what: str,
                       peer_keys: str) -> bool:
    """train.max_steps = ceil(epochs x samples / samples per step) when the peer caps the samples (max_samples);
    False when it does not (the dataset's rows are unknown here)."""
    if not samples:
        return False
    steps = max(1, math.ceil(epochs * samples / per_step))
    im.compute("train.max_steps", steps, f"ceil({peer_keys} = {_num(epochs)} x {samples} / {per_step} {what}) = {steps} "
                                         "(when the dataset holds at least max_samples rows)")
    return True


def warmup_from_ratio(im: Imported, ratio: float, peer_key: str) -> None:
    steps = im.values.get("train.max_steps", TrainConfig.model_fields["max_steps"].default)
    im.compute("train.warmup_steps", round(ratio * steps), f"{peer_key} {_num(ratio)} x train.max_steps {steps}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def finish(im: Imported) -> Config:
    """The imported config validated, or the one paragraph that says why it cannot be (exit 2)."""
    try:
        return validate(im.config())
    except ConfigError as e:
        raise ConfigError(f"The {im.peer} config {im.source or ''} imported into trainfit is not valid: {e} The "
                          "mapping above says where each value came from; fix it in the written file, or in the "
                          "peer's config and import again.".replace("  ", " ")) from None
