"""The agent examples are planned: the computer-use GRPO example fits one H200 beside vLLM at 50%."""

from __future__ import annotations

from pathlib import Path

from trainfit.config import load_config
from trainfit.plan import plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_cua_example_plans_on_one_h200_with_vllm_at_half_the_card():
    cfg = load_config(EXAMPLES / "cua_grpo_single_gpu.yaml")
    assert cfg.env.type == "http" and cfg.rollout.engine == "vllm" and cfg.rollout.max_turns > 1
    p = plan(cfg, suggest=False)
    assert p.gpu and "H200" in p.gpu and p.num_gpus == 1
    # A training sequence is a whole episode (prompt + turns + observations), not prompt + one answer.
    assert p.seq_len == cfg.episode_tokens() == 16384
    engine = [i for i in p.items if i.group == "engine"]
    assert len(engine) == 1 and "50%" in engine[0].name
    card = p.gpu_memory
    assert abs(engine[0].rollout - 0.5 * card) < 0.01 * card          # the engine's share while generating
    assert engine[0].train < 2 * 2**30                                  # asleep while the policy trains
    assert p.fits is True and p.peak <= p.budget
    assert not p.problems


def test_multi_turn_sequences_and_the_simulated_user_are_planned():
    base = ["model.name=Qwen/Qwen3-8B", "stage=grpo", "task.name=arithmetic", "peft.method=lora",
            "train.global_batch_size=16", "train.micro_batch_size=2", "grpo.num_generations=8", "hardware.gpu=h200", "model.dtype=bf16"]
    single = plan(load_config(None, base), suggest=False)
    multi_cfg = load_config(None, base + ["env.type=simulated_user", "rollout.max_turns=4",
                                          "rollout.max_new_tokens=128", "env.max_observation_tokens=64"])
    multi = plan(multi_cfg, suggest=False)
    # prompt 512 + 4 x (128 + 64) = 1280 tokens per episode
    assert multi.seq_len == 512 + 4 * (128 + 64) and single.seq_len == 512 + 64
    assert any("adapters disabled: no extra weights" in n for n in multi.notes)
    separate = plan(load_config(None, base + ["env.type=simulated_user", "env.user_model=Qwen/Qwen3-4B"]),
                    suggest=False)
    user = [i for i in separate.items if "simulated-user" in i.name]
    assert len(user) == 1 and 7.5e9 < user[0].train < 8.5e9            # ~4.0B params x 2 bytes (bf16), resident
