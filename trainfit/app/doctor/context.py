"""What the files given together imply: world size, GPU card, model, precision, launcher, CPU RAM.

Files passed in one `trainfit doctor` call are read as one job: a DeepSpeed JSON next to an
accelerate YAML that points at it, a trainfit config next to a `vllm serve` line that shares its
GPUs. Each derived value says where it came from, so a finding can name its source.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from trainfit.app.doctor.files import Command, Doc
from trainfit.app.doctor.findings import Finding
from trainfit.config import DistributedConfig

# CPU RAM of ZeRO offload when no planner figure exists, after DeepSpeed's own model-states
# estimator (estimate_zero3_model_states_mem_needs with zero_init): offloaded optimizer states are
# 16 bytes a parameter (fp32 master weights, two fp32 Adam moments, fp32 gradients), offloaded
# parameters 2 more (bf16/fp16 copy), spread over the nodes, times a 1.5 buffer for pinned staging.
OFFLOAD_OPT_BYTES = 16
OFFLOAD_PARAM_BYTES = 2
OFFLOAD_BUFFER = 1.5
LR_TOLERANCE = 0.02  # a learning rate within 2% of a scaled value counts as scaled


@dataclass
class Options:
    num_gpus: Optional[int] = None       # GPUs per node the job runs on (--num-gpus)
    gpu: Optional[str] = None            # card to check memory against (--gpu)
    model: Optional[str] = None          # model the files are for, when none of them names it (--model)
    cpu_ram_gb: Optional[float] = None   # CPU RAM of a training node (--cpu-ram-gb), else this machine's
    plan: bool = True                    # run the memory planner (slower on a cold cache)
    planner: Optional[Callable] = None   # plan(cfg, gpu=, num_gpus=, suggest=) -> Plan; default trainfit.plan.plan


@dataclass
class Card:
    name: str
    memory: int                 # bytes
    bf16: Optional[bool]        # Ampere (sm80) or newer
    source: str


class Context:
    """All files of one call (the root), or the view of one file: itself and its peers.

    Peers are the other files in the same folder (a job folder: config, DeepSpeed JSON, accelerate
    YAML, launch line); a file alone in its folder has every other file given as peers. A file is
    checked against the trainfit configs among its peers, or the only config given when none is.
    """

    def __init__(self, docs: list[Doc], opts: Options, machine: dict):
        self.root = self
        self.docs, self.opts, self.machine = docs, opts, machine
        self.configs: dict[str, Any] = {}   # path -> validated trainfit Config (filled by the trainfit lint)
        self.stages: dict[str, list] = {}   # path -> the Config of each pipeline stage
        self.commands: list[Command] = [c for d in docs for c in d.commands]
        self._plans: dict[str, tuple] = {}

    def view(self, doc: Doc) -> "Context":
        root = self.root
        folder = Path(doc.path).parent
        peers = [d for d in root.docs if d is not doc and Path(d.path).parent == folder] or \
            [d for d in root.docs if d is not doc]
        v = Context([doc] + peers, root.opts, root.machine)
        v.root, v.stages, v._plans = root, root.stages, root._plans
        v.configs = {d.path: root.configs[d.path] for d in v.docs if d.path in root.configs}
        if not v.configs and len(root.configs) == 1:
            v.configs = dict(root.configs)
        return v

    def of_kind(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d.kind == kind and d.error is None and isinstance(d.data, dict)]

    @property
    def cfg(self):
        return next(iter(self.configs.values()), None)

    @property
    def accel(self) -> Optional[dict]:
        docs = self.of_kind("accelerate")
        return docs[0].data if docs else None

    def nodes(self) -> int:
        if self.cfg is not None:
            return self.cfg.distributed.num_nodes
        if self.accel is not None:
            return int(self.accel.get("num_machines", 1) or 1)
        for c in self.commands:
            if c.launcher in ("torchrun", "deepspeed", "accelerate"):
                return c.nodes()
        return 1

    def world(self) -> tuple[Optional[int], str]:
        """Total processes (GPUs) of the job and where that number came from."""
        if self.opts.num_gpus:
            n = self.nodes()
            return self.opts.num_gpus * n, f"--num-gpus {self.opts.num_gpus}" + (f" x {n} nodes" if n > 1 else "")
        for path, cfg in self.configs.items():
            return cfg.world_size, f"{path} (distributed.num_gpus x num_nodes)"
        for d in self.of_kind("accelerate"):
            if d.data.get("num_processes") is not None:
                return int(d.data["num_processes"]), f"{d.path} (num_processes)"
        for c in self.commands:
            ppn = c.procs_per_node() if c.launcher in ("torchrun", "deepspeed", "accelerate") else None
            if ppn:
                return ppn * c.nodes(), f"the launch command `{c.line[:60]}`"
        return None, ""

    def visible_gpus(self) -> Optional[int]:
        """GPUs per node the job can use: --num-gpus, else what this machine shows (None if it shows none)."""
        if self.opts.num_gpus:
            return self.opts.num_gpus
        n = self.machine.get("visible_gpus") if self.machine else None
        return n or None

    def card(self) -> Optional[Card]:
        try:
            from trainfit.plan.hardware import CATALOG, find_gpu
        except ImportError:
            find_gpu, CATALOG = None, {}
        name, source = self.opts.gpu, "--gpu"
        if not name and self.cfg is not None and self.cfg.hardware.gpu:
            name, source = self.cfg.hardware.gpu, "hardware.gpu"
        if name and find_gpu is not None:
            try:
                g = find_gpu(name)
                # Every catalog card is Ampere (sm80) or newer, so has bf16; a card given by size is unknown.
                return Card(g.name, g.memory, True if g.key in CATALOG else None, source)
            except ValueError:
                return None
        gpus = self.machine.get("gpus") if self.machine else None
        if gpus:
            g = gpus[0]
            return Card(g["name"], int(g["total_gb"] * 1e9), g.get("bf16"), "this machine (NVML)")
        return None

    def model_name(self) -> Optional[str]:
        if self.opts.model:
            return self.opts.model
        if self.cfg is not None and not self.cfg.model.name.startswith("preset:"):
            return self.cfg.model.name
        for d in self.of_kind("vllm"):
            if isinstance(d.data.get("model"), str):
                return d.data["model"]
        for c in self.commands:
            for k in ("model_name_or_path", "model", "model_id"):
                if isinstance(c.args.get(k), str):
                    return c.args[k]
        return None

    def model_info(self, name: Optional[str]) -> dict:
        """{"params", "max_pos"} of a model from the planner's catalog or a local config.json."""
        out: dict = {"params": None, "max_pos": None}
        if not name:
            return out
        local = Path(name) / "config.json"
        if local.is_file():
            try:
                conf = json.loads(local.read_text())
                text = conf.get("text_config", conf)
                out["max_pos"] = text.get("max_position_embeddings")
            except (OSError, json.JSONDecodeError):
                pass
        else:
            try:
                from trainfit.models.catalog import catalog_entries, catalog_lookup

                stem = catalog_lookup(name)
                if stem:
                    entry = catalog_entries()[stem]
                    conf = entry["config"].get("text_config", entry["config"])
                    out.update(params=entry.get("published_params"), max_pos=conf.get("max_position_embeddings"))
            except Exception:  # the catalog is another module's work in progress: never fail doctor on it
                pass
        # Counting a local model's parameters builds it on the meta device (cached); hub ids outside the
        # catalog are not looked up, so doctor never waits on the network.
        if out["params"] is None and self.opts.plan and (Path(name).is_dir() or name.startswith("preset:")):
            try:
                from trainfit.models.shapes import arch_facts

                out["params"] = arch_facts(name).n_params
            except Exception:
                pass
        return out

    def precisions(self) -> list[tuple[str, str]]:
        """(fp32|bf16|fp16, source) that the non-DeepSpeed files state."""
        out = []
        for path, cfg in self.configs.items():
            out.append((cfg.model.dtype, f"{path} (model.dtype)"))
        for d in self.of_kind("accelerate"):
            mp = str(d.data.get("mixed_precision") or "").lower()
            if mp in ("bf16", "fp16"):
                out.append((mp, f"{d.path} (mixed_precision)"))
        return out

    def ram(self) -> tuple[Optional[int], bool, str]:
        """CPU RAM per node, whether it is the training machine's for sure, and its source."""
        if self.opts.cpu_ram_gb:
            return int(self.opts.cpu_ram_gb * 1e9), True, f"--cpu-ram-gb {self.opts.cpu_ram_gb:g}"
        total = (self.machine.get("cpu_ram") or {}).get("total") if self.machine else None
        if total:
            # A machine with GPUs is taken to be the training node; a CPU-only one may just be a laptop.
            return total, bool(self.machine.get("gpus")), "this machine"
        return None, False, ""

    def plan(self, cfg, **raw_overrides) -> tuple[Any, Optional[str]]:
        """(Plan, None) or (None, why not). Memoised per config; never raises."""
        if not self.opts.plan:
            return None, "planning is off (--no-plan)"
        planner = self.opts.planner
        if planner is None:
            try:
                from trainfit.plan import plan as planner
            except Exception as e:
                return None, f"trainfit.plan is not importable ({type(e).__name__}: {e})"
        if raw_overrides:
            from trainfit.config import deep_merge, validate

            try:
                cfg = validate(deep_merge(cfg.model_dump(), raw_overrides))
            except Exception as e:
                return None, f"the config with {raw_overrides} is invalid: {e}"
        key = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
        if key not in self._plans:
            try:
                # Doctor reads the phases, problems and CPU RAM, never the suggestions (it points to
                # `trainfit plan` / `fit` for those): not searching them saves a plan per candidate.
                self._plans[key] = (planner(cfg, gpu=self.opts.gpu, num_gpus=self.opts.num_gpus, suggest=False), None)
            except Exception as e:  # a ConfigError is a reason; anything else is the planner's bug, reported
                self._plans[key] = (None, f"{type(e).__name__}: {e}"[:300])
        return self._plans[key]

    def ds_launch_kind(self, doc: Doc) -> Optional[str]:
        """Who reads this DeepSpeed file: `hf` (HF Trainer / accelerate fill `auto`), `trainfit`, `native`
        (deepspeed.initialize with --deepspeed_config: nothing fills `auto`), or None when unknown."""
        name = Path(doc.path).name
        for d in self.of_kind("accelerate"):
            if str(d.data.get("distributed_type", "")).upper() == "DEEPSPEED":
                return "hf"
        for c in self.commands:
            if c.launcher == "accelerate":
                return "hf"
            if str(c.args.get("deepspeed", "")).endswith(name):
                return "hf"  # --deepspeed is the HF TrainingArguments flag
            if str(c.args.get("deepspeed_config", "")).endswith(name):
                return "native"
            if c.launcher == "trainfit":
                return "trainfit"
        if any(cfg.distributed.strategy == "deepspeed" for cfg in self.configs.values()):
            return "trainfit"
        return None

    def batch_reference(self, doc: Doc, distributed: Optional[DistributedConfig] = None
                        ) -> tuple[Optional[int], Optional[float], str]:
        """(base global batch, base lr or None, source). trainfit's future field first, then comments
        in this file, then in the other files of the call."""
        if distributed is not None:
            base = getattr(distributed, "base_global_batch_size", None)
            if base:
                return int(base), None, "distributed.base_global_batch_size"
        for d in [doc] + [x for x in self.docs if x is not doc]:
            if "base_global_batch_size" in d.comments:
                return int(d.comments["base_global_batch_size"]), d.comments.get("base_lr"), \
                    f"the `# base_global_batch_size` comment in {d.path}"
        return None, None, ""


def lr_scaling_findings(ctx: Context, doc: Doc, lr: Any, global_batch: Optional[int], lr_key: str,
                        distributed: Optional[DistributedConfig] = None) -> list[Finding]:
    """Warn when the global batch moved away from its reference and the lr did not follow.

    Linear rule (Goyal et al. 2017, SGD): lr x G/B. Square-root rule (Adam-family, common for LLM
    fine-tuning): lr x sqrt(G/B). Without a recorded base lr, the file's lr is taken as the one tuned
    at the base batch, so any change of batch needs a rescaled lr and an updated reference.
    """
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not global_batch:
        return []
    base, base_lr, src = ctx.batch_reference(doc, distributed)
    if not base or base == global_batch:
        return []
    scaling = getattr(distributed, "lr_scaling", None) if distributed is not None else None
    if scaling in ("linear", "sqrt"):
        return []  # the trainer rescales train.lr itself
    ref_lr = base_lr if base_lr else float(lr)
    ratio = global_batch / base
    lin, sq = ref_lr * ratio, ref_lr * math.sqrt(ratio)
    if base_lr and any(abs(lr - x) <= LR_TOLERANCE * x for x in (lin, sq)):
        return []
    what = f"base lr {base_lr:g}" if base_lr else f"{lr_key}={lr:g}"
    return [Finding("lr.not_scaled", "warning",
                    f"The global batch is {global_batch} but {src} says the learning rate was tuned at "
                    f"{base}; {lr_key}={lr:g} is not rescaled for the {ratio:g}x batch.",
                    f"Set {lr_key} to {lin:.3g} (linear rule, {what} x {global_batch}/{base}) or {sq:.3g} "
                    f"(square-root rule, usual for Adam), then record the new reference (base_global_batch_size: "
                    f"{global_batch}" + (", base_lr" if base_lr else "") + ").", doc.path)]


def offload_ram_rule(params: int, offload_param: bool, nodes: int, buffer: float = OFFLOAD_BUFFER) -> int:
    """CPU bytes per node of ZeRO offload by the rule above."""
    return int(params * (OFFLOAD_OPT_BYTES + (OFFLOAD_PARAM_BYTES if offload_param else 0)) * buffer / max(nodes, 1))
