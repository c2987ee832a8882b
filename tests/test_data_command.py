"""data.template decides how prompt/completion and alpaca rows become sequences (plain, chat, a format string),
and `trainfit data` prints the first examples of a stage from the trainer's own loaders: the decoded text with
the trained tokens marked, pairs with both sides, RL prompts with their answers and rewards (CPU, preset:tiny's
tokenizer)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import tiny_config
from trainfit.app.cli import app
from trainfit.config import ConfigError
from trainfit.data import sources
from trainfit.data.text import IGNORE
from trainfit.models.tokenizer import build_tokenizer
from trainfit.train.sft import lm_items

E = "<|im_end|>"
ROWS = [{"instruction": f"Double {i}.", "input": "", "output": str(2 * i)} for i in range(1, 6)]


def _jsonl(tmp_path, rows, name="rows") -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _first_item(cfg) -> tuple[str, str]:
    tok = build_tokenizer()
    items, _, notes = lm_items(cfg, tok, sources.read_rows(cfg.data, "sft"), None)
    ids, labels = items[0]["input_ids"], items[0]["labels"]
    return tok.decode(ids), tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE]), notes


@pytest.mark.parametrize("template, text, trained", [
    ("plain", "Double 1.2" + E, "2" + E),   # TRL's plain concatenation: no separator (the default)
    ("chat", f"<|im_start|>user\nDouble 1.{E}\n<|im_start|>assistant\n2{E}\n", "2" + E),
    ('"### Question\\n{prompt}\\n### Answer\\n{completion}\\n"', "### Question\nDouble 1.\n### Answer\n2\n" + E,
     "2\n" + E),
])
def test_the_template_decides_the_sequence_and_its_loss(tmp_path, template, text, trained):
    cfg = tiny_config(tmp_path, "sft", **{"data.path": _jsonl(tmp_path, ROWS), "task.name": "null",
                                          "data.eval_fraction": 0.0, "data.template": template})
    got_text, got_trained, notes = _first_item(cfg)
    assert (got_text, got_trained) == (text, trained)
    assert notes and "data.template=" in notes[0]   # said at start


def test_a_template_without_both_fields_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"data.template='Q: \{prompt\}' is neither `plain` nor `chat`"):
        tiny_config(tmp_path, "sft", **{"data.path": "x.jsonl", "task.name": "null", "data.template": '"Q: {prompt}"'})


def _cli(tmp_path, *overrides: str) -> str:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  name: preset:tiny\ntrain:\n  device: cpu\n")
    r = CliRunner().invoke(app, ["data", str(cfg), *overrides, "--rows", "2"])
    assert r.exit_code == 0, r.output
    return r.output


def test_data_prints_sft_examples_with_the_trained_tokens_marked(tmp_path):
    out = _cli(tmp_path, f"data.path={_jsonl(tmp_path, ROWS)}", "data.eval_fraction=0",
               'data.template="Q: {prompt}\\nA: {completion}"')
    assert f"Q: Double 1.\nA: ⟦2{E}⟧" in out and f"Q: Double 2.\nA: ⟦4{E}⟧" in out and "Double 3." not in out
    assert "(alpaca)" in out and "data.template=format" in out


def test_data_prints_pairs_and_rl_prompts(tmp_path):
    pairs = _jsonl(tmp_path, [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(4)],
                   "pairs")
    out = _cli(tmp_path, "stage=dpo", f"data.path={pairs}", "data.eval_fraction=0")
    assert "0+1=" in out and f"⟦1{E}⟧" in out and f"⟦2{E}⟧" in out and "1+1=" in out and "2+1=" not in out
    task = _jsonl(tmp_path, [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(5)], "task")
    out = _cli(tmp_path, "stage=grpo", "task.name=jsonl", f"task.path={task}", "task.num_eval=1", "task.chat=true")
    assert "rewards: correctness" in out and out.count("<|im_start|>assistant") == 2
    assert all(f"answer '{a}'" in out for a in _answers_of_first_prompts(out))


def _answers_of_first_prompts(out: str) -> list[str]:
    """Each printed prompt's answer is its own: "What is i+i?" is answered 2i."""
    found = []
    for line in out.splitlines():
        if line.startswith("What is "):
            i = int(line.split("+")[0].removeprefix("What is "))
            found.append(str(2 * i))
    assert len(found) == 2
    return found


def test_data_names_a_stage_the_pipeline_lacks(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  name: preset:tiny\ntrain:\n  device: cpu\n")
    r = CliRunner().invoke(app, ["data", str(cfg), f"data.path={_jsonl(tmp_path, ROWS)}", "--stage", "3"])
    assert r.exit_code == 2 and "--stage 3: the config has 1 stage(s)" in " ".join(r.output.split())


def test_data_prints_pretraining_blocks_alike_read_whole_or_streamed(tmp_path):
    docs = _jsonl(tmp_path, [{"body": f"document {i} " * 10} for i in range(5)], "docs")
    args = ("stage=pretrain", f"data.path={docs}", "data.columns={text: body}", "data.max_seq_length=16",
            "data.eval_fraction=0")
    whole, streamed = _cli(tmp_path, *args), _cli(tmp_path, *args, "data.streaming=true")
    blocks = lambda out: out[out.index("example 0"):]  # noqa: E731
    assert blocks(whole) == blocks(streamed) and "⟦document 0 document" in whole and "example 1" in whole
