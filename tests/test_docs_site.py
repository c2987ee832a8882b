"""The documentation site (issue 49): the generated pages hold every schema key, command, option and peer
key; the README's measured tables are the records' own; every page is in the nav and every include
exists; the README stays a front door (<= 250 lines, its links resolve) and every section the README
used to hold landed on a page. Pure functions over files: no model, no mkdocs (make docs builds the site
with --strict, which checks the links between pages)."""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import pytest
import typer
import yaml

from bench import readme_numbers
from docs.gen.__main__ import fragments
from docs.gen.cli_ref import cli_reference
from docs.gen.config_ref import config_reference
from docs.gen.peers import PEERS, peer_table
from docs.gen.results import measured, reliability
from docs.gen.tables import cell
from trainfit.app.cli import app
from trainfit.config import field_doc, valid_keys
from trainfit.config.peer_keys import PEER_KEYS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
PAGES = {p.relative_to(DOCS).as_posix(): p.read_text() for p in sorted(DOCS.rglob("*.md"))}


def test_the_config_reference_lists_every_key_with_its_own_description():
    text = config_reference()
    rows = {m.group(1): line for line in text.splitlines() if (m := re.match(r"\| `([\w.]+)` \|", line))}
    assert set(rows) == set(valid_keys())
    for key, line in rows.items():
        doc = field_doc(key)
        assert doc and line.rstrip(" |").endswith(cell(doc)), (key, line)   # the field's description, verbatim


def test_the_cli_reference_lists_every_command_and_option():
    text = cli_reference()

    def walk(group, words):
        for name, command in group.commands.items():
            path = " ".join([*words, name])
            assert f"## trainfit {path}\n" in text, path
            if hasattr(command, "commands"):
                walk(command, [*words, name])
                continue
            for p in command.params:
                for opt in (p.opts if p.param_type_name == "option" else [p.name.upper()]):
                    assert f"`{opt}`" in text, (path, opt)

    walk(typer.main.get_command(app), [])


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_each_coming_from_page_lists_every_key_of_its_tool(peer):
    table = peer_table(peer)
    rows = [r for r in PEER_KEYS if r.peer in (PEERS[peer], "")]
    assert rows
    for r in rows:
        assert re.search(rf"^\| `{re.escape(r.key)}`.*\| `{re.escape(r.trainfit)}` \|", table, flags=re.M), r
    page = PAGES[f"coming-from/{peer}.md"]
    assert f'--8<-- "peer-keys-{peer}.md"' in page


@pytest.mark.parametrize("config", sorted(readme_numbers.CONFIGS))
def test_the_readmes_measured_tables_are_the_records(config):
    # The README's table rows are what bench/readme_numbers.py renders from bench/results/readme_numbers: the
    # same function the benchmarks page uses, so both show the recorded runs' numbers (the prose under a
    # table may be an older renderer's wording: `make readme-numbers REUSE=1` rewrites it).
    shown = README.split(f"<!-- readme-numbers:{config} -->")[1].split(f"<!-- /readme-numbers:{config} -->")[0]
    rows = [line for line in shown.splitlines() if line.startswith("| ")]
    assert len(rows) > 2 and rows == [line for line in measured(config).splitlines() if line.startswith("| ")]


def test_the_reliability_page_says_not_measured_without_its_results_and_draws_them_with(tmp_path):
    assert reliability(tmp_path / "faults.json").startswith("Not measured yet")
    (tmp_path / "faults.json").write_text(json.dumps(
        {"command": "python -m bench.faults", "rows": [{"fault": "kill -9 at step 3", "recovered": True},
                                                      {"fault": "nan_loss:2", "recovered": True}]}))
    text = reliability(tmp_path / "faults.json")
    assert "| fault | recovered |" in text and "| kill -9 at step 3 | True |" in text and "Not measured" not in text


def _nav_pages(nav) -> list[str]:
    out = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_nav_and_every_include_exists():
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))
    nav = _nav_pages(site["nav"])
    assert sorted(nav) == sorted(PAGES), set(nav) ^ set(PAGES)
    generated = set(fragments())
    for page, text in PAGES.items():
        for target in re.findall(r'^--8<-- "([^"]+)"', text, flags=re.M):
            assert target in generated or (ROOT / target).is_file(), (page, target)


def test_the_readme_is_a_front_door():
    assert len(README.splitlines()) <= 250
    for guide in (p for p in PAGES if p.startswith("guides/")):
        assert f"(docs/{guide})" in README, f"README.md does not link the guide docs/{guide}"


def _slug(heading: str) -> str:
    """The anchor of a heading, as Python-Markdown's toc (MkDocs) and GitHub make it."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _anchors(text: str) -> set[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose, flags=re.M)}


def test_the_readmes_links_resolve():
    links = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", README)
    assert len(links) > 20
    for path, anchor in links:
        if path.startswith("http"):
            continue
        target = ROOT / path if path else ROOT / "README.md"
        assert target.exists(), path
        if anchor:
            assert anchor in _anchors(target.read_text()), (path, anchor)


# Where each section of the README before issue 49 went (its heading, kept), and the start of its first
# and of its last paragraph, so a section cannot be dropped or cut short on the way.
MOVED = {
    "Set up and run (two commands)": ("get-started.md", "Both install into `.venv`; the `trainfit` commands",
                                      "Why 80%: GRPO's end point spreads less"),
    "Try an example on CPU": ("examples.md", "Every `examples/*.yaml` trains for a step on",
                              "Beyond that: `rollout.engine=hf` where an example uses"),
    "The config": ("concepts/config.md", "One YAML file, validated by one pydantic", "Mistakes exit with code 2 and one"),
    "Batch semantics (one definition everywhere)": ("concepts/config.md", "- `train.global_batch_size`: samples per",
                                                    "- `train.micro_batch_size`: samples per forward"),
    "Pipelines": ("concepts/stages.md", "A config may list `stages:`; each entry", "In 400 steps the reward model stays"),
    "Stages": ("concepts/stages.md", "GRPO samples `grpo.num_generations` completions per prompt with",
               "All algorithm math (advantages, clipped loss, KL"),
    "Models": ("models.md", "`model.name` takes a Hugging Face hub id,", "Pretraining from scratch: `model.init: random` builds the"),
    "Vision-language models (SFT and continued pretraining)": (
        "models.md", "Image-text-to-text models load through `AutoModelForImageTextToText` and their",
        "GRPO with images: a task's examples may"),
    "Data from where you keep it": ("data.md", "`data.path` and `task.path` (and their `eval_path`) take",
                                    "It builds them with the trainer's loaders:"),
    "Tasks and rewards": ("data.md", "- `task.name: arithmetic` — generated on the",
                          "Math answers beyond Math-Verify: `math_verify` (and `task.name:"),
    "Runs, checkpoints, resume": ("runs.md", "`<run_dir>/config.yaml` (resolved), per stage `metrics.jsonl`,",
                                  "Metrics go to the trackers in `logging.report_to`"),
    "See the run: `report.html` and the episode replay": ("runs.md", "The trainer writes the same `report.html` into",
                                                          "The pictures are made by `python -m"),
    "Plan memory before you launch": ("concepts/planner.md", "`--html` writes one offline page (plotly, inlined):",
                                      "Model-state bytes are counted exactly from the"),
    "Fit, export, doctor": ("concepts/planner.md", "`fit` searches what you left free (micro-batch,",
                            "`fit` searches what you left free (micro-batch,"),
    "OOM recovery": ("runs.md", "When a micro-step runs out of memory,", "When a micro-step runs out of memory,"),
    "Several GPUs and nodes": ("multi-node.md", "`distributed.strategy: auto` means DDP on several ranks,",
                               "Rank 0 writes logs, checkpoints and the"),
    "DeepSpeed ZeRO-3 and CPU offload": ("multi-node.md", "`distributed.zero_stage: 1|2|3` with `offload_optimizer: true`",
                                         "Pretrain, SFT, GRPO and PPO run on one"),
    "Rollout engines": ("concepts/engines.md", "GRPO generates through one interface (`trainfit/rollout/base.py`):",
                        "Engines with their own copy of the"),
    "Asynchronous rollouts (`rollout.mode: async`)": ("concepts/async.md", "With `rollout.mode: async` (stage grpo,",
                                                      "With rollout GPUs, `trainfit plan`'s rollout column"),
    "Agents: multi-turn GRPO with environments": ("agents.md", "`examples/agent_tools.yaml` teaches a random-init",
                                                  "An image part over 32 MiB of"),
    "MiniWoB++: a computer-use environment on 127.0.0.1": ("agents.md", "`trainfit env serve miniwob` runs",
                                                           "Screenshots are deterministic on one machine: the"),
    "A computer-use agent on CPU (`examples/cua_tiny.yaml`)": ("agents.md", "The CPU twin of `examples/cua_grpo_single_gpu.yaml`:",
                                                               "What made the difference: at lr 1e-4"),
    "Serve the policy (`trainfit serve`)": ("serve.md", "An OpenAI-compatible API (FastAPI + uvicorn) for",
                                            "GRPO can roll out against any such"),
    "Tests": ("testing.md", "`make test` runs the CPU suite (tiny", "Every package is pinned: `make test` and"),
    "Not in this version": ("limits.md", "PPO with a quantized base; a quantized base under ZeRO-3", "PPO with a quantized base;"),
}
# The rest of the "Stages" section: the DPO conventions against TRL's, now on the TRL page; the one-card
# ZeRO case of "DeepSpeed ZeRO-3 and CPU offload", now the A800 guide.
MOVED_PARTS = {"coming-from/trl.md": "Where trainfit's convention differs from TRL's (1.16), a copied config",
               "guides/a800-zero-offload.md": "bf16 weights and gradients stay on the card; the 7.6B parameters'"}


@pytest.mark.parametrize("heading", sorted(MOVED))
def test_each_section_of_the_old_readme_is_on_a_page(heading):
    page, first, last = MOVED[heading]
    text = " ".join(PAGES[page].split())
    assert re.search(rf"(^|\n)#{{1,3}} {re.escape(heading)}\n", PAGES[page]), (page, heading)
    section = text[text.index(heading):]
    assert " ".join(first.split()) in section and " ".join(last.split()) in section, (page, heading)


def test_the_parts_moved_to_their_own_pages_are_there():
    for page, start in MOVED_PARTS.items():
        assert " ".join(start.split()) in " ".join(PAGES[page].split()), page
