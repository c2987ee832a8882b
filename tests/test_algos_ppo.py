"""PPO math (trainfit.algos.ppo): hand-worked values in the comments, and GAE against a slow loop."""

import pytest
import torch

from trainfit.algos.ppo import AdaptiveKL, clipped_value_loss, gae, last_positions, token_rewards, whiten

F64 = torch.float64


def t64(x):
    return torch.tensor(x, dtype=F64)


def test_token_rewards_hand_worked():
    # Row 0: policy tokens at 0, 1; KL 0.1, 0.2; coef 0.5 -> -0.05, -0.1; score 2 lands on the last
    # policy token (1): -0.1 + 2 = 1.9. Row 1: one policy token: -0.25 + (-1) = -1.25.
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    got = token_rewards(t64([2.0, -1.0]), t64([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]]), mask, kl_coef=0.5)
    torch.testing.assert_close(got, t64([[-0.05, 1.9, 0.0], [-1.25, 0.0, 0.0]]))
    assert last_positions(torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])).tolist() == [2, -1]


def test_gae_hand_worked_with_an_environment_token():
    # T = 4, position 2 is an environment token (off the mask); gamma 0.9, lam 0.5.
    # t=3: delta = 1 + 0 - 0.8 = 0.2; A3 = 0.2.
    # t=2: skipped; the "next" of t=1 is t=3 (V 0.8, A 0.2).
    # t=1: delta = 0 + 0.9 x 0.8 - 0.4 = 0.32; A1 = 0.32 + 0.45 x 0.2 = 0.41.
    # t=0: delta = 0 + 0.9 x 0.4 - 0.5 = -0.14; A0 = -0.14 + 0.45 x 0.41 = 0.0445.
    # Returns = A + V = 0.5445, 0.81, (0), 1.0.
    adv, ret = gae(t64([[0, 0, 0, 1]]), t64([[0.5, 0.4, 9.0, 0.8]]), torch.tensor([[1, 1, 0, 1]]), 0.9, 0.5)
    torch.testing.assert_close(adv, t64([[0.0445, 0.41, 0.0, 0.2]]))
    torch.testing.assert_close(ret, t64([[0.5445, 0.81, 0.0, 1.0]]))


def test_gae_matches_slow_loop():
    gen = torch.Generator().manual_seed(0)
    b, t, gamma, lam = 5, 9, 0.97, 0.9
    r, v = torch.randn(b, t, generator=gen, dtype=F64), torch.randn(b, t, generator=gen, dtype=F64)
    mask = torch.rand(b, t, generator=gen) > 0.3
    adv, ret = gae(r, v, mask, gamma, lam)
    for i in range(b):
        pos = [j for j in range(t) if mask[i, j]]          # the row's policy tokens, in order
        a_next = 0.0
        for k in range(len(pos) - 1, -1, -1):
            j = pos[k]
            v_next = v[i, pos[k + 1]].item() if k + 1 < len(pos) else 0.0
            a_next = r[i, j].item() + gamma * v_next - v[i, j].item() + gamma * lam * a_next
            assert adv[i, j].item() == pytest.approx(a_next, rel=1e-12, abs=1e-12)
            assert ret[i, j].item() == pytest.approx(a_next + v[i, j].item(), rel=1e-12, abs=1e-12)
        assert all(adv[i, j] == 0 for j in range(t) if not mask[i, j])


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t (Monte-Carlo return minus baseline).
    r, v = t64([[0.5, 0.0, 2.0]]), t64([[1.0, 1.5, 0.25]])
    adv, _ = gae(r, v, torch.ones(1, 3, dtype=torch.bool), 1.0, 1.0)
    torch.testing.assert_close(adv, t64([[2.5 - 1.0, 2.0 - 1.5, 2.0 - 0.25]]))


def test_whiten_hand_worked():
    # Mask positions 1, 2, 3: mean 2, unbiased var (1 + 0 + 1) / 2 = 1 -> -1, 0, 1; the masked 100 is
    # ignored and set to 0. shift_mean=False adds the mean back: 1, 2, 3.
    x, mask = t64([1.0, 2.0, 3.0, 100.0]), torch.tensor([1, 1, 1, 0])
    torch.testing.assert_close(whiten(x, mask, eps=0.0), t64([-1.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(whiten(x, mask, shift_mean=False, eps=0.0), t64([1.0, 2.0, 3.0, 0.0]))


def test_clipped_value_loss_hand_worked():
    # Token 0: V 1.0, V_old 0.8, R 1.5, clip 0.1: V_clip = 0.8 + 0.1 = 0.9; (1 - 1.5)^2 = 0.25 <
    #   (0.9 - 1.5)^2 = 0.36 -> 0.5 x 0.36 = 0.18, clipped (no gradient).
    # Token 1: V 2.0, V_old 2.05, R 1.0: V_clip = 2.05 - 0.05 = 2.0, both squares 1 -> 0.5, not clipped.
    loss, clipped = clipped_value_loss(t64([1.0, 2.0]), t64([0.8, 2.05]), t64([1.5, 1.0]), 0.1)
    torch.testing.assert_close(loss, t64([0.18, 0.5]))
    assert clipped.tolist() == [True, False]
    loss, clipped = clipped_value_loss(t64([1.0, 2.0]), t64([0.8, 2.05]), t64([1.5, 1.0]), None)
    torch.testing.assert_close(loss, t64([0.125, 0.5]))
    assert not clipped.any()


def test_adaptive_kl_hand_worked():
    # KL 9 vs target 6: error min(9/6 - 1, 0.2) = 0.2; 512 samples of a 10000 horizon:
    # 0.1 x (1 + 0.2 x 512 / 10000) = 0.101024. Then KL 3: error max(-0.5, -0.2) = -0.2:
    # 0.101024 x (1 - 0.2 x 0.0512) = 0.100989575...
    c = AdaptiveKL(0.1, target=6.0, horizon=10000)
    assert c.update(9.0, 512) == pytest.approx(0.101024)
    assert c.update(3.0, 512) == pytest.approx(0.101024 * (1 - 0.2 * 0.0512))
    with pytest.raises(ValueError):
        AdaptiveKL(0.1, target=0.0, horizon=10)
