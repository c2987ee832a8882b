"""PPO with a learned critic (Schulman et al. 2017; the RLHF recipe of Ziegler et al. 2019 / InstructGPT).

    trainfit train cfg.yaml stage=ppo task.name=arithmetic
    trainfit train cfg.yaml stage=ppo rl_models.reward_model=runs/rm/final ppo.kl_coef=0.02

A rollout r takes R = train.global_batch_size x ppo.num_mini_batches prompts (indexes r*R .. r*R+R-1
of the task stream), samples one completion each with the engine (rollout_batch.py, shared with
GRPO) and scores it: the weighted task.rewards plus ppo.reward_model_weight x the frozen reward
model's score (ppo_rewards.py). Then, without gradients, it computes the behaviour log-probs, the
reference log-probs (the base with adapters off, or a frozen copy) and the critic's values, folds
-kl_coef x KL into the per-token rewards (ppo.kl_mode=reward) with the score at the last completion
token, and runs GAE and whitening over the whole rollout. The rollout then serves ppo.epochs x
ppo.num_mini_batches optimizer steps, one minibatch of train.global_batch_size samples each (shuffled
per epoch), with the clipped surrogate + vf_coef x clipped value loss (- entropy_coef x entropy),
aggregated by grpo.loss_type over the minibatch's totals (so micro-batch size never changes the
gradient). The policy and the critic train as one module (value_model.PolicyCritic).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Optional

import torch

from trainfit.algos import (AdaptiveKL, LOSS_AGG, agg_loss, clipped_policy_loss, clipped_value_loss, gae, kl_penalty,
                            token_logprobs_rows, token_rewards, whiten)
from trainfit.config import Config
from trainfit.core.dist import Ranks, SINGLE, all_gather_objects
from trainfit.models.logprobs import (batch_tensors, forward_batch, policy_token_count, scatter_values,
                                      sequence_logprobs, store_rows, to_frame)
from trainfit.models.policy import LoadedModel, reference_context
from trainfit.models.save import save_pretrained
from trainfit.models.save_shards import LazyWeights
from trainfit.models.value import PolicyCritic, build_critic, save_critic
from trainfit.tasks import resolve_rewards, resolve_weights
from trainfit.train import frozen, memstats, zero
from trainfit.train.evaluate import task_accuracy
from trainfit.train.ppo_rewards import load_reward_scorer, reward_model_scores
from trainfit.train.rollout_batch import (current_engine, generation_over, log_completions, rollout_round,
                                           sample_and_score, sync_engine)
from trainfit.train.stage import BaseStage, StepBatch, padding_free, policy_parts, step_seed


def _var(v: torch.Tensor) -> float:
    return float(v.var()) if v.numel() > 1 else 0.0


def _gathered(parts: list, i: int) -> torch.Tensor:
    """Every rank's `i`-th tensor, concatenated in rank order (= sample order of the whole rollout)."""
    return torch.cat([p[i] for p in parts])


class PPOStage(BaseStage):
    # The train states put to sleep for a rollout's generation (set by `prepare`); nothing asleep before.
    states = zero.StatesAsleep(None)

    @classmethod
    def build(cls, cfg: Config, stage_dir: Path, ranks: Ranks, device) -> tuple:
        """The loop trains policy + critic as one module (its `loaded.model`); the engine samples the policy."""
        loaded, task, engine = policy_parts(cfg, stage_dir, ranks, device)
        pair = PolicyCritic(loaded.model, build_critic(cfg, loaded.tokenizer, device, loaded.model), loaded.is_peft)
        return dataclasses.replace(loaded, model=pair), cls(cfg, loaded, pair, device, task, engine, stage_dir, ranks=ranks)

    def __init__(self, cfg: Config, policy: LoadedModel, pair: PolicyCritic, device, task, engine, stage_dir: Path,
                 ranks: Ranks = SINGLE):
        self.cfg, self.device, self.task, self.engine, self.ranks = cfg, device, task, engine, ranks
        self.loaded, self.pair, self.policy, self.critic = policy, pair, pair.policy, pair.critic
        self.tokenizer, self.is_peft, self.stage_dir = policy.tokenizer, policy.is_peft, stage_dir
        self.pad_id = self.tokenizer.pad_token_id
        self.packed = padding_free(cfg, self.policy)   # train.padding_free: policy and critic on one packed row
        self.reward_fns = resolve_rewards(cfg.task, task) if cfg.task.rewards else []
        self.reward_weights = resolve_weights(cfg.task, task) if cfg.task.rewards else []
        self.reward_model = load_reward_scorer(cfg.rl_models, device, len(self.tokenizer))
        if self.reward_model is not None:   # sharded like the policy when it is (train/frozen.py)
            self.reward_model = frozen.spread(self.reward_model, cfg, ranks)
        p = cfg.ppo
        # Reference policy: the base with adapters off (no copy; with ppo.shared_base the critic's
        # backbone is this same base too, value_model.shared_backbone), or a frozen copy of the start.
        self.ref_model = None
        if p.kl_coef > 0 and not self.is_peft:
            self.ref_model = frozen.spread(copy.deepcopy(self.policy).eval().requires_grad_(False), cfg, ranks)
        self.kl_ctl = AdaptiveKL(p.kl_coef, p.adaptive_kl_target, p.adaptive_kl_horizon) \
            if p.adaptive_kl_target and p.kl_coef > 0 else None
        self.kl_coef = p.kl_coef
        self.steps_per_rollout = p.epochs * p.num_mini_batches
        self.rollout: Optional[StepBatch] = None
        self.rollout_round = -1
        self.sync_metrics: dict = {}
        self.completions_log = stage_dir / "completions.jsonl"

    # ---- rollout -------------------------------------------------------------------------------
    def prepare(self, step: int) -> StepBatch:
        rnd, idx = divmod(step, self.steps_per_rollout)
        if rnd != self.rollout_round:
            # ZeRO-3: policy and critic gathered whole for the rollout with the hf engine (generation local,
            # as GRPO's); with an engine of its own copy, the sync gathers a tensor at a time and the
            # old-logprob and value forwards a layer at a time under the partition hooks.
            with rollout_round(self.pair, self.engine, self.cfg) as self.states:
                with memstats.phase("rollout", "sync"):
                    self.sync_metrics = sync_engine(self.engine, self.policy, self.tokenizer, self.device,
                                                    self.cfg, step) or self.sync_metrics
                self.rollout, self.rollout_round = self._rollout(rnd, step), rnd
        epoch, j = divmod(idx, self.cfg.ppo.num_mini_batches)
        b = self.cfg.train.global_batch_size // self.ranks.world                # this rank's share of a minibatch
        micro = [self.rollout.samples[i] for i in self._order(rnd, epoch)[j * b:(j + 1) * b]]
        # The loss normalisers are the whole minibatch's, over every rank (micro and rank shares add up).
        tokens = all_gather_objects(float(sum(policy_token_count(s) for s in micro)), self.ranks)
        totals = {"total_seqs": self.cfg.train.global_batch_size, "total_tokens": float(sum(tokens)),
                  "max_len": self.cfg.rollout.max_new_tokens}
        return StepBatch(samples=micro, totals=totals, metrics={**self.rollout.metrics, "ppo_epoch": float(epoch)})

    def _order(self, rnd: int, epoch: int) -> list[int]:
        """This rank's sample order in `epoch`: a fresh permutation per epoch from (seed, rollout,
        epoch, rank), so a resumed run takes the same minibatches; in order when there is one
        minibatch. Each rank shuffles its own share, so every rank trains the same number of samples."""
        n = len(self.rollout.samples)
        if self.cfg.ppo.num_mini_batches == 1:
            return list(range(n))
        key = f"ppo-order:{rnd}:{epoch}" + (f":{self.ranks.rank}" if self.ranks.distributed else "")
        g = torch.Generator().manual_seed(step_seed(self.cfg.train.seed, key))
        return torch.randperm(n, generator=g).tolist()

    def _rollout(self, rnd: int, step: int) -> StepBatch:
        R = self.cfg.train.global_batch_size * self.cfg.ppo.num_mini_batches
        local = R // self.ranks.world                          # this rank's prompts of the rollout
        first = self.ranks.rank * local
        examples = [self.task.train_example(rnd * R + first + j) for j in range(local)]
        # One seed per completion from its index in the whole rollout: the same samples on 1 or N ranks.
        seeds = [step_seed(self.cfg.train.seed, f"{rnd}:{first + j}") for j in range(local)]
        samples, texts, total, per_fn, finished = sample_and_score(
            self.engine, self.tokenizer, self.cfg, examples, seeds, self.reward_fns, self.reward_weights)  # [local]
        generation_over(self.engine, self.states)
        if self.reward_model is not None:
            with memstats.phase("scoring", "rewards"):
                rm = reward_model_scores(self.reward_model, samples, self.pad_id, self.device,
                                         self.cfg.train.micro_batch_size, self.ranks)          # [local]
            per_fn = {**per_fn, "reward_model": rm}
            total = total + self.cfg.ppo.reward_model_weight * rm
        if self.cfg.logging.save_completions and self.ranks.main:
            log_completions(self.completions_log, self.cfg.logging.save_completions, step, examples, texts, total)
        with memstats.phase("scoring", "logprobs"):
            self._fill(samples)
        metrics = self._advantages(samples, total)
        lengths = torch.tensor([float(policy_token_count(s)) for s in samples])
        parts = all_gather_objects((total, lengths, finished, per_fn), self.ranks)  # small: per-sample numbers
        all_total = _gathered(parts, 0)
        metrics.update({f"reward/{k}": torch.cat([p[3][k] for p in parts]).mean().item() for k in per_fn})
        metrics.update(reward=all_total.mean().item(), reward_std=_var(all_total) ** 0.5,
                       completion_len=_gathered(parts, 1).mean().item(), finished=_gathered(parts, 2).mean().item(),
                       **self.sync_metrics)
        return StepBatch(samples=samples, totals={}, metrics=metrics)

    @torch.no_grad()
    def _fill(self, samples: list[dict]) -> None:
        """Behaviour log-probs, reference log-probs (kl_coef > 0) and the critic's values, per sample
        as 1-D tensors over its policy tokens `[c_i]`, micro_batch_size samples per forward."""
        mb, need_ref = self.cfg.train.micro_batch_size, self.cfg.ppo.kl_coef > 0
        for i in range(0, len(samples), mb):
            chunk = samples[i:i + mb]
            logp, mask, _ = self._logprobs(self.policy, chunk)                 # [b, T-1]
            store_rows(chunk, "old_logp", logp, mask)
            if need_ref:
                ref = self.ref_model if self.ref_model is not None else self.policy
                with reference_context(self.policy, self.is_peft and self.ref_model is None):
                    logp, mask, _ = self._logprobs(ref, chunk)
                store_rows(chunk, "ref_logp", logp, mask)
            fb = forward_batch(chunk, self.pad_id, self.device, self.packed)
            values = self.critic(fb.ids, fb.attn, **fb.inputs)                    # [rows, width]
            store_rows(chunk, "old_values", fb.per_position(values), fb.mask)     # V at t scores token t+1

    def _advantages(self, samples: list[dict], scores: torch.Tensor) -> dict:
        """Token rewards, GAE, returns and (whitened) advantages over the whole rollout; stored per
        sample. Returns the rollout's metrics."""
        p, g = self.cfg.ppo, self.cfg.grpo
        _, _, mask = batch_tensors(samples, self.pad_id, "cpu")                # [r, T-1], r = this rank's samples
        old = scatter_values([s["old_logp"] for s in samples], mask)
        values = scatter_values([s["old_values"] for s in samples], mask)
        kl = None
        if "ref_logp" in samples[0]:
            ref = scatter_values([s["ref_logp"] for s in samples], mask)
            kl = torch.where(mask, kl_penalty(old, ref, g.kl_estimator), torch.zeros_like(old))  # [r, T-1]
        coef = self.kl_coef if p.kl_mode == "reward" else 0.0
        rewards = token_rewards(scores.float(), kl, mask, coef)                # [r, T-1]
        adv, ret = gae(rewards, values, mask, p.gamma, p.lam)                  # [r, T-1] each
        seq_kl = kl.sum(dim=1) if kl is not None else torch.zeros(len(samples))  # [r] KL per sequence
        # Whitening and the metrics are over the whole rollout: every rank's policy tokens, gathered
        # (1-D, in sample order), so 1 and N ranks whiten alike.
        parts = all_gather_objects((adv[mask], ret[mask], values[mask], seq_kl), self.ranks)
        every_adv, every_ret, every_v, every_kl = (_gathered(parts, i) for i in range(4))
        if p.whiten_advantages:
            mine = sum(int(q[0].numel()) for q in parts[:self.ranks.rank])
            white = whiten(every_adv[None], torch.ones_like(every_adv[None], dtype=torch.bool))[0]
            adv = torch.zeros_like(adv).masked_scatter(mask, white[mine:mine + int(mask.sum())])
        for s, a, r, m in zip(samples, adv, ret, mask):
            s["advantages"], s["returns"] = a[m].clone(), r[m].clone()      # [c_i]
        var_ret = _var(every_ret)
        out = {"kl_coef": self.kl_coef, "returns_mean": float(every_ret.mean()),
               "advantages_mean": float(every_adv.mean()), "advantages_std": _var(every_adv) ** 0.5,
               "values_mean": float(every_v.mean()),
               "explained_variance": 1.0 - _var(every_ret - every_v) / var_ret if var_ret > 0 else 0.0}
        if kl is not None:
            out["kl"] = float(every_kl.mean())
            if self.kl_ctl is not None:  # the next rollout's coefficient (Ziegler et al. 2019)
                self.kl_coef = self.kl_ctl.update(out["kl"], every_kl.numel())
        return out

    def _logprobs(self, model, samples: list[dict]):
        return sequence_logprobs(model, samples, self.pad_id, self.device, self.cfg.rollout.temperature,
                                 self.cfg.train.logits_chunk_rows, packed=self.packed)

    # ---- loss ----------------------------------------------------------------------------------
    def loss(self, model, micro: list[dict], totals: dict) -> tuple[torch.Tensor, dict]:
        p, g, t = self.cfg.ppo, self.cfg.grpo, self.cfg.rollout.temperature
        fb = forward_batch(micro, self.pad_id, self.device, self.packed)      # padded [b, T] or packed [1, N]
        mask = fb.mask                                                         # [b, T-1]
        rows, values = model(input_ids=fb.ids, attention_mask=fb.attn, keep=fb.keep,
                             **fb.inputs)                                      # [n, V], [rows, width]
        logp_rows, ent_rows = token_logprobs_rows(rows, fb.targets, t, self.cfg.train.logits_chunk_rows,
                                                  entropy=True)                # [n] each
        logp = fb.frame(logp_rows)                                             # [b, T-1]
        values = fb.per_position(values)                                       # [b, T-1]
        old, adv, ret, old_v = (scatter_values([s[k] for s in micro], mask)
                                for k in ("old_logp", "advantages", "returns", "old_values"))
        fmask = mask.float()

        def agg(x: torch.Tensor) -> torch.Tensor:  # the minibatch's totals: micro shares add up
            return agg_loss(x, fmask, LOSS_AGG[g.loss_type], total_seqs=totals["total_seqs"],
                            total_tokens=totals["total_tokens"], max_len=totals["max_len"])

        per_token, clipped = clipped_policy_loss(logp, old, adv, g.epsilon, g.epsilon_high or g.epsilon)
        kl_sum = 0.0
        if p.kl_mode == "loss" and self.kl_coef > 0:
            ref = scatter_values([s["ref_logp"] for s in micro], mask)
            kl = kl_penalty(logp, ref, g.kl_estimator)
            per_token = per_token + self.kl_coef * kl
            kl_sum = float(kl.detach()[mask].sum())
        pg_loss = agg(per_token)
        v_mat, v_clipped = clipped_value_loss(values, old_v, ret, p.vf_clip)
        vf_loss = agg(v_mat)
        loss = pg_loss + p.vf_coef * vf_loss
        if p.entropy_coef > 0:  # a differentiable entropy (ent_rows is detached)
            lsm = torch.log_softmax(rows.float() / (t if t > 0 else 1.0), dim=-1)             # [n, V]
            ent = to_frame(-(lsm.exp() * lsm).sum(-1), mask)                                  # [b, T-1]
            loss = loss - p.entropy_coef * agg(ent)
        with torch.no_grad():
            m = mask
            metrics = {"policy_loss": float(pg_loss), "value_loss": float(vf_loss),
                       "clip_frac_sum": float(clipped[m].sum()), "value_clip_sum": float(v_clipped[m].sum()),
                       "ratio_sum": float(torch.exp(logp - old)[m].sum()), "tokens": float(m.sum()),
                       "entropy_sum": float(ent_rows.sum()), "kl_loss_sum": kl_sum,
                       "seq_tokens": sum(len(s["input_ids"]) for s in micro)}
        return loss, metrics

    def summarize(self, batch: StepBatch, sums: dict) -> dict:
        n = max(sums.get("tokens", 0.0), 1.0)
        out = {"loss": sums.get("loss", 0.0), **batch.metrics, "policy_loss": sums.get("policy_loss", 0.0),
               "value_loss": sums.get("value_loss", 0.0), "clip_frac": sums.get("clip_frac_sum", 0.0) / n,
               "value_clip_frac": sums.get("value_clip_sum", 0.0) / n, "ratio": sums.get("ratio_sum", 0.0) / n,
               "entropy": sums.get("entropy_sum", 0.0) / n, "tokens": sums.get("tokens", 0.0)}
        if self.cfg.ppo.kl_mode == "loss" and self.kl_coef > 0:
            out["kl_token"] = sums.get("kl_loss_sum", 0.0) / n
        return out

    def evaluate(self, model) -> dict:
        rewards = (self.reward_fns, self.reward_weights) if self.reward_fns else None
        with current_engine(self.engine, self.policy, self.tokenizer, self.device, self.cfg):
            return task_accuracy(self.engine, self.tokenizer, self.task, self.cfg.task.chat, rewards=rewards)

    @property
    def saves_from_module(self) -> bool:
        """A critic over the policy's base is saved from the modules (final_save.save_final_model)."""
        return self.cfg.ppo_shared_base()

    def save_final(self, path: Path, state_dict=None) -> Path:
        """The policy's final dir as every stage writes it, and the critic beside it in `critic/`.
        `state_dict`: FSDP's gathered tensors of both (`policy.` / `critic.` names), on rank 0."""
        if state_dict is not None:
            return self._save_gathered(path, state_dict)
        save_pretrained(self.loaded, path, base_dir=self.stage_dir / "base")
        save_critic(self.critic, self.tokenizer, path / "critic", shared=self.cfg.ppo_shared_base())
        return path

    def _save_gathered(self, path: Path, full: dict) -> Path:
        """Under FSDP the modules hold shards: the policy is saved from its gathered tensors, the critic
        (merged with its adapters) from a plain CPU copy they are loaded into (its own base: FSDP never
        shares the policy's, Config.ppo_shared_base)."""
        def part(prefix: str) -> LazyWeights:   # read (gathered) only as the save reads it
            return LazyWeights.of(full).subset(lambda k: k.startswith(prefix), lambda k: k[len(prefix):])

        save_pretrained(self.loaded, path, base_dir=self.stage_dir / "base", state_dict=part("policy."))
        critic = build_critic(self.cfg, self.tokenizer, torch.device("cpu"))
        critic.load_state_dict(dict(part("critic.").items()))
        save_critic(critic, self.tokenizer, path / "critic")
        return path

    def state_dict(self) -> dict:
        return {"rollout": self.rollout, "rollout_round": self.rollout_round, "kl_coef": self.kl_coef}

    def load_state_dict(self, state: dict) -> None:
        self.rollout, self.rollout_round = state.get("rollout"), state.get("rollout_round", -1)
        if state.get("world_changed"):  # this rank's share of a half-used rollout was not saved: redo it
            self.rollout, self.rollout_round = None, -1
        self.kl_coef = state.get("kl_coef", self.kl_coef)
        if self.kl_ctl is not None:
            self.kl_ctl.coef = self.kl_coef
