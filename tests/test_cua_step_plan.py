"""The planner's train phase for a screenshot episode against one real GRPO optimizer step on CPU (issue
23 item 6): examples/cua_tiny.yaml's GRPO stage (preset:vlm-tiny, vision tower and projector trained,
env.type http, three turns of 16 new tokens, loss_type grpo with a KL reference copy, 4 optimizer steps
a rollout so the behaviour log-probs are kept) in fp32 against a MiniWoB-like service on 127.0.0.1 that
answers /reset and /step with 160 x 210 PNG screenshots. Measured: planned +8.3% (+6.4% at two turns).

The run is put at the shapes the planner plans, so that the comparison is of the planner's accounting,
not of its bounds: model.max_pixels = 224 x 160 makes the screenshot the heaviest screen the budget
allows (35 image tokens), every screenshot stays (rollout.max_images_per_episode = max_turns), and
rollout.max_episode_tokens is the length of an episode whose turns run to max_new_tokens (measured
first with an engine that never ends a turn), so every row is as long as the planned sequence."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from conftest import tiny_config
from test_vlm_env import ScreenServer, png
from trainfit.envs import HTTPEnv, run_episodes
from trainfit.models.images import load_processor
from trainfit.models.policy import load_tokenizer, trainable_parameters
from trainfit.plan import plan
from trainfit.plan.tracker import step_peak
from trainfit.rollout.base import Completion
from trainfit.tasks import build_task
from trainfit.train.loop import accumulate, make_optimizer, seed_step
from trainfit.train.run import build_stage

SCREEN = (160, 210)   # MiniWoB's screenshot (width x height), envs/miniwob_service.py


class MiniWoBScreens(ScreenServer):
    """As envs/miniwob_service.py answers: /reset the instructions as text, then a screenshot; each
    /step a new screenshot (never done within two turns), reward 1 for an odd-length action."""

    def __init__(self):
        super().__init__(done_at=10 ** 6)

    def answer(self, path, body):
        def shot(k):
            return {"type": "image", "image": base64.b64encode(png((40 * k % 256, 90, 200), SCREEN)).decode()}
        if path == "/reset":
            return {"episode_id": "e", "observation": [{"role": "user", "content": [
                {"type": "text", "text": "Task: click the button. One action per turn: click(x, y)."}, shot(0)]}]}
        if path == "/step":
            return {"observation": [{"role": "user", "content": [shot(body["step"])]}],
                    "reward": float(len(body["action"]) % 2), "done": False}
        return {}


class FullTurns:
    """An engine whose every turn is max_new_tokens ids of a plain token, never an eos."""

    def __init__(self, tok):
        self.id = tok("a", add_special_tokens=False)["input_ids"][0]

    def generate(self, prompts, *, max_new_tokens, **kw):
        return [Completion([self.id] * max_new_tokens, "a" * max_new_tokens, False) for _ in prompts]


def grpo_config(tmp_path, url: str, **over):
    rows = tmp_path / "tasks.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "MiniWoB++ click-test"}],
                                        "answer": "", "seed": i}) + "\n" for i in range(4)))
    return tiny_config(tmp_path, "grpo", **{
        "model.name": "preset:vlm-tiny", "model.dtype": "fp32", "model.max_pixels": 224 * 160,
        "model.freeze_vision_tower": False, "model.freeze_projector": False,
        "task.name": "jsonl", "task.path": str(rows), "task.chat": True, "task.num_eval": 1,
        "env.type": "http", "env.url": url, "env.max_observation_tokens": 64, "env.timeout_s": 10, "env.retries": 0,
        "rollout.max_turns": 3, "rollout.max_new_tokens": 16, "rollout.max_prompt_length": 256,
        "rollout.max_images_per_episode": 3, "rollout.temperature": 0.7,
        "grpo.num_generations": 4, "grpo.loss_type": "grpo", "grpo.beta": 0.05, "grpo.num_iterations": 4,
        "train.global_batch_size": 4, "train.micro_batch_size": 4, **over})


def longest_episode(cfg) -> int:
    """Tokens of an episode of `cfg` whose turns all run to max_new_tokens (the episode budget unset)."""
    tok = load_tokenizer(cfg.model)
    r, e = cfg.rollout, cfg.env
    (ep,) = run_episodes(lambda: HTTPEnv(e.url, timeout_s=10.0, retries=0), [build_task(cfg.task).train_example(0)],
                         FullTurns(tok), tok, seeds=[0], max_turns=r.max_turns, max_new_tokens=r.max_new_tokens,
                         max_prompt_length=r.max_prompt_length, max_observation_tokens=e.max_observation_tokens,
                         processor=load_processor(cfg.model, tok), max_images=r.max_images_per_episode)
    assert not ep.failed and ep.turns == r.max_turns and len(ep.images) == r.max_turns
    return len(ep.input_ids)


def test_plan_matches_a_real_grpo_step_on_screenshot_episodes(tmp_path):
    server = MiniWoBScreens()
    try:
        budget = longest_episode(grpo_config(tmp_path, server.url))
        cfg = grpo_config(tmp_path, server.url, **{"rollout.max_episode_tokens": budget})
        p = plan(cfg, gpu="h100", suggest=False)
        screens = p.lengths["screens"]
        assert p.seq_len == budget and screens["kept"] == 3 and screens["image_tokens_per_screenshot"] == 35

        loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
        model = loaded.model.train()   # as train_stage does
        # Every turn runs to max_new_tokens (no eos, no stop string), as the planner plans them.
        stage.engine.eos_id, stage.engine.stop = None, []
        params = trainable_parameters(model)
        opt = make_optimizer(params, cfg.train, lr=cfg.effective_lr())
        seed_step(cfg.train.seed, 0)
        batch = stage.prepare(0)
    finally:
        server.close()
    # The real episodes are at the planned shapes: one row an episode (no screenshot dropped), each as
    # long as the planned sequence, holding the kept screenshots at the processor's count each, and
    # every policy token of the three turns.
    proc = stage.vision
    assert len(batch.samples) == cfg.train.global_batch_size
    for s in batch.samples:
        assert len(s["input_ids"]) == p.seq_len and sum(s["loss_mask"]) == 3 * cfg.rollout.max_new_tokens
        assert [im.size for im in s["images"]] == [SCREEN] * screens["kept"]
        assert s["input_ids"].count(proc.image_token_id) == screens["kept"] * proc.tokens_for(SCREEN[1], SCREEN[0]) \
            == screens["episode_image_tokens"] - 2 * screens["kept"]

    def one_step():
        accumulate(model, batch, cfg.train.micro_batch_size, stage.loss)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()  # optimizer state exists from here on
    # Resident: the policy and the frozen reference copy (beta > 0 under full fine-tuning).
    assert stage.ref_model is not None
    measured = step_peak(one_step, torch.nn.ModuleList([model, stage.ref_model]), opt)
    planned = p.phases["train"].allocated
    assert planned / measured - 1 == pytest.approx(0.0, abs=0.10), (planned, measured)
