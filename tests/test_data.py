"""Data pipeline: loading, format detection, loss masks (both chat-template paths), packing, batching."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from trainfit.config import ConfigError
from trainfit.data.text import (IGNORE, build_pretrain_blocks, build_sft_items, collate, detect_format,
                           encode_example, encode_messages, encode_prompt, encode_prompt_completion,
                           load_records, pack_texts, split_records)
from trainfit.models.tokenizer import build_tokenizer

EOS = "<|im_end|>"
CHAT = [
    {"role": "system", "content": "You add numbers."},
    # The user repeats the answer text, so a mask found by searching for the content would be wrong.
    {"role": "user", "content": "Reply It is 5. if 2 + 3 = 5."},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "And 40 + 4?"},
    {"role": "assistant", "content": "44, the sum."},
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tok_plain():
    """The preset tokenizer with its `{% generation %}` markers removed (forces the prefix fallback)."""
    t = build_tokenizer()
    t.chat_template = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", t.chat_template)
    assert "{% generation" not in t.chat_template and "endgeneration" not in t.chat_template
    return t


def labelled_text(tok, enc) -> str:
    return tok.decode([t for t, y in zip(enc["input_ids"], enc["labels"]) if y != IGNORE])


def loss_runs(enc) -> list[list[int]]:
    """Contiguous runs of labelled ids, so separate assistant turns can be checked one by one."""
    runs, cur = [], []
    for t, y in zip(enc["input_ids"], enc["labels"]):
        if y != IGNORE:
            assert y == t  # labels are aligned with inputs, not shifted
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def test_prompt_completion_plain_masks_exactly_completion_and_eos(tok):
    enc = encode_prompt_completion(tok, "What is 12 + 7? ", "19", max_len=128, chat=False)
    assert labelled_text(tok, enc) == "19" + EOS
    assert enc["input_ids"][-1] == tok.eos_token_id == 2
    prompt_ids = tok("What is 12 + 7? ", add_special_tokens=False)["input_ids"]
    assert enc["input_ids"][: len(prompt_ids)] == prompt_ids
    assert enc["labels"][: len(prompt_ids)] == [IGNORE] * len(prompt_ids)
    assert tok.decode(enc["input_ids"]) == "What is 12 + 7? 19" + EOS
    assert enc["truncated"] is False


def test_prompt_completion_boundary_is_exact_where_bpe_would_merge(tok):
    # "abo" + "ut" would tokenize jointly as "about"; separate tokenization keeps the prompt out of loss.
    enc = encode_prompt_completion(tok, "how abo", "ut that", max_len=64, chat=False)
    assert labelled_text(tok, enc) == "ut that" + EOS


def test_prompt_completion_chat_masks_assistant_turn(tok):
    enc = encode_prompt_completion(tok, "What is 2 + 3?", "5", max_len=128, chat=True)
    assert labelled_text(tok, enc) == "5" + EOS
    text = tok.decode(enc["input_ids"])
    assert text.startswith("<|im_start|>user\nWhat is 2 + 3?" + EOS) and text.endswith("assistant\n5" + EOS + "\n")


def test_messages_loss_on_every_assistant_turn(tok, tok_plain):
    results = []
    for t in (tok, tok_plain):
        enc = encode_messages(t, CHAT, max_len=256)
        runs = [t.decode(r) for r in loss_runs(enc)]
        assert runs == ["It is 5." + EOS, "44, the sum." + EOS]
        results.append(enc)
    # The generation-marker path and the prefix fallback give identical ids and labels.
    assert results[0]["input_ids"] == results[1]["input_ids"]
    assert results[0]["labels"] == results[1]["labels"]


def test_messages_without_assistant_has_no_loss_and_is_dropped(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert all(y == IGNORE for y in encode_messages(tok, msgs, 64)["labels"])
    items, stats = build_sft_items([{"messages": msgs}, {"messages": CHAT}], tok, 256)
    assert len(items) == 1 and stats["dropped_no_loss"] == 1


def test_fallback_handles_template_that_is_not_prefix_stable(tok):
    # Like Qwen3: the last assistant turn renders with an empty think block, earlier ones without,
    # so render(messages[:k+1]) is not a prefix of the full render and the content search is used for
    # the first turn. The last turn is prefix-stable: what follows the generation prompt, think block
    # included, is what the model must generate, so it carries loss.
    t = build_tokenizer()
    t.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    enc = encode_messages(t, CHAT, max_len=256)
    assert [t.decode(r) for r in loss_runs(enc)] == ["It is 5." + EOS, "<think></think>44, the sum." + EOS]


def test_truncation_flag_and_right_cut(tok):
    full = encode_prompt_completion(tok, "What is 12 + 7? ", "19 and more words", max_len=1000, chat=False)
    cut = encode_prompt_completion(tok, "What is 12 + 7? ", "19 and more words", max_len=10, chat=False)
    assert cut["truncated"] is True and full["truncated"] is False
    assert cut["input_ids"] == full["input_ids"][:10] and cut["labels"] == full["labels"][:10]
    exact = encode_prompt_completion(tok, "a", "b", max_len=len(tok("a")["input_ids"]) + 2, chat=False)
    assert exact["truncated"] is False


def test_build_sft_items_drops_records_whose_loss_is_cut_away(tok):
    long_prompt = "word " * 60
    recs = [{"prompt": long_prompt, "completion": "x"}, {"prompt": "1+1=", "completion": "2"}]
    items, stats = build_sft_items(recs, tok, max_len=16)
    assert stats["format"] == "prompt_completion"
    assert stats["records"] == 2 and stats["items"] == 1
    assert stats["dropped_no_loss"] == 1 and stats["truncated"] == 1
    assert labelled_text(tok, items[0]) == "2" + EOS
    assert stats["loss_tokens"] == 2
    with pytest.raises(ConfigError, match="max_seq_length"):
        build_sft_items(recs[:1], tok, max_len=16)


def test_build_sft_items_formats_and_errors(tok):
    items, stats = build_sft_items([{"messages": CHAT}], tok, 256)
    assert stats["format"] == "messages" and len(items) == 1
    items, _ = build_sft_items([{"prompt": "2+3=", "completion": "5"}], tok, 64, chat=True)
    assert labelled_text(tok, items[0]) == "5" + EOS
    # Conversational prompt/completion (prompt given as messages).
    items, _ = build_sft_items([{"prompt": CHAT[:2], "completion": "It is 5."}], tok, 64)
    assert labelled_text(tok, items[0]) == "It is 5." + EOS
    with pytest.raises(ConfigError, match=r"data.path: record 1 has keys \['prompt'\]"):
        build_sft_items([{"prompt": "a", "completion": "b"}, {"prompt": "a"}], tok, 64)
    with pytest.raises(ConfigError, match="stage pretrain"):
        build_sft_items([{"text": "hello"}], tok, 64)


def test_encode_example_and_prompt_agree(tok):
    ex = SimpleNamespace(prompt="What is 3 + 4?", messages=None, target="7")
    for chat in (False, True):
        enc = encode_example(tok, ex, 128, chat)
        prompt = encode_prompt(tok, ex, chat)
        # Generation starts from exactly the tokens that precede the target in training.
        assert enc["input_ids"][: len(prompt)] == prompt
        assert all(y == IGNORE for y in enc["labels"][: len(prompt)])
        assert labelled_text(tok, enc) == "7" + EOS
    assert tok.decode(encode_prompt(tok, ex, True)).endswith("<|im_start|>assistant\n")
    assert tok.decode(encode_prompt(tok, ex, False)) == "What is 3 + 4?"
    ex_m = SimpleNamespace(prompt=None, messages=CHAT[:4], target="44")
    enc = encode_example(tok, ex_m, 256, chat=False)
    prompt = encode_prompt(tok, ex_m, chat=False)
    assert enc["input_ids"][: len(prompt)] == prompt
    assert [tok.decode(r) for r in loss_runs(enc)] == ["It is 5." + EOS, "44" + EOS]


def test_pack_texts_order_eos_and_shape(tok):
    texts = ["the first text", "a second one", "and 123"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    stream = ids[0] + [2] + ids[1] + [2] + ids[2] + [2]
    block = 4
    blocks = pack_texts(tok, texts, block)
    n = len(stream) // block
    assert blocks.dtype == torch.long and blocks.shape == (n, block)
    assert blocks.flatten().tolist() == stream[: n * block]  # order kept, tail dropped
    assert pack_texts(tok, texts, len(stream)).flatten().tolist() == stream
    assert tok.decode(stream) == "the first text" + EOS + "a second one" + EOS + "and 123" + EOS
    assert pack_texts(tok, texts, len(stream) + 1).shape == (0, len(stream) + 1)


def test_build_pretrain_blocks(tok):
    recs = [{"body": "some words to pack " * 5}, {"body": "more words here " * 5}]
    blocks = build_pretrain_blocks(recs, tok, 8, text_field="body")
    assert blocks.shape[1] == 8 and blocks.shape[0] >= 2
    with pytest.raises(ConfigError, match="data.text_field"):
        build_pretrain_blocks(recs, tok, 8, text_field="text")
    with pytest.raises(ConfigError, match="max_seq_length=4096"):
        build_pretrain_blocks(recs, tok, 4096, text_field="body")


def test_collate_right_pads_with_masks():
    items = [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    b = collate(items, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert all(v.dtype == torch.long and v.shape == (2, 3) for v in b.values())


def test_detect_format():
    assert detect_format({"text": "x"}) == "text"
    assert detect_format({"body": "x"}, text_field="body") == "text"
    assert detect_format({"prompt": "p", "completion": "c"}) == "prompt_completion"
    assert detect_format({"messages": [], "text": "x"}) == "messages"
    with pytest.raises(ConfigError) as e:
        detect_format({"question": "q", "answer": "a"})
    msg = str(e.value)
    assert "['answer', 'question']" in msg
    assert all(s in msg for s in ("`text`", "`prompt_completion`", "`messages`"))


def test_load_records_txt_jsonl_dir_glob(tmp_path):
    (tmp_path / "b.txt").write_text("line one\nline two\n")
    (tmp_path / "a.jsonl").write_text('{"prompt": "p1", "completion": "c1"}\n\n{"prompt": "p2", "completion": "c2"}\n')
    (tmp_path / "c.json").write_text(json.dumps([{"text": "j1"}, {"text": "j2"}]))
    (tmp_path / "skip.csv").write_text("x,y\n")
    assert load_records(str(tmp_path / "b.txt")) == [{"text": "line one\nline two\n"}]
    assert [r["prompt"] for r in load_records(str(tmp_path / "a.jsonl"))] == ["p1", "p2"]
    # Directory: sorted files a.jsonl, b.txt, c.json; the .csv is ignored.
    recs = load_records(str(tmp_path))
    assert [r.get("prompt", r.get("text")) for r in recs] == ["p1", "p2", "line one\nline two\n", "j1", "j2"]
    assert len(load_records(str(tmp_path / "*.j*"))) == 4


def test_load_records_errors_name_file_line_and_key(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "broken"\n')
    with pytest.raises(ConfigError) as e:
        load_records(str(bad))
    assert "data.path" in str(e.value) and "bad.jsonl line 2" in str(e.value)
    (tmp_path / "list.jsonl").write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(ConfigError, match="line 2 is a list"):
        load_records(str(tmp_path / "list.jsonl"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="task.path"):
        load_records(str(tmp_path / "missing.jsonl"), key="task.path")
    with pytest.raises(ConfigError, match="glob matches no"):
        load_records(str(tmp_path / "*.parquet"))
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(ConfigError, match="rename"):
        load_records(str(tmp_path / "x.csv"))


def test_a_json_document_error_names_its_line_and_column_and_its_items_their_lines(tmp_path):
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(3)]
    text = json.dumps(rows, indent=1)   # "[", then 4 lines an item: item i starts on line 2 + 4i
    good = tmp_path / "good.json"
    good.write_text(text)
    assert load_records(str(good)).origins == [f"{good}, item {i} (line {2 + 4 * i})" for i in range(3)]
    bad = tmp_path / "bad.json"
    bad.write_text(text.replace('"completion": "2"', '"completion" "2"'))   # item 1's colon missing, on line 8
    with pytest.raises(ConfigError) as e:
        load_records(str(bad))
    assert "bad.json is not valid JSON (Expecting ':' delimiter at line 8, column 16)" in str(e.value), str(e.value)


def test_split_records_deterministic_and_disjoint():
    recs = [{"i": i} for i in range(100)]
    tr, ev = split_records(recs, 0.1, seed=3)
    assert (tr, ev) == split_records(recs, 0.1, seed=3)
    assert len(ev) == 10 and len(tr) == 90
    assert sorted(r["i"] for r in tr + ev) == list(range(100))  # disjoint and complete
    assert ev != split_records(recs, 0.1, seed=4)[1]
    assert ev != recs[-10:]  # shuffled, not a tail cut
    assert split_records(recs, 0.0, 0) == (recs, [])
    tr, ev = split_records(recs[:3], 0.05, 0)
    assert len(ev) == 1 and len(tr) == 2
