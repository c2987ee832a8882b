"""The GRPO step's speed-ups change no math.

- The LM head applied only at policy positions, log-probs and entropy chunk by chunk
  (`sequence_logprobs`), give the loss, gradient and logged entropy of the straightforward
  computation over full `[b, T, V]` logits (fp64, full and LoRA models, single-turn and multi-turn
  masks with gaps, temperatures, chunk sizes, every loss type, with and without a KL term).
- Leaving zero-advantage samples out of the step (beta = 0, on-policy) gives the same parameter
  update, including a step where every sample is left out (AdamW still moves on its momentum).
- Generation with LoRA merged into temporary weights gives the unmerged model's tokens and log-probs
  and puts the base weights back bit for bit.
- SFT's LM head at the labelled positions only (`label_logprobs`) gives `sft_loss`'s loss, gradient
  and eval loss over full logits (prompt-masked and padded rows, chunked or not, full and LoRA).
- The fused AdamW kernel trainfit builds gives the for-loop AdamW's parameters (fp32, several steps,
  weight decay, gradient clipping between).
(trainfit's decoding loop against `generate`: tests/test_decode_loop.py.)
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from rich.console import Console

from conftest import tiny_config
from trainfit.algos import entropy_sum, grpo_loss, sft_loss, shifted_logprobs, token_entropy, token_logprobs_rows
from trainfit.config import ModelConfig, PeftConfig, RolloutConfig
from trainfit.models.policy import load_policy, trainable_parameters
from trainfit.rollout.hf import HFEngine, merged_lora
from trainfit.train.faults import Faults
from trainfit.train.grpo import GRPOStage, _drop_zero_advantage, _pad_rows
from trainfit.models.logprobs import scatter_values as _scatter
from trainfit.data.text import collate
from trainfit.train.evaluate import eval_loss
from trainfit.models.logprobs import batch_tensors, policy_token_count, sequence_logprobs, single_turn_sample
from trainfit.config import TrainConfig
from trainfit.train.loop import accumulate, fused_adamw_applies, make_optimizer, train_stage
from trainfit.train.stage import BaseStage, StepBatch
from trainfit.train.report import read_metrics
from trainfit.train.run import build_stage

CPU = torch.device("cpu")
QUIET = Console(file=open("/dev/null", "w"))


def _randomise_lora(model, seed: int = 0) -> None:
    """LoRA starts as the identity (B = 0); give B values so the adapters change the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)


def _samples(seed: int = 0) -> list[dict]:
    """Single-turn samples of different lengths and multi-turn ones with gaps in the mask."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, 500, (n,), generator=g).tolist()

    out = [single_turn_sample(ids(5), ids(7)), single_turn_sample(ids(9), ids(2)),
           single_turn_sample(ids(3), ids(1))]
    # prompt, policy turn, environment tokens, policy turn, environment tokens, policy turn
    mask = [0] * 4 + [1] * 3 + [0] * 2 + [1] * 4 + [0] * 3 + [1] * 2
    out.append({"input_ids": ids(len(mask)), "loss_mask": mask})
    mask = [0, 0, 1, 0, 1, 1, 0, 0, 0, 1]
    out.append({"input_ids": ids(len(mask)), "loss_mask": mask})
    return out


def _grpo_stage(tmp_path, **overrides):
    cfg = tiny_config(tmp_path, "grpo", **{"task.num_eval": 0, **overrides})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    loaded.model.double()
    _randomise_lora(loaded.model)
    return cfg, loaded, stage


def _reference_loss(stage: GRPOStage, model, micro: list[dict], totals: dict):
    """GRPOStage.loss as it was: full [b, T, V] logits, `shifted_logprobs`, entropy over the mask."""
    g = stage.cfg.grpo
    ids, attn, mask = batch_tensors(micro, stage.pad_id, CPU)
    logits = model(input_ids=ids, attention_mask=attn).logits                          # [b, T, V]
    logp = shifted_logprobs(logits, ids, stage.cfg.rollout.temperature, 0)            # [b, T-1]
    ref = _scatter([s["ref_logp"] for s in micro], mask).to(logp.dtype) if "ref_logp" in micro[0] else None
    adv = torch.tensor([s["advantage"] for s in micro], dtype=logp.dtype)
    loss, m = grpo_loss(logp, logp.detach(), ref, adv, mask.to(logp.dtype), loss_type=g.loss_type,
                        eps_low=g.epsilon, eps_high=g.epsilon_high or g.epsilon, beta=g.beta,
                        kl_estimator=g.kl_estimator, total_seqs=totals["total_seqs"],
                        total_tokens=totals["total_tokens"], max_len=totals["max_len"])
    ent = entropy_sum(logits.detach()[:, :-1][mask])
    return loss, {k: float(v) for k, v in m.items()}, float(ent)


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in trainable_parameters(model)])


@pytest.mark.parametrize("peft,loss_type,beta,temperature,chunk", [
    ("none", "dapo", 0.0, 1.0, 0),
    ("lora", "grpo", 0.1, 0.7, 5),
    ("lora", "dr_grpo", 0.0, 1.0, 3),
    ("none", "dapo", 0.1, 0.7, 0),
])
def test_policy_position_head_gives_the_full_logits_loss_and_gradient(tmp_path, peft, loss_type, beta,
                                                                     temperature, chunk):
    cfg, loaded, stage = _grpo_stage(tmp_path, **{"peft.method": peft, "grpo.loss_type": loss_type,
                                                  "grpo.beta": beta, "rollout.temperature": temperature,
                                                  "train.logits_chunk_rows": chunk})
    model = loaded.model
    micro = _samples()
    g = torch.Generator().manual_seed(1)
    for i, s in enumerate(micro):
        s["advantage"] = [1.5, -0.5, 0.0, -1.0, 0.25][i]
        if beta:
            s["ref_logp"] = -torch.rand(policy_token_count(s), generator=g, dtype=torch.float64) * 3
    totals = {"total_seqs": 8, "total_tokens": 40.0, "max_len": 12}

    want_loss, want_m, want_ent = _reference_loss(stage, model, micro, totals)
    want_loss.backward()
    want_g = _grads(model)
    model.zero_grad(set_to_none=True)

    loss, m = stage.loss(model, micro, totals)
    loss.backward()
    got_g = _grads(model)
    assert want_g.norm() > 0
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-13)
    for k in ("clip_frac_sum", "kl_sum", "ratio_sum", "tokens"):
        assert m[k] == pytest.approx(want_m[k], rel=1e-12, abs=1e-12), k
    assert m["entropy_sum"] == pytest.approx(want_ent, rel=1e-12)
    assert m["entropy_tokens"] == want_m["tokens"] == 7 + 2 + 1 + 9 + 4


def test_sequence_logprobs_fp32_and_old_frame(tmp_path):
    # fp32, as trained: the selected-rows values equal the full-logits ones to fp32 rounding, in the
    # same [b, T-1] frame (zeros off the mask), and the entropy is that of the untempered logits.
    lm = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(method="lora", r=4), CPU, seed=0)
    _randomise_lora(lm.model)
    samples = _samples(3)
    ids, attn, mask = batch_tensors(samples, 0, CPU)
    with torch.no_grad():
        logits = lm.model(input_ids=ids, attention_mask=attn).logits
        for temp in (1.0, 0.6):
            logp, m, ent = sequence_logprobs(lm.model, samples, 0, CPU, temp, chunk_size=4, entropy=True)
            assert torch.equal(m, mask)
            want = shifted_logprobs(logits, ids, temp)
            torch.testing.assert_close(logp[mask], want[mask], rtol=1e-5, atol=1e-5)
            assert (logp[~mask] == 0).all() and (ent[~mask] == 0).all()
            torch.testing.assert_close(ent[mask], token_entropy(logits[:, :-1][mask]), rtol=1e-5, atol=1e-5)
            assert sequence_logprobs(lm.model, samples, 0, CPU, temp)[2] is None  # entropy only when asked


def test_token_logprobs_rows_matches_a_loop():
    # Row r: log softmax(x_r / T)[t_r]; entropy of softmax(x_r) (untempered); a -inf logit is fine.
    torch.manual_seed(4)
    x = torch.randn(7, 11, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (7,))
    with torch.no_grad():
        x[2, 3] = float("-inf")
    t[2] = 4
    for temp, chunk in ((1.0, 0), (0.7, 3), (1.3, 1)):
        logp, ent = token_logprobs_rows(x, t, temp, chunk, entropy=True)
        want = torch.stack([torch.log_softmax(x[r] / temp, -1)[t[r]] for r in range(7)])
        torch.testing.assert_close(logp, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ent, token_entropy(x.detach()), rtol=1e-12, atol=1e-12)
        w = torch.randn(7, dtype=torch.float64)
        (gx,) = torch.autograd.grad((logp * w).sum(), x)
        (gw,) = torch.autograd.grad((want * w).sum(), x)
        torch.testing.assert_close(gx, gw, rtol=1e-12, atol=1e-12)
    empty, e = token_logprobs_rows(x[:0], t[:0], 1.0, 0, entropy=True)
    assert empty.shape == (0,) and e.shape == (0,)


def _batch(samples: list[dict], advantages: list[float], max_len: int = 12) -> StepBatch:
    for s, a in zip(samples, advantages):
        s["advantage"] = a
    totals = {"total_seqs": len(samples), "total_tokens": float(sum(policy_token_count(s) for s in samples)),
              "max_len": max_len}
    return StepBatch(samples=samples, totals=totals, metrics={"reward": 0.5})


def _skipped(batch: StepBatch) -> StepBatch:
    keep = sum(1 for s in batch.samples if s["advantage"] != 0.0)
    return StepBatch(samples=_drop_zero_advantage(batch.samples, keep), totals={**batch.totals, "skipped": 1.0},
                     metrics=dict(batch.metrics))


@pytest.mark.parametrize("loss_type,peft", [("dapo", "lora"), ("grpo", "none"), ("dr_grpo", "lora")])
def test_zero_advantage_skip_gives_the_same_update(tmp_path, loss_type, peft):
    cfg, loaded, stage = _grpo_stage(tmp_path, **{"peft.method": peft, "grpo.loss_type": loss_type})
    assert stage._skips_zero_advantage()
    samples = (_samples(5) + _samples(6))[:8]
    # group 1 (4 samples) has signal, one member exactly at the mean; group 2 is all equal: all 0
    full = _batch(samples, [1.2, -0.7, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0])
    skipped = _skipped(copy.deepcopy(full))
    assert len(skipped.samples) == 3

    results = []
    for batch in (full, skipped):
        model = copy.deepcopy(loaded.model)
        params = trainable_parameters(model)
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        sums = accumulate(model, batch, 2, stage.loss)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        results.append((torch.cat([p.detach().flatten() for p in params]), stage.summarize(batch, sums)))
    (p_full, m_full), (p_skip, m_skip) = results
    before = torch.cat([p.detach().flatten() for p in trainable_parameters(loaded.model)])
    assert not torch.equal(p_full, before)
    torch.testing.assert_close(p_skip, p_full, rtol=1e-12, atol=1e-14)
    for k in ("loss", "clip_frac", "kl", "ratio", "tokens", "reward"):
        assert m_skip[k] == pytest.approx(m_full[k], rel=1e-12, abs=1e-14), k
    assert m_full["ratio"] == 1.0 and m_full["tokens"] == full.totals["total_tokens"]


class _Replay(BaseStage):
    """A stage that replays fixed step batches through GRPOStage's loss (for the optimizer loop)."""

    def __init__(self, inner: GRPOStage, batches: list[StepBatch]):
        self.inner, self.batches = inner, batches

    def prepare(self, step):
        return self.batches[step]

    def loss(self, model, micro, totals):
        return self.inner.loss(model, micro, totals)

    def summarize(self, batch, sums):
        return self.inner.summarize(batch, sums)

    def evaluate(self, model):
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_step_with_every_sample_skipped_moves_like_zero_gradients(tmp_path):
    # Step 2 has zero advantages only. Unskipped, its backward gives exact zero gradients and AdamW
    # still moves the weights on its momentum (and weight decay); skipped, no backward runs at all,
    # and the loop must step on zero gradients to end in the same place.
    cfg, loaded, stage = _grpo_stage(tmp_path, **{"peft.method": "lora", "train.max_steps": 2,
                                                  "train.weight_decay": 0.05, "train.lr": 1e-2})
    first = _batch(_samples(7)[:4] + _samples(8)[:4], [1.0, -1.0, 0.5, -0.5, 0.3, -0.3, 0.0, 0.0])
    zero = _batch(_samples(9)[:4] + _samples(10)[:4], [0.0] * 8)
    runs = {}
    for name, batches in {"full": [first, zero], "skipped": [first, _skipped(copy.deepcopy(zero))],
                          "one_step": [first]}.items():
        assert name != "skipped" or batches[1].samples == []
        run_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": len(batches)})})
        lm = dataclasses.replace(loaded, model=copy.deepcopy(loaded.model))
        d = tmp_path / name
        train_stage(run_cfg, lm, _Replay(stage, batches), d, resume=False, console=QUIET, faults=Faults(),
                    save_final=lambda p, **k: p)
        runs[name] = (torch.cat([p.detach().flatten() for p in trainable_parameters(lm.model)]),
                      [m for m in read_metrics(d / "metrics.jsonl") if m["kind"] == "train"])
    assert not torch.allclose(runs["full"][0], runs["one_step"][0])       # step 2 did move the weights
    torch.testing.assert_close(runs["skipped"][0], runs["full"][0], rtol=1e-12, atol=1e-14)
    full2, skip2 = runs["full"][1][1], runs["skipped"][1][1]
    for k in ("loss", "ratio", "clip_frac", "tokens", "grad_norm"):
        assert skip2[k] == pytest.approx(full2[k], abs=1e-12), k
    assert skip2["loss"] == 0.0 and skip2["ratio"] == 1.0 and "entropy" not in skip2


def _half_zero_reward(prompts, completions, **fields):
    # Group-major: the first half of the completions (the first group of each rank's pair) gets a
    # length reward, the second half 0 everywhere, so its advantages are exactly 0.
    n = len(completions)
    return [float(len(c)) if i < n // 2 else 0.0 for i, c in enumerate(completions)]


def test_grpo_run_skipping_zero_advantage_groups_matches_the_unskipped_run(tmp_path, monkeypatch):
    def run(name, skip):
        cfg = tiny_config(tmp_path, "grpo", **{"task.num_eval": 0, "train.max_steps": 3, "train.lr": 1e-2,
                                               "train.micro_batch_size": 2, "rollout.max_new_tokens": 5})
        loaded, stage, _ = build_stage(cfg, tmp_path / name)
        stage.reward_fns, stage.reward_weights = [("half", _half_zero_reward)], [1.0]
        if not skip:
            monkeypatch.setattr(stage, "_skips_zero_advantage", lambda: False)
        train_stage(cfg, loaded, stage, tmp_path / name, resume=False, console=QUIET, faults=Faults(),
                    save_final=lambda p, **k: p)
        params = torch.cat([p.detach().flatten() for p in loaded.model.parameters()])
        return params, [m for m in read_metrics(tmp_path / name / "metrics.jsonl") if m["kind"] == "train"]

    p_skip, m_skip = run("skip", True)
    p_full, m_full = run("full", False)
    assert all(m["skipped_frac"] == 0.5 for m in m_skip) and all("skipped_frac" not in m for m in m_full)
    assert ((p_skip - p_full).norm() / p_full.norm()) < 1e-6
    for a, b in zip(m_skip, m_full):
        for k in ("reward", "completion_len", "ratio", "clip_frac", "tokens"):
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), k
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)


def test_drop_zero_advantage_keeps_order_and_tops_up():
    s = [{"advantage": a, "i": i} for i, a in enumerate([0.0, 1.0, 0.0, -1.0, 0.0])]
    assert [x["i"] for x in _drop_zero_advantage(s, 2)] == [1, 3]
    assert [x["i"] for x in _drop_zero_advantage(s, 4)] == [0, 1, 2, 3]   # equal counts across ranks
    assert _drop_zero_advantage([{"advantage": 0.0}], 0) == []


def test_pad_rows_adds_rows_that_train_nothing():
    """A rank with fewer rows than another (its episodes split less by screenshot drops) is topped up
    with rows whose loss mask is all 0, and so their loss, gradient and metrics are exactly 0."""
    rows = [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "advantage": 1.5, "episode": 0,
             "ref_logp": torch.tensor([-0.5, -0.25])}]
    padded = _pad_rows(rows, 3)
    assert padded[0] is rows[0] and len(padded) == 3 and _pad_rows(rows, 1) == rows
    for pad in padded[1:]:
        assert pad["input_ids"] == [1, 2, 3, 4] and pad["loss_mask"] == [0, 0, 0, 0] and pad["advantage"] == 0.0
        assert pad["ref_logp"].numel() == 0        # what store_rows keeps for a row with no mask token
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5]], requires_grad=True)   # [2 rows, T-1]
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])                             # the second a pad
    loss, m = grpo_loss(logp, logp.detach(), None, torch.tensor([1.5, 0.0]), mask, loss_type="grpo",
                        eps_low=0.2, eps_high=0.2, beta=0.0, kl_estimator="k3", total_seqs=1)
    loss.backward()
    assert logp.grad[1].abs().sum() == 0 and m["tokens"] == 2


# ---- LoRA merged for generation -------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_policy():
    lm = load_policy(ModelConfig(name="preset:tiny", seed=2), PeftConfig(method="lora", r=4), CPU, seed=0)
    _randomise_lora(lm.model, seed=3)
    return lm


def _base_weights(model):
    from peft.tuners.lora.layer import LoraLayer

    return {n: m.get_base_layer().weight for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def test_merged_generation_equals_unmerged_and_restores_base_bitwise(lora_policy, monkeypatch):
    model, tok = lora_policy.model, lora_policy.tokenizer
    before = _base_weights(model)
    copies = {n: w.detach().clone() for n, w in before.items()}
    prompts = [[19, 13, 20], [5, 6, 7, 8, 9], [30]]
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    want_logits = model(input_ids=ids).logits
    with merged_lora(model) as merged:
        assert merged
        torch.testing.assert_close(model(input_ids=ids).logits, want_logits, rtol=1e-5, atol=1e-5)
    cfg = RolloutConfig(max_new_tokens=6, temperature=0.8)
    with HFEngine(model, tok, cfg)._merged(decode_steps=6) as merged:
        assert not merged                               # a short call is not worth a merge
    monkeypatch.setattr(HFEngine, "MERGE_MIN_DECODE_STEPS", 1)   # merge these short test calls
    plain = HFEngine(model, tok, cfg.model_copy(update={"merge_lora": "never"}))  # the reference: LoRA as it is
    with plain._merged(decode_steps=6) as merged:
        assert not merged
    with HFEngine(model, tok, cfg.model_copy(update={"merge_lora": "always"}))._merged(decode_steps=1) as merged:
        assert merged                                   # "always" merges whatever the length
    want = plain.generate(prompts, seeds=[1, 2, 3], logprobs=True)
    want_greedy = plain.generate(prompts, greedy=True)
    eng = HFEngine(model, tok, cfg)
    with eng._merged(decode_steps=6) as merged:
        assert merged                                   # on CPU the engine merges by default
    out = eng.generate(prompts, seeds=[1, 2, 3], logprobs=True)
    greedy = eng.generate(prompts, greedy=True)
    assert [c.token_ids for c in out] == [c.token_ids for c in want]
    assert [c.token_ids for c in greedy] == [c.token_ids for c in want_greedy]
    for a, b in zip(out, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)
    # The trainer's log-probs of the merged engine's samples (the sync check's comparison).
    samples = [single_turn_sample(p, o.token_ids) for p, o in zip(prompts, out)]
    logp, mask, _ = sequence_logprobs(model, samples, 0, CPU, 0.8)
    for i, o in enumerate(out):
        torch.testing.assert_close(torch.tensor(o.logprobs), logp[i][mask[i]], rtol=1e-5, atol=1e-5)
    after = _base_weights(model)
    for n in before:
        assert after[n] is before[n] and torch.equal(after[n], copies[n]), n  # same object, same bits
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_merge_restores_on_error_and_skips_unmergeable(lora_policy):
    model = lora_policy.model
    before = _base_weights(model)
    with pytest.raises(RuntimeError, match="boom"):
        with merged_lora(model):
            raise RuntimeError("boom")
    assert all(_base_weights(model)[n] is w for n, w in before.items())
    dora = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(method="dora", r=4), CPU, seed=0)
    with merged_lora(dora.model) as merged:
        assert not merged                                # DoRA is not merged this way: used as it is
    plain = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), CPU, seed=0)
    with merged_lora(plain.model) as merged:
        assert not merged
    with lora_policy.model.disable_adapter():           # adapters off (e.g. a reference pass)
        with merged_lora(model) as merged:
            assert not merged


def test_cpu_heap_limit_is_process_wide_opt_out_and_lifted_for_decoding(monkeypatch):
    import sys

    from trainfit.core import heap

    monkeypatch.setattr(heap, "_HEAP_LIMIT", None)
    with heap.cpu_heap_for_decoding():                  # nothing set: a no-op
        assert heap._HEAP_LIMIT is None
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert not heap.limit_cpu_heap_growth()             # the user's own malloc setting wins
    assert heap._HEAP_LIMIT is None
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    if not sys.platform.startswith("linux") or heap._libc() is None:
        pytest.skip("glibc only")
    assert heap.limit_cpu_heap_growth(1 << 20) and heap._HEAP_LIMIT == 1 << 20
    with heap.cpu_heap_for_decoding():
        x = torch.empty(4 << 20, dtype=torch.uint8)    # from the heap while decoding
        del x
    assert heap._HEAP_LIMIT == 1 << 20


def test_policy_logits_fallbacks_give_the_same_rows(monkeypatch):
    # transformers < 5 (1-D positions in `logits_to_keep`) and a model without `logits_to_keep`
    # (full logits, rows selected after) give the rows of the boolean-mask path.
    import trainfit.models.logprobs as lp

    lm = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), CPU, seed=0)
    model = lm.model.double()
    samples = _samples(11)
    ids, attn, mask = batch_tensors(samples, 0, CPU)
    keep = torch.nn.functional.pad(mask, (0, 1))
    with torch.no_grad():
        want = lp.policy_logits(model, ids, attn, keep)
        assert want.shape == (int(mask.sum()), model.config.vocab_size)
        monkeypatch.setattr(lp, "_BOOL_KEEP", False)
        torch.testing.assert_close(lp.policy_logits(model, ids, attn, keep), want, rtol=1e-12, atol=1e-12)

        class NoKeep(torch.nn.Module):                    # a causal LM whose forward has no logits_to_keep
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, attention_mask=None):
                return self.inner(input_ids=input_ids, attention_mask=attention_mask)

        torch.testing.assert_close(lp.policy_logits(NoKeep(model), ids, attn, keep), want, rtol=1e-12, atol=1e-12)
    # A micro-batch without any policy token: zero log-probs, and backward still runs.
    empty = [{"input_ids": [5, 6, 7], "loss_mask": [0, 0, 0]}]
    logp, m, ent = sequence_logprobs(model, empty, 0, CPU, 1.0, entropy=True)
    assert not m.any() and (logp == 0).all() and (ent == 0).all()
    logp.sum().backward()
    with pytest.raises(ValueError, match="one per token"):
        batch_tensors([{"input_ids": [1, 2], "loss_mask": [1]}], 0, CPU)


def test_fused_adamw_updates_like_the_for_loop_adamw():
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (7, 5, 3)]
    start = [torch.randn(s) for s in shapes]
    t = TrainConfig(lr=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)
    grads = [[torch.randn(s) for s in shapes] for _ in range(5)]
    runs = {}
    for name in ("fused", "for-loop"):
        params = [torch.nn.Parameter(x.clone()) for x in start]
        if name == "fused":
            opt = make_optimizer(params, t)
            assert opt.param_groups[0]["fused"] is True
        else:
            opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                    weight_decay=t.weight_decay, foreach=False)
        for g in grads:
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        runs[name] = params
    for a, b, x0 in zip(runs["fused"], runs["for-loop"], start):
        assert not torch.allclose(b, x0, atol=1e-3)  # the steps moved the parameters
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    # DeepSpeed steps its own flat partitions: the default implementation there.
    ps = [torch.nn.Parameter(torch.zeros(3))]
    assert fused_adamw_applies(ps) and not fused_adamw_applies(ps, deepspeed=True)
    assert make_optimizer(ps, t, deepspeed=True).param_groups[0]["fused"] is None


@pytest.mark.parametrize("peft,chunk", [("none", 0), ("lora", 3)])
def test_sft_label_position_head_gives_the_full_logits_loss_and_gradient(tmp_path, peft, chunk):
    cfg = tiny_config(tmp_path, "sft", **{"task.num_eval": 0, "peft.method": peft, "train.logits_chunk_rows": chunk})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    model = loaded.model.double()
    _randomise_lora(model)
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()
    # A masked prompt then the answer; a fully labelled row; an assistant turn in the middle.
    micro = [{"input_ids": (x := ids(11)), "labels": [-100] * 6 + x[6:]},
             {"input_ids": (y := ids(7)), "labels": list(y)},
             {"input_ids": (z := ids(14)), "labels": [-100] * 4 + z[4:9] + [-100] * 5}]
    totals = {"tokens": 30}

    b = collate(micro, stage.pad_id)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits     # [b, T, V]
    want, want_n = sft_loss(logits, b["labels"], total_tokens=totals["tokens"])
    want.backward()
    want_g = _grads(model)
    model.zero_grad(set_to_none=True)

    loss, m = stage.loss(model, micro, totals)
    loss.backward()
    assert m["tokens"] == int(want_n) == 5 + 6 + 5 and want_g.norm() > 0
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(_grads(model), want_g, rtol=1e-10, atol=1e-13)
    # Eval loss: the token mean over all items, batched.
    with torch.no_grad():
        full, n = sft_loss(logits.detach(), b["labels"], total_tokens=1)
    assert eval_loss(model, micro, stage.pad_id, batch_size=2)["eval_loss"] == pytest.approx(float(full) / int(n), rel=1e-12)
