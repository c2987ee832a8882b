"""The final save's shard writer, on one process (CPU): whole weights written a bounded shard at a time, in
the files and index transformers' `save_pretrained(max_shard_size=...)` writes, each tensor read once, and
a failed write leaves no file that looks whole. The gathers from FSDP2 shards are test_fsdp_adapters.py's."""

from __future__ import annotations

import errno
import json
import os
import weakref

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trainfit.models import save_shards
from trainfit.models.save import save_weights_streamed
from trainfit.models.save_shards import INDEX_NAME, LazyWeights, plan_shards, write_shards


def test_shards_split_where_the_next_tensor_would_pass_the_bound():
    sizes = [("a", 40), ("b", 50), ("c", 20), ("big", 300), ("d", 10), ("e", 95)]
    assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["big"], ["d"], ["e"]]
    assert plan_shards(sizes, 10 ** 6) == [["a", "b", "c", "big", "d", "e"]]


def streamed(model) -> LazyWeights:
    """The model's tensors as the final save reads them, a tied LM head under its first name only."""
    sd = model.state_dict()
    return LazyWeights.of({k: sd[k] for k in dict(model.named_parameters())})


def test_streamed_shards_match_save_pretrained_and_load_equal(tiny_lm, tmp_path):
    model, tokenizer = tiny_lm
    bound = 200_000   # the tiny model's 0.6 MiB in several files, its 128 KiB embeddings in one of them
    weights = streamed(model)
    save_weights_streamed(model, tmp_path / "ours", weights)
    model.save_pretrained(str(tmp_path / "theirs"), max_shard_size=bound)
    for d in ("ours", "theirs"):
        tokenizer.save_pretrained(str(tmp_path / d))
    # save_weights_streamed writes transformers' 5 GB bound; the same writer at a small bound splits:
    files = write_shards(tmp_path / "split", weights, max_bytes=bound)
    model.config.save_pretrained(str(tmp_path / "split"))
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(shards) > 2 and [f.name for f in shards][0] == f"model-00001-of-{len(shards):05d}.safetensors"
    biggest = max(weights._bytes.values())
    for f in shards:   # each file within the bound (a tensor alone may pass it)
        held = load_file(str(f))
        assert sum(t.numel() * t.element_size() for t in held.values()) <= max(bound, biggest)
    ours = json.loads((tmp_path / "split" / INDEX_NAME).read_text())
    theirs = json.loads((tmp_path / "theirs" / INDEX_NAME).read_text())
    assert ours["weight_map"] == theirs["weight_map"]
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    assert weights.read == weights.keys() * 2   # each tensor read once per save, in order
    want = model.state_dict()
    for d in ("ours", "split"):
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / d)).state_dict()
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want), d
    assert json.loads((tmp_path / "ours" / "config.json").read_text()) == \
        json.loads((tmp_path / "theirs" / "config.json").read_text())


def test_a_write_that_fails_leaves_no_file_that_looks_whole(tiny_lm, tmp_path, monkeypatch):
    model, _ = tiny_lm
    real, calls = save_shards.save_file, []

    def full_disk(state, path, metadata=None):   # the second file fails half-way, as on a full disk
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(state, path, metadata=metadata)

    monkeypatch.setattr(save_shards, "save_file", full_disk)
    with pytest.raises(OSError) as e:
        write_shards(tmp_path, streamed(model), max_bytes=200_000)
    assert e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == [calls[0].rsplit("/", 1)[1].removesuffix(".tmp")]


def test_the_writer_holds_one_shard_at_a_time_not_the_model(tiny_lm, tmp_path):
    model, _ = tiny_lm
    sd = {k: v for k, v in model.state_dict().items() if k in dict(model.named_parameters())}
    alive, peak = [0], [0]

    def fetch(name):   # a fresh copy per read, as a gather makes; counted while something holds it
        t = sd[name].clone()
        n = t.numel() * t.element_size()
        alive[0] += n
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - n))
        return t

    weights = LazyWeights([(k, v.numel(), v.element_size()) for k, v in sd.items()], fetch)
    bound = 200_000
    write_shards(tmp_path, weights, max_bytes=bound)
    total, biggest = sum(n for _, n in weights.sizes), max(n for _, n in weights.sizes)
    assert peak[0] <= max(bound, biggest) < total / 2 and alive[0] == 0, (peak, total)
