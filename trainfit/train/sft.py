"""SFT and continued pretraining: next-token loss on completion / assistant tokens, or packed text.

    trainfit train examples/sft.yaml                 # one device (CPU or GPU)
    trainfit train examples/sft.yaml train.lr=2e-5   # with an override

Samples of step s are items s*B .. s*B+B-1 of a deterministic stream (B = global batch): a generated
task's examples, or a file's records in a seeded per-epoch order. The loss of a step is the token
mean over the whole step, so any micro-batch split gives the same gradient.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch

from trainfit.algos import nll_mean
from trainfit.config import Config, ConfigError
from trainfit.core.dist import SINGLE, Ranks, all_reduce_sum
from trainfit.data import sources
from trainfit.data.text import (build_pretrain_blocks, build_sft_items, collate, cut_note, encode_example,
                                split_indices, split_records)
from trainfit.data.sources.encode import sft_items
from trainfit.data.sources.stream import BlockStream
from trainfit.envs import build_env_factory
from trainfit.train.evaluate import episode_eval, eval_loss, task_accuracy
from trainfit.models.logprobs import label_logprobs
from trainfit.models import fused_head
from trainfit.train import memstats
from trainfit.config.stages import stage_spec
from trainfit.train.stage import BaseStage, StepBatch, policy_parts
from trainfit.train.packing import packed_loss
from trainfit.data.image_examples import encode_image_example, example_images, policy_processor
from trainfit.train.evaluate import image_task_accuracy
from trainfit.data.image_chat import build_vlm_items, collate_vlm, has_images, mark_base_dirs, model_inputs


def lm_items(cfg: Config, tokenizer, rows, held, records=None) -> tuple[list, list, list[str]]:
    """(training items, eval items, notes) of pretrain / sft from data.path's rows without images (`rows`, `held`:
    sources.Rows; `records`: rows.to_list() when already made): exactly what LMStage trains on, in data order
    before the epoch shuffle. `trainfit data` shows these items."""
    d, seed, max_len = cfg.data, cfg.train.seed, cfg.data.max_seq_length
    if rows.is_dataset and cfg.stage != "pretrain":
        if held is None:   # the split split_records makes, on the dataset's positions
            keep, out = split_indices(len(rows), d.eval_fraction, seed)
            rows, held = (rows.select(keep), rows.select(out)) if out else (rows, None)
        train_items, stats = sft_items(rows, tokenizer, max_len, d.format, template=d.template)
        eval_items = build_sft_items(held.to_list(), tokenizer, max_len, d.format, key=held.key,
                                     template=d.template)[0] if held else []
        return train_items, eval_items, _template_note(cfg, stats["format"]) + cut_note(stats, max_len)
    records = rows.to_list() if records is None else records
    held_key = held.key if held is not None else "data.path"   # errors name a held-out row by its file line
    if held is not None:
        train, evals = records, held.to_list()
    else:
        train, evals = split_records(records, d.eval_fraction, seed)
    if cfg.stage == "pretrain":
        return (_blocks_to_items(build_pretrain_blocks(train, tokenizer, max_len, d.text_field)),
                _blocks_to_items(build_pretrain_blocks(evals, tokenizer, max_len, d.text_field, held_key)) if evals else [],
                [])
    train_items, stats = build_sft_items(train, tokenizer, max_len, d.format, d.text_field, template=d.template)
    eval_items = build_sft_items(evals, tokenizer, max_len, d.format, d.text_field, key=held_key,
                                 template=d.template)[0] if evals else []
    return train_items, eval_items, _template_note(cfg, stats["format"]) + cut_note(stats, max_len)


def _template_note(cfg: Config, fmt: str) -> list[str]:
    """The start line saying how prompt/completion rows become sequences (data.template)."""
    if fmt != "prompt_completion":
        return []
    t = cfg.data.template
    how = {"plain": "the prompt, then the completion and an eos, no separator",
           "chat": "a user and an assistant turn through the chat template"}.get(t, f"the format {t!r}")
    return [f"prompt/completion rows become {how} (data.template={t if t in ('plain', 'chat') else 'format'}); "
            "`trainfit data` prints them"]


class LMStage(BaseStage):
    @classmethod
    def build(cls, cfg: Config, stage_dir: Path, ranks: Ranks, device) -> tuple:
        loaded, task, engine = policy_parts(cfg, stage_dir, ranks, device)
        return loaded, cls(cfg, loaded.model, loaded.tokenizer, device, task=task, engine=engine,
                           ranks=ranks).bound(loaded, stage_dir)

    def __init__(self, cfg: Config, model, tokenizer, device, task=None, engine=None, ranks: Ranks = SINGLE):
        self.cfg, self.tokenizer, self.device, self.ranks = cfg, tokenizer, device, ranks
        self.task, self.engine = task, engine
        self.pad_id = tokenizer.pad_token_id
        self.max_len = cfg.data.max_seq_length
        self.train_items: list[dict] = []
        self.eval_items: list[dict] = []
        self.vision = policy_processor(cfg, model, tokenizer, task)   # a VisionProcessor for VLMs, else None
        if cfg.data.packing and self.vision is not None:
            raise ConfigError("data.packing=true with a vision-language model: packed rows are for text models "
                              "(image tokens are placed per row); set data.packing=false.")
        if self.vision is not None and engine is not None:
            engine.processor = self.vision   # the hf engine turns a task's images into pixel inputs
        self.head = fused_head.resolve(cfg, model, device)   # train.fused_head: off | chunked | liger
        self.stream = None   # data.streaming: a BlockStream
        self.data_notes: list[str] = []
        # SFT on expert trajectories with an environment (env.type): trains on data.path; task.name's held-out
        # rows are episodes played greedily against the environment at each evaluation (success rate).
        self.make_env = None
        if task is not None and stage_spec(cfg.stage).eval_episodes(cfg):
            self.make_env = build_env_factory(cfg, task, model, tokenizer, False, device)
        if task is None or self.make_env is not None:
            self._load_files()

    def _load_files(self) -> None:
        """data.path (and its held-out rows) through trainfit/data/sources/: JSONL/.txt as lists, as always;
        datasets-read sources tokenized on disk (sources/encode.py) or, data.streaming, streamed."""
        d, seed = self.cfg.data, self.cfg.train.seed
        want = "text" if self.cfg.stage == "pretrain" else "sft"
        held = sources.read_rows(d, want, held_out=True)
        if d.streaming:
            self._open_stream(held)
            return
        rows = sources.read_rows(d, want)
        self.data_notes = [r.note for r in (rows, held) if r is not None and not r.shape.identity]
        records = None if rows.is_dataset else rows.to_list()
        if records is None or not any(map(has_images, records)):
            self.train_items, self.eval_items, notes = lm_items(self.cfg, self.tokenizer, rows, held, records)
            self.data_notes += notes
            return
        if self.vision is None:
            raise ConfigError(f"data.path={d.path!r} has rows with images, but model.name={self.cfg.model.name!r} "
                              "is a text model (its config has no vision_config); use a vision-language model "
                              "(e.g. a Qwen2.5-VL / Qwen3-VL checkpoint) or data without images.")
        records = mark_base_dirs(records, d.path)   # relative image paths resolve next to their JSONL
        if held is not None:
            train, evals = records, mark_base_dirs(held.to_list(), d.eval_path)
        else:
            train, evals = split_records(records, d.eval_fraction, seed)
        self._load_vlm(train, evals)

    def _open_stream(self, held) -> None:
        """data.streaming: training blocks packed as the run goes (sources/stream.py); eval blocks from
        data.eval_path / eval_split, read whole."""
        d = self.cfg.data
        open_dataset, shape, label = sources.open_stream(d)
        self.stream = BlockStream(open_dataset, shape, self.tokenizer, self.max_len, label, d.text_field)
        self.data_notes = [f"streaming {label}: {shape.describe()}, packed into blocks of {self.max_len} tokens"]
        if held is not None:
            self.data_notes.append(held.note)
            self.eval_items = _blocks_to_items(build_pretrain_blocks(held.to_list(), self.tokenizer, self.max_len,
                                                                     d.text_field))
        else:
            self.data_notes.append("no eval loss: a stream holds nothing out (set data.eval_path or data.eval_split)")

    def _load_vlm(self, train: list[dict], evals: list[dict]) -> None:
        """Rows with images (data/image_chat.py): chat rows for SFT, image-caption pairs for pretraining."""
        args = (self.tokenizer, self.vision, self.max_len, self.cfg.stage, self.cfg.data.text_field)
        self.train_items, _ = build_vlm_items(train, *args)
        self.eval_items = build_vlm_items(evals, *args)[0] if evals else []

    def _item(self, index: int) -> dict:
        if self.task is not None and self.make_env is None:
            ex = self.task.train_example(index)
            if self.vision is not None and example_images(ex):   # a task whose prompts carry images
                return encode_image_example(self.tokenizer, self.vision, ex, self.max_len, self.cfg.task.chat)
            return encode_example(self.tokenizer, ex, self.max_len, self.cfg.task.chat)
        if self.stream is not None:   # stream order, one pass after another
            return self.stream.item(index)
        epoch, pos = divmod(index, len(self.train_items))
        return self.train_items[self._epoch_order(epoch)[pos]]

    @functools.lru_cache(maxsize=2)
    def _epoch_order(self, epoch: int) -> list[int]:
        """A seeded permutation per epoch: the data order is a function of (seed, step) alone."""
        order = list(range(len(self.train_items)))
        random.Random(self.cfg.train.seed * 100003 + epoch).shuffle(order)
        return order

    def prepare(self, step: int) -> StepBatch:
        """This rank's samples of the step: items step*B + [rank*b, (rank+1)*b) of the stream."""
        bp = self.cfg.batch_plan()
        first = step * bp.global_batch + self.ranks.rank * bp.per_device_batch
        with memstats.phase(None, "data"):  # tokenizing the step's examples (task streams)
            items = [self._item(first + j) for j in range(bp.per_device_batch)]
        # Loss tokens of the whole step (all ranks): label positions 1.. (position 0 predicts nothing).
        tokens = sum(sum(1 for t in it["labels"][1:] if t != -100) for it in items)
        return StepBatch(samples=items, totals=all_reduce_sum({"tokens": tokens}, self.ranks))

    def loss(self, model, micro: list[dict], totals: dict) -> tuple[torch.Tensor, dict]:
        if self.cfg.data.packing:  # train/packing.py: one row, no padding
            return packed_loss(model, micro, totals, self.device, self.cfg.train.logits_chunk_rows, self.head)
        batch = collate_vlm(micro, self.pad_id, self.vision) if self.vision else collate(micro, self.pad_id)
        b = {k: v.to(self.device) for k, v in batch.items()}                        # [b, T] each (+ images)
        logp = label_logprobs(model, b["input_ids"], b["attention_mask"], b["labels"],
                              self.cfg.train.logits_chunk_rows, model_inputs(b), self.head)  # [n] labelled
        loss = nll_mean(logp.sum(), totals["tokens"])
        return loss, {"tokens": logp.numel(), "seq_tokens": int(b["attention_mask"].sum())}

    def summarize(self, batch: StepBatch, sums: dict) -> dict:
        return {"loss": sums["loss"], "tokens": sums["tokens"]}

    def evaluate(self, model) -> dict:
        if self.make_env is not None:   # held-out episodes against the environment, plus eval loss on data
            # tool use: the last assistant message is the answer, judged as GRPO judges it (its accuracy)
            out = episode_eval(self.make_env, self.engine, self.tokenizer, self.task, self.cfg,
                               judge_final=self.cfg.env.type == "tools")
            return {**self._eval_loss(model), **out}
        if self.task is not None and self.engine is not None:
            if self.vision is not None:  # prompts may carry images
                return image_task_accuracy(self.engine, self.tokenizer, self.vision, self.task, self.cfg.task.chat)
            return task_accuracy(self.engine, self.tokenizer, self.task, self.cfg.task.chat)
        return self._eval_loss(model)

    def _eval_loss(self, model) -> dict:
        if self.vision is not None:
            return eval_loss(model, self.eval_items, self.pad_id, self.cfg.train.micro_batch_size,
                             lambda chunk: collate_vlm(chunk, self.pad_id, self.vision), model_inputs)
        return eval_loss(model, self.eval_items, self.pad_id, self.cfg.train.micro_batch_size)

    def state_dict(self) -> dict:
        # The data position is the step itself, except in a stream: its reader's position.
        return {"stream": self.stream.state_dict()} if self.stream is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.stream is not None and "stream" in state:
            self.stream.load_state_dict(state["stream"])


def _blocks_to_items(blocks: torch.Tensor) -> list[dict]:
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in blocks]
