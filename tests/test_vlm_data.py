"""Vision-language data: image tokens per image equal the processor's, chat rows with images keep loss
on assistant text only, both image conventions encode alike, a row that cannot fit errors clearly."""

from __future__ import annotations

import json

import pytest
import torch

from test_vlm_helpers import SIZES, row, write_dataset
from trainfit.config import ConfigError, ModelConfig
from trainfit.data.text import IGNORE
from trainfit.models.policy import load_tokenizer
from trainfit.data.image_chat import BASE_KEY, build_vlm_items, collate_vlm, encode_caption, encode_vlm_messages
from trainfit.models.images import load_processor


def processor(**mc):
    cfg = ModelConfig(name="preset:vlm-tiny", **mc)
    return load_processor(cfg, load_tokenizer(cfg))


@pytest.mark.parametrize("limits", [{}, {"max_pixels": 64 * 64}, {"min_pixels": 160 * 160, "max_pixels": 512 * 512}])
def test_image_tokens_equal_the_processors_count(limits):
    from PIL import Image

    proc = processor(**limits)
    merge = proc.image_processor.merge_size
    counts = []
    for w, h in SIZES:
        out = proc.pixels([Image.new("RGB", (w, h))])
        t, gh, gw = out["image_grid_thw"][0].tolist()
        assert proc.tokens_for(h, w) == t * gh * gw // merge ** 2
        # ...and the patches the vision tower gets are those tokens x merge^2.
        assert out["pixel_values"].shape[0] == proc.tokens_for(h, w) * merge ** 2
        counts.append(proc.tokens_for(h, w))
    assert len(set(counts)) > 1 or limits.get("max_pixels") == 64 * 64   # sizes matter unless capped


def test_max_pixels_bounds_tokens():
    small, large = processor(max_pixels=64 * 64), processor(max_pixels=512 * 512)
    assert small.tokens_for(400, 400) == 4 < large.tokens_for(400, 400)


def test_loss_on_assistant_text_only(tmp_path):
    path = write_dataset(tmp_path, n=2)
    proc = processor()
    tok = proc.tokenizer
    r = {**json.loads(path.read_text().splitlines()[0]), BASE_KEY: str(tmp_path)}
    item = encode_vlm_messages(r, tok, proc, max_len=512)
    ids, labels = item["input_ids"], item["labels"]
    n_img = proc.tokens_for(SIZES[0][1], SIZES[0][0])
    assert sum(t == proc.image_token_id for t in ids) == n_img == item["image_tokens"]
    answer = r["messages"][1]["content"]
    want = tok(answer, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert [y for y in labels if y != IGNORE] == want
    # The labelled tokens are the last ones before the trailing newline: the assistant turn.
    first = next(i for i, y in enumerate(labels) if y != IGNORE)
    assert ids[first:first + len(want)] == want and all(y == IGNORE for y in labels[:first])


def test_both_conventions_encode_alike(tmp_path):
    write_dataset(tmp_path, n=1)
    proc = processor()
    a = encode_vlm_messages({**row("img/0.png", "Q?", "red", parts=True), BASE_KEY: str(tmp_path)}, proc.tokenizer,
                            proc, 512)
    b = encode_vlm_messages({**row("img/0.png", "Q?", "red", parts=False), BASE_KEY: str(tmp_path)},
                            proc.tokenizer, proc, 512)
    assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]


def test_too_long_row_errors_and_never_cuts_an_image(tmp_path):
    write_dataset(tmp_path, n=3)
    proc = processor()
    r = {**row("img/2.png", "What colour is the square?", "red"), BASE_KEY: str(tmp_path)}
    n = len(encode_vlm_messages(r, proc.tokenizer, proc, 10 ** 6)["input_ids"])
    with pytest.raises(ConfigError) as e:
        encode_vlm_messages(r, proc.tokenizer, proc, max_len=10, where="record 7")
    msg = str(e.value)
    assert "record 7" in msg and f"{n} tokens" in msg and "data.max_seq_length=10" in msg and "max_pixels" in msg
    # Text after the image may be cut (as text rows are): the image tokens stay whole.
    long = {**row("img/2.png", "Q?", "red " * 40), BASE_KEY: str(tmp_path)}
    item = encode_vlm_messages(long, proc.tokenizer, proc, max_len=60)
    assert item["truncated"] and len(item["input_ids"]) == 60
    assert sum(t == proc.image_token_id for t in item["input_ids"]) == item["image_tokens"]


def test_missing_image_is_a_config_error(tmp_path):
    proc = processor()
    with pytest.raises(ConfigError, match="does not exist"):
        encode_vlm_messages({**row("nope.png", "Q?", "red"), BASE_KEY: str(tmp_path)}, proc.tokenizer, proc, 512)


def test_caption_pairs_and_collate(tmp_path):
    write_dataset(tmp_path, n=2)
    proc = processor()
    cap = encode_caption({"image": "img/1.png", "text": "a blue square", BASE_KEY: str(tmp_path)},
                         proc.tokenizer, proc, 512)
    want = proc.tokenizer("a blue square", add_special_tokens=False)["input_ids"] + [proc.tokenizer.eos_token_id]
    assert [y for y in cap["labels"] if y != IGNORE] == want
    items, stats = build_vlm_items([{**json.loads(line), BASE_KEY: str(tmp_path)}
                                    for line in (tmp_path / "train.jsonl").read_text().splitlines()],
                                   proc.tokenizer, proc, 512, "sft")
    assert stats["images"] == 2 and stats["image_tokens"] == sum(it["image_tokens"] for it in items)
    b = collate_vlm(items, proc.tokenizer.pad_token_id, proc)
    assert b["image_grid_thw"].shape == (2, 3)
    assert int(b["mm_token_type_ids"].sum()) == stats["image_tokens"]
    assert b["pixel_values"].shape[0] == stats["image_tokens"] * proc.image_processor.merge_size ** 2
    assert torch.equal(b["mm_token_type_ids"].bool(), b["input_ids"] == proc.image_token_id)


def test_pixel_limits_are_checked_together(tmp_path):
    from test_vlm_helpers import vlm_config

    data = write_dataset(tmp_path, n=1)
    with pytest.raises(ConfigError, match="model.min_pixels=9000 is larger than model.max_pixels=4096"):
        vlm_config(tmp_path, data, **{"model.min_pixels": 9000, "model.max_pixels": 4096})


def test_images_resolve_next_to_their_jsonl_in_a_directory(tmp_path):
    from trainfit.data.text import load_records
    from trainfit.data.image_chat import mark_base_dirs

    write_dataset(tmp_path / "a", n=2)
    write_dataset(tmp_path / "b", n=2, seed=1)
    records = mark_base_dirs(load_records(str(tmp_path)), str(tmp_path))
    assert sorted({r[BASE_KEY] for r in records}) == [str(tmp_path / "a"), str(tmp_path / "b")]
    proc = processor()
    items, stats = build_vlm_items(records, proc.tokenizer, proc, 512, "sft")
    assert stats["images"] == 4 and all(p.startswith(str(tmp_path)) for it in items for p in it["images"])
