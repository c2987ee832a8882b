"""README sentences that name something checkable are checked (issue 36): the files and folders it names
exist, a test file it says runs in a make target is run by that target, `trainfit --help` names every
stage, and the error paragraphs it shows are what the config gets. Reads files only, no model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainfit.app.cli import app
from trainfit.config import ConfigError, load_config
from trainfit.config.stages import stage_names

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# The repository's own folders: a backticked path under one of them names a file or folder of the project.
OWN = ("trainfit/", "tests/", "bench/", "examples/")
# pytest markers that `make test` deselects (pyproject addopts), and the target that runs each.
MARKER_TARGET = {"deepspeed": "test-deepspeed", "cua": "test-cua"}


def _spans(text: str) -> list[str]:
    """Inline code spans (`...`) outside fenced blocks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", prose)


def test_every_project_path_the_readme_names_exists():
    named = {s.split()[0].rstrip(".,:;)") for s in _spans(README) if s.startswith(OWN)}
    assert len(named) > 20
    missing = [p for p in sorted(named) if not (any(ROOT.glob(p.rstrip("/"))) if "*" in p else (ROOT / p).exists())]
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_a_test_file_said_to_run_in_a_make_target_is_run_by_it():
    claims = re.findall(r"`(tests/[\w.*]+\.py)`,? in `make ([\w-]+)`", " ".join(README.split()))
    assert claims
    for path, target in claims:
        text = "".join(p.read_text() for p in ROOT.glob(path))
        marked = [m for m in MARKER_TARGET if f"pytest.mark.{m}" in text]
        expected = {MARKER_TARGET[m] for m in marked} or {"test"}
        assert target in expected, (f"README.md says {path} runs in `make {target}`, but its tests are marked "
                                    f"{marked} (run by `make {' / make '.join(sorted(expected))}`)")


def test_help_names_every_stage():
    text = " ".join(CliRunner().invoke(app, ["--help"]).output.split()).lower()
    head = text[:text.index("commands")] if "commands" in text else text
    missing = [s for s in stage_names() if not re.search(rf"\b{s}\b", head)]
    assert not missing, f"`trainfit --help` does not name the stages {missing}"


# The README's example mistakes (section "The config") and the override that makes each on grpo_lora.yaml.
MISTAKES = {"Unknown config key 'train.warmup'": "train.warmup=10",
            "train.global_batch_size=12": "train.global_batch_size=12"}


def test_the_readme_error_paragraphs_are_what_the_config_gets():
    block = README[README.index("Mistakes exit with code 2"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n(?=error: )", block.strip())]
    assert len(paragraphs) == len(MISTAKES)
    for shown, (start, override) in zip(paragraphs, MISTAKES.items()):
        assert shown.startswith(f"error: {start}"), shown
        with pytest.raises(ConfigError) as e:
            load_config(ROOT / "examples" / "grpo_lora.yaml", [override])
        assert f"error: {' '.join(str(e.value).split())}" == shown
