"""Offline preference optimisation (stage dpo): DPO, robust DPO, IPO, hinge, SimPO, ORPO and KTO on pairs.

    trainfit train examples/dpo_tiny.yaml                         # SFT then DPO on CPU
    trainfit train dpo.yaml data.path=prefs.jsonl dpo.beta=0.1    # one stage
    torchrun --nproc_per_node 2 -m trainfit.app.cli train dpo.yaml distributed.num_gpus=2

The data is stage rm's (trainfit/tasks/pairs.py): rows with a prompt, `chosen` and `rejected`, or pairs
made from task.name. A sample is one pair: train.global_batch_size pairs per optimizer step, and a
micro-batch holds whole pairs (OOM recovery shrinks it by pairs, never splitting one). Each pair's
prompt is tokenized once; its two sides go through one forward with the rest of the micro-batch
([chosen x b; rejected x b], LM head at the answer positions only). The loss (algos/preference.py) is
summed over pairs and divided by the step's pair count, so any micro-batch split gives the same gradient.

The reference (dpo.reference, resolved by stage_specs.dpo_reference) is the policy with its adapters
disabled, a frozen copy made before training, or none; its log-probs are computed for the step's pairs
in `prepare` (no grad), or, with dpo.precompute_reference, once for every pair before the first step
and stored as <stage_dir>/reference_logps.pt, which a resumed run reads back (for kto with those of
every step's mismatched rows, so z0 needs no reference model either). KTO unpairs each pair into a
desirable row (prompt, chosen) and an undesirable row (prompt, rejected), as TRL does; its reference
point z0 is the mean log-ratio of the mismatched rows built from both: the prompt of step position q
with the chosen and with the rejected answer of position q+1 of the whole step (2 rows a pair), clamped
at 0, computed in `prepare` over all ranks. With kto the data may instead be unpaired rows (prompt,
completion, label; preference.encode_unpaired): a sample is one row, one sequence a forward, and its
mismatched row takes the completion of the step's next position.
"""

from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path
from typing import Optional

import torch

from trainfit.algos import PairLogps, implicit_rewards, kto_loss, preference_loss
from trainfit.config import Config, ConfigError
from trainfit.core.dist import SINGLE, Ranks, all_reduce_sum
from trainfit.models.policy import reference_context
from trainfit.tasks.pairs import PairRows, encode_policy_rows
from trainfit.config.stages import dpo_reference
from trainfit.tasks.base import EpochShuffle
from trainfit.models import fused_head
from trainfit.train import memstats
from trainfit.train.evaluate import task_accuracy
from trainfit.models.logprobs import sequence_logprobs
from trainfit.train.stage import BaseStage, StepBatch, padding_free, policy_parts

REF_FILE = "reference_logps.pt"


def pair_sequences(pairs: list[dict], answer: Optional[list[str]] = None) -> list[dict]:
    """The 2b training sequences of b pairs, chosen sides first (or one a row for `answer`=["completion"],
    unpaired rows): {"input_ids", "loss_mask"} each."""
    out = []
    for side in answer or ("chosen", "rejected"):
        for p in pairs:
            out.append({"input_ids": p["prompt"] + p[side], "loss_mask": [0] * len(p["prompt"]) + p[side + "_mask"]})
    return out


class DPOStage(BaseStage):
    @classmethod
    def build(cls, cfg: Config, stage_dir: Path, ranks: Ranks, device) -> tuple:
        loaded, task, engine = policy_parts(cfg, stage_dir, ranks, device)
        return loaded, cls(cfg, loaded, device, task=task, engine=engine, stage_dir=stage_dir,
                           ranks=ranks).bound(loaded, stage_dir)

    def __init__(self, cfg: Config, loaded, device, task=None, engine=None, stage_dir: Optional[Path] = None,
                 ranks: Ranks = SINGLE):
        self.cfg, self.device, self.ranks, self.task, self.engine = cfg, device, ranks, task, engine
        self.model, self.tokenizer, self.is_peft = loaded.model, loaded.tokenizer, loaded.is_peft
        self.pad_id = self.tokenizer.pad_token_id
        d, chat, self.dpo = cfg.data, cfg.task.chat, cfg.dpo
        rows = PairRows(cfg)  # data.path less its held-out split, or pairs made from task.name
        self.data_notes = rows.notes
        held = rows.held()
        lt = cfg.dpo.loss_type
        self.pairs, self.stats, self.unpaired = encode_policy_rows(rows.train(), self.tokenizer, d.max_seq_length,
                                                                   chat, lt)
        self.eval_pairs = encode_policy_rows(held, self.tokenizer, d.max_seq_length, chat, lt,
                                             key=rows.held_key)[0] if held else []
        if held and self.unpaired != bool(self.eval_pairs and "desirable" in self.eval_pairs[0]):
            raise ConfigError("data.eval_path: the held-out rows are " + ("paired" if self.unpaired else "unpaired")
                              + " but the training rows are not; give both in one shape (pairs, or unpaired rows "
                              "with prompt, completion, label).")
        # The answers a sample puts through the forward: both sides of a pair, or an unpaired row's one.
        self.sides = ["completion"] if self.unpaired else ["chosen", "rejected"]
        if not self.pairs:
            raise ConfigError(f"data.path={d.path!r} holds no training pairs after the held-out split.")
        self.order = EpochShuffle(len(self.pairs), f"dpo|{cfg.train.seed}")
        self.head = fused_head.resolve(cfg, self.model, device)
        self.packed = padding_free(cfg, self.model)   # train.padding_free: each micro-batch's sides in one row
        self.kto = self.dpo.loss_type == "kto"
        self.ref_mode = dpo_reference(self.dpo.loss_type, self.dpo.reference, cfg.peft.method)
        # A frozen copy of the starting weights, made before any parallel wrapper sees the model.
        self.ref_model = (copy.deepcopy(self.model).eval().requires_grad_(False)
                          if self.ref_mode == "copy" else None)
        self.ref_store: Optional[dict] = None
        if self.dpo.precompute_reference and self.ref_mode != "none":
            self.ref_store = self._precomputed(Path(stage_dir) if stage_dir is not None else None)
            self.ref_model = None   # training holds only the policy

    def _logps(self, model, pairs: list[dict], sides=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(answer log-prob sums [kb], answer token counts [kb]) of the rows' k sides, side-major."""
        logp, mask, _ = sequence_logprobs(model, pair_sequences(pairs, sides or self.sides), self.pad_id, self.device,
                                          head=self.head, packed=self.packed)          # [2b, T-1] each
        return logp.sum(-1), mask.sum(-1)

    @torch.no_grad()
    def _reference(self, pairs: list[dict], sides=None) -> torch.Tensor:
        """Reference answer log-prob sums [2b] (chosen first), from one no-grad forward in eval mode."""
        ref = self.ref_model if self.ref_model is not None else self.model
        was = ref.training
        ref.eval()
        try:
            with reference_context(self.model, self.ref_mode == "adapters_off" and self.is_peft):
                return self._logps(ref, pairs, sides)[0].detach()
        finally:
            ref.train(was)

    def _reference_rows(self, pairs: list[dict]) -> torch.Tensor:
        """[n, k] reference sums of the rows' sides ((chosen, rejected), or an unpaired row's completion)."""
        mb, out, k = self.cfg.train.micro_batch_size, [], len(self.sides)
        for i in range(0, len(pairs), mb):
            r = self._reference(pairs[i:i + mb])
            out.append(torch.stack(r.chunk(k), dim=1).cpu())
        return torch.cat(out) if out else torch.zeros(0, k)

    def _fingerprint(self) -> str:
        t = self.cfg.train   # kto's mismatched rows follow the step order: the seed, steps and batch name it
        kto = (f"|{t.seed}|{t.max_steps}|{t.global_batch_size}|mismatched {'+'.join(self.sides)}"
               if self.kto else "")
        h = hashlib.sha256(f"{self.cfg.model.name}|{self.ref_mode}|{self.cfg.model.dtype}{kto}".encode())
        for p in (*self.pairs, *self.eval_pairs):
            h.update(repr((p["prompt"], *(p[s] for s in self.sides), p.get("desirable"))).encode())
        return h.hexdigest()

    def _precomputed(self, stage_dir: Optional[Path]) -> dict:
        """{"train": [N, k], "eval": [M, k]} reference sums (and for kto "kl": [max_steps x B, k], those of
        every stream position's k mismatched rows, for z0): read from the stage dir when it holds them for
        these rows and this reference (a resumed run), else computed in one pass and stored there."""
        key = self._fingerprint()
        path = stage_dir / REF_FILE if stage_dir is not None else None
        if path is not None and path.exists():
            stored = torch.load(path, map_location="cpu")
            if stored.get("key") == key:
                return stored
        with memstats.phase("scoring", "logprobs"):
            store = {"key": key, "train": self._reference_rows(self.pairs), "eval": self._reference_rows(self.eval_pairs)}
            if self.kto:
                B = self.cfg.train.global_batch_size
                mism = [m for step in range(self.cfg.train.max_steps)
                        for m in self._mismatched(step, range(step * B, (step + 1) * B), B)]
                mb = self.cfg.train.micro_batch_size
                kl = torch.cat([self._reference(mism[i:i + mb], ["completion"]).cpu()
                                for i in range(0, len(mism), mb)] or [torch.zeros(0)])
                store["kl"] = kl.view(-1, len(self.sides))   # [max_steps x B, k]: a position's k rows
        if path is not None and self.ranks.main:
            tmp = path.with_suffix(".tmp")
            torch.save(store, tmp)
            os.replace(tmp, path)   # atomic: a crash leaves the old file or none
        return store

    def _attach_reference(self, samples: list[dict], split: str = "train") -> list[dict]:
        """Copies of the rows with "ref" = reference sums of their sides [k]."""
        if self.ref_mode == "none":
            return samples
        if self.ref_store is not None:
            return [{**p, "ref": self.ref_store[split][p["index"]]} for p in samples]
        rows = self._reference_rows(samples)
        return [{**p, "ref": r} for p, r in zip(samples, rows)]

    def prepare(self, step: int) -> StepBatch:
        """This rank's pairs of the step: stream items step*B + [rank*b, (rank+1)*b), with their reference."""
        bp = self.cfg.batch_plan()
        first = step * bp.global_batch + self.ranks.rank * bp.per_device_batch
        positions = [first + j for j in range(bp.per_device_batch)]
        samples = [self.pairs[self.order(q)] for q in positions]
        totals = {"pairs": bp.global_batch}
        # The scoring phase (planned as plan/memory.py's `scoring`): the live reference's forward, KTO's z0.
        scores = self.kto or (self.ref_mode != "none" and self.ref_store is None)
        with memstats.phase("scoring" if scores else None, "logprobs"):
            samples = self._attach_reference(samples)
            if self.kto:
                totals["kto_z0"] = self._kto_z0(step, positions, bp.global_batch)
        if self.dpo.sft_weight and self.dpo.sft_mean == "token":   # the token mean is over the whole step
            mine = float(sum(sum(p["chosen_mask"]) for p in samples))
            totals["chosen_tokens"] = all_reduce_sum({"n": mine}, self.ranks)["n"]
        return StepBatch(samples=samples, totals=totals)

    def _mismatched(self, step: int, positions, global_batch: int) -> list[dict]:
        """KTO's mismatched rows of stream `positions`, as {"prompt", "completion", "completion_mask"}: the
        prompt of q with each answer of the step's next position, q-major: (chosen, rejected) for a pair
        (its desirable and its undesirable row, both in z0 as in TRL), the completion for an unpaired row."""
        start = step * global_batch
        out = []
        for q in positions:
            p, other = self.pairs[self.order(q)], self.pairs[self.order(start + (q - start + 1) % global_batch)]
            out += [{"prompt": p["prompt"], "completion": other[s], "completion_mask": other[s + "_mask"]}
                    for s in self.sides]
        return out

    @torch.no_grad()
    def _kto_z0(self, step: int, positions: list[int], global_batch: int) -> float:
        """KTO's reference point over the whole step (all ranks): the mean policy minus reference log-prob
        of the step's mismatched rows (`_mismatched`: prompt of q with the answers of the next position), >= 0."""
        mism = self._mismatched(step, positions, global_batch)
        total, mb = 0.0, self.cfg.train.micro_batch_size
        stored = self.ref_store["kl"][positions].reshape(-1) if self.ref_store is not None else None
        was = self.model.training
        self.model.eval()
        for i in range(0, len(mism), mb):
            chunk = mism[i:i + mb]
            pol = self._logps(self.model, chunk, ["completion"])[0]
            if stored is not None:   # precomputed: the frozen copy is gone
                ref = stored[i:i + mb].to(pol.device, pol.dtype)
            else:
                ref = self._reference(chunk, ["completion"])
            total += float((pol - ref).sum())
        self.model.train(was)
        s = all_reduce_sum({"kl": total, "n": float(len(mism))}, self.ranks)
        return max(0.0, s["kl"] / max(s["n"], 1.0))

    def _unpaired_loss(self, model, micro: list[dict], total: float, z0: float) -> tuple[torch.Tensor, dict]:
        """KTO on unpaired rows: one sequence a row; metrics are sums (rows, desirable, their rewards)."""
        logps, _ = self._logps(model, micro)                                             # [b]
        ref = torch.stack([p["ref"][0] for p in micro]).to(logps.device, logps.dtype)     # [b]
        desirable = torch.tensor([p["desirable"] for p in micro], device=logps.device)
        d = self.dpo
        loss, m = kto_loss(logps, ref, desirable, z0, beta=d.beta, desirable_weight=d.desirable_weight,
                           undesirable_weight=d.undesirable_weight, total_rows=total)
        return loss, {k: float(v) for k, v in m.items()}

    def _pair_loss(self, model, micro: list[dict], total: float, z0: float = 0.0,
                   chosen_tokens: Optional[float] = None) -> tuple[torch.Tensor, dict]:
        if self.unpaired:
            return self._unpaired_loss(model, micro, total, z0)
        sums, tokens = self._logps(model, micro)                                         # [2b] each
        c, r = sums.chunk(2)
        nc, nr = tokens.chunk(2)
        ref = (torch.stack([p["ref"] for p in micro]).to(sums.device, sums.dtype)
               if self.ref_mode != "none" else None)                                     # [b, 2]
        d = self.dpo
        if self.kto:
            logps, ref_logps = torch.cat([c, r]), torch.cat([ref[:, 0], ref[:, 1]])
            desirable = torch.arange(2 * len(micro), device=sums.device) < len(micro)
            loss, m = kto_loss(logps, ref_logps, desirable, z0, beta=d.beta, desirable_weight=d.desirable_weight,
                               undesirable_weight=d.undesirable_weight, total_rows=2 * total)
            p = PairLogps(c.detach(), r.detach(), nc, nr, ref[:, 0], ref[:, 1])
            cr, rr = implicit_rewards("sigmoid", p, d.beta)
            m = {**m, "pairs": float(len(micro)), "correct": float((cr > rr).sum()), "margin": float((cr - rr).sum()),
                 "chosen_reward": float(cr.sum()), "rejected_reward": float(rr.sum())}
        else:
            p = PairLogps(c, r, nc, nr, *((ref[:, 0], ref[:, 1]) if ref is not None else (None, None)))
            loss, m = preference_loss(d.loss_type, p, beta=d.beta, label_smoothing=d.label_smoothing,
                                      simpo_gamma=d.simpo_gamma, sft_weight=d.sft_weight, sft_mean=d.sft_mean,
                                      ipo_normalize=d.ipo_normalize, total_pairs=total,
                                      total_chosen_tokens=chosen_tokens)
        return loss, {k: float(v) for k, v in m.items()}

    def loss(self, model, micro: list[dict], totals: dict) -> tuple[torch.Tensor, dict]:
        loss, m = self._pair_loss(model, micro, totals["pairs"], totals.get("kto_z0", 0.0),
                                  totals.get("chosen_tokens"))
        m["seq_tokens"] = sum(len(self.sides) * len(p["prompt"]) + sum(len(p[s]) for s in self.sides) for p in micro)
        return loss, m

    def summarize(self, batch: StepBatch, sums: dict) -> dict:
        if self.unpaired:
            n, nd = sums.get("rows", 0.0), sums.get("desirable", 0.0)
            return {"loss": sums["loss"], "rows": n, "desirable_reward": sums["reward_desirable"] / max(nd, 1.0),
                    "undesirable_reward": sums["reward_undesirable"] / max(n - nd, 1.0),
                    "kto_z0": batch.totals["kto_z0"]}
        n = max(sums.get("pairs", 0.0), 1.0)
        out = {"loss": sums["loss"], "reward_accuracy": sums["correct"] / n, "margin": sums["margin"] / n,
               "chosen_reward": sums["chosen_reward"] / n, "rejected_reward": sums["rejected_reward"] / n,
               "pairs": sums.get("pairs", 0.0)}
        if "kto_z0" in batch.totals:
            out["kto_z0"] = batch.totals["kto_z0"]
        return out

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        """Held-out pairs: mean loss (not for kto, whose reference point is a training-batch estimate),
        reward accuracy (chosen's implicit reward strictly higher) and mean margin; with a task, its
        held-out accuracy by greedy decoding."""
        out: dict = {}
        if self.eval_pairs and self.unpaired:
            out = self._evaluate_unpaired(model)
        elif self.eval_pairs:
            was = model.training
            model.eval()
            sums = {"loss": 0.0, "correct": 0.0, "margin": 0.0}
            mb = self.cfg.train.micro_batch_size
            for i in range(0, len(self.eval_pairs), mb):
                chunk = self._attach_reference(self.eval_pairs[i:i + mb], "eval")
                loss, m = self._pair_loss(model, chunk, 1.0)
                for k in sums:
                    sums[k] += float(loss) if k == "loss" else m[k]
            model.train(was)
            n = len(self.eval_pairs)
            out = {"reward_accuracy": sums["correct"] / n, "eval_margin": sums["margin"] / n}
            if not self.kto:
                out["eval_loss"] = sums["loss"] / n
        if self.task is not None and self.engine is not None:
            out.update(task_accuracy(self.engine, self.tokenizer, self.task, self.cfg.task.chat))
        return out

    def _evaluate_unpaired(self, model) -> dict:
        """Held-out unpaired rows: the mean implicit reward (beta x log-ratio) of the desirable and the
        undesirable ones, and their difference as eval_margin."""
        was = model.training
        model.eval()
        sums = {"rows": 0.0, "desirable": 0.0, "reward_desirable": 0.0, "reward_undesirable": 0.0}
        mb = self.cfg.train.micro_batch_size
        for i in range(0, len(self.eval_pairs), mb):
            m = self._unpaired_loss(model, self._attach_reference(self.eval_pairs[i:i + mb], "eval"), 1.0, 0.0)[1]
            for k in sums:
                sums[k] += m[k]
        model.train(was)
        nd, nu = sums["desirable"], sums["rows"] - sums["desirable"]
        out = {"eval_desirable_reward": sums["reward_desirable"] / max(nd, 1.0),
               "eval_undesirable_reward": sums["reward_undesirable"] / max(nu, 1.0)}
        if nd and nu:
            out["eval_margin"] = out["eval_desirable_reward"] - out["eval_undesirable_reward"]
        return out

    def state_dict(self) -> dict:
        return {}  # the data position is the step itself; precomputed references live in REF_FILE

    def load_state_dict(self, state: dict) -> None:
        pass
