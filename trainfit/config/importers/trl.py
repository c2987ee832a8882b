"""TRL: the arguments of GRPOConfig / DPOConfig / SFTConfig and ModelConfig, as a YAML or JSON file
(`trl sft --config FILE`) or a command line (`trl grpo --k v`, `python trl/scripts/dpo.py --k v`,
`accelerate launch [--num_processes N] [--config_file F] script.py --k v`).

Batch arithmetic. transformers' Trainer steps the optimizer every per_device_train_batch_size x
gradient_accumulation_steps x processes samples; GRPO counts completions in it, num_generations of them a
prompt, and generates steps_per_generation steps' worth at once. trainfit's global batch is that product, its
micro-batch per_device_train_batch_size, and GRPO samples a fresh rollout for every optimizer step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml

from trainfit.config.base import ConfigError
from trainfit.config.importers.common import Imported, map_keys, reader, trainer_batch
from trainfit.config.importers.shell import commands
from trainfit.config.importers.values import scalar

STAGES = {"sft": "sft", "dpo": "dpo", "grpo": "grpo", "gspo": "grpo", "reward": "rm", "kto": "dpo", "rloo": "grpo"}
GRPO_KEYS = ("num_generations", "max_completion_length", "reward_funcs", "steps_per_generation", "use_vllm")
DPO_KEYS = ("rpo_alpha", "ref_model_init_kwargs", "precompute_ref_log_probs")
# The configs' defaults the arithmetic reads when the arguments leave them out (TRL 0.2x).
DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_generations": 8}
LR = {"grpo": 1e-6, "dpo": 1e-6, "sft": 2e-5, "rm": 5e-5}
MAX_LENGTH = {"sft": 1024, "dpo": 1024, "rm": 1024}
_NO = "no trainfit setting: "
DROPS = {
    "num_train_epochs": "trainfit counts optimizer steps: set train.max_steps = epochs x dataset rows / "
    "train.global_batch_size (the rows are not known here)",
    "eval_strategy": "trainfit evaluates every train.eval_every steps", "push_to_hub": _NO + "push the final dir yourself",
    "remove_unused_columns": "trainfit keeps the columns it reads (data.columns)",
    "eos_token": "trainfit ends each completion with the tokenizer's eos",
    "log_completions": "trainfit writes logging.save_completions completions a step to completions.jsonl",
    "dataset_streaming": "data.streaming applies to stage pretrain; trainfit reads SFT, DPO and RM rows whole",
    "dataset_test_split": "trainfit holds out data.eval_split, else data.eval_fraction of the rows",
    "overwrite_output_dir": "`trainfit train --overwrite`",
}


def arguments(text: str) -> tuple[dict[str, Any], str, list[str]]:
    """(the arguments, the script or subcommand they were given to, the launcher's words)."""
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:
        loaded = None
    if isinstance(loaded, dict):
        return {k: v for k, v in loaded.items() if k != "env"}, "", []
    for c in commands(text):
        for i, w in enumerate(c):
            if w.endswith(".py") or (w == "trl" and i + 1 < len(c)):
                script = Path(c[i + 1] if w == "trl" else w).stem
                return _flags(c[i + 2 if w == "trl" else i + 1:]), script, c[:i]
    raise ConfigError("no TRL command found (`trl grpo ...`, `python trl/scripts/dpo.py ...`, `accelerate launch "
                      "script.py ...`) and the text is not a YAML or JSON mapping of TRL arguments.")


def _flags(ws: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    key = None
    for w in ws:
        if w.startswith("--"):
            key, _, v = w[2:].partition("=")
            if key.startswith("no_") and not v:
                key, v = key[3:], "false"
            out[key] = scalar(v) if v else True
        elif key is not None:
            v = scalar(w.strip(","))
            out[key] = v if out[key] is True else (out[key] if isinstance(out[key], list) else [out[key]]) + [v]
    return out


def _launcher(launcher: list[str], num_gpus: Optional[int]) -> tuple[int, str, dict[str, Any]]:
    """(processes, where that number comes from, what the accelerate config file's name or content says)."""
    opts = _flags(launcher)
    found: dict[str, Any] = {}
    cfg_file = opts.get("config_file")
    if isinstance(cfg_file, str):
        p = Path(cfg_file)
        content = yaml.safe_load(p.read_text()) if p.is_file() else {}
        found = {"num_processes": (content or {}).get("num_processes"), "file": cfg_file}
        name = p.name
        for stage in (3, 2, 1):
            if f"zero{stage}" in name or (content or {}).get("deepspeed_config", {}).get("zero_stage") == stage:
                found["zero_stage"] = stage
                break
    if num_gpus:
        return num_gpus, "--num-gpus", found
    if opts.get("num_processes"):
        return int(opts["num_processes"]), "accelerate's --num_processes", found
    if found.get("num_processes"):
        return int(found["num_processes"]), f"num_processes in {cfg_file}", found
    return 1, "no process count given: 1 assumed, pass --num-gpus", found


def peer_args(text: str) -> dict[str, Any]:
    return arguments(text)[0]


def convert(text: str, stage: Optional[str] = None, num_gpus: Optional[int] = None) -> Imported:
    args, script, launcher = arguments(text)
    if stage:
        why = "--stage"
    elif script in STAGES:
        stage, why = STAGES[script], f"TRL's {script} script"
    elif any(k in args for k in GRPO_KEYS):
        stage, why = "grpo", f"GRPOConfig's {next(k for k in GRPO_KEYS if k in args)}"
    elif any(k in args for k in DPO_KEYS):
        stage, why = "dpo", f"DPOConfig's {next(k for k in DPO_KEYS if k in args)}"
    else:
        stage, why = "sft", "no GRPO or DPO argument: SFTConfig's (`trl sft --config`); --stage to choose"
    im = Imported("trl", stage, why)
    defaults = {**DEFAULTS, "learning_rate": LR.get(stage), "max_length": MAX_LENGTH.get(stage)}
    get = reader(im, args, {k: v for k, v in defaults.items() if v is not None})
    world, world_from, acc = _launcher(launcher, num_gpus)
    if world > 1:
        im.compute("distributed.num_gpus", world, world_from)
    if acc.get("zero_stage"):
        im.compute("distributed.zero_stage", acc["zero_stage"], f"accelerate's --config_file {acc['file']}")
    group = get("num_generations") if stage == "grpo" else 1
    if stage == "grpo":
        im.compute("grpo.num_generations", group, f"num_generations {group}")
    trainer_batch(im, get, world, world_from, group)
    handled = {"per_device_train_batch_size", "gradient_accumulation_steps", "num_generations"}
    for key, trainfit in (("learning_rate", "train.lr"), ("max_length", "data.max_seq_length")):
        if key not in args and get(key) is not None and (key != "max_length" or stage != "grpo"):
            im.compute(trainfit, get(key), f"{key} {get(key)}: TRL's default for stage {stage}")
    if stage == "grpo":
        _grpo(im, args, world)
        handled.add("steps_per_generation")
    if script == "kto":
        im.compute("dpo.loss_type", "kto", "TRL's kto script")
    if script == "rloo":
        im.compute("grpo.advantage", "rloo", "TRL's rloo script")
    if script in ("gspo",) and "importance_sampling_level" not in args:
        im.compute("grpo.importance", "sequence", "TRL's gspo script")
    map_keys(im, args, handled, DROPS)
    return im


def _grpo(im: Imported, args: dict, world: int) -> None:
    spg = args.get("steps_per_generation")
    if spg:
        pdb, ga = args.get("per_device_train_batch_size", DEFAULTS["per_device_train_batch_size"]), \
            args.get("gradient_accumulation_steps", DEFAULTS["gradient_accumulation_steps"])
        im.drop("steps_per_generation", spg, f"TRL generates per_device_train_batch_size {pdb} x {world} x {spg} = "
                f"{pdb * world * spg} completions at once and trains {spg} micro-steps on them ({spg} / "
                f"gradient_accumulation_steps {ga} = {spg / ga:g} optimizer steps); trainfit samples a fresh rollout "
                "for every optimizer step")
    if "dataset_name" in args:
        im.compute("task.name", "dataset", "GRPO's prompts are dataset rows (dataset_name), which task.name=dataset reads")
    else:
        im.compute("task.name", "arithmetic", "the arguments name no dataset (the script loads its own): a built-in "
                   "task stands in so the config plans; set task.name=dataset and task.path to your prompts")
