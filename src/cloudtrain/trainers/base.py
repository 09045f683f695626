"""What both trainers share: the outer loop, optimizer and schedule, evaluation, saving, logging.

A subclass supplies only what differs between a plain PyTorch loop and accelerate: how the model
and data are placed (`setup`), one optimizer step over a window of micro-batches (`train_step`),
and how per-example tensors and counters meet across processes (`gather`, `reduce_sum`).

Gradient accumulation: the micro-batches of one optimizer step are fetched together, so the loss of
each can be divided by the number of examples in the whole window. The update then equals that of
one batch holding all of them, also for a short last window.
"""

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedModel, get_scheduler

from cloudtrain.config import Config
from cloudtrain.data_processing import ProcessedData, eval_dataloader, train_dataloader
from cloudtrain.evaluation import evaluate_model, scalar_metrics
from cloudtrain.tracking import RunLog


@dataclass
class StepStats:
    loss: torch.Tensor  # the window's mean loss, detached, still on the device
    grad_norm: torch.Tensor | float | None  # before clipping; None when clipping is off


@dataclass
class TrainResult:
    global_step: int = 0
    epoch: float = 0.0
    train_loss: float = float("nan")
    runtime_s: float = 0.0
    train_samples: int = 0
    train_tokens: int = 0
    evaluations: list = field(default_factory=list)

    def summary(self) -> dict:
        runtime = max(self.runtime_s, 1e-9)
        return {"global_step": self.global_step, "epoch": round(self.epoch, 4), "train_loss": self.train_loss,
                "train_runtime_s": round(self.runtime_s, 2), "train_samples": self.train_samples,
                "train_samples_per_s": round(self.train_samples / runtime, 2),
                "train_tokens_per_s": round(self.train_tokens / runtime, 1)}


def micro_batch_windows(batches: Iterable[dict], size: int) -> Iterator[list[dict]]:
    """Group micro-batches into the windows of one optimizer step each (the last may be short)."""
    window = []
    for batch in batches:
        window.append(batch)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def count_parameters(model: torch.nn.Module) -> int:
    """All parameters, also when ZeRO-3 has partitioned them (each then holds only its shard)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def summed_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Cross-entropy summed over the batch, so a window can be normalised by its real example count."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    return F.cross_entropy(logits.float(), batch["labels"], reduction="sum")


class Meter:
    """Examples, real (non-padding) tokens and summed loss since the last flush, added across processes.

    Counts stay on the device between logging steps, so the step itself never waits for a host sync.
    """

    def __init__(self, reduce_sum):
        self.reduce_sum = reduce_sum
        self.start = self.last = time.perf_counter()
        self.interval: torch.Tensor | None = None
        self.samples, self.tokens, self.loss_sum = 0, 0, 0.0

    def add(self, window: list[dict], loss_sum: torch.Tensor) -> None:
        tokens = sum(batch["attention_mask"].sum() for batch in window)
        examples = sum(len(batch["labels"]) for batch in window)
        counts = torch.stack([loss_sum.new_tensor(examples), tokens.to(loss_sum), loss_sum]).double()
        self.interval = counts if self.interval is None else self.interval + counts

    def flush(self) -> dict:
        """Totals since the last flush, from every process; one collective per logging step."""
        examples, tokens, loss_sum = self.reduce_sum(self.interval).cpu().tolist()
        self.interval = None
        now = time.perf_counter()
        seconds, self.last = max(now - self.last, 1e-9), now
        self.samples += int(examples)
        self.tokens += int(tokens)
        self.loss_sum += loss_sum
        return {"loss": loss_sum / max(examples, 1), "samples_per_s": examples / seconds,
                "tokens_per_s": tokens / seconds}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; biases and normalisation weights get no weight decay."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.training.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.training.learning_rate)


class Trainer:
    """The outer training loop; subclasses implement the device-specific parts."""

    name = "trainer"

    def __init__(self, cfg: Config, model: PreTrainedModel, data: ProcessedData, run_log: RunLog):
        self.cfg, self.model, self.data, self.run_log = cfg, model, data, run_log
        t = cfg.training
        self.train_dl: DataLoader = train_dataloader(data, t.per_device_train_batch_size, t.seed)
        self.eval_dls = {"validation": eval_dataloader(data.validation, data, t.per_device_eval_batch_size)}
        if data.test is not None:
            self.eval_dls["test"] = eval_dataloader(data.test, data, t.per_device_eval_batch_size)
        self.optimizer = build_optimizer(model, cfg)

    # ------------------------------------------------------------ what subclasses provide
    is_main_process = True
    num_processes = 1
    mode = "plain PyTorch"

    def setup(self) -> None:
        raise NotImplementedError

    def train_step(self, window: list[dict], num_examples: int) -> StepStats:
        raise NotImplementedError

    def gather(self, tensors):
        return tensors

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def move(self, batch: dict) -> dict:
        return batch

    def autocast(self):
        raise NotImplementedError

    def save_model(self, output_dir: Path) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ the loop
    def fit(self) -> TrainResult:
        """Train for the configured steps, logging and evaluating on schedule."""
        self.setup()
        t = self.cfg.training
        steps_per_epoch = math.ceil(len(self.train_dl) / t.gradient_accumulation_steps)
        total_steps = t.max_steps or math.ceil(t.num_train_epochs * steps_per_epoch)
        self.scheduler = get_scheduler(t.lr_scheduler_type, self.optimizer,
                                       num_warmup_steps=round(t.warmup_ratio * total_steps),
                                       num_training_steps=total_steps)
        self._announce(steps_per_epoch, total_steps)

        result, meter = TrainResult(), Meter(self.reduce_sum)
        bar = tqdm(total=total_steps, desc="training", disable=not self.is_main_process, dynamic_ncols=True)
        for epoch in range(math.ceil(total_steps / steps_per_epoch)):
            for window in micro_batch_windows(self.train_dl, t.gradient_accumulation_steps):
                window = [self.move(batch) for batch in window]
                num_examples = sum(len(batch["labels"]) for batch in window)
                stats = self.train_step(window, num_examples)
                self.scheduler.step()
                result.global_step += 1
                result.epoch = epoch + min(1.0, (result.global_step - epoch * steps_per_epoch) / steps_per_epoch)
                meter.add(window, stats.loss * num_examples)
                bar.update(1)
                done = result.global_step >= total_steps
                if done or result.global_step % t.logging_steps == 0:
                    self._log_interval(result, meter.flush(), stats, bar)
                if not done and t.eval_strategy == "steps" and result.global_step % t.eval_steps == 0:
                    self._evaluate_during_training(result, bar)
                if done:
                    break
            if not done and t.eval_strategy == "epoch":
                self._evaluate_during_training(result, bar)
        bar.close()
        result.runtime_s, result.train_samples, result.train_tokens = meter.elapsed(), meter.samples, meter.tokens
        result.train_loss = meter.loss_sum / max(meter.samples, 1)
        return result

    # ------------------------------------------------------------ shared pieces
    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def evaluate(self, split: str) -> dict:
        """Metrics of the current weights on one split, counted over every example exactly once."""
        return evaluate_model(self.model, self.eval_dls[split], len(self.data.label_names),
                              gather=self.gather, move=self.move, autocast=self.autocast)

    def _evaluate_during_training(self, result: TrainResult, bar: tqdm) -> None:
        metrics = self.evaluate("validation")
        result.evaluations.append({"step": result.global_step, **metrics})
        self.run_log.log(scalar_metrics(metrics, "eval"), step=result.global_step)
        if self.is_main_process:
            bar.write(f"eval @ step {result.global_step}: accuracy {metrics['accuracy']:.4f} | "
                      f"macro_f1 {metrics['macro_f1']:.4f} | loss {metrics['loss']:.4f}")

    def _log_interval(self, result: TrainResult, interval: dict, stats: StepStats, bar: tqdm) -> None:
        values = {"train/loss": interval["loss"], "train/learning_rate": self.scheduler.get_last_lr()[0],
                  "train/epoch": round(result.epoch, 4), "train/samples_per_s": interval["samples_per_s"],
                  "train/tokens_per_s": interval["tokens_per_s"]}
        if stats.grad_norm is not None:
            values["train/grad_norm"] = float(stats.grad_norm)
        self.run_log.log(values, step=result.global_step)
        if self.is_main_process:
            bar.write(f"step {result.global_step}/{bar.total} | epoch {values['train/epoch']:.2f} | "
                      f"loss {values['train/loss']:.4f} | lr {values['train/learning_rate']:.2e} | "
                      f"{values['train/samples_per_s']:.1f} samples/s | {values['train/tokens_per_s']:.0f} tokens/s")

    def _announce(self, steps_per_epoch: int, total_steps: int) -> None:
        t = self.cfg.training
        effective = t.per_device_train_batch_size * self.num_processes * t.gradient_accumulation_steps
        if self.is_main_process:
            params = count_parameters(self.model)
            print(f"{self.name}: {len(self.data.train)} training examples, {params / 1e6:.1f}M parameters, "
                  f"{self.num_processes} process(es) on {self._device.type} ({self.mode}), effective batch {effective} "
                  f"({t.per_device_train_batch_size} per device x {self.num_processes} x "
                  f"{t.gradient_accumulation_steps} accumulation), {total_steps} steps "
                  f"({steps_per_epoch} per epoch)", flush=True)
