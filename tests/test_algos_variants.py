"""RLOO, REINFORCE++ and GSPO (trainfit.algos): hand-worked values (in the comments) and slow loops."""

import math

import pytest
import torch

from trainfit.algos import (advantages, grpo_loss, group_advantages, reinforce_pp_advantages, rloo_advantages,
                            sequence_log_ratio)

F64 = torch.float64


def t64(x):
    return torch.tensor(x, dtype=F64)


def test_rloo_hand_worked():
    # Group 1: rewards 1, 0, 0, 1 (G = 4). Leave-one-out baselines: r0's others are 0, 0, 1 -> 1/3,
    # so A0 = 1 - 1/3 = 2/3; r1's others are 1, 0, 1 -> 2/3, so A1 = 0 - 2/3 = -2/3; likewise A2 = -2/3,
    # A3 = 2/3. (= 4/3 x the group-centred rewards +-1/2.)
    # Group 2: rewards 3, 1, 2, x with the 4th invalid (k = 3 valid, sum 6): A = 3 - 3/2 = 1.5,
    # 1 - 5/2 = -1.5, 2 - 4/2 = 0, and the invalid member 0.
    # Group 3: only one valid member (5): no baseline, all 0.
    r = t64([1, 0, 0, 1, 3, 1, 2, 9, 5, 7, 7, 7])
    valid = torch.tensor([True] * 7 + [False] + [True, False, False, False])
    got = rloo_advantages(r, 4, valid=valid)
    want = t64([2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.5, -1.5, 0, 0, 0, 0, 0, 0])
    torch.testing.assert_close(got, want)


def test_rloo_matches_slow_loop():
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(6 * 5, generator=gen, dtype=F64)
    got = rloo_advantages(r, 5)
    want = torch.empty_like(r)
    for i in range(r.numel()):
        g0 = (i // 5) * 5
        others = [r[j].item() for j in range(g0, g0 + 5) if j != i]
        want[i] = r[i] - sum(others) / len(others)
    torch.testing.assert_close(got, want)


def test_reinforce_pp_hand_worked():
    # Rewards, G = 4: group 1 = 1, 0, 0, 1 (mean 0.5), group 2 = 1, 1, 1, 0 (mean 0.75).
    # REINFORCE++-baseline ("group"): centred = 0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75.
    #   Sum of squares = 4 x 0.25 + 3 x 0.0625 + 0.5625 = 1.75; unbiased var = 1.75 / 7 = 0.25; std 0.5.
    #   A = 1, -1, -1, 1, 0.5, 0.5, 0.5, -1.5 (eps = 0 here).
    # REINFORCE++ ("batch"): batch mean = 5/8 = 0.625; centred = 0.375, -0.625, -0.625, 0.375,
    #   0.375, 0.375, 0.375, -0.625; sum of squares = 5 x 0.140625 + 3 x 0.390625 = 1.875;
    #   var = 1.875 / 7; std = 0.517549...; A = centred / std.
    r = t64([1, 0, 0, 1, 1, 1, 1, 0])
    got = reinforce_pp_advantages(r, 4, baseline="group", eps=0.0)
    torch.testing.assert_close(got, t64([1, -1, -1, 1, 0.5, 0.5, 0.5, -1.5]))
    std = math.sqrt(1.875 / 7)
    got = reinforce_pp_advantages(r, 4, baseline="batch", eps=0.0)
    torch.testing.assert_close(got, t64([0.375, -0.625, -0.625, 0.375, 0.375, 0.375, 0.375, -0.625]) / std)


def test_reinforce_pp_matches_slow_loop_with_invalid_members():
    gen = torch.Generator().manual_seed(1)
    r = torch.randn(4 * 6, generator=gen, dtype=F64)
    valid = torch.rand(r.numel(), generator=gen) > 0.25
    got = reinforce_pp_advantages(r, 6, valid=valid, baseline="group", eps=0.0)
    centred = []
    for g0 in range(0, r.numel(), 6):
        members = [j for j in range(g0, g0 + 6) if valid[j]]
        mean = sum(r[j].item() for j in members) / max(len(members), 1)
        centred += [(r[j].item() - mean) if valid[j] else 0.0 for j in range(g0, g0 + 6)]
    n = int(valid.sum())
    std = math.sqrt(sum(c * c for c in centred) / (n - 1))
    torch.testing.assert_close(got, t64(centred) / std)


def test_batch_estimators_differ_from_group_norm():
    # A group of near-equal rewards: GRPO's per-group std blows it up to +-0.7; REINFORCE++'s batch
    # std keeps it small next to a group with a real spread (the paper's argument).
    r = t64([1.0, 1.01, 1.0, 1.01, 0.0, 1.0, 0.0, 1.0])
    grpo = group_advantages(r, 4)
    rpp = reinforce_pp_advantages(r, 4)
    assert grpo[:4].abs().min() > 0.5
    assert rpp[:4].abs().max() < 0.05 and rpp[4:].abs().min() > 0.5


def test_advantages_dispatch_and_unknown_name():
    r = t64([1, 0, 0, 1])
    torch.testing.assert_close(advantages(r, 4, "rloo"), rloo_advantages(r, 4))
    torch.testing.assert_close(advantages(r, 4, "group_norm", scale=False), t64([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="rloo"):
        advantages(r, 4, "ppo")


LOGP = [[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]]
OLD = [[-1.5, -2.0, -2.7], [-1.2, -0.8, 5.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def test_sequence_log_ratio_hand_worked():
    # Sequence 0: token log-ratios 0.5, 0, -0.3 -> mean 0.2 / 3. Sequence 1: 0.2, -0.2 (the third
    # position is masked, its 5.0 never counts) -> 0.
    got = sequence_log_ratio(t64(LOGP), t64(OLD), t64(MASK))
    torch.testing.assert_close(got, t64([0.2 / 3, 0.0]))


def test_gspo_loss_hand_worked():
    # s0 = exp(0.2/3) = 1.06894, s1 = exp(0) = 1; advantages +1, -1; epsilon 0.05 both sides.
    # Sequence 0: A > 0 and s0 > 1.05, so every token is clipped: loss_t = -min(1.06894, 1.05) = -1.05,
    #   no gradient. Sequence 1: ratio 1, loss_t = -min(-1, -1) = 1 on its 2 tokens.
    # loss_type grpo (mean over sequences of token means): (-1.05 + 1) / 2 = -0.025.
    # Gradient: sequence 1's token loss is -A x ratio_t with d ratio_t / d logp_t = ratio_t = 1, so
    #   d loss / d logp = +1 x (1/2 tokens) x (1/2 sequences) = 0.25 at its two tokens, 0 elsewhere.
    logp = t64(LOGP).requires_grad_(True)
    loss, m = grpo_loss(logp, t64(OLD), None, t64([1.0, -1.0]), t64(MASK), loss_type="grpo", eps_low=0.05,
                        eps_high=0.05, beta=0.0, kl_estimator="k3", importance="sequence")
    torch.testing.assert_close(loss, t64(-0.025))
    loss.backward()
    torch.testing.assert_close(logp.grad, t64([[0, 0, 0], [0.25, 0.25, 0]]))
    # clipped tokens: all 3 of sequence 0; logged ratios: 3 x s0 + 2 x 1.
    assert m["clip_frac_sum"].item() == 3
    torch.testing.assert_close(m["ratio_sum"], t64(3 * math.exp(0.2 / 3) + 2))


def test_gspo_differs_from_token_level_off_policy():
    # Token level on the same inputs: sequence 0's first token (ratio e^0.5) is clipped, the other two
    # are not, so the loss differs from GSPO's -0.025.
    loss_tok, m = grpo_loss(t64(LOGP), t64(OLD), None, t64([1.0, -1.0]), t64(MASK), loss_type="grpo",
                            eps_low=0.05, eps_high=0.05, beta=0.0, kl_estimator="k3", importance="token")
    # sequence 0: (-1.05 - 1 - exp(-0.3)) / 3; sequence 1: ratios e^0.2 (A<0: -min(-1.2214, -1.05) =
    # 1.2214, clipped) and e^-0.2 (-min(-0.8187, -0.95) = 0.95, clipped) -> mean (1.2214 + 0.95) / 2.
    s0 = (-1.05 - 1.0 - math.exp(-0.3)) / 3
    s1 = (math.exp(0.2) + 0.95) / 2
    torch.testing.assert_close(loss_tok, t64((s0 + s1) / 2))


def test_gspo_on_policy_gradient_equals_token_level():
    # On-policy (old = logp), every ratio is 1: GSPO and token-level GRPO give the same gradient.
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(3, 5, generator=gen, dtype=F64)
    mask = (torch.rand(3, 5, generator=gen) > 0.3).to(F64)
    mask[:, 0] = 1
    adv = torch.randn(3, generator=gen, dtype=F64)
    grads = []
    for level in ("token", "sequence"):
        logp = base.clone().requires_grad_(True)
        loss, _ = grpo_loss(logp, logp.detach(), None, adv, mask, loss_type="grpo", eps_low=0.2, eps_high=0.2,
                            beta=0.0, kl_estimator="k3", importance=level)
        loss.backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_unknown_importance_level():
    with pytest.raises(ValueError, match="sequence"):
        grpo_loss(t64(LOGP), t64(OLD), None, t64([1.0, -1.0]), t64(MASK), loss_type="grpo", eps_low=0.2,
                  eps_high=0.2, beta=0.0, kl_estimator="k3", importance="group")
