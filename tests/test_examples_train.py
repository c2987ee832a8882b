"""Every shipped example trains for a step through the real CLI (`trainfit train`), on CPU with the tiny
preset: the README's "Try an example on CPU" overrides, tested. Examples the trainer does not run yet
are refused with exit 2 and the reason, in their own test (none today); an example is refused or
trained as it stands with its overrides (the PPO ones train on one process by override).

The overrides are the smallest found per example: COMMON for all; BIG_GPU where an example is sized
for a big GPU (its batch, generation length); a few more where a piece needs CUDA or a service.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import JSONService
from datasource_helpers import cache_hub_dataset, capybara_rows, gsm8k_rows, use_cache
from trainfit.config import expand_stages, load_config
from trainfit.models.runnable import not_trainable

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))

# The README's lines (keep them the same).
COMMON = ["model.name=preset:tiny", "train.device=cpu", "train.max_steps=1"]
SMALL_EVAL = ["task.num_eval=16"]  # for examples that hold out hundreds of problems for a real accuracy
BIG_GPU = ["train.global_batch_size=16", "train.micro_batch_size=8", "rollout.max_new_tokens=16"]
OVERRIDES = {
    "pretrain.yaml": [],
    "sft_chat.yaml": [],
    "grpo_custom_reward.yaml": [],
    "grpo_lora.yaml": SMALL_EVAL,
    # SFT on expert conversations, then tool-use GRPO (2 turns x 64 tokens x 32 episodes): one small step each.
    "agent_tools.yaml": SMALL_EVAL + ["rollout.max_new_tokens=16", "stages.0.train.max_steps=1",
                                      "stages.1.train.max_steps=1", "stages.1.train.global_batch_size=16",
                                      "stages.1.train.micro_batch_size=8"],
    # Its stages set their own steps and batch, which override the base: cut them by index.
    "demo.yaml": SMALL_EVAL + ["stages.0.train.max_steps=1", "stages.1.train.max_steps=1",
                               "stages.1.train.global_batch_size=16", "stages.1.train.micro_batch_size=16"],
    # A 4-bit base and paged 8-bit AdamW are bitsandbytes on CUDA; CPU support varies by version.
    "qwen3_4b_grpo_4bit.yaml": SMALL_EVAL + BIG_GPU + ["model.quantization=none", "train.optimizer=adamw"],
    "qwen3_8b_grpo_lora_h200.yaml": SMALL_EVAL + BIG_GPU + ["rollout.engine=hf"],  # vLLM needs Linux + CUDA
    # A Mamba stands in for the Mamba; 8-bit AdamW is bitsandbytes on CUDA; one micro-batch, not 32.
    "mamba_7b_sft_a800.yaml": ["model.name=preset:mamba-tiny", "train.optimizer=adamw",
                               "train.global_batch_size=4", "train.micro_batch_size=4"],
    # vLLM and flash-attention need CUDA; the remote desktop service is stood in by SandboxStandIn.
    "cua_grpo_single_gpu.yaml": BIG_GPU + ["rollout.engine=hf", "model.attn_implementation=sdpa",
                                           "rollout.max_turns=2"],
    # DeepSpeed ZeRO-2 + CPU Adam in bf16 on one process, as on the card; a smaller batch.
    "sft_7b_zero2_offload.yaml": SMALL_EVAL + ["train.global_batch_size=4", "train.micro_batch_size=2"],
}
# PPO on one process, the 7B reward model stood in by a random one; the DoRA example keeps its DeepSpeed
# ZeRO-3 (one rank), the full one trains without DeepSpeed.
PPO_CPU = SMALL_EVAL + BIG_GPU + ["distributed.num_gpus=1", "rl_models.reward_model=preset:tiny",
                                  "rl_models.reward_dtype=fp32"]
OVERRIDES.update({"ppo_7b_full.yaml": PPO_CPU + ["distributed.strategy=auto", "distributed.zero_stage=0"],
                  "ppo_7b_dora_zero3.yaml": PPO_CPU})
# The VLM example keeps its own preset (COMMON's preset:tiny has no vision tower); one step per stage.
OVERRIDES["vlm_tiny.yaml"] = ["model.name=preset:vlm-tiny", "task.num_eval=4", "stages.0.train.max_steps=1",
                              "stages.1.train.max_steps=1", "stages.1.train.global_batch_size=8",
                              "stages.1.train.micro_batch_size=8"]
# Qwen3-VL-8B on 4 GPUs: the tiny VLM stands in (its own preset), one process.
OVERRIDES["qwen3_vl_8b_sft_4gpu.yaml"] = ["model.name=preset:vlm-tiny", "distributed.num_gpus=1"]
# Hub datasets: a copy of the same columns in an offline datasets cache, built in the test (HUB_DATA).
OVERRIDES["grpo_gsm8k.yaml"] = SMALL_EVAL + BIG_GPU
OVERRIDES["sft_hub_chat.yaml"] = ["train.global_batch_size=4", "train.micro_batch_size=2"]
HUB_DATA = {"grpo_gsm8k.yaml": ("openai/gsm8k", "main", {"train": gsm8k_rows(24), "test": gsm8k_rows(8, 100)}),
            "sft_hub_chat.yaml": ("trl-lib/Capybara", "default", {"train": capybara_rows(24),
                                                                 "test": capybara_rows(4, 100)})}
# The run's start says what it read and which column fed which field (issue 25's start line).
START_LINES = {"grpo_gsm8k.yaml": "data: read 24 rows of openai/gsm8k[main] train: prompt <- question, "
                                  "answer <- answer",
               "sft_hub_chat.yaml": "data: read 24 rows of trl-lib/Capybara train: messages <- messages (messages)"}
# SFT -> DPO, one step each; the 7B LoRA DPO on the tiny preset with a CPU-sized batch.
OVERRIDES["dpo_tiny.yaml"] = SMALL_EVAL + ["stages.0.train.max_steps=1", "stages.1.train.max_steps=1",
                                           "stages.1.train.global_batch_size=16", "stages.1.train.micro_batch_size=16"]
OVERRIDES["dpo_7b_lora.yaml"] = SMALL_EVAL + ["train.global_batch_size=4", "train.micro_batch_size=2"]
# SFT -> RM -> PPO, one step each; the PPO stage scores with the RM stage's model (stage:rm).
OVERRIDES["ppo_pipeline_tiny.yaml"] = SMALL_EVAL + [f"stages.{i}.train.max_steps=1" for i in range(3)] + [
    "stages.2.train.global_batch_size=16", "stages.2.train.micro_batch_size=16"]
# The computer-use agent's CPU twin (examples/cua_tiny.yaml): SFT on expert rows written by the test (the
# example's come from `trainfit env expert miniwob`; tests/test_cua_tiny.py runs it against MiniWoB++),
# held-out and GRPO episodes against the stand-in service.
OVERRIDES["cua_tiny.yaml"] = ["model.name=preset:vlm-tiny", "task.num_eval=4", "stages.0.train.max_steps=1",
                              "stages.1.train.max_steps=1", "stages.1.train.global_batch_size=8",
                              "stages.1.train.micro_batch_size=8"]


def _expert_rows(folder: Path) -> Path:
    """Four rows in `trainfit env expert`'s form: the opening screen (a PNG), one click."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (160, 210), (255, 255, 255)).save(folder / "screen.png")
    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "Task: Click the button."},
                                                       {"type": "image", "image": "screen.png"}]},
                          {"role": "assistant", "content": f"click({40 + i}, 100)"}]} for i in range(4)]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "rows.jsonl"


def _refusal(name: str):
    """The trainer's reason for not running some stage of the example (trainfit/models/runnable.py), or None."""
    cfg = load_config(ROOT / "examples" / name, COMMON + OVERRIDES.get(name, []))
    return next((r for r in map(not_trainable, [cfg, *expand_stages(cfg)]) if r), None)


REFUSED = [n for n in EXAMPLES if _refusal(n)]
TRAINED = [n for n in EXAMPLES if n not in REFUSED]


def _engine(name: str) -> str:
    return load_config(ROOT / "examples" / name, COMMON + OVERRIDES.get(name, [])).engine()


# The examples that train under DeepSpeed go to `make test-deepspeed` with the other DeepSpeed runs.
TRAINED_PARAMS = [pytest.param(n, marks=pytest.mark.deepspeed) if _engine(n) == "deepspeed" else n for n in TRAINED]


class SandboxStandIn(JSONService):
    """The computer-use example's environment service, speaking trainfit/envs/http.py's protocol on
    localhost: one opening screen, one action, done, reward 1 for a non-empty action. The real service
    (a sandboxed desktop) cannot run in a test; the trainer's side of the protocol is what is tested."""

    def __init__(self):
        self.paths: list[str] = []
        super().__init__()

    def answer(self, path, body):
        self.paths.append(path)
        if path == "/reset":
            return {"episode_id": str(body["task"].get("task_id")),
                    "observation": [{"role": "user", "content": "Screen: a settings window. Act."}]}
        return {"observation": [], "reward": float(bool(body.get("action", "").strip())), "done": True}


def _train(args):
    from trainfit.app.cli import app

    return CliRunner().invoke(app, ["train", *args])


def test_every_example_is_either_trained_or_refused():
    assert set(TRAINED) == set(OVERRIDES), "add the example's CPU overrides to OVERRIDES (and the README)"
    assert len(EXAMPLES) >= 12


@pytest.mark.parametrize("name", TRAINED_PARAMS)
def test_example_trains_a_step_on_cpu(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples name their data files relative to the repository
    monkeypatch.delenv("TRAINFIT_ENV_API_KEY", raising=False)
    extra, server = list(OVERRIDES[name]), None
    if name in HUB_DATA:  # the hub id resolves offline from a local copy in the datasets cache
        cache_hub_dataset(use_cache(monkeypatch, tmp_path), *HUB_DATA[name], tmp_path / "hub-copy")
    if name in ("cua_grpo_single_gpu.yaml", "cua_tiny.yaml"):
        server = SandboxStandIn()
        extra.append(f"env.url={server.url}")
    if name == "cua_tiny.yaml":
        extra.append(f"stages.0.data.path={_expert_rows(tmp_path / 'expert')}")
    run_dir = tmp_path / "run"
    try:
        r = _train([f"examples/{name}", *COMMON, *extra, f"run_dir={run_dir}"])
    finally:
        if server:
            server.close()
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "Traceback" not in r.output
    if name in START_LINES:
        assert START_LINES[name] in " ".join(r.output.split()), r.output
    summary = json.loads((run_dir / "summary.json").read_text())
    stages = expand_stages(load_config(ROOT / "examples" / name))
    assert [s["stage"] for s in summary["stages"]] == [s.stage for s in stages]
    assert all(int(s["steps"]) == 1 for s in summary["stages"])
    for i, s in enumerate(stages):
        stage_dir = run_dir / f"{i}-{s.stage}" if len(stages) > 1 else run_dir
        steps = [json.loads(ln) for ln in (stage_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in steps if m["kind"] == "train"] == [1]
        assert (stage_dir / "final").is_dir()
    if server:
        assert server.paths.count("/reset") >= 1 and "/step" in server.paths


@pytest.mark.parametrize("name", REFUSED)
def test_example_the_trainer_does_not_run_yet_is_refused_with_the_reason(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    # One process, so that the day the trainer runs these, this cannot spawn the example's 8 ranks.
    r = _train([f"examples/{name}", *COMMON, "distributed.num_gpus=1", f"run_dir={tmp_path / 'run'}"])
    assert r.exit_code == 2, r.output
    assert _refusal(name) in " ".join(r.output.split()) and "Traceback" not in r.output
    assert not (tmp_path / "run" / "summary.json").exists()
