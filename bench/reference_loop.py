"""The floor for overhead: the shortest correct PyTorch loop over the same data, model and schedule.

AdamW (no decay on biases and norms), linear warmup and decay, clipping at 1.0, mean cross-entropy;
no logging, no checkpoints, no accumulation. One process, CPU or one GPU.
"""

import contextlib
import time

import torch
import torch.nn.functional as F
from common import Spec, StepClock, prepare
from torch.utils.data import DataLoader
from transformers import get_scheduler

from cloudtrain.data.processing import eval_dataloader, train_dataloader
from cloudtrain.training.optim import adamw_kernel


def optimizer_for(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.training.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.training.learning_rate,
        **adamw_kernel(cfg.training.adamw_implementation),
    )  # the same kernel as ours


def autocast(device: torch.device, precision: str):
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def train(model, loader: DataLoader, cfg, device: torch.device, clock: StepClock) -> tuple[int, int]:
    """max_steps optimizer steps; returns (examples, real tokens) seen."""
    t = cfg.training
    optimizer = optimizer_for(model, cfg)
    scheduler = get_scheduler(
        t.lr_scheduler_type,
        optimizer,
        num_warmup_steps=round(t.warmup_ratio * t.max_steps),
        num_training_steps=t.max_steps,
    )
    model.train()
    loader.sampler.set_epoch(0)
    samples = tokens = 0
    for step, batch in enumerate(loader):
        if step == t.max_steps:
            break
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")
        with autocast(device, t.mixed_precision):
            logits = model(**batch).logits
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        samples += len(labels)
        tokens += batch["attention_mask"].sum()
        clock.step_done()
    return samples, int(tokens)


@torch.no_grad()
def evaluate(model, loader: DataLoader, device: torch.device, precision: str) -> dict:
    model.eval()
    start, correct, total = time.perf_counter(), 0, 0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")
        with autocast(device, precision):
            correct += int((model(**batch).logits.argmax(-1) == labels).sum())
        total += len(labels)
    return {
        "eval_samples_per_s": total / (time.perf_counter() - start),
        "accuracy": correct / total,
        "eval_samples": total,
    }


def run(spec: Spec) -> dict:
    cfg, data, model, _ = prepare(spec)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    clock = StepClock()
    model.to(device)
    if cfg.training.torch_compile:
        model.compile()
    loader = train_dataloader(data, spec.batch_size, cfg.training.seed, cfg.data)
    samples, tokens = train(model, loader, cfg, device, clock)
    result = clock.result(spec.batch_size, samples, tokens)
    test = eval_dataloader(data.test, data, cfg.training.per_device_eval_batch_size, cfg.data)
    return {**result, **evaluate(model, test, device, cfg.training.mixed_precision)}
