"""What `plan`, `fit` and `hardware` advise holds when it is applied (issue 46): every example is planned
on a couple of cards; each suggestion, applied as its key=value overrides, passes the dry run's config
checks and plans to what it claimed (fits or not, the same peak); `hardware`'s fix for a setup that does
not fit does the same; `fit`'s table names every knob it changed, its message agrees with the table and
with the config it writes, its closest miss is one that runs and reports its real overshoot, and the
faster split it names fits when applied.

Planner only (meta-device models, the run's planner cache), in-process. `fit` searches the examples named
in the issue and a sample of the others (fit over every example on every card takes minutes on 2 cores;
plan and hardware cover every example). The optional packages count as installed (as in
test_advice_accepted.py): a suggestion is judged, not this machine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainfit.app.export import export_all
from trainfit.app.fit_report import KNOB_OF, changes, explain, knobs
from trainfit.config import ConfigError, expand_stages, load_config
from trainfit.core import extras
from trainfit.plan import api
from trainfit.plan.fit import fit
from trainfit.plan.hardware import CATALOG
from trainfit.plan.memory import plan, with_gpus
from trainfit.plan.setups import rank_setups
from trainfit.plan.suggest import accepted
from trainfit.train.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
# A consumer card, a data-centre one, and one too small for anything (every example gets advice there).
CARDS = ("rtx4090", "a100-40gb", "1GB")
GiB = 2 ** 30

pytestmark = pytest.mark.usefixtures("user_plan_cache")  # offline, the run's own planner cache


@pytest.fixture
def as_trained(monkeypatch, target_machine, hub_cache):
    """The examples' folder as the working directory, every optional package installed, and a function
    `accepts(cfg)` that runs the dry run's config checks (preflight without the plan) on the machine the
    config names."""
    monkeypatch.chdir(ROOT)  # the examples' data paths are relative to the repository
    monkeypatch.setattr(extras, "installed", lambda module: True)

    seen: dict[str, str] = {}

    def refusal(cfg) -> str:
        key = cfg.model_dump_json()
        if key not in seen:
            seen[key] = _refusal(cfg)
        return seen[key]

    def _refusal(cfg) -> str:
        hub_cache.catalog(cfg)
        target_machine(max(s.distributed.num_gpus for s in expand_stages(cfg)))
        try:
            preflight(cfg, "dry-run", plan=False)
        except ConfigError as e:
            return str(e)
        return ""

    def accepts(cfg, base=None) -> None:
        """Refused only for what the unchanged `base` is refused for too (cua_tiny's data is generated
        by its README's first command), or not at all."""
        why = refusal(cfg)
        assert not why or (base is not None and why == refusal(base)), f"advice refused by the dry run: {why}"
    return accepts


def _claims_hold(cfg, overrides: list[str], gpu: str, fits: bool, peak: int, accepts) -> None:
    """`overrides` on `cfg`, planned on `gpu`: `trainfit train`'s checks accept it, and it fits as
    claimed with the claimed peak (the same planner: within 0.01 GiB)."""
    trial = accepted(cfg, overrides)
    assert trial is not None, overrides
    accepts(trial, cfg)
    q = plan(trial, gpu=gpu)
    assert bool(q.fits) == fits, (overrides, q.problems, q.peak / GiB)
    assert abs(q.peak - peak) < 0.01 * GiB, (overrides, q.peak / GiB, peak / GiB)


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_suggestion_of_plan_holds_when_applied(name, tmp_path, as_trained):
    cfg = load_config(ROOT / "examples" / name, [f"run_dir={tmp_path / 'run'}"])
    for gpu in CARDS:
        for stage in expand_stages(cfg):
            p = api.plan(stage, gpu=gpu)
            sugs = p.suggestions
            if p.fits:
                assert not sugs
                continue
            # one change of a kind (the keys it sets); when anything fits, only what fits is offered; when
            # nothing does, identical outcomes are said once
            kinds = [frozenset(o.split("=")[0] for o in s.overrides) for s in sugs]
            assert len(set(kinds)) == len(kinds), [s.change for s in sugs]
            if any(s.fits for s in sugs):
                assert all(s.fits for s in sugs), [s.change for s in sugs]
            else:
                assert len({s.peak for s in sugs}) == len(sugs), [s.change for s in sugs]
            for s in sugs:
                assert s.fits or (s.why and "none of this kind fits" in s.change), s.change
                _claims_hold(stage, s.overrides, gpu, s.fits, s.peak, as_trained)


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_fix_hardware_names_holds_when_applied(name, as_trained):
    for cfg in expand_stages(load_config(ROOT / "examples" / name)):   # a pipeline: each stage
        rows = rank_setups(cfg, gpus=[CATALOG["rtx4090"], CATALOG["a100-40gb"]], counts=(1, 2))
        for r in rows:
            if r["fits"] is False and "async" not in r["setup"]:
                fix = r["fix"]
                assert fix is not None and (" ".join(fix["overrides"]) in r["note"]), r
                if fix["overrides"]:
                    _claims_hold(with_gpus(cfg, r["num_gpus"]), fix["overrides"], r["gpu"], fix["fits"],
                                 int(fix["peak_gb"] * GiB), as_trained)
            else:
                assert not r.get("fix"), r


FIT_CASES = [  # (example, --gpu, --num-gpus, overrides): the cases first, then a sample
    ("cua_grpo_single_gpu.yaml", None, None, ()),               # partial checkpointing chosen
    ("grpo_lora.yaml", "h100", 2, ()),                          # an async split is faster
    ("qwen3_8b_grpo_lora_h200.yaml", "rtx4090", None, ()),      # nothing fits: vLLM has no room
    ("qwen3_8b_grpo_lora_h200.yaml", "rtx4090", None, ("rollout.gpu_memory_utilization=0.75",)),
    ("qwen3_8b_grpo_lora_h200.yaml", "rtx4090", 4, ()),         # fits with vLLM tensor parallel (issue 48)
    ("sft_7b_zero2_offload.yaml", "a100-40gb", None, ()),
    ("dpo_7b_lora.yaml", "rtx4090", None, ()),
    ("ppo_7b_full.yaml", "h200", None, ()),
]


def _overrides_after(line: str, command: str) -> list[str]:
    """The key=value words after `command` in a reason line."""
    return [w.rstrip(".") for w in line.split(command, 1)[1].split() if "=" in w]


@pytest.mark.parametrize("name,gpu,num_gpus,overrides", FIT_CASES)
def test_fit_says_what_it_changes_and_its_advice_holds(name, gpu, num_gpus, overrides, tmp_path, as_trained):
    path = ROOT / "examples" / name
    cfg = load_config(path, [f"run_dir={tmp_path / 'run'}", *overrides])
    res = fit(cfg, gpu=gpu, num_gpus=num_gpus)
    reasons = explain(res, str(path))
    text = " ".join(reasons)
    u, b = res.user, res.best
    if b is not None:
        diff = changes(u.cfg, b.cfg)
        # every key fit changed moves its row of the table, and no row moves without one
        assert {KNOB_OF[k] for k in b.overrides} == {k for k, _, _ in diff}, (b.overrides, diff)
        assert ("is faster by more than 1% (estimate): your settings are kept" in text) == (not diff), text
        for knob, before, after in diff:
            assert f"{knob}: {before} -> {after}" in text
        written = load_config(export_all(b.cfg, tmp_path / "fit")["config"])
        assert written.model_dump() == b.cfg.model_dump()   # the file is what the table shows
        assert knobs(written) == knobs(b.cfg) and plan(written).fits
        as_trained(written, cfg)
    # "To fit that instead: trainfit fit PATH [--gpu G] [--num-gpus N] key=value...", and the planner's
    # change when nothing fits: fit with it finds a config that fits and has what it was told to take
    for line in reasons:
        if re.search(r"[Tt]o fit (that instead|with it):", line):
            ovs = _overrides_after(line, str(path))
            again = fit(load_config(path, [f"run_dir={tmp_path / 'run'}", *overrides, *ovs]), gpu=gpu,
                        num_gpus=num_gpus)
            assert again.best is not None, line
            for ov in ovs:
                key, value = ov.split("=", 1)
                section, field = key.split(".", 1)
                assert str(getattr(getattr(again.best.cfg, section), field)).lower() == value.lower(), ov
    if b is None:
        c = res.closest
        assert c is not None and not c.fits
        if c.plan.problems:
            assert "GiB missing" not in text
        else:   # the real overshoot of a plan that runs, planned again
            assert res.missing == c.plan.peak - c.plan.budget > 0
            assert f"{res.missing / GiB:.1f} GiB missing" in text
            q = plan(c.cfg)
            assert not q.fits and not q.problems and q.peak == c.plan.peak
    if name == "cua_grpo_single_gpu.yaml":   # the case: half the layers checkpointed, said so
        assert b is not None and "gradient checkpointing" in {k for k, _, _ in changes(u.cfg, b.cfg)}
    if num_gpus == 4:   # the planner's "split it over GPUs with rollout.tensor_parallel_size", searched by fit
        assert b is not None and b.cfg.rollout.tensor_parallel_size > 1
    if name == "grpo_lora.yaml":   # the faster split is offered once, as an alternative fit would fit
        assert res.split_pick is not None and "Suggested:" not in text
        assert re.search(r"to fit that instead: trainfit fit \S+ --gpu h100-80gb --num-gpus 2 .*rollout.mode=async",
                         text)


def test_fit_writes_nothing_and_says_so_when_nothing_fits(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from trainfit.app.cli import app

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["fit", str(ROOT / "examples" / "qwen3_8b_grpo_lora_h200.yaml"), "--gpu", "rtx4090",
                                 "-o", str(out)])
    text = " ".join(r.output.split())
    assert r.exit_code == 1, r.output
    assert "a config that fits is written" not in text and "wrote config" not in text
    assert f"nothing written to {out}/" in text and not out.exists()
    assert "0.0 GiB missing" not in text and "raise it to" not in text
