"""`trainfit fit --allow-screens`: on a plan with environment screenshots, fit may keep fewer screenshots
(rollout.max_images_per_episode) and lower model.max_pixels, only when nothing else fits and never
below the floors rollout.fit_min_images_per_episode and model.fit_min_pixels; what it writes passes
`trainfit train --dry-run`'s checks; with floors that leave nothing fitting it says so. vLLM gets the
pixel limits the trainer's processor uses.

The computer-use example keeping all 12 screenshots (rollout.max_images_per_episode=0) does not fit
its own episode budget: 12 x (2025 + 2) = 24324 tokens > rollout.max_episode_tokens=16384, a plan
problem that no memory knob removes. Plan-only (the 8B from the architecture catalog, the run's
planner cache); nothing trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainfit.app.cli import app
from trainfit.config import ModelConfig, load_config
from trainfit.core import extras
from trainfit.models.shapes import model_source
from trainfit.plan import plan
from trainfit.plan.fit import Allow, fit, override_list
from trainfit.plan.fit_space import screen_ladder
from trainfit.plan.screens import kept_screens, screen_tokens
from trainfit.plan.vision import image_settings
from trainfit.rollout.vllm_engine import mm_limits, mm_processor_kwargs
from trainfit.train.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cua_grpo_single_gpu.yaml"
ALL_SCREENS = "rollout.max_images_per_episode=0"
USER_PIXELS = 2073600   # the example's model.max_pixels

pytestmark = pytest.mark.usefixtures("user_plan_cache")


def cua(*overrides):
    return load_config(EXAMPLE, list(overrides))


def seen(cfg) -> tuple[int, int]:
    """(screenshots kept an episode, image tokens of the heaviest screenshot) of a config."""
    s = image_settings(cfg.model, model_source(cfg.model))
    return kept_screens(cfg.rollout), screen_tokens(s)[1]


@pytest.fixture
def dry_run(tmp_path, hub_cache, monkeypatch):
    """`trainfit train --dry-run`'s config checks (preflight without the plan) on the example with overrides."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(extras, "installed", lambda module: True)   # vllm counts as installed here
    run = [f"run_dir={tmp_path / 'run'}"]
    hub_cache.catalog(load_config(EXAMPLE, run))

    def check(overrides: list[str]) -> None:
        preflight(load_config(EXAMPLE, run + overrides), "dry-run", plan=False)
    return check


def test_the_ladder_descends_to_the_floors_in_suggest_s_steps():
    cfg = cua(ALL_SCREENS, "rollout.fit_min_images_per_episode=3", "model.fit_min_pixels=200000")
    kepts, rungs = screen_ladder(cfg)
    assert kepts == list(range(12, 2, -1))
    assert rungs[0] == (None, 2025)              # the user's own pixels first
    pixels = [px for px, _ in rungs[1:]]
    assert pixels == sorted(pixels, reverse=True) and min(pixels) == 200000  # the floor itself is the last rung
    for (_, hi), (px, lo) in zip(rungs[:-2], rungs[1:-1]):
        assert lo <= hi // 2 and px % 32 ** 2 == 0   # half the image tokens or fewer, whole 32 x 32 tokens
    # A floor above the user's values leaves only the user's setting; a text policy has no screens.
    assert screen_ladder(cua("rollout.fit_min_images_per_episode=4", f"model.fit_min_pixels={USER_PIXELS}")) == \
        ([4], [(None, 2025)])
    assert screen_ladder(cua("model.name=Qwen/Qwen3-8B", "model.max_pixels=null"))[0] == [4]
    assert len(screen_ladder(cua("model.name=Qwen/Qwen3-8B", "model.max_pixels=null"))[1]) == 1


def test_screens_are_lowered_only_when_allowed_keeping_the_most_the_budget_holds(dry_run):
    cfg = cua(ALL_SCREENS)
    assert plan(cfg, gpu="h200", suggest=False).fits is False
    plain = fit(cfg, gpu="h200")
    assert plain.best is None and plain.would_fit_with == ["--allow-screens"]
    res = fit(cfg, gpu="h200", allow=Allow(screens=True))
    b = res.best
    assert b is not None and b.fits and b.tier == 4 and not b.plan.problems
    kept, tokens = seen(b.cfg)
    assert 1 <= kept < 12
    # The most image tokens an episode among the settings that fit: at the user's pixels one more kept
    # screenshot is over the budget, and every lower pixel rung (at most 12 kept) shows fewer tokens.
    assert tokens == 2025 and b.cfg.model.max_pixels == USER_PIXELS
    more = plan(cua(*override_list(b.overrides), f"rollout.max_images_per_episode={kept + 1}"),
                gpu="h200", suggest=False)
    assert more.problems and not more.fits
    assert all(12 * t < kept * tokens for px, t in screen_ladder(cfg)[1][1:])
    # Planned again from the fitted config alone: it fits; and `train --dry-run` accepts the change.
    assert plan(b.cfg).fits
    dry_run([ALL_SCREENS, *override_list(b.overrides)])


def test_a_kept_screenshot_floor_makes_fit_lower_the_pixels_not_below_their_floor(dry_run):
    # Half the image tokens (suggest.py's step) would be max_pixels 1036288; the floor stops it above.
    floors = ["rollout.fit_min_images_per_episode=10", "model.fit_min_pixels=1100000"]
    res = fit(cua(ALL_SCREENS, *floors), gpu="h200", allow=Allow(screens=True))
    b = res.best
    assert b is not None and b.fits and not b.plan.problems
    kept, tokens = seen(b.cfg)
    assert kept >= 10 and 1100000 <= b.cfg.model.max_pixels < USER_PIXELS and tokens < 2025
    # 10 screenshots at the user's pixels do not fit the episode (10 x 2027 > 16384).
    assert plan(cua(ALL_SCREENS, "rollout.max_images_per_episode=10"), gpu="h200", suggest=False).problems
    dry_run([ALL_SCREENS, *floors, *override_list(b.overrides)])


def test_floors_that_leave_nothing_fitting_are_reported(tmp_path):
    floors = ["rollout.fit_min_images_per_episode=9", f"model.fit_min_pixels={USER_PIXELS}"]
    out = CliRunner().invoke(app, ["fit", str(EXAMPLE), ALL_SCREENS, *floors, "--gpu", "h200", "--allow-screens",
                                   "--json", "-o", str(tmp_path / "fit")])
    assert out.exit_code == 1, out.output
    res = json.loads(out.output)
    assert res["fitted"] is None and res["would_fit_with"] == [] and not (tmp_path / "fit").exists()
    assert res["closest"]["problems"] and res["closest"]["knobs"]["screenshots kept an episode"] in {str(k) for k in
                                                                                                     range(9, 13)}
    assert "rollout.fit_min_images_per_episode" in res["screens_floor"]
    assert any("searched down to their floors" in r for r in res["reasons"])


def test_a_config_that_fits_keeps_its_screens_even_when_allowed():
    res = fit(cua(), gpu="h200", allow=Allow(screens=True))
    assert res.best is not None and res.best.tier == 0
    assert not {"rollout.max_images_per_episode", "model.max_pixels"} & set(res.best.overrides)


def test_vllm_gets_the_trainer_s_pixel_limits():
    assert mm_processor_kwargs(ModelConfig(name="preset:vlm-tiny", min_pixels=4096, max_pixels=65536)) == \
        {"min_pixels": 4096, "max_pixels": 65536}
    assert mm_processor_kwargs(ModelConfig(name="preset:vlm-tiny", max_pixels=65536)) == {"max_pixels": 65536}
    assert mm_processor_kwargs(ModelConfig(name="preset:tiny")) == {} and mm_processor_kwargs(None) == {}


def test_vllm_accepts_the_screenshots_an_episode_keeps():
    from trainfit.config import RolloutConfig
    from trainfit.models.presets import preset_config

    vlm, text = preset_config("preset:vlm-tiny"), preset_config("preset:tiny")
    assert mm_limits(RolloutConfig(max_turns=12, max_images_per_episode=4), vlm) == {"image": 4}
    # No image budget, or a text model: vLLM's own default.
    assert mm_limits(RolloutConfig(max_turns=12), vlm) == {}
    assert mm_limits(RolloutConfig(max_turns=12, max_images_per_episode=4), text) == {}
