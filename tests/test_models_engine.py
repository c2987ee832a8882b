"""Model loading (presets, local dirs, adapter dirs, dtypes, missing extras) and the HF engine."""

from __future__ import annotations

import sys
import math

import pytest
import torch

from trainfit.config import ConfigError, ModelConfig, PeftConfig, RolloutConfig
from trainfit.models.policy import load_base_model, load_policy
from trainfit.models.save import save_pretrained
from trainfit.rollout.hf import HFEngine
from trainfit.rollout.sampling import SeededGumbel

CPU = torch.device("cpu")


def logits(model, ids=((5, 9, 13, 17, 21),)):
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor(ids)).logits


def test_preset_is_deterministic_and_local_dir_roundtrips(tmp_path):
    a = load_policy(ModelConfig(name="preset:tiny", seed=3), PeftConfig(), CPU)
    b = load_policy(ModelConfig(name="preset:tiny", seed=3), PeftConfig(), CPU)
    c = load_policy(ModelConfig(name="preset:tiny", seed=4), PeftConfig(), CPU)
    assert torch.equal(logits(a.model), logits(b.model))
    assert not torch.equal(logits(a.model), logits(c.model))
    save_pretrained(a, tmp_path / "m")
    back = load_policy(ModelConfig(name=str(tmp_path / "m")), PeftConfig(), CPU)
    assert torch.equal(logits(back.model), logits(a.model))
    assert back.tokenizer("12+7=").input_ids == a.tokenizer("12+7=").input_ids


def test_adapter_dir_loads_merged_into_its_base(tmp_path):
    lm = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(method="lora", r=4), CPU)
    with torch.no_grad():  # make the adapter non-trivial (B starts at zero)
        for n, p in lm.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    want = logits(lm.model)
    save_pretrained(lm, tmp_path / "adapter", base_dir=tmp_path / "base")
    merged, _ = load_base_model(ModelConfig(name=str(tmp_path / "adapter")), CPU)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert torch.allclose(logits(merged), want, atol=1e-5)


def test_dtype_lora_targets_and_dora(tmp_path):
    lm = load_policy(ModelConfig(name="preset:tiny", dtype="bf16"), PeftConfig(method="dora", r=2), CPU)
    trainable = {n: p for n, p in lm.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("lora_magnitude" in n for n in trainable)  # DoRA's magnitude vector
    frozen = [p for p in lm.model.parameters() if not p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in frozen)
    # all-linear covers attention and MLP projections but not the (tied) LM head
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= adapted


def test_qlora_without_bitsandbytes_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: import raises ImportError
    lm = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), CPU)
    save_pretrained(lm, tmp_path / "m")
    with pytest.raises(ConfigError, match=r"trainfit\[bnb\]"):
        load_policy(ModelConfig(name=str(tmp_path / "m"), quantization="4bit"), PeftConfig(method="lora"), CPU)


def test_missing_local_model_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="model.name"):
        load_policy(ModelConfig(name=str(tmp_path / "nope.gguf")), PeftConfig(), CPU)


@pytest.fixture(scope="module")
def engine_model():
    return load_policy(ModelConfig(name="preset:tiny", seed=1), PeftConfig(), CPU)


def test_left_padded_batch_greedy_equals_one_by_one(engine_model):
    eng = HFEngine(engine_model.model, engine_model.tokenizer, RolloutConfig(max_new_tokens=5))
    prompts = [[19, 13, 20, 31], [5], [40, 41, 42, 43, 44, 45, 46]]
    together = eng.generate(prompts, greedy=True)
    alone = [eng.generate([p], greedy=True)[0] for p in prompts]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert all(len(c.token_ids) <= 5 for c in together)


def test_stop_string_ends_completion(engine_model):
    tok = engine_model.tokenizer
    cfg = RolloutConfig(max_new_tokens=12, temperature=1.0)
    torch.manual_seed(0)  # sampling from a random model gives varied tokens; the stop reuses the seed
    plain = HFEngine(engine_model.model, tok, cfg).generate([[19, 13, 20]])[0]
    pieces = [tok.decode([t]) for t in plain.token_ids]
    k = next(i for i, s in enumerate(pieces) if i > 0 and s.strip() and s not in "".join(pieces[:i]))
    torch.manual_seed(0)
    stopped = HFEngine(engine_model.model, tok, cfg.model_copy(update={"stop": [pieces[k]]})).generate([[19, 13, 20]])[0]
    assert stopped.token_ids == plain.token_ids[: k + 1] and stopped.finished
    assert stopped.text.endswith(pieces[k])


def test_eos_is_kept_and_marks_finished(engine_model):
    eng = HFEngine(engine_model.model, engine_model.tokenizer, RolloutConfig())
    eos, pad = eng.eos_id, eng.pad_id
    done = eng._finish([21, 22, eos, pad, pad])
    assert done.token_ids == [21, 22, eos] and done.finished
    cut = eng._finish([21, 22, 23])
    assert cut.token_ids == [21, 22, 23] and not cut.finished


def test_seeded_sampling_is_independent_of_batch_partition(engine_model):
    # Per-row seeds: the same completions whether rows are generated 8 together or 3 at a time.
    eng = HFEngine(engine_model.model, engine_model.tokenizer, RolloutConfig(max_new_tokens=6, temperature=0.9))
    prompts = [[19, 13, 20], [5, 6], [40, 41, 42, 43]] * 3
    seeds = list(range(100, 109))
    together = eng.generate(prompts, seeds=seeds)
    split = eng.generate(prompts, seeds=seeds, batch_size=3)
    assert [c.token_ids for c in together] == [c.token_ids for c in split]
    other = eng.generate(prompts, seeds=[s + 1000 for s in seeds])
    assert [c.token_ids for c in other] != [c.token_ids for c in together]  # the seed does matter


# ---- seeded Gumbel noise (counter-based, float32) -------------------------------------------------

def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.999 quantile of chi-square(df), Wilson-Hilferty (within 1% for df >= 3)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _draws(logits: torch.Tensor, seeds: list[int], steps: int) -> torch.Tensor:
    """Tokens picked by SeededGumbel for `steps` decoding steps, one row per seed: [steps, N]."""
    proc = SeededGumbel(seeds)
    rows = logits.expand(len(seeds), -1).clone()
    return torch.stack([proc(None, rows).argmax(-1) for _ in range(steps)])


def test_seeded_gumbel_samples_the_softmax_distribution():
    # 20000 seeds on a fixed 6-token distribution (one token masked to -inf): the empirical frequencies
    # match softmax at both decoding steps (chi-square, 4 degrees of freedom, 0.999 quantile 18.47),
    # the masked token is never drawn, and step 1's draw is independent of step 0's (joint 5 x 5
    # table against p_i p_j, 24 degrees of freedom, 0.999 quantile 51.18).
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    p = torch.softmax(logits, -1)[:5].double()
    n = 20000
    draws = _draws(logits, list(range(n)), steps=2)                                # [2, N]
    assert (draws < 5).all()
    for step in range(2):
        obs = torch.bincount(draws[step], minlength=5).double()
        chi2 = ((obs - n * p) ** 2 / (n * p)).sum().item()
        assert chi2 < _chi2_critical(4), (step, chi2)
    joint = torch.bincount(draws[0] * 5 + draws[1], minlength=25).double().view(5, 5)
    exp = n * p[:, None] * p[None, :]
    assert ((joint - exp) ** 2 / exp).sum().item() < _chi2_critical(24)
    # rows with neighbouring seeds are independent too (row 2k against row 2k+1, same step)
    pairs = torch.bincount(draws[0, 0::2] * 5 + draws[0, 1::2], minlength=25).double().view(5, 5)
    exp = (n // 2) * p[:, None] * p[None, :]
    assert ((pairs - exp) ** 2 / exp).sum().item() < _chi2_critical(24)


def test_seeded_gumbel_samples_a_wide_distribution():
    # 60 tokens with spread-out probabilities, 40000 seeds; tokens binned so each bin expects >= 20.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(60, generator=g) * 1.5
    p = torch.softmax(logits.double(), -1)
    n = 40000
    obs = torch.bincount(_draws(logits, list(range(10**6, 10**6 + n)), steps=1)[0], minlength=60).double()
    order = torch.argsort(p, descending=True)
    bins, cur = [], []
    for i in order.tolist():
        cur.append(i)
        if n * p[cur].sum() >= 20:
            bins.append(cur)
            cur = []
    if cur:
        bins[-1] += cur
    o = torch.stack([obs[b].sum() for b in bins])
    e = torch.stack([n * p[b].sum() for b in bins])
    assert ((o - e) ** 2 / e).sum().item() < _chi2_critical(len(bins) - 1)


def test_gumbel_noise_depends_on_row_seed_and_step_only():
    from trainfit.rollout.sampling import gumbel_noise, row_step_keys

    alone = gumbel_noise(row_step_keys([5, 7], 3), 1000, torch.device("cpu"))
    mixed = gumbel_noise(row_step_keys([1, 5, 9, 7, 5], 3), 1000, torch.device("cpu"))
    assert torch.equal(mixed[[1, 3, 4]], alone[[0, 1, 0]])
    assert not torch.equal(gumbel_noise(row_step_keys([5], 4), 1000, torch.device("cpu"))[0], alone[0])
    # Standard Gumbel: mean = Euler's gamma 0.5772, variance = pi^2 / 6 = 1.6449; float32, finite,
    # tails cut at -log(-log(2^-24)) = -2.81 and -log(-log(1 - 2^-24)) = 16.6.
    x = gumbel_noise(row_step_keys(range(8), 0), 50000, torch.device("cpu"))
    assert x.dtype == torch.float32 and torch.isfinite(x).all()
    x = x.double()
    assert abs(x.mean().item() - 0.5772) < 0.01 and abs(x.var().item() - math.pi ** 2 / 6) < 0.03
    assert x.min().item() > -2.82 and x.max().item() < 16.7
