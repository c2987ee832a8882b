"""Tests of trainfit.algos: hand-computed values, slow-loop references, micro-batch invariance."""

import math

import pytest
import torch

from trainfit.algos import (
    token_logprobs_rows,
    LOSS_AGG, agg_loss, clipped_policy_loss, group_advantages, grpo_loss, kl_penalty, masked_mean,
    masked_sum, sft_loss, token_entropy, token_logprobs, shifted_logprobs, entropy_sum,
)

F64 = torch.float64
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def t64(x):
    return torch.tensor(x, dtype=F64)


def random_mask(gen, b, t):
    # [B, T] right-padded mask with lengths 0..T, so some rows are empty and lengths differ.
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0] = t  # at least one full row
    return torch.arange(t)[None, :] < lengths[:, None]


# Hand-computed values.

def test_group_advantages_hand():
    # Group 0 = [1, 0, 0, 1]: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3,
    # std = 0.57735; advantage = +-0.5 / (0.57735 + 1e-4) = +-0.86588.
    # Group 1 = [0, 0, 0, 0]: deviations 0, std 0 -> 0 / (0 + 1e-4) = 0 (not NaN).
    rewards = t64([1, 0, 0, 1, 0, 0, 0, 0])
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert a == pytest.approx(0.86588, abs=1e-5)
    torch.testing.assert_close(group_advantages(rewards, 4), t64([a, -a, -a, a, 0, 0, 0, 0]))
    # scale=False (Dr. GRPO): only centred.
    torch.testing.assert_close(group_advantages(rewards, 4, scale=False),
                               t64([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    # Groups are consecutive blocks: G=2 gives pairs [1,0] [0,1] [0,0] [0,0] -> mean .5, std
    # sqrt((.25 + .25) / 1) = .70711 -> +-0.5 / .70721 = +-0.70700.
    b = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 2), t64([b, -b, -b, b, 0, 0, 0, 0]))


def test_group_advantages_errors_and_int_input():
    with pytest.raises(ValueError, match="10 % 4 = 2"):
        group_advantages(torch.zeros(10), 4)
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.zeros(4), 1)
    # Integer / bool rewards come back as float (a 0/1 verifier returns ints).
    out = group_advantages(torch.tensor([1, 0]), 2, scale=False)
    assert out.dtype == torch.float32 and out.tolist() == [0.5, -0.5]


def test_kl_estimators_hand():
    logp = t64([-1.0, -2.0, -0.5])
    ref = t64([-1.5, -1.0, -0.5])
    # d = ref - logp = [-0.5, 1.0, 0.0]
    # k1 = logp - ref = [0.5, -1.0, 0.0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), t64([0.5, -1.0, 0.0]))
    # k2 = d^2 / 2 = [0.125, 0.5, 0.0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), t64([0.125, 0.5, 0.0]))
    # k3 = e^d - d - 1 = [0.606531 + 0.5 - 1, 2.718282 - 1 - 1, 1 - 0 - 1] = [0.106531, 0.718282, 0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), t64([0.10653066, 0.71828183, 0.0]),
                               atol=1e-8, rtol=0)
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(logp, ref, "k4")


def test_clipped_policy_loss_hand():
    # ratios [0.5, 0.9, 1.0, 1.5] (old_logp = 0), eps_low 0.2 -> [0.8, ...], eps_high 0.28 -> [..., 1.28].
    ratios = t64([[0.5, 0.9, 1.0, 1.5], [0.5, 0.9, 1.0, 1.5]])       # [B=2, T=4]
    logp = ratios.log().requires_grad_()
    old = torch.zeros_like(ratios)
    adv = t64([2.0, -1.0])                                             # [B]
    loss, clipped = clipped_policy_loss(logp, old, adv, 0.2, 0.28)
    # A = +2: r*A = [1.0, 1.8, 2.0, 3.0]; clamp(r)*A = [1.6, 1.8, 2.0, 2.56];
    #   min = [1.0, 1.8, 2.0, 2.56] -> loss = [-1.0, -1.8, -2.0, -2.56]; clipped only at r = 1.5.
    # A = -1: r*A = [-0.5, -0.9, -1.0, -1.5]; clamp(r)*A = [-0.8, -0.9, -1.0, -1.28];
    #   min = [-0.8, -0.9, -1.0, -1.5] -> loss = [0.8, 0.9, 1.0, 1.5]; clipped only at r = 0.5.
    torch.testing.assert_close(loss, t64([[-1.0, -1.8, -2.0, -2.56], [0.8, 0.9, 1.0, 1.5]]))
    assert clipped.tolist() == [[False, False, False, True], [True, False, False, False]]
    # Gradient: d(-r*A)/dlogp = -A*r where the unclipped term is active, 0 where clipped
    # (including the ties r = 0.9, 1.0 inside the range, which must get the full gradient).
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t64([[-1.0, -1.8, -2.0, 0.0], [0.0, 0.9, 1.0, 1.5]]))


def test_agg_loss_hand():
    loss = t64([[1.0, 2.0, float("nan")], [4.0, 5.0, 6.0]])            # [B=2, T=3]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])                          # NaN sits on a masked slot
    # token-mean: (1 + 2 + 4) / 3 tokens = 7/3
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)
    # seq-mean-token-mean: seq 0 (1 + 2) / 2 = 1.5, seq 1 4 / 1 = 4 -> (1.5 + 4) / 2 = 2.75
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)
    # seq-mean-token-sum-norm: (1 + 2 + 4) / (2 seqs x max_len 4) = 7/8
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", max_len=4).item() == pytest.approx(7 / 8)
    # Explicit totals replace the local ones: 7 / 10 tokens; (1.5 + 4) / 5 seqs; 7 / (5 x 4).
    assert agg_loss(loss, mask, "token-mean", total_tokens=10).item() == pytest.approx(0.7)
    assert agg_loss(loss, mask, "seq-mean-token-mean", total_seqs=5).item() == pytest.approx(1.1)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", total_seqs=5,
                    max_len=4).item() == pytest.approx(0.35)


def test_agg_loss_sequence_spanning_rows():
    # One episode trained as two rows (its screenshot was dropped between its turns): row 0 holds its
    # tokens 1, 2, row 1 its token 3; a second sequence is one row with tokens 4, 6.
    loss = t64([[1.0, 2.0, 9.0], [9.0, 3.0, 9.0], [4.0, 6.0, 9.0]])     # [rows=3, T=3]
    mask = torch.tensor([[1, 1, 0], [0, 1, 0], [1, 1, 0]])
    per_seq = t64([3.0, 3.0, 2.0])                                       # each row's sequence's tokens
    # rows 0 + 1: (1 + 2) / 3 + 3 / 3 = 2 = mean(1, 2, 3); row 2: (4 + 6) / 2 = 5 -> (2 + 5) / 2 seqs = 3.5
    got = agg_loss(loss, mask, "seq-mean-token-mean", total_seqs=2, seq_tokens=per_seq)
    assert got.item() == pytest.approx(3.5)
    # Without the divisors each row would count as a sequence of its own: (1.5 + 3 + 5) / 2 = 4.75.
    assert agg_loss(loss, mask, "seq-mean-token-mean", total_seqs=2).item() == pytest.approx(4.75)
    # A row's own token count as its divisor is the plain per-row mean.
    own = mask.sum(-1).to(torch.float64)
    assert agg_loss(loss, mask, "seq-mean-token-mean", seq_tokens=own).item() == \
        agg_loss(loss, mask, "seq-mean-token-mean").item()


def test_agg_loss_empty_rows_and_errors():
    loss = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    empty = torch.tensor([[1, 1, 1], [0, 0, 0]])
    # Row 1 has no token: contributes 0 and still counts as a sequence -> (2 + 0) / 2 = 1.
    assert agg_loss(loss, empty, "seq-mean-token-mean").item() == 1.0
    # No token at all: 0, not NaN, in every mode.
    none = torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        assert agg_loss(loss, none, mode, max_len=3).item() == 0.0
    with pytest.raises(ValueError) as err:
        agg_loss(loss, empty, "seq-mean")
    assert all(mode in str(err.value) for mode in MODES)  # the message lists the valid modes
    with pytest.raises(ValueError, match="max_len"):
        agg_loss(loss, empty, "seq-mean-token-sum-norm")
    assert LOSS_AGG == {"grpo": "seq-mean-token-mean", "dapo": "token-mean",
                        "dr_grpo": "seq-mean-token-sum-norm"}


def test_masked_helpers_hand():
    x = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[True, False, True], [False, False, False]])
    assert masked_sum(x, m).item() == 4.0                              # 1 + 3
    assert masked_sum(x, m, dim=1).tolist() == [4.0, 0.0]
    assert masked_mean(x, m, dim=1).tolist() == [2.0, 0.0]             # (1 + 3) / 2; empty row -> 0
    assert masked_mean(x, m).item() == 2.0


def test_token_logprobs_and_entropy_hand():
    # V = 3, logits [0, ln 2, 0] -> exp [1, 2, 1] / 4 = probs [0.25, 0.5, 0.25].
    logits = t64([0.0, math.log(2), 0.0]).expand(1, 2, 3)              # [B=1, T=2, V=3]
    targets = torch.tensor([[1, 0]])
    expected = t64([[math.log(0.5), math.log(0.25)]])
    for cs in (0, 1):
        torch.testing.assert_close(token_logprobs(logits, targets, chunk_size=cs), expected)
    # Entropy = -(0.25 ln 0.25 + 0.5 ln 0.5 + 0.25 ln 0.25) = 0.5 ln 4 + 0.5 ln 2 = 1.5 ln 2.
    torch.testing.assert_close(token_entropy(logits), t64([[1.5 * math.log(2)] * 2]))
    # A -inf logit has p = 0 and adds 0 to the entropy (not NaN): [0, -inf] -> one-hot -> 0.
    assert token_entropy(t64([[[0.0, float("-inf")]]])).item() == 0.0
    # The row path (policy positions only) gives the same: [ln 2, -inf, 0] -> p = [2/3, 0, 1/3],
    # entropy = -(2/3 ln 2/3 + 1/3 ln 1/3) = ln 3 - (2/3) ln 2.
    rows = t64([[math.log(2), float("-inf"), 0.0], [0.0, math.log(2), 0.0]])          # [N=2, V=3]
    lp, ent = token_logprobs_rows(rows, torch.tensor([0, 1]), entropy=True)
    torch.testing.assert_close(ent, t64([math.log(3) - 2 / 3 * math.log(2), 1.5 * math.log(2)]))
    torch.testing.assert_close(lp, t64([math.log(2 / 3), math.log(0.5)]))


def test_sft_loss_hand():
    # Every position has probs [0.25, 0.5, 0.25] (logits [0, ln 2, 0]).
    logits = t64([0.0, math.log(2), 0.0]).expand(1, 3, 3).clone()      # [B=1, T=3, V=3]
    labels = torch.tensor([[-100, 1, 0]])
    # Position 0 predicts labels[1] = 1 (p 0.5), position 1 predicts labels[2] = 0 (p 0.25),
    # position 2 predicts nothing. NLL = ln 2 + ln 4 = 3 ln 2 over 2 tokens = 1.5 ln 2.
    loss, n = sft_loss(logits, labels)
    assert n.item() == 2
    assert loss.item() == pytest.approx(1.5 * math.log(2))
    loss, _ = sft_loss(logits, labels, total_tokens=4, chunk_size=2)  # 3 ln 2 / 4
    assert loss.item() == pytest.approx(0.75 * math.log(2))


# Vectorised against slow loops, on seeded random inputs.

def test_group_advantages_vs_loop():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=gen, dtype=F64)
    for g in (2, 3, 8):
        for scale in (True, False):
            ref = []
            for start in range(0, 24, g):
                grp = rewards[start:start + g].tolist()
                mean = sum(grp) / g
                std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (g - 1))
                ref += [(r - mean) / (std + 1e-4) if scale else r - mean for r in grp]
            torch.testing.assert_close(group_advantages(rewards, g, scale=scale), t64(ref))


def test_clipped_policy_loss_vs_loop():
    gen = torch.Generator().manual_seed(1)
    b, t = 5, 7
    logp = torch.randn(b, t, generator=gen, dtype=F64) * 0.3         # ratios roughly in [0.4, 2.5]
    old = torch.randn(b, t, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(b, generator=gen, dtype=F64)
    loss, clipped = clipped_policy_loss(logp, old, adv, 0.2, 0.3)
    n_clipped = 0
    for i in range(b):
        for j in range(t):
            r = math.exp(logp[i, j].item() - old[i, j].item())
            a = adv[i].item()
            un, cl = r * a, min(max(r, 0.8), 1.3) * a
            assert loss[i, j].item() == pytest.approx(-min(un, cl), abs=1e-12)
            assert clipped[i, j].item() == (cl < un)
            n_clipped += cl < un
    assert 0 < n_clipped < b * t  # the random draw exercises both branches


def test_agg_loss_vs_loop():
    gen = torch.Generator().manual_seed(2)
    b, t = 6, 5
    loss = torch.randn(b, t, generator=gen, dtype=F64)
    mask = random_mask(gen, b, t)
    for mode in MODES:
        total_seqs, total_tokens, max_len = (None, 40.0, 9) if mode == "token-mean" else (11, None, 9)
        got = agg_loss(loss, mask, mode, total_seqs=total_seqs, total_tokens=total_tokens, max_len=max_len)
        num, seq_means = 0.0, 0.0
        for i in range(b):
            row = [loss[i, j].item() for j in range(t) if mask[i, j]]
            num += sum(row)
            seq_means += sum(row) / len(row) if row else 0.0
        ref = {"token-mean": num / 40.0, "seq-mean-token-mean": seq_means / 11,
               "seq-mean-token-sum-norm": num / (11 * 9)}[mode]
        assert got.item() == pytest.approx(ref, abs=1e-12)


@pytest.mark.parametrize("chunk_size", [0, 1, 4, 7, 100])
def test_token_logprobs_vs_log_softmax(chunk_size):
    gen = torch.Generator().manual_seed(3)
    b, t, v = 3, 5, 11                                                  # 15 rows: 4 and 7 leave a ragged chunk
    logits = (torch.randn(b, t, v, generator=gen, dtype=F64) * 3).requires_grad_()
    targets = torch.randint(0, v, (b, t), generator=gen)
    got = token_logprobs(logits, targets, chunk_size=chunk_size)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = torch.log_softmax(ref_logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(got, ref)
    # Same gradient for an arbitrary upstream gradient.
    w = torch.randn(b, t, generator=gen, dtype=F64)
    (got * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_token_logprobs_chunked_gradcheck():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, chunk_size=4), (logits,))


def test_token_logprobs_bf16_upcasts():
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 4, 50, generator=gen) * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (2, 4), generator=gen)
    # Reference: the same bf16 values in fp64.
    ref = torch.log_softmax(logits.detach().double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    grads = []
    for cs in (0, 3):
        out = token_logprobs(logits, targets, chunk_size=cs)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
        (g,) = torch.autograd.grad(out.sum(), logits)
        assert g.dtype == torch.bfloat16
        grads.append(g.float())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-2, rtol=0)


def test_token_logprobs_chunked_saves_no_fp32_copy():
    # The point of chunking: for backward, keep the bf16 logits [B*T, V] plus per-row numbers, not an
    # fp32 copy of the logits (the unchunked path saves at least one: 4 bytes x B*T*V).
    logits = torch.randn(2, 16, 500).to(torch.bfloat16).requires_grad_()     # [B, T, V]
    targets = torch.randint(0, 500, (2, 16))
    saved = {}
    for cs in (0, 8):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda x: sizes.append(x.numel() * x.element_size()) or x, lambda x: x):
            token_logprobs(logits, targets, chunk_size=cs)
        saved[cs] = sum(sizes)
    bf16_bytes = logits.numel() * 2
    per_row = 32 * 16                                                  # B*T rows x (8 + 8) bytes, generous
    assert saved[8] <= bf16_bytes + per_row
    assert saved[0] >= 2 * bf16_bytes                                  # control: the plain path does copy


def test_token_entropy_vs_loop():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 7, generator=gen, dtype=F64) * 2
    got = token_entropy(logits)
    for i in range(2):
        for j in range(3):
            row = logits[i, j].tolist()
            z = sum(math.exp(x) for x in row)
            h = -sum(math.exp(x) / z * (x - math.log(z)) for x in row)
            assert got[i, j].item() == pytest.approx(h, abs=1e-12)
    assert token_entropy(logits.to(torch.bfloat16)).dtype == torch.float32


def test_sft_loss_vs_cross_entropy():
    gen = torch.Generator().manual_seed(7)
    b, t, v = 3, 6, 9
    logits = torch.randn(b, t, v, generator=gen, dtype=F64)
    labels = torch.randint(0, v, (b, t), generator=gen)
    labels[0, :3] = -100                                                # a masked prompt
    labels[2, 4:] = -100                                                # padding
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1),
                                            ignore_index=-100)
    for cs in (0, 5):
        loss, n = sft_loss(logits, labels, chunk_size=cs)
        torch.testing.assert_close(loss, ref)
        assert n.item() == int((labels[:, 1:] != -100).sum())


# Micro-batch invariance: the trainer sums micro-batch losses computed with the whole step's totals.

def _grpo_inputs(seed, b=8, t=6):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=gen, dtype=F64) * 3
    old = logp + torch.randn(b, t, generator=gen, dtype=F64) * 0.3      # some ratios clip
    ref = logp + torch.randn(b, t, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(b, generator=gen, dtype=F64)
    return logp, old, ref, adv, random_mask(gen, b, t)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_grpo_loss_micro_batch_invariance(loss_type):
    logp, old, ref, adv, mask = _grpo_inputs(8)
    kw = dict(loss_type=loss_type, eps_low=0.2, eps_high=0.28, beta=0.05, kl_estimator="k3", max_len=6)
    totals = dict(total_seqs=8, total_tokens=float(mask.sum()))

    whole_lp = logp.clone().requires_grad_()
    whole, whole_metrics = grpo_loss(whole_lp, old, ref, adv, mask, **kw)
    whole.backward()

    micro_lp = logp.clone().requires_grad_()
    summed, local_sum, metric_sums = 0.0, 0.0, {}
    for lo, hi in [(0, 3), (3, 4), (4, 8)]:                            # uneven micro-batches
        sl = slice(lo, hi)
        part, metrics = grpo_loss(micro_lp[sl], old[sl], ref[sl], adv[sl], mask[sl], **kw, **totals)
        summed = summed + part
        local_sum += grpo_loss(logp[sl], old[sl], ref[sl], adv[sl], mask[sl], **kw)[0].item()
        for k, val in metrics.items():
            metric_sums[k] = metric_sums.get(k, 0.0) + val
    summed.backward()

    assert summed.item() == pytest.approx(whole.item(), abs=1e-6)
    torch.testing.assert_close(micro_lp.grad, whole_lp.grad, atol=1e-6, rtol=0)
    for k in whole_metrics:
        assert metric_sums[k].item() == pytest.approx(whole_metrics[k].item(), abs=1e-9)
    assert whole_metrics["clip_frac_sum"].item() > 0 and whole_metrics["kl_sum"].item() > 0
    # Control: with the local default totals the sum is not the whole-batch loss, so the equality
    # above depends on passing the totals.
    assert abs(local_sum - whole.item()) > 1e-3


def test_sft_loss_micro_batch_invariance():
    gen = torch.Generator().manual_seed(9)
    b, t, v = 6, 5, 7
    logits = torch.randn(b, t, v, generator=gen, dtype=F64, requires_grad=True)
    labels = torch.randint(0, v, (b, t), generator=gen).masked_fill(~random_mask(gen, b, t), -100)
    whole, n = sft_loss(logits, labels)
    (g_whole,) = torch.autograd.grad(whole, logits)
    summed = sum(sft_loss(logits[i:i + 2], labels[i:i + 2], total_tokens=n, chunk_size=3)[0]
                 for i in range(0, b, 2))
    (g_micro,) = torch.autograd.grad(summed, logits)
    assert summed.item() == pytest.approx(whole.item(), abs=1e-9)
    torch.testing.assert_close(g_micro, g_whole)


# On-policy, reference equal to the policy: the loss is the advantage-weighted token count.

@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_grpo_loss_on_policy_no_drift(estimator):
    # ratio = exp(0) = 1 everywhere, so nothing clips and the per-token loss is -A_i; kl(logp, logp) = 0
    # for every estimator, so beta does not change the loss. With n_i mask tokens in row i (B = 4):
    #   dapo    (token-mean):              -sum_i A_i n_i / sum_i n_i
    #   grpo    (seq-mean-token-mean):     -sum_{i: n_i > 0} A_i / B
    #   dr_grpo (seq-mean-token-sum-norm): -sum_i A_i n_i / (B * max_len)
    # The gradient w.r.t. logp of token (i, t) is (-A_i + beta * dkl/dlogp) times that token's weight,
    # with dkl/dlogp at logp = ref: k1 = d(logp - ref) = 1; k2 = (logp - ref) = 0;
    # k3 = 1 - exp(ref - logp) = 0. So k1 still pushes logp down by beta although its value is 0.
    adv = t64([1.0, -0.5, 2.0, 3.0])                                   # [B]
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # n = [3, 1, 4, 0]
    # dapo: -(3 - 0.5 + 8 + 0) / 8 = -1.3125; grpo: -(1 - 0.5 + 2) / 4 = -0.625;
    # dr_grpo with max_len 5: -10.5 / (4 * 5) = -0.525.
    expected = {"dapo": -1.3125, "grpo": -0.625, "dr_grpo": -0.525}
    weight = {"dapo": mask / 8.0, "grpo": mask / t64([3, 1, 4, 1])[:, None] / 4, "dr_grpo": mask / 20.0}
    gen = torch.Generator().manual_seed(10)
    base = -torch.rand(4, 4, generator=gen, dtype=F64)
    for loss_type, value in expected.items():
        logp = base.clone().requires_grad_()
        loss, m = grpo_loss(logp, logp.detach(), logp.detach(), adv, mask, loss_type=loss_type,
                            eps_low=0.2, eps_high=0.2, beta=0.5, kl_estimator=estimator, max_len=5)
        assert loss.item() == pytest.approx(value, abs=1e-12)
        assert m["kl_sum"].item() == 0.0
        assert m["clip_frac_sum"].item() == 0.0
        assert m["tokens"].item() == 8.0 and m["ratio_sum"].item() == 8.0
        loss.backward()
        dkl = 1.0 if estimator == "k1" else 0.0
        torch.testing.assert_close(logp.grad, (-adv[:, None] + 0.5 * dkl) * weight[loss_type])


def test_grpo_loss_without_ref_and_bad_type():
    logp, old, _, adv, mask = _grpo_inputs(11)
    kw = dict(eps_low=0.2, eps_high=0.2, kl_estimator="k3")
    no_ref, m = grpo_loss(logp, old, None, adv, mask, loss_type="dapo", beta=0.1, **kw)
    assert m["kl_sum"].item() == 0.0
    # Without a reference (or with beta 0) the loss is the aggregated clipped surrogate alone.
    pg, _ = clipped_policy_loss(logp, old, adv, 0.2, 0.2)
    assert no_ref.item() == pytest.approx(agg_loss(pg, mask, "token-mean").item(), abs=1e-12)
    with pytest.raises(ValueError, match="grpo, dapo, dr_grpo"):
        grpo_loss(logp, old, None, adv, mask, loss_type="ppo", beta=0.0, **kw)


def test_shifted_logprobs_matches_a_loop_at_temperature():
    # Position t holds log softmax(logits[t] / temp)[ids[t+1]]; the last position predicts nothing.
    torch.manual_seed(3)
    logits = torch.randn(2, 5, 7, dtype=torch.float64)                 # [B, T, V]
    ids = torch.randint(0, 7, (2, 5))                                  # [B, T]
    for temp in (1.0, 0.7):
        got = shifted_logprobs(logits, ids, temperature=temp, chunk_size=3)   # [B, T-1]
        want = torch.tensor([[torch.log_softmax(logits[b, t] / temp, -1)[ids[b, t + 1]].item()
                              for t in range(4)] for b in range(2)], dtype=torch.float64)
        assert got.shape == (2, 4)
        assert torch.allclose(got, want, atol=1e-12)


def test_entropy_sum_chunked_equals_whole():
    # Uniform over 4 tokens has entropy ln 4; three such rows sum to 3 ln 4 = 4.1589.
    rows = torch.zeros(3, 4)
    assert entropy_sum(rows, chunk_rows=2).item() == pytest.approx(3 * math.log(4), rel=1e-6)
    r = torch.randn(10, 6)
    assert entropy_sum(r, chunk_rows=3).item() == pytest.approx(token_entropy(r).sum().item(), rel=1e-6)


def test_group_advantages_leave_out_invalid_members():
    # Group [1, 0, x, 2] with member 2 invalid (its environment failed): the valid rewards 1, 0, 2
    # have mean 1 and unbiased std sqrt(((0)^2 + (-1)^2 + 1^2) / 2) = 1, so the advantages are
    # (0, -1, 0, 1) / (1 + 1e-4); the invalid member gets 0 whatever its reward (here 5).
    # Group 2 [3, 3, 3, 3] all valid: 0 everywhere.
    r = torch.tensor([1.0, 0.0, 5.0, 2.0, 3.0, 3.0, 3.0, 3.0])
    valid = torch.tensor([True, True, False, True, True, True, True, True])
    adv = group_advantages(r, 4, scale=True, valid=valid)
    expected = torch.tensor([0.0, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]) / (1 + 1e-4)
    assert torch.allclose(adv, expected)
    assert torch.allclose(group_advantages(r, 4, scale=False, valid=valid),
                          torch.tensor([0.0, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    # All valid equals the unmasked version.
    x = torch.randn(12)
    assert torch.allclose(group_advantages(x, 4, valid=torch.ones(12, dtype=torch.bool)), group_advantages(x, 4))
