"""Each job guide and the quickstart page, followed as written (issue 49): every `trainfit` command of its
bash blocks runs in order, in a scratch directory with the repository's examples. Plans, fits and hardware
rankings run as shown (a `# FITS` / `# DOES NOT FIT` comment is a claim: exit 0 / 1); a training command
for a GPU is dry-run on the machine its config names (its GPUs visible, its models' architectures in a
hub cache of the test's own); a CPU training command trains whole where that is cheap (WHOLE_ON_CPU),
else it is dry-run as written and its example trains for a step in tests/test_examples_train.py. Services (`trainfit env serve`, `trainfit serve`) and
launchers are parse-checked by tests/test_readme.py only. Marked `docs`: run by `make docs`, not `make test`
(planning the guides' 7B and 8B models takes minutes on 2 cores)."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainfit.app.cli import app
from trainfit.config import expand_stages, load_config

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ["docs/get-started.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "guides").glob("*.md"))]
RUN = {"plan", "fit", "hardware", "config", "keys", "data"}
# Packages only the training machine needs: a dry run here may stop at one of them, naming its install.
# CPU runs cheap enough to train whole, as written (60 steps of preset:tiny: ~12 s of CPU); the others
# (minutes of SFT, a MiniWoB++ service) are dry-run here and train for a step in test_examples_train.py.
WHOLE_ON_CPU = {"examples/sft_chat.yaml"}
TRAINING_MACHINE = {"vllm": "trainfit[vllm]", "flash_attn": "flash-attn", "deepspeed": "trainfit[deepspeed]",
                    "bitsandbytes": "trainfit[bnb]"}


def steps(page: str) -> list[tuple[str, str]]:
    """(command, its comment) for each `trainfit` line of the page's bash blocks, continuations joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / page).read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            cmd, _, comment = line.partition("#")
            cmd = cmd.strip().rstrip("&").strip()
            if cmd.startswith("trainfit "):
                out.append((cmd, comment.strip()))
    return out


def test_every_guide_and_the_quickstart_have_steps():
    assert len(GUIDES) == 6
    for page in GUIDES:
        subs = {shlex.split(c)[1] for c, _ in steps(page)}
        assert {"plan", "train"} <= subs, (page, subs)


def _on_cpu(cfg) -> bool:
    return cfg.train.device == "cpu" or cfg.model.name.startswith("preset:")


def _dry_run(args: list[str], cfg, target_machine, monkeypatch) -> None:
    from trainfit.train import preflight

    target_machine(cfg.distributed.num_gpus, 2 ** 40)
    monkeypatch.setattr(preflight, "_cuda_here", lambda: True)   # train.device=cuda: the training machine's CUDA
    r = CliRunner().invoke(app, args)
    text = " ".join(r.output.split())
    missing = [pip for mod, pip in TRAINING_MACHINE.items() if importlib.util.find_spec(mod) is None and pip in text]
    assert r.exit_code == 0 or (r.exit_code == 2 and missing), r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("page", GUIDES)
def test_a_guide_followed_as_written(page, tmp_path, monkeypatch, hub_cache, target_machine):
    from test_examples_train import TRAINED   # the examples trained for a step on a CPU in make test

    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    # "With your captions in captions.jsonl": the reader's own file, one row of the shape the guide names.
    (tmp_path / "captions.jsonl").write_text('{"image": "examples/data/screens/login.png", "text": "a login page"}\n')
    # What an earlier step writes and this test does not run (a service's expert rows, a run's final model):
    # a later step that reads it is parse-checked only (tests/test_readme.py), as its producer is.
    produced: list[str] = []
    followed = 0
    for cmd, comment in steps(page):
        args = shlex.split(cmd)[1:]
        sub = args[0]
        if sub not in RUN | {"train"}:
            produced += [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--out"]
            continue
        config = next((a for a in args[1:] if a.endswith(".yaml")), None)
        overrides = [a for a in args[1:] if "=" in a and not a.startswith("-")]
        cfg = load_config(tmp_path / config, overrides) if config else None
        reads = [p for s in (expand_stages(cfg) if cfg else []) for p in (s.data.path, s.model.name) if p]
        if produced and any(str(p).startswith(tuple(produced)) for p in reads):
            continue
        if cfg is not None:
            hub_cache.catalog(cfg)
        followed += 1
        if sub == "train":
            produced.append(cfg.run_dir)
            if _on_cpu(cfg) and args[1:] == [config] and config in WHOLE_ON_CPU:
                r = CliRunner().invoke(app, args)
                assert r.exit_code == 0 and (tmp_path / cfg.run_dir / "final").is_dir(), r.output[-3000:]
                continue
            args = [a for a in args if a != "--dry-run"] + ["--dry-run"]
            if _on_cpu(cfg):
                assert Path(config).name in TRAINED, f"{cmd!r}: no one-step run in test_examples_train"
            _dry_run(args, cfg, target_machine, monkeypatch)
            continue
        r = CliRunner().invoke(app, args)
        expected = {1} if "DOES NOT FIT" in comment else {0} if "FITS" in comment or sub != "plan" else {0, 1}
        assert r.exit_code in expected, (cmd, r.output[-3000:])
        assert "Traceback" not in r.output
    assert followed >= 3, f"{page}: only {followed} steps could be followed"
