"""What a long run logs about itself beyond the loss, and the anomalies it warns about.

At each logging step (`--monitoring true`, the default):
    train/step_time_s        mean wall time of an optimizer step (data, forward, backward, optimizer)
    train/data_time_share    the part of it spent waiting for the data loader (an input-bound run shows here)
    train/peak_memory_gib    CUDA: peak allocated per device (and train/peak_reserved_gib); CPU: peak
                             resident set size of a process; the largest over all processes

Anomalies, each one warning line on the main process, an `anomaly/<kind>` value and an event line in
metrics.jsonl, and a W&B alert when W&B is online:
    loss_spike        a step's loss above the running mean by --loss_spike_threshold standard deviations
    grad_norm_spike   the same for the gradient norm (--grad_norm_spike_threshold; needs clipping on), when it is
                      also over GRAD_NORM_OVER_MAX times the largest of the last RECENT_STEPS steps' norms
    throughput_drop   tokens per second of step time below --throughput_drop_ratio (half) of the running median
                      of earlier intervals, two logging intervals in a row (an interval whose every step was
                      skipped, --nonfinite_loss skip, trained no tokens and is left out)
    straggler         with several processes: one process's own work (data loading and forward passes)
                      above --straggler_ratio (1.5) times the median of the other processes; once when it begins.
                      Under ZeRO-3 a forward pass gathers parameters, so it waits on the others too.
    memory_pressure   a process's peak memory (CUDA: the larger of allocated and reserved; CPU: resident
                      set size) above MEMORY_WARNING_SHARE of its device's memory (CUDA: the GPU's; CPU:
                      the machine's RAM); once, since the peak only grows: a longer batch may run out

Every process sees the same numbers (they arrive through the logging step's one all-reduce) and runs the
same detector, so all agree on what to do with `--on_anomaly warn|checkpoint|stop` without another
collective (memory_pressure only warns: WARN_ONLY). Not watched: evaluation and checkpoint time (they are left
out of step time), and which pipeline stage is slow (a pipeline process's forward passes run inside the schedule).
"""

import contextlib
import itertools
import math
import os
import resource
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from cloudtrain.config import MonitoringConfig

WARMUP_STEPS = 10  # steps of running statistics before a spike can be judged
WINDOW = 100  # steps (or logging intervals) the running statistics cover
# A gradient norm is heavy-tailed, and it climbs while a fine-tune's loss falls fastest: a spike in it must also be
# unlike the steps just before it, more than this many times their largest (the loss needs no such floor). Recent
# steps only: a large norm long ago (the first steps of a run) must not hide a spike now.
GRAD_NORM_OVER_MAX = 2.0
RECENT_STEPS = 20
STRAGGLER_MIN_S = 0.005  # per step: smaller gaps are noise, not a straggler
GIB = 2**30
MEMORY_WARNING_SHARE = 0.9  # of the device's memory: above it, the next longer batch may be out of memory
# Anomalies that only warn, whatever --on_anomaly says: a checkpoint does not lower a peak, and a stop on it stopped
# again after every resume (the peak comes back within one logging interval)
WARN_ONLY = ("memory_pressure",)


@dataclass
class Anomaly:
    kind: str
    step: int
    value: float
    message: str


class StepClock:
    """This process's time since the last logging step: whole steps, data waits, forward passes.

    Forward passes on CUDA are timed with events (read at the logging step, where the loop syncs
    anyway); on CPU with the wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.step_s = self.data_s = self.forward_s = 0.0
        self.steps = 0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._mark = time.perf_counter()

    def start_step(self) -> None:
        """Called where the loop begins to wait for a step's data; what came before (logging, evaluation,
        saving) is not step time."""
        self._mark = time.perf_counter()

    def data_ready(self) -> None:
        self.data_s += time.perf_counter() - self._mark

    def end_step(self) -> None:
        self.step_s += time.perf_counter() - self._mark
        self.steps += 1

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self.forward_s += time.perf_counter() - began

    def read(self) -> list[float]:
        """[steps, step seconds, data seconds, forward seconds] since the last read."""
        if self._events:
            torch.cuda.synchronize()
            self.forward_s += sum(start.elapsed_time(end) for start, end in self._events) / 1000
            self._events.clear()
        values = [float(self.steps), self.step_s, self.data_s, self.forward_s]
        self.step_s = self.data_s = self.forward_s = 0.0
        self.steps = 0
        return values


def peak_memory(device: torch.device) -> list[float]:
    """[peak allocated, peak reserved] GiB of this process's CUDA device, or [peak RSS, 0] on CPU."""
    if device.type == "cuda":
        return [torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return [rss / (GIB if sys.platform == "darwin" else 2**20), 0.0]


CGROUP_ROOT, OWN_CGROUPS = Path("/sys/fs/cgroup"), Path("/proc/self/cgroup")


def cgroup_limit_files() -> list[Path]:
    """The memory-limit files of this process's cgroup and of every cgroup above it, v2 and v1: a limit set on a
    parent (a nested container, a systemd slice, a SLURM job step) binds as much as one set on its own."""
    root = CGROUP_ROOT
    try:
        lines = OWN_CGROUPS.read_text().splitlines()
    except OSError:
        lines = []
    places = []  # (the hierarchy's folder, the limit file's name, this process's cgroup path in it)
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            places.append((root, "memory.max", path))
        elif "memory" in controllers.split(","):
            places.append((root / "memory", "memory.limit_in_bytes", path))
    places = places or [(root, "memory.max", "/"), (root / "memory", "memory.limit_in_bytes", "/")]
    files = []
    for folder, name, path in places:
        parts = [part for part in path.split("/") if part]
        files += [folder.joinpath(*parts[:depth], name) for depth in range(len(parts), -1, -1)]
    return files


def device_memory_gib() -> float:
    """The memory of this process's device: its CUDA device's, else the machine's RAM or the smallest limit of the
    container's cgroups, whichever is less (the container's OOM killer acts at its limit, long before the host's
    RAM is full)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in cgroup_limit_files():
        try:
            limit = path.read_text().strip()
        except OSError:
            continue
        if limit.isdigit():  # "max" (v2) or a number near 2**63 (v1): no limit
            ram = min(ram, int(limit))
    return ram / GIB


def interval_values(by_process: list[list[float]], device: torch.device) -> dict:
    """Step time, data share and peak memory from every process's [steps, step s, data s, forward s,
    memory, reserved memory] of the interval (`Meter.flush`); empty with --monitoring false."""
    if not measured(by_process):
        return {}
    steps = sum(p[0] for p in by_process)
    step_s, data_s = sum(p[1] for p in by_process), sum(p[2] for p in by_process)
    values = {
        "train/step_time_s": step_s / steps,
        "train/data_time_share": data_s / max(step_s, 1e-9),
        "train/peak_memory_gib": max(p[4] for p in by_process),
    }
    if device.type == "cuda":
        values["train/peak_reserved_gib"] = max(p[5] for p in by_process)
    return values


def measured(by_process: list[list[float]]) -> bool:
    """Whether the interval brought every process's clock (--monitoring true, and a step was timed)."""
    return bool(by_process and by_process[0] and by_process[0][0])


class RunningStats:
    """Mean and standard deviation of the last WINDOW accepted values; `over_max`: a spike must also be more than
    this many times the largest of the last RECENT_STEPS of them (0: no such floor)."""

    def __init__(self, over_max: float = 0.0) -> None:
        self.values: deque[float] = deque(maxlen=WINDOW)
        self.over_max = over_max

    def spike(self, value: float, threshold: float) -> tuple[float, float] | None:
        """(mean, std) if `value` is above mean + threshold * std (and above the floor)."""
        if not math.isfinite(value):
            return None
        if threshold > 0 and len(self.values) >= WARMUP_STEPS:
            mean, std = statistics.fmean(self.values), statistics.pstdev(self.values)
            std = max(std, 1e-3 * abs(mean))  # a flat curve: a tiny wobble is no spike
            if value > mean + threshold * std and value > self.over_max * self.recent_max():
                # enters clipped: one spike barely moves the statistics, a lasting new level becomes normal
                self.values.append(mean + threshold * std)
                return mean, std
        self.values.append(value)
        return None

    def recent_max(self) -> float:
        """The largest of the last RECENT_STEPS accepted values (read only for a value already above the mean)."""
        return max(itertools.islice(self.values, max(len(self.values) - RECENT_STEPS, 0), None))


class AnomalyDetector:
    """Judges each logging interval's numbers; the same inputs give the same verdict on every process."""

    def __init__(
        self, cfg: MonitoringConfig, places: list[str], memory_gib: float | None = None, stragglers: bool = True
    ):
        """`places[r]`: how to name process r in a message (its node and host); `memory_gib`: a device's
        memory (default: this process's device, device_memory_gib); `stragglers`: whether the processes' own
        work is timed apart from waiting for each other (not in a pipeline's schedule), so stragglers can be told."""
        self.cfg, self.places, self.stragglers = cfg, places, stragglers
        self.memory_gib = memory_gib or device_memory_gib()
        self.memory_warned = False  # peaks are since the start: one warning says it
        self.loss, self.grad_norm = RunningStats(), RunningStats(over_max=GRAD_NORM_OVER_MAX)
        self.throughputs: deque[float] = deque(maxlen=WINDOW)
        self.slow = 0  # logging intervals in a row under half the median throughput
        self.straggler: int | None = None  # the process reported as a straggler, while it stays one

    def check(self, step: int, interval: dict) -> list[Anomaly]:
        """The anomalies of the logging interval that ends at `step` (its numbers from `Meter.flush`)."""
        first = step - len(interval["step_losses"]) + 1
        found = self.check_steps(list(range(first, step + 1)), interval["step_losses"], interval["grad_norms"])
        by_process = interval["by_process"]
        if measured(by_process):
            step_s = sum(p[1] for p in by_process) / len(by_process)
            work = [(p[2] + p[3]) / max(p[0], 1) for p in by_process]  # data + forward: no waiting on others
            # every step of the interval skipped (--nonfinite_loss skip): no tokens trained, no throughput to judge
            rate = interval["tokens"] / max(step_s, 1e-9) if interval["tokens"] else None
            found += self.check_interval(step, rate, work)
            found += self.check_memory(step, [max(p[4], p[5]) for p in by_process])
        return found

    def check_memory(self, step: int, peaks: list[float]) -> list[Anomaly]:
        """`peaks[r]`: process r's peak memory in GiB so far; a warning the first time one is near the limit."""
        worst = max(range(len(peaks)), key=peaks.__getitem__)
        share = peaks[worst] / self.memory_gib
        if self.memory_warned or share <= MEMORY_WARNING_SHARE:
            return []
        self.memory_warned = True
        return [
            Anomaly(
                "memory_pressure",
                step,
                peaks[worst],
                f"memory near the limit at step {step}: process {worst} ({self.places[worst]}) peaked at "
                f"{peaks[worst]:.1f} of {self.memory_gib:.1f} GiB ({share:.0%}, over {MEMORY_WARNING_SHARE:.0%}); "
                "a longer batch may run out of memory: lower --per_device_train_batch_size (raise "
                "--gradient_accumulation_steps to keep the batch), or use --gradient_checkpointing true or ZeRO",
            )
        ]

    def check_steps(self, steps: list[int], losses: list[float], grad_norms: list[float]) -> list[Anomaly]:
        found = []
        for step, loss, norm in zip(steps, losses, grad_norms, strict=True):
            if seen := self.loss.spike(loss, self.cfg.loss_spike_threshold):
                found.append(self._spike("loss_spike", "loss", step, loss, *seen, self.cfg.loss_spike_threshold))
            if seen := self.grad_norm.spike(norm, self.cfg.grad_norm_spike_threshold):
                found.append(
                    self._spike(
                        "grad_norm_spike", "gradient norm", step, norm, *seen, self.cfg.grad_norm_spike_threshold
                    )
                )
        return found

    @staticmethod
    def _spike(kind: str, what: str, step: int, value: float, mean: float, std: float, threshold: float) -> Anomaly:
        sigmas = (value - mean) / std
        return Anomaly(
            kind,
            step,
            value,
            f"{what} spike at step {step}: {value:.4g}, {sigmas:.1f} standard deviations above its running mean "
            f"{mean:.4g} (threshold {threshold:g}); look at that step's batch, or lower --learning_rate",
        )

    def check_interval(self, step: int, tokens_per_s: float | None, work_per_step: list[float]) -> list[Anomaly]:
        """`tokens_per_s` over step time (None: no step of the interval applied, left out of the throughput
        check); `work_per_step[r]`: process r's own seconds per step."""
        found = []
        median = statistics.median(self.throughputs) if len(self.throughputs) >= 3 else 0.0
        drop = self.cfg.throughput_drop_ratio
        if tokens_per_s is None:
            pass  # left out: neither slow nor a rate for the median (the intervals around it judged as adjacent)
        elif drop > 0 and tokens_per_s < drop * median:
            self.slow += 1
            if self.slow == 2:  # two intervals in a row: one slow interval is noise (a GC pause, a busy disk)
                found.append(
                    Anomaly(
                        "throughput_drop",
                        step,
                        tokens_per_s,
                        f"throughput dropped at step {step}: {tokens_per_s:.0f} tokens/s for two logging intervals, "
                        f"under {drop:g} of the running median {median:.0f}; see train/data_time_share (the input) "
                        "and the machine's other load (--throughput_drop_ratio 0: off)",
                    )
                )
        else:
            self.slow = 0
            self.throughputs.append(tokens_per_s)
        if len(work_per_step) > 1 and self.cfg.straggler_ratio > 0 and self.stragglers:
            slowest = max(range(len(work_per_step)), key=work_per_step.__getitem__)
            worst = work_per_step[slowest]
            # the others' median: with the slowest in it, 2 processes could never be R >= 2 apart
            typical = statistics.median(w for i, w in enumerate(work_per_step) if i != slowest)
            lagging = worst > self.cfg.straggler_ratio * typical and worst - typical > STRAGGLER_MIN_S
            reported, self.straggler = self.straggler, slowest if lagging else None
            if lagging and slowest != reported:  # once when it begins, not at every interval it lasts
                found.append(
                    Anomaly(
                        "straggler",
                        step,
                        float(slowest),
                        f"straggler at step {step}: process {slowest} ({self.places[slowest]}) spends "
                        f"{worst * 1000:.0f} ms per step on its own data and forward passes, {worst / typical:.1f}x "
                        f"the other processes' median {typical * 1000:.0f} ms; every other process waits for it at "
                        "each all-reduce (--straggler_ratio 0: off)",
                    )
                )
        return found
