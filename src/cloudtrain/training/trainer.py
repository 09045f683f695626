"""The Trainer base: the outer loop every trainer runs (`fit`: a step's window of micro-batches, the step, then
the hooks of cloudtrain.training.hooks), resume and evaluation. A subclass supplies only what differs between a
plain PyTorch loop, accelerate and a pipeline: `setup`, `backward_window`, the optimizer step and its checkpoint
state. docs/architecture.md ("The training step") says how the loss is normalised, why the step never waits on
the host, and what makes a resume exact.
"""

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from accelerate import skip_first_batches
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from cloudtrain.checkpointing import (
    Checkpointer,
    TrainerState,
    check_compatible,
    read_data_state,
    read_state,
)
from cloudtrain.config import PRECISIONS, Config, differs_from_default
from cloudtrain.data.processing import ProcessedData, eval_dataloader, train_dataloader
from cloudtrain.errors import TrainingStopped, UserError
from cloudtrain.evaluation import scalar_metrics
from cloudtrain.observe import console
from cloudtrain.observe.flops import ModelFlops
from cloudtrain.observe.tracking import RunLog
from cloudtrain.parallel.mesh import Mesh
from cloudtrain.parallel.runtime import Runtime, collective_failure
from cloudtrain.registry import TRAINERS
from cloudtrain.resume import check_engine, check_order, load_failure, set_aside_newer
from cloudtrain.tasks.base import Task
from cloudtrain.tasks.module_task import is_plain_module, save_module
from cloudtrain.training.best_model import BestModelHook, EarlyStoppingHook
from cloudtrain.training.callbacks import CallbackHook
from cloudtrain.training.hooks import (
    TASK_STATE_FILE,
    AnomalyHook,
    CheckpointHook,
    EvaluationHook,
    Hook,
    LoggingHook,
    LoopState,
    NonfiniteHook,
    PreemptionHook,
)
from cloudtrain.training.meter import Meter, StepStats, norm_scalar
from cloudtrain.training.nonfinite import NonfiniteGuard
from cloudtrain.training.optim import (
    build_optimizer,
    build_scheduler,
    follow_schedule,
    keep_settings,
    other_schedule,
    schedule_name,
    settings,
)
from cloudtrain.training.preemption import PreemptionSignal, UnlessCutShort, until
from cloudtrain.training.prefetch import InputClock
from cloudtrain.training.result import LaunchStart, TrainResult
from cloudtrain.training.weights import count_parameters, save_pretrained, tied_once


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


def save_weights(model: torch.nn.Module, output_dir: Path, state_dict: dict | None = None) -> None:
    """The final model: transformers' layout (or PEFT's for adapters), or for a user's plain module its
    state_dict and the class's name (cloudtrain.tasks.module_task)."""
    if is_plain_module(model):
        save_module(model, output_dir, None if state_dict is None else tied_once(model, state_dict))
    else:
        save_pretrained(model, output_dir, state_dict=state_dict)


def epochs_in_steps(epochs: float, steps_per_epoch: int) -> int:
    """The optimizer steps of `epochs` (a fraction too): 2.2 x 25 is 55, though in floats it is 55.00000000000001."""
    return math.ceil(round(epochs * steps_per_epoch, 6))


def set_epoch(dataloader: DataLoader, epoch: int) -> None:
    """accelerate's prepared loaders pass set_epoch on to the sampler; a plain loader is told directly."""
    target: Any = dataloader if hasattr(dataloader, "set_epoch") else dataloader.sampler
    target.set_epoch(epoch)


def local_gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """The norm of the gradients this process holds (a sharded one's local shard), None where it holds none."""
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in parameters if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


class Trainer:
    """The outer training loop; subclasses implement the device-specific parts."""

    name = "trainer"  # the --training_type that picks it (cloudtrain.registry)
    summary = ""  # a line for --help
    step_collectives = "the gradient all-reduce"  # what a process waits for in forward and backward
    phase = "placing the model and the optimizer"  # what the run is doing: named when it fails

    def __init__(
        self, cfg: Config, task: Task, model: PreTrainedModel, data: ProcessedData, run_log: RunLog, runtime: Runtime
    ):
        t = cfg.training
        if t.mixed_precision not in PRECISIONS:  # a programming error: the pipeline resolves "auto" first
            raise ValueError(f"mixed_precision {t.mixed_precision!r}: resolve it with hardware.resolve_precision")
        self.cfg, self.task, self.model, self.data, self.run_log, self.runtime = (
            cfg,
            task,
            model,
            data,
            run_log,
            runtime,
        )
        self.is_main_process, self.num_processes = runtime.is_main, runtime.count
        self.replicas = runtime.mesh.data_parallel  # each takes its own share of a step's rows
        self.counts_batches = True  # whether this process's batches enter the logged sums (Meter)
        self.checkpoint_owner = runtime.is_main  # writes a checkpoint's files shared by processes (Checkpointer)
        self.train_dl: DataLoader = train_dataloader(
            data, self.loader_rows(t.micro_batch), t.seed, cfg.data, step_rows=self.global_rows
        )
        eval_rows = self.loader_rows(t.per_device_eval_batch_size)
        self.eval_dls = {"validation": eval_dataloader(data.validation, data, eval_rows, cfg.data)}
        if data.test is not None:
            self.eval_dls["test"] = eval_dataloader(data.test, data, eval_rows, cfg.data)
        self.predict_dls = {
            split: eval_dataloader(ds, data, eval_rows, cfg.data) for split, ds in data.unlabelled.items()
        }
        self.optimizer = build_optimizer(model, cfg)
        self.flops = ModelFlops.from_model(model)  # before setup(): DDP/DeepSpeed wrappers hide the config
        # before setup() too: FSDP2's shards count a part (and drop a 4-bit weight's quant_state, its full size)
        self.counted = count_parameters(model), count_parameters(model, trainable=True)
        # this process's step, data and forward time; on CUDA the GPU's own (cloudtrain.training.prefetch)
        self.clock = InputClock(runtime.device)
        self.callbacks: list[Any] = []  # the user's (cloudtrain.training.callbacks); the pipeline sets them
        self.launch_start: LaunchStart | None = None  # where a resumed launch began (`resume`); None: a fresh run

    # ------------------------------------------------------------ what subclasses provide
    mode = "plain PyTorch"

    own_options: tuple[str, ...] = ()  # options only this trainer reads; others refuse them
    # whether a process's forward passes are timed apart from waiting for the others (the straggler check's input)
    times_own_work = True
    follows_launcher = True  # whether an accelerate config's settings (its mixed precision) apply to its runs

    @classmethod
    def mesh(cls, cfg: Config, processes: int) -> Mesh:
        """How this trainer arranges the launch's `processes` (default: each holds the whole model: DDP)."""
        return Mesh(world=processes, dp_replicate=processes)

    @classmethod
    def launch(cls, cfg: Config) -> Runtime:
        """This process's runtime for the launch (process group, collectives); one process by default."""
        return Runtime()

    @classmethod
    def check_options(cls, cfg: Config, task: Task) -> None:
        """Reject what this trainer cannot run, before anything heavy is loaded; subclasses extend it."""
        for other in TRAINERS:
            changed = [name for name in other.own_options if other is not cls and differs_from_default(cfg, name)]
            if changed:
                raise UserError(f"--{changed[0]} needs --training_type {other.name} (this run is {cls.name})")
        if cfg.checkpoint.async_checkpointing and (why := cls.async_refusal(cfg)):
            raise UserError(f"--async_checkpointing true {why}; leave it false there (checkpoints then block)")

    @property
    def reshards_states(self) -> bool:
        """Whether this run reads checkpoint states that torch.distributed.checkpoint re-cuts for any process
        count (FSDP's sharded states): a checkpoint of such a run resumes at another count."""
        return False

    @classmethod
    def async_refusal(cls, cfg: Config) -> str | None:
        """Why this trainer cannot write checkpoints in the background with `cfg` (None: it can)."""
        return (
            f"with --training_type {cls.name} (it writes its checkpoints from the live state: it has no CPU "
            "snapshot of them to write in the background)"
        )

    def setup(self) -> None:
        raise NotImplementedError

    def backward_window(self, window: list[dict], scale: torch.Tensor) -> StepStats:
        """Forward and backward over the micro-batches of one step, each summed loss times `scale` (the
        process count over the step's global count); gradients summed, then clipped."""
        raise NotImplementedError

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def skip_step(self) -> None:
        """Drop the gradients of a step that is not applied."""
        self.optimizer.zero_grad(set_to_none=True)

    def move(self, batch: dict) -> dict:
        return batch

    def input_batches(self, batches: Iterable[dict]) -> Iterable[dict]:
        """The training batches as the step gets them (default: as the loader yields them; `move` places them
        in the step). A trainer that places its own batches copies them ahead (cloudtrain.training.prefetch)."""
        return batches

    def store_per_node(self) -> None:
        """Checkpoint folders are node-local: each node's first process must also write the shared files."""

    @property
    def global_rows(self) -> int:
        """Rows per optimizer step over all processes: where a stored run's position lies, at any process count."""
        t = self.cfg.training
        return t.micro_batch * self.replicas * t.gradient_accumulation_steps

    def loader_rows(self, per_process: int) -> int:
        """Rows a data loader yields per batch: one process's share (accelerate shards the loaders)."""
        return per_process

    def autocast(self):
        raise NotImplementedError

    def save_model(self, output_dir: Path) -> None:
        raise NotImplementedError

    def write_checkpoint(self, folder: Path) -> None:
        raise NotImplementedError

    def checkpoint_snapshot(self) -> Callable[[Path], None]:
        """A CPU copy of what `write_checkpoint` writes, taken now, and the function that writes it into a
        folder later (from another thread, while the live state changes: --async_checkpointing)."""
        raise NotImplementedError

    def load_checkpoint(self, folder: Path) -> None:
        raise NotImplementedError

    def check_resume_files(self, folder: Path) -> None:
        """What a resume needs beyond `load_checkpoint`'s own files, checked on every process before it loads
        (the accelerated trainer's RNG states, which accelerate skips with an info log); by default nothing."""

    # ------------------------------------------------------------ the loop
    def fit(
        self,
        checkpointer: Checkpointer | None = None,
        resume_from: Path | None = None,
        preemption: PreemptionSignal | None = None,
    ) -> TrainResult:
        """Train for the configured steps: get a step's window of micro-batches, step, then the hooks. `preemption`:
        the pipeline's, active around the evaluation and save too (else one of the loop's own)."""
        loop = self._start(checkpointer, resume_from)
        signals: contextlib.AbstractContextManager = contextlib.nullcontext()  # the pipeline's is active already
        if preemption is None:
            preemption = signals = PreemptionSignal()
        hooks = self.hooks(checkpointer, preemption)
        for hook in hooks:
            with self._timed(hook, loop):
                hook.on_train_start(loop)
        self.phase = "the first step"
        try:
            with self._collective_errors(loop.state), signals, loop.bar:
                for window in self._windows(loop):
                    self._step(window, loop)
                    ran = self._after_step(hooks, loop)
                    if loop.ending and not loop.done:  # a hook made this step the last (early stopping)
                        self._end_here(hooks, loop, ran)
                    if loop.done:
                        break
                    self.clock.start_step()  # what the hooks did is not step time
                    self.phase = "loading the data"
                if not loop.done:  # a stream ran out first (--mixture_exhausted stop or drop)
                    loop.ending = (
                        f"the training data ran out after step {loop.step} of {loop.total_steps} (--mixture_exhausted "
                        f"{self.cfg.data.mixture_exhausted}); the run ends there"
                    )
                    self._end_here(hooks, loop, hooks)
                preemption.loop_ended = True  # a signal from here on: the model is saved, its evaluation skipped
                for hook in hooks:
                    self.phase = hook.phase or self.phase
                    hook.on_train_end(loop)
                result = TrainResult.of(loop, self.launch_start)
        finally:
            for hook in hooks:  # a run that fails still lets a checkpoint in flight complete
                hook.close()
        if self.streams:
            result.sources = self.train_dl.consumed(loop.state.global_step)  # type: ignore[attr-defined]
        return result

    @property
    def streams(self) -> bool:
        """Whether the training data is a stream with a cursor (cloudtrain.data.streaming), not stored rows."""
        return hasattr(self.train_dl, "consumed")  # accelerate's prepared loaders have a state_dict too

    def data_state(self, step: int) -> dict | None:
        """A stream's cursor after `step`, for the checkpoint's owner to write (None: nothing to write)."""
        if self.streams and self.checkpoint_owner:
            return self.train_dl.state_dict(step)  # type: ignore[attr-defined]
        return None

    def hooks(self, checkpointer: Checkpointer | None, preemption: PreemptionSignal) -> list[Hook]:
        """What runs after each step, in order (cloudtrain.training.hooks): the flag readers first, so
        nothing is logged, evaluated or saved before they are read; the checkpoint last, after the hooks
        that may ask for one."""
        hooks: list[Hook] = [
            NonfiniteHook(self, checkpointer),
            PreemptionHook(self.runtime, preemption),
            LoggingHook(self, self._device),
        ]
        if self.cfg.monitoring.monitoring:
            hooks.append(AnomalyHook(self))
        hooks.append(EvaluationHook(self))
        if self.cfg.training.early_stopping_patience:
            hooks.append(EarlyStoppingHook(self))
        if checkpointer:
            hooks.append(CheckpointHook(self, checkpointer))
            if self.cfg.checkpoint.load_best_model_at_end:  # after the last checkpoint is complete
                hooks.append(BestModelHook(self, checkpointer))
        if self.callbacks:  # last: a callback sees what every hook did at the step
            hooks.append(
                CallbackHook(self.callbacks, self.runtime, self.run_log.output_dir, checkpointer, self.streams)
            )
        from cloudtrain.observe.profile import profile_hooks  # here: that module builds on training.hooks

        hooks += profile_hooks(self, self._device)  # --profile: last, so a traced step includes the hooks before it
        return hooks

    def _start(self, checkpointer: Checkpointer | None, resume_from: Path | None) -> LoopState:
        """Place model and data, build the schedule, resume, announce the run: the loop's starting state."""
        if checkpointer:
            self.checkpoint_owner = checkpointer.owner
            if checkpointer.storage.per_node:
                self.store_per_node()  # before setup(): DeepSpeed reads its checkpoint settings there
        self.setup()
        self.model.train()  # from_pretrained returns the model in eval mode: dropout would stay off
        t = self.cfg.training
        if resume_from and self.streams:  # its cursor first: a --max_tokens budget counts the rows it has trained
            self.train_dl.load_state_dict(read_data_state(resume_from))  # type: ignore[attr-defined]
        steps_per_epoch = math.ceil(len(self.train_dl) / t.gradient_accumulation_steps)
        total_steps = (
            t.max_steps
            or getattr(self.train_dl, "total_steps", None)
            or epochs_in_steps(t.num_train_epochs, steps_per_epoch)
        )
        self.scheduler = build_scheduler(self.optimizer, self.cfg, total_steps)
        state = self.resume(resume_from) if resume_from else TrainerState()
        if resume_from and checkpointer:  # resumed: a step back sets the branch it leaves aside
            set_aside_newer(checkpointer.folder, resume_from, self.runtime)
        self._announce(steps_per_epoch, total_steps)
        if resume_from and state.global_step >= total_steps and self.is_main_process:
            at = f" of {total_steps}" if state.global_step == total_steps else f", past this run's {total_steps} steps"
            print(
                f"{resume_from.name} is at step {state.global_step}{at}: nothing left to train; evaluating and "
                "saving its model",
                flush=True,
            )
        elif resume_from and state.total_steps not in (None, total_steps) and self.is_main_process:
            print(
                f"note: {resume_from.name} was trained on a learning-rate schedule of {state.total_steps} steps; this "
                f"run's has {total_steps}, and from step {state.global_step} the learning rate follows it (as if "
                f"{total_steps} had been planned from the start)",
                flush=True,
            )
        schedule = schedule_name(self.cfg)
        if resume_from and other_schedule(state.schedule, schedule) and self.is_main_process:
            print(
                f"note: {resume_from.name} was trained on a {state.schedule} schedule; this run's is {schedule}, and "
                f"from step {state.global_step} the learning rate follows it",
                flush=True,
            )
        state.total_steps, state.schedule = total_steps, schedule  # what this run's checkpoints were trained on
        bar = tqdm(
            total=total_steps,
            initial=state.global_step,
            desc="training",
            dynamic_ncols=True,
            disable=not self.is_main_process or not console.progress_bars(),  # a log file: the step lines say it
        )
        meter, guard = Meter(self.runtime, state, self._device), NonfiniteGuard(self._device, state.global_step)
        return LoopState(state, total_steps, steps_per_epoch, meter, guard, bar, streams=self.streams)

    def _windows(self, loop: LoopState) -> Iterator[list[dict]]:
        """Each step's window of micro-batches, epoch after epoch, until the last step: each epoch's order
        from seed + epoch; the batches a resumed run had consumed are skipped by index, unread."""
        k = self.cfg.training.gradient_accumulation_steps
        if loop.done:  # resumed at (or past) the last step: a stream would yield a step past the run's end
            return
        if self.streams:  # a stream starts at its own cursor (restored by `resume`) and has no epochs
            self.clock.start_step()
            yield from micro_batch_windows(self.input_batches(self.train_dl), k)
            return
        while not loop.done:
            epoch, steps_done = divmod(loop.step, loop.steps_per_epoch)
            set_epoch(self.train_dl, epoch)
            batches = skip_first_batches(self.train_dl, steps_done * k) if steps_done else self.train_dl
            if hasattr(self.train_dl, "_non_blocking"):  # accelerate's skipping loader forgets its copy mode
                batches._non_blocking = self.train_dl._non_blocking  # type: ignore[union-attr]
            self.clock.start_step()
            yield from micro_batch_windows(self.input_batches(batches), k)

    def _step(self, window: list[dict], loop: LoopState) -> None:
        """One optimizer step over a window of micro-batches; nothing in it waits on the host."""
        window = [self.move(batch) for batch in window]
        # the rate the step is taken at, the optimizer's before it (a DeepSpeed engine steps its own schedule inside
        # the optimizer step; a resume's changed --learning_rate is set there): a float, no device read
        loop.learning_rate = self.optimizer.param_groups[0]["lr"]
        self.clock.data_ready()
        self.phase = "the all-reduce of the step's token count"
        scale = self._loss_scale(window)
        self.phase = f"forward and backward ({self.step_collectives})"
        stats = self.backward_window(window, scale)
        self.phase = "the optimizer step"
        bad = self.runtime.any_process(self.nonfinite(stats))  # stays on the device
        self.apply_step(bad)
        loop.guard.add(bad)
        loop.meter.add(window, stats, applied=~bad & self.counts_batches)
        self.scheduler.step()
        self.clock.end_step()
        loop.step_ended(stats)

    def _end_here(self, hooks: list[Hook], loop: LoopState, ran: list[Hook]) -> None:
        """The step just taken becomes the run's last (why: `loop.ending`). The hooks that did not run at it (`ran`:
        those that did), and those that a last step makes due (logging: the steps since the last logging step, which
        the totals and a checkpoint at this step then include), run now, in order; the others do not run again."""
        note, loop.ending = loop.ending, ""
        if self.runtime.is_main:
            loop.bar.write(f"note: {note}")
        was_due = {id(hook): hook.due(loop) for hook in ran}
        loop.total_steps = loop.step
        rest = [hook for hook in hooks if id(hook) not in was_due or (hook.due(loop) and not was_due[id(hook)])]
        if rest:
            loop.sync, loop.interval, loop.logged, loop.requests, loop.saved = False, None, None, [], None
            self._after_step(rest, loop)

    def _after_step(self, hooks: list[Hook], loop: LoopState) -> list[Hook]:
        """The hooks in order, then the stop one of them asked for (once its checkpoint is saved). A hook that makes
        this step the last (`loop.ending`) is the last to run, unless a checkpoint was asked for: the rest run as at
        the run's last step (`_end_here`). Returns the hooks that ran."""
        loop.sync = any(hook.due(loop) for hook in hooks)  # where the loop syncs anyway: the flags are read
        ran = []
        for hook in hooks:
            self.phase = hook.phase or self.phase
            with self._timed(hook, loop):
                request = hook.on_step_end(loop)
            if request:
                loop.requests.append(request)
            ran.append(hook)
            if loop.ending and not loop.requests:
                break
        if stop := next((request for request in loop.requests if request.reason), None):
            raise stop.stopped(loop.saved)
        return ran

    @staticmethod
    @contextlib.contextmanager
    def _timed(hook: Hook, loop: LoopState) -> Iterator[None]:
        """A hook whose time is not training time (an evaluation, a save): the interval's rates leave it out."""
        began = time.perf_counter()
        try:
            yield
        finally:
            if hook.outside_training:
                loop.meter.exclude(time.perf_counter() - began)

    @contextlib.contextmanager
    def _collective_errors(self, state: TrainerState) -> Iterator[None]:
        """A collective that fails or times out ends the run with one line: which process, doing what."""
        try:
            yield
        except RuntimeError as err:  # gloo raises where the process waits; NCCL's watchdog names the operation
            if not (what := collective_failure(err, self.cfg.distributed.collective_timeout)):
                raise
            raise TrainingStopped(
                f"process {self.runtime.index} (node {self.runtime.node}) {what}, in {self.phase} after step "
                f"{state.global_step}; see the other processes' logs (the launcher names the one that "
                f"failed). Backend: {str(err).splitlines()[0][:160]}",
                1,
            ) from None

    def _loss_scale(self, window: list[dict]) -> torch.Tensor:
        """Process count / the step's count over all micro-batches and processes (one all-reduce)."""
        local = torch.stack([self.task.loss_count(batch) for batch in window]).sum().double()
        return (self.num_processes / self.runtime.reduce_sum(local).clamp(min=1)).float()

    def nonfinite(self, stats: StepStats) -> torch.Tensor:
        """Whether this process's step is bad: its loss, or its gradients' norm, is nan/inf. A finite loss can
        back-propagate nan/inf gradients (an overflow in the backward); applied, they make every weight nan. Under
        fp16 the loss scaler skips such steps itself and lowers its scale (routine, not a bad step). Without
        clipping (--max_grad_norm 0) the norm of this process's gradients is taken for it, one pass over them."""
        bad = ~torch.isfinite(stats.loss_sum)
        if self.cfg.training.mixed_precision == "fp16":
            return bad
        norm = stats.grad_norm if stats.grad_norm is not None else local_gradient_norm(self.gradient_parameters())
        if norm is None:  # no gradients here (DeepSpeed keeps its own, and checks them itself)
            return bad
        return bad | ~torch.isfinite(norm_scalar(norm, stats.loss_sum))  # (FSDP2's is a DTensor: made plain)

    def gradient_parameters(self) -> Iterable[torch.nn.Parameter]:
        """The parameters whose gradients a step applies."""
        return self.model.parameters()

    def apply_step(self, bad: torch.Tensor) -> None:
        """The optimizer step, skipped where `bad` (the same on every process) is true.

        Fused AdamW skips on the device (it reads `found_inf`, as for a GradScaler), so no step waits on
        the host; other optimizers read the flag on the host. A skipped step leaves weights and
        optimizer state as they were and drops its gradients.
        """
        optimizer: Any = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        if optimizer.defaults.get("fused"):
            optimizer.found_inf = bad.float()
            try:
                self.optimizer_step()
            finally:
                if hasattr(optimizer, "found_inf"):  # a GradScaler sets and deletes its own
                    del optimizer.found_inf
        elif bool(bad):
            self.skip_step()
        else:
            self.optimizer_step()

    def resume(self, folder: Path) -> TrainerState:
        """Restore weights, optimizer, schedule and RNG from `folder`; returns its trainer state."""
        meta = read_state(folder)
        global_rows = None if self.streams else self.global_rows  # a stream's cursor resumes at any global batch
        mesh, reshards = self.runtime.mesh, self.reshards_states
        pdb, accumulation = self.cfg.training.per_device_train_batch_size, self.cfg.training.gradient_accumulation_steps
        per_process = pdb * accumulation if isinstance(pdb, int) else None  # auto: resolved from the checkpoint
        try:  # every process finds the same mismatch: the main one says it (it was one line per process)
            check_compatible(meta, folder, type(self).__name__, mesh, global_rows, reshards, per_process)
            check_engine(meta, folder, self.cfg)
            if global_rows is not None:  # stored rows; a stream's cursor checks its own seed (data.streaming)
                check_order(meta, folder, self.cfg)
        except UserError as err:
            err.quiet = not self.is_main_process
            raise
        start = time.perf_counter()
        ours = settings(self.optimizer, self.scheduler)  # before the checkpoint's states replace them
        self.check_resume_files(folder)
        try:
            self.load_checkpoint(folder)
        except UserError:
            raise
        except (Exception, CheckpointException) as err:  # torch's DCP error is a BaseException; many kinds besides
            raise load_failure(folder, err) from None
        state = TrainerState(**meta["state"])
        follow_schedule(self.scheduler)
        if (changed := keep_settings(self.optimizer, self.scheduler, ours)) and self.is_main_process:
            print(
                f"note: {folder.name} was trained with {' and '.join(changed)}: this run's take over from step "
                f"{state.global_step} (the learning-rate schedule keeps its shape)",
                flush=True,
            )
        if (folder / TASK_STATE_FILE).is_file():  # the task's own sums not yet logged (preference rewards)
            self.task.restore_state(json.loads((folder / TASK_STATE_FILE).read_text()), self.is_main_process)
        self.launch_start = LaunchStart.of(
            state, self.runtime.count
        )  # before the pending sums leave the other processes
        if not self.is_main_process:  # the pending logging sums of all processes live on the main one
            state.interval = [0.0] * len(state.interval)
        if self.is_main_process:
            print(
                f"resumed from {folder} at step {state.global_step} (loaded in {time.perf_counter() - start:.1f}s)",
                flush=True,
            )
        return state

    # ------------------------------------------------------------ shared pieces
    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def evaluate(self, split: str, stop: Callable[[], bool] | None = None) -> dict:
        """The task's metrics of the current weights on one split, counted over every example exactly once (or
        over fewer, and meaningless, once `stop` says so: PreemptionSignal.cut_short). The sample answers (and
        their exact_match) come from validation prompts: they belong to the validation split's results only, and to an
        evaluation that was not cut short."""
        data = self.data if split == "validation" else replace(self.data, prompts=[], references=[])
        if stop is not None:
            data = replace(data, prompts=UnlessCutShort(data.prompts, stop))  # type: ignore[arg-type]
        return self.task.evaluate(
            self.model,
            self._batches(self.eval_dls[split], f"evaluation of {split}", stop),
            data,
            gather=self.runtime.gather,
            move=self.move,
            autocast=self.autocast,
        )

    def predict(self, split: str, stop: Callable[[], bool] | None = None):
        """The task's predictions for an unlabelled split, in the split's order (some of them once `stop` says so)."""
        return self.task.predict(
            self.model,
            self._batches(self.predict_dls[split], f"predictions for {split}", stop),
            gather=self.runtime.gather,
            move=self.move,
            autocast=self.autocast,
        )

    def _batches(self, loader: Iterable, what: str, stop: Callable[[], bool] | None) -> Iterable:
        """`loader`'s batches (until `stop`), under a bar that goes once they are done, where bars show."""
        try:
            total: int | None = len(loader)  # type: ignore[arg-type]
        except TypeError:  # a stream's loader has no length
            total = None
        return console.passing_bar(until(stop, loader), what, total, shown=self.is_main_process)

    def log_evaluation(self, metrics: dict, prefix: str, step: int) -> None:
        """An evaluation's numbers and tables to the run log."""
        self.run_log.log(scalar_metrics(metrics, f"{prefix}/"), step=step)
        for name, (header, rows) in self.task.tables(metrics).items():
            self.run_log.log_table(f"{prefix}/{name}", header, rows, step=step)

    def parameter_counts(self) -> tuple[int, int]:
        """(all, trainable) parameters of the whole model."""
        return self.counted

    def _announce(self, steps_per_epoch: int, total_steps: int) -> None:
        t = self.cfg.training
        effective = t.micro_batch * self.replicas * t.gradient_accumulation_steps
        if self.is_main_process:
            params, trainable = self.parameter_counts()
            trains = "" if trainable == params else f" ({trainable / 1e6:.2f}M trainable: {trainable / params:.2%})"
            print(
                f"{type(self).__name__}: {len(self.data.train)} training rows, {params / 1e6:.1f}M parameters{trains}, "
                f"{self.num_processes} process(es) on {self._device.type} ({self.mode}, precision "
                f"{t.mixed_precision}), effective batch {effective} "
                f"({t.per_device_train_batch_size} per device x {self.replicas} x "
                f"{t.gradient_accumulation_steps} accumulation), {console.counted(total_steps, 'step')} "
                f"({'streamed: no epochs' if self.streams else f'{steps_per_epoch} per epoch'})",
                flush=True,
            )
