"""Load and save the policy: presets, hub ids, local directories (full or PEFT adapter), GGUF files.

Everything a stage needs from a model goes through `load_policy`: dtype, attention kernel, gradient
checkpointing, LoRA/DoRA adapters and 4/8-bit bases. Saved outputs are plain transformers / peft
directories, so `AutoModelForCausalLM.from_pretrained(dir)` or `PeftModel.from_pretrained` load them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from trainfit.config import ConfigError, ModelConfig, PeftConfig
from trainfit.core.extras import install_message
from trainfit.models.images import is_vlm_config, load_processor
from trainfit.models.lora_compute import lora_compute_in_input_dtype
from trainfit.models.kbit import prepare_kbit
from trainfit.models.lora_rules import MAMBA_TYPES, check_targets, lora_in_model_dtype, skipped_by_all_linear
from trainfit.models.modules import layer_list
from trainfit.models.presets import parse_preset, preset_config
from trainfit.models.tokenizer import build_tokenizer
from trainfit.models.shapes import hf_config, instantiate, model_source
from trainfit.models.catalog import catalog_entries, catalog_lookup
from trainfit.models.gguf import eos_token_id
from trainfit.models.vision_freeze import apply_freeze, lora_target_regex
from trainfit.models.vlm_preset import build_vlm_tokenizer, is_vlm_preset

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
logging.getLogger("peft").setLevel(logging.ERROR)


def _defer_deepspeed_unwrap() -> None:
    """save_pretrained unwraps the model with accelerate's extract_model_from_parallel, which imports
    DeepSpeed (and mlflow with it: ~3 s a process) whenever it is installed, only to add DeepSpeedEngine to
    an isinstance check; no model is an engine before deepspeed is imported, so the check waits for that."""
    try:
        from accelerate.utils import other  # peft's dependency; without it transformers unwraps by itself
    except ImportError:
        return
    installed = other.is_deepspeed_available
    if not getattr(installed, "trainfit_deferred", False):
        other.is_deepspeed_available = lambda: "deepspeed" in sys.modules and installed()
        other.is_deepspeed_available.trainfit_deferred = True


_defer_deepspeed_unwrap()

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: PreTrainedModel      # the trained module (a PeftModel when adapters are on)
    tokenizer: object
    is_peft: bool
    source: str                 # what model.name resolved to (for the adapter's base path)
    from_gguf: bool = False     # the base was read (dequantized) from a .gguf file: no loadable base dir
    processor: object = None    # vision-language models: trainfit.models.images.VisionProcessor


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto.")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _split_gguf(name: str, gguf_file: Optional[str]) -> tuple[str, Optional[str]]:
    """'dir/model.gguf' -> ('dir', 'model.gguf'); hub id + gguf_file pass through."""
    if name.endswith(".gguf"):
        p = Path(name)
        if not p.is_file():
            raise ConfigError(f"model.name={name!r}: GGUF file not found; give the path to an existing .gguf file.")
        return str(p.parent), p.name
    return name, gguf_file


def _require(module: str, extra: str, why: str) -> None:
    try:
        __import__(module)
    except ImportError:
        raise ConfigError(install_message(module, extra, why)) from None


def load_tokenizer(mc: ModelConfig):
    if parse_preset(mc.name) and is_vlm_preset(parse_preset(mc.name)) and mc.tokenizer in (None, "preset"):
        return build_vlm_tokenizer()  # the local tokenizer plus the vision tokens
    if mc.tokenizer == "preset" or (parse_preset(mc.name) and mc.tokenizer is None):
        return build_tokenizer()
    if mc.tokenizer is not None:
        return _auto_tokenizer(mc.tokenizer, mc, f"model.tokenizer={mc.tokenizer!r}")
    if mc.init == "random":
        # The architecture's own tokenizer: a local directory's, or the named model's (hub cache or
        # network). A catalog entry has numbers only, so this may find none: the error names the fix.

        stem = None if Path(mc.name).is_dir() else catalog_lookup(mc.name)
        source = catalog_entries()[stem]["names"][0] if stem else mc.name  # qwen3-0.6b -> Qwen/Qwen3-0.6B
        return _auto_tokenizer(source, mc, f"model.init=random with model.name={mc.name!r}", random=True)
    name, gguf = _split_gguf(mc.name, mc.gguf_file)
    if gguf:
        _require("gguf", "gguf", f"model.name={mc.name!r} (a GGUF file)")
    # An adapter dir usually carries its tokenizer; otherwise the base's is the right one.
    has_own = (Path(name) / "tokenizer_config.json").is_file()
    source = name if has_own else (_adapter_base(name) or name)
    try:
        tok = AutoTokenizer.from_pretrained(source, gguf_file=gguf, revision=mc.revision,
                                            trust_remote_code=mc.trust_remote_code)
    except OSError as e:
        raise ConfigError(f"model.name={mc.name!r}: cannot load a tokenizer ({e}). Give a hub id, a local "
                          "model directory, a .gguf file, or preset:tiny.") from None
    if gguf:  # the file's eos, whichever transformers built the tokenizer (gguf.eos_token_id)
        eos = eos_token_id(mc.name, mc.gguf_file, mc.revision)
        if eos is not None and eos < len(tok) and eos != tok.eos_token_id:
            tok.eos_token = tok.convert_ids_to_tokens(eos)
    if tok.pad_token is None:  # generation and batching need a pad id; eos is the usual stand-in
        tok.pad_token = tok.eos_token
    return tok


def _auto_tokenizer(source: str, mc: ModelConfig, what: str, random: bool = False):
    try:
        tok = AutoTokenizer.from_pretrained(source, revision=mc.revision, trust_remote_code=mc.trust_remote_code)
        if len(tok) < 3:  # transformers makes an empty tokenizer for a directory holding only config.json
            raise OSError(f"{source} holds no tokenizer files")
    except (OSError, ValueError) as e:
        fix = ("set model.tokenizer to a hub id or local directory (e.g. the published model's), or "
               "model.tokenizer=preset for trainfit's local 512-token tokenizer (then "
               "model.config_overrides.vocab_size: 512 sizes the embedding to it)") if random else \
            "give a hub id or a local directory holding a tokenizer, or preset"
        raise ConfigError(f"{what}: no tokenizer found ({type(e).__name__}: {str(e)[:160]}); {fix}.") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _random_model(mc: ModelConfig, dtype, vocab_size: Optional[int]):
    """The architecture of `mc` (planner's shapes.model_source: catalog, hub, local dir or preset, with
    `config_overrides`) built with random weights, seeded by model.seed."""
    config = hf_config(model_source(mc))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if vocab_size is not None and vocab_size > text.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} tokens but the architecture of {mc.name!r} has "
                          f"vocab_size={text.vocab_size}; set model.config_overrides.vocab_size to at least "
                          f"{vocab_size}, or use a smaller tokenizer (model.tokenizer).")
    if vocab_size is not None and vocab_size < text.vocab_size and not parse_preset(mc.name):
        logging.getLogger("trainfit").warning(
            "the embedding has %d rows (vocab_size of %s) but the tokenizer uses %d; set "
            "model.config_overrides.vocab_size: %d to drop the unused rows", text.vocab_size, mc.name,
            vocab_size, vocab_size)
    # Attention-free architectures (Mamba) refuse an attention implementation.
    attn = mc.attn_implementation if getattr(text, "num_attention_heads", None) else None
    with _fork_rng(mc.seed):
        return instantiate(config, dtype, attn_implementation=attn)


def _adapter_base(path: str) -> Optional[str]:
    cfg = Path(path) / "adapter_config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text()).get("base_model_name_or_path")
    return None


def _quantization_config(mc: ModelConfig):
    if mc.quantization == "none":
        return None
    _require("bitsandbytes", "bnb", f"model.quantization={mc.quantization}")
    from transformers import BitsAndBytesConfig

    if mc.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=mc.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=mc.bnb_4bit_double_quant,
                              bnb_4bit_compute_dtype=DTYPES[mc.dtype] if mc.dtype != "fp32" else torch.bfloat16)


def load_base_model(mc: ModelConfig, device: torch.device, vocab_size: Optional[int] = None) -> tuple[PreTrainedModel, str]:
    """The causal LM without adapters. Adapter directories are merged into their base."""
    dtype = DTYPES[mc.dtype]
    preset = parse_preset(mc.name)
    if (mc.init == "random" and not preset) or (preset and mc.config_overrides):
        # Drawn where it will live: a GPU draws a 4B model's weights in about a second, where a CPU
        # core takes a minute (the same seed gives other numbers on CUDA than on the CPU).
        on = torch.device(device) if torch.device(device).type == "cuda" else contextlib.nullcontext()
        with on:
            return _random_model(mc, dtype, vocab_size).to(device), mc.name
    if preset:
        config = preset_config(mc.name, vocab_size)
        if hasattr(config, "num_attention_heads"):  # Mamba has no attention to choose a kernel for
            config._attn_implementation = mc.attn_implementation
        with _fork_rng(mc.seed):
            model = _auto_class(config).from_config(config, dtype=dtype)
        return model.to(device), mc.name
    name, gguf = _split_gguf(mc.name, mc.gguf_file)
    if gguf:
        _require("gguf", "gguf", f"model.name={mc.name!r} (a GGUF file)")
    base = _adapter_base(name)
    kwargs = dict(dtype=dtype, attn_implementation=mc.attn_implementation, revision=mc.revision,
                  trust_remote_code=mc.trust_remote_code, gguf_file=gguf,
                  quantization_config=_quantization_config(mc) or _gguf_dequantized(gguf))
    if device.type == "cuda":
        # One process trains one model on one device: never let "auto" spread it over all GPUs.
        kwargs["device_map"] = {"": device.index or 0}
    elif _quantization_config(mc) is not None:
        # transformers puts a bitsandbytes model on the current GPU whenever one is visible: keep a
        # train.device=cpu model on the CPU.
        kwargs["device_map"] = {"": "cpu"}
    try:
        model = _from_pretrained(base or name, kwargs)
        if base:  # an adapter dir (e.g. the previous stage's LoRA output): merge into its base
            from peft import PeftModel
            model = PeftModel.from_pretrained(model, name).merge_and_unload()
    except OSError as e:
        raise ConfigError(f"model.name={mc.name!r}: cannot load ({e}). Give a hub id (network needed), a local "
                          "model directory, a .gguf file, or preset:tiny.") from None
    if gguf:
        _drop_gguf_marking(model)
    if device.type != "cuda" or mc.quantization == "none":
        model = model.to(device)
    return model, name


def _auto_class(config):
    """AutoModelForImageTextToText for a vision-language config, else AutoModelForCausalLM."""
    return transformers.AutoModelForImageTextToText if is_vlm_config(config) else AutoModelForCausalLM


def _from_pretrained(name: str, kwargs: dict):
    try:
        cfg = transformers.AutoConfig.from_pretrained(name, revision=kwargs.get("revision"),
                                                      trust_remote_code=kwargs.get("trust_remote_code", False))
    except (OSError, ValueError):
        cfg = None  # a GGUF file or an unusual repo: the causal-LM class reads what it can
    if cfg is not None and _auto_class(cfg) is not AutoModelForCausalLM:
        return _auto_class(cfg).from_pretrained(name, **kwargs)
    try:
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except ValueError as e:
        # Attention-free models (Mamba) refuse every attention implementation: load with their default.
        if "attention implementation" not in str(e):
            raise
        return AutoModelForCausalLM.from_pretrained(name, **{**kwargs, "attn_implementation": None})


def _gguf_dequantized(gguf: Optional[str]):
    """For a GGUF base: load every weight unpacked into a plain dense model. The weights are trained
    (or sit under adapters) as ordinary tensors, and transformers' packed GGUF modules (used when the
    `kernels` package is installed) are not trainable. None for other bases or older transformers,
    which always dequantize."""
    cls = getattr(transformers, "GgufConfig", None)
    return cls(dequantize=True) if gguf and cls is not None else None


def _drop_gguf_marking(model) -> None:
    """Some transformers versions mark a dequantized GGUF model as GGUF-quantized and then refuse to
    save it; its weights are plain tensors, so drop the marking (full fine-tunes save a plain dir)."""
    q = getattr(model, "hf_quantizer", None)
    if q is not None and str(getattr(q.quantization_config, "quant_method", "")).lower().endswith("gguf") \
            and not getattr(q, "packed_modules", None):
        q.remove_quantization_config(model)


def load_policy(mc: ModelConfig, pc: PeftConfig, device: torch.device, seed: int = 0) -> LoadedModel:
    tok = load_tokenizer(mc)
    model, source = load_base_model(mc, device, vocab_size=len(tok))
    model.config.pad_token_id = tok.pad_token_id
    enable_checkpointing(model, mc)
    processor = None

    if is_vlm_config(model.config):
        apply_freeze(model, mc)  # before adapters: peft freezes the rest anyway
        processor = load_processor(mc, tok)
    is_peft = pc.method != "none"
    if is_peft:
        model = attach_adapters(model, pc, mc, seed)
    return LoadedModel(model=model, tokenizer=tok, is_peft=is_peft, source=source,
                       from_gguf=not parse_preset(mc.name) and _split_gguf(mc.name, mc.gguf_file)[1] is not None,
                       processor=processor)


def decoder_layers(model) -> list:
    """The decoder's layers, in order (the text model's for a multimodal one)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return list(layer_list(model, cfg.num_hidden_layers))


def enable_checkpointing(model, mc: ModelConfig) -> int:
    """Checkpoint the first k = mc.checkpointed_layers(L) of the L decoder layers; returns k.

    Non-reentrant checkpointing works with frozen inputs (adapters) and with no_grad probes. Why the
    first k: the end-of-forward memory is the same whichever k are chosen, but backward visits the
    layers last to first, so it finishes the L-k full layers (freeing their saved activations) before it
    recomputes any checkpointed one: the recompute's transient then sits on the small checkpointed
    layers, not on all the full ones (Megatron's `block` recompute also takes the first N layers).
    plan/memory.py plans exactly this. transformers' GradientCheckpointingLayer recomputes a layer when
    its own `gradient_checkpointing` attribute is set (the model-wide switch sets it on every layer)."""
    layers = decoder_layers(model)
    k = mc.checkpointed_layers(len(layers))
    if k == 0:
        return 0
    enable = getattr(model, "activation_checkpointing_enable", None)  # gradient_checkpointing_enable: deprecated
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if k < len(layers):
        from transformers.modeling_layers import GradientCheckpointingLayer

        if not all(isinstance(layer, GradientCheckpointingLayer) for layer in layers):
            raise ConfigError(f"model.gradient_checkpointing={mc.gradient_checkpointing}: {type(model).__name__} "
                              "switches checkpointing for all its layers at once, not per layer; use true or false.")
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i < k
    return k


def lora_targets(model, targets, mc: Optional[ModelConfig] = None):
    """peft's `target_modules` for `model` under trainfit's rule (trainfit/models/lora_rules.py): `all-linear`
    becomes the explicit names of the linear layers it covers where peft's own `all-linear` would pick
    modules it then refuses (Mamba's out_proj), or, on a vision-language model, the language model's
    linear layers only (plus the vision tower's / projector's where `mc` trains them); explicit names
    peft refuses are a ConfigError."""
    mt = getattr(getattr(model, "config", None), "model_type", "") or ""
    check_targets(mt, targets)
    if is_vlm_config(model.config) and isinstance(targets, str) and targets.lower() == "all-linear":
        return lora_target_regex(model, mc or ModelConfig())
    if mt not in MAMBA_TYPES or not (isinstance(targets, str) and targets.lower() == "all-linear"):
        return targets
    head = model.get_output_embeddings()
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head and not skipped_by_all_linear(mt, n)})


def attach_adapters(model: PreTrainedModel, pc: PeftConfig, mc: ModelConfig, seed: int):
    from peft import LoraConfig, get_peft_model

    if mc.quantization != "none":
        model = prepare_kbit(model, mc.gradient_checkpointing)
    elif mc.gradient_checkpointing:
        model.enable_input_require_grads()
    lcfg = LoraConfig(r=pc.r, lora_alpha=pc.alpha, lora_dropout=pc.dropout, use_dora=pc.method == "dora",
                      target_modules=lora_targets(model, pc.target_modules, mc), task_type="CAUSAL_LM")
    with _fork_rng(seed):
        model = get_peft_model(model, lcfg)

    if lora_in_model_dtype(pc.method, pc.adapter_compute, mc.dtype, mc.quantization):
        lora_compute_in_input_dtype(model)  # bf16 matmuls, fp32 adapter weights (lora_compute.py)
    return model


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def unwrap(model, peft: bool = False):
    """The module under DDP / DeepSpeed (`.module`) and torch.compile (`_orig_mod`) wrappers; with
    `peft`, also the transformers model under a PEFT wrapper."""
    m = model
    for _ in range(4):  # wrappers nest (compile over DDP over PEFT...): a few levels at most
        for attr in ("module", "_orig_mod"):
            inner = getattr(m, attr, None)
            if inner is not None:
                m = inner
        if peft and hasattr(m, "get_base_model"):
            m = m.get_base_model()
    return m


def reference_context(model, is_peft: bool):
    """Context in which `model` computes the reference policy: adapters off (PEFT), else nothing."""
    return model.disable_adapter() if is_peft else contextlib.nullcontext()


@contextlib.contextmanager
def _fork_rng(seed: int):
    """Seed model / adapter init without disturbing the caller's RNG stream."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def count_parameters(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable
