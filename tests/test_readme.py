"""README and documentation sentences that name something checkable are checked (issues 36 and 49): the
files and folders they name exist, a test file said to run in a make target is run by that target,
`trainfit --help` names every stage, the error paragraphs shown are what the config gets, and every
command shown in README.md and docs/**/*.md parses as the CLI parses it. Reads files only, no model;
the commands of the guides are followed as written by tests/test_docs_guides.py (make docs)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from trainfit.app.cli import app
from trainfit.config import ConfigError, load_config
from trainfit.config.stages import stage_names

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# The documentation pages (docs/gen/ writes generated fragments elsewhere: they show no commands). A
# command the CLI does not have yet (docs/import.md names `trainfit import` ahead of it) waits for it.
PENDING = {"import"} - set(typer.main.get_command(app).commands)
DOC_PAGES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))}
TEXT = "\n".join([README, *DOC_PAGES.values()])
# The repository's own folders: a backticked path under one of them names a file or folder of the project.
OWN = ("trainfit/", "tests/", "bench/", "examples/")
# pytest markers that `make test` deselects (pyproject addopts), and the target that runs each.
MARKER_TARGET = {"deepspeed": "test-deepspeed", "cua": "test-cua", "docs": "docs", "fsdp": "test-fsdp",
                 "multiprocess": "test-multiprocess"}


def _spans(text: str) -> list[str]:
    """Inline code spans (`...`) outside fenced blocks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", prose)


def test_every_project_path_the_readme_names_exists():
    named = {s.split()[0].rstrip(".,:;)") for s in _spans(TEXT) if s.startswith(OWN)}
    assert len(named) > 20
    missing = [p for p in sorted(named) if not (any(ROOT.glob(p.rstrip("/"))) if "*" in p else (ROOT / p).exists())]
    assert not missing, f"README.md or docs/ name paths that do not exist: {missing}"


def test_a_test_file_said_to_run_in_a_make_target_is_run_by_it():
    claims = re.findall(r"`(tests/[\w.*]+\.py)`,? in `make ([\w-]+)`", " ".join(TEXT.split()))
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
    block = TEXT[TEXT.index("Mistakes exit with code 2"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n(?=error: )", block.strip())]
    assert len(paragraphs) == len(MISTAKES)
    for shown, (start, override) in zip(paragraphs, MISTAKES.items()):
        assert shown.startswith(f"error: {start}"), shown
        with pytest.raises(ConfigError) as e:
            load_config(ROOT / "examples" / "grpo_lora.yaml", [override])
        assert f"error: {' '.join(str(e.value).split())}" == shown


# Every command the README shows (fenced blocks and inline spans) that runs `trainfit`, `make` or
# `python -m` is checked (issue 36): the subcommand and its options parse as the CLI parses them, the
# project files it names exist, every key=value override is a config key (the whole command validates
# through the schema when it names an example), `--gpu` names a card the planner knows, a make target
# and its VARIABLE=value exist in the Makefile, a module exists; the cheap ones run (`plan`, `config`,
# `keys`). Placeholders (cfg.yaml, <model>, outputs of an earlier command) are not files to check.
MAKEFILE = (ROOT / "Makefile").read_text()
# The tools `trainfit import` reads: their commands are quoted, not run here.
PEER_PACKAGES = ("verl", "openrlhf", "trl", "llamafactory")
STARTS = ("trainfit ", "make ", "python -m ", ".venv/bin/python ", "python3 -m ")


def _shell_lines(text: str) -> list[str]:
    """The shell lines of fenced blocks (continuations joined) and the inline spans, each split into the
    commands it chains (&&, ;, |), comments and a trailing & dropped."""
    lines: list[str] = []
    for block in re.findall(r"```(?!text)[a-z]*\n(.*?)```", text, flags=re.S):   # a text block is output
        lines += block.replace("\\\n", " ").splitlines()
    lines += _spans(text)
    out = []
    for line in lines:
        line = re.sub(r"(^|\s)#.*$", "", line).strip().rstrip("&").strip()
        out += [c.strip() for c in re.split(r"&&|;|\|(?!\|)", line) if c.strip().startswith(STARTS)]
    return list(dict.fromkeys(c for c in out if not (c.startswith("trainfit ") and c.split()[1] in PENDING)))


# README's first, then each page's; a command shown on several pages is checked once.
COMMANDS = list(dict.fromkeys(_shell_lines(README) + [c for t in DOC_PAGES.values() for c in _shell_lines(t)]))


def _is_override(tok: str) -> bool:
    return re.fullmatch(r"[a-z_]+(\.[\w]+)+=.*", tok) is not None


def _check_overrides(overrides: list[str], where: str) -> None:
    from trainfit.config import valid_keys

    keys = set(valid_keys())
    for o in overrides:
        key = re.sub(r"^stages\.\d+\.", "", o.split("=", 1)[0])
        assert key in keys, f"{where}: {o!r} is not a config key"


def _own_paths(tokens: list[str]) -> list[str]:
    return [t for t in tokens if t.startswith(OWN)]


def _trainfit(cmd: str) -> None:
    import shlex

    import typer

    from trainfit.plan.hardware import find_gpu

    tokens = shlex.split(cmd)[1:]
    group = typer.main.get_command(app)
    words = []
    command = group
    while tokens and hasattr(command, "commands") and not tokens[0].startswith("-"):
        name = tokens.pop(0)
        assert name in command.commands, f"{cmd!r}: `{' '.join(['trainfit', *words, name])}` is no command"
        words.append(name)
        command = command.commands[name]
    if not words:
        return
    # Placeholders in angle brackets (<model>) stand for a value: any word parses.
    tokens = ["x" if t.startswith("<") else t for t in tokens]
    name = "trainfit " + " ".join(words)
    try:  # unknown options and bad values raise here
        ctx = command.make_context(name, list(tokens))
    except typer.BadParameter as e:  # a command mentioned in passing (`trainfit train`): its options parsed
        if type(e).__name__ != "MissingParameter":  # typer's own click raises it; a wrong value is not
            raise
        _check_overrides([t for t in tokens if _is_override(t)], cmd)
        return
    for path in _own_paths([str(v) for v in ctx.params.values() if isinstance(v, str)]):
        assert (ROOT / path).exists(), f"{cmd!r}: {path} does not exist"
    if ctx.params.get("gpu"):
        find_gpu(ctx.params["gpu"])  # ValueError for a card the planner does not know
    overrides = list(ctx.params.get("overrides") or [])
    _check_overrides([o for o in overrides if "=" in o], cmd)
    config = ctx.params.get("config")
    if isinstance(config, str) and config.startswith("examples/"):
        load_config(ROOT / config, overrides)  # the whole command validates: keys, values, cross-field rules


def _make(cmd: str) -> None:
    tokens = shlex.split(cmd)[1:]   # KERNELS="default avx2" is one variable, not two targets
    targets = [t for t in tokens if "=" not in t]
    assert targets, cmd
    for t in targets:
        assert re.search(rf"^{re.escape(t)}:", MAKEFILE, flags=re.M), f"{cmd!r}: no make target {t}"
    for t in tokens:
        if "=" in t:
            var = t.split("=", 1)[0]
            assert f"$({var})" in MAKEFILE, f"{cmd!r}: the Makefile reads no variable {var}"


def _python(cmd: str) -> None:
    import importlib.util

    tokens = cmd.split()[1:]
    if tokens[:1] == ["-m"]:
        module = tokens[1]
        if module.split(".")[0] in PEER_PACKAGES:   # another tool's command, quoted as `trainfit import` reads it
            return
        assert importlib.util.find_spec(module) is not None, f"{cmd!r}: no module {module}"
    else:
        assert (ROOT / tokens[0]).is_file(), f"{cmd!r}: no file {tokens[0]}"
    _check_overrides([t for t in tokens if _is_override(t)], cmd)


def test_the_readme_shows_the_commands_this_test_reads():
    heads = {c.split()[0] + " " + c.split()[1] for c in COMMANDS}
    assert {"trainfit plan", "trainfit train", "trainfit fit", "make test", "make demo", "make docs"} <= heads, heads
    assert len(COMMANDS) > 100
    # every page of the guides and the quickstart shows commands this test reads
    for page in ("docs/get-started.md", *(p for p in DOC_PAGES if p.startswith("docs/guides/"))):
        assert [c for c in _shell_lines(DOC_PAGES[page]) if c.startswith("trainfit ")], page


@pytest.mark.parametrize("cmd", COMMANDS)
def test_a_readme_command_names_what_exists(cmd):
    if cmd.startswith("trainfit "):
        _trainfit(cmd)
    elif cmd.startswith("make "):
        _make(cmd)
    else:
        _python(cmd)
    for path in _own_paths(cmd.split()):
        path = path.rstrip(".,:;)")
        assert any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists(), f"{cmd!r}: {path} does not exist"


# The cheap ones run as shown (offline): a plan answers 0 or 1 (fits or not), never 2 (an error). The
# README's plans of examples run here; the docs' plans run as their guides go (tests/test_docs_guides.py,
# make docs), so that planning the guides' 7B and 8B models does not lengthen `make test`.
_README_COMMANDS = set(_shell_lines(README))
RUN = [c for c in COMMANDS if re.fullmatch(r"trainfit config examples/\S+\.yaml( [^-]\S*)*", c) or c == "trainfit keys"
       or (c in _README_COMMANDS and re.fullmatch(r"trainfit plan examples/\S+\.yaml( [^-]\S*)*( --json)?", c))]


@pytest.mark.parametrize("cmd", RUN)
def test_a_cheap_readme_command_runs(cmd, monkeypatch):
    import shlex

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = CliRunner().invoke(app, shlex.split(cmd)[1:])
    assert r.exit_code in ((0, 1) if " plan " in cmd else (0,)), r.output
    assert "Traceback" not in r.output


# A headline command that trains (a fenced `trainfit train examples/X.yaml` with nothing overridden, the
# command a reader copies) must show learning: the recorded runs of that example
# (bench/results/readme_numbers/X-s*.json, written by `make readme-numbers` from the run's summary.json)
# end with a held-out accuracy above the one they started from.
RECORDS = ROOT / "bench" / "results" / "readme_numbers"
# The README's headlines: the guides' training commands (GPU ones among them) are followed by
# tests/test_docs_guides.py instead.
HEADLINES = sorted({m for c in _README_COMMANDS for m in re.findall(r"^trainfit train examples/(\w+)\.yaml$", c)})


def test_the_readme_has_headline_training_commands():
    assert {"agent_tools", "cua_tiny"} <= set(HEADLINES), HEADLINES


@pytest.mark.parametrize("name", HEADLINES)
def test_a_headline_training_command_shows_learning(name):
    records = sorted(RECORDS.glob(f"{name}-s*.json"))
    assert records, f"`trainfit train examples/{name}.yaml` is a headline in README.md but no run of it is recorded " \
                    f"in {RECORDS.relative_to(ROOT)} (make readme-numbers CONFIGS={name})"
    for path in records:
        stages = json.loads(path.read_text())["summary"]["stages"]
        # the first accuracy the run measured (a stage without a held-out accuracy has none) and its last
        before = next((s["accuracy_before"] for s in stages if s["accuracy_before"] is not None), None)
        after = stages[-1]["accuracy_after"]
        assert before is not None and after is not None and after > before, (path.name, before, after)


def _fenced_lines() -> list[str]:
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", TEXT, flags=re.S):
        out += block.replace("\\\n", " ").splitlines()
    return out


# `# accepted` after a dry run is a claim that the dry run exits 0: it is run here as the README shows it,
# after the command that writes its config (a `trainfit fit ... # -> DIR/` line), on the machine it names.
ACCEPTED = [line for line in _fenced_lines() if "--dry-run" in line and re.search(r"#.*\baccepted\b", line)]


def test_the_readme_claims_an_accepted_dry_run():
    assert ACCEPTED


@pytest.mark.parametrize("line", ACCEPTED)
def test_an_accepted_dry_run_is_accepted(line, tmp_path, monkeypatch, hub_cache, target_machine):
    import importlib.util

    cmd = line.split("#")[0].strip()
    config = shlex.split(cmd)[2]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    if not config.startswith("examples/"):   # written by a fit line before it: `trainfit fit X.yaml ... # -> DIR/`
        writer = next(c for c in _fenced_lines() if re.search(rf"#\s*->\s*{re.escape(config.split('/')[0])}/", c))
        fit = shlex.split(writer.split("#")[0])[1:]
        hub_cache.catalog(load_config(ROOT / fit[1]))
        r = CliRunner().invoke(app, fit)
        assert r.exit_code == 0 and (tmp_path / config).is_file(), r.output
    cfg = load_config(tmp_path / config)
    hub_cache.catalog(cfg)
    # The training machine the comment names: its GPUs, RAM for what the plan offloads, the extras installed.
    target_machine(cfg.distributed.num_gpus, 2 ** 40)
    if "on the training machine" in line:
        for extra in ("deepspeed",) if cfg.engine() == "deepspeed" else ():
            if importlib.util.find_spec(extra) is None:
                pytest.skip(f"{extra} is not installed here")
    r = CliRunner().invoke(app, shlex.split(cmd)[1:])
    assert r.exit_code == 0, r.output
    if cfg.engine() == "deepspeed":   # and where DeepSpeed is missing (a laptop): exit 2 naming the extra
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real(n, *a))
        r = CliRunner().invoke(app, shlex.split(cmd)[1:])
        assert r.exit_code == 2 and "trainfit[deepspeed]" in " ".join(r.output.split()), r.output


def test_the_serve_example_asks_for_a_model_its_server_serves():
    # The curl goes to the first `trainfit serve` of its block (the port it names): its `model` must be
    # that server's base model (MODEL as given, or --served-model-name) or one of its adapters.
    blocks = re.findall(r"```bash\n(.*?)```", TEXT, flags=re.S)
    block = next(b for b in blocks if "curl " in b and "trainfit serve" in b)
    block = block.replace("\\\n", " ")
    port = re.search(r"curl localhost:(\d+)", block).group(1)
    serve = next(shlex.split(c.split("#")[0]) for c in block.splitlines()
                 if c.startswith("trainfit serve") and f"--port {port}" in c)
    names = {serve[2]}
    names |= {serve[i + 1] for i, t in enumerate(serve) if t == "--served-model-name"}
    names |= {serve[i + 1].split("=")[0] for i, t in enumerate(serve) if t == "--adapter" and "=" in serve[i + 1]}
    asked = json.loads(re.search(r"-d '(\{.*?\})'", block).group(1))["model"]
    assert asked in names, (asked, names)
