"""Reward-model training (stage rm) on preference pairs: Bradley-Terry loss, held-out accuracy and margin.

    trainfit train examples/ppo_pipeline_tiny.yaml          # SFT -> RM -> ... on CPU
    trainfit train rm.yaml data.path=prefs.jsonl           # one stage

A sample is one pair (trainfit/tasks/pairs.py): train.global_batch_size pairs per optimizer step, in a
seeded per-epoch order. Each micro-batch scores its chosen and rejected sides in one forward (2 x
micro rows); the loss is summed over pairs and divided by the step's pair count, so any micro-batch
split gives the same gradient. The final directory is a plain sequence classifier
(trainfit/models/reward.py) that `rl_models.reward_model` and transformers load.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainfit.algos import bradley_terry_loss
from trainfit.config import Config, ConfigError
from trainfit.data.text import collate
from trainfit.core.dist import SINGLE, Ranks
from trainfit.tasks.pairs import PairRows, encode_pairs
from trainfit.models.reward import rewards
from trainfit.tasks.base import EpochShuffle
from trainfit.train.stage import BaseStage, StepBatch
from trainfit.models.reward import load_reward_model, save_reward_model


class RMStage(BaseStage):
    @classmethod
    def build(cls, cfg: Config, stage_dir: Path, ranks: Ranks, device) -> tuple:
        """A sequence classifier on the policy's backbone, trained on preference pairs."""
        loaded = load_reward_model(cfg.model, cfg.peft, device, seed=cfg.train.seed)
        stage_dir.mkdir(parents=True, exist_ok=True)
        return loaded, cls(cfg, loaded.model, loaded.tokenizer, device, ranks=ranks).bound(loaded, stage_dir)

    @property
    def saves_from_module(self) -> bool:
        """Its adapters are merged in the module itself (final_save.save_final_model)."""
        return self.loaded.is_peft

    def save_final(self, path: Path, state_dict=None) -> Path:
        """A plain sequence-classifier directory, adapters merged."""
        # A sharded model's tensors are read whole here: the adapters are merged into the weights they change.
        whole = dict(state_dict.items()) if state_dict is not None else None
        return save_reward_model(self.loaded, path, state_dict=whole)

    def __init__(self, cfg: Config, model, tokenizer, device, ranks: Ranks = SINGLE):
        self.cfg, self.device, self.ranks = cfg, device, ranks
        self.pad_id = tokenizer.pad_token_id
        d, chat = cfg.data, cfg.task.chat
        rows = PairRows(cfg)  # data.path less its held-out split, or pairs made from task.name
        self.data_notes = rows.notes
        train, held = rows.train(), rows.held()
        self.pairs, self.stats = encode_pairs(train, tokenizer, d.max_seq_length, chat)
        self.eval_pairs = encode_pairs(held, tokenizer, d.max_seq_length, chat, key=rows.held_key)[0] if held else []
        if not self.pairs:
            raise ConfigError(f"data.path={d.path!r} holds no training pairs after the held-out split.")
        self.order = EpochShuffle(len(self.pairs), f"rm|{cfg.train.seed}")

    def prepare(self, step: int) -> StepBatch:
        """This rank's pairs of the step: stream items step*B + [rank*b, (rank+1)*b)."""
        bp = self.cfg.batch_plan()
        first = step * bp.global_batch + self.ranks.rank * bp.per_device_batch
        samples = [self.pairs[self.order(first + j)] for j in range(bp.per_device_batch)]
        return StepBatch(samples=samples, totals={"pairs": bp.global_batch})

    def _scores(self, model, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen [b], rejected [b]) rewards from one forward over the 2b sequences."""
        items = [{"input_ids": p["chosen"]} for p in pairs] + [{"input_ids": p["rejected"]} for p in pairs]
        b = collate(items, self.pad_id)                                               # [2b, T]
        r = rewards(model, b["input_ids"].to(self.device), b["attention_mask"].to(self.device))  # [2b]
        return r[: len(pairs)], r[len(pairs):]

    def loss(self, model, micro: list[dict], totals: dict) -> tuple[torch.Tensor, dict]:
        chosen, rejected = self._scores(model, micro)
        loss, m = bradley_terry_loss(chosen, rejected, total_pairs=totals["pairs"])
        seq_tokens = sum(len(p["chosen"]) + len(p["rejected"]) for p in micro)
        return loss, {**{k: float(v) for k, v in m.items()}, "seq_tokens": seq_tokens}

    def summarize(self, batch: StepBatch, sums: dict) -> dict:
        n = max(sums.get("pairs", 0.0), 1.0)
        return {"loss": sums["loss"], "accuracy": sums["correct"] / n, "margin": sums["margin"] / n,
                "pairs": sums.get("pairs", 0.0)}

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        """Held-out pairs: accuracy (chosen scored higher), mean margin and mean Bradley-Terry loss."""
        if not self.eval_pairs:
            return {}
        was = model.training
        model.eval()
        sums = {"loss": 0.0, "correct": 0.0, "margin": 0.0}
        mb = self.cfg.train.micro_batch_size
        for i in range(0, len(self.eval_pairs), mb):
            chosen, rejected = self._scores(model, self.eval_pairs[i:i + mb])
            loss, m = bradley_terry_loss(chosen, rejected, total_pairs=1)
            sums["loss"] += float(loss)
            sums["correct"] += float(m["correct"])
            sums["margin"] += float(m["margin"])
        model.train(was)
        n = len(self.eval_pairs)
        return {"accuracy": sums["correct"] / n, "eval_margin": sums["margin"] / n, "eval_loss": sums["loss"] / n}

    def state_dict(self) -> dict:
        return {}  # the data position is the step itself

    def load_state_dict(self, state: dict) -> None:
        pass
