"""The training loop's concerns, one hook each: `Trainer.fit` runs a step, then its hooks.

After every optimizer step the loop calls each hook's `on_step_end(loop)`, in order. A hook reads what it
needs from `loop` (a `LoopState`: the step, the run's state, the interval's numbers) and may return a
`Request`: a checkpoint now, whatever the schedule, and, with a reason, the end of the run once it is saved.

A step where any hook is `due` (it logs, evaluates or saves there) is a sync point: the loop waits on the
device there anyway, so the flags kept on the device (non-finite steps, SIGTERM) are read then and only
then (`loop.sync`). Their hooks come first, so nothing is logged, evaluated or saved before they are read,
and every process agrees on what comes next.

The hooks, in the order `Trainer.hooks` runs them:
    NonfiniteHook    stop on a nan/inf loss, or count the skipped steps (--nonfinite_loss)
    PreemptionHook   SIGTERM or Ctrl-C on any process: a checkpoint, then stop (exit status 143 or 130)
    LoggingHook      the interval's loss, learning rate, throughput, MFU and step-time numbers, and the task's own
                     (Task.train_metrics), to the run log (metrics.jsonl and the --report_to trackers) and the console
    AnomalyHook      the monitoring detector's warnings (--monitoring); --on_anomaly checkpoint or stop
    EvaluationHook   the validation split on --eval_strategy, and before the first step (--eval_on_start)
    EarlyStoppingHook  --early_stopping_patience: the run ends after an evaluation that used up the patience
                     (cloudtrain.training.best_model)
    CheckpointHook   a checkpoint on its schedule, or now when a hook above asked for one (with the task's own
                     sums not yet logged, in task_state.json)
    CallbackHook     the user's callbacks (--callbacks, cloudtrain.train(callbacks=...)), in
                     cloudtrain.training.callbacks: it sees what every hook above did at the step
    ProfileHook      --profile: a torch.profiler trace of --profile_steps (main process only; no hook when off),
                     in cloudtrain.observe.profile; last, so a traced step includes the hooks after it
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from cloudtrain.checkpointing import DATA_STATE_FILE, PREFIX, Checkpointer, TrainerState
from cloudtrain.errors import TrainingStopped
from cloudtrain.evaluation import scalar_metrics
from cloudtrain.observe import cost
from cloudtrain.observe.flops import matmul_precision, no_peak_reason, peak_flops
from cloudtrain.observe.monitoring import WARN_ONLY, AnomalyDetector, interval_values, peak_memory
from cloudtrain.parallel.runtime import Runtime
from cloudtrain.training.meter import Meter, StepStats
from cloudtrain.training.nonfinite import NonfiniteGuard
from cloudtrain.training.preemption import PreemptionSignal

if TYPE_CHECKING:
    from cloudtrain.training.trainer import Trainer

RESUME = "continue with --resume_from_checkpoint latest"
TASK_STATE_FILE = "task_state.json"  # the task's own sums not yet logged (Task.pending_state)


@dataclass(frozen=True)
class Request:
    """What a hook asks of the loop after a step: a checkpoint now, whatever the schedule; with a `reason`,
    also the end of the run once it is saved."""

    reason: str = ""  # "SIGTERM at step 7" (said after "stopped: "); empty: the run goes on
    advice: str = ""  # what to do next, said after where the checkpoint is
    exit_code: int = 0
    quiet: bool = False  # this process prints no error line: another prints the same

    def stopped(self, saved: Path | None) -> TrainingStopped:
        where = f"checkpoint saved to {saved}" if saved else "no checkpoint (none configured)"
        return TrainingStopped(f"{self.reason}; {where}: {self.advice}", self.exit_code, quiet=self.quiet)


@dataclass
class LoopState:
    """What the loop shares with its hooks. `state` is what a checkpoint keeps; the rest lasts one run."""

    state: TrainerState  # the step count, the run's totals, the evaluations so far
    total_steps: int
    steps_per_epoch: int
    meter: Meter  # the sums since the last logging step, on the device
    guard: NonfiniteGuard  # the non-finite steps since the last sync point, on the device
    bar: tqdm  # the progress bar (the main process's); hooks print through `bar.write`
    # Set anew after each step, for the hooks after it:
    stats: StepStats | None = None  # the step's loss sum, count and gradient norm, on the device
    learning_rate: float = 0.0  # the rate the step was taken at (the schedule has moved on to the next one's)
    sync: bool = False  # a hook is due: the loop syncs here, and the device flags are read
    interval: dict | None = None  # at a logging step: the interval's totals over every process (Meter.flush)
    logged: dict | None = None  # at a logging step: the numbers logged (train/loss, train/learning_rate, ...)
    requests: list[Request] = field(default_factory=list)  # what the hooks so far asked for
    saved: Path | None = None  # the checkpoint saved after this step
    ending: str = ""  # why this step becomes the run's last before its planned end (a hook's note)
    model_step: int | None = None  # the step whose model the run ends with, where not its last (best_model)
    streams: bool = False  # a stream (--streaming true) has no epochs

    @property
    def step(self) -> int:
        return self.state.global_step

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    @property
    def epoch(self) -> float | None:
        """Steps done / steps per epoch; None for a stream, whose steps_per_epoch is only its planned steps."""
        return None if self.streams else self.step / self.steps_per_epoch

    @property
    def end_of_epoch(self) -> bool:
        return self.step % self.steps_per_epoch == 0

    def step_ended(self, stats: StepStats) -> None:
        """Count the step, and forget what the hooks of the step before found."""
        self.state.global_step += 1
        self.bar.update(1)
        self.stats, self.sync, self.interval, self.requests, self.saved = stats, False, None, [], None
        self.logged = None


class Hook:
    """One concern of the training loop; a subclass overrides what it needs (the defaults do nothing)."""

    # What the run was doing when a collective in this hook fails (the error names it); None: the step's.
    phase: str | None = None
    # Its time is not training time (an evaluation, a save): the interval's throughput and MFU leave it out.
    outside_training: bool = False

    def on_train_start(self, loop: LoopState) -> None:
        """Once, before the first step (after a resume: before the first step still to run)."""

    def due(self, loop: LoopState) -> bool:
        """Whether this hook logs, evaluates or saves after this step; the same on every process."""
        return False

    def on_step_end(self, loop: LoopState) -> Request | None:
        """After every step, in the hooks' order."""
        return None

    def on_train_end(self, loop: LoopState) -> None:
        """Once, after the last step (also one that early stopping or a stream's end made the last; not when the
        run stops on an error, a signal or --on_anomaly stop)."""

    def close(self) -> None:
        """Once, when the loop ends for any reason (an error too): finish what runs in the background."""


class NonfiniteHook(Hook):
    """At each sync point: stop on a non-finite loss since the last one (the default), or count the
    steps skipped for it (--nonfinite_loss skip)."""

    def __init__(self, trainer: Trainer, checkpointer: Checkpointer | None):
        self.skip = trainer.cfg.checkpoint.nonfinite_loss == "skip"
        self.run_log, self.checkpointer = trainer.run_log, checkpointer

    def on_step_end(self, loop: LoopState) -> Request | None:
        if not loop.sync:
            return None
        count, first = loop.guard.read()
        if count and self.skip:
            loop.state.skipped_steps += count
            self.run_log.log({"train/skipped_steps": loop.state.skipped_steps}, step=loop.step)
            if self.run_log.enabled:  # the main process: one line, not one per process
                loop.bar.write(
                    f"warning: skipped {count} step(s) with a non-finite loss or gradients since the last sync, the "
                    f"first at step {first} (--nonfinite_loss skip; {loop.state.skipped_steps} in all)"
                )
        elif count:
            last = self.checkpointer.latest() if self.checkpointer else None
            where = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
            raise TrainingStopped(
                f"the loss or its gradients became non-finite at step {first}; training stopped and no model "
                f"was saved ({where}). Lower --learning_rate or use --nonfinite_loss skip",
                1,
            )
        return None


class PreemptionHook(Hook):
    """At each sync point: whether any process received SIGTERM or Ctrl-C (one small collective); then a
    checkpoint, and stop: exit status 143 (a scheduler restarts the job), 130 after Ctrl-C (as for any program)."""

    def __init__(self, runtime: Runtime, signal: PreemptionSignal):
        self.runtime, self.signal = runtime, signal

    def on_step_end(self, loop: LoopState) -> Request | None:
        if not (loop.sync and self.runtime.agree([self.signal.received])[0]):
            return None
        if self.signal.by == "SIGINT":
            return Request(f"Ctrl-C at step {loop.step}", RESUME, 130)
        by = "SIGTERM" if self.signal.received else "a signal to another process"
        return Request(f"{by} at step {loop.step}", RESUME, 143)


class LoggingHook(Hook):
    """Every --logging_steps steps and at the last: the interval's numbers, added over every process in one
    all-reduce, to the run log and as one console line. Throughput counts samples and real (non-padding)
    tokens; the MFU is logged where the device's peak is known (cloudtrain.observe.flops)."""

    phase = "the logging step's all-reduce"

    def __init__(self, trainer: Trainer, device: torch.device):
        self.trainer, self.device = trainer, device
        self.every = trainer.cfg.training.logging_steps
        self.monitoring = trainer.cfg.monitoring.monitoring
        precision = matmul_precision(trainer.cfg.training.mixed_precision)
        self.peak = peak_flops(device, precision)
        self.no_mfu = no_peak_reason(device, precision)  # a GPU without a known peak: said once, at the start
        if self.peak and trainer.task.no_mfu:
            self.peak, self.no_mfu = None, f"no MFU logged for --task {trainer.task.name}: {trainer.task.no_mfu}"
        self.task_metrics: list[str] = []  # names of the task's own numbers at the last logging step

    def on_train_start(self, loop: LoopState) -> None:
        self.started = (time.monotonic(), loop.step)  # for the elapsed time and ETA of a log without a bar
        if self.no_mfu and self.trainer.is_main_process:
            loop.bar.write(self.no_mfu)

    def due(self, loop: LoopState) -> bool:
        return loop.done or loop.step % self.every == 0

    def on_step_end(self, loop: LoopState) -> Request | None:
        # a stop asked for at this step (a signal, --on_anomaly stop) ends the run here: the steps since the last
        # logging step are logged as at a last step, else the resume starts after them and they are lost
        if not (self.due(loop) or any(request.reason for request in loop.requests)):
            return None
        # this process's step times and memory, for train/step_time_s and the anomaly detector
        local = self.trainer.clock.read() + peak_memory(self.device) if self.monitoring else None
        loop.interval = loop.meter.flush(local)
        values = self._values(loop, loop.interval)
        self.trainer.run_log.log(values, step=loop.step)
        loop.logged = values
        if self.trainer.is_main_process:
            line = self._line(loop, values)
            if self.task_metrics:  # the task's own numbers (preference rewards) on a line of their own
                line += "\n  " + " | ".join(f"{n.removeprefix('train/')} {values[n]:.4g}" for n in self.task_metrics)
            loop.bar.write(line)
        return None

    def _values(self, loop: LoopState, interval: dict) -> dict:
        trainer = self.trainer
        values = {  # no train/loss where every step of the interval was skipped (--nonfinite_loss skip): not 0
            **({"train/loss": interval["loss"]} if interval["loss"] is not None else {}),
            "train/learning_rate": loop.learning_rate,
            **({"train/epoch": round(loop.epoch, 4)} if loop.epoch is not None else {}),  # none for a stream
            "train/samples_per_s": interval["samples_per_s"],
            "train/tokens_per_s": interval["tokens_per_s"],
        }
        if loop.stats is not None and loop.stats.grad_norm is not None:
            values["train/grad_norm"] = float(loop.stats.grad_norm)  # the last step's; a host read
        if self.peak:
            flops = trainer.flops.training_flops(interval["tokens"], interval["squared_lengths"])
            values["train/mfu"] = flops / interval["seconds"] / trainer.num_processes / self.peak
        values.update(interval_values(interval["by_process"], self.device))
        if trainer.streams:  # per source, the documents and tokens consumed so far (cloudtrain.data.streaming)
            values.update(trainer.train_dl.source_metrics(loop.step))  # type: ignore[attr-defined]
        own = trainer.task.train_metrics(trainer.runtime.reduce_sum, interval["seconds"])  # every process: a collective
        values.update({f"train/{name}": value for name, value in own.items()})
        self.task_metrics = [f"train/{name}" for name in own]
        return values

    def _line(self, loop: LoopState, values: dict) -> str:
        epoch = "" if loop.epoch is None else f" | epoch {loop.epoch:.2f}"  # a stream has no epochs
        loss = f"{values['train/loss']:.4f}" if "train/loss" in values else "- (every step skipped)"
        line = (
            f"step {loop.step}/{loop.bar.total}{epoch} | loss {loss}"
            f" | lr {values['train/learning_rate']:.2e} | {values['train/samples_per_s']:.1f} samples/s"
            f" | {values['train/tokens_per_s']:.0f} tokens/s"
        )
        if "train/mfu" in values:
            line += f" | MFU {values['train/mfu']:.1%}"
        if "train/step_time_s" in values:
            line += (
                f" | {values['train/step_time_s'] * 1000:.0f} ms/step, data {values['train/data_time_share']:.0%}"
                f" | peak {values['train/peak_memory_gib']:.2f} GiB"
            )
        if loop.bar.disable:  # a log file or CloudWatch: no bar shows the time, so the line does
            line += self._timing(loop)
        return line

    def _timing(self, loop: LoopState) -> str:
        """| elapsed 1:02, ETA 3:10: this launch's time so far, and its steps' pace over the steps left."""
        start, first = self.started
        elapsed, done = time.monotonic() - start, loop.step - first
        left = elapsed / done * (loop.total_steps - loop.step) if done else None
        eta = f", ETA {tqdm.format_interval(left)}" if left is not None and loop.step < loop.total_steps else ""
        return f" | elapsed {tqdm.format_interval(elapsed)}{eta}"


class AnomalyHook(Hook):
    """At each logging step: the detector's verdict on the interval (cloudtrain.observe.monitoring), warned about
    and logged as events. Every process sees the same numbers, so all agree on --on_anomaly without
    another collective: checkpoint, or checkpoint and stop (at the last step the model is saved anyway); memory
    pressure only warns (a checkpoint does not lower the peak, and a stop came back after every resume)."""

    def __init__(self, trainer: Trainer):
        runtime = trainer.runtime
        places = runtime.gather_objects(f"node {runtime.node}, {runtime.host}")  # to name a straggler
        self.detector = AnomalyDetector(trainer.cfg.monitoring, places, stragglers=trainer.times_own_work)
        self.action = trainer.cfg.monitoring.on_anomaly
        self.run_log, self.is_main = trainer.run_log, trainer.is_main_process

    def on_step_end(self, loop: LoopState) -> Request | None:
        if loop.interval is None:
            return None
        found = self.detector.check(loop.step, loop.interval)
        for anomaly in found:
            self.run_log.event(anomaly.kind, anomaly.message, anomaly.value, step=anomaly.step)
            if self.is_main:
                loop.bar.write(f"warning: {anomaly.message}")
        acting = [anomaly for anomaly in found if anomaly.kind not in WARN_ONLY]  # memory pressure only warns
        if not acting or self.action == "warn":
            return None
        if self.action == "stop" and not loop.done:
            return Request(
                f"stopped at step {loop.step} on {acting[0].kind.replace('_', ' ')} (--on_anomaly stop)",
                f"look at the run, then {RESUME}",
                3,
                quiet=not self.is_main,
            )
        return Request()  # a checkpoint of the moment


class EvaluationHook(Hook):
    """The validation metrics every --eval_steps steps or at each epoch's end (--eval_strategy), and before
    the first step with --eval_on_start; none after the last step (the run evaluates its final model)."""

    phase = "evaluation"
    outside_training = True

    def __init__(self, trainer: Trainer):
        self.trainer, t = trainer, trainer.cfg.training
        self.strategy, self.every, self.on_start = t.eval_strategy, t.eval_steps, t.eval_on_start

    def on_train_start(self, loop: LoopState) -> None:
        if self.on_start and loop.step == 0:
            self._evaluate(loop)

    def due(self, loop: LoopState) -> bool:
        return not loop.done and (
            (self.strategy == "steps" and loop.step % self.every == 0)  # type: ignore[operator]  # config checks it is set
            or (self.strategy == "epoch" and loop.end_of_epoch)
        )

    def on_step_end(self, loop: LoopState) -> Request | None:
        if self.due(loop):
            self._evaluate(loop)
        return None

    def _evaluate(self, loop: LoopState) -> None:
        trainer, state = self.trainer, loop.state
        metrics = trainer.evaluate("validation")
        state.evaluations.append({"step": state.global_step, **scalar_metrics(metrics, "")})
        trainer.log_evaluation(metrics, "eval", state.global_step)
        if trainer.is_main_process:
            loop.bar.write(f"eval @ step {state.global_step}: {trainer.task.describe_metrics(metrics)}")


class CheckpointHook(Hook):
    """A checkpoint every --checkpointing_steps steps or at each epoch's end (`Checkpointer.due`), or when a
    hook above asked for one; every process writes its part. It runs last, after the hooks that may ask.

    With --async_checkpointing the loop waits only for a CPU snapshot (cloudtrain.async_save); the files are
    written in the background. A save before a stop is written at once: the run ends when it is complete.
    The seconds the loop waited go to the run log as checkpoint/blocked_s."""

    phase = "saving a checkpoint"
    outside_training = True

    def __init__(self, trainer: Trainer, checkpointer: Checkpointer):
        self.trainer, self.checkpointer = trainer, checkpointer
        self.asynchronous = trainer.cfg.checkpoint.async_checkpointing

    def due(self, loop: LoopState) -> bool:
        return self.checkpointer.due(loop.step, loop.end_of_epoch)

    def on_step_end(self, loop: LoopState) -> Request | None:
        self.checkpointer.background.check()  # a background save that failed stops the run here
        if self.due(loop) or loop.requests:
            loop.saved = self._save(loop)
        return None

    def on_train_end(self, loop: LoopState) -> None:
        self.checkpointer.background.wait()  # the final model is saved after a complete last checkpoint

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the run's own error is the one to report
            self.checkpointer.background.wait()

    def _save(self, loop: LoopState) -> Path:
        trainer, state, step = self.trainer, loop.state, loop.state.global_step
        self.checkpointer.background.wait()  # the previous save first: one snapshot in memory at a time
        start = time.perf_counter()
        runtime_s = trainer.runtime.share(state.runtime_s + loop.meter.elapsed())  # every node writes the same
        count = trainer.runtime.count
        device_s = state.earlier_device_s(count) + (runtime_s - state.runtime_s) * count
        # a deep copy: the evaluations list grows while a background save writes this state
        job, job_wall_s = cost.job_wall(state.job, state.job_wall_s)
        snapshot = copy.deepcopy(
            dataclasses.replace(
                state,
                interval=loop.meter.pending(),
                interval_s=trainer.runtime.share(loop.meter.since_logged()),  # the main process's, as its sums
                runtime_s=runtime_s,
                device_s=device_s,
                job=job,
                job_wall_s=trainer.runtime.share(job_wall_s),
            )
        )
        task_state = trainer.task.pending_state(trainer.runtime.reduce_sum)  # every process: a collective
        data_state = trainer.data_state(step)  # taken now: the stream moves on
        now = self.asynchronous and not any(request.reason for request in loop.requests)
        write_model = trainer.checkpoint_snapshot() if now else trainer.write_checkpoint

        def write(folder: Path) -> None:
            write_model(folder)
            if data_state is not None:
                (folder / DATA_STATE_FILE).write_text(json.dumps(data_state))
            if task_state is not None and trainer.checkpoint_owner:
                (folder / TASK_STATE_FILE).write_text(json.dumps(task_state))

        name, mesh = type(trainer).__name__, trainer.runtime.mesh
        if now:
            blocked = self.checkpointer.save_async(step, write, name, mesh, snapshot, start)
            saved = self.checkpointer.folder / f"{PREFIX}{step}"
        else:
            saved = self.checkpointer.save(step, write, name, mesh, snapshot, start)
            blocked = time.perf_counter() - start
        trainer.run_log.log({"checkpoint/blocked_s": round(blocked, 4)}, step=step)
        return saved
