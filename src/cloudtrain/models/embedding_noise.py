"""NEFTune (`--neftune_noise_alpha`): uniform noise added to the input embeddings while the model trains.

Each training forward adds noise drawn from U(-s, s), s = alpha / sqrt(length x hidden), to the embedding output
[batch, length, hidden] (length: the padded or packed row's). Evaluation, generation and the saved model are
untouched: the noise is a forward hook that acts only in training mode, and a hook is not part of the weights.
"""

from __future__ import annotations

import math

import torch


def add_embedding_noise(model: torch.nn.Module, alpha: float) -> torch.utils.hooks.RemovableHandle:
    """Hook NEFTune's noise onto `model`'s input embeddings; returns the handle that removes it."""
    embeddings = model.get_input_embeddings()  # type: ignore[operator]

    def noisy(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not module.training:
            return None
        scale = alpha / math.sqrt(output.shape[-2] * output.shape[-1])
        return output + torch.empty_like(output).uniform_(-scale, scale)

    return embeddings.register_forward_hook(noisy)


def has_input_embeddings(model: torch.nn.Module) -> bool:
    """Whether `model` names its token embeddings (transformers' get_input_embeddings)."""
    try:
        return isinstance(model.get_input_embeddings(), torch.nn.Module)  # type: ignore[operator]
    except (AttributeError, NotImplementedError):
        return False
