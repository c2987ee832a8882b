"""train.compile: torch.compile of the decoder blocks for the training forward and backward.

Each decoder layer's `forward` is compiled on its own (the layers share one class and one graph, so
one compilation serves them all; the embedding, LM head and loss stay eager, where trainfit already
runs the head at the labelled positions only). The compiled forward runs when gradients are on:
the training forward, and the recompute of a checkpointed layer in backward. No-grad calls (the
rollout's decoding with a KV cache, reference and scoring forwards, evaluation) keep the eager
forward, so their changing shapes and cache objects never trigger recompiles.
"""

from __future__ import annotations

import torch

from trainfit.models.policy import decoder_layers


def compile_blocks(model, backend: str = "inductor") -> int:
    """Compile the forward of every decoder layer of `model` (under any PEFT wrapper); returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        eager = layer.forward
        compiled = torch.compile(eager, backend=backend)

        def forward(*args, _eager=eager, _compiled=compiled, **kwargs):
            return (_compiled if torch.is_grad_enabled() else _eager)(*args, **kwargs)

        layer.forward = forward   # instance attribute: nn.Module.__call__ (and checkpointing) call it
    return len(layers)
