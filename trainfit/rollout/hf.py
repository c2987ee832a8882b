"""In-process generation with Hugging Face `generate`: batched, left-padded, KV-cached.

The engine returns token ids (what the trainer scores), text (what rewards read) and, when asked, its
log-probs. A completion ends at the first eos (kept, so the model learns to stop) or when a stop string
appears. It samples from the module the trainer updates, so `sync` has nothing to do.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from trainfit.config import RolloutConfig
from trainfit.rollout.base import Completion

__all__ = ["Completion", "HFEngine", "SeededGumbel"]


class SeededGumbel(LogitsProcessor):
    """Exact sampling as argmax(logits + Gumbel noise), the noise of row i drawn from its own seed.

    Each completion's sample then depends only on its seed and its own logits, not on which other
    rows share the batch: the same rollout on 1 or N ranks, with any generation batch size. Applied
    after temperature / top-k / top-p, so argmax samples from exactly the warped distribution.
    """

    def __init__(self, seeds: Sequence[int]):
        self.gens = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # [B, V]
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, dtype=torch.float64) for g in self.gens])
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))                    # [B, V]
        return scores.double() + gumbel.to(scores.device)


class LogprobRecorder(LogitsProcessor):
    """Records log softmax(raw logits / T) of each sampled token, one decoding step late.

    Placed first, it sees the model's raw logits. The token chosen at step t is only known at step
    t+1 (last column of `input_ids`), so one step's [B, V] log-probs are kept until then and the last
    step is settled by `finish` from the returned sequences: O(B x V) memory, not O(B x steps x V).
    """

    def __init__(self, temperature: float):
        self.t = temperature if temperature > 0 else 1.0
        self.prev: Optional[torch.Tensor] = None     # [B, V] log-probs of the previous step
        self.steps: list[torch.Tensor] = []          # per step: [B] log-prob of the chosen token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        self.prev = torch.log_softmax(scores.float() / self.t, dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:        # new_tokens [B, n] -> [B, n]
        if self.prev is not None and len(self.steps) < new_tokens.shape[1]:
            self.steps.append(self.prev.gather(1, new_tokens[:, len(self.steps):len(self.steps) + 1]).squeeze(1))
        self.prev = None
        return torch.stack(self.steps, dim=1).cpu()


class HFEngine:
    """Generation from the policy module the trainer holds (no second copy of the weights)."""

    name = "hf"
    shares_weights = True

    def __init__(self, model, tokenizer, cfg: RolloutConfig, stop: Sequence[str] = ()):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.stop = list(dict.fromkeys([*cfg.stop, *stop]))  # config stops first, task stops after
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id
        self.synced = False  # FSDP: keep decoding until every rank is done (forwards are collectives)

    # The trainer's module is the engine's: nothing to push, nothing to free between phases.
    def sync(self, model) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, greedy: bool = False, seeds: Optional[Sequence[int]] = None,
                 max_new_tokens: Optional[int] = None, batch_size: Optional[int] = None,
                 logprobs: bool = False, temperature: Optional[float] = None) -> list[Completion]:
        """Complete each prompt (token ids) once.

        With `seeds` (one per prompt) sampling is per-row seeded (see SeededGumbel); without, it
        follows the global torch RNG as transformers does. `temperature` overrides the config's.
        """
        bs = batch_size or self.cfg.batch_size or len(prompts)
        temp = self.cfg.temperature if temperature is None else temperature
        was_training = self.model.training
        self.model.eval()
        try:
            out: list[Completion] = []
            for i in range(0, len(prompts), bs):
                out.extend(self._generate_batch(prompts[i:i + bs], greedy or temp == 0,
                                                max_new_tokens or self.cfg.max_new_tokens,
                                                None if seeds is None else seeds[i:i + bs], logprobs, temp))
            return out
        finally:
            self.model.train(was_training)

    def _warpers(self, seeds: Sequence[int], temperature: float) -> list:
        c = self.cfg
        procs: list = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
        if c.top_k:
            procs.append(TopKLogitsWarper(c.top_k))
        if c.top_p < 1.0:
            procs.append(TopPLogitsWarper(c.top_p))
        return [*procs, SeededGumbel(seeds)]

    def _generate_batch(self, prompts: list[list[int]], greedy: bool, max_new: int,
                        seeds: Optional[Sequence[int]], want_logprobs: bool, temperature: float) -> list[Completion]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        # Left padding keeps every prompt's last token at the same column, so new tokens align.
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)       # [B, P]
        mask = torch.zeros((len(prompts), width), dtype=torch.long)                  # [B, P]
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p):] = 1
        recorder = LogprobRecorder(1.0 if greedy else temperature) if want_logprobs else None
        procs: list = [recorder] if recorder else []
        if not greedy:
            if seeds is None:  # unseeded: per-row seeds drawn from the global torch RNG
                seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
            # Sampling = argmax over warped logits + per-row Gumbel noise (exact; see SeededGumbel).
            procs += self._warpers(seeds, temperature)
        stop = dict(stop_strings=self.stop, tokenizer=self.tokenizer) if self.stop else {}
        seqs = self.model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
            eos_token_id=self.eos_id, pad_token_id=self.pad_id, use_cache=True, synced_gpus=self.synced,
            do_sample=False, logits_processor=LogitsProcessorList(procs), **stop,
        )
        new_t = seqs[:, width:]                                                      # [B, <=max_new]
        lp = recorder.finish(new_t).tolist() if recorder and new_t.shape[1] else None
        out = []
        for r, row in enumerate(new_t.tolist()):
            c = self._finish(row)
            if lp is not None:
                c.logprobs = lp[r][: len(c.token_ids)]
            elif recorder:
                c.logprobs = []
            out.append(c)
        return out

    def _finish(self, row: list[int]) -> Completion:
        if self.eos_id in row:
            ids = row[: row.index(self.eos_id) + 1]
            return Completion(ids, self.tokenizer.decode(ids, skip_special_tokens=True), True)
        # No eos: generation stopped on a stop string (rest is padding) or at the length limit.
        ids = list(row)
        while ids and ids[-1] == self.pad_id and self.pad_id != self.eos_id:
            ids.pop()
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stopped = any(s in text for s in self.stop)
        if stopped:
            ids, text = self._cut_at_stop(ids, text)
        return Completion(ids, text, stopped)

    def _cut_at_stop(self, ids: list[int], text: str) -> tuple[list[int], str]:
        """Keep tokens through the one that completes the first stop string."""
        for n in range(1, len(ids) + 1):
            t = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            if any(s in t for s in self.stop):
                return ids[:n], t
        return ids, text
