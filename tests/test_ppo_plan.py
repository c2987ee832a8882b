"""The planner's train phase for stage ppo against one real PPO optimizer step on CPU (preset:small,
fp32): policy, critic (a second backbone + value head, or under LoRA by default adapters + head on the
policy's own base: ppo.shared_base), reference copy, reward model, and the policy and critic
activations of one micro-step, which are alive together (value_model.PolicyCritic)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config


# Long enough completions that the two activation sets are ~20% of the step (planning only one of them
# misses by more than the tolerance); fewer for LoRA, whose traced body runs ~15% above the real one.
# One micro-batch per step (micro = global): the planner's no-accumulation case, gradients appearing in backward.
# LoRA with the shared base (the default) and with a separate critic base: the plan follows either.
# The separate-critic LoRA case (a second base) is slow-only: full and shared-base LoRA are the two the
# default suite keeps (~30 s each on 2 cores).
@pytest.mark.parametrize("method,new,shared", [("none", 48, None), ("lora", 32, True),
                                               pytest.param("lora", 32, False, marks=pytest.mark.slow)])
def test_plan_matches_a_real_ppo_step(tmp_path, method, new, shared):
    from trainfit.models.policy import trainable_parameters
    from trainfit.plan import plan
    from trainfit.plan.tracker import step_peak
    from trainfit.train.loop import accumulate, make_optimizer, seed_step
    from trainfit.train.run import build_stage

    over = {"model.name": "preset:small", "model.dtype": "fp32", "rollout.max_new_tokens": new,
            "train.global_batch_size": 8, "train.micro_batch_size": 8, "ppo.kl_coef": 0.05,
            "rollout.sync_check": "never"}
    if method == "none":  # full fine-tuning: a frozen reference copy; and a frozen reward model
        over.update({"rl_models.reward_model": "preset:small", "rl_models.reward_dtype": "fp32"})
    else:  # LoRA: the reference is the base with adapters off, the critic has its own adapters; an entropy bonus
        over.update({"peft.method": method, "ppo.entropy_coef": 0.01, "ppo.shared_base": shared})
    cfg = tiny_config(tmp_path, "ppo", **over)
    p = plan(cfg, gpu="h100", suggest=False)
    weights = {i.group: i.train for i in p.items if i.name.startswith(("policy weights", "value model weights",
                                                                         "value head"))}
    assert (weights["value"] < weights["policy"] / 10) == bool(shared)  # shared: its head, not a second base
    assert "policy + value forward/backward" in p.substeps
    groups = {i.group for i in p.items}
    assert "value" in groups and ("reference" in groups) == ("reward" in groups) == (method == "none")

    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    pair = loaded.model
    # Every completion runs to max_new_tokens (no eos, no stop string), as the planner plans them.
    stage.engine.eos_id, stage.engine.stop = None, []
    assert (stage.ref_model is not None) == (stage.reward_model is not None) == (method == "none")
    opt = make_optimizer(pair.param_groups(cfg.effective_lr(), cfg.ppo.value_lr), cfg.train, lr=cfg.effective_lr())
    params = trainable_parameters(pair)
    seed_step(cfg.train.seed, 0)
    batch = stage.prepare(0)
    assert all(sum(s["loss_mask"]) == new for s in batch.samples)
    assert max(len(s["input_ids"]) for s in batch.samples) == p.seq_len

    def one_step():
        accumulate(pair, batch, cfg.train.micro_batch_size, stage.loss)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()  # optimizer state exists from here on
    # Resident: the trained pair, and the frozen reference copy and reward model where they exist.
    frozen = [m for m in (stage.ref_model, stage.reward_model) if m is not None]
    measured = step_peak(one_step, torch.nn.ModuleList([pair, *frozen]), opt)
    planned = p.phases["train"].allocated
    if shared:  # the critic's frozen tensors are the policy's (one base in the measured step)
        frozen_ptrs = {q.untyped_storage().data_ptr() for q in pair.policy.parameters() if not q.requires_grad}
        assert all(q.untyped_storage().data_ptr() in frozen_ptrs for q in pair.critic.parameters()
                   if not q.requires_grad)
    assert planned / measured - 1 == pytest.approx(0.0, abs=0.10), (planned, measured)


def test_shared_base_plans_one_base_fewer_for_7b(monkeypatch):
    """ppo_7b_dora_zero3.yaml on one card: sharing the base removes exactly the critic's base weights
    from the plan (Qwen2.5-7B's body without its LM head in bf16, ~13 GiB), nothing else."""
    from pathlib import Path

    from trainfit.config import load_config
    from trainfit.plan import plan

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ex = Path(__file__).resolve().parents[1] / "examples" / "ppo_7b_dora_zero3.yaml"
    one = ["distributed.num_gpus=1", "distributed.zero_stage=0", "distributed.strategy=auto"]
    shared, separate = (plan(load_config(ex, [*one, f"ppo.shared_base={v}"]), suggest=False) for v in ("true", "false"))

    def value_weights(p) -> int:
        return next(i.train for i in p.items if i.name.startswith(("value model weights", "value head")))

    saved = separate.phases["train"].allocated - shared.phases["train"].allocated
    assert saved == value_weights(separate) - value_weights(shared)
    assert 12 * 2**30 < saved < 15 * 2**30  # ~7B bf16 parameters: 2 bytes each


def test_zero3_rollout_gathers_the_critic_too(monkeypatch):
    # PPOStage.prepare runs generation and value scoring inside full_weights(PolicyCritic): under ZeRO-3
    # a separate critic's base is gathered whole beside the policy's; a shared-base critic adds only its
    # adapters' missing partitions.
    from pathlib import Path

    from trainfit.config import load_config
    from trainfit.plan import plan

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ex = Path(__file__).resolve().parents[1] / "examples" / "ppo_7b_full.yaml"

    def gathers(*over):
        p = plan(load_config(ex, list(over)), suggest=False)
        return {i.group: i.rollout for i in p.items if "gathered whole" in i.name}

    full = gathers()
    assert full["value"] > 0.8 * full["policy"]  # the critic's base (no LM head) gathered like the policy's
    shared = gathers("peft.method=lora", "ppo.shared_base=true")
    assert 0 < shared["value"] < 0.01 * shared["policy"]


@pytest.mark.parametrize("method,shared", [("none", None), ("lora", True), ("lora", False)])
def test_plan_counts_the_parameters_the_trainer_counts(tmp_path, method, shared):
    """The plan's parameter line names its models; the trained ones (policy + critic) sum to the
    trainer's start line (count_parameters of PolicyCritic), and the frozen reference copy and reward
    model are counted apart, as loaded."""
    from trainfit.models.policy import count_parameters
    from trainfit.plan import plan
    from trainfit.plan.counts import describe
    from trainfit.train.loop import describe_start
    from trainfit.train.run import build_stage

    over = {"ppo.kl_coef": 0.05, "rollout.sync_check": "never"}
    if method == "none":
        over.update({"rl_models.reward_model": "preset:tiny", "rl_models.reward_dtype": "fp32"})
    else:
        over.update({"peft.method": method, "ppo.shared_base": shared})
    cfg = tiny_config(tmp_path, "ppo", **over)
    p = plan(cfg, gpu="h100", suggest=False)
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    total, trainable = count_parameters(loaded.model)
    trained = [c for c in p.counts if c.trained]
    assert [c.model for c in trained] == ["policy", "critic"]
    assert (sum(c.params for c in trained), sum(c.trainable for c in trained)) == (total, trainable)
    assert trained[0].params == count_parameters(loaded.model.policy)[0]
    frozen = {c.model: c.params for c in p.counts if not c.trained}
    want = {name: count_parameters(m)[0] for name, m in (("reference", stage.ref_model),
                                                         ("reward model", stage.reward_model)) if m is not None}
    assert frozen == want and bool(want) == (method == "none")
    # Both lines say what they count, and the totals read the same.
    line = describe_start(cfg, loaded, "cpu")
    assert f"policy + critic {total / 1e6:.2f}M params" in line
    assert f"policy {trained[0].params / 1e3:.1f}K + critic" in describe(p.counts)
    assert f"= {total / 1e3:.1f}K trained together" in describe(p.counts)
