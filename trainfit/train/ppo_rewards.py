"""PPO's frozen reward model (`rl_models.reward_model`): loaded once, scoring prompt + completion.

The model reads the policy's token ids directly (no re-tokenizing), so it must share the policy's
tokenizer: a stage rm final dir trained from the same base does. A `preset:` name builds a random
sequence classifier on that preset (for trying the pipeline offline; its scores mean nothing).
"""

from __future__ import annotations

import torch

from trainfit.config import ConfigError, ModelConfig, PeftConfig, RLModelsConfig
from trainfit.core.dist import Ranks, SINGLE
from trainfit.models.logprobs import batch_tensors
from trainfit.models.policy import DTYPES
from trainfit.models.reward import load_reward_model, rewards
from trainfit.train.frozen import even_chunks, is_spread


def load_reward_scorer(rl_models: RLModelsConfig, device: torch.device, vocab: int):
    """The frozen reward model of the rl_models section, or None when none is set."""
    name, dtype = rl_models.reward_model, rl_models.reward_dtype
    if not name:
        return None
    if name.startswith("preset:"):
        model = load_reward_model(ModelConfig(name=name, dtype=dtype), PeftConfig(), device).model
    else:
        from transformers import AutoModelForSequenceClassification

        try:
            model = AutoModelForSequenceClassification.from_pretrained(name, dtype=DTYPES[dtype]).to(device)
        except (OSError, ValueError) as e:
            raise ConfigError(f"rl_models.reward_model={name!r} could not be loaded as a sequence classifier ({e}); "
                              "point it at a directory written by stage rm (its final dir) or a hub reward model.") \
                from None
    if model.config.num_labels != 1 or model.config.vocab_size < vocab:
        raise ConfigError(f"rl_models.reward_model={name!r} has {model.config.num_labels} outputs and a vocabulary of "
                          f"{model.config.vocab_size}; PPO needs one output and the policy's tokenizer ({vocab} "
                          "tokens): train it with stage rm from the policy's base.")
    if model.config.pad_token_id is None:
        raise ConfigError(f"rl_models.reward_model={name!r} has no config.pad_token_id, so the token it is read at "
                          "cannot be found in padded batches; set pad_token_id in its config.json.")
    return model.eval().requires_grad_(False)


@torch.no_grad()
def reward_model_scores(model, samples: list[dict], pad_id: int, device, chunk: int,
                        ranks: Ranks = SINGLE) -> torch.Tensor:
    """Scores `[N]` (fp32, on CPU) of the samples' whole sequences (prompt + completion), `chunk` at a time
    (a sharded reward model: as many forwards on every rank, train/frozen.py)."""
    out: list[torch.Tensor] = []
    for part, real in even_chunks(samples, chunk, ranks, is_spread(model)):
        ids, attn, _ = batch_tensors(part, pad_id, device)                       # [b, T]
        # Right padding is written with the RM's own pad id, which its pooling looks for.
        ids = ids.masked_fill(attn == 0, model.config.pad_token_id)
        scores = rewards(model, ids, attn).cpu()
        if real:
            out.append(scores)
    return torch.cat(out) if out else torch.zeros(0)

