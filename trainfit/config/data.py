"""Config sections of what a stage reads: data rows (`data`) and verifiable tasks with rewards (`task`)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from trainfit.config.base import _Section


_SUBSET = ("Configuration (subset) of a hub dataset or dataset folder, e.g. `main` for openai/gsm8k; none = its "
           "only one.")
_SPLIT = "Split of `path` to train on; none = `train`, or the only split."
_EVAL_SPLIT = ("Split held out for evaluation, read from `eval_path` when it is set, else from `path` (e.g. `test`); "
               "none = `eval_path`'s train or only split, or a share of `path`.")
_REVISION = "Hub revision (branch, tag or commit) of a hub dataset in `path` / `eval_path`."
_COLUMNS = ("Which column feeds each field trainfit reads, e.g. {prompt: question, answer: answer}; dotted names "
            "reach into nested columns (reward_model.ground_truth). Fields: text; prompt, completion, messages "
            "(sft); prompt or messages, chosen, rejected (rm); prompt or messages, answer, completion (tasks). "
            "Unmapped fields are found by name, and common shapes need no mapping (TRL's prompt/completion, "
            "messages, chosen/rejected; verl's parquet rows; alpaca; sharegpt): the run's start says what fed what.")


class DataConfig(_Section):
    path: Optional[str] = Field(None, description=(
        "Training data for pretrain/sft/rm: a file (.txt, .jsonl, .json, .parquet, .arrow, .csv, .tsv), a "
        "directory of them, a glob, a `save_to_disk` dataset folder, or a Hugging Face hub dataset id "
        "(org/name; read with `datasets`, through the HF cache, HF_HUB_OFFLINE and HF_TOKEN). Unused when "
        "`task` gives the data."))
    subset: Optional[str] = Field(None, description=_SUBSET)
    split: Optional[str] = Field(None, description=_SPLIT)
    revision: Optional[str] = Field(None, description=_REVISION)
    columns: dict[str, str] = Field(default_factory=dict, description=_COLUMNS)
    streaming: bool = Field(False, description=(
        "pretrain: read `path` as a stream (a datasets IterableDataset) instead of loading it whole: text is "
        "tokenized and packed as the run goes, in file order, and checkpoints keep the stream's position, so "
        "a resumed run continues with the same next batch. Eval loss needs `eval_path` or `eval_split`."))
    format: Literal["auto", "text", "prompt_completion", "messages"] = Field("auto", description=(
        "`text` (raw text or JSONL `text` field), `prompt_completion` (JSONL prompt/completion) or "
        "`messages` (JSONL chat); `auto` decides from the first record."))
    template: str = Field("plain", description=(
        "sft: how a prompt/completion row (and an alpaca row without system or history) becomes one sequence. "
        "`plain` (the default, as TRL's SFTTrainer): the prompt's tokens, then the completion's and an eos, with "
        "no separator; `chat`: a user turn and an assistant turn through the tokenizer's chat template; or a "
        "format string with {prompt} before {completion}, e.g. \"### Question\\n{prompt}\\n### Answer\\n{completion}\": "
        "loss on the completion, the text after it and the eos. The run's start says which is used; "
        "`trainfit data` shows the result."))
    text_field: str = Field("text", description="Field (column) that holds raw text for pretraining; `columns.text` overrides it.")
    max_seq_length: int = Field(512, ge=8, description="Tokens per training sequence (pretrain packs into blocks of this size).")
    eval_path: Optional[str] = Field(None, description="Held-out data for eval loss; else `eval_fraction` of `path`.")
    eval_split: Optional[str] = Field(None, description=_EVAL_SPLIT)
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of records held out when no `eval_path` or `eval_split`.")
    packing: bool = Field(False, description=(
        "sft: padding-free packing. Each micro-batch's sequences go back to back in one row, position ids "
        "restarting per sequence, and the attention keeps them apart (flash-attention varlen on CUDA, a "
        "block-diagonal mask with sdpa / eager): the same loss and gradients, no compute on padding."))


    @field_validator("template")
    @classmethod
    def _template_has_both_fields(cls, v: str) -> str:
        if v in ("plain", "chat"):
            return v
        p, c = v.find("{prompt}"), v.find("{completion}")
        if p < 0 or c < 0 or c < p:
            raise ValueError(f"data.template={v!r} is neither `plain` nor `chat`, nor a format string with {{prompt}} "
                             "before {completion}: e.g. data.template=\"Q: {prompt}\\nA: {completion}\".")
        return v


class TaskConfig(_Section):
    name: Optional[str] = Field(None, description=(
        "Built-in task (`arithmetic`, `arithmetic_tagged`; `shapes`, images for vision-language models), "
        "`jsonl` (rows with `prompt` or `messages`, `answer`, and any metadata), or `dataset` (the same rows "
        "from any source task.path reads; its `default` reward and accuracy check each row with "
        "math_verify where its answer is mathematical, by normalised text elsewhere). Gives SFT examples and "
        "GRPO prompts with rewards."))
    path: Optional[str] = Field(None, description=(
        "Rows for `name: jsonl` / `dataset`: a JSONL file, or anything data.path reads (parquet, a dataset "
        "folder, a hub id such as openai/gsm8k, ...)."))
    subset: Optional[str] = Field(None, description=_SUBSET)
    split: Optional[str] = Field(None, description=_SPLIT)
    revision: Optional[str] = Field(None, description=_REVISION)
    columns: dict[str, str] = Field(default_factory=dict, description=_COLUMNS)
    answer_pattern: Optional[str] = Field(None, description=(
        "A regex that finds the answer inside the answer column, for answers that carry their reasoning, e.g. "
        "'####\\s*(.+)' for GSM8K: its first group (or the whole match) is the answer, and the whole column "
        "stays the SFT target. A row it does not match is an error."))
    eval_path: Optional[str] = Field(None, description="Held-out rows for `name: jsonl` / `dataset` (else rows are split).")
    eval_split: Optional[str] = Field(None, description=_EVAL_SPLIT)
    seed: int = Field(1234, description="Seed of the generated task stream (eval uses a disjoint stream).")
    num_eval: int = Field(200, ge=0, description="Held-out examples for accuracy.")
    max_operand: int = Field(20, ge=1, description="Arithmetic: largest operand.")
    num_operands: int = Field(2, ge=2, le=4, description="Arithmetic: operands per expression.")
    operations: str = Field("+-", description="Arithmetic: operators to draw from (subset of '+-*').")
    num_train: Optional[int] = Field(None, ge=1, description=(
        "Arithmetic: how many distinct problems training draws from (a fixed set, cycled), as when "
        "labelled examples are scarce; unset, every step draws fresh problems from the whole space. A "
        "stage can set its own: e.g. SFT on a few labelled problems, GRPO on every problem."))
    chat: bool = Field(False, description="Present prompts through the tokenizer's chat template.")
    rewards: list[str] = Field(default_factory=lambda: ["default"], description=(
        "Reward functions for GRPO: `default` (the task's own), built-ins `exact_match`, `numeric_match`, "
        "`format`, `math_verify` (Hugging Face's Math-Verify: LaTeX and plain answers, `pip install "
        "'trainfit[math]'`), or a user function `module:function` / `path/to/file.py:function`."))
    reward_weights: Optional[list[float]] = Field(None, description="One weight per reward (default all 1).")
