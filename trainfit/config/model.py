"""Config sections of the model: what to load and how (`model`), and its adapters (`peft`)."""

from __future__ import annotations

import math
from typing import Any, Literal, Optional, Union

from pydantic import Field, model_validator

from trainfit.config.base import _Section


class ModelConfig(_Section):
    name: str = Field("preset:tiny", description=(
        "What to load: a Hugging Face hub id, a local directory (full model or PEFT adapter), a .gguf "
        "file, or a built-in random-init preset `preset:tiny` / `preset:small` (no download)."))
    gguf_file: Optional[str] = Field(None, description="GGUF file name inside `name` when `name` is a hub id or directory.")
    revision: Optional[str] = Field(None, description="Hub revision (branch, tag or commit).")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the hub.")
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Dtype of the weights being trained (and of frozen ones).")
    gradient_checkpointing: Union[bool, int, float] = Field(False, description=(
        "Recompute activations in backward to save memory: `true` = every decoder layer, `false` or 0 = "
        "none, an integer k = the first k decoder layers (more than the model has = all), a fraction "
        "0 < f < 1 = the first ceil(f x layers). Fewer checkpointed layers recompute less (faster) and "
        "keep more activations (like DeepSpeed's `number_checkpoints`); `trainfit fit` searches it."))
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = Field(
        "sdpa", description="Attention kernel passed to transformers.")
    quantization: Literal["none", "4bit", "8bit"] = Field("none", description=(
        "Quantize the frozen base with bitsandbytes (QLoRA). Needs `peft.method` lora/dora and the `bnb` extra."))
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    bnb_4bit_double_quant: bool = Field(True, description="Quantize the 4-bit absmax constants too (saves ~0.4 bit/param).")
    seed: int = Field(0, description="Seed for random-init presets and `init: random`.")
    init: Literal["pretrained", "random"] = Field("pretrained", description=(
        "`pretrained` loads the weights of `name`; `random` builds its architecture (a catalog name such as "
        "qwen3-0.6b, a hub id, or a local directory with config.json) with random weights, for pretraining "
        "from scratch. Presets are always random."))
    config_overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "Architecture numbers changed before the model is built, by the trainer and the planner alike, e.g. "
        "{num_hidden_layers: 4, hidden_size: 256} or Mamba's {state_size: 16, expand: 2} (mamba_ssm names "
        "d_state, d_conv, d_model, n_layer are accepted). Keys must exist in the architecture's config "
        "(nested dicts for sub-configs such as text_config). Needs `init: random` or a preset."))
    tokenizer: Optional[str] = Field(None, description=(
        "Tokenizer to use instead of the model's: a hub id or local directory, or `preset` (trainfit's local "
        "512-token tokenizer, no download). Default: the model's own; with `init: random` the tokenizer of "
        "the named model (local directory, hub cache or network), else an error naming this key. The "
        "embedding keeps the architecture's vocab_size: set config_overrides.vocab_size to match a smaller "
        "tokenizer."))
    freeze_vision_tower: bool = Field(True, description=(
        "Vision-language models: keep the vision encoder's weights fixed (no gradients, no optimizer state, "
        "no LoRA adapters on it). The projector is governed by `freeze_projector`."))
    freeze_projector: bool = Field(True, description=(
        "Vision-language models: keep the projector that maps vision features into the language model "
        "(Qwen-VL's patch merger and DeepStack mergers, LLaVA's multi_modal_projector) fixed."))
    max_pixels: Optional[int] = Field(None, ge=1, description=(
        "Vision-language models: largest image area in pixels after resizing (Qwen-VL's max_pixels); bounds "
        "the image tokens per image (one token per (patch x merge)^2 pixels, e.g. 28 x 28 for Qwen2.5-VL). "
        "None = the processor's own setting."))
    min_pixels: Optional[int] = Field(None, ge=1, description=(
        "Vision-language models: smallest image area in pixels after resizing (Qwen-VL's min_pixels). None = "
        "the processor's own setting."))
    fit_min_pixels: Optional[int] = Field(None, ge=1, description=(
        "`trainfit fit --allow-screens`: the smallest max_pixels fit may lower screenshots to when it lowers "
        "model.max_pixels to fit the card (it never goes below). Read only by fit, not by the processor "
        "(min_pixels is the processor's lower limit). None = the processor's min_pixels."))

    @model_validator(mode="after")
    def _checkpointing(self) -> "ModelConfig":
        g = self.gradient_checkpointing
        if isinstance(g, bool):
            return self
        if isinstance(g, int) and g < 0:
            raise ValueError(f"model.gradient_checkpointing={g}: a layer count must be >= 0 (0 = none, true = all).")
        if isinstance(g, float) and not 0.0 < g < 1.0:
            raise ValueError(f"model.gradient_checkpointing={g}: a fraction of the layers must lie strictly between "
                             "0 and 1; write true for all layers, false for none, or an integer layer count.")
        return self

    def checkpointed_layers(self, n_layers: int) -> int:
        """How many of the model's `n_layers` decoder layers are checkpointed (the first ones, see
        models.enable_checkpointing). One rule for the trainer, the planner and `fit`."""
        g = self.gradient_checkpointing
        if isinstance(g, bool):
            return n_layers if g else 0
        if isinstance(g, float):  # round() first: 0.3 x 10 is 3.0000000000000004 in floats
            return min(n_layers, math.ceil(round(g * n_layers, 6)))
        return min(n_layers, g)


class PeftConfig(_Section):
    method: Literal["none", "lora", "dora"] = Field("none", description="Full fine-tuning, LoRA, or DoRA adapters (peft).")
    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0, description="Adapter scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="Module names to adapt; `all-linear` = every linear layer except the LM head.")
    adapter_compute: Literal["model", "fp32"] = Field("model", description=(
        "What LoRA's matmuls compute in on a bf16 base (peft keeps the adapter weights fp32 either way, so "
        "their gradients and optimizer state stay fp32). `model`: bf16, each adapter weight cast for its "
        "matmul as torch autocast does, so backward keeps the bf16 layer inputs it already has (~30% less "
        "activation memory on Qwen2.5-0.5B). `fp32`: peft's own behaviour, which casts every adapted layer's "
        "input to fp32 and keeps that copy for backward. Unused for DoRA, k-bit bases and fp32/fp16 models."))


# Where a data.path / task.path dataset is read from besides the path itself (trainfit/data/sources/): one
# description for both sections.
