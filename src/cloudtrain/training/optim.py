"""The optimizer and the learning-rate schedule every trainer steps."""

import torch
from transformers import get_scheduler

from cloudtrain.config import Config


def adamw_kernel(implementation: str) -> dict:
    """torch.optim.AdamW's keyword for --adamw_implementation; auto is fused, measured the fastest
    (bench/results/latest.md) and supported on CPU and CUDA, also under DeepSpeed and FSDP."""
    return {
        "auto": {"fused": True},
        "fused": {"fused": True},
        "foreach": {"foreach": True},
        "for_loop": {"foreach": False},
    }[implementation]


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; biases and normalisation weights (the 1-d tensors) get no weight decay."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            # ZeRO-3 partitions parameters to shape [0] while loading; `ds_shape` keeps the real one
            (no_decay if len(getattr(param, "ds_shape", param.shape)) < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.training.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.training.learning_rate, **adamw_kernel(cfg.training.adamw_implementation))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config, total_steps: int):
    """--lr_scheduler_type over `total_steps` optimizer steps, warming up for --warmup_ratio of them."""
    t = cfg.training
    return get_scheduler(
        t.lr_scheduler_type,
        optimizer,
        num_warmup_steps=round(t.warmup_ratio * total_steps),
        num_training_steps=total_steps,
    )
