"""`trainfit data CONFIG [--stage N] [--rows K]`: the first K examples of a stage exactly as it trains on them.

The examples come from the trainer's own loaders (train/sft.py `lm_items`, tasks/pairs.py `PairRows` and its
encoders, the task's prompts), decoded back to text: trained tokens (those with loss) are highlighted, and
marked ⟦like this⟧ when the output is not a terminal, so the mask survives a pipe. Pairs show both sides (a
reward model's whole, nothing marked); RL stages show each prompt, its answer and the reward functions that
score it (nothing marked: the policy trains on its own samples). The data is checked first, as `train` checks
it, so an error here is the one `train --dry-run` and `train` give, and it comes alone.
"""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.rule import Rule
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
    """Print `k` examples of `cfg`'s stage (cfg: one stage's Config) on `console`, after the check `train
    --dry-run` and `train` make (train/datacheck.py: every row, the held-out ones too), so that a row they
    refuse is refused here with the same words. Nothing is printed before the examples are made: an error
    comes alone."""
    from trainfit.config.stages import stage_spec
    from trainfit.models.policy import load_tokenizer
    from trainfit.train.datacheck import check_stage, uses_data

    notes = check_stage(cfg)
    tok = load_tokenizer(cfg.model)
    spec = stage_spec(cfg.stage)
    if spec.reads_pairs:
        what, shown = _pairs(console, cfg, tok, k)
    elif uses_data(cfg):
        what, shown = _sequences(console, cfg, tok, k)
    else:
        what, shown = _task(console, cfg, tok, k, bool(spec.rollout))
    console.print(f"[bold]stage {cfg.stage}[/]: {what}", highlight=False)
    for part in [*notes, *shown]:
        console.print(part, highlight=False)


def _marked(console, n: int, noun: str = "example(s)") -> str:
    """The header of examples whose trained tokens are shown: how they are shown on this console."""
    return (f"the first {n} {noun} as trained; "
            + ("trained tokens highlighted" if console.is_terminal else "trained tokens ⟦marked⟧"))


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


def _sequences(console, cfg, tok, k: int) -> tuple[str, list]:
    """pretrain / sft on data.path: the items of the first training rows, from the trainer's lm_items."""
    from trainfit.data import sources
    from trainfit.data.text import split_indices
    from trainfit.train.sft import lm_items

    d = cfg.data
    if d.streaming:   # the stream's first blocks, as LMStage makes them (nothing else is read)
        from trainfit.data.sources.stream import BlockStream

        open_dataset, shape, label = sources.open_stream(d)
        stream = BlockStream(open_dataset, shape, tok, d.max_seq_length, label, d.text_field)
        items = [stream.item(i) for i in range(k)]
        return _marked(console, len(items), "block(s)"), [f"streaming {label}: {shape.describe()}",
                                                          *_items(console, tok, items, d.max_seq_length)]
    want = "text" if cfg.stage == "pretrain" else "sft"
    rows, held = sources.read_rows(d, want), sources.read_rows(d, want, held_out=True)
    keep = split_indices(len(rows), d.eval_fraction, cfg.train.seed)[0] if held is None else list(range(len(rows)))
    out: list = [r.note for r in (rows, held) if r is not None and not r.shape.identity]
    # The trainer's split kept `keep`; its first rows, with nothing more held out, give its first items (pretrain
    # packs rows in order, so more rows are read until k blocks fill).
    one = cfg.model_copy(update={"data": d.model_copy(update={"eval_fraction": 0.0})})
    n = min(k, len(keep))
    while True:
        items, _, notes = lm_items(one, tok, rows.select(keep[:n]), None, _texts_cut(rows.select(keep[:n]), tok, d, k))
        if len(items) >= k or n >= len(keep):
            break
        n = min(len(keep), n * 2)
    items = items[:k]
    return _marked(console, len(items)), [*out, *notes, *_items(console, tok, items, d.max_seq_length)]


def _texts_cut(rows, tok, d, k: int):
    """Pretraining rows with each text cut to the k blocks shown (text.cut_text): the first k blocks are the
    same, and a 50 MB document is not tokenized whole to show them. SFT rows: None (the encoders cut them)."""
    from trainfit.data.text import Records, cut_text

    if rows.shape.want != "text":
        return None
    records = rows.to_list()
    cut = lambda t: cut_text(tok, t, k * d.max_seq_length) if isinstance(t, str) else t  # noqa: E731
    return Records([{**r, d.text_field: cut(r.get(d.text_field))} for r in records], records.origins)


def _items(console, tok, items: list, max_len: int) -> list:
    """Each item's rule (its tokens, those trained, and whether its row was cut) and its masked text."""
    out: list = []
    for i, it in enumerate(items):
        labels = it.get("labels", it["input_ids"])
        cut = f", cut at {max_len} (its row is longer)" if it.get("truncated") else ""
        out.append(Rule(f"example {i}: {len(it['input_ids'])} tokens, {sum(t != IGNORE for t in labels)} trained{cut}"))
        out.append(masked(console, tok, list(it["input_ids"]), [t != IGNORE for t in labels]))
    return out


def _pairs(console, cfg, tok, k: int) -> tuple[str, list]:
    """rm / dpo: the first training pairs (PairRows), encoded as the stage encodes them."""
    from trainfit.config.stages import stage_spec
    from trainfit.tasks.pairs import PairRows, encode_pairs, encode_policy_rows

    rows = PairRows(cfg)
    out: list = list(rows.notes)
    picked = rows.train(range(min(k, rows.n)))
    d = cfg.data
    if not stage_spec(cfg.stage).unpaired_rows:   # a reward model scores the whole sequences
        pairs, stats = encode_pairs(picked, tok, d.max_seq_length, cfg.task.chat)
        out += _cut(stats, "pair(s)", d.max_seq_length)
        for i, p in enumerate(pairs):
            table = Table(title=f"pair {i}", show_lines=True, expand=True)
            table.add_column("chosen")
            table.add_column("rejected")
            table.add_row(tok.decode(p["chosen"]), tok.decode(p["rejected"]))
            out.append(table)
        return (f"the first {len(pairs)} pair(s) as the reward model scores them, each side whole (a reward model "
                "has no per-token loss, so no token is marked)"), out
    pairs, stats, unpaired = encode_policy_rows(picked, tok, d.max_seq_length, cfg.task.chat, cfg.dpo.loss_type)
    out += _cut(stats, "row(s)" if unpaired else "pair(s)", d.max_seq_length)
    sides = ["completion"] if unpaired else ["chosen", "rejected"]
    for i, p in enumerate(pairs):
        label = f" (desirable: {p['desirable']})" if unpaired else ""
        out.append(Rule(f"pair {i}{label}: prompt {len(p['prompt'])} tokens"))
        out.append(tok.decode(p["prompt"]))
        table = Table(show_lines=True, expand=True)
        for s in sides:
            table.add_column(s)
        table.add_row(*(masked(console, tok, p[s], p[s + "_mask"]) for s in sides))
        out.append(table)
    return _marked(console, len(pairs), "row(s)" if unpaired else "pair(s)"), out


def _cut(stats: dict, noun: str, max_len: int) -> list[str]:
    n = stats.get("truncated", 0)
    return [f"{n} of these {noun} are longer than data.max_seq_length={max_len} tokens and are cut there"] if n else []


def _task(console, cfg, tok, k: int, rl: bool) -> tuple[str, list]:
    """A task's stage: RL prompts (as the rollout encodes them) with their answers and rewards, or SFT
    examples of the task."""
    from trainfit.data.text import encode_example, encode_prompt
    from trainfit.tasks import build_task
    from trainfit.tasks.rewards import resolve_rewards

    task = build_task(cfg.task)
    out: list = list(getattr(task, "notes", []))
    if rl:
        out.append(f"rewards: {', '.join(n for n, _ in resolve_rewards(cfg.task, task))}")
    n = min(k, task.num_train) if task.num_train else k
    items = []
    for i in range(n):
        ex = task.train_example(i)
        if rl:
            ids = encode_prompt(tok, ex, cfg.task.chat)[-cfg.rollout.max_prompt_length:]
            out += [Rule(f"prompt {i}: {len(ids)} tokens, answer {ex.answer!r}"), tok.decode(ids)]
        else:
            items.append(encode_example(tok, ex, cfg.data.max_seq_length, cfg.task.chat))
    if rl:   # the policy is trained on its own completions, which no example holds
        return (f"the first {n} prompt(s) as the rollout encodes them, with their answers and rewards (the policy "
                "is trained on the completions it samples, so no token here is marked)"), out
    return _marked(console, len(items)), out + _items(console, tok, items, cfg.data.max_seq_length)
