"""One answer from every door: `trainfit data`, `train --dry-run` and `train` read the data through the one pre-run
check (train/datacheck.py), so each bad input below exits 2 with the same paragraph from all three, and that
paragraph is all they print (no "first examples" header before it). Each names the file and line (or the parquet
row), the column where JSON stopped, the key and the fix. `train` stops in that check, before any model loads (CPU,
preset:tiny). Also: rows longer than data.max_seq_length are cut by tokens before they are tokenized, with the same
first tokens, and `data` says so; its header says what it marks."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from datasource_helpers import write
from trainfit.app.cli import app
from trainfit.config import ConfigError, expand_stages, load_config
from trainfit.data.text import (IGNORE, _assistant_mask_by_prefixes, _ids, encode_messages, encode_prompt_completion,
                                split_indices)
from trainfit.models.tokenizer import build_tokenizer
from trainfit.train.datacheck import check_stage

COMMANDS = ("data", "train --dry-run", "train")
CONFIG = ("model:\n  name: preset:tiny\ntrain:\n  device: cpu\n  global_batch_size: 4\n  micro_batch_size: 4\n"
          "  max_steps: 1\ntask:\n  name: null\nlogging:\n  tensorboard: false\n  progress: false\n  plot: false\n")
MSG = lambda role, text: {"role": role, "content": text}  # noqa: E731
PAIR = lambda i: {"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)}  # noqa: E731

pytestmark = pytest.mark.usefixtures("datasets_cache")


def _answer(tmp_path, command: str, *overrides: str) -> tuple[int, str]:
    """(exit code, output with its line wrapping undone) of `trainfit <command>` on preset:tiny with `overrides`."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG + f"run_dir: {tmp_path / 'run'}\n")
    verb, *flags = command.split()
    r = CliRunner().invoke(app, [verb, str(cfg), *overrides, *flags])
    return r.exit_code, " ".join(r.output.split())


def _refused(tmp_path, command: str, *overrides: str) -> str:
    """The paragraph `command` refuses the data with: exit 2, the check's own words and nothing else printed."""
    code, out = _answer(tmp_path, command, *overrides)
    cfg = load_config(tmp_path / "c.yaml", list(overrides))
    with pytest.raises(ConfigError) as checked:
        check_stage(expand_stages(cfg)[0])
    assert (code, out) == (2, "error: " + " ".join(str(checked.value).split())), out
    return out


def _jsonl(tmp_path, lines: list, name: str = "rows") -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_row_in_the_held_out_split_is_refused_by_every_command(tmp_path, command):
    rows = [PAIR(i) for i in range(10)]
    held = split_indices(10, 0.2, 0)[1][0]   # a row the split holds out, which `data` used to skip
    del rows[held]["chosen"]
    out = _refused(tmp_path, command, "stage=rm", f"data.path={_jsonl(tmp_path, rows, 'pairs')}",
                   "data.eval_fraction=0.2", "train.seed=0")
    assert f"pairs.jsonl, line {held + 1} has keys ['prompt', 'rejected']" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_row_is_named_by_its_file_and_line_not_a_record_number(tmp_path, command):
    rows = [PAIR(i) for i in range(6)]
    del rows[2]["chosen"]
    out = _refused(tmp_path, command, "stage=dpo", f"data.path={_jsonl(tmp_path, rows, 'pairs')}",
                   "data.eval_fraction=0")
    assert "pairs.jsonl, line 3 has keys ['prompt', 'rejected']" in out and "record" not in out


@pytest.mark.parametrize("command", COMMANDS)
def test_a_json_line_missing_its_brace_is_reported_at_the_column_it_stops(tmp_path, command):
    line = '{"prompt": "2+2=", "completion": "4"'   # 36 characters: the `}` is missing at column 37
    path = _jsonl(tmp_path, [{"prompt": "1+1=", "completion": "2"}] * 2 + [line])
    out = _refused(tmp_path, command, f"data.path={path}")
    assert "rows.jsonl line 3 is not valid JSON (Expecting ',' delimiter at column 37, the end of the line)" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_a_null_message_content_is_refused_not_trained_as_an_empty_answer(tmp_path, command):
    path = _jsonl(tmp_path, [{"messages": [MSG("user", "hi"), MSG("assistant", None)]}] * 4)
    out = _refused(tmp_path, command, f"data.path={path}")
    assert "rows.jsonl, line 1: `messages` item 1 (assistant) has no content (`content: null`)" in out
    assert "drop the row" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_a_null_content_in_parquet_row_0_is_refused(tmp_path, command):
    rows = [{"messages": [MSG("user", "hi"), MSG("assistant", None if i == 0 else "ok")]} for i in range(4)]
    out = _refused(tmp_path, command, f"data.path={write(rows, 'parquet', tmp_path / 'chat')}")
    assert "chat.parquet, row 0: `messages` item 1 (assistant) has no content (`content: null`)" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_a_null_message_in_a_parquet_row_is_refused_with_its_fix(tmp_path, command):
    rows = [{"messages": [MSG("user", "hi"), MSG("assistant", "ok")]}, {"messages": [MSG("user", "hi"), None]}] * 2
    out = _refused(tmp_path, command, f"data.path={write(rows, 'parquet', tmp_path / 'chat')}")
    assert "chat.parquet, row 1: column 'messages' item 1 is null, not a message; write each message as" in out
    assert out.endswith("or drop the row.")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_nested_list_is_refused_not_trained_as_its_python_text(tmp_path, command):
    path = _jsonl(tmp_path, [{"prompt": [["2+2="]], "completion": "4"}] * 3)
    out = _refused(tmp_path, command, f"data.path={path}")
    assert "rows.jsonl, line 1: `prompt` item 0 is a list, not a message" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_a_parquet_struct_content_is_refused(tmp_path, command):
    rows = [{"messages": [{"role": "user", "content": {"text": "hi", "lang": "en"}}]}] * 3
    out = _refused(tmp_path, command, f"data.path={write(rows, 'parquet', tmp_path / 'structs')}")
    assert "structs.parquet, row 0: `messages` item 0 (user) has content an object (a struct) with keys" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_a_pair_mixing_chat_and_text_answers_is_refused(tmp_path, command):
    rows = [PAIR(0), {"prompt": "a", "chosen": [MSG("assistant", "x")], "rejected": " y"}, PAIR(1)]
    out = _refused(tmp_path, command, "stage=dpo", f"data.path={_jsonl(tmp_path, rows, 'pairs')}",
                   "data.eval_fraction=0")
    assert "pairs.jsonl, line 2: `chosen` is chat messages but `rejected` is text" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_jsonl_question_response_rows_get_the_columns_advice_their_parquet_twin_gets(tmp_path, command):
    rows = [{"question": f"{i}+1=", "response": str(i + 1)} for i in range(3)]
    advice = "which match no shape trainfit reads for SFT"
    fix = "map the columns, e.g. data.columns={prompt: question, completion: response}."
    jsonl = _refused(tmp_path, command, f"data.path={_jsonl(tmp_path, rows, 'qa')}")
    parquet = _refused(tmp_path, command, f"data.path={write(rows, 'parquet', tmp_path / 'qa')}")
    assert "qa.jsonl, line 1 has columns question, response, " + advice in jsonl and jsonl.endswith(fix)
    assert "qa.parquet has columns question, response, " + advice in parquet and parquet.endswith(fix)


@pytest.mark.parametrize("kind", ["directory", "glob"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_path_without_data_lists_every_format_trainfit_reads(tmp_path, command, kind):
    (tmp_path / "sheets").mkdir()
    (tmp_path / "sheets" / "rows.xlsx").write_bytes(b"PK")
    path = tmp_path / "sheets" if kind == "directory" else tmp_path / "sheets" / "*.x*"
    out = _refused(tmp_path, command, f"data.path={path}")
    assert "(it holds .xlsx files; trainfit reads .txt, .jsonl, .json, .parquet, .arrow, .csv, .tsv files" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_a_mixed_schema_error_does_not_cite_a_format_the_user_never_set(tmp_path, command):
    rows = [{"prompt": "a", "completion": "b"}] * 2 + [{"messages": [MSG("user", "hi"), MSG("assistant", "x")]}]
    out = _refused(tmp_path, command, f"data.path={_jsonl(tmp_path, rows)}", "data.eval_fraction=0")
    assert "rows.jsonl, line 3 has keys ['messages'], but the rows are read as prompt_completion rows" in out
    assert "data.format=prompt_completion" not in out and "data.format=auto" in out


def test_data_says_what_its_header_marks(tmp_path):
    task = _jsonl(tmp_path, [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(5)], "task")
    code, grpo = _answer(tmp_path, "data", "stage=grpo", "task.name=jsonl", f"task.path={task}", "task.num_eval=1",
                         "grpo.num_generations=4")
    assert code == 0 and "no token here is marked" in grpo and "⟦" not in grpo and "marked⟧" not in grpo
    pairs = _jsonl(tmp_path, [PAIR(i) for i in range(4)], "pairs")
    code, rm = _answer(tmp_path, "data", "stage=rm", f"data.path={pairs}", "data.eval_fraction=0")
    assert code == 0 and "no token is marked" in rm and "⟦" not in rm
    code, dpo = _answer(tmp_path, "data", "stage=dpo", f"data.path={pairs}", "data.eval_fraction=0")
    assert code == 0 and "trained tokens ⟦marked⟧" in dpo and "⟦2<|im_end|>⟧" in dpo


def test_data_says_a_long_row_was_cut_and_which(tmp_path):
    rows = [{"prompt": "Say it:", "completion": "word " * 5000}, {"prompt": "1+1=", "completion": "2"}]
    code, out = _answer(tmp_path, "data", f"data.path={_jsonl(tmp_path, rows)}", "data.eval_fraction=0",
                        "data.max_seq_length=64")
    assert code == 0, out
    assert ("1 of 2 rows are longer than data.max_seq_length=64 tokens and are cut there, keeping their start (the "
            "first: data.path " in out and "rows.jsonl, line 1)" in out)
    assert out.count("trained, cut at 64 (its row is longer)") == 1 and "example 0: 64 tokens," in out
    assert out.index("example 0:") < out.index("cut at 64") < out.index("example 1:")   # the long row's alone


def test_a_long_pretraining_document_shows_the_blocks_it_trains_on(tmp_path):
    docs = [{"text": "the long document goes on " * 500}, {"text": "a short one"}]
    code, out = _answer(tmp_path, "data", "stage=pretrain", f"data.path={_jsonl(tmp_path, docs, 'docs')}",
                        "data.max_seq_length=16", "data.eval_fraction=0")
    tok = build_tokenizer()
    ids = tok(docs[0]["text"])["input_ids"]   # the document tokenized whole, as `train` packs it
    shown = [" ".join(f"⟦{tok.decode(ids[i * 16:(i + 1) * 16])}⟧".split()) for i in range(3)]
    assert code == 0 and all(f"example {i}: 16 tokens, 16 trained ─" in out and shown[i] in out for i in range(3)), out


class _Longest:
    """A tokenizer that remembers the longest text it was asked to tokenize."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kw):
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_long_text_is_cut_by_tokens_to_the_tokens_it_would_keep_whole():
    tok = build_tokenizer()
    long = " ".join(f"w{i % 97} and more" for i in range(4000))   # ~50k characters, thousands of tokens
    spy = _Longest(tok)
    got = encode_prompt_completion(spy, "Say it:", long, 64, False)
    p = _ids(tok, "Say it:", special=True)
    whole = (p + _ids(tok, long, special=False) + [tok.eos_token_id])[:64]   # tokenized whole, then truncated
    assert got["input_ids"] == whole and got["labels"] == [IGNORE] * len(p) + whole[len(p):] and got["truncated"]
    chat = [MSG("user", "Say it:"), MSG("assistant", long)]
    ids, mask = _assistant_mask_by_prefixes(tok, chat)   # the whole conversation, uncut
    got = encode_messages(spy, chat, 64)
    assert got["input_ids"] == ids[:64] and got["labels"] == [t if k else IGNORE for t, k in zip(ids, mask)][:64]
    assert spy.longest < len(long) // 20   # neither was the text tokenized whole
