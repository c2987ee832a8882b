"""`trainfit data CONFIG [--stage N] [--rows K]`: the first K examples of a stage exactly as it trains on them.

The examples come from the trainer's own loaders (train/sft.py `lm_items`, tasks/pairs.py `PairRows` and its
encoders, the task's prompts), decoded back to text: trained tokens (those with loss) are highlighted, and
marked ⟦like this⟧ when the output is not a terminal, so the mask survives a pipe. Pairs show both sides;
RL stages show each prompt, its answer and the reward functions that score it.
"""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.table import Table
from rich.text import Text

from trainfit.config import ConfigError

IGNORE = -100
TRAINED = "bold black on green"


def register(app: typer.Typer) -> None:
    app.command("data")(data)


def data(
    config: str = typer.Argument(..., help="YAML config file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides such as data.template=chat."),
    stage: int = typer.Option(0, "--stage", help="Which stage of a pipeline (0 = the first)."),
    rows: int = typer.Option(3, "--rows", min=1, help="How many examples to print."),
) -> None:
    """Print the first examples of a stage exactly as it trains on them: the decoded text with its loss mask
    (trained tokens highlighted), pairs side by side, RL prompts with their answers and rewards."""
    from trainfit.app.cli import console, fail, load_or_exit   # here: cli imports this module at its start
    from trainfit.config import expand_stages

    cfg = load_or_exit(config, overrides)
    try:
        stages = expand_stages(cfg)
        if not 0 <= stage < len(stages):
            raise ConfigError(f"--stage {stage}: the config has {len(stages)} stage(s), numbered from 0; pick one "
                              f"of 0..{len(stages) - 1}.")
        show(console, stages[stage], rows)
    except ConfigError as e:
        fail(str(e))


def show(console, cfg, k: int) -> None:
    """Print `k` examples of `cfg`'s stage (cfg: one stage's Config) on `console`."""
    from trainfit.config.stages import stage_spec
    from trainfit.models.policy import load_tokenizer
    from trainfit.train.datacheck import uses_data

    tok = load_tokenizer(cfg.model)
    spec = stage_spec(cfg.stage)
    console.print(f"[bold]stage {cfg.stage}[/]: the first {k} example(s) as trained; "
                  + ("trained tokens highlighted" if console.is_terminal else "trained tokens ⟦marked⟧"), highlight=False)
    if spec.reads_pairs:
        _pairs(console, cfg, tok, k)
    elif uses_data(cfg):
        _sequences(console, cfg, tok, k)
    else:
        _task(console, cfg, tok, k, bool(spec.rollout))


def masked(console, tok, ids: list, trained: list) -> Text:
    """The decoded tokens, runs with loss styled (and marked ⟦⟧ off a terminal)."""
    out = Text()
    start = 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or bool(trained[j]) != bool(trained[start]):
            piece = tok.decode(ids[start:j])
            if trained[start]:
                out.append(piece if console.is_terminal else f"⟦{piece}⟧", style=TRAINED)
            else:
                out.append(piece)
            start = j
    return out


def _sequences(console, cfg, tok, k: int) -> None:
    """pretrain / sft on data.path: the items of the first training rows, from the trainer's lm_items."""
    from trainfit.data import sources
    from trainfit.data.text import split_indices
    from trainfit.train.sft import lm_items

    d = cfg.data
    if d.streaming:   # the stream's first blocks, as LMStage makes them (nothing else is read)
        from trainfit.data.sources.stream import BlockStream

        open_dataset, shape, label = sources.open_stream(d)
        console.print(f"streaming {label}: {shape.describe()}", highlight=False)
        stream = BlockStream(open_dataset, shape, tok, d.max_seq_length, label, d.text_field)
        _print_items(console, tok, [stream.item(i) for i in range(k)])
        return
    want = "text" if cfg.stage == "pretrain" else "sft"
    rows, held = sources.read_rows(d, want), sources.read_rows(d, want, held_out=True)
    keep = split_indices(len(rows), d.eval_fraction, cfg.train.seed)[0] if held is None else list(range(len(rows)))
    for note in [r.note for r in (rows, held) if r is not None and not r.shape.identity]:
        console.print(note, highlight=False)
    # The trainer's split kept `keep`; its first rows, with nothing more held out, give its first items (pretrain
    # packs rows in order, so more rows are read until k blocks fill).
    one = cfg.model_copy(update={"data": d.model_copy(update={"eval_fraction": 0.0})})
    n = min(k, len(keep))
    while True:
        items, _, notes = lm_items(one, tok, rows.select(keep[:n]), None)
        if len(items) >= k or n >= len(keep):
            break
        n = min(len(keep), n * 2)
    for note in notes:
        console.print(note, highlight=False)
    _print_items(console, tok, items[:k])


def _print_items(console, tok, items: list) -> None:
    for i, it in enumerate(items):
        labels = it.get("labels", it["input_ids"])
        console.rule(f"example {i}: {len(it['input_ids'])} tokens, {sum(t != IGNORE for t in labels)} trained")
        console.print(masked(console, tok, list(it["input_ids"]), [t != IGNORE for t in labels]), highlight=False)


def _pairs(console, cfg, tok, k: int) -> None:
    """rm / dpo: the first training pairs (PairRows), encoded as the stage encodes them."""
    from trainfit.config.stages import stage_spec
    from trainfit.tasks.pairs import PairRows, encode_pairs, encode_policy_rows

    rows = PairRows(cfg)
    for note in rows.notes:
        console.print(note, highlight=False)
    picked = rows.train(range(min(k, rows.n)))
    d = cfg.data
    if not stage_spec(cfg.stage).unpaired_rows:   # a reward model scores the whole sequences
        pairs, _ = encode_pairs(picked, tok, d.max_seq_length, cfg.task.chat)
        for i, p in enumerate(pairs):
            table = Table(title=f"pair {i}", show_lines=True, expand=True)
            table.add_column("chosen")
            table.add_column("rejected")
            table.add_row(tok.decode(p["chosen"]), tok.decode(p["rejected"]))
            console.print(table)
        return
    out, _, unpaired = encode_policy_rows(picked, tok, d.max_seq_length, cfg.task.chat, cfg.dpo.loss_type)
    sides = ["completion"] if unpaired else ["chosen", "rejected"]
    for i, p in enumerate(out):
        label = f" (desirable: {p['desirable']})" if unpaired else ""
        console.rule(f"pair {i}{label}: prompt {len(p['prompt'])} tokens")
        console.print(tok.decode(p["prompt"]), highlight=False)
        table = Table(show_lines=True, expand=True)
        for s in sides:
            table.add_column(s)
        table.add_row(*(masked(console, tok, p[s], p[s + "_mask"]) for s in sides))
        console.print(table)


def _task(console, cfg, tok, k: int, rl: bool) -> None:
    """A task's stage: RL prompts (as the rollout encodes them) with their answers and rewards, or SFT
    examples of the task."""
    from trainfit.data.text import encode_example, encode_prompt
    from trainfit.tasks import build_task
    from trainfit.tasks.rewards import resolve_rewards

    task = build_task(cfg.task)
    for note in getattr(task, "notes", []):
        console.print(note, highlight=False)
    if rl:
        names = [n for n, _ in resolve_rewards(cfg.task, task)]
        console.print(f"rewards: {', '.join(names)}", highlight=False)
    n = min(k, task.num_train) if task.num_train else k
    for i in range(n):
        ex = task.train_example(i)
        if rl:
            ids = encode_prompt(tok, ex, cfg.task.chat)[-cfg.rollout.max_prompt_length:]
            console.rule(f"prompt {i}: {len(ids)} tokens, answer {ex.answer!r}")
            console.print(tok.decode(ids), highlight=False)
        else:
            it = encode_example(tok, ex, cfg.data.max_seq_length, cfg.task.chat)
            console.rule(f"example {i}: {len(it['input_ids'])} tokens")
            console.print(masked(console, tok, it["input_ids"], [t != IGNORE for t in it["labels"]]), highlight=False)
