"""`trainfit import`: a config of TRL, verl, OpenRLHF or LLaMA-Factory carried into a trainfit config, key by
key, through the one table of peer keys (config/peer_keys.py), with each tool's batch arithmetic worked into
trainfit's (config/schema.py BatchPlan) and every key that does not carry listed with why.

    im = import_config("run_qwen3-1.7b.sh", "verl")    # Imported: .mapped, .computed, .dropped, .config()
    cfg = finish(im)                                   # the validated Config; ConfigError (exit 2) when it cannot be

Pure: reads the file or command text, imports nothing of torch, runs nothing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from trainfit.config.base import ConfigError
from trainfit.config.importers import llamafactory, openrlhf, trl, verl
from trainfit.config.importers.common import PEERS, Imported, finish
from trainfit.config.stages import stage_names

IMPORTERS = {"trl": trl.convert, "verl": verl.convert, "openrlhf": openrlhf.convert,
             "llamafactory": llamafactory.convert}
# Each tool's reading of its config into {peer key: value}, before any mapping (what the mapping must account for).
PEER_ARGS = {"trl": trl.peer_args, "verl": verl.peer_args, "openrlhf": openrlhf.peer_args,
             "llamafactory": llamafactory.peer_args}

__all__ = ["IMPORTERS", "PEER_ARGS", "PEERS", "Imported", "finish", "import_config", "read_source"]


def read_source(source: str) -> tuple[str, str]:
    """(text, name): a file's text and path, or a pasted command as itself."""
    p = Path(source).expanduser() if "\n" not in source else None
    if p is not None and p.is_file():
        try:
            return p.read_text(), str(source)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {source!r}: {e}; give a readable text file.") from None
    if p is not None and p.is_dir():
        raise ConfigError(f"{source!r} is a directory: give the path of one config or script file.")
    if p is not None and " " not in source.strip():
        raise ConfigError(f"{source!r} does not exist: give the path of the peer's config or script, or the "
                          "command itself in quotes (e.g. \"python3 -m verl.trainer.main_ppo ...\").")
    return source, "the command"


def import_config(source: str, tool: str, *, stage: Optional[str] = None, num_gpus: Optional[int] = None) -> Imported:
    """Carry `source` (a path, or the command text) of `tool` into trainfit; `stage` and `num_gpus` say what
    the peer's config leaves to its launcher (TRL's process count) or to the script's name."""
    if tool not in IMPORTERS:
        raise ConfigError(f"--from {tool!r} is not a tool trainfit imports from; choose one of {', '.join(IMPORTERS)}.")
    if stage is not None and stage not in stage_names():
        raise ConfigError(f"--stage {stage!r} is not a trainfit stage; choose one of {', '.join(stage_names())}.")
    text, name = read_source(source)
    im = IMPORTERS[tool](text, stage=stage, num_gpus=num_gpus)
    im.source = name
    link = re.search(r"^#\s*source:\s*(\S+)", text, re.M)
    im.source_link = link.group(1) if link else ""
    return im
