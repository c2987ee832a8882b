"""Published multi-GPU recipes (examples/recipes/*.yaml: verl, OpenRLHF, EasyR1, LLaMA-Factory, each with its
source link and its own numbers in the header) as a truth table for the planner.

Fast: every recipe loads, names its source and the recipe's numbers, and passes the checks `trainfit train`
makes. Slow (`-m slow`: each recipe's architecture is traced once, about a minute a model on a cold cache):
`plan` says FITS on the recipe's own hardware, except where trainfit runs the recipe differently from its
framework, and there the plan holds the components that make the difference (the README's recipes table
says why, with these numbers). `bench/fit_speed.py recipes` fits each one and compares step times.
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

# Where trainfit runs a recipe differently from its framework: the components of trainfit's plan that
# its framework does not hold on a GPU (it offloads or shards them), each at least this many GiB.
DIFFERENCES = {
    # verl offloads the reference and the reward model's parameters to CPU RAM; trainfit's FSDP shards the
    # policy and the critic as verl's does but holds both frozen models whole on every GPU.
    "verl_ppo_qwen2_7b_rm.yaml": {"reference policy": 14, "reward model": 13},
    # OpenRLHF partitions the reference and reward models with ZeRO-3 like the actor and critic.
    "openrlhf_ppo_llama3_8b_colocated.yaml": {"reference policy": 14, "reward model": 13,
                                             "ZeRO-3 weights gathered whole": 13},
    # OpenRLHF gives the 70B reference, reward model and vLLM GPUs of their own (Ray placement); trainfit
    # colocates every model on each training GPU.
    "openrlhf_ppo_llama_70b_offload.yaml": {"reference policy": 130, "reward model": 129},
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
    assert not p.fits
    held = {i.name: i for i in p.items}
    for prefix, gib in DIFFERENCES[name].items():
        item = next(i for n, i in held.items() if n.startswith(prefix))
        assert max(item.rollout, item.train) >= gib * GiB, (name, prefix)
