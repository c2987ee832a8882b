"""The shape of trainfit/ (ARCHITECTURE.md): layers that import one way, no import circle, and a CI check
that fails when either is broken. The contracts live in pyproject.toml ([tool.importlinter])."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def _lint(root: Path) -> subprocess.CompletedProcess:
    # `root` first, so a planted copy's trainfit is the one linted; then this run's PYTHONPATH, where
    # import-linter and grimp may be installed (pip install --target) rather than in site-packages.
    path = os.pathsep.join([str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    return subprocess.run([*LINT, "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)


def test_the_layer_and_circle_contracts_hold():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


def test_no_module_imports_another_in_a_circle():
    # import-linter's acyclic contract compares siblings; this looks at every module of the package at once.
    g = grimp.build_graph("trainfit", cache_dir=None, exclude_type_checking_imports=True)
    circles = [sorted(c) for c in _cycles(g)]
    assert circles == []


def test_the_contract_fails_on_a_planted_upward_import(tmp_path):
    # A copy of the package with one upward import planted: config (the lowest layer) importing train.
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "trainfit", copy / "trainfit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    base = copy / "trainfit" / "config" / "base.py"
    base.write_text(base.read_text() + "\nimport trainfit.train.run  # noqa: E402,F401\n")
    out = _lint(copy)
    assert out.returncode == 1
    assert "trainfit.config.base -> trainfit.train.run" in out.stdout


def _cycles(g) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in sorted(g.modules):
        if m not in index:
            visit(m)
    return out


def test_the_configs_allowed_names_are_the_registries():
    # config is the lowest layer, so it cannot import algos' registries: its Literals list the names and
    # this test keeps the two in step (order included: it is the order of the error messages).
    from typing import get_args

    from trainfit.algos import ADVANTAGE_ESTIMATORS, LOSS_AGG, PREFERENCE_LOSSES
    from trainfit.config import DPOConfig, GRPOConfig
    from trainfit.config.stages import STAGES, stage_names
    from trainfit.config.schema import StageName

    assert get_args(GRPOConfig.model_fields["advantage"].annotation) == tuple(ADVANTAGE_ESTIMATORS)
    assert set(get_args(GRPOConfig.model_fields["loss_type"].annotation)) == set(LOSS_AGG)
    assert get_args(DPOConfig.model_fields["loss_type"].annotation) == tuple(PREFERENCE_LOSSES)
    assert get_args(StageName) == stage_names() == tuple(STAGES)
