"""The README's "Coming from TRL" table against TRL itself: which of TRL's losses read `label_smoothing`
(from TRL's own source, where trl is installed), and what `dpo.ipo_normalize` logs (by hand, on CPU)."""

from __future__ import annotations

import ast
import importlib.util
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainfit.algos import PairLogps, preference_loss
from trainfit.train.dpo import DPOStage

T = torch.tensor
README = Path(__file__).resolve().parents[1] / "docs" / "coming-from" / "trl.md"   # the table (was in README.md)
TABLE_VERSION = (1, 16)   # the TRL release the README's table describes


def _trl_source(relative: str) -> str:
    """The text of a module of the installed trl, read without importing trl (its import pulls in
    transformers' trainer stack); skipped with the reason where trl is absent or older than the table."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("trl is not installed: the README's TRL table is checked against TRL's own "
                    "dpo_trainer.py where `pip install 'trl==1.16.*'` has put it")
    try:
        installed = version("trl")
    except PackageNotFoundError:
        installed = "0"
    if tuple(int(x) for x in installed.split(".")[:2] if x.isdigit()) < TABLE_VERSION:
        pytest.skip(f"trl {installed} is installed; the README's table describes TRL "
                    f"{'.'.join(map(str, TABLE_VERSION))} or later")
    return (Path(next(iter(spec.submodule_search_locations))) / relative).read_text()


def _branches_reading_label_smoothing(source: str, cls: str, method: str, var: str) -> dict[str, bool]:
    """{loss name: does its branch read label_smoothing} for the `if var == "name": ... elif ...` chains
    inside `cls.method` of `source`."""
    tree = ast.parse(source)
    fn = next(n for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == cls
              for n in c.body if isinstance(n, ast.FunctionDef) and n.name == method)
    out: dict[str, bool] = {}
    for node in ast.walk(fn):
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.Eq)
                and ast.unparse(test.left).endswith(var) and isinstance(test.comparators[0], ast.Constant)):
            body = "\n".join(ast.unparse(s) for s in node.body)
            out[test.comparators[0].value] = "label_smoothing" in body
    return out


def _readme_row(start: str) -> str:
    rows = [line for line in README.read_text().splitlines() if line.startswith(start)]
    assert len(rows) == 1, f"README has {len(rows)} rows starting {start!r}"
    return rows[0]


def test_readme_says_which_trl_dpo_losses_read_label_smoothing():
    branches = _branches_reading_label_smoothing(_trl_source("trainer/dpo_trainer.py"), "DPOTrainer",
                                                 "_compute_loss", "loss_type")
    assert {"sigmoid", "robust", "ipo", "hinge"} <= set(branches), sorted(branches)
    readers = {name for name, reads in branches.items() if reads}
    # The table: sigmoid, ipo and hinge ignore it; robust (and EXO, AOT) read it, and the sigmoid row names
    # every loss that reads it; the last row holds those trainfit does not have.
    assert not branches["sigmoid"] and not branches["ipo"] and not branches["hinge"] and branches["robust"]
    sigmoid_row = _readme_row("| label smoothing with `sigmoid` |")
    assert "ignored" in sigmoid_row
    assert set(re.findall(r"`(\w+)`", sigmoid_row.split(" only ", 1)[1].split(" read it")[0])) == readers
    assert "ignored" in _readme_row("| label smoothing with `ipo`, `hinge` |")
    others = _readme_row("| label smoothing with `exo_pair`")
    assert set(re.findall(r"`(\w+)`", others.split("|")[1])) == readers - {"robust"}


def test_readme_says_trls_simpo_smooths_labels_as_cdpo():
    # SimPO is CPOTrainer's loss_type="simpo" (trl.experimental): cDPO on SimPO's margin, as dpo.loss_type=simpo.
    branches = _branches_reading_label_smoothing(_trl_source("experimental/cpo/cpo_trainer.py"), "CPOTrainer",
                                                 "cpo_loss", "loss_type")
    assert branches["simpo"] and not branches["ipo"] and not branches["hinge"], branches
    assert "cDPO" in _readme_row("| label smoothing with SimPO |")


def test_ipo_normalize_logs_trls_summed_rewards():
    # Two pairs, beta 0.5, ipo_normalize (TRL's IPO). The loss reads length-normalised log-ratios; the
    # logged rewards are beta x the summed log-ratios, as TRL's rewards/chosen and rewards/rejected.
    # Pair a: chosen -2 (4 tokens), ref -3; rejected -5 (2 tokens), ref -4.
    #   sums: rc = 1, rr = -1; normalised: rc = 1/4 = 0.25, rr = -1/2 = -0.5, h = 0.75.
    #   loss (0.75 - 1/(2 x 0.5))^2 = 0.0625; rewards 0.5 x 1 = 0.5, 0.5 x -1 = -0.5, margin 1, chosen ahead.
    # Pair b: chosen -10 (10 tokens), ref -9; rejected -3 (1 token), ref -2.5.
    #   sums: rc = -1, rr = -0.5; normalised: rc = -0.1, rr = -0.5, h = 0.4.
    #   loss (0.4 - 1)^2 = 0.36; rewards -0.5, -0.25, margin -0.25: rejected ahead on the sums although the
    #   normalised margin favours chosen (TRL counts it wrong too: its accuracy compares the summed rewards).
    # Logged (sums / 2 pairs): loss (0.0625 + 0.36) / 2 = 0.21125, chosen_reward (0.5 - 0.5) / 2 = 0,
    # rejected_reward (-0.5 - 0.25) / 2 = -0.375, margin (1 - 0.25) / 2 = 0.375, reward_accuracy 1 / 2 = 0.5.
    # (Normalised rewards would have logged 0.0375, -0.25 and accuracy 1.0.)
    p = PairLogps(chosen=T([-2.0, -10.0]), rejected=T([-5.0, -3.0]), chosen_tokens=T([4, 10]),
                  rejected_tokens=T([2, 1]), ref_chosen=T([-3.0, -9.0]), ref_rejected=T([-4.0, -2.5]))
    loss, m = preference_loss("ipo", p, beta=0.5, ipo_normalize=True)
    sums = {"loss": float(loss), **{k: float(v) for k, v in m.items()}}
    # The stage's own summary of a step's sums, as the loop logs it (a paired, non-KTO step).
    logged = DPOStage.summarize(SimpleNamespace(unpaired=False), SimpleNamespace(totals={}), sums)
    assert logged["loss"] == pytest.approx(0.21125)
    assert logged["chosen_reward"] == pytest.approx(0.0, abs=1e-7)
    assert logged["rejected_reward"] == pytest.approx(-0.375)
    assert logged["margin"] == pytest.approx(0.375)
    assert logged["reward_accuracy"] == pytest.approx(0.5)
