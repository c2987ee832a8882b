"""trainfit's decoding loop (rollout/decode.py) computes what `model.generate` computes.

Both paths of HFEngine run on the same model, prompts and seeds: the loop (one prefill per distinct
prompt, finished rows dropped from the batch, log-probs read off each step's logits) must return the
same tokens, texts, finish flags and log-probs as `generate` with trainfit's logits processors.
"""

from __future__ import annotations

import pytest
import torch

from trainfit.config import ModelConfig, PeftConfig, RolloutConfig
from trainfit.models.policy import load_policy
from trainfit.rollout import decode as decode_mod
from trainfit.rollout.decode import supports_decode_loop
from trainfit.rollout.hf import HFEngine

CPU = torch.device("cpu")
# Two distinct prompts of different lengths, each 4 times (a GRPO group shape), plus a singleton.
PROMPTS = [[19, 13, 20, 31]] * 4 + [[5, 7]] * 4 + [[40, 41, 42, 43, 44, 45, 46]]


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(name="preset:tiny", seed=2), PeftConfig(), CPU)


def both(model, tok, cfg: RolloutConfig, **kw):
    """(loop, generate) completions for the same call."""
    out = []
    for decoder in ("trainfit", "generate"):
        eng = HFEngine(model, tok, cfg.model_copy(update={"decoder": decoder}))
        out.append(eng.generate(PROMPTS, **kw))
        assert eng.use_decode_loop == (decoder == "trainfit")
    return out


def assert_same(loop, gen, atol=1e-5):
    for a, b in zip(loop, gen):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finished == b.finished
        if b.logprobs is not None:
            assert len(a.logprobs) == len(b.logprobs)
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol)


def test_the_preset_and_common_architectures_use_the_loop(policy):
    assert supports_decode_loop(policy.model)
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4))
    assert not supports_decode_loop(mamba)  # its own cache and input preparation: `generate` stays
    # rollout.decoder: auto follows the model; the engine decides once, on first use.
    for model, want in ((policy.model, True), (mamba, False)):
        eng = HFEngine(model, policy.tokenizer, RolloutConfig())
        assert eng._use_decode_loop() is want and eng.use_decode_loop is want


@pytest.mark.parametrize("kw", [
    dict(greedy=True, logprobs=True),
    dict(seeds=list(range(9)), logprobs=True),
    dict(seeds=list(range(100, 109)), logprobs=True, temperature=0.7),
])
def test_loop_equals_generate(policy, kw):
    loop, gen = both(policy.model, policy.tokenizer, RolloutConfig(max_new_tokens=12), **kw)
    assert_same(loop, gen)
    assert len({tuple(c.token_ids) for c in loop[:4]}) > 1 or kw.get("greedy")  # sampled rows differ


def test_loop_equals_generate_with_top_k_top_p_and_lora(tmp_path):
    lm = load_policy(ModelConfig(name="preset:tiny", seed=5), PeftConfig(method="lora", r=4), CPU)
    with torch.no_grad():
        for n, p in lm.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    cfg = RolloutConfig(max_new_tokens=10, top_k=20, top_p=0.9)
    loop, gen = both(lm.model, lm.tokenizer, cfg, seeds=list(range(9)), logprobs=True)
    assert_same(loop, gen)


def test_loop_stops_on_stop_strings_like_generate(policy):
    tok = policy.tokenizer
    free = HFEngine(policy.model, tok, RolloutConfig(max_new_tokens=12)).generate(PROMPTS, seeds=list(range(9)))
    # A stop string taken from the middle of one sampled completion: that row must end there.
    text = free[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2] if len(text) >= 4 else text[:1]
    cfg = RolloutConfig(max_new_tokens=12, stop=[stop])
    loop, gen = both(policy.model, tok, cfg, seeds=list(range(9)), logprobs=True)
    assert_same(loop, gen)
    assert loop[0].finished and stop in loop[0].text
    # The same seed samples the same tokens up to the stop: the stopped completion is a prefix.
    assert loop[0].token_ids == free[0].token_ids[:len(loop[0].token_ids)]


def test_prefill_once_per_distinct_prompt_and_finished_rows_leave(policy, monkeypatch):
    """3 distinct prompts -> the prefill forward sees 3 rows; once rows end, later forwards see fewer."""
    batch_rows = []
    model = policy.model
    real_forward = model.forward

    def counting_forward(*a, **k):
        batch_rows.append(k["input_ids"].shape[0])
        return real_forward(*a, **k)

    monkeypatch.setattr(model, "forward", counting_forward)
    # Common words as stop strings, so rows end at different steps (a random model seldom says eos).
    cfg = RolloutConfig(max_new_tokens=24, stop=[" over", " two", " she", " the"])
    eng = HFEngine(model, policy.tokenizer, cfg.model_copy(update={"decoder": "trainfit"}))
    outs = eng.generate(PROMPTS, seeds=list(range(9)))
    monkeypatch.undo()
    # Expected batch per forward: the prefill sees the 3 distinct prompts; after step t the rows still
    # generating are those whose completion is longer than t + 1 tokens (or never ended); the batch is
    # compacted to them when they fall under 3/4 of it.
    expected, batch = [3], len(PROMPTS)
    for t in range(max(len(c.token_ids) for c in outs) - 1):
        live = sum(1 for c in outs if not c.finished or len(c.token_ids) > t + 1)
        batch = live if live < 0.75 * batch else batch
        expected.append(batch)
    assert batch_rows == expected
    assert min(expected[1:]) < len(PROMPTS)  # these seeds end rows early: the batch did shrink


def test_rows_are_independent_of_the_batch(policy):
    """A row's completion is the same alone and in a batch that shrinks around it."""
    eng = HFEngine(policy.model, policy.tokenizer, RolloutConfig(max_new_tokens=12, decoder="trainfit"))
    together = eng.generate(PROMPTS, seeds=list(range(9)), logprobs=True)
    alone = [eng.generate([p], seeds=[s], logprobs=True)[0] for s, p in enumerate(PROMPTS)]
    assert_same(together, alone)


def test_decode_stops_at_max_new_and_pads_finished_rows(policy):
    eos = policy.tokenizer.eos_token_id
    calls = []

    def pick(rows, seq, scores, step):  # row 0 ends at once (eos), the others never do
        calls.append(len(rows))
        out = torch.full((len(rows),), 7)
        out[rows == 0] = eos
        return out

    d = decode_mod.decode(policy.model, [[5, 6], [8], [9, 10, 11]], pad_id=0, eos_id=eos, max_new=4, pick=pick,
                          logprob_temperature=1.0)
    assert d.tokens.tolist() == [[eos, 0, 0, 0], [7, 7, 7, 7], [7, 7, 7, 7]]
    assert calls == [3, 2, 2, 2]         # row 0 left the batch after step 0 (2 < 0.75 * 3)
    assert d.logprobs.shape == (3, 4) and (d.logprobs[1:] < 0).all() and (d.logprobs[0, 1:] == 0).all()
