"""The input path of a training step on the device: batches copied on a side stream, and the time the
device waits for them.

On CUDA each batch is copied on a stream of its own (non-blocking, from pinned memory), so the copy runs
beside the kernels of the step before it, and the compute stream waits for it on the device: the host
never waits. The data time is what the GPU itself waits for input, measured with CUDA events and read at
the logging step, where the loop syncs anyway. On CPU batches are placed as they come and time is
the host's. Why the look-ahead depends on the loader's workers: docs/fault-tolerance.md.
"""

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from cloudtrain.observe.monitoring import StepClock


def prefetch(
    batches: Iterable[dict], move: Callable[[dict], dict], device: torch.device, ahead: int = 0
) -> Iterator[dict]:
    """`batches` in their order, each placed by `move` on `device`; `ahead` more batches are fetched and
    copied before one is handed over (0: fetched when the step asks for it, as without prefetching)."""
    copies = CudaCopies(device) if device.type == "cuda" else HostCopies()
    pending: deque = deque()
    for batch in batches:
        pending.append(copies.issue(move, batch))
        if len(pending) > ahead:
            yield copies.hand_over(pending.popleft())
    while pending:
        yield copies.hand_over(pending.popleft())


class HostCopies:
    """Placement where the host computes: at once, nothing to wait for."""

    def issue(self, move: Callable[[dict], dict], batch: dict) -> Any:
        return move(batch)

    def hand_over(self, issued: Any) -> dict:
        return issued


class CudaCopies(HostCopies):
    """Copies on a stream of their own; the compute stream waits for each on the device when it is handed
    over, and the allocator keeps the batch's memory (allocated on the copy stream) until the compute
    stream is done with it."""

    def __init__(self, device: torch.device):
        self.device, self.stream = device, torch.cuda.Stream(device)

    def issue(self, move: Callable[[dict], dict], batch: dict) -> Any:
        with torch.cuda.stream(self.stream):
            placed = move(batch)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return placed, copied

    def hand_over(self, issued: Any) -> dict:
        batch, copied = issued
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(copied)
        for value in batch.values():
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                value.record_stream(compute)
        return batch


class InputClock(StepClock):
    """The StepClock, with a step's time and its data wait on CUDA taken on the GPU's own timeline: events
    where the loop begins to wait for a step's batches, where they are ready on the compute stream, and
    where the step ends. The wait is the time the GPU had nothing to run before the step's first kernel
    (a host running ahead of it shows none); the events are read at the logging step."""

    def __init__(self, device: torch.device, event: Callable[[], Any] | None = None):
        super().__init__(device)
        self._event = event or _cuda_event  # a timing event recorded on the current stream now
        self._started: Any = None
        self._ready: Any = None
        self._timed: list[tuple[Any, Any, Any]] = []

    def start_step(self) -> None:
        super().start_step()
        if self.cuda:
            self._started = self._ready = self._event()

    def data_ready(self) -> None:
        if self.cuda:
            self._ready = self._event()
        else:
            super().data_ready()

    def end_step(self) -> None:
        if not self.cuda:
            super().end_step()
            return
        assert self._started is not None and self._ready is not None, "start_step() comes first"
        self._timed.append((self._started, self._ready, self._event()))
        self.steps += 1

    def read(self) -> list[float]:
        if self._timed:
            self._timed[-1][2].synchronize()  # the logging step's sync: the last event, so every one, has run
            for started, ready, ended in self._timed:
                self.data_s += started.elapsed_time(ready) / 1000
                self.step_s += started.elapsed_time(ended) / 1000
            self._timed.clear()
        return super().read()


def _cuda_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
