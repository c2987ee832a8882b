"""PPO's critic and the module the loop trains for PPO (policy and critic together).

The critic is a transformer backbone (the LM without its head) with a scalar head: a value at every
position, `[b, T]`, where position t estimates the return after reading tokens 0..t. By default it
starts from the policy's weights, or from `rl_models.value_model`, a sequence classifier directory
such as a stage rm final dir (its backbone and its `score` head). Starting from the policy:

- with peft and `ppo.shared_base` (the default), the critic's backbone is a second module tree whose
  frozen tensors ARE the policy's (the same storage): its own LoRA/DoRA adapters and head, no second
  base. The reference is the policy with adapters off, so one base serves all three roles. A second
  tree, not a second peft adapter on the policy's tree, because peft switches adapters globally and
  gradient checkpointing re-runs the policy's forward during backward, after the critic's forward
  would have switched the active adapter; separate trees need no switching and compute what separate
  copies compute;
- otherwise `model.name` is loaded again (a second copy of the base), with its own adapters under peft.

`PolicyCritic` holds both as submodules so the loop's one optimizer (two param groups, two lrs),
checkpoints and OOM recovery see one model; its forward runs both on a micro-batch. The final critic
is saved as a plain `AutoModelForSequenceClassification` directory (adapters merged), which
`rl_models.value_model` loads back.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from trainfit.config import Config, ConfigError
from trainfit.models.logprobs import policy_logits
from trainfit.models.lora_compute import lora_compute_in_input_dtype
from trainfit.models.lora_rules import lora_in_model_dtype
from trainfit.models.policy import DTYPES, _fork_rng, enable_checkpointing, load_base_model
from trainfit.models.state import load_trainable_state, trainable_state


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, head: nn.Linear):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], **inputs) -> torch.Tensor:
        """Values `[b, T]`; `inputs`: further forward arguments (a packed row's position_ids)."""
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **inputs).last_hidden_state  # [b, T, H]
        return self.head(h).squeeze(-1).float()                                                  # [b, T]


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def shared_backbone(policy: nn.Module) -> nn.Module:
    """The policy's transformer body (a peft model's, without its adapters) as a new module tree whose
    parameters and buffers are the policy's own tensors: no weight is copied, only modules."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    lm = policy.get_base_model()
    body = getattr(lm, lm.base_model_prefix)
    same = {id(t): t for t in (*body.parameters(), *body.buffers())}
    twin = copy.deepcopy(body, memo=same)   # modules copied; every tensor looked up in `same`, not copied
    for name, mod in list(twin.named_modules()):
        if isinstance(mod, BaseTunerLayer):   # a LoRA/DoRA layer: put its frozen base layer back in its place
            parent, _, child = name.rpartition(".")
            setattr(twin.get_submodule(parent), child, mod.get_base_layer())
    return twin


def build_critic(cfg: Config, tokenizer, device: torch.device, policy: Optional[nn.Module] = None) -> ValueModel:
    """The critic for `cfg` (see the module docstring), on `device`, adapters attached under peft.
    `policy`: the (peft) policy whose base the critic shares when cfg.ppo_shared_base()."""
    mc, pc = cfg.model, cfg.peft
    dtype = DTYPES[mc.dtype]
    shared = cfg.ppo_shared_base()
    if shared and policy is None:
        raise ValueError("build_critic: ppo.shared_base needs the policy whose base it shares")
    if shared:
        backbone = shared_backbone(policy)
        head = _new_head(_text_config(backbone.config).hidden_size, dtype, cfg.train.seed)
    elif cfg.rl_models.value_model:
        from transformers import AutoModelForSequenceClassification

        try:
            cls = AutoModelForSequenceClassification.from_pretrained(cfg.rl_models.value_model, dtype=dtype)
        except (OSError, ValueError) as e:
            raise ConfigError(f"rl_models.value_model={cfg.rl_models.value_model!r} could not be loaded as a sequence "
                              f"classifier ({e}); point it at a directory such as a stage rm final dir, or remove it "
                              "to start the critic from the policy.") from None
        head = getattr(cls, "score", None)
        if not isinstance(head, nn.Linear) or head.out_features != 1:
            raise ConfigError(f"rl_models.value_model={cfg.rl_models.value_model!r} has no one-output `score` head; "
                              "use a reward-model directory written by stage rm, or remove the key.")
        backbone = getattr(cls, cls.base_model_prefix)
        head = head.to(dtype)
    else:
        lm, _ = load_base_model(mc, device, vocab_size=len(tokenizer))    # the policy's weights, a second copy
        enable_checkpointing(lm, mc)
        backbone = getattr(lm, lm.base_model_prefix)
        head = _new_head(_text_config(lm.config).hidden_size, dtype, cfg.train.seed)
        del lm
    backbone.config.pad_token_id = tokenizer.pad_token_id
    backbone, head = backbone.to(device), head.to(device)
    if pc.method != "none":
        from peft import LoraConfig, get_peft_model

        for p in backbone.parameters():
            p.requires_grad_(False)
        if mc.gradient_checkpointing:
            backbone.enable_input_require_grads()
        lcfg = LoraConfig(r=pc.r, lora_alpha=pc.alpha, lora_dropout=pc.dropout, use_dora=pc.method == "dora",
                          target_modules=pc.target_modules)
        with _fork_rng(cfg.train.seed + 1):
            backbone = get_peft_model(backbone, lcfg)

        if lora_in_model_dtype(pc.method, pc.adapter_compute, mc.dtype, mc.quantization):
            lora_compute_in_input_dtype(backbone)  # as the policy's (models.attach_adapters)
    return ValueModel(backbone, head)


def _new_head(hidden: int, dtype: torch.dtype, seed: int) -> nn.Linear:
    with _fork_rng(seed + 1):
        head = nn.Linear(hidden, 1, bias=False, dtype=dtype)
        # Small random weights (OpenRLHF's std 1/(H+1)): a zero head would give the backbone no
        # gradient on the first step.
        nn.init.normal_(head.weight, std=1.0 / (hidden + 1))
    return head


def save_critic(critic: ValueModel, tokenizer, out_dir: Path, shared: bool = False) -> Path:
    """A plain sequence-classifier directory (adapters merged). A separate critic is merged in place
    (the end of training); a `shared` one is merged in a CPU copy, since merging in place would write
    the critic's adapters into the base the policy still uses."""
    from transformers import AutoModelForSequenceClassification

    backbone = critic.backbone
    if shared:
        frozen = {id(p): nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=False)
                  for p in backbone.parameters() if not p.requires_grad}
        backbone = copy.deepcopy(backbone, memo=frozen).cpu()
    if hasattr(backbone, "merge_and_unload"):
        backbone = backbone.merge_and_unload()
    config = backbone.config
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    cls = AutoModelForSequenceClassification.from_config(config, dtype=critic.head.weight.dtype)
    getattr(cls, cls.base_model_prefix).load_state_dict(backbone.state_dict())
    with torch.no_grad():
        cls.score.weight.copy_(critic.head.weight)
    out_dir.mkdir(parents=True, exist_ok=True)
    cls.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


class PolicyCritic(nn.Module):
    """Policy and critic as one trained module (the loop's `model`)."""

    def __init__(self, policy: nn.Module, critic: ValueModel, is_peft: bool):
        super().__init__()
        self.policy, self.critic, self.is_peft = policy, critic, is_peft

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], keep: torch.Tensor, **inputs):
        """(policy logits `[n, V]` at the positions `keep [b, T]` marks, critic values `[b, T]`); `inputs`
        go to both forwards (a packed row's position_ids, models/logprobs.ForwardBatch)."""
        return (policy_logits(self.policy, input_ids, attention_mask, keep, inputs),
                self.critic(input_ids, attention_mask, **inputs))

    def param_groups(self, policy_lr: float, critic_lr: Optional[float]) -> list[dict]:
        """Two optimizer groups; the loop's schedule scales both lrs alike."""
        pol = [p for p in self.policy.parameters() if p.requires_grad]
        cri = [p for p in self.critic.parameters() if p.requires_grad]
        return [{"params": pol, "lr": policy_lr}, {"params": cri, "lr": critic_lr or policy_lr}]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The checkpoint's weights: the policy's as for any stage (adapters under peft), and the
        critic's trainable tensors (all of them without peft; adapters and head with it: its frozen
        base is rebuilt from model.name on resume)."""
        out = {f"policy.{k}": v for k, v in trainable_state(self.policy, self.is_peft).items()}
        for k, p in self.critic.named_parameters():
            if p.requires_grad:
                out[f"critic.{k}"] = p.detach().cpu().contiguous()
        return out

    def load_trainable_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        pol = {k[len("policy."):]: v for k, v in sd.items() if k.startswith("policy.")}
        cri = {k[len("critic."):]: v for k, v in sd.items() if k.startswith("critic.")}
        load_trainable_state(self.policy, self.is_peft, pol)
        want = {k for k, p in self.critic.named_parameters() if p.requires_grad}
        if set(cri) != want:
            raise RuntimeError(f"checkpoint's critic does not match: missing {sorted(want - set(cri))[:5]}, "
                               f"unexpected {sorted(set(cri) - want)[:5]}")
        self.critic.load_state_dict(cri, strict=False)
