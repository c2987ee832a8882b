"""The round trip of every `trainfit import` fixture (tests/data/import/): the peer's file -> the trainfit config ->
`trainfit plan` -> `trainfit train --dry-run`, offline on this machine, as a markdown table; with --write it
replaces the generated parts of docs/import.md (the round-trip table and the per-tool key tables), which
tests/test_import.py checks against fresh imports.

    PYTHONPATH=. python bench/import_roundtrip.py [--write]

Offline stand-ins, each said in the table's last column: a model outside the planner's catalog is planned from the
catalog entry with the same shapes (tests/test_import.py STAND_INS); data not on this machine (verl's parquet, a
LLaMA-Factory dataset_info name, a hub dataset) is replaced by a local file of the same kind for the dry-run (plan
reads the caps instead); vLLM and flash-attention, not installed here, are replaced by rollout.engine=hf and
sdpa for the dry-run (plan lists them as needed on the training machine).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "import.md"
sys.path.insert(0, str(ROOT / "tests"))


def _offline_cache(stand_ins: dict[str, str]) -> None:
    """A Hugging Face cache of this run's own, hub lookups off, holding config.json of the stand-ins and catalog."""
    from huggingface_hub import constants

    from trainfit.models.catalog import catalog_entries

    root = Path(tempfile.mkdtemp()) / "hf"
    os.environ.update(HF_HUB_CACHE=str(root), HF_HUB_OFFLINE="1")
    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = str(root), True
    models = {**{n: stem for stem, e in catalog_entries().items() for n in e["names"]}, **stand_ins}
    for name, stem in models.items():
        snap = root / ("models--" + name.replace("/", "--")) / "snapshots" / ("0" * 40)
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(catalog_entries()[stem]["config"]))
        (snap.parents[1] / "refs").mkdir()
        (snap.parents[1] / "refs" / "main").write_text("0" * 40)


def _dry_overrides(cfg, tmp: Path) -> list[str]:
    """What this machine needs for a dry run of `cfg`: local data, and the engine and kernel it has."""
    from trainfit.config.stages import stage_spec

    spec, out = stage_spec(cfg.stage), []
    if spec.rollout:
        if cfg.task.path:
            out += [f"task.path={ROOT}/examples/data/word_problems.jsonl", "task.eval_path=null", "task.num_eval=20"]
            out += ["task.columns={}"] if cfg.task.columns else []
    elif spec.reads_pairs:
        pairs = tmp / "pairs.jsonl"
        pairs.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "chosen": str(i + 1), "rejected": str(i)}) + "\n"
                                 for i in range(40)))
        out.append(f"data.path={pairs}")
    elif cfg.data.path and not Path(cfg.data.path).expanduser().exists():
        out.append(f"data.path={ROOT}/examples/data/chat_sample.jsonl")
    if cfg.data.columns and not spec.rollout:
        out.append("data.columns={}")   # the local file's own columns
    if cfg.rollout.engine == "vllm" and not importlib.util.find_spec("vllm"):
        out.append("rollout.engine=hf")
    if cfg.model.attn_implementation.startswith("flash") and not importlib.util.find_spec("flash_attn"):
        out.append("model.attn_implementation=sdpa")
    return out


def rows() -> list[dict]:
    from typer.testing import CliRunner

    from test_import import DATA, FIXTURES, PLAN_OVERRIDES, PROMPTS, STAND_INS
    from trainfit.app.cli import app
    from trainfit.config import load_config
    from trainfit.config.importers import finish, import_config
    from trainfit.plan.lengths import missing_locally

    _offline_cache(STAND_INS)
    out = []
    for fixture in FIXTURES:
        tmp = Path(tempfile.mkdtemp())
        tool = fixture.split("/")[0]
        im = import_config(str(DATA / fixture), tool)
        cfg = finish(im)
        path = tmp / "imported.yaml"
        r = CliRunner().invoke(app, ["import", str(DATA / fixture), "--from", tool, "-o", str(path)])
        assert r.exit_code == 0, r.output
        plan_ov = PLAN_OVERRIDES.get(fixture, []) + (
            [f"task.path={PROMPTS}", "task.eval_path=null", "task.num_eval=20"]
            if cfg.task.path and missing_locally(cfg.task.path) else [])
        plan = CliRunner().invoke(app, ["plan", str(path), *plan_ov])
        verdict = re.search(r"^(FITS|DOES NOT FIT|DOES NOT RUN)", plan.output, re.M)
        dry_ov = _dry_overrides(load_config(path, plan_ov), tmp) + PLAN_OVERRIDES.get(fixture, [])
        dry_ov = list(dict.fromkeys(dry_ov + [f"run_dir={tmp}/run"]))
        dry = CliRunner().invoke(app, ["train", str(path), "--dry-run", *dry_ov])
        out.append({"fixture": fixture, "link": im.source_link, "stage": im.stage,
                    "batch": cfg.batch_plan().describe(), "plan_exit": plan.exit_code,
                    "plan": verdict.group(1) if verdict else plan.output.strip()[-200:],
                    "plan_overrides": plan_ov, "dry_exit": dry.exit_code,
                    "dry_error": dry.output[dry.output.find("error:"):].strip()[:300] if dry.exit_code else "",
                    "dry_overrides": [o for o in dry_ov if not o.startswith("run_dir=")],
                    "dropped": len(im.dropped), "mapped": len(im.mapped), "computed": len(im.computed)})
    return out


def table(rs: list[dict]) -> str:
    from trainfit.config.importers.report import fixture_cells

    lines = ["| fixture | stage | trainfit batch | mapped / computed / dropped | `plan` (assumed H100 80GB) | "
             "`train --dry-run` here | stand-ins on this machine |", "|---|---|---|---|---|---|---|"]
    for r in rs:
        plans = f"exit {r['plan_exit']}: {r['plan']}"
        dry = f"exit {r['dry_exit']}" + (" (ready)" if r["dry_exit"] == 0 else f": {r['dry_error']}")
        stand = "; ".join(filter(None, ("plan: " + ", ".join(r["plan_overrides"]) if r["plan_overrides"] else "",
                                        "dry-run: " + ", ".join(r["dry_overrides"]) if r["dry_overrides"] else "")))
        lines.append(f"{fixture_cells(r['fixture'], r['link'], r['stage'], r['batch'])} "
                     f"{r['mapped']} / {r['computed']} / {r['dropped']} | {plans} | {dry} | "
                     f"{re.sub(r'/tmp/[^ ,]*/pairs.jsonl', 'a local pairs file', stand).replace(str(ROOT) + '/', '') or 'none'} |")
    return "\n".join(lines)


def _replace(text: str, name: str, body: str) -> str:
    start, end = f"<!-- generated:{name} -->", f"<!-- end:{name} -->"
    return re.sub(re.escape(start) + ".*?" + re.escape(end), lambda m: f"{start}\n{body}\n{end}", text, flags=re.S)


def main() -> None:
    from trainfit.config.importers import PEERS
    from trainfit.config.importers.report import key_table

    rs = rows()
    print(table(rs))
    if "--write" in sys.argv:
        text = _replace(DOCS.read_text(), "roundtrip", table(rs))
        for peer in PEERS.values():
            text = _replace(text, f"keys-{peer}", key_table(peer))
        DOCS.write_text(text)
        (ROOT / "bench" / "results").mkdir(exist_ok=True)
        (ROOT / "bench" / "results" / "import_roundtrip.json").write_text(json.dumps(rs, indent=1) + "\n")


if __name__ == "__main__":
    main()
