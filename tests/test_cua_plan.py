"""The computer-use example's screenshots are planned: image tokens per screenshot as the processor
counts them, the kept screenshots through the vision tower in the training forward (and in HF
generate's prefill), the episode's token budget checked against them with fixes `train` accepts, and
vLLM's multimodal share named. The 8B's architecture comes from the catalog (no download)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from PIL import Image
from rich.console import Console

from test_cua_step_plan import MiniWoBScreens
from test_vlm_env import ScreenServer, episode
from trainfit.config import ModelConfig, load_config
from trainfit.plan import plan, work
from trainfit.plan.memory import verdict
from trainfit.plan.report import render
from trainfit.models.shapes import model_source
from trainfit.plan.suggest import accepted
from trainfit.models.images import load_processor
from trainfit.plan.vision import image_settings
from trainfit.models.vlm_preset import build_vlm_tokenizer
from trainfit.models.shapes import arch_facts
from trainfit.plan.screens import kept_screens, rows_per_episode, screen_tokens

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cua_grpo_single_gpu.yaml"


def cua(*overrides):
    return load_config(EXAMPLE, list(overrides))


def vision_item(p, word="activations"):
    found = [i for i in p.items if i.name.startswith(f"vision tower {word}")]
    assert len(found) <= 1
    return found[0] if found else None


@pytest.mark.parametrize("max_pixels", [64 * 64 * 3, 200 * 200, 224 * 160])
def test_image_tokens_per_screenshot_are_the_processors_count(max_pixels):
    """vlm-tiny's real image processor, at the planned (heaviest) screen, at the square, a 16:9 and a
    MiniWoB 160 x 210 screen of the same budget. 224 x 160 pixels: MiniWoB's screenshot is the heaviest
    screen (35 tokens), the 189 x 189 square takes only 25."""
    mc = ModelConfig(name="preset:vlm-tiny", max_pixels=max_pixels)
    s = image_settings(mc, model_source(mc))
    proc = load_processor(mc, build_vlm_tokenizer())
    (h, w), tokens = screen_tokens(s)
    # No screen takes more than max_pixels / 32^2 tokens (sides in whole 32-pixel tokens within the budget).
    assert tokens == max_pixels // s.factor ** 2
    side, wide = math.isqrt(max_pixels), math.isqrt(max_pixels * 16 // 9)
    for size in ((w, h), (side, side), (wide, wide * 9 // 16), (160, 210)):
        grid = proc.pixels([Image.new("RGB", size, (10, 20, 30))])["image_grid_thw"]
        counted = int(grid.prod()) // s.merge_size ** 2
        assert proc.tokens_for(size[1], size[0]) == counted
        if size == (w, h):
            assert tokens == counted
        assert counted <= tokens   # the planned screen is the heaviest the budget allows
        if size == (160, 210) and max_pixels == 224 * 160:
            assert counted == tokens == 35


def test_the_kept_screenshots_are_what_the_trainer_keeps():
    tok = build_vlm_tokenizer()
    proc = load_processor(ModelConfig(name="preset:vlm-tiny"), tok)
    server = ScreenServer(done_at=99)   # a screenshot after every action, never done
    try:
        for max_turns, max_images in ((4, 2), (4, 0), (2, 5)):
            ep, _ = episode(server, tok, proc, max_turns=max_turns, max_images=max_images)
            r = cua(f"rollout.max_turns={max_turns}", f"rollout.max_images_per_episode={max_images}").rollout
            # This server's reset has no screenshot, so an unbounded episode keeps one fewer than planned.
            assert len(ep.images) == min(max_images or max_turns, max_turns - 1) <= kept_screens(r)
    finally:
        server.close()


def test_cua_example_plans_its_screenshots_through_the_vision_tower():
    cfg = cua()
    p = plan(cfg, suggest=False)
    s = image_settings(cfg.model, model_source(cfg.model))
    screens = p.lengths["screens"]
    # 4 kept (rollout.max_images_per_episode) of at most 12 turns; 1920 x 1080 = 2073600 pixels a screen,
    # 32 x 32 pixels a token on Qwen3-VL: at most 2073600 / 1024 = 2025 tokens (a 1440 x 1440 screen).
    assert screens["kept"] == 4 and screens["image_tokens_per_screenshot"] == screen_tokens(s)[1] == 2025
    assert screens["episode_image_tokens"] == 4 * (2025 + 2) <= cfg.episode_tokens()
    item = vision_item(p)
    assert item is not None and "2025 image tokens per screenshot" in item.name and "4 screenshots" in item.name
    assert item.rollout == 0 and item.train > 0
    assert any(n.startswith("Screenshots: 4 kept") for n in p.notes)
    assert any("vLLM multimodal" in n and "8100 image tokens" in n for n in p.notes)
    # The verdict follows from the phases, the screenshots' activations counted in training.
    assert p.phases["train"].total >= sum(i.train for i in p.items if i.group != "overhead")
    assert p.peak == max(ph.total for ph in p.phases.values()) and p.fits is (p.peak <= p.budget)
    assert verdict(p) == "FITS" and not p.problems
    # Twice the kept screenshots: twice the tower's per-image activations (the fit's constant once).
    more = vision_item(plan(cua("rollout.max_images_per_episode=8"), suggest=False))
    assert 1.8 * item.train < more.train < 2.05 * item.train


def test_hf_generate_runs_the_tower_on_every_episode_s_screens():
    p = plan(cua("rollout.engine=hf", "rollout.batch_size=4"), suggest=False)
    gen = vision_item(p, "forward")
    assert gen is not None and "4 episodes x 4 screenshots" in gen.name and gen.train == 0 and gen.rollout > 0
    assert p.phases["rollout"].total >= sum(i.rollout for i in p.items if i.group != "overhead")
    wider = vision_item(plan(cua("rollout.engine=hf", "rollout.batch_size=8"), suggest=False), "forward")
    assert wider.rollout > 1.8 * gen.rollout


def test_screenshots_over_the_episode_budget_are_a_problem_with_fixes_train_accepts():
    cfg = cua("rollout.max_images_per_episode=0")   # all 12 screens: 12 x 2027 tokens > 16384
    p = plan(cfg)
    assert p.lengths["screens"]["kept"] == 12
    (prob,) = p.problems
    assert "rollout.max_episode_tokens=16384" in prob and p.fits is False
    # The memory fits: the verdict names the token budget, not DOES NOT FIT with a positive headroom (issue 36).
    assert p.headroom > 0 and verdict(p) == "DOES NOT RUN"
    con = Console(record=True, width=300)
    render(p, con)
    line = next(ln for ln in con.export_text().splitlines() if ln.startswith("DOES NOT"))
    assert line.startswith("DOES NOT RUN - 12 kept screenshots") and "exceed rollout.max_episode_tokens=16384" in line
    assert "Memory is not the problem" in line
    # The dry run's and train's exit-1 paragraph says the same.
    from trainfit.train.preflight import Ready

    said = Ready("dry-run", [cfg], plans=[p]).does_not_fit("cua.yaml")
    assert said.startswith(f"stage 0 (grpo) does not run as configured on {p.gpu} (hardware.gpu): 12 kept screenshots")
    assert "memory is not the problem" in said and "does not fit" not in said.split(". `trainfit plan")[0]
    fixes = [w.rstrip(".") for w in prob.split() if w.startswith(("rollout.max_images_per_episode=",
                                                                    "model.max_pixels="))]
    assert len(fixes) == 2
    for fix in fixes:
        trial = accepted(cfg, [fix])
        assert trial is not None, fix
        q = plan(trial, suggest=False)
        assert not q.problems and q.lengths["screens"]["episode_image_tokens"] + 12 * 256 <= 16384
    # The plan's suggestions offer the screenshot knobs too (planned again: they fit).
    offered = {o.split("=")[0] for s in p.suggestions if s.fits for o in s.overrides}
    assert {"rollout.max_images_per_episode", "model.max_pixels"} <= offered


def test_runs_without_screenshots_plan_none():
    text = plan(cua("model.name=Qwen/Qwen3-8B", "model.max_pixels=null"), suggest=False)
    assert "screens" not in text.lengths and vision_item(text) is None
    assert not any("Screenshots" in n or "vLLM multimodal" in n for n in text.notes)


def test_screenshot_drops_keep_gradients_resident_across_the_rows_micro_batches():
    """Dropping screenshots mid-episode trains an episode as several rows (envs/episodes.py), so a step
    without accumulation still runs several micro-batches: the policy's gradients are planned resident
    between them, as under accumulation; with every screenshot kept they appear in the backward only."""
    one = ("train.global_batch_size=8", "train.micro_batch_size=8", "grpo.num_generations=8")
    grads = lambda p: [i for i in p.items if i.name.startswith("policy gradients (accumulating")]  # noqa: E731
    dropping = plan(cua(*one, "rollout.max_images_per_episode=4"), gpu="h200", suggest=False)
    keeping = plan(cua(*one, "rollout.max_images_per_episode=12"), gpu="h200", suggest=False)
    assert dropping.accumulation == keeping.accumulation == 1
    (resident,) = grads(dropping)
    assert resident.train > 0 and "2 micro-steps" in resident.name and not grads(keeping)


def test_an_episode_trains_the_rows_planned_and_the_step_time_counts_them(monkeypatch):
    """An episode whose screenshots are dropped trains as one row per context its turns acted in
    (envs/episodes.py): against a service that opens with a screenshot and answers every action with
    one, an episode that uses all its turns has exactly the planned rows_per_episode; the step's work
    (the FLOP count and the calibrated estimate's token passes) runs each of them."""
    tok = build_vlm_tokenizer()
    proc = load_processor(ModelConfig(name="preset:vlm-tiny"), tok)
    facts = arch_facts("preset:vlm-tiny")
    server = MiniWoBScreens()   # never done: every turn is used
    try:
        for max_turns, max_images in ((4, 1), (4, 2), (3, 3), (2, 0)):
            ep, _ = episode(server, tok, proc, max_turns=max_turns, max_images=max_images)
            assert ep.turns == max_turns and not ep.failed
            cfg = cua("model.name=preset:vlm-tiny", f"rollout.max_turns={max_turns}",
                      f"rollout.max_images_per_episode={max_images}")
            # (4, 1): 4 rows; (4, 2): 3; every screenshot kept: 1
            assert len(ep.rows()) == rows_per_episode(cfg, facts) == max_turns - kept_screens(cfg.rollout) + 1
    finally:
        server.close()
    one = ("train.global_batch_size=8", "train.micro_batch_size=8", "grpo.num_generations=8")
    dropping = plan(cua(*one, "rollout.max_images_per_episode=4"), gpu="h200", suggest=False)   # 12 turns: 9 rows
    keeping = plan(cua(*one, "rollout.max_images_per_episode=12"), gpu="h200", suggest=False)   # 1 row
    per_token = [p.work["pass_tokens"] / (p.micro_batch * p.seq_len) for p in (dropping, keeping)]
    assert per_token[0] == pytest.approx(9 * per_token[1])
    # The same plan with one row an episode: every forward and backward term is 9x smaller.
    monkeypatch.setattr(work, "rows_per_episode", lambda cfg, facts: 1)
    single = plan(cua(*one, "rollout.max_images_per_episode=4", "train.fused_head=off"), gpu="h200", suggest=False)
    monkeypatch.undo()
    nine = plan(cua(*one, "rollout.max_images_per_episode=4", "train.fused_head=off"), gpu="h200", suggest=False)
    assert nine.work["train_flops"] == pytest.approx(9 * single.work["train_flops"])
    assert nine.work["decode_steps"] == single.work["decode_steps"]   # decoding is per turn, not per row
