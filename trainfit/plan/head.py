"""Memory of the LM head and the loss, traced at their exact size with the trainer's own math.

From the body's output `hidden [b, T, d]` to the loss and back: the logits in the model dtype, the
fp32 log-probs (in row chunks when `train.logits_chunk_rows` > 0), the loss (`grpo_loss` /
`sft_loss`), GRPO's no-grad entropy, and the backward down to the gradient of `hidden`. These are
the largest transients of LLM training (tokens x vocab x 4 bytes, several times over) and depend on
the loss code rather than on the layers, so they are traced here at the configured micro-batch,
sequence length and vocabulary, not scaled.

trainfit runs the head at the scored positions only: the hidden rows are gathered (transformers'
boolean `logits_to_keep`), logits are [n, V], and `algos.token_logprobs_rows` gives log-probs (and
GRPO's entropy) from them. GRPO and PPO (`policy_rows`) are planned that way with n = b x new_tokens.
SFT is planned with [b, T, V] logits: which tokens carry labels depends on the data, and every
position labelled (pretraining) costs what full logits cost, so that is its upper bound.

With `train.fused_head` (`fused`: chunked / liger) the head runs fused with the log-probs
(`algos.linear_token_logprobs`): the hidden rows [n, d] are kept for backward and only one chunk's
logits, their fp32 copy and their gradient exist at a time, in forward and backward (SFT: every
position labelled, n = b x (T-1)). Liger's kernel is planned as that function at Liger's own chunk
size (`liger_chunk_rows`); its buffers are the same kinds ([n, d] gradient, one [c, V] chunk).

The composition mirrors trainfit/models/logprobs.py (`sequence_logprobs`, `label_logprobs`), trainfit/train/grpo.py
(`GRPOStage.loss`) and trainfit/train/sft.py (`SFTStage.loss`) without importing the trainer: keep
them in step when the trainer changes. Only the shapes of data-dependent selections are fixed (the
completion mask selects the last `new_tokens` positions of every row).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from trainfit.config.stages import stage_spec
from trainfit.core import cache
from trainfit.models.head_transforms import config_head_problem
from trainfit.models.shapes import hf_config, model_source
from trainfit.plan.trace import DTYPES
from trainfit.plan.tracker import LiveTracker


@dataclass(frozen=True)
class HeadSpec:
    kind: str                 # grpo | sft | logprobs (no-grad reference / old log-probs) | value
    vocab: int
    hidden: int
    dtype: str
    batch: int
    tokens: int               # T, whole sequence
    new_tokens: int = 0       # completion tokens per row (GRPO/PPO)
    chunk_rows: int = 0       # train.logits_chunk_rows
    beta: float = 0.0
    temperature: float = 1.0
    loss_type: str = "dapo"
    head_trainable: bool = False  # full fine-tuning trains the output projection
    policy_rows: bool = False     # the head runs at the policy positions only (trainfit's GRPO)
    fused: str = "off"            # train.fused_head as planned: off | chunked | liger


def planned_fused_head(cfg) -> str:
    """train.fused_head as the trainer resolves it (models/fused_head.py), from the config alone:
    `auto` counts as liger when the plan is for CUDA and liger-kernel imports here; stages and
    engines the trainer refuses or skips plan the plain head."""
    import importlib.util

    mode = cfg.train.fused_head
    sharded = cfg.engine() == "fsdp" or (cfg.engine() == "deepspeed" and cfg.distributed.zero_stage == 3)
    if mode == "off" or stage_spec(cfg.stage).plain_head or sharded:
        return "off"
    if mode == "auto":
        cuda = cfg.train.device != "cpu"
        return "liger" if cuda and importlib.util.find_spec("liger_kernel") is not None else "off"
    return mode


def fused_head_runs(cfg) -> bool:
    """Whether `train.fused_head=chunked` is a change the trainer accepts for this config: a stage
    with an LM head loss, an unsharded head, no LoRA on the head, no logit transform after it
    (models/fused_head.py refuses the rest). What `plan` suggests and `fit` tries."""
    t, pc = cfg.train, cfg.peft
    # Only from `auto`: an explicit `off` (or fused setting) is the user's choice, kept by plan and fit.
    if getattr(t, "fused_head", "off") != "auto" or stage_spec(cfg.stage).plain_head:
        return False
    if cfg.engine() == "fsdp" or (cfg.engine() == "deepspeed" and cfg.distributed.zero_stage == 3):
        return False
    targets = pc.target_modules if isinstance(pc.target_modules, list) else [pc.target_modules]
    if pc.method != "none" and any("lm_head" in str(x) for x in targets):
        return False
    try:
        return _plain_head_config(model_source(cfg.model))
    except Exception:   # the model's config cannot be read here: no suggestion rather than a wrong one
        return False


def _plain_head_config(src) -> bool:
    """No logit transform after the head in the model's transformers config (its class defaults
    included), cached on disk by the config and transformers' version: fit asks it of every search
    and a cached answer imports no transformers."""
    key = cache.stable_hash({"plain_head": src.config, "transformers": cache.package_version("transformers")})
    found = cache.read("heads", key)
    if found is None:
        hf = hf_config(src)
        found = {"plain": config_head_problem(hf) is None
                 and config_head_problem(getattr(hf, "get_text_config", lambda: hf)()) is None}
        cache.write("heads", key, found)
    return found["plain"]


def liger_chunk_rows(n: int, hidden: int, vocab: int) -> int:
    """Rows per chunk of Liger's fused linear cross-entropy (its heuristic: the chunk's logits about
    the size of the hidden rows, rounded up to a power of two, at most n)."""
    inc = -(-vocab // hidden)
    c = -(-n // inc)
    return max(1, min(n, 1 << (c - 1).bit_length()))


def _fused_chunk(spec: HeadSpec, n: int) -> int:
    if spec.fused == "liger":
        return liger_chunk_rows(n, spec.hidden, spec.vocab)
    from trainfit.algos import FUSED_CHUNK_ROWS  # torch: only when tracing (a cold cache)

    return spec.chunk_rows or FUSED_CHUNK_ROWS


def _completion_mask(b: int, t: int, new_tokens: int):
    """[b, T-1]: position t scores token t+1; the last `new_tokens` tokens of every row are the policy's."""
    import torch

    mask = torch.zeros((b, t - 1), dtype=torch.bool)
    mask[:, t - 1 - new_tokens:] = True
    return mask


def _grpo_loss(logp, mask, spec: HeadSpec, algos):
    """`GRPOStage.loss` after the log-probs `[b, T-1]` (on-policy: old = detached current)."""
    import torch

    b = logp.shape[0]
    ref = torch.zeros_like(logp) if spec.beta > 0 else None
    loss, _ = algos.grpo_loss(logp, logp.detach(), ref, torch.zeros(b), mask.float(), loss_type=spec.loss_type,
                              eps_low=0.2, eps_high=0.2, beta=spec.beta, kl_estimator="k3",
                              total_seqs=b, total_tokens=float(b * spec.new_tokens), max_len=spec.new_tokens)
    return loss


def _full_logits_grpo(logits, ids, spec: HeadSpec, algos):
    """GRPO over full [b, T, V] logits (PPO's planned path): shifted log-probs, loss, entropy."""
    import torch

    b, t = ids.shape
    logp = algos.shifted_logprobs(logits, ids, spec.temperature, spec.chunk_rows)    # [b, T-1]
    loss = _grpo_loss(logp, _completion_mask(b, t, spec.new_tokens), spec, algos)
    lg = logits[:, :-1]
    with torch.no_grad():  # a slice of the completion rows keeps shapes static
        algos.entropy_sum(lg.detach()[:, t - 1 - spec.new_tokens:].reshape(-1, lg.shape[-1]))
    return loss


def _policy_rows(hidden, weight, ids, spec: HeadSpec, algos, entropy: bool):
    """`sequence_logprobs`: the head on the policy positions only, then row log-probs (and entropy)
    scattered back to `[b, T-1]`. Returns (logp [b, T-1], mask [b, T-1])."""
    import torch

    # The trainer gathers with the boolean mask; slices of the same rows (copied by the reshape, as the
    # gather copies) keep shapes static under the fake-tensor trace.
    b, t = ids.shape
    first = t - 1 - spec.new_tokens
    mask = _completion_mask(b, t, spec.new_tokens)                                   # [b, T-1]
    picked = hidden[:, first:t - 1].reshape(-1, hidden.shape[-1])                    # [n, d], a copy
    targets = ids[:, first + 1:].reshape(-1)                                         # [n]
    if spec.fused != "off":   # the fused head keeps `picked` for backward, no [n, V]
        logp_rows, _ = algos.linear_token_logprobs(picked, weight, targets, spec.temperature,
                                                   _fused_chunk(spec, targets.numel()), entropy)
    else:
        rows = torch.nn.functional.linear(picked, weight)                            # [n, V]
        del picked
        logp_rows, _ = algos.token_logprobs_rows(rows, targets, spec.temperature, spec.chunk_rows, entropy)
        del rows
    logp = torch.zeros(mask.shape, dtype=logp_rows.dtype)                            # [b, T-1]
    logp[:, first:] = logp_rows.view(b, spec.new_tokens)
    return logp, mask


def _forward(hidden, weight, ids, spec: HeadSpec, algos):
    """The head's forward up to the loss (a no-grad sum for "logprobs"). Only what autograd saved
    outlives it: the trainer's loss() also returns before backward."""
    import torch

    if spec.policy_rows and spec.kind in ("grpo", "logprobs"):
        logp, mask = _policy_rows(hidden, weight, ids, spec, algos, entropy=spec.kind == "grpo")
        return _grpo_loss(logp, mask, spec, algos) if spec.kind == "grpo" else logp.sum()
    if spec.kind == "sft" and spec.fused != "off":   # label_logprobs: every position labelled (the bound)
        picked = hidden[:, :-1].reshape(-1, hidden.shape[-1])                            # [n, d], a copy
        targets = ids[:, 1:].reshape(-1)                                                 # [n]
        logp = algos.linear_token_logprobs(picked, weight, targets, 1.0, _fused_chunk(spec, targets.numel()))[0]
        return algos.nll_mean(logp.sum(), spec.batch * spec.tokens)
    logits = torch.nn.functional.linear(hidden, weight)                                  # [b, T, V]
    if spec.kind == "grpo":
        return _full_logits_grpo(logits, ids, spec, algos)
    if spec.kind == "sft":
        labels = ids.masked_fill(ids < 0, -100)
        return algos.sft_loss(logits, labels, total_tokens=spec.batch * spec.tokens, chunk_size=spec.chunk_rows)[0]
    if spec.kind == "value":
        values = logits.squeeze(-1).float()                                                # [b, T]
        return (values - torch.zeros_like(values)).pow(2).mean()
    # No-grad log-probs of the reference / behaviour policy (the logits are dropped after).
    if spec.temperature > 0 and spec.temperature != 1.0:
        logits = logits / spec.temperature
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    return algos.token_logprobs(logits, targets, chunk_size=spec.chunk_rows)[:, :-1].sum()


def _run(spec: HeadSpec) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainfit import algos  # torch: a warm cache answers without it

    dtype = getattr(torch, DTYPES[spec.dtype])
    with FakeTensorMode(allow_non_fake_inputs=True):
        hidden = torch.zeros(spec.batch, spec.tokens, spec.hidden, dtype=dtype, requires_grad=spec.kind != "logprobs")
        out_dim = 1 if spec.kind == "value" else spec.vocab
        weight = torch.nn.Parameter(torch.zeros(out_dim, spec.hidden, dtype=dtype),
                                    requires_grad=spec.head_trainable or spec.kind == "value")
        ids = torch.zeros(spec.batch, spec.tokens, dtype=torch.long)
        h_id = id(hidden.untyped_storage())
        tracker = LiveTracker({h_id, id(weight.untyped_storage())}, inputs={h_id: hidden.untyped_storage().nbytes()})
        tracker.owner = "head"
        grad_ctx = torch.no_grad() if spec.kind == "logprobs" else torch.enable_grad()
        gc.disable()
        try:
            with tracker.mode, grad_ctx, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
                loss = _forward(hidden, weight, ids, spec, algos)
                tracker.mark("forward")
                if spec.kind != "logprobs":
                    loss.backward()
                tracker.mark("end")
        finally:
            gc.enable()
        grads = {tracker.serial_of(weight.grad)} if weight.grad is not None else set()
        return {"peak": tracker.peak(skip=grads), "saved": tracker.saved_bytes(),
                "forward_peak": tracker.peak(end=tracker.marks["forward"], skip=grads),
                "end": sum(tracker.live_at(tracker.marks["forward"], skip=grads).values())}


_MEMO: dict[HeadSpec, dict] = {}


def _many_fused_chunks(spec: HeadSpec) -> bool:
    """A `chunked` fused head of more than 16 row chunks: tracing every chunk's ops is slow (a
    [64 x 8192]-token SFT micro-batch has 2048 of them) and tells nothing new."""
    rows = spec.batch * (spec.new_tokens if spec.policy_rows else spec.tokens - 1)
    return spec.fused == "chunked" and spec.batch > 3 and rows > 16 * _fused_chunk(spec, rows)


def _run_fused_by_rows(spec: HeadSpec) -> dict:
    """The chunked fused head traced at 2 and 3 sequences and extended to `spec.batch`: its buffers
    (hidden rows, their gradient, per-row log-probs and log-sum-exps) grow with the rows while one
    chunk's logits and their gradient do not, and every chunk runs the same ops, so each figure is
    linear in the batch (tests/test_fused_head.py compares the two)."""
    from dataclasses import replace

    # From 2 and 3 sequences: at 1 some selections are views rather than copies (off the line).
    two, three = _run(replace(spec, batch=2)), _run(replace(spec, batch=3))
    return {k: two[k] + (three[k] - two[k]) * (spec.batch - 2) for k in two}


def head_memory(spec: HeadSpec) -> dict:
    """Bytes of the head + loss for one micro-batch: peak (forward and backward), live at the end of
    forward (what stays for backward), and saved-for-backward. Cached on disk."""
    if spec in _MEMO:
        return _MEMO[spec]
    key = cache.stable_hash({"head": spec.__dict__})
    res = cache.read("heads", key)
    if res is None:
        res = _run_fused_by_rows(spec) if _many_fused_chunks(spec) else _run(spec)
        cache.write("heads", key, res)
    _MEMO[spec] = res
    return res
