"""bench/cua_eval.py reads its command line as the README and its own docstring write it: key=value
overrides anywhere after the model, before or after the options."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from bench import cua_eval

ROOT = Path(__file__).resolve().parents[1]


def documented_commands() -> list[str]:
    """Every `... -m bench.cua_eval ...` command line in the README, the docs and cua_eval's docstring."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    text = "\n".join(p.read_text() for p in pages) + "\n" + cua_eval.__doc__
    found = re.findall(r"(?:python|\.venv/bin/python) -m bench\.cua_eval ([^`\n]+)", text)
    assert len(found) >= 3, found
    return found


@pytest.mark.parametrize("command", documented_commands())
def test_the_documented_command_lines_parse(command):
    argv = shlex.split(command.replace("<model>", "runs/cua_tiny/0-sft/final"))
    a = cua_eval.parse_args(argv)
    assert a.model == argv[0]
    assert a.overrides == [w for w in argv if "=" in w and not w.startswith("-")]
    if "--episodes" in argv:
        assert a.episodes == int(argv[argv.index("--episodes") + 1])


def test_overrides_before_between_and_after_the_options():
    a = cua_eval.parse_args(["m", "rollout.temperature=0.7", "--episodes", "12", "rollout.max_turns=2",
                             "--sampled", "4", "env.url=http://127.0.0.1:9"])
    assert (a.model, a.episodes, a.sampled) == ("m", 12, 4)
    assert a.overrides == ["rollout.temperature=0.7", "rollout.max_turns=2", "env.url=http://127.0.0.1:9"]
