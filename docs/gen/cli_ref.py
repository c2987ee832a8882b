"""The command-line reference: every `trainfit` command of the typer app (trainfit/app/cli.py), its usage,
its help and each argument and option, read from the click command typer builds. Nothing by hand."""

from __future__ import annotations

import typer

from docs.gen.tables import table
from trainfit.app.cli import app


def _param_rows(command, ctx: typer.Context) -> list[list[str]]:
    # typer builds its own click classes (typer._click): read them by their attributes, not their types.
    rows = []
    for p in command.get_params(ctx):
        option = p.param_type_name == "option"
        if option and p.name == "help":
            continue
        names = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts]) if option else f"`{(p.name or '').upper()}`"
        kind = "flag" if option and p.is_flag else p.display_type(ctx).strip("<>").lower()
        default = "" if p.default in (None, (), []) or p.required else f"`{p.default}`"
        what = getattr(p, "help", None) or ""
        if p.required:
            what = f"required. {what}".strip()
        rows.append([names, kind, default, what])
    return rows


def _commands(group, ctx: typer.Context, words: list[str]) -> list[str]:
    parts: list[str] = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None or command.hidden:
            continue
        path = [*words, name]
        sub = typer.Context(command, info_name=" ".join(path), parent=None)
        help_text = (command.help or "").strip()
        if hasattr(command, "commands"):
            parts += [f"## trainfit {' '.join(path)}", "", help_text, ""]
            parts += _commands(command, sub, path)
            continue
        usage = " ".join(command.collect_usage_pieces(sub))
        parts += [f"## trainfit {' '.join(path)}", "", "```text", f"trainfit {' '.join(path)} {usage}".rstrip(),
                  "```", "", help_text, ""]
        rows = _param_rows(command, sub)
        if rows:
            parts += [table(["argument / option", "type", "default", "what it does"], rows), ""]
    return parts


def cli_reference() -> str:
    group = typer.main.get_command(app)
    ctx = typer.Context(group, info_name="trainfit")
    return "\n".join([(group.help or "").strip(), "", *_commands(group, ctx, [])])
