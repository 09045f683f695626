"""What the loop counts between logging steps, without waiting on the host.

Examples (rows), real (non-padding) tokens, the summed loss, the summed squared sequence lengths (for
the attention FLOPs) and what the loss sums over stay on the device from step to step; `Meter.flush`
adds them over every process into the run's totals in one all-reduce, at the logging step.
"""

import math
import time
from dataclasses import dataclass

import torch

from cloudtrain.checkpointing import TrainerState
from cloudtrain.observe.flops import attention_squared_lengths
from cloudtrain.parallel.runtime import Runtime


@dataclass
class StepStats:
    """What a trainer's `backward_window` returns for one optimizer step."""

    loss_sum: torch.Tensor  # this process's summed loss over the window, detached, still on the device
    count: torch.Tensor  # what it sums over (rows or tokens), on the device
    grad_norm: torch.Tensor | float | None  # before clipping; None when clipping is off


def norm_scalar(norm: torch.Tensor | float | None, like: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a device scalar like `like` (nan for none), without a blocking copy."""
    if norm is None or isinstance(norm, float):  # DeepSpeed's is a float: a fill, not a blocking copy
        return like.new_full((), math.nan if norm is None else norm)
    if hasattr(norm, "full_tensor"):  # FSDP2's is a replicated DTensor
        return norm.full_tensor().to(like)
    return norm.to(like)


class Meter:
    """The sums since the last logging step, over applied steps only; and each step's summed loss, count
    and gradient norm (for the anomaly detector). `flush` turns them into the interval's numbers."""

    def __init__(self, runtime: Runtime, state: TrainerState, device: torch.device):
        self.reduce_sum, self.state = runtime.reduce_sum, state
        self.processes, self.index = runtime.count, runtime.index
        self.start = time.perf_counter()
        self.last = self.start - state.interval_s  # a resume's pending sums: their rates over their own time too
        self.excluded = 0.0  # seconds since `last` that were not training (evaluations, saves): no rate counts them
        sums = list(state.interval) + [0.0] * (4 - len(state.interval))  # checkpoints before the 4th sum had 3
        if len(sums) == 4:  # ... and before the 5th, the loss summed over examples
            sums.append(sums[0])
        self.interval = torch.tensor(sums, dtype=torch.float64, device=device)
        self.steps: list[torch.Tensor] = []  # per step since the last flush: [loss sum, count, grad norm]

    def add(self, window: list[dict], stats: StepStats, applied: torch.Tensor) -> None:
        masks = [batch["attention_mask"] for batch in window]  # real tokens (a causal LM's model never sees it)
        loss_sum = stats.loss_sum.double()
        values = torch.stack(
            [
                sum(real_rows(batch) for batch in window).to(loss_sum),  # type: ignore[union-attr]
                sum(m.sum() for m in masks).to(loss_sum),
                loss_sum,
                sum(attention_squared_lengths(batch) for batch in window).to(loss_sum),  # type: ignore[union-attr]
                stats.count.to(loss_sum),
            ]
        )
        self.interval += torch.where(applied, values, 0.0)  # a skipped step's nan must not reach the sums
        self.steps.append(torch.stack([loss_sum, values[4], norm_scalar(stats.grad_norm, loss_sum)]))

    def pending(self) -> list[float]:
        """The not yet logged sums of every process (a collective), for a checkpoint."""
        return self.reduce_sum(self.interval.clone()).cpu().tolist()

    def flush(self, local: list[float] | None = None) -> dict:
        """Totals since the last flush, from every process, in one collective. `local` (this process's own
        numbers) comes back as `by_process`: every process's list, on every process."""
        local = local or []
        width, n = len(local), len(self.steps)
        slots = torch.zeros(self.processes * width, dtype=torch.float64, device=self.interval.device)
        slots[self.index * width : (self.index + 1) * width] = torch.tensor(local, dtype=torch.float64)
        steps = torch.stack(self.steps).to(slots) if self.steps else torch.zeros(0, 3).to(slots)
        norms = steps[:, 2] if self.index == 0 else torch.zeros_like(steps[:, 2])  # the same everywhere: once
        total = self.reduce_sum(torch.cat([self.interval, steps[:, :2].flatten(), norms, slots])).cpu().tolist()
        examples, tokens, loss_sum, squared_lengths, count = total[:5]
        per_step, norms_read = total[5 : 5 + 2 * n], total[5 + 2 * n : 5 + 3 * n]
        self.interval.zero_()
        self.steps.clear()
        seconds, self.last, self.excluded = max(self.since_logged(), 1e-9), time.perf_counter(), 0.0
        self.state.samples += int(examples)
        self.state.tokens += int(tokens)
        self.state.loss_sum += loss_sum
        self.state.loss_count += int(count)
        return {
            "loss": loss_sum / count if count else None,  # None: every step of the interval was skipped
            "samples_per_s": examples / seconds,
            "tokens_per_s": tokens / seconds,
            "tokens": tokens,
            "squared_lengths": squared_lengths,
            "seconds": seconds,
            "step_losses": [s / c if c else math.nan for s, c in zip(per_step[::2], per_step[1::2], strict=True)],
            "grad_norms": norms_read,
            "by_process": [total[5 + 3 * n + r * width : 5 + 3 * n + (r + 1) * width] for r in range(self.processes)],
        }

    def exclude(self, seconds: float) -> None:
        """Seconds of the interval that were not training: the rates divide by the rest."""
        self.excluded += seconds

    def since_logged(self) -> float:
        """The training seconds of the sums not yet logged."""
        return time.perf_counter() - self.last - self.excluded

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def real_rows(batch: dict) -> torch.Tensor:
    """The rows of a batch with a real token (a pipeline pads whole rows); a context-parallel slice counts the
    rows its group's first process counts (`counted_rows`, cloudtrain.parallel.context), each row once."""
    counted = batch.get("counted_rows")
    return (batch["attention_mask"].any(dim=1) if counted is None else counted).sum()
