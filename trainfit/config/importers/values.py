"""How a peer's value becomes a trainfit value: the converters a row of config/peer_keys.py names in its
`carry` field, and the reading of values from command lines.

A converter returns the trainfit value, or a dict {trainfit key: value} when one peer key sets several ("" is the
row's own key; a dict value is merged into a mapping such as data.columns), and
raises `NotCarried(why)` when the value has no trainfit meaning (the importer lists it as dropped).
"""

from __future__ import annotations

import ast
from typing import Any, Callable

import yaml


class NotCarried(Exception):
    """A peer value that no trainfit value means; its message says why."""


def scalar(text: Any) -> Any:
    """A command-line word as the peer reads it: true/false, numbers (1e-6 too, which YAML 1.1 keeps a
    string), None/null, Python or YAML lists; else the text."""
    if not isinstance(text, str):
        return text
    t = text.strip()
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null", "~"):
        return None
    for kind in (int, float):
        try:
            return kind(t)
        except ValueError:
            pass
    if t[:1] in "[{":
        for parse in (ast.literal_eval, yaml.safe_load):
            try:
                return parse(t)
            except (ValueError, SyntaxError, yaml.YAMLError):
                continue
    return t


def _flag(arg: str) -> Callable[[Any], Any]:
    """`--bf16` (true) is model.dtype=bf16: the row's argument is the value a true flag means."""
    def carry(v: Any) -> Any:
        if v is False:
            raise NotCarried("false leaves trainfit's default")
        return scalar(arg)
    return carry


def _map(arg: str) -> Callable[[Any], Any]:
    table = dict(p.split("=") for p in arg.split(","))

    def carry(v: Any) -> Any:
        if str(v) not in table:
            raise NotCarried(f"{v} has no trainfit equivalent (trainfit has {', '.join(table.values())})")
        return table[str(v)]
    return carry


def _choice(arg: str) -> Callable[[Any], Any]:
    names = arg.split(",")

    def carry(v: Any) -> Any:
        if v not in names:
            raise NotCarried(f"{v} is not offered (trainfit has {', '.join(names)})")
        return v
    return carry


def _table(out: dict, why: str):
    """A converter that maps a peer's value through `out`, or says why trainfit has no such value."""
    def convert(v: Any) -> str:
        if str(v) not in out:
            raise NotCarried(f"{v}: {why}")
        return out[str(v)]
    return convert


_dtype = _table({"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32",
                 "fp32": "fp32"}, "trainfit trains in bf16, fp16 or fp32 (model.dtype)")
_attn = _table({"fa2": "flash_attention_2", "flash_attention_2": "flash_attention_2",
                "flash_attention_3": "flash_attention_3", "sdpa": "sdpa", "eager": "eager"},
               "trainfit offers sdpa, eager, flash_attention_2 and flash_attention_3")


def _schedule(v: Any) -> str:
    if v in ("cosine", "constant"):
        return v
    if v == "constant_with_warmup":
        return "constant"
    raise NotCarried(f"{v}: trainfit's schedules are cosine and constant (after train.warmup_steps); cosine, the "
                     "default, is kept")


def _every(v: Any) -> int:
    """Step intervals: -1 (verl, OpenRLHF: never) is 0 here (only at the end)."""
    return max(0, int(v))


def _trackers(v: Any) -> list[str]:
    names = v if isinstance(v, list) else [p.strip() for p in str(v).split(",")]
    known = [n for n in names if n in ("tensorboard", "wandb", "trackio", "mlflow")]
    other = [n for n in names if n not in known and n not in ("none", "console")]
    if other and not known:
        raise NotCarried(f"{', '.join(other)}: trainfit writes to tensorboard, wandb, trackio or mlflow")
    return known


def _modules(v: Any) -> Any:
    names = v if isinstance(v, list) else [p.strip() for p in str(v).split(",")]
    names = [n.strip().strip(",\"'") for n in names if n.strip().strip(",\"'")]
    return "all-linear" if names in (["all"], ["all-linear"]) else names


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, list) else v


_kl_type = _table({"low_var_kl": "k3", "k3": "k3", "mse": "k2", "k2": "k2", "kl": "k1", "k1": "k1"},
                  "trainfit's KL estimators are k1, k2 and k3")
_loss_agg = _table({"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"},
                   "trainfit aggregates as token-mean (dapo), seq-mean-token-mean (grpo) or seq-mean-token-sum-norm "
                   "(dr_grpo)")


ADVANTAGES = {"grpo": "group_norm", "group_norm": "group_norm", "rloo": "rloo",
              "reinforce_plus_plus_baseline": "reinforce_pp", "reinforce_baseline": "reinforce_pp",
              "reinforce_plus_plus": "reinforce_pp_batch", "reinforce": "reinforce_pp_batch"}


_advantage = _table(ADVANTAGES, "trainfit's advantages are group_norm, rloo, reinforce_pp and reinforce_pp_batch")


def _engine(v: Any) -> str:
    if v in ("vllm", "hf"):
        return v
    raise NotCarried(f"{v}: trainfit generates with hf, vllm or an OpenAI-compatible server (rollout.engine)")


def _lf_dataset(v: Any) -> str:
    """LLaMA-Factory names datasets by their entry in data/dataset_info.json, whose file is data/<name>.json for
    its own demo sets; several names are a comma list (the first is taken, the rest dropped by the caller)."""
    return f"data/{str(v).split(',')[0].strip()}.json"


def _ds_json(v: Any) -> dict:
    """LLaMA-Factory's DeepSpeed JSON names its stage (ds_z3_config.json, ds_z2_offload_config.json)."""
    name = str(v).rsplit("/", 1)[-1]
    for stage in (3, 2, 1, 0):
        if f"z{stage}" in name:
            return {"distributed.strategy": "deepspeed", "distributed.zero_stage": stage,
                    **({"distributed.offload_optimizer": True} if "offload" in name else {})}
    raise NotCarried(f"{v}: the ZeRO stage is not in the file's name; set distributed.strategy=deepspeed and "
                     "distributed.zero_stage")


def _column(field: str) -> Callable[[Any], dict]:
    return lambda v: {"": {field: str(v)}}   # merged into the row's columns mapping


def _pair(second: str) -> Callable[[Any], Any]:
    def carry(v: Any) -> Any:
        if not isinstance(v, list) or len(v) != 2:
            raise NotCarried(f"{v}: expected two values (low high)")
        return {"": scalar(v[0]), second: scalar(v[1])}
    return carry


CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "": lambda v: v, "dtype": _dtype, "attn": _attn, "schedule": _schedule, "every": _every, "trackers": _trackers,
    "modules": _modules, "first": _first, "kl_type": _kl_type, "loss_agg": _loss_agg, "advantage": _advantage,
    "engine": _engine, "lf_dataset": _lf_dataset, "ds_json": _ds_json,
}
FAMILIES: dict[str, Callable[[str], Callable[[Any], Any]]] = {
    "flag": _flag, "map": _map, "choice": _choice, "column": _column, "pair": _pair,
    "always": lambda arg: (lambda v: arg),
}


def converter(carry: str) -> Callable[[Any], Any]:
    """The converter a table row names: `dtype`, or a family with its argument, `flag:bf16`."""
    if carry in CONVERTERS:
        return CONVERTERS[carry]
    family, _, arg = carry.partition(":")
    return FAMILIES[family](arg)
