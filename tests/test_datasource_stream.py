"""Streamed pretraining (data.streaming): the blocks are those data.pack_texts makes from the same texts, a
stream resumed from its state goes on with the same next block, and a run killed after a checkpoint and
resumed trains on the same batches with the same losses as an uninterrupted one (CPU, preset:tiny)."""

from __future__ import annotations

import pytest
from rich.console import Console

from conftest import tiny_config
from datasource_helpers import write
from test_resume import kill_then_resume, train_losses, write_config
from trainfit.data.text import pack_texts
from trainfit.models.tokenizer import build_tokenizer
from trainfit.data.sources import open_stream
from trainfit.data.sources.stream import BlockStream
from trainfit.train.run import run_pipeline

QUIET = Console(file=open("/dev/null", "w"))
WORDS = "the cat sat on a mat while dogs ran far away from home".split()
# 24 short documents: ~300 tokens, so 6 steps of 4 blocks of 16 tokens run past the end of the stream.
TEXTS = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 9)) for i in range(24)]


pytestmark = pytest.mark.usefixtures("datasets_cache")


def _stream(tmp_path, block: int):
    cfg = tiny_config(tmp_path, "pretrain", **{"data.path": write([{"text": t} for t in TEXTS], "parquet",
                                                                    tmp_path / "corpus"),
                                               "data.streaming": True, "task.name": "null"})
    open_dataset, shape, label = open_stream(cfg.data)
    return lambda: BlockStream(open_dataset, shape, build_tokenizer(), block, label, cfg.data.text_field)


def test_stream_blocks_are_the_packed_blocks_and_resume_from_their_state(tmp_path):
    make = _stream(tmp_path, 16)
    # Past the end the next pass starts over: the stream is the texts packed twice over, [N, 16].
    packed = pack_texts(build_tokenizer(), TEXTS * 2, 16).tolist()
    whole = make()
    blocks = [whole.item(i)["input_ids"] for i in range(len(packed))]
    assert blocks == packed and len(packed) >= 30
    cut = make()
    first = [cut.item(i)["input_ids"] for i in range(7)]
    state = cut.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert first + [resumed.item(i)["input_ids"] for i in range(7, len(blocks))] == blocks
    with pytest.raises(RuntimeError, match="passed already"):
        resumed.item(2)


@pytest.mark.multiprocess
def test_streaming_pretraining_killed_and_resumed_matches_uninterrupted(tmp_path):
    corpus = write([{"text": t} for t in TEXTS], "parquet", tmp_path / "corpus")
    common = {"data.path": corpus, "data.streaming": True, "data.max_seq_length": 16, "task.name": "null",
              "train.max_steps": 6, "train.save_every": 3, "train.global_batch_size": 4,
              "train.micro_batch_size": 2}
    ref = tiny_config(tmp_path, "pretrain", run_dir=str(tmp_path / "ref"), **common)
    run_pipeline(ref, console=QUIET)
    expected = train_losses(tmp_path / "ref")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6] and len(set(expected.values())) == 6
    cut = tiny_config(tmp_path, "pretrain", run_dir=str(tmp_path / "cut"), **common)
    kill_then_resume(write_config(cut, tmp_path / "cut.yaml"), tmp_path / "cut", expected)
