"""GRPO (and its DAPO / Dr. GRPO loss variants) on a verifiable task.

    trainfit train examples/grpo.yaml
    trainfit train examples/grpo.yaml grpo.num_generations=16 grpo.beta=0.04

One rollout serves `grpo.num_iterations` optimizer steps. A rollout takes P = global_batch / G
prompts (prompt indexes r*P .. r*P+P-1 of the task stream for rollout r), samples G completions of
each with the engine, scores them with the reward functions, and normalises rewards within each
group. Groups are laid out group-major and the step's loss is normalised over the whole step, so any
micro-batch split gives the same gradient and a group is never split across optimizer steps. With
beta = 0 and one optimizer step per rollout, samples whose advantage is exactly 0 (e.g. every member
of a group with equal rewards) are left out of the training forward/backward: their gradient is
exactly zero and the normalisers are the whole step's, so the update is the same.

With an `env` (tools, simulated user, HTTP service) a group is G multi-turn episodes of one task: the
policy's turns interleave with environment tokens, only the policy's tokens carry loss, the advantage is
per episode, and an episode whose environment failed is left out of its group. Before each rollout the
weights are pushed to the engine (`engine.sync`) and, for engines holding their own copy (vllm,
openai), a probe batch proves the engine samples from them (trainfit.rollout.sync_check).

With rollout.mode=async the rollouts come from a worker a bounded number of rollouts behind, a thread
or a child process (train/async_rollout.py, train/async_process.py run this module's `_rollout` on their
own copy of the weights); the trainer adds a
stale rollout's proximal log-probs when it takes it, and the loss reweights stale samples by their
behaviour log-probs (algos/offpolicy.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Optional

import torch

from trainfit.algos import advantages, grpo_loss
from trainfit.config import Config
from trainfit.core.dist import Ranks, SINGLE, all_gather_objects
from trainfit.data.image_examples import buffer_images, image_inputs, policy_processor
from trainfit.envs import build_env_factory, env_task, run_groups, transcript_record
from trainfit.models import fused_head
from trainfit.models.logprobs import policy_token_count, scatter_values, sequence_logprobs, store_rows
from trainfit.models.policy import reference_context
from trainfit.tasks import resolve_rewards, resolve_weights
from trainfit.train import frozen, memstats, parallel, zero
from trainfit.train.evaluate import episode_eval, image_task_accuracy, task_accuracy
from trainfit.train.async_process import start_worker
from trainfit.train.async_rollout import RolloutWorker, check_rollout_device
from trainfit.train.rollout_batch import (current_engine, generation_over, log_completions, rollout_round,
                                           sample_and_score, sync_engine)
from trainfit.train.screens import SCREENS, ScreenKeeper
from trainfit.train.stage import BaseStage, StepBatch, padding_free, policy_parts, step_seed
from trainfit.train.warnings_rl import ZeroAdvantageWatch, zero_signal_frac


def _drop_zero_advantage(samples: list[dict], keep: int) -> list[dict]:
    """The samples with a non-zero advantage, in order, topped up to `keep` with zero-advantage ones
    (which add exactly nothing to the gradient) when there are fewer."""
    nonzero = [i for i, s in enumerate(samples) if s["advantage"] != 0.0]
    fill = [i for i, s in enumerate(samples) if s["advantage"] == 0.0][: max(keep - len(nonzero), 0)]
    return [samples[i] for i in sorted(nonzero + fill)]


def _pad_rows(samples: list[dict], n: int) -> list[dict]:
    """`samples` topped up to `n` rows with copies of the last whose loss mask is all 0: they train
    nothing (every loss and metric term is masked) but keep the ranks' forwards in step."""
    pad = []
    if samples and len(samples) < n:
        last = samples[-1]
        pad = [{**last, "loss_mask": [0] * len(last["loss_mask"]), "advantage": 0.0,
                **{k: torch.zeros(0) for k in ("ref_logp", "old_logp", "behav_logp") if k in last}}] * (n - len(samples))
    return samples + pad


class GRPOStage(BaseStage):
    # The train states put to sleep for a rollout's generation (set by `prepare`); nothing asleep before.
    states = zero.StatesAsleep(None)

    @classmethod
    def build(cls, cfg: Config, stage_dir: Path, ranks: Ranks, device) -> tuple:
        loaded, task, engine = policy_parts(cfg, stage_dir, ranks, device)
        return loaded, cls(cfg, loaded.model, loaded.tokenizer, device, task, engine, loaded.is_peft, stage_dir,
                           ranks=ranks).bound(loaded, stage_dir)

    def __init__(self, cfg: Config, model, tokenizer, device, task, engine, is_peft: bool, stage_dir: Path,
                 ranks: Ranks = SINGLE):
        self.cfg, self.model, self.tokenizer, self.device, self.ranks = cfg, model, tokenizer, device, ranks
        self.task, self.engine, self.is_peft = task, engine, is_peft
        self.pad_id = tokenizer.pad_token_id
        self.G = cfg.grpo.num_generations
        self.reward_fns = resolve_rewards(cfg.task, task)
        self.reward_weights = resolve_weights(cfg.task, task)
        # Reference policy for the KL term: the base with adapters off (no copy), or a frozen copy.
        self.ref_model = None
        if cfg.grpo.beta > 0 and not is_peft:
            self.ref_model = frozen.spread(copy.deepcopy(model).eval().requires_grad_(False), cfg, ranks)
        self.buffer: Optional[StepBatch] = None
        self.buffer_round = -1
        self.completions_log = stage_dir / "completions.jsonl"
        self.transcripts_log = stage_dir / "transcripts.jsonl"
        self.sync_metrics: dict = {}
        # Warn once when no group has had a learning signal for several steps (warnings_rl.py).
        self.zero_adv_watch = ZeroAdvantageWatch(cfg.train.max_steps, self.G, cfg.rollout.temperature)
        self.step, self._notices = 0, []
        # Vision-language policy: prompts may carry images (data/image_examples.py); the hf engine needs
        # the processor to turn them into pixel inputs.
        self.vision = policy_processor(cfg, model, tokenizer, task)
        if self.vision is not None and engine is not None:
            engine.processor = self.vision
        self.head = fused_head.resolve(cfg, model, device)   # train.fused_head: off | chunked | liger
        self.packed = padding_free(cfg, model)                # train.padding_free: one row per micro-batch
        # Multi-turn: a fresh environment per episode (the policy's own module plays a simulated user).
        self.make_env = None
        if cfg.env.type != "none":
            self.make_env = build_env_factory(cfg, task, model, tokenizer, is_peft, device)
            self.task = env_task(cfg, task)  # simulated_user: only the selected domains' rows
        # Episodes in lock-step (one engine call per turn for all of them), or each on its own as its
        # environment answers (envs/episodes.py): the async worker's, so a slow turn holds up one episode.
        self.episodes_as_ready = False
        # rollout.mode=async: the worker sampling the next rollouts (train/async_rollout.py), started at the
        # first rollout the stage takes (after a resume has loaded the weights it copies).
        self.worker: Optional[RolloutWorker] = None
        self._queued: dict[int, StepBatch] = {}   # rollouts sampled ahead, restored by a resume
        if cfg.rollout.mode == "async":
            check_rollout_device(cfg, device)
        self._iw_extremes: list[float] = []   # the step's largest and smallest importance weights (async)

    # ---- rollout -------------------------------------------------------------------------------
    def prepare(self, step: int) -> StepBatch:
        self.step = step + 1
        self._iw_extremes = []
        rnd = step // self.cfg.grpo.num_iterations
        if self.cfg.rollout.mode == "async":
            if rnd != self.buffer_round:
                self.buffer, self.buffer_round = self._async_batch(rnd), rnd
            if step + 1 == self.cfg.train.max_steps:
                self.close()
            return self.buffer
        if rnd != self.buffer_round:
            # ZeRO-3: the policy gathered whole for the rollout with the hf engine (generation local); with an
            # engine of its own copy, the sync gathers a tensor at a time and the scoring a layer at a time.
            with rollout_round(self.model, self.engine, self.cfg) as self.states:
                with memstats.phase("rollout", "sync"):  # weight push + probe (no-op for in-process hf)
                    self._sync_engine(step)
                self.buffer, self.buffer_round = self._rollout(rnd, step), rnd
        return self.buffer

    def close(self) -> None:
        """The async worker stopped (its thread joined, its engine closed, its process ended); a no-op in sync mode."""
        if self.worker is not None:
            self.worker.close()

    def _async_batch(self, rnd: int) -> StepBatch:
        """Rollout `rnd` from the worker, which gets the weights of this step (version `rnd`)."""
        if self.worker is None:
            n = self.cfg.grpo.num_iterations
            last = -(-self.cfg.train.max_steps // n)                  # rollouts in the stage
            self.worker = start_worker(self, start=rnd, last=last, queued=self._queued)
            self._queued = {}
        batch = self.worker.next_batch(rnd, self.model)
        batch.metrics.update(self.worker.sync_metrics)
        return batch

    def _sync_engine(self, step: int) -> None:
        """Push the current weights to the engine and prove it samples from them (rollout.sync_check)."""
        self.sync_metrics = sync_engine(self.engine, self.model, self.tokenizer, self.device, self.cfg, step) \
            or self.sync_metrics

    def _rollout(self, rnd: int, step: int) -> StepBatch:
        """Generate, score and normalise this rank's whole groups of rollout `rnd`."""
        P, G = self.cfg.batch_plan().prompts_per_step, self.G
        local = P // self.ranks.world                         # prompts (whole groups) on this rank
        first = self.ranks.rank * local                       # this rank's first prompt in the step
        examples = [self.task.train_example(rnd * P + first + j) for j in range(local)]
        flat_ex = [ex for ex in examples for _ in range(G)]                    # group-major, [P*G]
        # One seed per completion, from (seed, rollout, index in the global batch): the same samples
        # whatever the generation batch size or the number of ranks sharing the rollout.
        seeds = [step_seed(self.cfg.train.seed, f"{rnd}:{first * G + i}") for i in range(len(flat_ex))]
        gen = self._episodes if self.make_env is not None else self._single_turn
        samples, total, per_fn, finished, valid = gen(flat_ex, seeds, step)
        # A sample is one training row; an episode whose screenshots were dropped trains as several
        # (envs/episodes.py, Episode.rows), each naming its completion as "episode".
        owner = torch.tensor([x.get("episode", i) for i, x in enumerate(samples)])              # [rows]
        adv = self._advantages(total, valid)                                                  # [P*G]
        for smp, a in zip(samples, adv[owner].tolist()):
            smp["advantage"] = float(a)
        generation_over(self.engine, self.states)
        with memstats.phase("scoring", "logprobs"):  # reference / behaviour log-prob forwards
            self._fill_logprobs(samples)
        lengths = torch.zeros(len(total)).index_add_(                                        # [P*G]
            0, owner, torch.tensor([float(policy_token_count(x)) for x in samples]))
        skip = self._skips_zero_advantage()
        nonzero = sum(1 for x in samples if x["advantage"] != 0.0) if skip else len(samples)
        # Metrics over the whole step: gather every rank's per-completion values (small) first.
        parts = all_gather_objects((total, lengths, finished, per_fn, valid, nonzero, len(samples)), self.ranks)
        all_total = torch.cat([p[0] for p in parts])
        all_len = torch.cat([p[1] for p in parts])
        metrics = {"reward": all_total.mean().item(), "reward_std": all_total.std().item(),
                   "reward_group_std": all_total.view(-1, G).std(dim=1).mean().item(),
                   "completion_len": all_len.mean().item(),
                   "finished": torch.cat([p[2] for p in parts]).mean().item(),
                   **{f"reward/{k}": torch.cat([p[3][k] for p in parts]).mean().item() for k in per_fn},
                   "zero_adv_frac": zero_signal_frac(all_total, torch.cat([p[4] for p in parts]), G),
                   **self.sync_metrics}
        if self.make_env is not None:
            metrics["env_failed"] = 1.0 - torch.cat([p[4] for p in parts]).float().mean().item()
        max_len = self.cfg.rollout.max_new_tokens * self.cfg.rollout.max_turns  # Dr. GRPO's constant
        totals = {"total_seqs": P * G, "total_tokens": float(all_len.sum()), "max_len": max_len}
        # Every rank trains the same number of rows (forwards and gradient all-reduces are collective):
        # with the skip, its non-zero ones topped up with zero-advantage ones to the largest count;
        # ranks with fewer rows (fewer episodes split by screenshot drops) add rows that train nothing.
        keep = max(p[5] for p in parts)
        if skip:
            samples = _drop_zero_advantage(samples, keep)
            totals["skipped"] = 1.0
            metrics["skipped_frac"] = 1.0 - keep * self.ranks.world / sum(p[6] for p in parts)
        samples = _pad_rows(samples, keep)
        if len(samples) > local * G and self.cfg.engine() == "deepspeed":
            # DeepSpeed steps the optimizer after a fixed count of micro-batches (its accumulation).
            raise RuntimeError(
                f"this step's episodes train as {len(samples)} rows on this rank, more than its {local * G} "
                "episodes (screenshots dropped by rollout.max_images_per_episode split an episode into one row "
                "per context it acted in), which DeepSpeed's fixed accumulation cannot take; raise "
                "rollout.max_images_per_episode to rollout.max_turns (plus the opening screenshots), or train "
                "without DeepSpeed (distributed.strategy=auto).")
        return StepBatch(samples=samples, totals=totals, metrics=metrics)

    def _advantages(self, total: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """This rank's advantages `[P*G]` by `grpo.advantage`. Per-group estimators need only this
        rank's whole groups; REINFORCE++'s batch statistics are over the whole step, so every rank's
        rewards are gathered first (the same advantages on 1 or N ranks)."""
        g = self.cfg.grpo
        if g.advantage in ("group_norm", "rloo") or self.ranks.world == 1:
            return advantages(total, self.G, g.advantage, scale=g.scale_rewards,
                              valid=None if bool(valid.all()) else valid)
        parts = all_gather_objects((total, valid), self.ranks)
        every = advantages(torch.cat([p[0] for p in parts]), self.G, g.advantage,
                           valid=torch.cat([p[1] for p in parts]))                            # [world*P*G]
        n = total.numel()
        return every[self.ranks.rank * n:(self.ranks.rank + 1) * n]

    def _skips_zero_advantage(self) -> bool:
        """Leave zero-advantage samples out of the training forward/backward when that cannot change
        the update: with beta = 0 their per-token loss is -min(r * 0, clip(r) * 0) = 0, so their
        gradient is exactly zero, and the loss normalisers (`totals`) are computed over all samples
        before the drop. Only on-policy (num_iterations = 1), where their logged ratio is exactly 1
        (see `summarize`); not under DeepSpeed, which counts micro-steps to find its accumulation
        boundary."""
        g = self.cfg.grpo
        return g.beta == 0 and g.num_iterations == 1 and self.cfg.engine() != "deepspeed"

    def _single_turn(self, flat_ex: list, seeds: list[int], step: int):
        samples, texts, total, per_fn, finished = sample_and_score(
            self.engine, self.tokenizer, self.cfg, flat_ex, seeds, self.reward_fns, self.reward_weights,
            vision=self.vision)                                                                          # [P*G]
        if self.ranks.main:
            self._log_completions(step, flat_ex, texts, total)
        return samples, total, per_fn, finished, torch.ones(len(samples), dtype=torch.bool)

    def _episodes(self, flat_ex: list, seeds: list[int], step: int):
        """G multi-turn episodes per task against the environment; rewards come from the environment."""
        r, e = self.cfg.rollout, self.cfg.env
        kept = self.cfg.logging.save_transcripts if self.ranks.main else 0
        if kept:   # the kept episodes as objects of their own: a group's G episodes share one example
            flat_ex = [copy.copy(ex) for ex in flat_ex[:kept]] + flat_ex[kept:]
        keeper = ScreenKeeper(self.make_env, flat_ex[:kept]) if kept else None   # the kept episodes' screenshots
        with memstats.phase("rollout", "generate"):  # turns and the environment's rewards interleave
            # A group that lost an episode to a restarted service is sampled again whole (envs/groups.py).
            eps = run_groups(keeper.make_env if keeper else self.make_env, flat_ex, self.engine, self.tokenizer,
                             group_size=self.G, group_retries=e.group_retries, seeds=seeds,
                             max_turns=r.max_turns, max_new_tokens=r.max_new_tokens,
                             max_prompt_length=r.max_prompt_length, max_episode_tokens=self.cfg.episode_tokens(),
                             max_observation_tokens=e.max_observation_tokens,
                             processor=self.vision, max_images=r.max_images_per_episode,
                             as_ready=self.episodes_as_ready)
        if keeper is not None:
            records = [transcript_record(step + 1, ep) for ep in eps[:kept]]
            with open(self.transcripts_log, "a") as f:
                f.writelines(json.dumps(rec) + "\n" for rec in records)
            keeper.save(records, self.transcripts_log.parent / SCREENS)
        # One row per context the policy acted in (Episode.rows); "episode_tokens" is the episode's
        # policy tokens over all its rows, so loss_type grpo still weighs each episode as one sequence.
        samples = [{"input_ids": list(row.input_ids), "loss_mask": list(row.loss_mask), "episode": i,
                    "episode_tokens": ep.policy_tokens(), **({"images": list(row.images)} if row.images else {})}
                   for i, ep in enumerate(eps) for row in ep.rows()]
        total = torch.tensor([float(ep.reward) for ep in eps])                                        # [P*G]
        finished = torch.tensor([float(ep.done) for ep in eps])
        valid = torch.tensor([not ep.failed for ep in eps])
        return samples, total, {"env": total.clone()}, finished, valid

    @torch.no_grad()
    def _fill_logprobs(self, samples: list[dict]) -> None:
        """Reference log-probs (beta > 0) and behaviour log-probs (num_iterations > 1), no grad."""
        g, mb = self.cfg.grpo, self.cfg.train.micro_batch_size
        need_ref, need_old = g.beta > 0, g.num_iterations > 1
        # Sharded models' forwards are collectives: as many on every rank, though a rank's episodes may
        # train as more rows (a repeated chunk, `real` False, is scored and dropped).
        collective = frozen.is_spread(self.ref_model) or parallel.collective_forward(self.model)
        for chunk, real in frozen.even_chunks(samples, mb, self.ranks, collective):
            if need_ref:
                ref = self.ref_model if self.ref_model is not None else self.model
                with reference_context(self.model, self.is_peft and self.ref_model is None):
                    logp, mask, _ = self._logprobs(ref, chunk)
                if real:
                    store_rows(chunk, "ref_logp", logp, mask)
            if need_old:
                logp, mask, _ = self._logprobs(self.model, chunk)
                if real:
                    store_rows(chunk, "old_logp", logp, mask)

    def _logprobs(self, model, samples: list[dict], entropy: bool = False):
        return sequence_logprobs(model, samples, self.pad_id, self.device, self.cfg.rollout.temperature,
                                 self.cfg.train.logits_chunk_rows, entropy=entropy,
                                 inputs=image_inputs(samples, self.vision, self.device), head=self.head,
                                 packed=self.packed)

    def _log_completions(self, step: int, examples, texts, rewards) -> None:
        log_completions(self.completions_log, self.cfg.logging.save_completions, step, examples, texts, rewards)

    # ---- loss ----------------------------------------------------------------------------------
    def loss(self, model, micro: list[dict], totals: dict) -> tuple[torch.Tensor, dict]:
        g = self.cfg.grpo
        logp, mask, ent = self._logprobs(model, micro, entropy=True)            # [b, T-1] each
        old = scatter_values([s["old_logp"] for s in micro], mask) if "old_logp" in micro[0] else logp.detach()
        ref = scatter_values([s["ref_logp"] for s in micro], mask) if "ref_logp" in micro[0] else None
        # rollout.mode=async: a stale rollout's log-probs under the version that sampled it.
        behav = scatter_values([s["behav_logp"] for s in micro], mask) if "behav_logp" in micro[0] else None
        if behav is not None and "old_logp" not in micro[0] and g.num_iterations > 1:
            # The rollout's first step: these weights are its proximal policy (version r, async_rollout.py);
            # kept for its later steps' ratios instead of a separate no-grad pass when it was taken.
            store_rows(micro, "old_logp", logp.detach(), mask)
        adv = torch.tensor([s["advantage"] for s in micro], dtype=torch.float32, device=logp.device)  # [b]
        per_seq = None
        if any("episode_tokens" in s for s in micro):   # episodes: a sequence's tokens may span rows
            per_seq = torch.tensor([s.get("episode_tokens", policy_token_count(s)) for s in micro],
                                   dtype=torch.float32, device=logp.device)                          # [b]
        loss, m = grpo_loss(logp, old, ref, adv, mask.float(), loss_type=g.loss_type, eps_low=g.epsilon,
                            eps_high=g.epsilon_high or g.epsilon, beta=g.beta, kl_estimator=g.kl_estimator,
                            total_seqs=totals["total_seqs"], total_tokens=totals["total_tokens"],
                            max_len=totals["max_len"], importance=g.importance, seq_tokens=per_seq,
                            behav_logp=behav, off_policy=self.cfg.rollout.off_policy,
                            importance_cap=self.cfg.rollout.importance_cap)
        if behav is not None:   # extremes are not sums: kept here, reported by summarize
            self._iw_extremes += [float(m.pop("iw_max")), float(m.pop("iw_min"))]
        seq_tokens = sum(len(s["input_ids"]) for s in micro)
        return loss, {**{k: float(v) for k, v in m.items()}, "entropy_sum": float(ent[mask].sum()),
                      "entropy_tokens": float(mask.sum()), "seq_tokens": seq_tokens}

    def summarize(self, batch: StepBatch, sums: dict) -> dict:
        # Samples left out of the forward (zero advantage, see `_skips_zero_advantage`) are on-policy
        # with loss exactly 0: each of their tokens has ratio 1, is not clipped and has no KL term
        # (beta = 0), so they are added here and clip_frac / ratio / tokens are over every sample
        # (`total_tokens` counts the whole step's policy tokens; `sums` are already over all ranks).
        # The entropy needs their logits: it is the mean over the trained tokens only.
        skipped = 0.0
        if batch.totals.get("skipped"):
            skipped = max(batch.totals["total_tokens"] - sums.get("tokens", 0.0), 0.0)
        n = max(sums.get("tokens", 0.0) + skipped, 1.0)
        out = {"loss": sums.get("loss", 0.0), **batch.metrics, "clip_frac": sums.get("clip_frac_sum", 0.0) / n,
               "kl": sums.get("kl_sum", 0.0) / n, "ratio": (sums.get("ratio_sum", 0.0) + skipped) / n,
               "tokens": sums.get("tokens", 0.0) + skipped}
        if sums.get("entropy_tokens", 0.0) > 0:
            out["entropy"] = sums["entropy_sum"] / sums["entropy_tokens"]
        if self._iw_extremes:   # stale samples: their importance weights over the trained tokens
            t = max(sums.get("tokens", 0.0), 1.0)
            out.update(iw_mean=sums["iw_sum"] / t, iw_cut_frac=sums["iw_cut_sum"] / t,
                       iw_max=max(self._iw_extremes), iw_min=min(self._iw_extremes))
        msg = self.zero_adv_watch.update(self.step, out.get("zero_adv_frac", 0.0))
        if msg:
            self._notices.append(msg)
        return out

    def notices(self) -> list[str]:
        """Warnings for the user raised since the last call (the loop prints and logs them once)."""
        out, self._notices = self._notices, []
        return out

    def evaluate(self, model) -> dict:
        # rollout.engine=vllm under async: the worker samples with this engine, lent here between its rollouts.
        with (self.worker.borrowed_engine() if self.worker is not None else contextlib.nullcontext(False)) as lent, \
                current_engine(self.engine, self.model, self.tokenizer, self.device, self.cfg, sleep_after=not lent):
            if self.make_env is not None:
                return episode_eval(self.make_env, self.engine, self.tokenizer, self.task, self.cfg,
                                    judge_final=self.cfg.env.type == "tools")
            if self.vision is not None:  # prompts may carry images
                return image_task_accuracy(self.engine, self.tokenizer, self.vision, self.task, self.cfg.task.chat,
                                           rewards=(self.reward_fns, self.reward_weights))
            return task_accuracy(self.engine, self.tokenizer, self.task, self.cfg.task.chat,
                                 rewards=(self.reward_fns, self.reward_weights))

    def state_dict(self) -> dict:
        # Images as uint8 tensors: checkpoints are read weights-only (no PIL objects).
        state = {"buffer": buffer_images(self.buffer, to_tensors=True), "buffer_round": self.buffer_round}
        if self.cfg.rollout.mode == "async":   # the rollouts sampled ahead (train/async_rollout.py: Resume)
            first = self.buffer_round + 1
            queue = (self.worker.ahead(first, first + self.cfg.rollout.max_staleness) if self.worker is not None
                     else self._queued)
            state["queue"] = {r: buffer_images(b, to_tensors=True) for r, b in queue.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("world_changed"):
            # Another rank count: this rank's share of a half-used rollout was not saved. The next
            # step regenerates it from the current weights (documented: resume at rollout boundaries
            # with grpo.num_iterations > 1 to reproduce a run exactly across rank counts).
            self.buffer, self.buffer_round = None, -1
            return
        self.buffer, self.buffer_round = buffer_images(state.get("buffer"), to_tensors=False), state.get("buffer_round", -1)
        self._queued = {r: buffer_images(b, to_tensors=False) for r, b in (state.get("queue") or {}).items()}
