"""The components of a plan, one function each, over one `Build` (what every component reads): the policy's
resident states, the forward/backward of a micro-batch (body, head, vision tower, gradients), the optimizer
step, the frozen models that score a rollout (reference, reward model, simulated user) and PPO's critic.
memory.py assembles them into phases; each function appends the Items and sub-steps it accounts for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from trainfit.config import Config
from trainfit.config.stages import StageSpec, stage_spec
from trainfit.models.gguf import load_note
from trainfit.models.lora_rules import vlm_all_linear
from trainfit.models.shapes import arch_facts, locate, model_source
from trainfit.plan.counts import count_text, loaded_params
from trainfit.plan.frozen import frozen_notes, frozen_states, gathered_items
from trainfit.plan.head import HeadSpec, head_memory, planned_fused_head
from trainfit.plan.items import Item
from trainfit.plan.lengths import Lengths, mean_sequence, packed_tokens
from trainfit.plan.preference import reference_items, sequences_per_sample
from trainfit.plan.screens import episode_screens, plans_screens, rows_per_episode, screens_note
from trainfit.plan.states import DTYPE_BYTES, States, model_states, parallel_of
from trainfit.plan.trace import TraceSpec, trace
from trainfit.plan.vision import image_settings, vision_memory


@dataclass
class Build:
    """What the components of one plan read: the config, the architecture, the batch and the lengths."""

    cfg: Config
    lens: Lengths
    notes: list[str]
    src: Any = None                 # models.shapes.ModelSource (config_overrides applied, as the trainer builds it)
    facts: Any = None               # models.shapes.ArchFacts
    stage: Optional[StageSpec] = None
    bp: Any = None                  # config BatchPlan
    par: Any = None                 # states.Parallel
    mb: int = 0                     # sequences per forward (pairs: both sides; packing: one row)
    seq: int = 0                    # tokens per forward row
    row_seq: int = 0                # tokens per training sequence (what Plan.seq_len sees)
    work_seq: float = 0.0           # tokens a training sequence costs (the FLOP count): padded, row_seq;
                                    # train.padding_free, its real tokens on average (lengths.mean_sequence)
    padded: tuple = ()              # (sequences, tokens) of a micro-batch padded: forwards that never pack
    new_tokens: int = 0             # policy tokens per row scored by the head
    head_dtype: str = "bf16"
    chunk: int = 0                  # train.logits_chunk_rows
    fused: str = "off"              # train.fused_head as the trainer resolves it
    tr: Any = None                  # the policy body's trace
    spec: Any = None                # its TraceSpec
    mode: str = "train"             # the mode of layer 0, which backward reaches last
    common: dict = field(default_factory=dict)
    substeps: dict = field(default_factory=dict)

    @property
    def rl(self) -> bool:
        return self.stage.rollout

    @property
    def full(self) -> bool:
        return self.cfg.peft.method == "none"

    @property
    def rm(self) -> bool:           # a reward model: a scalar head for the LM head, both sides of a pair per forward
        return self.stage.saves == "reward_model"

    @property
    def micro_steps(self) -> int:
        """Micro-batches whose gradients add up in a step: the accumulation, or at least 2 when the image
        budget drops screenshots mid-episode (an episode then trains as several rows, envs/episodes.py,
        so a step's rows overflow one micro-batch and its gradients stay resident between them)."""
        if rows_per_episode(self.cfg, self.facts) > 1:
            return max(self.bp.accumulation, 2)
        return self.bp.accumulation

    @property
    def rows(self) -> bool:         # dpo: the head runs at the answer positions only
        return self.stage.reference == "preference"

    def body(self, trc, layers: int) -> tuple[int, int]:
        """(activations live at the end of forward, peak above that during backward) of a body whose
        first k = checkpointed_layers(layers) layers are checkpointed. Backward runs the L-k full layers
        first (each with the full layer's transient) and frees their activations before it recomputes
        the checkpointed ones, so the recompute's transient sits on k checkpointed layers only."""
        k = self.cfg.model.checkpointed_layers(layers)
        at = lambda q: trc.at(q, self.seq, self.mb)  # noqa: E731
        if k in (0, layers):
            md = "ckpt" if k else "train"
            return int(at(f"{md}_layer") * layers + at(f"{md}_other")), int(at(f"{md}_transient"))
        end = at("ckpt_layer") * k + at("train_layer") * (layers - k) + at("train_other")
        ckpt_end = at("ckpt_layer") * k + at("ckpt_other")
        return int(end), int(max(at("train_transient"), ckpt_end + at("ckpt_transient") - end))

    def head(self, kind: str, **kw) -> dict:
        # trainfit's GRPO and PPO run the LM head at the policy positions only (models/logprobs.py).
        c, f = self.cfg, self.facts
        return head_memory(HeadSpec(kind, f.vocab, f.hidden, self.head_dtype, self.mb, self.seq, self.new_tokens,
                                    self.chunk, self.stage.loss_kl_coef(c), c.rollout.temperature,
                                    c.grpo.loss_type, policy_rows=self.rl or self.rows, fused=self.fused, **kw))


def start(cfg: Config, notes: list[str], lens: Lengths) -> Build:
    """The architecture, the batch, the lengths and the policy body's trace."""
    m, pe, t = cfg.model, cfg.peft, cfg.train
    c = Build(cfg, lens, notes, src=model_source(m), stage=stage_spec(cfg.stage), bp=cfg.batch_plan(),
              par=parallel_of(cfg))
    c.facts = arch_facts(c.src)
    if lens.note:
        notes.append(lens.note)
    if c.src.gguf:  # the file's quantized tensors are dequantized on load: planned in model.dtype (models/gguf.py)
        notes.append(load_note(c.src.gguf, m.dtype, DTYPE_BYTES[m.dtype], m.quantization))
    # rm and dpo put the chosen and rejected sides of the micro-batch's pairs through one forward
    # (KTO's unpaired rows: one sequence a sample).
    c.mb, c.seq = sequences_per_sample(cfg) * t.micro_batch_size, lens.seq
    c.row_seq, c.work_seq, c.padded = c.seq, float(c.seq), (c.mb, c.seq)
    packed_rl = cfg.padding_free(vision=bool(c.facts.n_vision))   # as train/stage.padding_free resolves it
    if packed_rl:
        # models/logprobs.ForwardBatch: a micro-batch is one row of its sequences' real tokens (the
        # training, reference, old-log-prob and critic forwards); at most the longest rows the data has.
        tokens = packed_tokens(cfg, lens, t.micro_batch_size, sequences_per_sample(cfg))
        c.work_seq = mean_sequence(cfg, lens)
        notes.append(f"train.padding_free: each micro-batch is one packed row of its real tokens, at most {tokens:,} "
                     f"(padded: {c.mb} x {c.seq} = {c.mb * c.seq:,}); about {c.work_seq:.0f} tokens a sequence.")
    if c.stage.packs and cfg.data.packing:
        # train/packing.py: a micro-batch is one row of its sequences back to back (block-diagonal mask
        # with sdpa / eager, varlen with flash-attention), planned with every sequence at the data's longest.
        notes.append(f"data.packing: each micro-batch is one packed row of up to {c.mb} x {c.seq} = "
                     f"{c.mb * c.seq} tokens.")
        c.seq, c.mb = c.mb * c.seq, 1
    c.common = dict(peft=pe.method, r=pe.r, targets=targets(cfg, c.facts), optimizer=t.optimizer, par=c.par,
                    quantization=m.quantization, double_quant=m.bnb_4bit_double_quant)
    # A packed row has no padding mask: flash-attention's varlen kernels take none (traced as SDPA's fused
    # kernel without one); sdpa / eager get transformers' block-diagonal [N, N] mask (traced as a mask).
    varlen = packed_rl and m.attn_implementation.startswith("flash_attention")
    c.spec = TraceSpec(m.dtype, m.attn_implementation, pe.method, pe.r, pe.alpha, targets(cfg, c.facts),
                       padded=c.stage.data != "text" and not varlen, quantization=m.quantization,
                       double_quant=m.bnb_4bit_double_quant, device="cpu" if t.device == "cpu" else "cuda",
                       adapter_compute=pe.adapter_compute)
    # A quantized base has its LM head and final norm in fp32 (models.kbit.kbit_upcast): fp32 hidden, logits.
    c.head_dtype = "fp32" if m.quantization != "none" else m.dtype
    n_ckpt = m.checkpointed_layers(c.facts.n_layers)  # the first n_ckpt layers (models.enable_checkpointing)
    modes = tuple(md for md, n in (("ckpt", n_ckpt), ("train", c.facts.n_layers - n_ckpt)) if n)
    c.mode = modes[0]
    c.tr = trace(c.src, c.spec, modes=(*modes, "nograd"))
    notes += c.tr.notes
    c.chunk = int(getattr(t, "logits_chunk_rows", 0) or 0)
    # Policy tokens per row: every turn's completion (multi-turn episodes interleave environment tokens);
    # dpo: the head at the answer positions, planned as every position but the first (the bound).
    c.new_tokens = min(cfg.rollout.max_new_tokens * cfg.rollout.max_turns, c.seq - 1) if c.rl else 0
    if packed_rl:   # one row: its policy tokens are every sequence's
        c.new_tokens *= c.mb
        c.seq, c.mb = tokens, 1
    if c.rows:
        c.new_tokens = c.seq - 1
    c.fused = planned_fused_head(cfg)   # train.fused_head: no [n, V] logits (plan/head.py)
    return c


def policy_states(c: Build, items: list[Item]) -> tuple[States, str]:
    """The policy's resident states; returns them and the weights' description (e.g. NF4 double-quant)."""
    m = c.cfg.model
    pol = model_states(c.facts, dtype=m.dtype, trainable="full" if c.full else "adapters", **c.common,
                       frozen=frozen(c.cfg, c.facts),
                       **(dict(head_params=c.facts.hidden, drop_lm_head=True) if c.rm else {}))
    wdesc = {"4bit": f"{m.bnb_4bit_quant_type.upper()}{' double-quant' if m.bnb_4bit_double_quant else ''}",
             "8bit": "int8"}.get(m.quantization, m.dtype)
    states_items(items, "policy", pol, f"policy weights ({wdesc})", c.rl, c.micro_steps)
    if c.rl and pol.rollout_gather:  # the hf engine generates with the module: gathered whole (Config.rollout_gathers_whole)
        items.append(Item("ZeRO-3 weights gathered whole for generation", "policy", rollout=pol.rollout_gather,
                          note="every rank's missing partitions (and offloaded ones), freed before training"))
    elif c.rl and pol.rollout_sync:   # an engine with its own copy: the sync streams the partitions
        items.append(Item("ZeRO-3 weight sync (one tensor gathered at a time)", "policy", rollout=pol.rollout_sync,
                          note="the largest tensor gathered + the copy the engine loads"
                               + (", the adapters whole" if not c.full else "")))
    return pol, wdesc


def forward_backward(c: Build, pol: States) -> tuple[list[Item], list[Item], Any]:
    """The policy's forward/backward of one micro-batch: (its items, the items before gradients, for
    PPO's critic; the episode screenshots planned, or None)."""
    cfg, facts, mb, seq, b = c.cfg, c.facts, c.mb, c.seq, DTYPE_BYTES[c.cfg.model.dtype]
    a_body, a_trans = c.body(c.tr, facts.n_layers)  # transient: with a k-bit base, its dequantized weights too
    hm = c.head("grpo" if c.rl or c.rows else "value" if c.rm else "sft", head_trainable=c.full)
    n_ckpt = cfg.model.checkpointed_layers(facts.n_layers)
    ck = {0: "", facts.n_layers: ", checkpointed"}.get(n_ckpt, f", first {n_ckpt} checkpointed")
    fb = [Item(f"activations ({facts.n_layers} layers{ck}, "
               f"micro {mb} x {seq} tokens)", "activations", train=a_body, note="traced, saved for backward")]
    if hm["peak"] >= a_trans:
        fb.append(Item("logits + loss peak", "activations", train=hm["peak"],
                       note=(f"LM head fused with the log-probs ({c.fused}): hidden rows kept, one chunk "
                             f"of rows x {facts.vocab} logits at a time" if c.fused != "off" and not c.rm
                             else (f"[{mb} x {c.new_tokens}, {facts.vocab}] logits at the policy tokens"
                                   if c.rl or c.rows else f"[{mb}, {seq}, 1] reward-head outputs" if c.rm
                                   else f"[{mb}, {seq}, {facts.vocab}] logits")
                             + ("" if c.rm else f", fp32 log-probs{', chunked' if c.chunk else ''}"))))
    else:
        fb.append(Item("layer backward transient", "activations", train=a_trans, note="traced"))
    screens = _vision_items(c, fb)
    fb_forward = list(fb)  # before gradients: PPO adds the critic's activations to these
    if c.micro_steps == 1:
        # Gradients appear during backward while activations are freed: the peak is at its start (with
        # the output head's gradient) or at its end (all gradients, little activation left).
        head_grad = min((facts.n_lm_head or facts.n_embed) * b if c.full else pol.grads, pol.grads)
        end = pol.grads + int(c.tr.at(f"{c.mode}_other", seq, mb))
        if end > sum(i.train for i in fb) + head_grad:
            fb = [Item("policy gradients (end of backward)", "policy", train=pol.grads),
                  Item("activations outside the layers", "activations", train=end - pol.grads)]
        elif head_grad:
            fb.append(Item("policy gradients (output head, start of backward)", "policy", train=head_grad))
    if pol.gathered:
        fb.append(Item(f"{c.par.sharding} gathered layers", "policy", train=pol.gathered,
                       note="the layer computed + the prefetched one, all-gathered whole"))
    return fb, fb_forward, screens


def _vision_items(c: Build, fb: list[Item]):
    """The vision tower's activations: a task's prompt images reach the training forwards too
    (data/image_examples.image_inputs); an environment's screenshots, the ones an episode keeps
    (plan/screens.py), their tokens in the episode's sequence (Config.episode_tokens), their patches
    through the tower here. Returns the screenshots planned, or None."""
    cfg, m, mb = c.cfg, c.cfg.model, c.mb
    with_images = c.stage.data in ("text", "sft") or (c.rl and bool(cfg.task.name) and cfg.env.type == "none")
    screens = episode_screens(cfg, image_settings(m, c.src)) if plans_screens(cfg, c.facts) else None
    vis = (vision_memory(cfg, c.src, mb, ([screens.patches] * screens.kept, "")) if screens
           else vision_memory(cfg, c.src, mb) if c.facts.n_vision and with_images else None)
    if vis and screens:
        fb.append(Item(f"vision tower activations ({screens.kept} screenshots a sequence x {screens.tokens} "
                       f"image tokens per screenshot, micro {mb})", "activations", train=vis["end"],
                       note="traced; outputs + what trained vision parts save"))
        c.notes.append(screens_note(screens, vis["settings"]))
    elif vis:  # the images' patches through the vision tower (plan/vision.py)
        fb.append(Item(f"vision tower activations ({len(vis['patches'])} image(s) a sequence, "
                       f"{sum(vis['patches']) // vis['settings'].merge_size ** 2} image tokens)", "activations",
                       train=vis["end"], note="traced; outputs + what trained vision parts save"))
        c.notes.append(vis["note"])
    return screens


def optimizer_step(c: Build, pol: States) -> list[Item]:
    par = c.par
    opt = [Item("optimizer-step temporaries", "policy", train=pol.step_temp,
                note="fp32 gradient partition" if par.engine == "deepspeed" and par.zero_stage in (1, 2)
                else "foreach sqrt of exp_avg_sq" if pol.step_temp else "fused AdamW: none")]
    if c.micro_steps == 1:
        opt.append(Item("policy gradients", "policy", train=pol.grads))
    return opt


def scoring_models(c: Build, items: list[Item]) -> tuple[bool, Any]:
    """The frozen models a step scores with and their no-grad forwards: a reference (a whole copy or the
    base with adapters off), the rollout's old log-probs, a reward model, a simulated user. Returns
    (whether a reference copy is resident, the reward model's architecture or None)."""
    cfg, m, mb, seq, notes = c.cfg, c.cfg.model, c.mb, c.seq, c.notes
    # No-grad scoring forwards of one micro-batch: body, then the head's log-probs.
    lp = c.head("logprobs")
    score_fwd = max(int(c.tr.at("nograd_peak", seq, mb)),
                    mb * seq * c.facts.hidden * DTYPE_BYTES[c.head_dtype] + lp["peak"])
    ref_copy, rf = False, None
    if c.stage.reference == "preference":
        ref_copy = reference_items(cfg, c.facts, Item, items, c.substeps, notes, score_fwd, mb, c.lens.rows)
    elif c.stage.kl_reference(cfg):
        ref_fwd = [Item(f"reference forward (no grad, micro {mb})", "reference", train=score_fwd)]
        if c.full:
            # The stage deep-copies the policy before FSDP / DeepSpeed wrap it (grpo.py, ppo.py).
            ref = frozen_states(cfg, c.par, c.facts, dtype=m.dtype)   # sharded like the policy, or whole
            ref_copy = True
            items.append(Item(f"reference policy (frozen copy, {m.dtype})", "reference", rollout=ref.weights,
                              train=ref.weights, cpu=ref.cpu_weights))
            ref_fwd += gathered_items(c.par, ref, "reference")
        else:
            notes.append("Reference policy = the base with adapters disabled: no extra weights.")
        c.substeps["reference forward"] = ref_fwd
    if c.stage.old_logprobs(cfg):
        c.substeps["old log-probs forward"] = [Item("old log-probs forward (no grad)", "policy", train=score_fwd)]
    if c.rl and cfg.rl_models.reward_model:
        # stage:rm = a pipeline's own reward model, trained from the policy: the policy's architecture.
        rsrc = c.src if cfg.rl_models.reward_model == "stage:rm" else locate(cfg.rl_models.reward_model)
        rf, rd = arch_facts(rsrc), cfg.rl_models.reward_dtype
        rs = frozen_states(cfg, c.par, rf, dtype=rd, head_params=rf.hidden, drop_lm_head=True)
        items.append(Item(f"reward model ({count_text(loaded_params(rf, score_head=True))} {rd}, frozen)", "reward",
                          rollout=rs.weights, train=rs.weights, cpu=rs.cpu_weights))
        rtr = trace(rsrc, TraceSpec(rd, m.attn_implementation, padded=True), modes=("nograd",))
        c.substeps["reward forward"] = [Item("reward forward (no grad)", "reward",   # padded (ppo_rewards.py)
                                             train=int(rtr.at("nograd_peak", c.padded[1], c.padded[0]))),
                                        *gathered_items(c.par, rs, "reward")]
    if c.rl and cfg.env.type == "simulated_user":
        if cfg.env.user_model:  # a separate frozen model plays the user (kept resident in both phases)
            uf = arch_facts(locate(cfg.env.user_model))
            us = model_states(uf, dtype=m.dtype, trainable="none")   # loaded whole (envs/__init__.py), never wrapped
            items.append(Item(f"simulated-user model ({count_text(loaded_params(uf))} {m.dtype}, frozen)", "reward",
                              rollout=us.weights, train=us.weights))
        else:
            notes.append("Simulated user = the policy's own weights with adapters disabled: no extra weights.")
    frozen_rows = [(i.name.split(" (")[0], i) for i in items if i.group in ("reference", "reward")]
    spread = [n for n, _ in frozen_rows if n in ("reference policy", "reward model") and c.rl]   # train/frozen.py's
    notes += frozen_notes(cfg, c.par, spread, [n for n, i in frozen_rows if i.train and n not in spread])
    return ref_copy, rf


def critic(c: Build, items: list[Item], pol: States, wdesc: str, fb_forward: list[Item],
           opt: list[Item]) -> tuple[States, Any]:
    """PPO's critic: its states, its activations alive with the policy's in one micro-step (the
    forward/backward sub-step is replaced), its optimizer step. Returns (its states, its architecture)."""
    cfg, m, par, accum, b = c.cfg, c.cfg.model, c.par, c.bp.accumulation, DTYPE_BYTES[c.cfg.model.dtype]
    vsrc = locate(cfg.rl_models.value_model) if cfg.rl_models.value_model else c.src
    vf = arch_facts(vsrc)
    val = model_states(vf, dtype=m.dtype, trainable="full" if c.full else "adapters", head_params=vf.hidden,
                       drop_lm_head=True, **c.common)
    vname = f"value model weights ({wdesc})"
    if cfg.ppo_shared_base():  # value_model.shared_backbone: the policy's base, only adapters + head added
        # (ZeRO-3 partitioning of the head is ignored: [1, hidden].) Its base is the policy's, gathered
        # once for the rollout; the critic's own gather is its adapters' missing partitions.
        # offload_params: the adapters' partition (and the head) are in CPU RAM, gathered whole from there.
        part = val.adapters or val.cpu_adapters
        gather = part * par.world - val.adapters if val.rollout_gather else 0
        val = dataclasses.replace(val, weights=val.adapters + vf.hidden * b if val.weights else 0,
                                  cpu_weights=vf.hidden * b if val.cpu_weights else 0, rollout_gather=gather)
        vname = "value head (the critic shares the policy's base)"
        c.notes.append("Critic = the policy's frozen base with its own adapters and value head "
                       "(ppo.shared_base): no second copy of the base.")
    states_items(items, "value", val, vname, c.rl, accum)
    if val.rollout_gather:  # with the hf engine PPOStage.prepare gathers the whole PolicyCritic (values scored there)
        items.append(Item("ZeRO-3 critic weights gathered whole for the rollout", "value",
                          rollout=val.rollout_gather, note="freed before training"))
    vm = tuple(md for md, n in (("ckpt", m.checkpointed_layers(vf.n_layers)),
                                 ("train", vf.n_layers - m.checkpointed_layers(vf.n_layers))) if n)
    vtr = c.tr if vsrc is c.src else trace(vsrc, c.spec, modes=vm)
    v_end, v_trans = c.body(vtr, vf.n_layers)
    # The critic's layer transient or value head adds only where it exceeds the policy's head/transient.
    v_act = v_end + max(0, max(v_trans, c.head("value")["peak"]) - fb_forward[1].train)
    if cfg.ppo.entropy_coef > 0:  # PPOStage.loss: a differentiable fp32 log-softmax and its exp, [n, V] each
        fb_forward.append(Item("entropy bonus (log-softmax + exp saved)", "activations",
                               train=2 * c.mb * c.new_tokens * c.facts.vocab * 4))
    c.substeps.pop("policy forward/backward")
    c.substeps["policy + value forward/backward"] = ppo_backward(
        fb_forward, v_act, pol, val, accum, par.sharding,
        min((c.facts.n_lm_head or c.facts.n_embed) * b, pol.grads) if c.full else 0,  # a frozen head has none
        int(c.tr.at(f"{c.mode}_other", c.seq, c.mb)), int(c.tr.at(f"{c.mode}_transient", c.seq, c.mb)))
    opt += [Item("value optimizer-step temporaries", "value", train=val.step_temp),
            Item("value gradients", "value", train=val.grads if accum == 1 else 0)]
    return val, vf


def ppo_backward(fb: list, v_act: int, pol: States, val: States, accum: int, sharding: str, head_grad: int,
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
        both.append(Item(f"{sharding} gathered layers", "value", train=max(pol.gathered, val.gathered)))
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


def states_items(items: list[Item], group: str, st: States, weights_name: str, rl: bool, accum: int) -> None:
    """Resident states: present in both phases (gradients only while accumulating). Each kind is its own
    row, on the GPU or offloaded to CPU RAM (states.States keeps the offloaded bytes per kind)."""
    both = lambda v: dict(rollout=v if rl else 0, train=v)  # noqa: E731
    items.append(Item(weights_name, group, **both(st.weights - st.adapters), cpu=st.cpu_weights))
    if st.adapters or st.cpu_adapters:
        items.append(Item(f"{group} adapters (fp32)", group, **both(st.adapters), cpu=st.cpu_adapters))
    if accum > 1 and st.grads:
        items.append(Item(f"{group} gradients (accumulating over {accum} micro-steps)", group, train=st.grads,
                          between_steps=True))
    if st.cpu_grads:   # FSDP offload: reduce-scattered to CPU RAM at every micro-step, accumulated there
        items.append(Item(f"{group} gradients (shards in CPU RAM)", group, cpu=st.cpu_grads, between_steps=True))
    # distributed.offload_train_states_during_rollout: in CPU RAM while the engine generates (train/zero.py).
    awake = (lambda v: dict(rollout=0, train=v)) if st.asleep and rl else both  # noqa: E731
    items.append(Item(f"{group} optimizer state", group, **awake(st.optimizer), cpu=st.cpu_optimizer))
    items.append(Item(f"{group} fp32 master weights", group, **awake(st.master), cpu=st.cpu_master))
    if st.asleep and rl:
        items.append(Item(f"{group} optimizer state + master weights + gradients asleep (rollout)", group,
                          cpu=st.asleep, note="in CPU RAM while the engine generates, back before scoring"))
    if st.cpu_step_temp:   # the offloaded optimizer steps on the CPU: its temporaries are there
        items.append(Item(f"{group} optimizer-step temporaries (the offloaded step runs on the CPU)", group,
                          cpu=st.cpu_step_temp))
    items.append(Item(f"{group} communication buckets", group, train=st.comm_buffers))


def targets(cfg: Config, facts=None):
    t = cfg.peft.target_modules
    m = cfg.model
    if facts is not None and facts.n_vision and t == "all-linear" and not (m.freeze_vision_tower and m.freeze_projector):
        # LoRA on the unfrozen vision parts too: the trainer's regex (models.lora_targets), else
        # all-linear already means the language model only (shapes.match_targets).
        return vlm_all_linear([g.name.replace("*", "0") for g in facts.linears],
                              tower=not m.freeze_vision_tower, projector=not m.freeze_projector)
    return t if isinstance(t, str) else tuple(t)


def frozen(cfg: Config, facts) -> tuple:
    """Parameter tensor sizes a full fine-tune keeps frozen (a VLM's vision tower and projector)."""
    out: list[int] = []
    for sizes, frozen_ in ((facts.tower_sizes, cfg.model.freeze_vision_tower),
                           (facts.projector_sizes, cfg.model.freeze_projector)):
        if frozen_:
            out += [n for n, c in sizes for _ in range(c)]
    return tuple(out)
