"""`task.name: jsonl` with images: rows in either image convention become ImageExamples for a
vision-language policy (GRPO and SFT from a task), and bad rows or a text model are refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image
from rich.console import Console

from trainfit.config import ConfigError, load_config
from trainfit.tasks.jsonl_task import JsonlTask
from trainfit.train.loop import train_stage
from trainfit.train.faults import Faults
from trainfit.train.report import read_metrics
from trainfit.train.run import build_stage

QUIET = Console(file=open("/dev/null", "w"))
RED, BLUE = (220, 30, 30), (30, 30, 220)


def _write(tmp_path: Path, rows: list[dict]) -> Path:
    (tmp_path / "img").mkdir(exist_ok=True)
    Image.new("RGB", (32, 32), RED).save(tmp_path / "img" / "red.png")
    Image.new("RGB", (64, 32), BLUE).save(tmp_path / "img" / "blue.png")
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    # image parts in the user turn
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/red.png"},
                                               {"type": "text", "text": "Which colour?"}]}], "answer": "red"},
    # an `images` list with placeholders in the messages
    {"images": ["img/blue.png", "img/red.png"],
     "messages": [{"role": "user", "content": "<image> then <image>: which is first?"}], "answer": "blue"},
    # a raw prompt with a placeholder
    {"prompt": "<image>Colour:", "images": ["img/blue.png"], "answer": "blue"},
    {"prompt": "<image>Colour:", "images": ["img/red.png"], "answer": "red"},
]


def test_rows_in_either_convention_carry_their_images_in_order(tmp_path):
    task = JsonlTask(str(_write(tmp_path, ROWS)), num_eval=1, chat=True, seed=0)
    seen = []
    for ex in [task.train_example(i) for i in range(task.num_train)] + task.eval_examples():
        text = ex.messages[0]["content"]   # chat=True renders a raw prompt as one user turn
        assert text.count("<image>") == len(ex.images) >= 1 and all(im.mode == "RGB" for im in ex.images)
        seen.append((text, ex.answer, [im.getpixel((0, 0)) for im in ex.images]))
    assert sorted(seen) == sorted([
        ("<image>Which colour?", "red", [RED]),   # the image part became a placeholder where it was
        ("<image> then <image>: which is first?", "blue", [BLUE, RED]),
        ("<image>Colour:", "blue", [BLUE]),
        ("<image>Colour:", "red", [RED]),
    ])


@pytest.mark.parametrize("row, words", [
    ({"prompt": "<image>Colour:", "images": ["img/missing.png"], "answer": "red"}, ["line 1", "missing.png"]),
    ({"prompt": "Colour:", "images": ["img/red.png"], "answer": "red"}, ["line 1", "1 images", "0 <image>"]),
    ({"images": ["img/red.png"], "messages": [{"role": "user", "content": "<image><image>"}], "answer": "red"},
     ["line 1", "<image>"]),
])
def test_bad_image_rows_are_refused_when_the_task_is_built(tmp_path, row, words):
    with pytest.raises(ConfigError) as e:
        JsonlTask(str(_write(tmp_path, [row, ROWS[0]])), num_eval=1, chat=True)
    assert all(w in str(e.value) for w in words), str(e.value)


def _config(tmp_path, path: Path, stage: str, model: str = "preset:vlm-tiny"):
    base = {"stage": stage, "run_dir": str(tmp_path / "run"), "model": {"name": model},
            "task": {"name": "jsonl", "path": str(path), "chat": True, "num_eval": 1},
            "grpo": {"num_generations": 2}, "rollout": {"max_new_tokens": 3},
            "train": {"global_batch_size": 4, "micro_batch_size": 4, "max_steps": 1, "lr": 1e-3, "device": "cpu",
                      "eval_every": 0, "save_every": 0},
            "logging": {"tensorboard": False, "progress": False, "plot": False}}
    return load_config(None, [], base=base)


def test_grpo_step_on_a_jsonl_image_task_feeds_the_images(tmp_path):
    cfg = _config(tmp_path, _write(tmp_path, ROWS), "grpo")
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    assert stage.vision is not None
    image_id = stage.vision.image_token_id
    samples = stage.prepare(0).samples
    # Every sample's prompt holds its images' tokens and the images themselves travel with it.
    assert all(s.get("images") for s in samples)
    for s in samples:
        n_tok = sum(1 for t in s["input_ids"] if t == image_id)
        expected = sum(stage.vision.tokens_for(im.height, im.width) for im in s["images"])
        assert n_tok == expected > 0
        assert not any(m and t == image_id for t, m in zip(s["input_ids"], s["loss_mask"]))
    train_stage(cfg, loaded, stage, tmp_path / "stage", resume=False, console=QUIET, faults=Faults(),
                save_final=lambda path, state_dict=None: path)
    assert [m for m in read_metrics(tmp_path / "stage" / "metrics.jsonl") if "loss" in m]


def test_a_text_model_with_an_image_task_is_a_config_error(tmp_path):
    cfg = _config(tmp_path, _write(tmp_path, ROWS), "grpo", model="preset:tiny")
    with pytest.raises(ConfigError, match="text model"):
        build_stage(cfg, tmp_path / "stage")


def test_a_text_model_with_image_sft_data_is_a_config_error(tmp_path):
    path = _write(tmp_path, [{"messages": [{"role": "user", "content": [{"type": "image", "image": "img/red.png"}]},
                                           {"role": "assistant", "content": "red"}]}] * 4)
    cfg = load_config(None, [], base={
        "stage": "sft", "run_dir": str(tmp_path / "run"), "model": {"name": "preset:tiny"},
        "data": {"path": str(path)}, "train": {"max_steps": 1, "device": "cpu"},
        "logging": {"tensorboard": False, "progress": False, "plot": False}})
    with pytest.raises(ConfigError, match="text model"):
        build_stage(cfg, tmp_path / "stage")
