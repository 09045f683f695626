"""BasicTrainer: the plain PyTorch loop, with manual device placement.

Supports: one process on CUDA (when present) or CPU; gradient accumulation; clipping; fp16 (CUDA,
with a GradScaler) and bf16 autocast. Does not support: several processes or DeepSpeed; use the
AcceleratedTrainer (`--training_type accelerated`) for those.
"""

import contextlib
from pathlib import Path

import torch

from cloudtrain.trainers.base import StepStats, Trainer, summed_loss

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class BasicTrainer(Trainer):
    name = "BasicTrainer"

    @staticmethod
    def pick_device() -> torch.device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def setup(self) -> None:
        self.device = self.pick_device()
        self.model.to(self.device)
        self.model.train()
        # fp16 needs loss scaling against underflow; bf16 and fp32 do not (a disabled scaler is a no-op)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.cfg.training.mixed_precision == "fp16")

    def autocast(self):
        dtype = AUTOCAST_DTYPES.get(self.cfg.training.mixed_precision)
        return torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def move(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self, window: list[dict], num_examples: int) -> StepStats:
        window_loss = 0.0
        for batch in window:
            with self.autocast():
                loss = summed_loss(self.model, batch) / num_examples
            self.scaler.scale(loss).backward()
            window_loss += loss.detach()
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = None
        if self.cfg.training.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.training.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(loss=window_loss, grad_norm=grad_norm)

    def save_model(self, output_dir: Path) -> None:
        self.model.save_pretrained(output_dir)
