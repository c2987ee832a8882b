"""The one check behind the three doors: `trainfit plan`, `trainfit train --dry-run` and `trainfit train`.

    ready = preflight(cfg, "dry-run", resume=False, overwrite=False)   # ConfigError: exit 2
    ready.code                                                         # 0 ready, 1 does not fit

Exit codes, the same at every door: 0 ready, 1 planned and does not fit, 2 an error (ConfigError,
one paragraph). Nothing here loads weights; the checks run cheapest first, in this order:
1. the config: schema and cross-field rules with every pipeline stage merged with the base
   (trainfit/config/), stage references (rl_models.reward_model=stage:rm needs an earlier rm stage), and what
   the trainer runs (runnable.py);
2. the packages the config needs (core/extras.py): DeepSpeed, vLLM, bitsandbytes, gguf, liger,
   flash-attn, trackers;
3. what each stage reads (datacheck.py): data files parse and have the stage's fields, the task
   builds, GRPO / PPO reward functions import;
4. the models (hub.py): model.name, model.tokenizer, rl_models.reward_model / value_model are a
   preset, a local path, in the Hugging Face cache, or on the hub;
5. this machine (dry-run and train): train.device=cuda needs CUDA, several ranks or DeepSpeed need the
   GPUs and the CPU RAM (train/launch.py), the run dir (train/rundir.py: writable, and what it holds),
   and its disk's free space against one checkpoint (train/storage.py: refused below one, a warning
   in `Ready.warnings` below what the run keeps);
6. the plan of each stage (plan/memory.py).

The doors differ only where their question does:
- `plan` answers for the machine that will train, which need not be this one (--gpu, --num-gpus,
  hardware.gpu): it skips step 5, and plans a model known to the planner's catalog whose weights are
  not on this machine (with a note), where dry-run and train stop, since train would have nothing to
  load.
- The packages (step 2). Those only the training machine imports (vLLM, bitsandbytes, DeepSpeed,
  liger, flash-attn, trackers) do not stop `plan`: it lists them, as "needed on the training
  machine: ..." (Ready.training_machine, shown with each stage's plan; the ones missing here with
  their install command), and its exit code still says only whether the config fits (0 / 1) or is
  wrong (2). `trainfit fit` and `trainfit hardware` list them the same way. Dry-run and train refuse
  a missing one (exit 2, with extras.message's words), since train would import it. Only gguf, which
  the planner reads a GGUF file with, is needed here by every door.
- The verdict. Each stage is planned for the card plan/hardware.resolve_gpu picks: --gpu (plan
  only), hardware.gpu, the GPU detected here, else an assumed H100 80GB. A stage that does not fit a
  card named or detected is exit 1 at every door (DOES NOT FIT; or DOES NOT RUN, when its memory
  fits but a problem of the plan stops it, such as screenshots over the episode's token budget). A
  card only assumed (nothing named, no GPU here) never is: that plan is for nobody's card. `train` therefore plans before loading anything when a
  card is named or detected, and refuses with its dry run's message what its dry run refuses; on a
  CPU-only machine without hardware.gpu it plans nothing and nothing gates. To train on the CPU a
  config whose hardware.gpu it does not fit, remove hardware.gpu (hardware.gpu=null).
- A stage the planner cannot plan is exit 2 for `plan` (the plan is its answer); dry-run and train
  note it and go on (the planner's limits are not the trainer's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from trainfit.config.stages import stage_spec
from trainfit.config import Config, ConfigError, expand_stages
from trainfit.core import dist, extras, progress
from trainfit.models import hub
from trainfit.models.catalog import catalog_entries, catalog_lookup
from trainfit.models.runnable import not_trainable, require_extras
from trainfit.models.shapes import locate
from trainfit.plan import hardware, plan
from trainfit.plan.memory import verdict, with_gpus
from trainfit.train import rundir, storage
from trainfit.train.datacheck import check_stage
from trainfit.train.launch import check_launch

DOORS = ("plan", "dry-run", "train")
GiB = 2 ** 30


@dataclass
class Ready:
    """What passed: the stages as trained, each stage's plan (None where not planned), notes."""

    door: str
    stages: list[Config]
    plans: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # plan: each stage's "needed on the training machine: ..." (extras.training_machine_line), or None
    training_machine: list[Optional[str]] = field(default_factory=list)
    # dry-run and train: what may stop the run later (a disk short of what the run keeps), said before it starts
    warnings: list[str] = field(default_factory=list)

    def over(self) -> list:
        """(stage index, plan) of the stages that do not fit a card named or detected."""
        return [(i, p) for i, p in enumerate(self.plans)
                if p is not None and p.fits is False and p.gpu_source != "assumed"]

    @property
    def code(self) -> int:
        return 1 if self.over() else 0

    def does_not_fit(self, path: str) -> str:
        """The exit-1 paragraph (dry-run and train print the same)."""
        parts = []
        for i, p in self.over():
            why = "".join(f"; {prob.rstrip('.')}" for prob in p.problems)
            if verdict(p) == "DOES NOT RUN":  # the memory fits: the problem comes first
                parts.append(f"stage {i} ({p.stage}) does not run as configured on {p.gpu} ({p.gpu_source}): "
                             f"{why[2:]} (memory is not the problem: planned peak {p.peak / GiB:.1f} GiB per GPU "
                             f"within a {(p.budget or 0) / GiB:.1f} GiB budget)")
                continue
            parts.append(f"stage {i} ({p.stage}) does not fit {p.gpu} ({p.gpu_source}): planned peak "
                         f"{p.peak / GiB:.1f} GiB per GPU against a {(p.budget or 0) / GiB:.1f} GiB budget{why}")
        named = any(p.gpu_source == "hardware.gpu" for _, p in self.over())
        return ("; ".join(parts) + f". `trainfit plan {path}` lists the cheapest changes that fit and `trainfit fit "
                f"{path}` writes a config that does"
                + ("; to train on this machine's CPU anyway, remove hardware.gpu (hardware.gpu=null)" if named
                   and not _cuda_here() else "") + ".")


def preflight(cfg: Config, door: str, *, resume: bool = False, overwrite: bool = False, gpu: Optional[str] = None,
              num_gpus: Optional[int] = None, margin: Optional[float] = None, plan: bool = True) -> Ready:
    """Check `cfg` for `door` (plan | dry-run | train); ConfigError where `trainfit train` would refuse.
    `gpu`, `num_gpus`, `margin`: `trainfit plan`'s options. `plan=False` skips step 6."""
    if door not in DOORS:
        raise ValueError(f"door must be one of {DOORS}, not {door!r}")
    here = door != "plan"
    stages = expand_stages(cfg)
    if num_gpus is not None:
        stages = [with_gpus(s, num_gpus) for s in stages]
    check_references(stages)
    for s in stages:
        reason = not_trainable(s)
        if reason:
            raise ConfigError(reason)
    for s in stages:
        require_extras(s, planning=not here)
    ready = Ready(door, stages, training_machine=[] if here else [extras.training_machine_line([s]) for s in stages])
    for i, s in enumerate(stages):
        progress.step(f"{door}: checking what stage {i} ({s.stage}) reads")
        ready.notes += check_stage(s, planning=not here)
    progress.step(f"{door}: finding the models")
    ready.notes += check_models(stages, catalog_ok=not here, probe=door == "train")
    if here:
        check_machine(stages)

        rundir.check_run_dir(cfg.run_dir, resume=resume, overwrite=overwrite, cfg=cfg)
        warning = storage.check_space(stages, cfg.run_dir, reclaimed_bytes(cfg.run_dir, resume, overwrite))
        ready.warnings += [warning] if warning else []
    if plan:
        ready.plans = plan_stages(stages, door, gpu, margin, ready.notes)
    return ready


def reclaimed_bytes(run_dir: str, resume: bool, overwrite: bool) -> int:
    """Bytes in run_dir a run frees or writes over: its checkpoints under --resume, the whole run under --overwrite."""
    if overwrite:
        return storage.tree_bytes(Path(run_dir))
    return sum(storage.tree_bytes(c) for c in rundir.previous_run(Path(run_dir))[1]) if resume else 0


def check_references(stages: list[Config]) -> None:
    """rl_models.reward_model=stage:rm names the final model of an rm stage that runs earlier."""
    for i, s in enumerate(stages):
        if s.rl_models.reward_model == "stage:rm" and not any(stage_spec(p.stage).saves == "reward_model"
                                                                for p in stages[:i]):
            raise no_rm_stage(i, s.stage)


def no_rm_stage(i: int, stage: str) -> ConfigError:
    return ConfigError(f"stage {i} ({stage}) has rl_models.reward_model=stage:rm (this pipeline's reward model) but "
                       "no stage rm runs before it; add an rm stage earlier in `stages:`, or point "
                       "rl_models.reward_model at a reward-model directory.")


def check_models(stages: list[Config], *, catalog_ok: bool, probe: bool = False) -> list[str]:
    """Every model the run loads can be found (hub.resolve_model); returns notes. Later pipeline stages
    start from the previous stage's output, so only stage 0's model.name and tokenizer are looked up.
    `probe`: when a hub id is found in the cache, ask the hub once whether it is reachable, and if not
    switch huggingface_hub offline, so that loading reads the cache without retrying the network."""
    m = stages[0].model
    found: list[tuple[str, hub.Found]] = []
    if m.init == "random" and not m.name.startswith("preset:"):
        locate(m.name, m.revision, m.trust_remote_code)  # the architecture, as the trainer builds it
        if m.tokenizer is None:  # the named model's tokenizer (models.load_tokenizer)
            stem = None if Path(m.name).is_dir() else catalog_lookup(m.name)
            source = catalog_entries()[stem]["names"][0] if stem else m.name
            found.append((source, _tokenizer(source, f"model.init=random with model.name={m.name!r}", m.revision,
                                             catalog_ok)))
    else:
        found.append((m.name, hub.resolve_model(m.name, revision=m.revision, gguf_file=m.gguf_file,
                                                catalog_ok=catalog_ok)))
    if m.tokenizer not in (None, "preset"):
        found.append((m.tokenizer, _tokenizer(m.tokenizer, f"model.tokenizer={m.tokenizer!r}", m.revision, catalog_ok)))
    for s in stages:
        for key, name in (("rl_models.reward_model", s.rl_models.reward_model),
                          ("rl_models.value_model", s.rl_models.value_model), ("env.user_model", s.env.user_model)):
            if name and name != "stage:rm" and name not in (n for n, _ in found):
                found.append((name, hub.resolve_model(name, key=key, catalog_ok=catalog_ok)))
    cached = [n for n, f in found if f.kind == "cache"]
    if probe and cached and (hub.offline() or hub.ask_hub(cached[0])[0] is None):
        hub.go_offline()  # also when only the environment says offline (set after huggingface_hub was imported)
    return list(dict.fromkeys(f.note for _, f in found if f.note))


def _tokenizer(source: str, what: str, revision: Optional[str], catalog_ok: bool) -> hub.Found:
    """A tokenizer source: a directory with tokenizer files, or a hub id with them in the cache or on
    the hub. The error names models.load_tokenizer's fix."""
    path = Path(source).expanduser()
    if path.is_dir():
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return hub.Found("local", str(path))
        raise ConfigError(f"{what}: no tokenizer found in {path.resolve()} (no tokenizer.json or tokenizer_config.json); "
                          "set model.tokenizer to a hub id or local directory holding a tokenizer, or "
                          "model.tokenizer=preset for trainfit's local 512-token tokenizer.")
    if hub.in_cache(source, revision, "tokenizer_config.json"):
        return hub.Found("cache", source)
    try:
        found = hub.resolve_model(source, key="tokenizer of " + what, revision=revision, catalog_ok=catalog_ok)
    except ConfigError as e:
        raise ConfigError(f"{e} A tokenizer can also be given as model.tokenizer=preset (trainfit's local "
                          "512-token tokenizer).") from None
    return found


def check_machine(stages: list[Config]) -> None:
    """What this machine must have for the run: CUDA where asked, the GPUs and RAM of the launch."""
    for s in stages:
        if s.train.device == "cuda" and not _cuda_here():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto.")
        if s.train.fused_head == "liger" and not stage_spec(s.stage).plain_head and not dist.uses_cuda(s.train):
            raise ConfigError("train.fused_head=liger runs Liger's Triton kernel, which needs a CUDA device, but this "
                              "stage trains on cpu; use train.fused_head=chunked (any device) or off.")
        if s.world_size > 1 or s.engine() == "deepspeed":
            check_launch(s)


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def plan_stages(stages: list[Config], door: str, gpu: Optional[str], margin: Optional[float],
                notes: list[str]) -> list:
    """Each stage's plan (None where not planned: train with no card named or detected, or a
    planner error at dry-run / train, noted)."""
    out = []
    for i, s in enumerate(stages):
        if door == "train":
            card, _ = hardware.resolve_gpu(None, s.hardware)   # an unknown hardware.gpu: UnknownGPU, a ConfigError
            if card is None:  # nothing named or detected: a plan could not gate, so none is made
                out.append(None)
                continue
        try:
            progress.step(f"{door}: planning stage {i} ({s.stage})" + (" and the changes that would fit it"
                                                                       if door == "plan" else ""))
            p = plan(s, gpu=gpu, margin=margin, suggest=door == "plan")
            if len(stages) > 1:  # a change to one stage of a pipeline is that stage's override
                for sug in p.suggestions:
                    sug.overrides = [f"stages.{i}.{o}" for o in sug.overrides]
            out.append(p)
        except ConfigError as e:
            if door == "plan":
                raise
            notes.append(f"stage {i} ({s.stage}) not planned: {e}")
            out.append(None)
    return out
