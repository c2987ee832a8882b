"""Reward models: a sequence classifier with one output, built on the policy's architecture.

`load_reward_model` makes the model stage rm trains: the backbone's weights come from `model.name`
(any source `load_base_model` reads: preset, hub id, local or adapter directory, GGUF), the scalar
head ("score") starts random, and LoRA/DoRA adapters are attached as for the policy (the head is
trained in full beside them). The final directory is a plain `AutoModelForSequenceClassification`
one (adapters merged), which `rl_models.reward_model` and plain transformers load.

The reward of a sequence is the head's output at its last token that is not padding, as
transformers' sequence classifiers read it (`config.pad_token_id` set from the tokenizer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from transformers import AutoModelForSequenceClassification

from trainfit.config import ModelConfig, PeftConfig
from trainfit.models.lora_compute import lora_compute_in_input_dtype
from trainfit.models.lora_rules import lora_in_model_dtype
from trainfit.models.policy import (DTYPES, LoadedModel, _fork_rng, enable_checkpointing, load_base_model,
                                    load_tokenizer, lora_targets)


def load_reward_model(mc: ModelConfig, pc: PeftConfig, device: torch.device, seed: int = 0) -> LoadedModel:
    tok = load_tokenizer(mc)
    lm, source = load_base_model(mc, device, vocab_size=len(tok))         # causal LM of any source
    config = lm.config
    config.num_labels, config.pad_token_id = 1, tok.pad_token_id
    with _fork_rng(mc.seed):
        model = AutoModelForSequenceClassification.from_config(config, dtype=DTYPES[mc.dtype])
    # The backbone (embeddings, layers, final norm) is the LM's; only the head is new.
    getattr(model, model.base_model_prefix).load_state_dict(getattr(lm, lm.base_model_prefix).state_dict())
    del lm
    model = model.to(device)
    enable_checkpointing(model, mc)  # the first k layers, as for the policy
    is_peft = pc.method != "none"
    if is_peft:
        from peft import LoraConfig, get_peft_model

        if mc.gradient_checkpointing:
            model.enable_input_require_grads()
        # SEQ_CLS keeps the (new) score head fully trainable beside the adapters (modules_to_save).
        lcfg = LoraConfig(r=pc.r, lora_alpha=pc.alpha, lora_dropout=pc.dropout, use_dora=pc.method == "dora",
                          target_modules=lora_targets(model, pc.target_modules), task_type="SEQ_CLS")
        with _fork_rng(seed):
            model = get_peft_model(model, lcfg)

        if lora_in_model_dtype(pc.method, pc.adapter_compute, mc.dtype, mc.quantization):
            lora_compute_in_input_dtype(model)  # as the policy's (models.attach_adapters)
    return LoadedModel(model=model, tokenizer=tok, is_peft=is_peft, source=source)


def rewards(model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Scalar rewards `[B]` of right-padded sequences `ids [B, T]` (the classifier's own pooling)."""
    return model(input_ids=ids, attention_mask=attn).logits.squeeze(-1).float()


def save_reward_model(loaded: LoadedModel, out_dir: Path, state_dict: Optional[dict] = None) -> Path:
    """A plain sequence-classifier directory: adapters merged into the weights (in place: this is the
    end of training), the tokenizer beside them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = loaded.model.merge_and_unload() if loaded.is_peft else loaded.model
    if state_dict is not None:
        model.save_pretrained(str(out_dir), state_dict=state_dict)
    else:
        model.save_pretrained(str(out_dir))
    loaded.tokenizer.save_pretrained(str(out_dir))
    return out_dir
