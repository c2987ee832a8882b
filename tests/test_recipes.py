"""Published multi-GPU recipes (examples/recipes/*.yaml: verl, OpenRLHF, EasyR1, LLaMA-Factory, each with its
source link and its own numbers in the header) as a truth table for the planner.

Fast: every recipe loads, names its source and the recipe's numbers, and passes the checks `trainfit train`
makes. Slow (`-m slow`: each recipe's architecture is traced once, about a minute a model on a cold cache):
`plan` says FITS on the recipe's own hardware, except where trainfit runs the recipe differently from its
framework, and there the plan says the problem that makes the difference (the recipes table in
docs/multi-node.md says why, with the numbers). `bench/fit_speed.py recipes` fits each one and compares step times.
"""

import os
import tempfile
from pathlib import Path

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-recipes-test-"))

import pytest

from trainfit.config import load_config
from trainfit.models.runnable import refusal

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"
NAMES = sorted(p.name for p in RECIPES.glob("*.yaml"))
GiB = 2 ** 30

# Where trainfit runs a recipe differently from its framework and so plans it not to run: the problem the
# plan states. OpenRLHF gives the 70B recipe's vLLM engines (tensor parallel 2) GPUs of their own; trainfit
# colocates vLLM on the training GPUs, where a 70B shard at tensor parallel 2 leaves half a card no KV cache.
DIFFERENCES = {
    "openrlhf_ppo_llama_70b_offload.yaml": "has no room for a KV cache",
}


def test_at_least_ten_recipes_from_four_frameworks():
    assert len(NAMES) >= 10
    assert {n.split("_")[0] for n in NAMES} >= {"verl", "openrlhf", "easyr1", "llamafactory"}
    assert set(DIFFERENCES) <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_recipe_keeps_its_source_and_numbers_and_train_accepts_it(name):
    text = (RECIPES / name).read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any("Source: https://github.com/" in line for line in header), name
    assert any("recipe's own numbers" in line for line in header), name
    cfg = load_config(RECIPES / name)
    assert cfg.hardware.gpu and cfg.world_size >= 4        # multi-GPU, on the card it is planned for
    assert refusal(cfg) is None                             # what the recipe sets, `trainfit train` runs


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_plan_says_fits_on_the_recipes_own_hardware(name, monkeypatch):
    from trainfit.plan import plan

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = plan(load_config(RECIPES / name), suggest=False)
    if name not in DIFFERENCES:
        assert p.fits, (name, p.peak / GiB, p.budget / GiB, p.problems)
        return
    assert not p.fits and any(DIFFERENCES[name] in problem for problem in p.problems), (name, p.problems)
