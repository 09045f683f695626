"""Asynchronous checkpoints (--async_checkpointing true): the loop is blocked only while a CPU snapshot is taken.

What a checkpoint holds (weights, optimizer, schedule, scaler, RNG states, the trainer state) is copied to
CPU memory synchronously, so the live tensors may change from the next step on; a background thread then
writes the files, seals and renames the folder (`Checkpointer.save_async`). At most one save is in flight:
the next save, and the end of the run, wait for it. An error in the thread is kept and raised in the main
thread at the next step, as one line.

With several processes each one snapshots and writes its own part; the threads then meet (every part is
complete before the folder is sealed and renamed, as for a synchronous save) in a process group of their
own (`ThreadCollectives`): collectives of the launch's group from two threads at once could pair one
thread's barrier with the other's all-reduce.
"""

from __future__ import annotations

import copy
import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import _remove_duplicate_names  # the rule save_model and load_model share

from cloudtrain.errors import UserError, first_line


def cpu_copy(value: Any) -> Any:
    """A deep copy of nested dicts, lists and tuples with every tensor copied to CPU memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: cpu_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [cpu_copy(item) for item in value]
    if isinstance(value, tuple):
        return tuple(cpu_copy(item) for item in value)
    return copy.deepcopy(value)  # numbers, strings, numpy arrays: cheap, and never changed in place by us


def weights_snapshot(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A CPU copy of a state dict as safetensors' `save_model` writes it: tied tensors once (safetensors
    refuses shared storage), under the name `load_model` looks for, the dropped names in the metadata."""
    state = dict(state_dict)
    metadata: dict[str, str] = {}
    for kept, dropped in _remove_duplicate_names(state).items():
        for name in dropped:
            metadata[name] = kept
            del state[name]
    return {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in state.items()}, metadata


class BackgroundSave:
    """One background save at a time; its error, if any, is raised by `wait` or `check` in the caller (`timeout`:
    --collective_timeout, named where a peer's save hung)."""

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, work: Callable[[], None], name: str) -> None:
        self.wait()  # at most one in flight: two would write and rotate the same folder at once
        self._thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as err:  # kept for the main thread, which owns the run's error handling
            self._error = err

    def wait(self) -> None:
        """Block until the save in flight (if any) is written; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def check(self) -> None:
        """Raise, as one line, the error of a save that failed in the background (once)."""
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, UserError):
            raise error
        from cloudtrain.parallel.runtime import collective_failure  # (its module imports accelerate)

        what = collective_failure(error, self.timeout) if self.timeout else None  # a peer's save hung or died
        raise UserError(
            f"the asynchronous checkpoint save failed ({what or f'{type(error).__name__}: {first_line(error)}'}); "
            "the earlier checkpoints are intact: resume with --resume_from_checkpoint latest"
        ) from error


class ThreadCollectives:
    """The background save's barrier and broadcast, in a gloo group of its own (made by every process, in the
    main thread, at the first asynchronous save: creating a group is itself a collective of the launch), whose
    collectives wait `timeout` seconds (--collective_timeout) for the other processes' saves."""

    def __init__(self, timeout: float | None) -> None:
        wait = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.group = dist.new_group(backend="gloo", timeout=wait)

    @staticmethod
    def needed() -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def share(self, value: Any) -> Any:
        """The main process's `value` on every process (the main process is rank 0, as in Runtime.share)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
