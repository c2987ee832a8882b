"""LLaMA-Factory: its training YAML (`llamafactory-cli train FILE.yaml`): model, method, dataset, output and
transformers' training arguments.

Batch arithmetic. transformers' Trainer: per_device_train_batch_size x gradient_accumulation_steps x processes
samples per optimizer step (a DPO or RM sample is one pair, as in trainfit). llamafactory-cli starts one process
per visible GPU, which the YAML does not say: 1 unless --num-gpus says otherwise. With max_samples the run's
length is known: epochs x max_samples / global batch optimizer steps.
"""

from __future__ import annotations

from typing import Any, Optional

import yaml

from trainfit.config.base import ConfigError
from trainfit.config.importers.common import (Imported, map_keys, reader, steps_from_samples, trainer_batch,
                                              warmup_from_ratio)

STAGES = {"sft": "sft", "pt": "pretrain", "rm": "rm", "dpo": "dpo", "kto": "dpo", "ppo": "ppo"}
DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_train_epochs": 3.0,
            "learning_rate": 5e-5, "stage": "sft"}
_WORKERS = "trainfit reads and tokenizes the data in the training process"
_CLI = "no trainfit setting: "
DROPS = {
    "do_train": "`trainfit train` trains", "preprocessing_num_workers": _WORKERS, "dataloader_num_workers": _WORKERS,
    "overwrite_cache": _WORKERS, "plot_loss": "logging.plot writes metrics.png and report.html",
    "overwrite_output_dir": "`trainfit train --overwrite`", "save_only_model": "trainfit's checkpoints keep the "
    "optimizer state, for `trainfit train --resume`", "resume_from_checkpoint": "`trainfit train --resume`",
    "ddp_timeout": "distributed.timeout_s is the rendezvous and collectives' timeout (600 s by default)",
    "val_size": "data.eval_fraction holds out a share of the rows",
    "enable_liger_kernel": "train.fused_head=auto uses Liger's fused LM head on CUDA where it is installed",
    "rope_scaling": _CLI + "the model's own config.json decides",
}


def peer_args(text: str) -> dict[str, Any]:
    """The YAML's arguments; a key written as null (resume_from_checkpoint: null) asks for the default, so it
    has nothing to carry or drop."""
    try:
        args = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"the LLaMA-Factory config is not valid YAML: {e}. Give its training YAML "
                          "(examples/train_lora/*.yaml).") from None
    if not isinstance(args, dict):
        raise ConfigError("a LLaMA-Factory config is a YAML mapping of arguments (model_name_or_path, stage, "
                          "dataset, ...); this text is not one.")
    return {k: v for k, v in args.items() if v is not None}


def convert(text: str, stage: Optional[str] = None, num_gpus: Optional[int] = None) -> Imported:
    args = peer_args(text)
    peer_stage = str(args.get("stage", DEFAULTS["stage"]))
    if not stage and peer_stage not in STAGES:
        raise ConfigError(f"LLaMA-Factory's stage={peer_stage} has no trainfit stage (pt, sft, rm, dpo, kto and ppo "
                          "have); pass --stage to choose one.")
    im = Imported("llamafactory", stage or STAGES[peer_stage],
                  "--stage" if stage else f"LLaMA-Factory's stage: {peer_stage}")
    get = reader(im, args, DEFAULTS)
    get("stage")
    if peer_stage == "kto" and not stage:
        im.compute("dpo.loss_type", "kto", "LLaMA-Factory's stage: kto")
    world = num_gpus or 1
    world_from = "--num-gpus" if num_gpus else "llamafactory-cli's GPUs are not in the YAML: 1 assumed, pass --num-gpus"
    if world > 1:
        im.compute("distributed.num_gpus", world, world_from)
    trainer_batch(im, get, world, world_from)
    handled = {"stage", "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "max_samples",
               "warmup_ratio"}
    if "learning_rate" not in args:
        im.compute("train.lr", get("learning_rate"), "LLaMA-Factory's default learning_rate")
    if not steps_from_samples(im, epochs=get("num_train_epochs"), samples=args.get("max_samples"),
                              per_step=im.values["train.global_batch_size"], what="samples per step",
                              peer_keys="num_train_epochs x max_samples / global batch"):
        handled.discard("num_train_epochs")
    if "warmup_ratio" in args:
        warmup_from_ratio(im, args["warmup_ratio"], "warmup_ratio")
    datasets = [d.strip() for d in str(args.get("dataset", "")).split(",") if d.strip()]
    for extra in datasets[1:]:
        im.drop("dataset", extra, "trainfit reads one data.path: merge the files into one, or put them in one "
                "folder and give that")
    map_keys(im, args, handled, DROPS)
    return im
