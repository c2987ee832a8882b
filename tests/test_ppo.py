"""Stage ppo on CPU with preset:tiny: it trains policy and critic, micro-batching does not change the
update, SIGKILL + --resume repeats the same losses, a stage rm model scores the rollouts, and the
config rules and the trainer's refusals say what to change."""

from __future__ import annotations


import pytest
import torch

from conftest import tiny_config
from test_resume import QUIET, kill_then_resume, run_cli, train_losses, write_config
from test_rm import rm_config
from trainfit.config import ConfigError, load_config
from trainfit.models.runnable import not_trainable
from trainfit.train.faults import Faults
from trainfit.train.loop import train_stage
from trainfit.train.run import build_stage, run_pipeline


def ppo_cfg(tmp_path, name: str = "run", **over):
    base = {"run_dir": str(tmp_path / name), "train.max_steps": 3, "rollout.max_new_tokens": 5,
            "train.global_batch_size": 4, "train.micro_batch_size": 4, "ppo.value_lr": 3e-3}
    return tiny_config(tmp_path, "ppo", **{**base, **over})


def train(cfg, stage_dir, save: bool = True):
    """build_stage + train_stage; returns (the trained PolicyCritic, its stage, params before training).
    Saving merges LoRA adapters into the weights (the end of training): `save=False` keeps them."""
    loaded, stage, _ = build_stage(cfg, stage_dir)
    before = {k: v.detach().clone() for k, v in loaded.model.named_parameters()}
    train_stage(cfg, loaded, stage, stage_dir, resume=False, console=QUIET, faults=Faults(None),
                save_final=lambda path, **_: stage.save_final(path) if save else path)
    return loaded.model, stage, before


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters() if p.requires_grad])


def test_three_steps_train_policy_and_critic_and_save_both(tmp_path):
    from transformers import AutoModelForSequenceClassification

    cfg = ppo_cfg(tmp_path, **{"ppo.num_mini_batches": 2, "ppo.entropy_coef": 0.01})
    pair, stage, before = train(cfg, tmp_path / "run")
    moved = {k for k, v in pair.named_parameters() if not torch.equal(v.detach(), before[k])}
    assert any(k.startswith("policy.") for k in moved) and any(k.startswith("critic.backbone.") for k in moved)
    assert "critic.head.weight" in moved
    rows = [r for r in __import__("trainfit.train.report", fromlist=["x"]).read_metrics(
        tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward", "kl", "kl_coef", "value_loss", "value_clip_frac", "explained_variance", "returns_mean",
                "advantages_mean", "advantages_std", "clip_frac", "entropy", "policy_loss"):
        assert key in rows[-1], key
    # Steps 1-2 share rollout 0 (2 minibatches): step 2 is off-policy by one update, step 1 is not.
    assert rows[0]["ratio"] == pytest.approx(1.0, abs=1e-5) and rows[1]["ratio"] != pytest.approx(1.0, abs=1e-7)
    # The critic's final dir is a plain sequence classifier whose score is the trained critic's last value.
    critic_dir = tmp_path / "run" / "final" / "critic"
    cls = AutoModelForSequenceClassification.from_pretrained(str(critic_dir)).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = pair.critic(ids, torch.ones_like(ids))[0, -1]
        assert cls(input_ids=ids).logits.item() == pytest.approx(want.item(), rel=1e-4, abs=1e-5)
    # ... which rl_models.value_model loads back as the critic.
    from trainfit.models.value import build_critic

    again = build_critic(ppo_cfg(tmp_path, **{"rl_models.value_model": str(critic_dir)}), stage.tokenizer,
                         torch.device("cpu"))
    with torch.no_grad():
        assert again(ids, torch.ones_like(ids))[0, -1].item() == pytest.approx(want.item(), rel=1e-4, abs=1e-5)


def frozen_storages(module) -> dict[int, int]:
    """{storage address: bytes} of the module's frozen tensors, each storage once."""
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
            for p in module.parameters() if not p.requires_grad}


@pytest.mark.parametrize("shared", [True, False])
def test_lora_critic_has_its_own_adapters(tmp_path, shared):
    cfg = ppo_cfg(tmp_path, **{"peft.method": "lora", "peft.r": 4, "train.max_steps": 1, "train.lr": 1e-2,
                               "ppo.shared_base": shared})
    pair, _, before = train(cfg, tmp_path / "run", save=False)
    moved = {k for k, v in pair.named_parameters() if not torch.equal(v.detach(), before[k])}
    assert any("lora_" in k for k in moved if k.startswith("policy."))
    assert any("lora_" in k for k in moved if k.startswith("critic."))
    assert not any("lora_" not in k for k in moved if k.startswith(("policy.", "critic.backbone."))), \
        "a frozen base weight moved"
    # Shared: the critic's frozen tensors are the policy's own storage; separate: none of them are.
    pol, cri = frozen_storages(pair.policy), frozen_storages(pair.critic)
    assert (set(cri) <= set(pol)) == shared and bool(set(cri) & set(pol)) == shared


def test_shared_base_is_one_copy_for_three_roles(tmp_path):
    """Policy, critic and reference over one base: the critic adds only adapters and a head, the
    reference is the policy with adapters off, and all three compute the same body once adapters are
    off; training moves both roles' adapters and no base weight; the saved critic (merged in a copy)
    leaves the shared base as it was; and shared and separate critics train alike (same losses)."""
    from trainfit.models.policy import reference_context
    from trainfit.train.report import read_metrics

    over = {"peft.method": "lora", "peft.r": 4, "train.max_steps": 2, "train.lr": 1e-2}
    shared_cfg = ppo_cfg(tmp_path, "shared", **over)
    assert shared_cfg.ppo_shared_base()  # the default with peft
    loaded, stage, _ = build_stage(shared_cfg, tmp_path / "shared")
    pair = loaded.model
    pol, cri = frozen_storages(pair.policy), frozen_storages(pair.critic)
    assert set(cri) <= set(pol)
    critic_own = sum(p.numel() * p.element_size() for p in pair.critic.parameters() if p.requires_grad)
    policy_base = sum(pol.values())
    assert critic_own < policy_base / 10  # adapters + head: far below another base
    unique = {p.untyped_storage().data_ptr() for p in pair.parameters()}
    assert len(unique) == len(pol) + sum(1 for p in pair.parameters() if p.requires_grad)
    # The three roles differ only by adapters: with them off, the critic's body is the reference's.
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad(), reference_context(pair.policy, True), pair.critic.backbone.disable_adapter():
        ref_h = pair.policy(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        cri_h = pair.critic.backbone(input_ids=ids).last_hidden_state
    assert torch.equal(ref_h, cri_h)
    base_before = {k: v.detach().clone() for k, v in pair.named_parameters() if not v.requires_grad}
    before = {k: v.detach().clone() for k, v in pair.named_parameters() if v.requires_grad}
    train_stage(shared_cfg, loaded, stage, tmp_path / "shared", resume=False, console=QUIET, faults=Faults(None),
                save_final=lambda path, **_: stage.save_final(path))
    for k, v in pair.named_parameters():
        assert torch.equal(v.detach(), base_before[k]) if k in base_before else True, k
    moved = {k for k, v in pair.named_parameters() if v.requires_grad and not torch.equal(v.detach(), before[k])}
    assert any(k.startswith("policy.") for k in moved) and any(k.startswith("critic.backbone.") for k in moved)
    assert (tmp_path / "shared" / "final" / "critic" / "model.safetensors").exists()
    losses = [r["loss"] for r in read_metrics(tmp_path / "shared" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # A separate critic base starts from the same weights and trains alike: sharing changes memory only.
    train(ppo_cfg(tmp_path, "separate", **over, **{"ppo.shared_base": False}), tmp_path / "separate")
    sep = [r["loss"] for r in read_metrics(tmp_path / "separate" / "metrics.jsonl") if r["kind"] == "train"]
    assert sep == pytest.approx(losses, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("kl_mode,loss_type", [("reward", "dapo"), ("loss", "grpo")])
def test_micro1_accum4_equals_micro4_accum1(tmp_path, kl_mode, loss_type):
    finals = []
    for micro in (4, 1):
        cfg = ppo_cfg(tmp_path, f"m{micro}", **{"train.micro_batch_size": micro, "train.max_steps": 2,
                                                 "ppo.num_mini_batches": 2, "ppo.kl_coef": 0.1,
                                                 "ppo.kl_mode": kl_mode, "grpo.loss_type": loss_type})
        assert cfg.batch_plan().accumulation == 4 // micro
        pair, _, before = train(cfg, tmp_path / f"m{micro}")
        finals.append((flat(pair), torch.cat([before[k].flatten() for k, p in pair.named_parameters()
                                              if p.requires_grad])))
    (a, start), (b, _) = finals
    assert (a - start).norm() > 0
    assert (a - b).norm() / a.norm() < 1e-5
    assert (a - b).norm() / (a - start).norm() < 1e-4  # the updates themselves agree too


@pytest.mark.multiprocess
@pytest.mark.parametrize("peft", ["none", "lora"])  # lora: the critic's adapters over the shared base
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, peft):
    # Two minibatches per rollout: the checkpoint at step 3 is mid-rollout (its buffer must survive),
    # and the adaptive KL coefficient moves, so it must be restored too.
    over = {"train.max_steps": 6, "train.save_every": 3, "ppo.num_mini_batches": 2,
            "ppo.adaptive_kl_target": 0.001, "ppo.adaptive_kl_horizon": 8, "peft.method": peft}
    run_pipeline(ppo_cfg(tmp_path, "ref", **over), console=QUIET)
    expected = train_losses(tmp_path / "ref")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    kill_then_resume(write_config(ppo_cfg(tmp_path, "cut", **over), tmp_path / "cut.yaml"), tmp_path / "cut", expected)


@pytest.mark.slow  # PPO on 2 ranks stays in the default suite through tests/test_ppo_deepspeed.py (ZeRO-3)
def test_two_ddp_ranks_equal_one_rank(tmp_path):
    from safetensors.torch import load_file

    def params(run: str, sub: str) -> torch.Tensor:
        sd = load_file(str(tmp_path / run / "final" / sub / "model.safetensors"))
        return torch.cat([sd[k].flatten() for k in sorted(sd)])

    config = write_config(ppo_cfg(tmp_path, "x", **{"train.micro_batch_size": 2, "ppo.kl_coef": 0.1}),
                          tmp_path / "c.yaml")
    one = run_cli(config, f"run_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli(config, f"run_dir={tmp_path / 'two'}", "distributed.num_gpus=2")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 ranks" in two.stdout
    for sub in ("", "critic"):
        a, b = params("one", sub), params("two", sub)
        assert (a - b).norm() / a.norm() < 1e-5, sub
    for step, loss in train_losses(tmp_path / "one").items():
        assert train_losses(tmp_path / "two")[step] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    # ...and the comparison is not vacuous: three steps moved the policy away from its init.
    from trainfit.config import ModelConfig, PeftConfig
    from trainfit.models.policy import load_policy

    init = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu")).model.state_dict()
    sd = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    assert (torch.cat([init[k].flatten() for k in sorted(sd)]) - params("one", "")).norm() > 1e-3


def test_reward_comes_from_a_stage_rm_model(tmp_path):
    from transformers import AutoModelForSequenceClassification

    rm = run_pipeline(rm_config(tmp_path / "rm", **{"train.max_steps": 2}), console=QUIET)[0]
    # The reward model alone (no reward functions), weighted 2.
    cfg = ppo_cfg(tmp_path, **{"rl_models.reward_model": str(rm.final_dir), "rl_models.reward_dtype": "fp32",
                               "task.rewards": "[]", "ppo.reward_model_weight": 2.0})
    _, stage, _ = build_stage(cfg, tmp_path / "run")
    batch = stage.prepare(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(rm.final_dir)).eval()
    with torch.no_grad():  # each sequence alone, unpadded: plain transformers' score
        scores = torch.tensor([model(input_ids=torch.tensor([s["input_ids"]])).logits.item()
                               for s in stage.rollout.samples])
    assert scores.std() > 0
    assert batch.metrics["reward/reward_model"] == pytest.approx(scores.mean().item(), rel=1e-4, abs=1e-5)
    assert batch.metrics["reward"] == pytest.approx(2 * scores.mean().item(), rel=1e-4, abs=1e-5)


def test_config_rules_and_refusals(tmp_path):
    with pytest.raises(ConfigError, match="tf.ppo_rewards|needs a reward"):
        ppo_cfg(tmp_path, **{"task.rewards": "[]"})
    with pytest.raises(ConfigError, match="needs prompts"):
        load_config(None, ["stage=ppo", "train.device=cpu"])
    with pytest.raises(ConfigError, match="ppo.shared_base=true .*needs adapters"):
        ppo_cfg(tmp_path, **{"ppo.shared_base": True})
    with pytest.raises(ConfigError, match="ppo.shared_base=true with rl_models.value_model"):
        ppo_cfg(tmp_path, **{"ppo.shared_base": True, "peft.method": "lora", "rl_models.value_model": "x"})
    assert not ppo_cfg(tmp_path, **{"peft.method": "lora", "rl_models.value_model": "x"}).ppo_shared_base()
    two = {"distributed.num_gpus": 2, "train.micro_batch_size": 2}
    assert not_trainable(ppo_cfg(tmp_path, **two)) is None  # DDP
    assert not_trainable(ppo_cfg(tmp_path, **two, **{"distributed.strategy": "fsdp"})) is None  # FSDP2 (test_ppo_fsdp.py)
    assert not_trainable(ppo_cfg(tmp_path)) is None
    assert "stage ppo" in not_trainable(tiny_config(tmp_path, "grpo", **{"rl_models.reward_model": "x"}))
