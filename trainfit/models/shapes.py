"""Architecture facts from a real Hugging Face config, counted on the meta device.

Where a model's config comes from, in order:
1. `preset:NAME` - trainfit's built-in random-init presets;
2. a local directory holding `config.json` (a downloaded or fine-tuned model), or a GGUF file (a
   .gguf path, or a folder / cached hub id with model.gguf_file): the config transformers reads from
   its metadata, which is what `train` loads (gguf.py);
3. the catalog shipped in `trainfit/models/architectures/*.json`: the architecture numbers of popular models
   (config.json fields only, no weights), so `Qwen/Qwen3-8B` plans without network;
4. the local Hugging Face cache's config.json, else the hub (`AutoConfig.from_pretrained`) when one
   quick request reaches it (trainfit/models/hub.py) and neither HF_HUB_OFFLINE nor TRAINFIT_OFFLINE is set.

Parameter counts come from building the model on the meta device (no memory, tied weights counted
once): the count of Llama-3.1-8B is 8,030,261,248, as published. The facts (counts, the inventory of
linear layers that LoRA and bitsandbytes act on, KV-cache sizes) are cached on disk by a hash of the
config, so a warm plan needs neither torch nor transformers.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from trainfit.config import ConfigError
from trainfit.core import cache
from trainfit.models import hub
from trainfit.models.catalog import catalog_entries, catalog_lookup, catalog_names
from trainfit.models.gguf import read_gguf
from trainfit.models.lora_rules import module_part, skipped_by_all_linear
from trainfit.models.overrides import merge_overrides, set_overrides
from trainfit.models.presets import preset_dict

@dataclass
class ModelSource:
    """Where an architecture comes from, and its config.json as a plain dict (model_type included)."""

    name: str
    kind: str                      # preset | local | catalog | hub
    config: dict
    published_params: Optional[int] = None
    note: str = ""
    overrides: dict = field(default_factory=dict)   # model.config_overrides as applied (already in `config`)
    gguf: Optional[dict] = None    # a GGUF base: what the file stores (gguf.read_gguf), for the plan's note

    def key(self) -> str:
        return cache.stable_hash({"config": self.config})


def locate(name: str, revision: Optional[str] = None, trust_remote_code: bool = False,
           gguf_file: Optional[str] = None) -> ModelSource:
    """Find the config of `name` (preset, local dir, GGUF file, catalog, hub). Raises ConfigError with
    the options. `gguf_file`: model.gguf_file, a GGUF file inside the folder or hub id `name`."""
    if name.startswith("preset:"):
        return ModelSource(name, "preset", preset_dict(name))
    if name.endswith(".gguf") or gguf_file:
        info = read_gguf(name, gguf_file, revision)
        return ModelSource(name, "gguf", copy.deepcopy(info["config"]), gguf=info)
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            adapter = path / "adapter_config.json"
            if adapter.is_file():  # a PEFT adapter dir: plan its base model
                base = json.loads(adapter.read_text()).get("base_model_name_or_path")
                if base:
                    return locate(base, revision, trust_remote_code)
            raise ConfigError(f"model.name={name!r} is a directory without config.json; point it at a model "
                              "directory saved with save_pretrained, or use a hub id such as Qwen/Qwen3-8B.")
        return ModelSource(name, "local", json.loads(cfg_file.read_text()))
    stem = catalog_lookup(name)
    if stem is not None:
        entry = catalog_entries()[stem]
        return ModelSource(name, "catalog", copy.deepcopy(entry["config"]), entry.get("published_params"),
                           entry.get("note", ""))

    cached = hub.in_cache(name, revision)  # the local Hugging Face cache first: no network
    if cached:
        return ModelSource(name, "hub", json.loads(Path(cached).read_text()))
    answer = None if hub.offline() else hub.ask_hub(name, revision)  # one quick request, no retries
    if answer is None:
        reason = " (hub lookups are off: HF_HUB_OFFLINE/TRAINFIT_OFFLINE)"
    elif not answer[0]:  # unreachable, or the hub says it has no such model
        reason = f" ({answer[1]})"
    else:
        try:
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
            return ModelSource(name, "hub", hf.to_dict())
        except Exception as e:  # gated repo, unknown id: all end in the same advice
            reason = f" (hub lookup failed: {type(e).__name__})"
    raise ConfigError(f"model.name={name!r} is not a preset, a local directory with config.json, or a catalog "
                      f"model{reason}; use a local directory or one of: {', '.join(catalog_names())}.")


def model_source(mc) -> ModelSource:
    """The architecture a ModelConfig trains: `locate(name)` with `config_overrides` applied. The
    planner plans it and the trainer builds it (models.load_base_model, `init: random` and presets with
    overrides), so both read the same numbers."""
    src = locate(mc.name, mc.revision, mc.trust_remote_code, mc.gguf_file)
    if not mc.config_overrides:
        return src

    applied = merge_overrides(src.config, mc.config_overrides, src.name)
    return ModelSource(src.name, src.kind, deep_update(src.config, applied), None,
                       f"{src.note} Architecture changed by model.config_overrides.".strip(), applied, src.gguf)


def deep_update(base: dict, upd: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in upd.items():
        out[k] = deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def hf_config(src: ModelSource):
    """The transformers config object of a source (imports transformers)."""
    from transformers import AutoConfig

    if src.kind == "local":
        # Read by transformers (remote-code configs too), then the same applied overrides as `config`.

        cfg = AutoConfig.from_pretrained(src.name)
        set_overrides(cfg, src.overrides)
        return cfg
    raw = copy.deepcopy(src.config)  # transformers rewrites nested dicts (rope_scaling) in place
    for k in ("transformers_version", "_name_or_path", "_model_name_or_path"):
        raw.pop(k, None)
    model_type = raw.pop("model_type")
    return AutoConfig.for_model(model_type, **raw)


def build_meta(hf_cfg, dtype=None):
    """The model on the meta device: shapes and counts, no memory."""
    import torch

    with torch.device("meta"):
        return instantiate(hf_cfg, dtype)


def instantiate(hf_cfg, dtype=None, attn_implementation: Optional[str] = None):
    """A causal LM (or image-text-to-text model) from a config, on the current default device/mode."""
    import warnings

    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return AutoModelForCausalLM.from_config(hf_cfg, **kwargs)
        except ValueError:
            from transformers import AutoModelForImageTextToText

            return AutoModelForImageTextToText.from_config(hf_cfg, **kwargs)


@dataclass
class LinearGroup:
    """Linear layers sharing a name pattern (layer index replaced by `*`) and shape."""

    name: str          # e.g. model.layers.*.self_attn.q_proj
    in_features: int
    out_features: int
    bias: bool
    count: int

    @property
    def numel(self) -> int:
        return self.count * self.in_features * self.out_features


@dataclass
class ArchFacts:
    """Numbers of one architecture that the memory and time estimates need."""

    name: str
    model_type: str
    source: str
    n_params: int              # unique parameters (tied weights once)
    n_embed: int               # input embedding
    n_lm_head: int             # output projection when untied, else 0
    tied: bool
    n_vision: int              # vision tower parameters, projector included (0 for text-only models)
    n_fp32_params: int         # parameters transformers keeps in fp32 whatever the dtype (_keep_in_fp32_modules)
    n_buffer_elems: int        # floating buffers (rotary inv_freq ...), kept in fp32
    n_layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layer_params: int          # parameters of the largest decoder layer (ZeRO-3 gathers one at a time)
    largest_param: int         # numel of the largest single parameter tensor
    n_active_params: int       # parameters a text token passes through (MoE: top-k experts only)
    num_experts: int = 0
    experts_per_tok: int = 0
    output_name: str = "lm_head"
    linears: list[LinearGroup] = field(default_factory=list)
    param_sizes: list[list[int]] = field(default_factory=list)   # [numel, how many tensors], for 8-bit optimizers
    kv_full_per_token: int = 0     # K+V elements per token over full-attention layers
    kv_window_per_token: int = 0   # same for sliding-window layers (cache capped at `sliding_window`)
    sliding_window: int = 0
    ssm_state_per_seq: int = 0     # Mamba: conv + ssm state elements per sequence (all layers)
    ssm_fp32_per_seq: int = 0      # of which the ssm state, which the scan keeps in fp32 whatever the dtype
    published_params: Optional[int] = None
    note: str = ""
    # Vision-language models: [numel, how many tensors] of the vision tower and of the projector
    # (lora_rules.module_part), which model.freeze_vision_tower / freeze_projector keep frozen.
    tower_sizes: list[list[int]] = field(default_factory=list)
    projector_sizes: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ArchFacts":
        d = dict(d)
        d["linears"] = [LinearGroup(**g) for g in d.get("linears", [])]
        return cls(**d)

    def kv_elems(self, tokens_per_seq: int, seqs: int) -> int:
        """K+V cache elements for `seqs` sequences of `tokens_per_seq` tokens (Mamba: recurrent state)."""
        window = min(tokens_per_seq, self.sliding_window) if self.sliding_window else tokens_per_seq
        return seqs * (self.kv_full_per_token * tokens_per_seq + self.kv_window_per_token * window
                       + self.ssm_state_per_seq)


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _pattern(name: str) -> str:
    return _LAYER_INDEX.sub(".*.", name)


def _facts_from_model(model, src: ModelSource, hf_cfg) -> ArchFacts:
    import torch

    text = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
    params = dict(model.named_parameters())  # remove_duplicate=True: tied weights once
    n_params = sum(p.numel() for p in params.values())
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out_emb is not None and out_emb.weight is in_emb.weight
    output_name = next((n for n, m in model.named_modules() if m is out_emb), "lm_head")
    groups: dict[tuple, LinearGroup] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != output_name:
            key = (_pattern(name), mod.in_features, mod.out_features, mod.bias is not None)
            if key in groups:
                groups[key].count += 1
            else:
                groups[key] = LinearGroup(key[0], mod.in_features, mod.out_features, key[3], 1)
    n_layers = text.num_hidden_layers
    layer_lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers]
    layer_params = max((sum(p.numel() for p in layer.parameters()) for ml in layer_lists[:1] for layer in ml),
                       default=n_params // max(n_layers, 1))
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or []) | set(
        getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    n_fp32 = sum(p.numel() for n, p in params.items() if keep and any(k in n.split(".") or k in n for k in keep))
    n_vision = sum(p.numel() for n, p in params.items() if re.search(r"(^|\.)(visual|vision_tower|vision_model)\.", n))
    # MoE: experts are stored as 3-D parameters in modules named *Experts; a token uses top-k of them.
    expert_params = sum(p.numel() for m in model.modules() if type(m).__name__.endswith("Experts")
                        for p in m.parameters(recurse=False))
    num_experts = int(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0) or 0)
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    active = n_params - n_vision - (in_emb.weight.numel() if not tied else 0)
    if num_experts and expert_params:
        active -= expert_params - expert_params * top_k // num_experts
    heads = getattr(text, "num_attention_heads", 0) or 0
    hidden = text.hidden_size
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    kv_full = kv_win = ssm = ssm_fp32 = 0
    window = int(getattr(text, "sliding_window", 0) or 0)
    if getattr(text, "state_size", None) and getattr(text, "conv_kernel", None):  # Mamba: recurrent state
        # Per layer and sequence: conv state [d_inner, conv_kernel], ssm state [d_inner, state_size].
        # Falcon-Mamba's config.json gives intermediate_size (8192), not its stated expand (16) x hidden.
        d_inner = int(getattr(text, "intermediate_size", 0) or text.expand * hidden)
        ssm = n_layers * d_inner * (text.conv_kernel + text.state_size)
        ssm_fp32 = n_layers * d_inner * text.state_size
        window = 0
    else:
        # Sliding-window layers cache at most `sliding_window` tokens; with no `layer_types` (Mistral) a
        # configured window applies to every layer.
        types = getattr(text, "layer_types", None) or (["sliding_attention"] * n_layers if window
                                                         else ["full_attention"] * n_layers)
        for t in types:
            if window and t == "sliding_attention":
                kv_win += 2 * kv_heads * head_dim
            else:
                kv_full += 2 * kv_heads * head_dim
        if not kv_win:
            window = 0
    n_buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    sizes: dict[int, int] = {}
    for p in params.values():
        sizes[p.numel()] = sizes.get(p.numel(), 0) + 1

    part_sizes: dict[str, dict[int, int]] = {"tower": {}, "projector": {}, "language": {}}
    for n, p in params.items():
        d = part_sizes[module_part(n)]
        d[p.numel()] = d.get(p.numel(), 0) + 1
    return ArchFacts(
        name=src.name, model_type=src.config.get("model_type", ""), source=src.kind, n_params=n_params,
        n_embed=in_emb.weight.numel(), n_lm_head=0 if tied or out_emb is None else out_emb.weight.numel(),
        tied=bool(tied), n_vision=n_vision, n_fp32_params=n_fp32, n_buffer_elems=n_buffers, n_layers=n_layers,
        hidden=hidden, vocab=text.vocab_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=int(getattr(text, "intermediate_size", 0) or 0), layer_params=layer_params,
        largest_param=max(p.numel() for p in params.values()), n_active_params=active, num_experts=num_experts,
        experts_per_tok=top_k, output_name=output_name, linears=list(groups.values()), kv_full_per_token=kv_full,
        kv_window_per_token=kv_win, sliding_window=window, ssm_state_per_seq=ssm, ssm_fp32_per_seq=ssm_fp32,
        param_sizes=[[n, c] for n, c in sorted(sizes.items())],
        published_params=src.published_params, note=src.note,
        tower_sizes=[[n, c] for n, c in sorted(part_sizes["tower"].items())] if n_vision else [],
        projector_sizes=[[n, c] for n, c in sorted(part_sizes["projector"].items())] if n_vision else [])


_FACTS_MEMO: dict[str, ArchFacts] = {}


def arch_facts(name_or_source: "str | ModelSource", revision: Optional[str] = None,
               trust_remote_code: bool = False) -> ArchFacts:
    """Facts of an architecture: memo in process, then the disk cache, then a meta-device build."""
    src = name_or_source if isinstance(name_or_source, ModelSource) else locate(
        name_or_source, revision, trust_remote_code)
    key = src.key()
    if key in _FACTS_MEMO:
        return _replace_name(_FACTS_MEMO[key], src)
    cached = cache.read("facts", key)
    # An entry written before a field of ArchFacts existed is rebuilt, not read with the field's default.
    if cached is not None and {f.name for f in fields(ArchFacts)} <= cached.keys():
        facts = ArchFacts.from_dict(cached)
    else:
        hf = hf_config(src)
        facts = _facts_from_model(build_meta(hf), src, hf)
        cache.write("facts", key, facts.to_dict())
    _FACTS_MEMO[key] = facts
    return _replace_name(facts, src)


def _replace_name(facts: ArchFacts, src: ModelSource) -> ArchFacts:
    if facts.name == src.name and facts.source == src.kind:
        return facts
    d = facts.to_dict()
    d.update(name=src.name, source=src.kind)
    return ArchFacts.from_dict(d)


def match_targets(facts: ArchFacts, targets: "str | list[str]") -> list[LinearGroup]:
    """The linear groups peft adapts: `all-linear` = every nn.Linear but the output head; else a list of
    names matched as peft does (the full name, or a suffix after a dot)."""
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            # A vision-language model's all-linear is its language model's (lora_rules.vlm_all_linear).
            return [g for g in facts.linears if not skipped_by_all_linear(facts.model_type, g.name)
                    and (not facts.n_vision or module_part(g.name) == "language")]
        return [g for g in facts.linears if re.fullmatch(targets, g.name.replace("*", "0"))]
    out = []
    for g in facts.linears:
        if any(g.name == t or g.name.endswith("." + t) for t in targets):
            out.append(g)
    return out
