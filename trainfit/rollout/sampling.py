"""Seeded sampling shared by the engines: a row's sample depends only on its seed and step (splitmix64 keys,
Gumbel noise), and the log-probs of the sampled tokens recorded as the model gave them."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from transformers import LogitsProcessor

_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF
# A warper maps (input_ids [b, T], scores [b, V]) to warped scores [b, V] (transformers' LogitsProcessor).
Warper = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _splitmix64(z: int) -> int:
    """SplitMix64's output function on a Python int (64-bit): decorrelates nearby seeds and steps."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective hash of 32-bit values held in int64 (xorshift-multiply; constants from Wellons'
    hash-prospector). Both multipliers are below 2^31 and x below 2^32, so no product overflows."""
    x = x ^ (x >> 15)
    x.mul_(0x2C1B3C6D).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 12)
    x.mul_(0x297A2D39).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def row_step_keys(seeds: Sequence[int], step: int, _mixed: Optional[Sequence[int]] = None) -> list[int]:
    """One 32-bit key per row for decoding step `step`: a function of (the row's seed, step) only.
    `_mixed` = [_splitmix64(seed)] precomputed (SeededGumbel keeps them for the whole generation)."""
    mixed = _mixed if _mixed is not None else [_splitmix64(int(s) & _M64) for s in seeds]
    return [_splitmix64((m + step) & _M64) & _M32 for m in mixed]


def _i64(word: int) -> int:
    """A 64-bit word as the int64 holding its bits (two's complement)."""
    return word - (1 << 64) if word >= 1 << 63 else word


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of 64-bit words held in int64 (`>>` on int64 copies the sign bit)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64_t(z: torch.Tensor) -> torch.Tensor:
    """`_splitmix64` on a tensor of 64-bit words held in int64: int64 `+` and `*` wrap modulo 2^64
    as the Python version's masks do, and the shifts are logical. Runs on the device, so a decode
    step computes its rows' keys without reading anything back to the host."""
    z = z + _i64(0x9E3779B97F4A7C15)
    z = (z ^ _srl(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _srl(z, 31)


def mixed_seeds(seeds: Sequence[int], device=None) -> torch.Tensor:
    """int64 [B]: _splitmix64 of each seed, the per-row constant of `row_keys`."""
    return torch.tensor([_i64(_splitmix64(int(s) & _M64)) for s in seeds], dtype=torch.int64, device=device)


def row_keys(mixed: torch.Tensor, step) -> torch.Tensor:
    """`row_step_keys` on the device: int64 [B] keys from `mixed_seeds` [B] and the step (an int or a
    0-d int64 tensor, so a captured step graph serves every step)."""
    return splitmix64_t(mixed + step) & _M32


_VOCAB_HASH: dict = {}


def vocab_hash(vocab: int, device) -> torch.Tensor:
    """int64 [vocab]: hash32 of each token id (computed once per vocabulary size and device)."""
    hv = _VOCAB_HASH.get((vocab, device))
    if hv is None:
        hv = _VOCAB_HASH.setdefault((vocab, device), _hash32(torch.arange(vocab, dtype=torch.int64, device=device)))
    return hv


def gumbel_noise(keys: Sequence[int], vocab: int, device) -> torch.Tensor:
    """Standard Gumbel noise `[B, vocab]` float32, entry (i, v) a hash of (keys[i], v): counter-based,
    so a row's noise does not depend on the other rows or on how many there are."""
    k = torch.tensor(list(keys), dtype=torch.int64, device=device)                      # [B]
    return gumbel_from_keys(k, vocab_hash(vocab, device))


def gumbel_from_keys(keys: torch.Tensor, hv: torch.Tensor) -> torch.Tensor:
    """`gumbel_noise` from int64 keys [B] on the device and `vocab_hash` hv [V].

    u = (top 23 bits of hash32(hash32(v) xor key) + 0.5) / 2^23 lies in [2^-24, 1 - 2^-24] exactly
    (never 0 or 1), and -log(-log u) is Gumbel(0, 1) up to that resolution (its tails are cut at
    about -2.8 and 16.6, each with probability below 1e-7).
    """
    x = _hash32(hv ^ keys[:, None])                                                       # [B, V]
    u = (x >> 9).to(torch.float32).add_(0.5).mul_(2.0 ** -23)
    return u.log_().neg_().log_().neg_()


class SeededGumbel(LogitsProcessor):
    """Exact sampling as argmax(logits + Gumbel noise), the noise of row i drawn from its own seed.

    The noise of row i at decoding step t is `gumbel_noise(key(seed_i, t))`: each completion's sample
    depends only on its seed and its own logits, not on which other rows share the batch, so the same
    rollout comes out on 1 or N ranks and with any generation batch size. Applied after temperature /
    top-k / top-p, so argmax samples from exactly the warped distribution. One vectorised float32
    pass per step (no per-row generator, no float64).
    """

    def __init__(self, seeds: Sequence[int]):
        self.seeds = [int(s) for s in seeds]
        self.mixed = [_splitmix64(s & _M64) for s in self.seeds]
        self.step = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # [B, V]
        keys = row_step_keys(self.seeds, self.step, self.mixed)
        self.step += 1
        noise = gumbel_noise(keys, scores.shape[-1], scores.device)                       # [B, V]
        return noise.add_(scores.float())


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


class SeededPick:
    """`pick` for `decode`: argmax of the scores (greedy), or of the warped scores plus each row's
    own seeded Gumbel noise (exact sampling from the warped distribution; see sampling.SeededGumbel).
    The static path reads `warpers`, `seeds` and `greedy` and samples on the device (sample_step)."""

    def __init__(self, warpers: Sequence[Warper], seeds: Sequence[int], greedy: bool):
        self.warpers, self.seeds, self.greedy = tuple(warpers), [int(s) for s in seeds], greedy
        self.mixed = [_splitmix64(s & _M64) for s in self.seeds] if not greedy else []

    def __call__(self, rows: torch.Tensor, seq: torch.Tensor, scores: torch.Tensor, step: int) -> torch.Tensor:
        if self.greedy:
            return scores.argmax(-1)
        for w in self.warpers:
            scores = w(seq, scores)
        r = rows.tolist()
        keys = row_step_keys([self.seeds[i] for i in r], step, [self.mixed[i] for i in r])
        return gumbel_noise(keys, scores.shape[-1], scores.device).add_(scores).argmax(-1)


def seeded_pick(warpers: Sequence[Warper], seeds: Sequence[int], greedy: bool) -> SeededPick:
    return SeededPick(warpers, seeds, greedy)
