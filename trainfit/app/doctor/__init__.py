"""`trainfit doctor`: check this machine and lint training configs, each finding with its exact fix.

    from trainfit.app.doctor import Options, run
    report = run(["cfg.yaml", "ds_config.json", "accelerate.yaml"], Options(num_gpus=4))
    report.exit_code, [f.code for f in report.findings], report.to_dict()

Modules: findings (codes, severities, report), machine (versions, GPUs, RAM, ports, extras), files
(reading and classifying files), context (what the files imply together), lint_trainfit,
lint_deepspeed, lint_accelerate, lint_args (vLLM arguments, launch lines, scripts), commands (CLI).
"""

from __future__ import annotations

from typing import Iterable, Optional

from trainfit.app.doctor.context import Context, Options
from trainfit.app.doctor.files import Doc, load_doc
from trainfit.app.doctor.findings import CODES, Finding, Report

__all__ = ["CODES", "Finding", "Options", "Report", "lint_docs", "run"]

# trainfit configs first: the others are checked against what they say (world size, precision).
_ORDER = {"trainfit": 0, "accelerate": 1, "commands": 2, "deepspeed": 3, "vllm": 4, "python": 5, "missing": 6}


def lint_docs(docs: list[Doc], opts: Options, machine: dict) -> list[Finding]:
    from trainfit.app.doctor.lint_accelerate import lint_accelerate
    from trainfit.app.doctor.lint_args import lint_commands, lint_python, lint_vllm_args
    from trainfit.app.doctor.lint_deepspeed import lint_deepspeed
    from trainfit.app.doctor.lint_trainfit import lint_trainfit

    ctx = Context(docs, opts, machine)
    out: list[Finding] = []
    for doc in sorted(docs, key=lambda d: _ORDER.get(d.kind, 9)):
        view = ctx.view(doc)
        if doc.kind == "missing":
            out.append(Finding("tf.schema", "error", doc.error or "missing file", "Pass an existing file.", doc.path))
        elif doc.kind == "trainfit":
            out += lint_trainfit(doc, view)
        elif doc.kind == "deepspeed":
            out += lint_deepspeed(doc, view)
        elif doc.kind == "accelerate":
            out += lint_accelerate(doc, view)
        elif doc.kind == "vllm":
            out += ([Finding("vllm.invalid", "error", f"{doc.path}: {doc.error}.", "Fix the file's syntax.", doc.path)]
                    if doc.error else lint_vllm_args(doc.data, doc.path, view))
        elif doc.kind == "commands":
            out += lint_commands(doc, view)
        elif doc.kind == "python":
            out += lint_python(doc, view)
    return out


def run(files: Iterable[str] = (), opts: Optional[Options] = None, machine: bool = True) -> Report:
    """Machine checks (unless machine=False) and the lint of `files` read as one job."""
    from trainfit.app.doctor import machine as machine_mod

    opts = opts or Options()
    report = Report()
    if machine:
        facts, findings = machine_mod.collect()
        report.machine = facts
        report.add(*findings)
    docs = [load_doc(str(f)) for f in files]
    report.files = [{"path": d.path, "kind": d.kind} for d in docs]
    report.add(*lint_docs(docs, opts, report.machine))
    return report
