"""What every benchmark runner shares: the settings, the same data and model, and the step clock.

Each runner gets the very same tokenized data (cloudtrain's pipeline), the same model weights (same
seed), the same batch order (EpochShuffleSampler, or LengthGroupedSampler for --group_by_length) and
the same thread count, so only the training loop differs. Not supported: several processes.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

from cloudtrain.config import Config, build_config

if TYPE_CHECKING:
    import torch

    from cloudtrain.data.processing import ProcessedData


@dataclass
class Spec:
    """One benchmark run: which runner, and every setting it trains with."""

    runner: str
    model: str
    steps: int = 10
    batch_size: int = 16
    max_length: int = 64
    eval_samples: int = 160
    threads: int = 0  # 0: torch's default (one per physical core)
    mixed_precision: str = "no"
    fixed_padding: bool = False
    group_by_length: bool = False
    num_workers: int = 0
    pin_memory: bool = False
    torch_compile: bool = False
    adamw: str = "auto"
    keep_freed_memory: bool = True  # every runner's process, as cloudtrain does for CPU training
    seed: int = 42
    learning_rate: float = 1e-4
    cache_dir: str | None = None

    def config(self) -> Config:
        """The cloudtrain Config these settings mean; the other runners read their settings from it too."""
        return build_config(
            {
                "model_name_or_path": self.model,
                "max_length": self.max_length,
                "max_eval_samples": self.eval_samples,
                "cache_dir": self.cache_dir,
                "group_by_length": self.group_by_length,
                "dataloader_num_workers": self.num_workers,
                "dataloader_pin_memory": self.pin_memory,
                "max_steps": self.steps,
                "per_device_train_batch_size": self.batch_size,
                "per_device_eval_batch_size": 64,
                "learning_rate": self.learning_rate,
                "mixed_precision": self.mixed_precision,
                "seed": self.seed,
                "logging_steps": self.steps,
                "eval_strategy": "no",
                "torch_compile": self.torch_compile,
                "adamw_implementation": self.adamw,
                "training_type": "basic" if self.runner == "basic" else "accelerated",
                "report_to": ["none"],
            }
        )

    def to_dict(self) -> dict:
        return asdict(self)


def prepare(spec: Spec) -> tuple[Config, ProcessedData, torch.nn.Module, object]:
    """(config, tokenized data, freshly loaded model, tokenizer), the same for every runner."""
    # Imported here, not at the top: bench/run.py and the data bench's process need only Spec, and
    # transformers.set_seed alone pulls in peft (seconds of every such process's start-up).
    import torch
    from transformers import DataCollatorWithPadding, set_seed

    from cloudtrain.data.sources import connect_data
    from cloudtrain.models import prepare as model_prepare
    from cloudtrain.models.load import load_model, load_tokenizer
    from cloudtrain.tasks import build_task

    if spec.threads:
        torch.set_num_threads(spec.threads)
    cfg = spec.config()
    task = build_task(cfg)
    tokenizer = load_tokenizer(cfg.model)
    data = task.process(connect_data(cfg.data, task.columns(cfg.data)), tokenizer, cfg)
    if spec.fixed_padding:  # the ablation: every batch padded to max_length instead of its longest row
        data.collator = DataCollatorWithPadding(tokenizer, padding="max_length", max_length=spec.max_length)
    set_seed(cfg.training.seed)
    # every runner starts from the same prepared model; each compiles it its own way (--torch_compile)
    model = model_prepare.prepare(load_model(cfg, task, data, tokenizer), cfg, task, stop=model_prepare.compile_model)
    set_seed(cfg.training.seed)
    return cfg, data, model, tokenizer


class StepClock:
    """Times the optimizer steps: time to the first one, then the steady rate over the rest."""

    def __init__(self):
        self.start = time.perf_counter()
        self.step_ends: list[float] = []

    def step_done(self) -> None:
        self.step_ends.append(time.perf_counter())

    def result(self, batch_size: int, samples: int, tokens: int) -> dict:
        """Steady-state rates: batch size over the median step time, first step left out (warm-up,
        compilation). Every runner takes the same batches in the same order, so the medians compare
        like with like, and a burst of load from another tenant of a shared machine moves a median
        far less than a total. Tokens are real (non-padding) ones."""
        ends = [self.start, *self.step_ends]
        steps = [b - a for a, b in pairwise(ends)]
        step_s = statistics.median(steps[1:] if len(steps) > 1 else steps)
        samples_per_s = batch_size / max(step_s, 1e-9)
        return {
            "steps": len(steps),
            "time_to_first_step_s": steps[0],
            "median_step_s": step_s,
            "train_time_s": ends[-1] - self.start,
            "train_samples_per_s": samples_per_s,
            "train_tokens_per_s": samples_per_s * tokens / max(samples, 1),
            "train_samples": samples,
            "train_tokens": tokens,
        }


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
