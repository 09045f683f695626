"""AcceleratedTrainer: the same loop through Hugging Face accelerate.

Differences from the BasicTrainer, and nothing else: `accelerator.prepare` places the model and
shards the data across processes, `accelerator.backward` handles mixed precision, `no_sync` skips
the gradient all-reduce on all but the last micro-batch of a window, `clip_grad_norm_` and
`gather_for_metrics` work across processes, and saving gathers the full state dict first.

Supports: one process (CPU or GPU), fp16 (GPU) and bf16 mixed precision, gradient accumulation.
"""

import contextlib
from pathlib import Path

import torch
from accelerate import Accelerator

from cloudtrain.trainers.base import StepStats, Trainer, summed_loss


class AcceleratedTrainer(Trainer):
    name = "AcceleratedTrainer"

    def setup(self) -> None:
        t = self.cfg.training
        self.accelerator = Accelerator(mixed_precision=t.mixed_precision,
                                       gradient_accumulation_steps=t.gradient_accumulation_steps)
        # The scheduler stays outside prepare(): the base loop steps it once per optimizer step.
        self.model, self.optimizer, self.train_dl, *eval_dls = self.accelerator.prepare(
            self.model, self.optimizer, self.train_dl, *self.eval_dls.values())
        self.eval_dls = dict(zip(self.eval_dls, eval_dls))
        self.is_main_process = self.accelerator.is_main_process
        self.num_processes = self.accelerator.num_processes

    def autocast(self):
        return contextlib.nullcontext()  # prepare() already wrapped the model's forward in autocast

    def gather(self, tensors):
        return self.accelerator.gather_for_metrics(tensors)

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    def train_step(self, window: list[dict], num_examples: int) -> StepStats:
        accelerator, k = self.accelerator, self.cfg.training.gradient_accumulation_steps
        window_loss = 0.0
        for i, batch in enumerate(window):
            last = i == len(window) - 1
            accelerator.sync_gradients = last  # the accumulation boundary (DeepSpeed reads it too)
            with contextlib.nullcontext() if last else accelerator.no_sync(self.model):
                loss = summed_loss(self.model, batch) / num_examples
                accelerator.backward(loss * k)  # backward() divides by k; the window mean is already exact
            window_loss += loss.detach()
        grad_norm = None
        if self.cfg.training.max_grad_norm > 0:
            grad_norm = accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.training.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(loss=window_loss, grad_norm=grad_norm)

    def save_model(self, output_dir: Path) -> None:
        state_dict = self.accelerator.get_state_dict(self.model)  # every rank: ZeRO-3 gathers here
        if self.is_main_process:
            self.accelerator.unwrap_model(self.model).save_pretrained(output_dir, state_dict=state_dict)
        self.accelerator.wait_for_everyone()
