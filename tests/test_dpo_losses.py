"""Preference losses (trainfit/algos/preference.py) on hand-computed values, and loss + gradients on a
tiny fp64 model against independent implementations of the published formulas."""

import math

import pytest
import torch

from trainfit.algos import PREFERENCE_LOSSES, PairLogps, kto_loss, kto_reference_point, preference_loss
from trainfit.algos.preference import _log_odds, log1mexp

T = torch.tensor


def one_pair(**kw) -> PairLogps:
    # policy: chosen -2 (4 tokens), rejected -5 (2 tokens); reference: chosen -3, rejected -4.
    # Log-ratios rc = -2 - -3 = 1, rr = -5 - -4 = -1, h = rc - rr = 2.
    base = dict(chosen=T([-2.0]), rejected=T([-5.0]), chosen_tokens=T([4]), rejected_tokens=T([2]),
                ref_chosen=T([-3.0]), ref_rejected=T([-4.0]))
    return PairLogps(**{**base, **kw})


def test_sigmoid_hand_values():
    # beta 0.5: beta h = 1; -logsig(1) = log(1 + e^-1) = 0.3132617.
    loss, m = preference_loss("sigmoid", one_pair(), beta=0.5)
    assert float(loss) == pytest.approx(0.3132617, abs=1e-6)
    # Implicit rewards beta*rc = 0.5, beta*rr = -0.5: margin 1, chosen ahead.
    assert float(m["chosen_reward"]) == pytest.approx(0.5)
    assert float(m["rejected_reward"]) == pytest.approx(-0.5)
    assert float(m["margin"]) == pytest.approx(1.0)
    assert float(m["correct"]) == 1.0 and float(m["pairs"]) == 1.0
    # cDPO eps 0.1: 0.9 * 0.3132617 + 0.1 * -logsig(-1) = 0.3132617 + 0.1 * 1 = 0.4132617
    # (-logsig(-x) = -logsig(x) + x).
    loss, _ = preference_loss("sigmoid", one_pair(), beta=0.5, label_smoothing=0.1)
    assert float(loss) == pytest.approx(0.4132617, abs=1e-6)


def test_robust_dpo_hand_values():
    # Robust DPO (Chowdhury et al. 2024 eq. 8), beta 0.5: beta h = 1, -logsig(1) = 0.3132617,
    # -logsig(-1) = 1.3132617; eps 0.1: (0.9 * 0.3132617 - 0.1 * 1.3132617) / (1 - 0.2)
    # = (0.2819355 - 0.1313262) / 0.8 = 0.1882617. At eps 0 it is DPO's 0.3132617.
    loss, m = preference_loss("robust", one_pair(), beta=0.5, label_smoothing=0.1)
    assert float(loss) == pytest.approx(0.1882617, abs=1e-6)
    assert float(m["margin"]) == pytest.approx(1.0)
    assert float(preference_loss("robust", one_pair(), beta=0.5)[0]) == pytest.approx(0.3132617, abs=1e-6)


def test_ipo_and_hinge_hand_values():
    # IPO beta 0.5: (h - 1/(2*0.5))^2 = (2 - 1)^2 = 1.
    assert float(preference_loss("ipo", one_pair(), beta=0.5)[0]) == pytest.approx(1.0)
    # beta 0.25: (2 - 2)^2 = 0.
    assert float(preference_loss("ipo", one_pair(), beta=0.25)[0]) == pytest.approx(0.0)
    # hinge beta 0.25: max(0, 1 - 0.25 * 2) = 0.5; beta 0.5: max(0, 1 - 1) = 0.
    assert float(preference_loss("hinge", one_pair(), beta=0.25)[0]) == pytest.approx(0.5)
    assert float(preference_loss("hinge", one_pair(), beta=0.5)[0]) == pytest.approx(0.0)


def test_simpo_hand_values_without_reference():
    # mean log-probs: chosen -2/4 = -0.5, rejected -5/2 = -2.5; beta 2, gamma 1:
    # s = 2 * (-0.5 - -2.5) - 1 = 3; -logsig(3) = log(1 + e^-3) = 0.0485874.
    p = one_pair(ref_chosen=None, ref_rejected=None)
    loss, m = preference_loss("simpo", p, beta=2.0, simpo_gamma=1.0)
    assert float(loss) == pytest.approx(0.0485874, abs=1e-6)
    # Rewards are beta x mean log-prob: -1 and -5, margin 4.
    assert float(m["margin"]) == pytest.approx(4.0)


def test_orpo_hand_values():
    # log odds(-0.5) = -0.5 - log(1 - e^-0.5) = 0.4327521; log odds(-2.5) = -2.5 - log(1 - e^-2.5) = -2.4143495;
    # difference 2.8471016, -logsig(2.8471016) = 0.0563919; loss = nll 0.5 + 0.1 * 0.0563919 = 0.5056392.
    p = one_pair(ref_chosen=None, ref_rejected=None)
    loss, m = preference_loss("orpo", p, beta=0.1)
    assert float(loss) == pytest.approx(0.5056392, abs=1e-6)
    assert float(m["nll"]) == pytest.approx(0.5)


def test_orpo_log_odds_is_exact_near_probability_one_in_fp32():
    # log odds = x - log(1 - e^x) for a mean log-prob x. At x = -1e-6:
    #   1 - e^x = -expm1(x) = 1e-6 - 1e-12/2 + ... = 9.999995e-7,
    #   log(9.999995e-7) = log(1e-6) + log(0.9999995) = -13.8155106 - 5e-7 = -13.8155111,
    #   log odds = -1e-6 + 13.8155111 = 13.8155101.
    # At x = -1e-4: 1 - e^x = 1e-4 - 5e-9 = 9.9995e-5 (to 5 places), log = -9.2103404 - 5.0001e-5
    #   = -9.2103904, log odds = -1e-4 + 9.2103904 = 9.2102904.
    # At x = -3 (the other branch): 1 - e^-3 = 0.9502129, log = -0.0510692, log odds = -2.9489308.
    # fp32 1 - exp(x) keeps ~7 digits of e^x, i.e. ~6% of 1e-6: the naive form gives 13.802.
    x = T([-1e-6, -1e-4, -3.0])                        # float32, as training computes it
    got = _log_odds(x)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([13.8155101, 9.2102904, -2.9489308], abs=2e-6)
    # The ORPO loss sees it: chosen mean log-prob -1e-6 (p ~ 1), rejected -3: the odds-ratio term is
    # -logsig(13.8155101 + 2.9489308) = log(1 + e^-16.7644409) = 5.2396e-8; loss = nll 1e-6 + beta * that,
    # at beta 100: 6.2396e-6 (the naive log odds give 6.31e-6).
    p = PairLogps(T([-2e-6]), T([-6.0]), T([2]), T([2]))
    assert float(preference_loss("orpo", p, beta=100.0)[0]) == pytest.approx(6.2396e-6, rel=2e-3)
    assert float(log1mexp(T([-1e-6]))) == pytest.approx(-13.8155111, abs=2e-6)


def test_rpo_sft_weight_adds_chosen_nll():
    # sigmoid 0.3132617 + 2 * nll 0.5 = 1.3132617
    loss, _ = preference_loss("sigmoid", one_pair(), beta=0.5, sft_weight=2.0)
    assert float(loss) == pytest.approx(1.3132617, abs=1e-6)


# TRL's conventions, from its published formulas, at unequal answer lengths (numbers by hand).
# TRL's DPOTrainer with loss_type="ipo" divides every log-prob sum by its answer's token count before the
# loss ("ipo" length-normalises), then (h - 1/(2 beta))^2 per pair, mean over the batch:
#   one_pair(): chosen -2 / 4 tokens = -0.5, ref -3 / 4 = -0.75; rejected -5 / 2 = -2.5, ref -4 / 2 = -2;
#   rc = -0.5 + 0.75 = 0.25, rr = -2.5 + 2 = -0.5, h = 0.75; beta 0.5: (0.75 - 1)^2 = 0.0625.
#   (On sequence sums, this project's default, h = 2 and the loss is (2 - 1)^2 = 1.)
#   TRL logs rewards/* as beta x the SUMMED log-ratios whatever the loss: 0.5 x 1 = 0.5 and 0.5 x -1 = -0.5.
# TRL's rpo_alpha adds alpha x the chosen answers' NLL as one token mean over the batch:
#   pairs a = one_pair() (chosen -2 over 4 tokens) and b (chosen -3 over 1 token, ref -3, rejected -5 / 2,
#   ref -4): DPO sigmoid beta 0.5 per pair: a: h = 2, -logsig(1) = 0.3132617; b: rc = 0, rr = -1, h = 1,
#   -logsig(0.5) = 0.4740770; mean 0.3936693.
#   TRL (token mean): NLL = (2 + 3) / (4 + 1) = 1.0; alpha 2: 0.3936693 + 2 x 1.0 = 2.3936693.
#   This project's default (pair mean of token means): (2/4 + 3/1) / 2 = 1.75: 0.3936693 + 3.5 = 3.8936693.
TRL_B = dict(chosen=T([-3.0]), chosen_tokens=T([1]))


def _cat(*pairs: PairLogps) -> PairLogps:
    return PairLogps(*(torch.cat([getattr(q, f) for q in pairs]) for f in
                       ("chosen", "rejected", "chosen_tokens", "rejected_tokens", "ref_chosen", "ref_rejected")))


def test_ipo_normalize_reproduces_trls_length_normalised_ipo():
    loss, m = preference_loss("ipo", one_pair(), beta=0.5, ipo_normalize=True)
    assert float(loss) == pytest.approx(0.0625)
    assert (float(m["chosen_reward"]), float(m["rejected_reward"])) == pytest.approx((0.5, -0.5))
    assert float(preference_loss("ipo", one_pair(), beta=0.5)[0]) == pytest.approx(1.0)   # the default: sums
    # The conversion rule at equal lengths L: sums give h_sum = L h_mean, so beta_sum = beta_mean / L gives
    # L^2 x TRL's loss. Both sides 2 tokens, L = 2: chosen -2, ref -3, rejected -5, ref -4: h_mean = 1;
    # TRL beta 0.25: (1 - 2)^2 = 1; sums with beta 0.125: (2 - 4)^2 = 4 = L^2 x 1.
    q = one_pair(chosen_tokens=T([2]))
    assert float(preference_loss("ipo", q, beta=0.25, ipo_normalize=True)[0]) == pytest.approx(1.0)
    assert float(preference_loss("ipo", q, beta=0.125)[0]) == pytest.approx(4.0)


def test_sft_mean_token_reproduces_trls_rpo_token_mean():
    both = _cat(one_pair(), one_pair(**TRL_B))
    trl, _ = preference_loss("sigmoid", both, beta=0.5, sft_weight=2.0, sft_mean="token")
    ours, _ = preference_loss("sigmoid", both, beta=0.5, sft_weight=2.0)
    assert float(trl) == pytest.approx(2.3936693, abs=1e-6)
    assert float(ours) == pytest.approx(3.8936693, abs=1e-6)
    # Split into micro-batches of one pair, the step's token count keeps the token mean whole:
    # a: 0.3132617 / 2 + 2 x 2 / 5 = 0.9566309; b: 0.4740770 / 2 + 2 x 3 / 5 = 1.4370385; sum 2.3936693.
    parts = [preference_loss("sigmoid", q, beta=0.5, sft_weight=2.0, sft_mean="token", total_pairs=2,
                             total_chosen_tokens=5)[0] for q in (one_pair(), one_pair(**TRL_B))]
    assert [float(x) for x in parts] == pytest.approx([0.9566309, 1.4370385], abs=1e-6)


def test_total_pairs_makes_micro_batch_shares_add_up():
    # Two pairs in one call == each alone divided by the step's 2 pairs.
    a, b = one_pair(), one_pair(chosen=T([-6.0]))
    both = PairLogps(*(torch.cat([getattr(a, f), getattr(b, f)]) for f in
                       ("chosen", "rejected", "chosen_tokens", "rejected_tokens", "ref_chosen", "ref_rejected")))
    whole = preference_loss("sigmoid", both, beta=0.5)[0]
    parts = preference_loss("sigmoid", a, beta=0.5, total_pairs=2)[0] + preference_loss("sigmoid", b, beta=0.5, total_pairs=2)[0]
    assert float(whole) == pytest.approx(float(parts))
    # Pair b: rc = -3, rr = -1, chosen behind: one correct out of two.
    assert float(preference_loss("sigmoid", both, beta=0.5)[1]["correct"]) == 1.0


def test_kto_hand_values():
    # z0 from mismatched rows: mean(-2 - -2.5, -2 - -1.9) = mean(0.5, -0.1) = 0.2.
    z0 = kto_reference_point(T([-2.0, -2.0]), T([-2.5, -1.9]))
    assert float(z0) == pytest.approx(0.2)
    assert float(kto_reference_point(T([-3.0]), T([-1.0]))) == 0.0   # clamped at 0
    # r = logps - ref = [1, -1]; beta 1: desirable row 1 - sig(1 - 0.2) = 0.3100255,
    # undesirable row 1 - sig(0.2 - -1) = 0.2314752; mean 0.2707504.
    loss, m = kto_loss(T([-1.0, -3.0]), T([-2.0, -2.0]), T([True, False]), z0, beta=1.0)
    assert float(loss) == pytest.approx(0.2707504, abs=1e-6)
    assert float(m["desirable"]) == 1.0
    # undesirable_weight 2 doubles the second row: (0.3100255 + 2 * 0.2314752) / 2 = 0.3864880.
    loss, _ = kto_loss(T([-1.0, -3.0]), T([-2.0, -2.0]), T([True, False]), z0, beta=1.0, undesirable_weight=2.0)
    assert float(loss) == pytest.approx(0.3864880, abs=1e-6)


def test_reference_losses_refuse_missing_reference():
    with pytest.raises(ValueError, match="reference"):
        preference_loss("sigmoid", one_pair(ref_chosen=None, ref_rejected=None), beta=0.1)
    with pytest.raises(ValueError, match="unknown"):
        preference_loss("kto", one_pair(), beta=0.1)


# Independent implementations, written from the papers (per pair, plain torch, no trainfit code).
def ref_formula(name, lc, lr, nc, nr, rc_, rr_, beta, eps, gamma):
    if name == "sigmoid":   # DPO eq. 7, cDPO: expectation over a label flipped with probability eps
        z = beta * ((lc - rc_) - (lr - rr_))
        return -(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))
    if name == "robust":    # robust DPO eq. 8: the flipped label's loss subtracted, over 1 - 2 eps
        z = beta * ((lc - rc_) - (lr - rr_))
        return ((1 - eps) * -torch.log(torch.sigmoid(z)) - eps * -torch.log(torch.sigmoid(-z))) / (1 - 2 * eps)
    if name == "ipo":       # IPO eq. 17: (h - 1/(2 tau))^2
        h = torch.log(torch.exp(lc) * torch.exp(rr_) / (torch.exp(lr) * torch.exp(rc_)))
        return (h - 1 / (2 * beta)) ** 2
    if name == "hinge":
        return torch.clamp(1 - beta * ((lc - rc_) - (lr - rr_)), min=0)
    if name == "simpo":     # SimPO eq. 6
        z = beta / nc * lc - beta / nr * lr - gamma
        return -(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))
    if name == "orpo":      # ORPO eq. 4-7: odds(y|x) = P / (1 - P), P = exp(mean log-prob)
        pc, pr = torch.exp(lc / nc), torch.exp(lr / nr)
        odds_ratio = (pc / (1 - pc)) / (pr / (1 - pr))
        return -lc / nc + beta * -torch.log(torch.sigmoid(torch.log(odds_ratio)))
    raise AssertionError(name)


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb, self.mix, self.out = torch.nn.Embedding(vocab, d), torch.nn.Linear(d, d), torch.nn.Linear(d, vocab)

    def forward(self, ids):   # [b, T] -> logits [b, T, V]; position t sees tokens <= t (a running mean)
        x = self.emb(ids).cumsum(1) / torch.arange(1, ids.shape[1] + 1, dtype=torch.float64)[:, None]
        return self.out(torch.tanh(self.mix(x)))


def seq_logp_loop(model, prompt, answer):
    """Sum of log p(answer token | everything before it), one token at a time."""
    ids = torch.tensor([prompt + answer])
    logits = model(ids)[0]
    total = torch.zeros((), dtype=torch.float64)
    for k, tok in enumerate(answer):
        total = total + torch.log_softmax(logits[len(prompt) + k - 1], -1)[tok]
    return total


PAIRS = [([1, 2, 3], [4, 5], [6]), ([2, 7], [8, 8, 9], [9, 1, 3, 4]), ([5], [3], [2, 2])]


@pytest.mark.parametrize("name", ["sigmoid", "robust", "ipo", "hinge", "simpo", "orpo"])
def test_loss_and_gradients_match_published_formula_fp64(name):
    torch.manual_seed(0)
    policy, ref = TinyLM().double(), TinyLM().double()
    beta, eps, gamma = (0.3, 0.1, 0.4)
    # trainfit: batched answer log-prob sums from one forward over padded rows, then preference_loss.
    rows = [(p, a) for p, c, r in PAIRS for a in (c, r)]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.tensor([p + a + [0] * (width - len(p) - len(a)) for p, a in rows])
    mask = torch.tensor([[0] * len(p) + [1] * len(a) + [0] * (width - len(p) - len(a)) for p, a in rows]).bool()

    def sums(m):
        logp = torch.log_softmax(m(ids)[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]   # [2P, T-1]
        return (logp * mask[:, 1:]).sum(1)                                                     # [2P]

    s, rs = sums(policy), sums(ref).detach()
    n = mask.sum(1)
    p = PairLogps(s[0::2], s[1::2], n[0::2], n[1::2],
                  *((rs[0::2], rs[1::2]) if PREFERENCE_LOSSES[name].reference else (None, None)))
    ours, _ = preference_loss(name, p, beta=beta, label_smoothing=eps if name in ("sigmoid", "robust", "simpo") else 0.0,
                              simpo_gamma=gamma)
    g_ours = torch.autograd.grad(ours, list(policy.parameters()))
    # Independent: token-by-token log-probs, the paper's formula per pair, mean over pairs.
    terms = []
    for pr, c, r in PAIRS:
        lc, lr = seq_logp_loop(policy, pr, c), seq_logp_loop(policy, pr, r)
        with torch.no_grad():
            rc_, rr_ = seq_logp_loop(ref, pr, c), seq_logp_loop(ref, pr, r)
        terms.append(ref_formula(name, lc, lr, len(c), len(r), rc_, rr_, beta,
                                 eps if name in ("sigmoid", "robust", "simpo") else 0.0, gamma))
    theirs = torch.stack(terms).mean()
    g_theirs = torch.autograd.grad(theirs, list(policy.parameters()))
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-10, abs=1e-12)
    assert any(float(g.abs().max()) > 1e-6 for g in g_theirs)   # the comparison is not of zeros
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_kto_loss_and_gradients_match_paper_fp64():
    # KTO eq. 8 with z0 = max(0, mean KL estimate) held constant (TRL computes it without gradient).
    torch.manual_seed(1)
    policy, ref = TinyLM().double(), TinyLM().double()
    rows = [([1, 2], [3, 4], True), ([5], [6, 7, 8], False), ([9, 9], [1], True)]
    # Mismatched rows for z0: prompt i with completion i+1.
    mism = [(rows[i][0], rows[(i + 1) % 3][1]) for i in range(3)]
    with torch.no_grad():
        kl_p = torch.stack([seq_logp_loop(policy, p, c) for p, c in mism])
        kl_r = torch.stack([seq_logp_loop(ref, p, c) for p, c in mism])
    lp = torch.stack([seq_logp_loop(policy, p, c) for p, c, _ in rows])
    with torch.no_grad():
        lr_ = torch.stack([seq_logp_loop(ref, p, c) for p, c, _ in rows])
    des = torch.tensor([d for *_, d in rows])
    z0 = kto_reference_point(kl_p, kl_r)
    ours, _ = kto_loss(lp, lr_, des, z0, beta=0.2, desirable_weight=1.0, undesirable_weight=1.5)
    g_ours = torch.autograd.grad(ours, list(policy.parameters()), retain_graph=True)
    z = max(0.0, float((kl_p - kl_r).mean()))
    terms = []
    for i, (_, _, d) in enumerate(rows):
        r = lp[i] - lr_[i]
        v = 1.0 * torch.sigmoid(0.2 * (r - z)) if d else 1.5 * torch.sigmoid(0.2 * (z - r))
        terms.append((1.0 if d else 1.5) - v)
    theirs = torch.stack(terms).mean()
    g_theirs = torch.autograd.grad(theirs, list(policy.parameters()))
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-10)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert not math.isnan(float(ours.detach()))
