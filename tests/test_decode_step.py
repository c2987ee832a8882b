"""The static decode step (rollout/decode.py `decode_step`) runs without reading back to the host.

One step = the forward on the static cache + device-side seeded sampling + the sampled token's
log-prob + eos / stop bookkeeping, on preallocated buffers: the loop reads back only whether any row
is still live, once every SYNC_EVERY steps, and the outputs once at the end. It must return what the
dynamic loop (the reference path, tested against `generate` in test_decode_loop.py) returns, token
for token, with rows ending at different steps. CPU (`train.device=cpu`), preset:tiny.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from trainfit.config import ModelConfig, PeftConfig
from trainfit.models.policy import load_policy
from trainfit.rollout.decode import SYNC_EVERY, StaticDecoder, decode, seeded_pick
from trainfit.rollout.sampling import (
    _i64,
    _splitmix64,
    mixed_seeds,
    row_keys,
    row_step_keys,
    splitmix64_t,
)

CPU = torch.device("cpu")
PROMPTS = [[19, 13, 20, 31]] * 4 + [[5, 7]] * 4 + [[40, 41, 42, 43, 44, 45, 46]]
# Tensor methods that make the host wait for the device on a GPU.
SYNCS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(name="preset:tiny", seed=2), PeftConfig(), CPU)


@pytest.fixture(scope="module")
def lively():
    """preset:tiny with its matrices jittered: greedy decoding then varies instead of repeating one
    token, so an eos id can end rows at different steps."""
    lm = load_policy(ModelConfig(name="preset:tiny", seed=2), PeftConfig(), CPU)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lm.model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return lm


@contextlib.contextmanager
def counting_syncs(calls: list, inside: dict):
    """Record (method, inside a decode step?) for each sync-method call on a tensor."""
    saved = {m: getattr(torch.Tensor, m) for m in SYNCS}

    def wrap(name, fn):
        def counted(self, *a, **k):
            calls.append((name, inside["step"]))
            return fn(self, *a, **k)
        return counted

    try:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, wrap(m, fn))
        yield
    finally:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, fn)


def test_device_side_keys_equal_the_host_ones():
    r = random.Random(0)
    words = [r.getrandbits(64) for _ in range(4000)] + [0, 1, (1 << 64) - 1, 1 << 63, (1 << 63) - 1]
    got = splitmix64_t(torch.tensor([_i64(w) for w in words])).tolist()
    assert [g % (1 << 64) for g in got] == [_splitmix64(w) for w in words]
    seeds = [r.getrandbits(62) for _ in range(40)] + [0, 2**62 - 1]
    for step in (0, 1, 9, 255):
        assert row_keys(mixed_seeds(seeds), torch.tensor(step)).tolist() == row_step_keys(seeds, step)


@pytest.mark.parametrize("greedy", [True, False])
def test_static_loop_syncs_only_every_k_steps(policy, monkeypatch, greedy):
    """No sync inside a step; per call, one all-finished check per SYNC_EVERY steps plus a fixed few
    (the final reads): 24 more steps cost 24 / SYNC_EVERY more syncs, not one or more per step."""
    model, inside = policy.model, {"step": False}
    real_step = StaticDecoder.step

    def flagged(self, *a, **k):
        inside["step"] = True
        try:
            return real_step(self, *a, **k)
        finally:
            inside["step"] = False

    monkeypatch.setattr(StaticDecoder, "step", flagged)
    totals = {}
    for max_new in (9, 33):                       # rows never end (no eos): every step runs
        calls: list = []
        pick = seeded_pick([], list(range(len(PROMPTS))), greedy=greedy)
        dec = StaticDecoder(model)
        with counting_syncs(calls, inside):
            d = decode(model, PROMPTS, pad_id=0, eos_id=None, max_new=max_new, pick=pick, logprob_temperature=1.0,
                       static=dec)
        assert d.tokens.shape == (len(PROMPTS), max_new)
        assert not [c for c in calls if c[1]], "a decode step read a tensor back to the host"
        totals[max_new] = len(calls)
    assert totals[33] - totals[9] == (33 - 1) // SYNC_EVERY - (9 - 1) // SYNC_EVERY


def _ending_token(model, seeds, greedy: bool) -> int:
    """A token that the rows sample at different steps (so that, as eos, it ends them apart)."""
    pick = seeded_pick([], seeds, greedy=greedy)
    rows = decode(model, PROMPTS, pad_id=0, eos_id=None, max_new=20, pick=pick).tokens.tolist()
    firsts = {tok: {row.index(tok) for row in rows if tok in row} for row in rows for tok in row}
    return max(firsts, key=lambda tok: (len(firsts[tok]), sum(tok in row for row in rows)))


@pytest.mark.parametrize("greedy", [True, False])
def test_static_equals_dynamic_with_eos_at_different_steps(lively, greedy):
    """Rows end on eos at different steps, the last one off a SYNC_EVERY boundary: the static loop's
    tokens equal the dynamic loop's and its output is as wide as the last row's completion."""
    model, seeds = lively.model, list(range(50, 59))
    eos = _ending_token(model, seeds, greedy)
    kw = dict(pad_id=0, eos_id=eos, max_new=20, logprob_temperature=1.0)
    a = decode(model, PROMPTS, pick=seeded_pick([], seeds, greedy), static=StaticDecoder(model), **kw)
    b = decode(model, PROMPTS, pick=seeded_pick([], seeds, greedy), **kw)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    ends = {row.index(eos) for row in a.tokens.tolist() if eos in row}
    assert len(ends) > 1 and a.tokens.shape[1] % SYNC_EVERY != 0              # rows ended apart, off a check


def test_static_rows_are_independent_of_the_batch(policy):
    """Seeded on the static path: a row's completion alone equals the same row in a batch (bucketed,
    spare rows included)."""
    model, eos = policy.model, policy.tokenizer.eos_token_id
    dec = StaticDecoder(model, bucketed=True)
    kw = dict(pad_id=0, eos_id=eos, max_new=10, logprob_temperature=1.0, static=dec)
    seeds = list(range(200, 209))
    together = decode(model, PROMPTS, pick=seeded_pick([], seeds, False), **kw)
    for i, (p, s) in enumerate(zip(PROMPTS, seeds)):
        alone = decode(model, [p], pick=seeded_pick([], [s], False), **kw)
        n = alone.tokens.shape[1]
        assert alone.tokens[0].tolist() == together.tokens[i, :n].tolist()
        assert torch.allclose(alone.logprobs[0], together.logprobs[i, :n], atol=1e-5, rtol=0)


def test_static_path_needs_the_seeded_pick(policy):
    with pytest.raises(TypeError, match="seeded_pick"):
        decode(policy.model, PROMPTS[:2], pad_id=0, eos_id=None, max_new=3, static=StaticDecoder(policy.model),
               pick=lambda rows, seq, scores, step: scores.argmax(-1))


@pytest.mark.parametrize("greedy", [True, False])
def test_static_trims_the_steps_after_the_last_row_ended(lively, greedy):
    """Stop tokens (a `stopping` on the last id) end every row before max_new, at different steps:
    the static loop runs on to its next all-finished check, yet returns exactly the dynamic loop's
    tokens and log-probs, as wide as the longest completion."""
    model, seeds = lively.model, list(range(70, 79))
    free = decode(model, PROMPTS, pad_id=0, eos_id=None, max_new=24, pick=seeded_pick([], seeds, greedy)).tokens
    # One token per distinct row, taken at a different step of each: the rows end at or before them.
    rows = list(dict.fromkeys(tuple(r) for r in free.tolist()))
    stop = torch.tensor(sorted({r[min(3 + 4 * i, 22)] for i, r in enumerate(rows)}))

    def stopping(seq):
        return torch.isin(seq[:, -1], stop)

    kw = dict(pad_id=0, eos_id=None, max_new=24, logprob_temperature=1.0, stopping=stopping)
    a = decode(model, PROMPTS, pick=seeded_pick([], seeds, greedy), static=StaticDecoder(model), **kw)
    b = decode(model, PROMPTS, pick=seeded_pick([], seeds, greedy), **kw)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    ends = [next(t for t, tok in enumerate(row) if tok in stop.tolist()) for row in free.tolist()]
    assert len(set(ends)) > 1 and a.tokens.shape[1] == max(ends) + 1 < 24     # all ended, apart, early
    assert a.tokens.shape[1] % SYNC_EVERY != 0                               # and steps ran after that


def test_greedy_sampled_and_logprob_calls_share_one_step_spec(policy, monkeypatch):
    """What a captured graph is specialised on (StepSpec) is the same for greedy and sampled calls,
    with or without log-probs, at temperature 1: evaluation replays the rollouts' graph."""
    specs = []
    real_step = StaticDecoder.step

    def recording(self, b, cache, spec):
        specs.append(spec)
        return real_step(self, b, cache, spec)

    monkeypatch.setattr(StaticDecoder, "step", recording)
    dec, eos = StaticDecoder(policy.model, bucketed=True), policy.tokenizer.eos_token_id
    for greedy, lp in ((True, 1.0), (False, None), (False, 0.7)):
        decode(policy.model, PROMPTS, pad_id=0, eos_id=eos, max_new=4, pick=seeded_pick([], list(range(9)), greedy),
               logprob_temperature=lp, static=dec)
    assert len(specs) == 9 and len(set(specs)) == 1
