"""The shape of trainfit/ (ARCHITECTURE.md): layers that import one way, no import circle, and a CI check
that fails when either is broken. The contracts live in pyproject.toml ([tool.importlinter]). Also: what
the command line imports at its start, and on the way to a plan, imports no torch, transformers or peft
at the top of a module (they load only where a cold plan traces, or the trainer runs)."""

from __future__ import annotations

import ast
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


# Where the command line starts (cli and its command modules) and what its command bodies import on the way
# to a warm plan, fit or hardware ranking; tests/test_cli_imports.py runs the commands themselves.
START = ("trainfit.app.cli", "trainfit.train.preflight", "trainfit.plan", "trainfit.plan.fit", "trainfit.plan.setups",
         "trainfit.plan.report", "trainfit.app.export", "trainfit.app.dryrun")
HEAVY = ("torch", "transformers", "peft")


def _top_imports(module: str, modules: dict[str, Path]) -> set[str]:
    """What importing `module` imports: its top-level import statements (inside if / try too, not inside
    functions nor `if TYPE_CHECKING:`), each with the packages above it."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()

    def visit(body: list) -> None:
        for n in body:
            if isinstance(n, ast.Import):
                out.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:  # from . import x / from .sub import x
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - n.level + 1] + ([n.module] if n.module else []))
                out.add(base)
                out.update(f"{base}.{a.name}" for a in n.names if f"{base}.{a.name}" in modules)
            elif isinstance(n, ast.If) and not (isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"):
                visit(n.body)
                visit(n.orelse)
            elif isinstance(n, ast.Try):
                visit(n.body)
    visit(ast.parse(path.read_text()).body)
    return {".".join(m.split(".")[:i]) for m in out for i in range(1, len(m.split(".")) + 1)}


def test_the_command_line_and_a_warm_plan_import_no_heavy_package_at_a_module_top():
    from trainfit.app.cli import COMMAND_MODULES

    modules = {".".join(f.relative_to(ROOT).with_suffix("").parts[:-1 if f.name == "__init__.py" else None]): f
               for f in (ROOT / "trainfit").rglob("*.py")}
    seen = {m: None for m in (*START, *COMMAND_MODULES)}   # module -> the module that imported it
    todo = list(seen)
    while todo:
        m = todo.pop()
        for dep in sorted(_top_imports(m, modules)):
            if dep not in seen and (dep in modules or dep in HEAVY):
                seen[dep] = m
                if dep in modules:
                    todo.append(dep)

    def chain(m: str) -> str:
        return m if seen[m] is None else f"{m} <- {chain(seen[m])}"
    found = [chain(h) for h in HEAVY if h in seen]
    assert found == [], "imported at a module's top: " + "; ".join(found)


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
