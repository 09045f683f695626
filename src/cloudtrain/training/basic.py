"""BasicTrainer: the plain PyTorch loop, with manual device placement.

Supports: one process on CUDA (when present) or CPU; gradient accumulation; clipping; fp16 (CUDA,
with a GradScaler) and bf16 autocast; checkpoints (weights in safetensors, the rest in a file that
loads with weights_only=True). Does not support: several processes or DeepSpeed; use the
AcceleratedTrainer (`--training_type accelerated`) for those.
"""

import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from cloudtrain.async_save import cpu_copy, weights_snapshot
from cloudtrain.config import Config
from cloudtrain.errors import UserError
from cloudtrain.hardware import autocast
from cloudtrain.parallel.distributed import deepspeed_requested, fsdp_requested, launched_processes
from cloudtrain.registry import TRAINERS
from cloudtrain.tasks.base import Task
from cloudtrain.training.meter import StepStats
from cloudtrain.training.prefetch import prefetch
from cloudtrain.training.trainer import Trainer, save_weights
from cloudtrain.training.weights import load_trainable_state, trainable_state, trains_everything

TRAINING_STATE = "training_state.pt"  # optimizer, scheduler, scaler, RNG: plain tensors and numbers


@TRAINERS.register
class BasicTrainer(Trainer):
    name = "basic"
    summary = "plain PyTorch loop"
    follows_launcher = False

    @classmethod
    def check_options(cls, cfg: Config, task: Task) -> None:
        super().check_options(cfg, task)
        if launched_processes() > 1 or deepspeed_requested(cfg) or fsdp_requested(cfg):
            raise UserError(
                "the BasicTrainer runs one process without DeepSpeed or FSDP; "
                "use --training_type accelerated for multi-process, DeepSpeed and FSDP runs"
            )

    def setup(self) -> None:
        self.device = self.runtime.device
        self.model.to(self.device)  # type: ignore[arg-type]  # transformers' wrapped `to`
        # fp16 needs loss scaling against underflow; bf16 and fp32 do not (a disabled scaler is a no-op)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.cfg.training.mixed_precision == "fp16")

    def autocast(self):
        return autocast(self.cfg.training.mixed_precision, self.device)

    def move(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def input_batches(self, batches: Iterable[dict]) -> Iterator[dict]:
        # A loader without workers fetches in this process, where a dataset's transform may draw from the
        # global RNG: fetched ahead of the step, a resumed run would draw in another order.
        ahead = 1 if self.cfg.data.dataloader_num_workers > 0 else 0
        return prefetch(batches, self.move, self.device, ahead)

    def backward_window(self, window: list[dict], scale: torch.Tensor) -> StepStats:
        loss_sum: Any = 0  # tensors from the first batch on (a window is never empty)
        count: Any = 0
        for batch in window:
            with self.autocast():
                with self.clock.forward():
                    summed, n = self.task.loss(self.model, batch)
            self.scaler.scale(summed * scale).backward()
            loss_sum, count = loss_sum + summed.detach(), count + n
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = None
        if self.cfg.training.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.training.max_grad_norm)
        return StepStats(loss_sum=loss_sum, count=count, grad_norm=grad_norm)

    def optimizer_step(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update()  # closes the step the scaler saw unscaled

    def save_model(self, output_dir: Path) -> None:
        save_weights(self.model, output_dir)

    def write_checkpoint(self, folder: Path) -> None:
        weights = str(folder / "model.safetensors")
        if trains_everything(self.model):
            safetensors.torch.save_model(self.model, weights)
        else:  # adapters: the frozen base reloads from its own files
            safetensors.torch.save_file(trainable_state(self.model), weights)
        torch.save(self._training_state(), folder / TRAINING_STATE)

    def checkpoint_snapshot(self) -> Callable[[Path], None]:
        live = self.model.state_dict() if trains_everything(self.model) else trainable_state(self.model)
        weights, dropped = weights_snapshot(live)  # the same file save_model writes
        training = cpu_copy(self._training_state())  # state_dict() holds the live tensors, not copies

        def write(folder: Path) -> None:
            safetensors.torch.save_file(weights, str(folder / "model.safetensors"), metadata=dropped or None)
            torch.save(training, folder / TRAINING_STATE)

        return write

    @classmethod
    def async_refusal(cls, cfg: Config) -> str | None:
        return None  # one process (check_options): nothing in the background waits on another

    def _training_state(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng_state(),
        }

    def load_checkpoint(self, folder: Path) -> None:
        weights = str(folder / "model.safetensors")
        if trains_everything(self.model):
            safetensors.torch.load_model(self.model, weights, device=str(self.device))
        else:
            load_trainable_state(self.model, safetensors.torch.load_file(weights, device=str(self.device)))
        # Read onto the CPU: the RNG states must stay there (numpy's key as a CUDA tensor cannot become an
        # array again: the CUDA resume failed on it), and load_state_dict puts the optimizer's on its parameters.
        saved = torch.load(folder / TRAINING_STATE, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.scaler.load_state_dict(saved["scaler"])
        set_rng_state(saved["rng"])


def rng_state() -> dict:
    """Every RNG a step draws from, in types that torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],  # type: ignore[attr-defined]
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
