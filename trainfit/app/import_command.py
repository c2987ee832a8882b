"""`trainfit import FILE_OR_COMMAND --from trl|verl|openrlhf|llamafactory [-o PATH]`: another tool's config as a
trainfit config, with what was mapped, computed (each tool's batch arithmetic in trainfit's words) and dropped,
key by key. The conversion is trainfit/config/importers/; this module reads the options, prints and writes.

    trainfit import examples/run_qwen3-1.7b.sh --from verl -o grpo.yaml
    trainfit import "trl grpo --model_name_or_path Qwen/Qwen3-0.6B --num_generations 8" --from trl -o -
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Optional

import typer

from trainfit.config import ConfigError


def register(app: typer.Typer) -> None:
    app.command("import")(import_config)


def import_config(
    source: str = typer.Argument(..., metavar="FILE_OR_COMMAND", help="The other tool's config or launch script, "
                                 "or its command line in quotes."),
    tool: str = typer.Option(..., "--from", help="trl, verl, openrlhf or llamafactory."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Where to write the trainfit config (`-` prints "
                                         "it); default <name>.trainfit.yaml here. An existing file is kept unless "
                                         "--force."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output file."),
    stage: Optional[str] = typer.Option(None, "--stage", help="The trainfit stage, where the config does not say it "
                                        "(a TRL YAML is taken as SFT)."),
    num_gpus: Optional[int] = typer.Option(None, "--num-gpus", min=1, help="GPUs per node, where the launcher decides "
                                           "them (TRL's accelerate, llamafactory-cli, deepspeed without --num_gpus)."),
    as_json: bool = typer.Option(False, "--json", help="Print the mapping and the config as JSON."),
) -> None:
    """Write a trainfit config from a TRL, verl, OpenRLHF or LLaMA-Factory config or command, printing what was
    mapped, what was computed (the batch arithmetic each tool defines its own way) and what was dropped, and why."""
    from trainfit.app.cli import console, fail
    from trainfit.config.importers import finish, import_config as convert
    from trainfit.config.importers.report import config_text, lines

    try:
        im = convert(source, tool, stage=stage, num_gpus=num_gpus)
    except ConfigError as e:
        fail(str(e), as_json=as_json)
    path = _output(output, source, tool)
    if not as_json:
        for line in lines(im):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    try:
        finish(im)
        if path is not None and path.exists() and not force:
            raise ConfigError(f"{path} exists; trainfit import does not replace a file silently: pass -o with another "
                              "path, or --force to replace it.")
    except ConfigError as e:
        fail(str(e), as_json=as_json)
    command = shlex.join(["trainfit", "import", source if "\n" not in source else "...", "--from", tool]
                         + (["--stage", stage] if stage else []) + (["--num-gpus", str(num_gpus)] if num_gpus else []))
    text = config_text(im, command)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if as_json:
        print(json.dumps({**im.as_json(), "written": str(path) if path else None}, default=str))
    elif path is None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)
    else:
        console.print(f"wrote {path}; next: trainfit plan {path}, then trainfit train {path} --dry-run",
                      highlight=False, markup=False, soft_wrap=True)


def _output(output: Optional[str], source: str, tool: str) -> Optional[Path]:
    """The file to write (None: print it): -o, else <name>.trainfit.yaml in the current directory."""
    if output == "-":
        return None
    if output:
        return Path(output)
    p = Path(source)
    stem = p.stem if "\n" not in source and " " not in source.strip() and p.is_file() else f"{tool}-import"
    return Path(f"{stem}.trainfit.yaml")
