"""--profile: a torch.profiler trace of a few training steps, as a loop hook (cloudtrain.training.hooks).

The hook exists only when --profile is on, on the main process, so a run without it pays nothing. It
starts the profiler before the first step with a schedule that records nothing until the step before
--profile_steps' first (a warm-up step, so the first profiled step does not carry the profiler's own
start-up), records first..last, and writes one Chrome-trace JSON file when the last of them ends (or
when the run ends sooner). A step, as traced, runs from the end of the previous step's hooks to the end
of its own: the wait for its batch, forward, backward, the optimizer step and the hooks after it.

The file, `<profile dir>/steps_<first>-<last>.pt.trace.json`, opens in Perfetto (ui.perfetto.dev) or
chrome://tracing, and in TensorBoard with the torch-tb-profiler plugin (`tensorboard --logdir <dir>`). One
line sums it up (`summarize`, which bench/gpu.py also uses): the share of kernel time (on CPU: of the aten
ops' own time) in attention, matmuls, the optimizer, copies and the rest, how busy the device was, the host's
wait for data, and the top kernels.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from cloudtrain.config.run import profile_window
from cloudtrain.training.hooks import Hook, LoopState, Request

if TYPE_CHECKING:
    from cloudtrain.training.trainer import Trainer

__all__ = ["ProfileHook", "profile_hooks", "summarize", "summary_line", "timed_events"]

CATEGORIES = (  # checked in order on the lower-cased kernel (CPU: aten op) name
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|varlen")),
    ("matmul", re.compile(r"gemm|matmul|aten::mm$|aten::addmm|aten::bmm|cutlass|xmma|nvjet|cublas|wgmma")),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|optimizer")),
    ("copy", re.compile(r"memcpy|memset|aten::copy_")),
)


class ProfileHook(Hook):
    """Traces optimizer steps first..last (counted from 1, as the run log counts them) into `folder`."""

    outside_training = True  # writing the trace is not training time: the interval's rates leave it out

    def __init__(self, folder: Path, first: int, last: int, device: torch.device):
        self.folder, self.first, self.last = Path(folder), first, last
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler: profile | None = None
        self.say: Callable[[str], None] = print
        self.window = (first, last)  # what is traced: first moves on after a resume past it, last ends with the run
        self.reached = 0  # the last step ended under the profiler: a run that stops early traces fewer
        self.path: Path | None = None  # the trace, once written

    def on_train_start(self, loop: LoopState) -> None:
        self.say = loop.bar.write
        done, total = loop.step, loop.total_steps  # after a resume, the steps already trained
        asked = f"--profile_steps {self.first}:{self.last}"
        if self.last <= done:
            self.say(f"{asked}: the run resumes after step {done}, nothing to profile")
            return
        if self.first > total:
            self.say(f"{asked}: the run ends at step {total}, nothing to profile; give steps within 1:{total}")
            return
        first, last = max(self.first, done + 1), min(self.last, total)
        if last < self.last:
            self.say(f"{asked}: the run ends at step {total}; profiling steps {first}-{last}")
        warmup = 1 if first - 1 > done else 0
        self.window = (first, last)
        with warnings.catch_warnings():  # no warm-up when the first step is profiled: torch warns, we know
            warnings.simplefilter("ignore", UserWarning)
            steps = schedule(wait=first - 1 - done - warmup, warmup=warmup, active=last - first + 1, repeat=1)
        this = done + 1  # the trace's ProfilerStep#N is the run log's step N: torch counts from where it starts
        self.profiler = profile(
            activities=self.activities,
            schedule=lambda n: steps(max(n - this, 0)),
            on_trace_ready=self._write,
            record_shapes=True,
        )
        self.profiler.step_num = this
        self.profiler.start()

    def on_step_end(self, loop: LoopState) -> Request | None:
        if self.profiler is not None:
            self.reached = loop.step  # (the last active step's profiler.step() writes the trace)
            self.profiler.step()
            if loop.step >= self.window[1]:
                self._stop()
        return None

    def on_train_end(self, loop: LoopState) -> None:
        self._stop()

    def close(self) -> None:
        self._stop()  # a run that ends early still writes the steps it profiled

    def _stop(self) -> None:
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.stop()

    def _write(self, profiler: profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        first, last = self.window[0], min(self.window[1], self.reached)
        path = self.folder / f"steps_{first}-{last}.pt.trace.json"
        profiler.export_chrome_trace(str(path))
        self.path = path
        self.say(f"profile of steps {first}-{last} written to {path} (open it in ui.perfetto.dev or TensorBoard)")
        cuda = ProfilerActivity.CUDA in self.activities
        self.say("  " + summary_line(summarize(profiler, last - first + 1, cuda)))


def profile_hooks(trainer: Trainer, device: torch.device) -> list[Hook]:
    """[ProfileHook] for --profile on the main process, else []: the hook list of a run without it is unchanged."""
    cfg = trainer.cfg.monitoring
    if not cfg.profile or not trainer.is_main_process:
        return []
    first, last = profile_window(cfg.profile_steps)
    folder = Path(cfg.profile_dir) if cfg.profile_dir else trainer.run_log.output_dir / "profile"
    return [ProfileHook(folder, first, last, device)]


def category(name: str) -> str:
    """attention, matmul, optimizer, copy or other, by a kernel's or an op's name."""
    low = name.lower()
    return next((cat for cat, pattern in CATEGORIES if pattern.search(low)), "other")


@dataclass(frozen=True)
class Timed:
    """One profiled event, as the summary needs it: its name, whether it ran on the GPU, its duration and (for a
    host event) the part of it not spent in host events nested inside it, in microseconds."""

    name: str
    gpu: bool
    us: float
    self_us: float
    annotation: bool


# torch's own bookkeeping ops, which its event list leaves out too
_UTILITY = {"profiler::_record_function_enter", "profiler::_record_function_enter_new"}
_UTILITY |= {"profiler::_record_function_exit", "aten::is_leaf", "aten::output_nr", "aten::_version"}


def timed_events(profiler: profile) -> list[Timed]:
    """The events of a stopped profiler, read from kineto's records directly. `profiler.events()` builds a
    Python object per event first: 2.7 s for 69k events on this CPU, against 0.04 s here, once per profile."""
    results = getattr(profiler.profiler, "kineto_results", None)
    if results is None:
        return []
    kept = [e for e in results.events() if e.name() not in _UTILITY and not _hidden(e)]
    children_us = _nested_host_time(kept)
    return [
        Timed(
            e.name(),
            e.device_type() != DeviceType.CPU,
            e.duration_ns() / 1000,
            (e.duration_ns() - children_us.get(i, 0)) / 1000,
            e.is_user_annotation(),
        )
        for i, e in enumerate(kept)
    ]


def _hidden(event) -> bool:
    return getattr(event, "is_hidden_event", lambda: False)()  # newer torch marks some events hidden


def _nested_host_time(events: list) -> dict[int, int]:
    """Nanoseconds of host events directly inside each host event (by index), per thread, as torch nests them:
    a child lies within its parent's interval; async events (ending on another thread) nest nothing."""
    by_thread: dict[int, list[int]] = {}
    for i, e in enumerate(events):
        if e.device_type() == DeviceType.CPU and not e.is_async() and e.start_thread_id() == e.end_thread_id():
            by_thread.setdefault(e.start_thread_id(), []).append(i)
    nested: dict[int, int] = {}
    for indices in by_thread.values():
        indices.sort(key=lambda i: (events[i].start_ns(), -events[i].end_ns()))
        open_: list[int] = []  # each interval holds all those below it
        for i in indices:
            start, end = events[i].start_ns(), events[i].end_ns()
            while open_ and (start >= events[open_[-1]].end_ns() or end > events[open_[-1]].end_ns()):
                open_.pop()
            if open_:
                nested[open_[-1]] = nested.get(open_[-1], 0) + end - start
            open_.append(i)
    return nested


def summarize(profiler: profile, steps: int, cuda: bool) -> dict:
    """Where `steps` profiled steps' time went, from a stopped profiler: device kernels on CUDA (on CPU, the aten
    ops' self time) by category and the top ones, the host's time in DataLoader.__next__, the step time."""
    events = timed_events(profiler)
    host = [e for e in events if not e.gpu]
    step_us = sum(e.us for e in host if e.name.startswith("ProfilerStep"))
    busy: dict[str, float] = {}
    for e in events:
        if e.annotation or e.name.startswith("ProfilerStep"):
            continue  # a range marked on the GPU's timeline (record_function), not a kernel
        if cuda and e.gpu:
            busy[e.name] = busy.get(e.name, 0.0) + e.us
        elif not cuda and e.name.startswith("aten::") and e.self_us > 0:
            busy[e.name] = busy.get(e.name, 0.0) + e.self_us
    total = sum(busy.values()) or 1.0
    shares = dict.fromkeys([c for c, _ in CATEGORIES] + ["other"], 0.0)
    for name, us in busy.items():
        shares[category(name)] += us / total
    data_us = sum(e.us for e in host if e.name.startswith("enumerate(DataLoader)"))
    top = sorted(busy.items(), key=lambda item: -item[1])[:8]
    return {
        "steps": steps,
        "ms_per_step": step_us / 1000 / max(steps, 1),
        "device_busy": sum(busy.values()) / step_us if step_us else None,
        "shares": shares,
        "data_wait": data_us / step_us if step_us else None,
        "top": [{"name": n[:120], "ms_per_step": us / 1000 / max(steps, 1), "share": us / total} for n, us in top],
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def summary_line(summary: dict) -> str:
    """`summarize`'s result as one line."""
    shares = " | ".join(f"{k} {v:.0%}" for k, v in summary["shares"].items())
    top = ", ".join(f"{t['name'][:60]} {t['share']:.0%}" for t in summary["top"][:4])
    return (
        f"{summary['steps']} step{'s' * (summary['steps'] != 1)}, {summary['ms_per_step']:.0f} ms/step:"
        f" {shares} of kernel time; busy "
        f"{_pct(summary['device_busy'])} of the step; data wait {_pct(summary['data_wait'])}; top: {top}"
    )
