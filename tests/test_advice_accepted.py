"""What trainfit suggests, it runs (issue 21): over every example, every suggestion and every piece of
advice printed by `plan`, `train --dry-run` and `fit`, applied as overrides, passes the dry run's
checks (trainfit/train/preflight.py without the plan: exit code != 2).

The optional packages (vLLM, DeepSpeed, bitsandbytes...) count as installed here, so that every
example is planned and advised on any machine: this test is about the config a suggestion makes; a
missing package's refusal (and the suggestion table saying a change needs one) is test_preflight's.
Plan-only: nothing trains; the planner builds meta-device models, from the run's plan cache; the
examples' hub models resolve from a test cache holding their catalog config.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainfit.core import extras
from trainfit.app.cli import app
from trainfit.config import ConfigError, expand_stages, load_config, valid_keys
from trainfit.train.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
SMALL_CARD = "0.5GB"  # not even the CUDA context fits: every example gets the planner's suggestions
_TOKEN = re.compile(r"(?<![\w.\-/])((?:[a-z_]+\.)*[a-z_]+)=([^\s,;)'\"`]+)")
KEYS = set(valid_keys())

FITS_ANYTHING: set[str] = set()
# cua_tiny's SFT rows come from `trainfit env expert miniwob` (its README's first command): `plan` plans it at the
# length caps without them, but the dry run refuses the missing data.path whatever the advice, so its advice
# is judged by adding no refusal of its own to that one.
DATA_GENERATED_FIRST = {"cua_tiny.yaml"}

pytestmark = pytest.mark.usefixtures("user_plan_cache")  # offline, the run's own planner cache


def advice(text: str) -> list[list[str]]:
    """key=value overrides in printed text, for keys of the schema. Overrides separated by spaces only
    are one change (a table row, `trainfit fit cfg.yaml peft.method=lora model.quantization=4bit`);
    ones separated by words are alternatives ("set zero_stage=2 or ...")."""
    groups: list[list[str]] = []
    last_end = None
    for m in _TOKEN.finditer(text):
        key, value = m.group(1), m.group(2).rstrip(".:")
        if key not in KEYS or "{" in value:
            continue
        if last_end is not None and not text[last_end:m.start()].strip():
            groups[-1].append(f"{key}={value}")
        else:
            groups.append([f"{key}={value}"])
        last_end = m.end()
    return groups


def _gpus(cfg) -> int:
    return max(s.distributed.num_gpus for s in expand_stages(cfg))


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _printed_advice(name: str, run: list[str]) -> list[list[str]]:
    path = ROOT / "examples" / name
    groups: list[list[str]] = []
    dry = _invoke("train", path, "--dry-run", *run)
    assert dry.exit_code in (0, 1, 2) and "Traceback" not in dry.output, dry.output
    groups += advice(dry.output)
    for card in ([], ["--gpu", SMALL_CARD]):  # the JSON holds what the table prints: suggestions, notes, problems
        as_json = _invoke("plan", path, *run, *card, "--json")
        if as_json.exit_code not in (0, 1):
            groups += advice(as_json.output)
            continue
        plans = json.loads(as_json.output)
        for p in plans if isinstance(plans, list) else [plans]:
            groups += [s["overrides"] for s in p["suggestions"]]
            groups += [g for line in p["notes"] + p["problems"] for g in advice(line)]
    fit = _invoke("fit", path, *run, "--json", "-o", run[0].split("=", 1)[1] + "-fit")
    if fit.exit_code in (0, 1):
        res = json.loads(fit.output)
        groups += [g for line in res["reasons"] for g in advice(line)]
        if res["fitted"]:
            groups.append(res["fitted"]["overrides"])
    else:
        groups += advice(fit.output)
    return [g for g in groups if g]


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_suggestion_and_advice_passes_the_dry_runs_checks(name, tmp_path, hub_cache, monkeypatch,
                                                             target_machine):
    monkeypatch.chdir(ROOT)  # the examples' data paths are relative to the repository
    monkeypatch.setattr(extras, "installed", lambda module: True)
    run = [f"run_dir={tmp_path / 'run'}"]
    base = load_config(ROOT / "examples" / name, run)
    hub_cache.catalog(base)
    # Each config is checked on the machine it names (its GPUs visible, whatever this one has; the CPU
    # RAM check needs the plan, which this test leaves out): a suggestion is judged, not this machine.
    target_machine(_gpus(base))
    groups = _printed_advice(name, run)
    missing_data = None
    if name in DATA_GENERATED_FIRST:
        with pytest.raises(ConfigError, match="does not exist") as e:
            preflight(base, "dry-run", plan=False)
        missing_data = str(e.value)
    for group in dict.fromkeys(map(tuple, groups)):
        cfg = load_config(ROOT / "examples" / name, run + list(group))
        target_machine(_gpus(cfg))
        try:
            preflight(cfg, "dry-run", plan=False)
        except ConfigError as e:
            if str(e) != missing_data:
                pytest.fail(f"{name}: the advice {' '.join(group)} is refused: {e}")
    assert groups or name in FITS_ANYTHING, f"{name}: no advice printed at all"
