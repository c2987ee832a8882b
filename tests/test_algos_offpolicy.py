"""Off-policy correction of stale samples (algos/offpolicy.py, grpo_loss's behav_logp): numbers by hand."""

import math

import pytest
import torch

from trainfit.algos import (OFF_POLICY, behaviour_weights, grpo_loss, importance_stats, staleness_stats)

F64 = torch.float64


def t64(x):
    return torch.tensor(x, dtype=F64)


# One sequence of 4 tokens: prox - behav = [0, ln 3, -ln 2, ln 1.5], so the raw weights
# exp(prox - behav) are [1, 3, 0.5, 1.5].
PROX = t64([[-1.0, -0.5, -2.0, -1.2]])
BEHAV = PROX - t64([[0.0, math.log(3.0), -math.log(2.0), math.log(1.5)]])


def test_truncated_importance_by_hand():
    # tis, C = 2: min([1, 3, 0.5, 1.5], 2) = [1, 2, 0.5, 1.5]; only token 1 (3 > 2) is truncated.
    w, cut = behaviour_weights("tis", PROX, BEHAV, 2.0)
    torch.testing.assert_close(w, t64([[1.0, 2.0, 0.5, 1.5]]))
    assert cut.tolist() == [[False, True, False, False]]


def test_decoupled_importance_by_hand():
    # decoupled (AReaL), C = 2: the weight kept as is, tokens above C left out: [1, 0, 0.5, 1.5].
    w, cut = behaviour_weights("decoupled", PROX, BEHAV, 2.0)
    torch.testing.assert_close(w, t64([[1.0, 0.0, 0.5, 1.5]]))
    assert cut.tolist() == [[False, True, False, False]]
    # C = 5: nothing above it, the raw weights.
    torch.testing.assert_close(behaviour_weights("decoupled", PROX, BEHAV, 5.0)[0], t64([[1.0, 3.0, 0.5, 1.5]]))


def test_none_and_bad_names():
    w, cut = behaviour_weights("none", PROX, BEHAV, 2.0)
    assert w.tolist() == [[1.0] * 4] and not cut.any()
    with pytest.raises(ValueError, match="unknown off-policy correction 'x'"):
        behaviour_weights("x", PROX, BEHAV, 2.0)
    with pytest.raises(ValueError, match="below 1"):
        behaviour_weights("tis", PROX, BEHAV, 0.5)
    assert set(OFF_POLICY) == {"tis", "decoupled", "none"}


def test_importance_stats_by_hand():
    # Mask out token 3 (raw 1.5): over [1, 3, 0.5] sum 4.5, max 3, min 0.5, one cut (C = 2).
    mask = torch.tensor([[1, 1, 1, 0]])
    _, cut = behaviour_weights("tis", PROX, BEHAV, 2.0)
    s = importance_stats(PROX, BEHAV, cut, mask)
    assert s["iw_sum"].item() == pytest.approx(4.5)
    assert s["iw_max"].item() == pytest.approx(3.0) and s["iw_min"].item() == pytest.approx(0.5)
    assert s["iw_cut_sum"].item() == 1.0
    empty = importance_stats(PROX, BEHAV, cut, torch.zeros(1, 4))
    assert empty["iw_sum"].item() == 0 and empty["iw_max"].item() == -math.inf and empty["iw_min"].item() == math.inf


def test_staleness_stats_by_hand():
    # Trainer at version 5; samples of versions 4, 4, 5, 3: lags 1, 1, 0, 2 -> mean 1, max 2.
    assert staleness_stats([4, 4, 5, 3], 5) == {"staleness_mean": 1.0, "staleness_max": 2.0}


def test_decoupled_grpo_loss_by_hand():
    # One step per rollout: the proximal policy is the current one (old = logp.detach()), so every
    # ratio is 1, nothing clips and the per-token surrogate is -A. Advantage A = 2, dapo (token mean
    # over the 4 tokens): tis C = 2 weighs the tokens [1, 2, 0.5, 1.5], so
    #   loss = -2 * (1 + 2 + 0.5 + 1.5) / 4 = -2.5, and d loss / d logp_t = -2 * w_t / 4 = -w_t / 2.
    logp = PROX.clone().requires_grad_()
    loss, m = grpo_loss(logp, logp.detach(), None, t64([2.0]), torch.ones(1, 4), loss_type="dapo", eps_low=0.2,
                        eps_high=0.2, beta=0.0, kl_estimator="k3", behav_logp=BEHAV, off_policy="tis",
                        importance_cap=2.0)
    assert loss.item() == pytest.approx(-2.5)
    loss.backward()
    torch.testing.assert_close(logp.grad, t64([[-0.5, -1.0, -0.25, -0.75]]))
    assert m["iw_sum"].item() == pytest.approx(6.0) and m["iw_cut_sum"].item() == 1.0
    # decoupled, C = 2: weights [1, 0, 0.5, 1.5] -> -2 * 3 / 4 = -1.5.
    loss, _ = grpo_loss(PROX, PROX, None, t64([2.0]), torch.ones(1, 4), loss_type="dapo", eps_low=0.2, eps_high=0.2,
                        beta=0.0, kl_estimator="k3", behav_logp=BEHAV, off_policy="decoupled", importance_cap=2.0)
    assert loss.item() == pytest.approx(-1.5)


def test_decoupled_ratio_is_against_the_proximal_policy():
    # A second update of the same samples (current logp moved away from the proximal one): token 0 has
    # logp - prox = ln 1.5, ratio 1.5, clipped at 1.2 for A = 1 (min(1.5, 1.2) = 1.2), weight 1 -> 1.2;
    # token 1: ratio 1, weight min(3, 2) = 2 -> 2. dapo over 2 tokens: -(1.2 + 2) / 2 = -1.6.
    prox = t64([[-1.0, -0.5]])
    behav = prox - t64([[0.0, math.log(3.0)]])
    logp = prox + t64([[math.log(1.5), 0.0]])
    loss, m = grpo_loss(logp, prox, None, t64([1.0]), torch.ones(1, 2), loss_type="dapo", eps_low=0.2, eps_high=0.2,
                        beta=0.0, kl_estimator="k3", behav_logp=behav, off_policy="tis", importance_cap=2.0)
    assert loss.item() == pytest.approx(-1.6)
    assert m["clip_frac_sum"].item() == 1.0 and m["ratio_sum"].item() == pytest.approx(2.5)


@pytest.mark.parametrize("name", sorted(OFF_POLICY))
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_same_policies_reduce_exactly_to_the_on_policy_loss(name, loss_type):
    # behav == prox: w = exp(0) = 1 exactly, so loss, gradient and the shared metrics are bit for bit those
    # of the loss without a behaviour policy (beta > 0 as well: the KL term is never reweighted).
    gen = torch.Generator().manual_seed(3)
    logp0 = -torch.rand(3, 5, generator=gen)
    old = logp0 - 0.1 * torch.rand(3, 5, generator=gen)      # a second update: ratios away from 1
    ref = -torch.rand(3, 5, generator=gen)
    adv, mask = torch.tensor([1.0, -0.7, 0.3]), torch.rand(3, 5, generator=gen) > 0.3
    kw = dict(loss_type=loss_type, eps_low=0.2, eps_high=0.28, beta=0.04, kl_estimator="k3", max_len=5)
    a = logp0.clone().requires_grad_()
    la, ma = grpo_loss(a, old, ref, adv, mask, **kw)
    la.backward()
    b = logp0.clone().requires_grad_()
    lb, mb = grpo_loss(b, old, ref, adv, mask, **kw, behav_logp=old.clone(), off_policy=name, importance_cap=1.0)
    lb.backward()
    assert torch.equal(la, lb) and torch.equal(a.grad, b.grad)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    assert mb["iw_cut_sum"].item() == 0.0 and mb["iw_max"].item() == 1.0 == mb["iw_min"].item()


def test_the_config_offers_exactly_the_registered_corrections():
    from typing import get_args

    from trainfit.config import RolloutConfig

    assert get_args(RolloutConfig.model_fields["off_policy"].annotation) == tuple(OFF_POLICY)
