"""The model's parameters as the trainers count, save and load them, with or without adapters."""

from pathlib import Path

import torch

from cloudtrain.models import adapters
from cloudtrain.observe.flops import full_numel


def count_parameters(model: torch.nn.Module, trainable: bool = False) -> int:
    """All (or the trainable) parameters, also when ZeRO-3 has partitioned them (each then holds only its shard)
    or bitsandbytes packed them in 4 bits."""
    return sum(full_numel(p) for p in model.parameters() if p.requires_grad or not trainable)


def trains_everything(model: torch.nn.Module) -> bool:
    """False under adapters: then checkpoints hold only the trainable weights, the base reloads from its files."""
    return all(p.requires_grad for p in model.parameters())


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def save_pretrained(model: torch.nn.Module, output_dir: Path, state_dict: dict | None = None) -> None:
    """A full model in transformers' layout, or an adapter in PEFT's (cloudtrain.models.adapters.save)."""
    if state_dict is not None:
        state_dict = tied_once(model, state_dict)
    if adapters.is_adapter(model):
        adapters.save(model, output_dir, state_dict)
    else:
        model.save_pretrained(output_dir, state_dict=state_dict)  # type: ignore[operator]  # a PreTrainedModel


def tied_once(model: torch.nn.Module, state_dict: dict) -> dict:
    """A gathered state dict (FSDP, ZeRO-3) holds a tied weight (T5's shared embedding, GPT-2's head) as one copy
    per name; given one tensor under each of its names, transformers' save keeps the name the model loads from,
    as it does for a live model, instead of writing every copy."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if name in state_dict:
            names.setdefault(id(parameter), []).append(name)
    tied = {name: state_dict[group[0]] for group in names.values() for name in group[1:]}
    return {**state_dict, **tied} if tied else state_dict


def load_trainable_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's trainable weights; it must hold exactly the model's trainable parameters."""
    expected = set(trainable_state(model))
    if set(tensors) != expected:
        raise ValueError(
            f"it holds {len(tensors)} weights, {len(set(tensors) - expected)} unknown to this model, "
            f"and lacks {len(expected - set(tensors))} of its {len(expected)} trainable ones"
        )
    model.load_state_dict(tensors, strict=False)
