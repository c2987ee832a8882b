"""Data from where users keep it (trainfit/data/sources/): parquet, Arrow save_to_disk folders, CSV and JSONL in
TRL's, verl's, alpaca's and sharegpt's shapes give the stages the same tokens as the same rows written as
trainfit JSONL; SFT, RM and GRPO train a step from them (CPU, preset:tiny); hub ids resolve offline from
the datasets cache; bad input is one ConfigError naming the dataset, the row or column, and the fix."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from conftest import tiny_config
from datasource_helpers import cache_hub_dataset, gsm8k_rows, use_cache, write
from trainfit.config import ConfigError, DataConfig, TaskConfig
from trainfit.data.sources import read_rows
from trainfit.data.sources.encode import sft_items
from trainfit.data.text import encode_prompt
from trainfit.models.tokenizer import build_tokenizer
from trainfit.tasks.pairs import PairRows
from trainfit.tasks import build_task
from trainfit.train.run import run_pipeline
from trainfit.train.sft import LMStage

QUIET = Console(file=open("/dev/null", "w"))
MSG = lambda role, text: {"role": role, "content": text}  # noqa: E731

# name: (what the stage reads, rows as users keep them, the same rows as trainfit JSONL, formats, settings)
SHAPES = {
    "trl_prompt_completion": ("sft", [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(10)],
                              None, ("parquet", "arrow", "csv"), {}),
    "trl_messages": ("sft", [{"messages": [MSG("user", f"hi {i}"), MSG("assistant", f"hello {i}")]} for i in range(10)],
                     None, ("parquet", "arrow"), {}),
    "alpaca": ("sft", [{"instruction": f"Double {i}.", "input": "" if i % 2 else f"({i})", "output": str(2 * i)}
                       for i in range(10)],
               [{"prompt": f"Double {i}." + ("" if i % 2 else f"\n({i})"), "completion": str(2 * i)} for i in range(10)],
               ("parquet", "arrow", "csv", "jsonl"), {}),
    "sharegpt": ("sft", [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}],
                          "system": "Be brief."} for i in range(10)],
                 [{"messages": [MSG("system", "Be brief."), MSG("user", f"q{i}"), MSG("assistant", f"a{i}")]}
                  for i in range(10)], ("parquet", "arrow", "jsonl"), {}),
    "mapped_columns": ("sft", [{"q": f"{i}*3=", "a": str(3 * i), "id": i} for i in range(10)],
                       [{"prompt": f"{i}*3=", "completion": str(3 * i)} for i in range(10)],
                       ("parquet", "arrow", "csv", "jsonl"), {"data.columns": "{prompt: q, completion: a}"}),
    "trl_pairs": ("pairs", [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(10)],
                  None, ("parquet", "arrow", "csv"), {}),
    "trl_implicit_pairs": ("pairs", [{"chosen": f"Q: {i}+1? A: {i + 1}", "rejected": f"Q: {i}+1? A: {i + 9}"}
                                     for i in range(10)],
                           [{"prompt": f"Q: {i}+1? A:", "chosen": f" {i + 1}", "rejected": f" {i + 9}"} for i in range(10)],
                           ("parquet", "arrow", "csv", "jsonl"), {}),
    # TRL's conversational preference rows: the prompt as messages, each side an assistant turn.
    "trl_chat_pairs": ("pairs", [{"prompt": [MSG("user", f"{i}+1?")], "chosen": [MSG("assistant", str(i + 1))],
                                  "rejected": [MSG("assistant", str(i + 2))]} for i in range(10)],
                       None, ("parquet", "arrow"), {}),
    "verl": ("task", [{"data_source": "openai/gsm8k", "prompt": [MSG("user", f"What is {i}+{i}?")], "ability": "math",
                       "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                       "extra_info": {"index": i, "split": "train"}} for i in range(12)],
             [{"messages": [MSG("user", f"What is {i}+{i}?")], "answer": str(2 * i)} for i in range(12)],
             ("parquet", "arrow", "jsonl"), {}),
    "gsm8k": ("task", gsm8k_rows(12),
              [{"prompt": r["question"], "answer": r["answer"].rsplit("#### ", 1)[1], "completion": r["answer"]}
               for r in gsm8k_rows(12)], ("parquet", "csv", "arrow", "jsonl"), {"task.answer_pattern": r"'####\s*(.+)'"}),  # quoted: YAML's # starts a comment
    # alpaca rows as task rows: instruction (+ input) the prompt, output the answer.
    "alpaca_task": ("task", [{"instruction": f"Double {i}.", "input": "" if i % 2 else f"({i})", "output": str(2 * i)}
                             for i in range(12)],
                    [{"prompt": f"Double {i}." + ("" if i % 2 else f"\n({i})"), "answer": str(2 * i)}
                     for i in range(12)],
                    ("parquet", "arrow", "csv", "jsonl"), {}),
}
CASES = [(name, fmt) for name, (_, _, _, formats, _) in SHAPES.items() for fmt in formats]


pytestmark = pytest.mark.usefixtures("datasets_cache")


def _config(tmp_path, want: str, path: str, settings: dict, stage=None, **more):
    stage = stage or {"sft": "sft", "pairs": "rm", "task": "grpo"}[want]
    over = {"data.max_seq_length": 64, "data.eval_fraction": 0.2, **settings, **more}
    if want == "task":
        over.update({"task.name": "dataset", "task.path": path, "task.num_eval": 2, "task.chat": True})
    else:
        over.update({"data.path": path, "task.name": "null"})
    return tiny_config(tmp_path, stage, **over)


def _fed(cfg, want: str, tiny_lm) -> list:
    """What the stage feeds the model from its data: token ids per sample of the first steps (SFT,
    RM: the training items in stream order), or each training prompt's tokens and answer (tasks)."""
    model, tok = tiny_lm
    if want == "sft":
        stage = LMStage(cfg, model, tok, torch.device("cpu"))
        return [(s["input_ids"], s["labels"]) for step in range(3) for s in stage.prepare(step).samples] \
            + [(s["input_ids"], s["labels"]) for s in stage.eval_items]
    if want == "pairs":
        from trainfit.train.rm import RMStage

        stage = RMStage(cfg, None, tok, torch.device("cpu"))
        return [(p["chosen"], p["rejected"]) for step in range(3) for p in stage.prepare(step).samples]
    task = build_task(cfg.task)
    examples = [task.train_example(i) for i in range(task.num_train)] + task.eval_examples()
    return [(encode_prompt(tok, ex, True), ex.answer, ex.target) for ex in examples]


@pytest.mark.parametrize("name, fmt", CASES)
def test_a_shape_feeds_the_tokens_of_the_same_rows_as_trainfit_jsonl(tmp_path, tiny_lm, name, fmt):
    want, rows, canonical, _, settings = SHAPES[name]
    source = write(rows, fmt, tmp_path / name)
    reference = write(canonical or rows, "jsonl", tmp_path / "reference")
    plain = {k: v for k, v in settings.items() if k not in ("data.columns", "task.answer_pattern")}  # done already
    got = _fed(_config(tmp_path, want, source, settings), want, tiny_lm)
    assert got == _fed(_config(tmp_path, want, reference, plain), want, tiny_lm)
    assert len(got) >= 8 and all(len(x[0]) > 2 for x in got)


def test_the_start_line_says_what_fed_what(tmp_path):
    path = write(gsm8k_rows(4), "parquet", tmp_path / "gsm")
    rows = read_rows(TaskConfig(name="dataset", path=path), "task")
    assert rows.note == f"read 4 rows of {path}: prompt <- question, answer <- answer (question and answer)"
    verl = read_rows(TaskConfig(name="dataset", path=write(SHAPES["verl"][1], "parquet", tmp_path / "v")), "task")
    assert "messages <- prompt, answer <- reward_model.ground_truth (verl)" in verl.note
    row = verl[3]   # verl's other columns reach the reward functions as fields
    assert row["data_source"] == "openai/gsm8k" and row["extra_info"] == {"index": 3, "split": "train"}


def test_sft_rm_and_grpo_train_a_step_from_datasets(tmp_path):
    runs = [("sft", write(SHAPES["trl_messages"][1], "parquet", tmp_path / "m"), {}),
            ("pairs", write(SHAPES["trl_pairs"][1], "arrow", tmp_path / "p"), {}),
            ("task", write(SHAPES["verl"][1], "parquet", tmp_path / "v"), {"grpo.num_generations": 2,
                                                                          "train.global_batch_size": 4,
                                                                          "train.micro_batch_size": 4})]
    for want, path, more in runs:
        cfg = _config(tmp_path, want, path, {}, run_dir=str(tmp_path / f"run-{want}"), **{"train.max_steps": 1}, **more)
        result, = run_pipeline(cfg, console=QUIET)
        metrics = [json.loads(x) for x in (result.stage_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics if m["kind"] == "train"] == [1], want
        assert (result.final_dir / "model.safetensors").is_file()


def test_a_hub_id_resolves_offline_from_the_datasets_cache(tmp_path, monkeypatch):
    cache = use_cache(monkeypatch, tmp_path / "offline")
    cache_hub_dataset(cache, "openai/gsm8k", "main", {"train": gsm8k_rows(6), "test": gsm8k_rows(3, 100)},
                      tmp_path / "build")
    cfg = TaskConfig(name="dataset", path="openai/gsm8k", subset="main", eval_split="test")
    train, held = read_rows(cfg, "task"), read_rows(cfg, "task", held_out=True)
    assert [r["question"] for r in train] == [r["question"] for r in gsm8k_rows(6)]
    assert len(held) == 3 and held.label == "openai/gsm8k[main] test"
    assert train.note.startswith("read 6 rows of openai/gsm8k[main] train: prompt <- question, answer <- answer")
    with pytest.raises(ConfigError, match=r"no split 'validation'; its splits are train, test: set task.split"):
        read_rows(TaskConfig(name="dataset", path="openai/gsm8k", subset="main", split="validation"), "task")
    with pytest.raises(ConfigError, match="subset 'socratic' is not in the local datasets cache"):
        read_rows(TaskConfig(name="dataset", path="openai/gsm8k", subset="socratic"), "task")
    with pytest.raises(ConfigError, match=r"openai/other.* not in the local datasets cache \(.*hf-datasets\).*HF_HUB_OFFLINE"):
        read_rows(TaskConfig(name="dataset", path="openai/other"), "task")


def test_planner_measures_the_rows_the_trainer_reads(tmp_path, monkeypatch):
    from trainfit.plan.lengths import data_lengths

    monkeypatch.setenv("TRAINFIT_CACHE", str(tmp_path / "plan-cache"))
    rows = [{"messages": [MSG("user", "word " * (i + 1)), MSG("assistant", "ok " * (2 * i + 1))]} for i in range(9)]
    parquet, jsonl = write(rows, "parquet", tmp_path / "m"), write(rows, "jsonl", tmp_path / "m")
    a, b = (data_lengths(_config(tmp_path, "sft", p, {})) for p in (parquet, jsonl))
    assert a.source == b.source == "data" and a.rows == b.rows == 9
    assert (a.seq, a.mean) == (b.seq, b.mean) and a.seq > 8


def _gsm(tmp_path, fmt="parquet", rows=None):
    return write(rows or gsm8k_rows(8), fmt, tmp_path / "gsm")


@pytest.mark.parametrize("make, message", [
    # a missing column, a wrong mapping, a shape nobody maps
    (lambda p: read_rows(DataConfig(path=_gsm(p), columns={"prompt": "questoin", "completion": "answer"}), "sft"),
     r"data.columns.prompt='questoin': data.path .*gsm.parquet has no column 'questoin' \(its columns: answer, question\)"),
    (lambda p: read_rows(DataConfig(path=_gsm(p), columns={"promt": "question"}), "sft"),
     r"data.columns maps 'promt', which SFT do not read: map prompt, completion, messages"),
    (lambda p: read_rows(DataConfig(path=_gsm(p)), "sft"),
     r"has columns answer, question, which match no shape .* e.g. data.columns=\{prompt: question, completion: answer\}"),
    # a row with no value in a column the shape reads (met while tokenizing, a batch at a time)
    (lambda p: sft_items(read_rows(DataConfig(path=write([{"prompt": f"p{i}", "completion": None if i == 3 else f"c{i}"}
                                                          for i in range(6)], "parquet", p / "holes")), "sft"),
                         build_tokenizer(), 64),
     r"data.path .*holes.parquet, row 3 has no value in column 'completion' \(the completion\); fill it or drop "
     r"the row"),
    # an empty split
    (lambda p: read_rows(DataConfig(path=_saved_dict(p), eval_split="test"), "sft", held_out=True),
     r"data.path: split 'test' of .*saved has no rows \(its splits: train, test\); choose a split with rows "
     r"\(data.eval_split\)"),
    # a row whose answer does not parse
    (lambda p: build_task(TaskConfig(name="dataset", path=_gsm(p, rows=gsm8k_rows(5) + [{"question": "q", "answer": "7"}]),
                                     answer_pattern=r"####\s*(.+)", num_eval=1)),
     r"task.path .*gsm.parquet, row 5: task.answer_pattern '####\\\\s\*\(\.\+\)' does not match its answer '7'"),
    # a parquet file that is not one
    (lambda p: read_rows(DataConfig(path=_not_parquet(p)), "sft"), r"bad.parquet'?: a file there is not a parquet file"),
    # a hub revision given with local data (it would be ignored)
    (lambda p: read_rows(DataConfig(path=_gsm(p), revision="v1.0"), "sft"),
     r"data.revision='v1.0' picks a version of a hub dataset, but data.path=.*gsm.parquet' is local data"),
    # settings for datasets given to a JSONL file
    (lambda p: read_rows(DataConfig(path=_gsm(p, "jsonl"), split="test"), "sft"),
     r"data.split='test' applies to datasets with splits .* is a JSONL/text file"),
])
def test_bad_input_is_one_config_error_naming_the_dataset_and_the_fix(tmp_path, make, message):
    with pytest.raises(ConfigError, match=message):
        make(tmp_path)


def _saved_dict(tmp_path):
    import datasets

    rows = [{"prompt": "a", "completion": "b"}] * 4
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                               "test": datasets.Dataset.from_list(rows).select([])})
    dd.save_to_disk(str(tmp_path / "saved"))
    return str(tmp_path / "saved")


def _not_parquet(tmp_path):
    (tmp_path / "bad.parquet").write_text("prompt,completion\na,b\n")
    return str(tmp_path / "bad.parquet")


def test_train_exits_2_on_a_missing_column_without_a_traceback(tmp_path):
    from trainfit.app.cli import app

    path = _gsm(tmp_path)
    r = CliRunner().invoke(app, ["train", str(_write_cfg(tmp_path, path))])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "has no column 'qustion'" in text and "gsm.parquet" in text and "Traceback" not in r.output


def _write_cfg(tmp_path, path):
    from trainfit.config import to_yaml

    cfg = _config(tmp_path, "sft", path, {"data.columns": "{prompt: qustion, completion: answer}"},
                  run_dir=str(tmp_path / "run"))
    out = tmp_path / "cfg.yaml"
    out.write_text(to_yaml(cfg))
    return out


def test_pairs_from_sharegpt_and_alpaca_preference_rows(tmp_path):
    sharegpt = [{"conversations": [{"from": "human", "value": "2+2?"}], "chosen": {"from": "gpt", "value": "4"},
                 "rejected": {"from": "gpt", "value": "5"}}]
    alpaca = [{"instruction": "Add.", "input": "2+2", "chosen": "4", "rejected": "5"}]
    a = read_rows(DataConfig(path=write(sharegpt, "parquet", tmp_path / "s")), "pairs").to_list()
    b = read_rows(DataConfig(path=write(alpaca, "parquet", tmp_path / "a")), "pairs").to_list()
    assert a == [{"messages": [MSG("user", "2+2?")], "chosen": "4", "rejected": "5"}]
    assert b == [{"prompt": "Add.\n2+2", "chosen": "4", "rejected": "5"}]
    cfg = _config(tmp_path, "pairs", write(sharegpt * 4, "arrow", tmp_path / "s4"), {})
    note, = PairRows(cfg).notes
    assert note.startswith("read 4 rows of") and note.endswith("(sharegpt pairs)")


def test_sft_tokenizing_is_cached_and_the_same_in_processes(tmp_path, monkeypatch):
    from trainfit.data.sources import encode

    tok = build_tokenizer()
    rows = read_rows(DataConfig(path=write(SHAPES["trl_messages"][1] * 3, "parquet", tmp_path / "m")), "sft")
    items, stats = encode.sft_items(rows, tok, 64)
    other = build_tokenizer()
    other.chat_template = other.chat_template.replace("<|im_start|>", "<|im_start|> ")   # another tokenization
    assert encode.sft_items(rows, other, 64)[0].table.cache_files != items.table.cache_files
    with monkeypatch.context() as m:   # the same rows and settings: read back from datasets' cache file
        m.setattr(encode, "encode_record", lambda *a: pytest.fail("tokenized again"))
        again, _ = encode.sft_items(rows, tok, 64)
    assert again.table.cache_files == items.table.cache_files and stats["items"] == 30
    assert list(again) == list(items)
    monkeypatch.setattr(encode, "PARALLEL_FROM", 4)       # 30 rows tokenized by 2 processes
    monkeypatch.setattr(encode.os, "cpu_count", lambda: 2)
    split, _ = encode.sft_items(rows.select(range(30)), tok, 64)
    assert "_of_00002" in split.table.cache_files[0]["filename"] and list(split) == list(items)


def test_folders_globs_and_tsv_files(tmp_path):
    rows = SHAPES["trl_prompt_completion"][1]
    shards = tmp_path / "shards"
    shards.mkdir()
    write(rows[:4], "parquet", shards / "train-00000-of-00002")   # the hub's file naming gives the splits
    write(rows[4:8], "parquet", shards / "train-00001-of-00002")
    write(rows[8:], "parquet", shards / "test-00000-of-00001")
    (shards / "README.md").write_text("# notes, not data\n")
    folder = DataConfig(path=str(shards), eval_split="test")
    train, held = read_rows(folder, "sft"), read_rows(folder, "sft", held_out=True)
    assert sorted(r["prompt"] for r in train) == sorted(r["prompt"] for r in rows[:8]) and len(held) == 2
    assert train.label == f"{shards} train" and held.label == f"{shards} test"
    globbed = read_rows(DataConfig(path=str(shards / "train-*.parquet")), "sft")
    assert sorted(r["prompt"] for r in globbed) == sorted(r["prompt"] for r in rows[:8])
    (tmp_path / "rows.tsv").write_text("prompt\tcompletion\n" + "".join(f"{r['prompt']}\t{r['completion']}\n" for r in rows))
    assert read_rows(DataConfig(path=str(tmp_path / "rows.tsv")), "sft").to_list() == rows
    with pytest.raises(ConfigError, match=r"matches files of 2 readable kinds \(.csv, .md, .parquet\)"):
        write(rows, "csv", shards / "extra")
        read_rows(DataConfig(path=str(shards / "*.*")), "sft")


def test_eval_path_is_read_as_any_data_path(tmp_path):
    rows = SHAPES["alpaca"][1]
    data = DataConfig(path=write(rows[:6], "jsonl", tmp_path / "train"),
                      eval_path=write(rows[6:], "parquet", tmp_path / "held"))
    held = read_rows(data, "sft", held_out=True)
    assert held.key == "data.eval_path" and held.to_list() == SHAPES["alpaca"][2][6:]
    task = TaskConfig(name="dataset", path=write(gsm8k_rows(6), "parquet", tmp_path / "gsm"),
                      eval_path=write(gsm8k_rows(3, 100), "csv", tmp_path / "gsm-test"), answer_pattern=r"####\s*(.+)")
    held_out = build_task(task).eval_examples()
    assert [ex.prompt for ex in held_out] == [r["question"] for r in gsm8k_rows(3, 100)]
    assert [ex.answer for ex in held_out] == [r["answer"].rsplit("#### ", 1)[1] for r in gsm8k_rows(3, 100)]
