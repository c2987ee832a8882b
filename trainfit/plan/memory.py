"""Per-GPU memory of a training config, by component and phase, before anything runs.

Each component is counted for the two phases of a step: `rollout` (GRPO/PPO generation) and `train`
(scoring forwards, forward/backward, optimizer step). Within the training phase the sub-step with
the highest peak is the one reported (forward/backward, optimizer step, or a no-grad scoring
forward); all sub-steps are kept in `Plan.substeps`.

Stated constants (not measured per machine):
- CUDA_CONTEXT: 512 MiB per process for the CUDA context and cuBLAS/cuDNN workspaces, which
  torch.cuda.max_memory_allocated does not see but the card does.
- FRAGMENTATION: 5% of allocated bytes that the caching allocator holds in partly used blocks.
The rollout engine's constants are in rollout.py. Model states are counted (states.py), the body's
activations traced (trace.py), the head and loss traced at their exact size (head.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Optional

from trainfit.config import Config, ConfigError, validate
from trainfit.config.stages import stage_spec
from trainfit.models.gguf import load_note
from trainfit.models.lora_rules import vlm_all_linear
from trainfit.models.shapes import arch_facts, locate, model_source
from trainfit.plan import hardware
from trainfit.plan.counts import plan_counts
from trainfit.plan.head import HeadSpec, head_memory, planned_fused_head
from trainfit.plan.lengths import Lengths, cap_lengths, caps, data_lengths
from trainfit.plan.preference import pair_work, reference_items, sequences_per_sample
from trainfit.plan.rollout import rollout_items
from trainfit.plan.screens import episode_screens, plans_screens, rollout_screens, screens_dict, screens_note
from trainfit.plan.states import DTYPE_BYTES, Parallel, States, model_states, parallel_of
from trainfit.plan.trace import TraceSpec, trace
from trainfit.plan.vision import image_settings, vision_memory
from trainfit.plan.work import work_summary

MiB, GiB = 1024 ** 2, 1024 ** 3
CUDA_CONTEXT = 512 * MiB
FRAGMENTATION = 0.05
DEFAULT_GPU = "h100-80gb"


@dataclass
class Item:
    """One component: bytes on each GPU in each phase, and in CPU RAM per GPU process."""

    name: str
    group: str          # policy | reference | reward | value | rollout | activations | overhead
    rollout: int = 0
    train: int = 0
    cpu: int = 0
    note: str = ""


@dataclass
class Phase:
    name: str
    allocated: int      # what torch.cuda.max_memory_allocated would report
    total: int          # allocated + fragmentation + CUDA context (+ the vLLM envelope, already whole)
    step: str           # the sub-step that peaks


@dataclass
class Plan:
    model: str
    stage: str
    method: str
    dtype: str
    gpu: Optional[str]
    gpu_memory: Optional[int]
    gpu_source: str
    num_gpus: int
    world: int
    params: int
    trainable_params: int
    seq_len: int
    micro_batch: int
    accumulation: int
    items: list[Item]
    phases: dict[str, Phase]
    substeps: dict[str, int]
    peak: int
    budget: Optional[int]
    margin: float
    fits: Optional[bool]
    headroom: Optional[int]
    cpu_ram: int        # per node
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    suggestions: list = field(default_factory=list)
    work: dict = field(default_factory=dict)
    prompt_len: int = 0
    lengths: dict = field(default_factory=dict)   # lengths.Lengths: measured from the data, or the caps
    # The same plan at the configured caps (max_prompt_length + max_new_tokens, max_seq_length), when the
    # data is shorter: {seq_len, prompt_len, phases {name: {allocated, total}}, peak, fits}; else None.
    worst_case: Optional[dict] = None
    # One entry per model the stage holds (counts.Count): the trained ones sum to the trainer's start line.
    counts: list = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = verdict(self)
        return d


def verdict(p: Plan) -> str:
    return "UNKNOWN" if p.fits is None else ("FITS" if p.fits else "DOES NOT FIT")


def with_gpus(cfg: Config, num_gpus: Optional[int]) -> Config:
    if num_gpus is None or num_gpus == cfg.distributed.num_gpus:
        return cfg

    raw = cfg.model_dump()
    raw["distributed"]["num_gpus"] = num_gpus
    try:
        return validate(raw)
    except ConfigError as e:
        raise ConfigError(f"With {num_gpus} GPUs per node: {e}") from None


def seq_lengths(cfg: Config) -> tuple[int, int]:
    """(prompt tokens, tokens per training sequence) at the caps (lengths.cap_lengths)."""
    return cap_lengths(cfg)


def _targets(cfg: Config, facts=None):
    t = cfg.peft.target_modules
    m = cfg.model
    if facts is not None and facts.n_vision and t == "all-linear" and not (m.freeze_vision_tower and m.freeze_projector):
        # LoRA on the unfrozen vision parts too: the trainer's regex (models.lora_targets), else
        # all-linear already means the language model only (shapes.match_targets).

        return vlm_all_linear([g.name.replace("*", "0") for g in facts.linears],
                              tower=not m.freeze_vision_tower, projector=not m.freeze_projector)
    return t if isinstance(t, str) else tuple(t)


def _frozen(cfg: Config, facts) -> tuple:
    """Parameter tensor sizes a full fine-tune keeps frozen (a VLM's vision tower and projector)."""
    out: list[int] = []
    for sizes, frozen in ((facts.tower_sizes, cfg.model.freeze_vision_tower),
                          (facts.projector_sizes, cfg.model.freeze_projector)):
        if frozen:
            out += [n for n, c in sizes for _ in range(c)]
    return tuple(out)


def plan(cfg: Config, gpu: Optional[str] = None, num_gpus: Optional[int] = None, *,
         margin: Optional[float] = None, from_data: bool = True) -> Plan:
    """The bare plan of `cfg` (plan_on without its card); trainfit.plan.plan adds the suggestions."""
    return plan_on(cfg, gpu, num_gpus, margin=margin, from_data=from_data)[0]


def plan_on(cfg: Config, gpu: Optional[str] = None, num_gpus: Optional[int] = None, *,
            margin: Optional[float] = None, from_data: bool = True) -> tuple[Plan, hardware.GPU]:
    """Plan the per-GPU memory of `cfg` on `gpu` (name, else hardware.gpu, else NVML, else H100 80GB), and
    the card it was planned on.

    Sequences are planned at the lengths the data gives (lengths.py: the run's tokenizer on its
    prompts / items; `from_data=False` or unknown data: the caps); when those are shorter than the
    caps, the plan at the caps is attached as `worst_case`."""
    cfg = with_gpus(cfg, num_gpus)
    try:
        card, how = hardware.resolve_gpu(gpu, cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    notes: list[str] = []
    if card is None:
        card, how = hardware.find_gpu(DEFAULT_GPU), "assumed"
        notes.append(f"No GPU given or detected: planned for {card.name}; pass --gpu NAME.")
    margin = cfg.hardware.memory_margin if margin is None else margin
    lens = data_lengths(cfg) if from_data else caps(cfg)
    p = _build(cfg, card, how, list(notes), margin, lens)
    if (lens.prompt, lens.seq) != (lens.cap_prompt, lens.cap_seq):
        w = _build(cfg, card, how, list(notes), margin, caps(cfg))
        p.worst_case = {"seq_len": w.seq_len, "prompt_len": w.prompt_len, "peak": w.peak, "fits": w.fits,
                        "phases": {k: {"allocated": v.allocated, "total": v.total} for k, v in w.phases.items()}}
        p.notes.append(f"Worst case at the caps ({_caps_text(cfg, w)}): peak {w.peak / GiB:.2f} GiB"
                       + ("" if w.fits is None else f", {'fits' if w.fits else 'does NOT fit'} the budget") + ".")
    return p, card


def _caps_text(cfg: Config, w: Plan) -> str:
    if stage_spec(cfg.stage).rollout:
        return (f"prompts of rollout.max_prompt_length={cfg.rollout.max_prompt_length} + max_new_tokens, "
                f"{w.seq_len} tokens a sequence")
    return f"data.max_seq_length={w.seq_len} tokens a sequence"


def _build(cfg: Config, card: hardware.GPU, how: str, notes: list[str], margin: float, lens: Lengths) -> Plan:
    m, pe, t = cfg.model, cfg.peft, cfg.train
    src = model_source(m)  # config_overrides applied, as the trainer builds it
    facts = arch_facts(src)
    bp, par, b = cfg.batch_plan(), parallel_of(cfg), DTYPE_BYTES[m.dtype]
    stage = stage_spec(cfg.stage)
    rl = stage.rollout
    prompt, seq = lens.prompt, lens.seq
    if lens.note:
        notes.append(lens.note)
    if src.gguf:  # the file's quantized tensors are dequantized on load: planned in model.dtype (models/gguf.py)
        notes.append(load_note(src.gguf, m.dtype, b, m.quantization))
    mb, accum = t.micro_batch_size, bp.accumulation
    # rm and dpo put the chosen and rejected sides of the micro-batch's pairs through one forward
    # (KTO's unpaired rows: one sequence a sample).
    mb = sequences_per_sample(cfg) * mb
    row_seq = seq  # tokens per training sequence (what Plan.seq_len and the FLOP count see)
    if stage.packs and cfg.data.packing:
        # train/packing.py: a micro-batch is one row of its sequences back to back (block-diagonal mask
        # with sdpa / eager, varlen with flash-attention), planned with every sequence at the data's longest.
        notes.append(f"data.packing: each micro-batch is one packed row of up to {mb} x {seq} = {mb * seq} tokens.")
        seq, mb = mb * seq, 1
    full = pe.method == "none"
    trainable = "full" if full else "adapters"
    common = dict(peft=pe.method, r=pe.r, targets=_targets(cfg, facts), optimizer=t.optimizer, par=par,
                  quantization=m.quantization, double_quant=m.bnb_4bit_double_quant)
    rm = stage.saves == "reward_model"  # a reward model: a scalar head for the LM head, both sides of a pair per forward
    pol = model_states(facts, dtype=m.dtype, trainable=trainable, **common, frozen=_frozen(cfg, facts),
                       **(dict(head_params=facts.hidden, drop_lm_head=True) if rm else {}))
    items: list[Item] = []
    tag = {"none": "", "4bit": f" + {m.bnb_4bit_quant_type.upper()} base", "8bit": " + int8 base"}[m.quantization]
    method = ("full" if full else f"{pe.method} r={pe.r}") + tag
    wdesc = {"4bit": f"{m.bnb_4bit_quant_type.upper()}{' double-quant' if m.bnb_4bit_double_quant else ''}",
             "8bit": "int8"}.get(m.quantization, m.dtype)
    _states_items(items, "policy", pol, f"policy weights ({wdesc})", rl, accum, par)
    if rl and pol.rollout_gather:  # GRPOStage.prepare gathers for any engine (weights pushed whole)
        items.append(Item("ZeRO-3 weights gathered whole for generation", "policy", rollout=pol.rollout_gather,
                          note="every rank's missing partitions (and offloaded ones), freed before training"))
    spec = TraceSpec(m.dtype, m.attn_implementation, pe.method, pe.r, pe.alpha, _targets(cfg, facts),
                     padded=stage.data != "text", quantization=m.quantization,
                     double_quant=m.bnb_4bit_double_quant, device="cpu" if cfg.train.device == "cpu" else "cuda",
                     adapter_compute=pe.adapter_compute)
    # A quantized base has its LM head and final norm in fp32 (models.kbit_upcast): fp32 hidden, logits.
    head_dtype = "fp32" if m.quantization != "none" else m.dtype
    n_ckpt = m.checkpointed_layers(facts.n_layers)  # the first n_ckpt layers (models.enable_checkpointing)
    modes = tuple(md for md, n in (("ckpt", n_ckpt), ("train", facts.n_layers - n_ckpt)) if n)
    mode = modes[0]   # the mode of layer 0, which backward reaches last
    tr = trace(src, spec, modes=(*modes, "nograd"))
    notes += tr.notes
    chunk = int(getattr(t, "logits_chunk_rows", 0) or 0)
    # Policy tokens per row: every turn's completion (multi-turn episodes interleave environment tokens).
    new_tokens = min(cfg.rollout.max_new_tokens * cfg.rollout.max_turns, seq - 1) if rl else 0
    # dpo: the head runs at the answer positions only, planned as every position but the first (the bound).
    rows = stage.reference == "preference"
    if rows:
        new_tokens = seq - 1

    def body(trc, layers: int, batch: int = mb) -> tuple[int, int]:
        """(activations live at the end of forward, peak above that during backward) of a body whose
        first k = checkpointed_layers(layers) layers are checkpointed. Backward runs the L-k full layers
        first (each with the full layer's transient) and frees their activations before it recomputes
        the checkpointed ones, so the recompute's transient sits on k checkpointed layers only."""
        k = m.checkpointed_layers(layers)
        at = lambda q: trc.at(q, seq, batch)  # noqa: E731
        if k in (0, layers):
            md = "ckpt" if k else "train"
            return int(at(f"{md}_layer") * layers + at(f"{md}_other")), int(at(f"{md}_transient"))
        end = at("ckpt_layer") * k + at("train_layer") * (layers - k) + at("train_other")
        ckpt_end = at("ckpt_layer") * k + at("ckpt_other")
        return int(end), int(max(at("train_transient"), ckpt_end + at("ckpt_transient") - end))

    fused = planned_fused_head(cfg)   # train.fused_head: no [n, V] logits (plan/head.py)

    def head(kind: str, **kw) -> dict:
        # trainfit's GRPO and PPO run the LM head at the policy positions only (models/logprobs.py).
        return head_memory(HeadSpec(kind, facts.vocab, facts.hidden, head_dtype, mb, seq, new_tokens, chunk,
                                    stage.loss_kl_coef(cfg), cfg.rollout.temperature,
                                    cfg.grpo.loss_type, policy_rows=rl or rows, fused=fused, **kw))

    # Training sub-steps: bytes above the resident states.
    substeps: dict[str, list[Item]] = {}
    a_body, a_trans = body(tr, facts.n_layers)  # transient: with a k-bit base, its dequantized weights too
    hm = head("grpo" if rl or rows else "value" if rm else "sft", head_trainable=full)
    ck = {0: "", facts.n_layers: ", checkpointed"}.get(n_ckpt, f", first {n_ckpt} checkpointed")
    fb = [Item(f"activations ({facts.n_layers} layers{ck}, "
               f"micro {mb} x {seq} tokens)", "activations", train=a_body, note="traced, saved for backward")]
    if hm["peak"] >= a_trans:
        fb.append(Item("logits + loss peak", "activations", train=hm["peak"],
                       note=(f"LM head fused with the log-probs ({fused}): hidden rows kept, one chunk "
                             f"of rows x {facts.vocab} logits at a time" if fused != "off" and not rm
                             else (f"[{mb} x {new_tokens}, {facts.vocab}] logits at the policy tokens"
                                   if rl or rows else f"[{mb}, {seq}, 1] reward-head outputs" if rm
                                   else f"[{mb}, {seq}, {facts.vocab}] logits")
                             + ("" if rm else f", fp32 log-probs{', chunked' if chunk else ''}"))))
    else:
        fb.append(Item("layer backward transient", "activations", train=a_trans, note="traced"))
    # RL: a task's prompt images reach the training forwards too (data/image_examples.image_inputs);
    # an environment's screenshots: the ones an episode keeps (plan/screens.py), their tokens are
    # in the episode's sequence (Config.episode_tokens), their patches through the tower here.
    with_images = stage.data in ("text", "sft") or (rl and bool(cfg.task.name) and cfg.env.type == "none")
    screens = episode_screens(cfg, image_settings(m, src)) if plans_screens(cfg, facts) else None
    vis = (vision_memory(cfg, src, mb, ([screens.patches] * screens.kept, "")) if screens
           else vision_memory(cfg, src, mb) if facts.n_vision and with_images else None)
    if vis and screens:
        fb.append(Item(f"vision tower activations ({screens.kept} screenshots a sequence x {screens.tokens} "
                       f"image tokens per screenshot, micro {mb})", "activations", train=vis["end"],
                       note="traced; outputs + what trained vision parts save"))
        notes.append(screens_note(screens, vis["settings"]))
    elif vis:  # the images' patches through the vision tower (plan/vision.py)
        fb.append(Item(f"vision tower activations ({len(vis['patches'])} image(s) a sequence, "
                       f"{sum(vis['patches']) // vis['settings'].merge_size ** 2} image tokens)", "activations",
                       train=vis["end"], note="traced; outputs + what trained vision parts save"))
        notes.append(vis["note"])
    fb_forward = list(fb)  # before gradients: PPO adds the critic's activations to these
    if accum == 1:
        # Gradients appear during backward while activations are freed: the peak is at its start (with
        # the output head's gradient) or at its end (all gradients, little activation left).
        head_grad = min((facts.n_lm_head or facts.n_embed) * b if full else pol.grads, pol.grads)
        end = pol.grads + int(tr.at(f"{mode}_other", seq, mb))
        if end > sum(i.train for i in fb) + head_grad:
            fb = [Item("policy gradients (end of backward)", "policy", train=pol.grads),
                  Item("activations outside the layers", "activations", train=end - pol.grads)]
        elif head_grad:
            fb.append(Item("policy gradients (output head, start of backward)", "policy", train=head_grad))
    if pol.gathered:
        fb.append(Item("ZeRO-3 gathered layers", "policy", train=pol.gathered))
    substeps["policy forward/backward"] = fb
    opt = [Item("optimizer-step temporaries", "policy", train=pol.step_temp,
                note="fp32 gradient partition" if par.engine == "deepspeed" and par.zero_stage in (1, 2)
                else "foreach sqrt of exp_avg_sq" if pol.step_temp else "fused AdamW: none")]
    if accum == 1:
        opt.append(Item("policy gradients", "policy", train=pol.grads))
    substeps["optimizer step"] = opt
    # No-grad scoring forwards of one micro-batch: body, then the head's log-probs.
    lp = head("logprobs")
    score_fwd = max(int(tr.at("nograd_peak", seq, mb)), mb * seq * facts.hidden * DTYPE_BYTES[head_dtype] + lp["peak"])
    ref_copy = False
    rf = vf = None  # the reward model's and the critic's architecture, when the stage holds them
    if stage.reference == "preference":
        ref_copy = reference_items(cfg, facts, Item, items, substeps, notes, score_fwd, mb, lens.rows)
    elif stage.kl_reference(cfg):
        if full:
            # The stage deep-copies the policy before FSDP / DeepSpeed wrap it: the copy is whole on
            # every rank, never sharded (grpo.py, ppo.py).
            ref = model_states(facts, dtype=m.dtype, trainable="none", par=Parallel())
            ref_copy = True
            items.append(Item(f"reference policy (frozen copy, {m.dtype})", "reference", rollout=ref.weights,
                              train=ref.weights, cpu=ref.cpu))
        else:
            notes.append("Reference policy = the base with adapters disabled: no extra weights.")
        substeps["reference forward"] = [Item(f"reference forward (no grad, micro {mb})", "reference", train=score_fwd)]
    if stage.old_logprobs(cfg):
        substeps["old log-probs forward"] = [Item("old log-probs forward (no grad)", "policy", train=score_fwd)]
    if rl and cfg.rl_models.reward_model:
        # stage:rm = a pipeline's own reward model, trained from the policy: the policy's architecture.
        rsrc = src if cfg.rl_models.reward_model == "stage:rm" else locate(cfg.rl_models.reward_model)
        rf, rd = arch_facts(rsrc), cfg.rl_models.reward_dtype
        rs = model_states(rf, dtype=rd, trainable="none", par=par, head_params=rf.hidden, drop_lm_head=True)
        items.append(Item(f"reward model ({rf.n_params / 1e9:.1f}B {rd})", "reward", rollout=rs.weights,
                          train=rs.weights, cpu=rs.cpu))
        rtr = trace(rsrc, TraceSpec(rd, m.attn_implementation, padded=True), modes=("nograd",))
        substeps["reward forward"] = [Item("reward forward (no grad)", "reward",
                                           train=int(rtr.at("nograd_peak", seq, mb)))]
    if rl and cfg.env.type == "simulated_user":
        if cfg.env.user_model:  # a separate frozen model plays the user (kept resident in both phases)
            uf = arch_facts(locate(cfg.env.user_model))
            us = model_states(uf, dtype=m.dtype, trainable="none", par=par)
            items.append(Item(f"simulated-user model ({uf.n_params / 1e9:.1f}B {m.dtype}, frozen)", "reward",
                              rollout=us.weights, train=us.weights, cpu=us.cpu))
        else:
            notes.append("Simulated user = the policy's own weights with adapters disabled: no extra weights.")
    val: Optional[States] = None
    if stage.critic:
        vsrc = locate(cfg.rl_models.value_model) if cfg.rl_models.value_model else src
        vf = arch_facts(vsrc)
        val = model_states(vf, dtype=m.dtype, trainable=trainable, head_params=vf.hidden, drop_lm_head=True, **common)
        vname = f"value model weights ({wdesc})"
        if cfg.ppo_shared_base():  # value_model.shared_backbone: the policy's base, only adapters + head added
            # (ZeRO-3 partitioning of the head is ignored: [1, hidden].) Its base is the policy's, gathered
            # once for the rollout; the critic's own gather is its adapters' missing partitions.
            gather = val.adapters * (par.world - 1) if val.rollout_gather else 0
            val = dataclasses.replace(val, weights=val.adapters + vf.hidden * b if val.weights else 0,
                                      rollout_gather=gather)
            vname = "value head (the critic shares the policy's base)"
            notes.append("Critic = the policy's frozen base with its own adapters and value head "
                         "(ppo.shared_base): no second copy of the base.")
        _states_items(items, "value", val, vname, rl, accum, par)
        if val.rollout_gather:  # PPOStage.prepare gathers the whole PolicyCritic (values are scored there)
            items.append(Item("ZeRO-3 critic weights gathered whole for the rollout", "value",
                              rollout=val.rollout_gather, note="freed before training"))
        vm = tuple(md for md, n in (("ckpt", m.checkpointed_layers(vf.n_layers)),
                                     ("train", vf.n_layers - m.checkpointed_layers(vf.n_layers))) if n)
        vtr = tr if vsrc is src else trace(vsrc, spec, modes=vm)
        v_end, v_trans = body(vtr, vf.n_layers)
        # The critic's layer transient or value head adds only where it exceeds the policy's head/transient.
        v_act = v_end + max(0, max(v_trans, head("value")["peak"]) - fb_forward[1].train)
        if cfg.ppo.entropy_coef > 0:  # PPOStage.loss: a differentiable fp32 log-softmax and its exp, [n, V] each
            fb_forward.append(Item("entropy bonus (log-softmax + exp saved)", "activations",
                                   train=2 * mb * new_tokens * facts.vocab * 4))
        substeps.pop("policy forward/backward")
        substeps["policy + value forward/backward"] = _ppo_backward(
            Item, fb_forward, v_act, pol, val, accum,
            min((facts.n_lm_head or facts.n_embed) * b, pol.grads) if full else 0,  # a frozen head has none
            int(tr.at(f"{mode}_other", seq, mb)), int(tr.at(f"{mode}_transient", seq, mb)))
        opt += [Item("value optimizer-step temporaries", "value", train=val.step_temp),
                Item("value gradients", "value", train=val.grads if accum == 1 else 0)]
    problems: list[str] = []
    if rl:
        rollout_items(Item, items, cfg, facts, tr, card, prompt, seq, bp, notes, problems)
    if screens:  # the episode's token budget; each engine's share for the screenshots
        rollout_screens(Item, items, cfg, src, facts, screens, bp, notes, problems)
    totals = {k: sum(i.train for i in v) for k, v in substeps.items()}
    step_name = max(totals, key=totals.get)
    items += [i for i in substeps[step_name] if i.train]
    phases, overhead = {}, {}
    for ph in (("rollout", "train") if rl else ("train",)):
        alloc = sum(getattr(i, ph) for i in items if i.group != "engine")
        envelope = sum(getattr(i, ph) for i in items if i.group == "engine")  # vLLM's budget is whole already
        overhead[ph] = int(alloc * FRAGMENTATION) + CUDA_CONTEXT
        phases[ph] = Phase(ph, alloc, alloc + envelope + overhead[ph], step_name if ph == "train" else
                           {"hf": "HF generate", "vllm": "vLLM generation", "openai": "remote"}[cfg.rollout.engine])
    items.append(Item("CUDA context + allocator fragmentation", "overhead", **overhead,
                      note=f"{CUDA_CONTEXT // MiB} MiB context + {FRAGMENTATION:.0%} of allocated"))
    peak = max(ph.total for ph in phases.values())
    budget = int(card.memory * (1 - margin))
    if ref_copy and par.zero_stage == 3:
        notes.append("Frozen models are partitioned by ZeRO-3 like the policy.")
    if card.detected and card.free is not None and card.free < peak:
        notes.append(f"Only {card.free / 2**30:.1f} GiB of the card is free now (other processes).")
    return Plan(model=m.name, stage=cfg.stage, method=method, dtype=m.dtype, gpu=card.name, gpu_memory=card.memory,
                gpu_source=how, num_gpus=cfg.distributed.num_gpus, world=cfg.world_size, params=facts.n_params,
                trainable_params=pol.trainable_params, seq_len=row_seq, micro_batch=t.micro_batch_size, accumulation=accum,
                items=[i for i in items if i.rollout or i.train or i.cpu], phases=phases, substeps=totals,
                peak=peak, budget=budget, margin=margin, fits=peak <= budget and not problems,
                headroom=budget - peak, cpu_ram=sum(i.cpu for i in items) * cfg.distributed.num_gpus,
                problems=problems, notes=notes,
                work=_work(cfg, facts, pol, bp, prompt, row_seq, par, val is not None),
                prompt_len=prompt, lengths=lens.to_dict() | ({"screens": screens_dict(screens)} if screens else {}), counts=plan_counts(cfg, facts, pol, ref_copy, vf, val, rf))


def _work(cfg, facts, pol, bp, prompt: int, seq: int, par, has_value: bool) -> dict:
    w = work_summary(cfg, facts, pol, bp, prompt, seq, par, has_value)
    return pair_work(cfg, w, facts, bp, seq) if stage_spec(cfg.stage).reference == "preference" else w


def _ppo_backward(Item, fb: list, v_act: int, pol: States, val: States, accum: int, head_grad: int,
                  other: int, trans: int) -> list:
    """The micro-step of value_model.PolicyCritic: one forward runs the policy and the critic on the
    same micro-batch and one loss backs through both, so the critic's activations `v_act` are alive
    with the policy's (`fb`: the policy's activations and head/loss peak). Autograd runs the policy
    head's backward first, then the critic's body (its gradients appear, its activations go), then
    the policy's body. With accumulation the gradients are resident items; without, the peak is at
    the start (policy head gradient), after the critic (its gradients + the policy's activations and
    a layer transient) or at the end (all gradients)."""
    both = [*fb, Item("value activations (same micro-step as the policy)", "value", train=v_act)]
    if pol.gathered or val.gathered:
        both.append(Item("ZeRO-3 gathered layers", "value", train=max(pol.gathered, val.gathered)))
    if accum > 1:
        return both
    p_act = fb[0].train
    options = [
        [*both, Item("policy gradients (output head, start of backward)", "policy", train=head_grad)],
        [Item("policy activations (critic backward done)", "activations", train=p_act + trans),
         Item("value gradients", "value", train=val.grads),
         Item("policy gradients (output head)", "policy", train=head_grad)],
        [Item("policy + value gradients (end of backward)", "policy", train=pol.grads + val.grads),
         Item("activations outside the layers", "activations", train=other)]]
    return max(options, key=lambda items: sum(i.train for i in items))


def _states_items(items: list[Item], group: str, st: States, weights_name: str, rl: bool, accum: int, par) -> None:
    """Resident states: present in both phases (gradients only while accumulating)."""
    both = lambda v: dict(rollout=v if rl else 0, train=v)  # noqa: E731
    base = st.weights - st.adapters
    items.append(Item(weights_name, group, **both(base), cpu=st.cpu if par.offload_params else 0))
    if st.adapters:
        items.append(Item(f"{group} adapters (fp32)", group, **both(st.adapters)))
    if accum > 1 and st.grads:
        items.append(Item(f"{group} gradients (accumulating over {accum} micro-steps)", group, train=st.grads))
    items.append(Item(f"{group} optimizer state", group, **both(st.optimizer),
                      cpu=st.cpu - (st.cpu if par.offload_params else 0)))
    items.append(Item(f"{group} fp32 master weights", group, **both(st.master)))
    items.append(Item(f"{group} communication buckets", group, train=st.comm_buffers))


