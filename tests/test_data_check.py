"""The pre-run data check reads what the trainer reads (train/datacheck.py through trainfit/data/sources/): the
layouts the reader recognises or maps pass it from .json and .jsonl as they do from parquet, and a bad row is
refused by the check and the trainer alike, named by its line in the user's file (also after the held-out
split); a null field is refused instead of trained on as the text "None"."""

from __future__ import annotations

import pytest

from conftest import tiny_config
from datasource_helpers import write
from trainfit.config import ConfigError, DataConfig
from trainfit.data import sources
from trainfit.data.text import split_indices
from trainfit.models.tokenizer import build_tokenizer
from trainfit.tasks.pairs import PairRows, encode_pairs, encode_policy_rows
from trainfit.train.datacheck import check_stage

MSG = lambda role, text: {"role": role, "content": text}  # noqa: E731
HH = lambda i, a: f"\n\nHuman: What is {i}+1?\n\nAssistant: {a}"  # noqa: E731

# name: (stage, rows, settings, a field of the first converted row and what it holds)
LAYOUTS = {
    "alpaca": ("sft", [{"instruction": f"Double {i}.", "input": f"({i})", "output": str(2 * i)} for i in range(10)],
               {}, ("prompt", "Double 0.\n(0)")),
    "sharegpt": ("sft", [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
                         for i in range(10)], {}, ("messages", [MSG("user", "q0"), MSG("assistant", "a0")])),
    # Anthropic hh-rlhf: no prompt column, each side the whole dialogue.
    "hh_rlhf": ("rm", [{"chosen": HH(i, i + 1), "rejected": HH(i, i + 9)} for i in range(10)], {},
                ("prompt", "\n\nHuman: What is 0+1?\n\nAssistant:")),
    "mapped_columns": ("sft", [{"q": f"{i}*3=", "a": str(3 * i)} for i in range(10)],
                       {"data.columns": "{prompt: q, completion: a}"}, ("completion", "0")),
    "pretrain_columns_text": ("pretrain", [{"body": f"document number {i} " * 20} for i in range(10)],
                              {"data.columns": "{text: body}"}, ("text", "document number 0 " * 20)),
}


pytestmark = pytest.mark.usefixtures("datasets_cache")


def _cfg(tmp_path, stage: str, path: str, **more):
    return tiny_config(tmp_path, stage, **{"data.path": path, "task.name": "null", "data.max_seq_length": 64,
                                           "data.eval_fraction": 0.2, **more})


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_check_accepts_every_layout_the_reader_reads(tmp_path, name, fmt):
    stage, rows, settings, (field, value) = LAYOUTS[name]
    path = write(rows, fmt, tmp_path / name)
    cfg = _cfg(tmp_path, stage, path, **settings)
    assert check_stage(cfg) == []
    want = {"sft": "sft", "rm": "pairs", "pretrain": "text"}[stage]
    assert sources.read_rows(cfg.data, want)[0][field] == value


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_the_check_and_the_trainer_refuse_a_bad_row_with_one_message(tmp_path, tiny_lm, fmt):
    from trainfit.train.sft import LMStage

    rows = [dict(r) for r in LAYOUTS["alpaca"][1]]
    del rows[6]["output"]
    cfg = _cfg(tmp_path, "sft", write(rows, fmt, tmp_path / "alpaca"))
    with pytest.raises(ConfigError) as checked:
        check_stage(cfg)
    with pytest.raises(ConfigError) as trained:
        LMStage(cfg, *tiny_lm, "cpu")
    where = "alpaca.jsonl, line 7" if fmt == "jsonl" else "alpaca.json, item 6 (line 32)"   # 5 lines an item, after [
    assert str(checked.value) == str(trained.value) and where in str(checked.value), str(checked.value)
    assert "no value in column 'output'" in str(checked.value)


@pytest.mark.parametrize("stage, row, null", [
    ("rm", {"prompt": "2+2=", "chosen": "4", "rejected": None}, "rejected"),
    ("dpo", {"prompt": None, "chosen": "4", "rejected": "5"}, "prompt"),
    ("sft", {"prompt": "2+2=", "completion": None}, "completion"),
])
def test_a_null_field_is_refused_not_trained_as_the_text_none(tmp_path, tiny_lm, stage, row, null):
    good = ({"prompt": "1+1=", "completion": "2"} if stage == "sft" else {"prompt": "1+1=", "chosen": "2", "rejected": "3"})
    path = write([good] * 4 + [row] + [good] * 3, "jsonl", tmp_path / "rows")
    cfg = _cfg(tmp_path, stage, path, **{"data.eval_fraction": 0.0})
    with pytest.raises(ConfigError) as checked:
        check_stage(cfg)
    text = str(checked.value)
    assert f"`{null}: null`" in text and "rows.jsonl, line 5" in text, text
    tok = build_tokenizer()
    with pytest.raises(ConfigError) as trained:   # the trainer's encoder, not only the check
        if stage == "sft":
            from trainfit.train.sft import LMStage

            LMStage(cfg, *tiny_lm, "cpu")
        elif stage == "rm":   # the reward model's encoder (train/rm.py)
            encode_pairs(PairRows(cfg).train(), tok, 64, False)
        else:
            encode_policy_rows(PairRows(cfg).train(), tok, 64, False, "sigmoid")
    assert str(trained.value) == text


def test_an_empty_prompt_is_written_as_empty_text(tmp_path):
    path = write([{"prompt": "", "chosen": "yes", "rejected": "no"}] * 4, "jsonl", tmp_path / "rows")
    cfg = _cfg(tmp_path, "rm", path, **{"data.eval_fraction": 0.0})
    assert check_stage(cfg) == []
    tok = build_tokenizer()
    pairs, _ = encode_pairs(PairRows(cfg).train(), tok, 64, False)
    assert "None" not in tok.decode(pairs[0]["chosen"])


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_pair_error_names_the_row_of_the_file_after_the_held_out_split(tmp_path, fmt):
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(40)]
    kept, held = split_indices(40, 0.2, 0)
    bad = kept[-3]   # a training row with rows held out before it
    assert sum(h < bad for h in held) > 0
    rows[bad]["rejected"] = rows[bad]["chosen"]   # the same tokens on both sides: refused after the split
    cfg = _cfg(tmp_path, "rm", write(rows, fmt, tmp_path / "pairs"), **{"train.seed": 0})
    with pytest.raises(ConfigError) as e:
        encode_pairs(PairRows(cfg).train(), build_tokenizer(), 64, False)
    where = f"pairs.jsonl, line {bad + 1}" if fmt == "jsonl" else f"pairs.parquet, row {bad}"
    assert where in str(e.value) and "same tokens for chosen and rejected" in str(e.value), str(e.value)


def test_a_csv_with_an_unbalanced_quote_is_refused_not_read_as_one_row(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text('prompt,completion\n"2+2=,4\n3+3=,6\n4+4=,8\n"5+5=",10\n')   # pandas alone reads 1 row
    with pytest.raises(ConfigError, match=r"bad.csv has an unbalanced quote: the field that starts on line 2"):
        sources.read_rows(DataConfig(path=str(bad)), "sft")
    never = tmp_path / "never.csv"
    never.write_text('prompt,completion\n"2+2=,4\n3+3=,6\n')
    with pytest.raises(ConfigError, match=r'a quoted field opened on line 2 is never closed') as e:
        sources.read_rows(DataConfig(path=str(never)), "sft")
    assert "datasets" not in str(e.value)
    good = tmp_path / "good.csv"   # a quoted value with a line break is legitimate
    good.write_text('prompt,completion\n"two\nlines",4\n3+3=,6\n')
    assert sources.read_rows(DataConfig(path=str(good)), "sft").to_list()[0] == {"prompt": "two\nlines", "completion": "4"}


def test_a_struct_answer_is_reported_by_its_type(tmp_path):
    rows = [{"prompt": "2+2=", "chosen": {"text": "4", "score": 1.0}, "rejected": {"text": "5", "score": 0.0}}] * 3
    rows_read = sources.read_rows(DataConfig(path=write(rows, "parquet", tmp_path / "s")), "pairs")
    with pytest.raises(ConfigError, match=r"column 'chosen' holds a struct \(object\) with fields \['score', 'text'\]"):
        rows_read[0]


def test_an_empty_split_is_said_in_trainfit_words(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": "a", "completion": "b"}]).select([]).to_parquet(str(tmp_path / "zero.parquet"))
    with pytest.raises(ConfigError) as e:
        sources.read_rows(DataConfig(path=str(tmp_path / "zero.parquet")), "sft")
    assert "its 'train' split has no rows" in str(e.value) and "data.split" in str(e.value)
    assert "Instruction" not in str(e.value) and "corresponds to no data" not in str(e.value)


def test_a_pair_without_an_answer_gets_the_same_message_from_the_check_and_the_trainer(tmp_path):
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(6)]
    del rows[2]["rejected"]
    cfg = _cfg(tmp_path, "rm", write(rows, "jsonl", tmp_path / "pairs"), **{"data.eval_fraction": 0.0})
    with pytest.raises(ConfigError) as checked:
        check_stage(cfg)
    with pytest.raises(ConfigError) as trained:
        encode_pairs(PairRows(cfg).train(), build_tokenizer(), 64, False)
    assert str(checked.value) == str(trained.value) and "pairs.jsonl, line 3 has keys ['chosen', 'prompt']" in str(
        checked.value)


def test_the_held_out_split_of_a_dataset_is_checked_too(tmp_path):
    import datasets

    good = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(4)]
    held = good[:1] + [{"prompt": "9+1=", "completion": None}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(good), "test": datasets.Dataset.from_list(held)}
                         ).save_to_disk(str(tmp_path / "saved"))
    cfg = _cfg(tmp_path, "sft", str(tmp_path / "saved"), **{"data.eval_split": "test"})
    with pytest.raises(ConfigError, match=r"data.path .*saved.* test, row 1 has no value in column 'completion'"):
        check_stage(cfg)
