"""What both trainers share: the outer loop, optimizer and schedule, evaluation, saving, logging.

A subclass supplies only what differs between a plain PyTorch loop and accelerate: how the model
and data are placed (`setup`), forward and backward over the micro-batches of one step
(`backward_window`), the optimizer step, and how its state is written to and read from a checkpoint.
Who this process is and how tensors meet across processes is the launch's `Runtime`; what the loss
and the metrics are is the `Task`'s.

Resuming is exact: each epoch's order comes from seed + epoch, consumed batches are skipped by
index without being read, and RNG states, optimizer, schedule and logging sums are restored.

The loss is normalised by the global count: the micro-batches of one optimizer step are fetched
together, the task counts what their losses sum over (rows, or target tokens after the shift), and
that count is summed over the window and all processes (one small all-reduce per step). Each
micro-batch's summed loss is divided by it (times the process count, which DDP and DeepSpeed divide
by when they average gradients), so the update equals that of one batch holding every example or
token of the step: for uneven token counts, a short last window and unequal shards too.

No host sync in the step: losses, counts and the non-finite flag stay on the device. A nan/inf loss
on any process (one small all-reduce) skips that step on the device (fused AdamW's `found_inf`); the
flags are read, and SIGTERM agreed on, only where the loop syncs anyway (logging, evaluation and
checkpoint steps, the last step), always before anything is logged, evaluated or saved.

Throughput (samples/s, real non-padding tokens/s) is logged every logging step; on a CUDA device
whose peak is known (PEAK_FLOPS), also the model FLOPs utilization: training FLOPs of the matmul
weights and attention (cloudtrain.flops) per second, over the device's dense bf16/fp16 peak (an fp32
run reads low).
"""

import dataclasses
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import skip_first_batches
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedModel, get_scheduler

from cloudtrain import adapters
from cloudtrain.checkpointing import Checkpointer, PreemptionSignal, TrainerState, check_compatible, read_state
from cloudtrain.config import PRECISIONS, Config, differs_from_default
from cloudtrain.data_processing import ProcessedData, eval_dataloader, train_dataloader
from cloudtrain.errors import TrainingStopped, UserError
from cloudtrain.evaluation import scalar_metrics
from cloudtrain.flops import ModelFlops, sum_squared_lengths
from cloudtrain.monitoring import Anomaly, AnomalyDetector, StepClock, peak_memory
from cloudtrain.parallel.mesh import Mesh
from cloudtrain.registry import TRAINERS
from cloudtrain.runtime import Runtime, collective_failure
from cloudtrain.tasks.base import Task
from cloudtrain.tracking import RunLog


@dataclass
class StepStats:
    loss_sum: torch.Tensor  # this process's summed loss over the window, detached, still on the device
    count: torch.Tensor  # what it sums over (rows or tokens), on the device
    grad_norm: torch.Tensor | float | None  # before clipping; None when clipping is off


@dataclass
class TrainResult:
    global_step: int = 0
    epoch: float = 0.0
    train_loss: float = float("nan")
    runtime_s: float = 0.0
    train_samples: int = 0
    train_tokens: int = 0

    def summary(self) -> dict:
        runtime = max(self.runtime_s, 1e-9)
        return {
            "global_step": self.global_step,
            "epoch": round(self.epoch, 4),
            "train_loss": self.train_loss,
            "train_runtime_s": round(self.runtime_s, 2),
            "train_samples": self.train_samples,
            "train_samples_per_s": round(self.train_samples / runtime, 2),
            "train_tokens_per_s": round(self.train_tokens / runtime, 1),
        }


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


def set_epoch(dataloader: DataLoader, epoch: int) -> None:
    """accelerate's prepared loaders pass set_epoch on to the sampler; a plain loader is told directly."""
    target: Any = dataloader if hasattr(dataloader, "set_epoch") else dataloader.sampler
    target.set_epoch(epoch)


def count_parameters(model: torch.nn.Module, trainable: bool = False) -> int:
    """All (or the trainable) parameters, also when ZeRO-3 has partitioned them (each then holds only its shard)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad or not trainable)


def trains_everything(model: torch.nn.Module) -> bool:
    """False under adapters: then checkpoints hold only the trainable weights, the base reloads from its files."""
    return all(p.requires_grad for p in model.parameters())


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def save_pretrained(model: torch.nn.Module, output_dir: Path, state_dict: dict | None = None) -> None:
    """A full model in transformers' layout, or an adapter in PEFT's (cloudtrain.adapters.save)."""
    if adapters.is_adapter(model):
        adapters.save(model, output_dir, state_dict)
    else:
        model.save_pretrained(output_dir, state_dict=state_dict)  # type: ignore[operator]  # a PreTrainedModel


def load_trainable_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's trainable weights; it must hold exactly the model's trainable parameters."""
    expected = set(trainable_state(model))
    if set(tensors) != expected:
        raise ValueError(
            f"it holds {len(tensors)} weights, {len(set(tensors) - expected)} unknown to this model, "
            f"and lacks {len(expected - set(tensors))} of its {len(expected)} trainable ones"
        )
    model.load_state_dict(tensors, strict=False)


class Meter:
    """Examples (rows), real (non-padding) tokens, summed loss, summed squared sequence lengths (for the
    attention FLOPs) and what the loss sums over, since the last logging step, over applied steps only;
    and each step's summed loss, count and gradient norm (for the anomaly detector).

    Counts stay on the device between logging steps, so the step itself never waits for a host sync;
    `flush` adds them across processes into the run's totals in `state`, in one all-reduce.
    """

    def __init__(self, runtime: Runtime, state: TrainerState, device: torch.device):
        self.reduce_sum, self.state = runtime.reduce_sum, state
        self.processes, self.index = runtime.count, runtime.index
        self.start = self.last = time.perf_counter()
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
                sum(m.any(dim=1).sum() for m in masks).to(loss_sum),  # rows with a real token (a pipeline pads)
                sum(m.sum() for m in masks).to(loss_sum),
                loss_sum,
                sum(sum_squared_lengths(m) for m in masks).to(loss_sum),  # type: ignore[union-attr]  # masks: not empty
                stats.count.to(loss_sum),
            ]
        )
        self.interval += torch.where(applied, values, 0.0)  # a skipped step's nan must not reach the sums
        norm = stats.grad_norm
        if norm is None or isinstance(norm, float):  # DeepSpeed's is a float: a fill, not a blocking copy
            norm = loss_sum.new_full((), math.nan if norm is None else norm)
        elif hasattr(norm, "full_tensor"):  # FSDP2's is a DTensor
            norm = norm.full_tensor()
        self.steps.append(torch.stack([loss_sum, values[4], norm.to(loss_sum)]))

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
        now = time.perf_counter()
        seconds, self.last = max(now - self.last, 1e-9), now
        self.state.samples += int(examples)
        self.state.tokens += int(tokens)
        self.state.loss_sum += loss_sum
        self.state.loss_count += int(count)
        return {
            "loss": loss_sum / max(count, 1),
            "samples_per_s": examples / seconds,
            "tokens_per_s": tokens / seconds,
            "tokens": tokens,
            "squared_lengths": squared_lengths,
            "seconds": seconds,
            "step_losses": [s / c if c else math.nan for s, c in zip(per_step[::2], per_step[1::2], strict=True)],
            "grad_norms": norms_read,
            "by_process": [total[5 + 3 * n + r * width : 5 + 3 * n + (r + 1) * width] for r in range(self.processes)],
        }

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class NonfiniteGuard:
    """Steps whose loss was nan/inf on any process, counted on the device and read only where the loop
    syncs anyway (logging, evaluation and checkpoint steps, the last step), so a step never waits on
    the host. The step itself is skipped on the device (see `Trainer.apply_step`)."""

    def __init__(self, device: torch.device, step: int):
        self.step = torch.tensor(step, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.first = torch.zeros((), dtype=torch.int64, device=device)  # the first bad step since the last read

    def add(self, bad: torch.Tensor) -> None:
        self.step += 1
        self.first = torch.where((self.count == 0) & bad, self.step, self.first)
        self.count += bad

    def read(self) -> tuple[int, int]:
        """(bad steps, the first of them) since the last read; one host sync."""
        count, first = torch.stack([self.count, self.first]).tolist()
        self.count.zero_(), self.first.zero_()
        return count, first


# Dense bf16/fp16 tensor-core peak per GPU, by a substring of torch.cuda.get_device_name().
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 70e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
    "T4": 65e12,
}


def peak_flops(device: torch.device) -> float | None:
    """The device's peak FLOPS, or None (CPU, or a GPU not in PEAK_FLOPS): then no MFU is logged."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


def adamw_kernel(implementation: str) -> dict:
    """torch.optim.AdamW's keyword for --adamw_implementation; auto is fused, measured the fastest
    (bench/results/latest.md) and supported on CPU and CUDA, also under DeepSpeed and FSDP."""
    return {
        "auto": {"fused": True},
        "fused": {"fused": True},
        "foreach": {"foreach": True},
        "for_loop": {"foreach": False},
    }[implementation]


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; biases and normalisation weights (the 1-d tensors) get no weight decay."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            # ZeRO-3 partitions parameters to shape [0] while loading; `ds_shape` keeps the real one
            (no_decay if len(getattr(param, "ds_shape", param.shape)) < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.training.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.training.learning_rate, **adamw_kernel(cfg.training.adamw_implementation))


class Trainer:
    """The outer training loop; subclasses implement the device-specific parts."""

    name = "trainer"  # the --training_type that picks it (cloudtrain.registry)
    summary = ""  # a line for --help

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
        self.train_dl: DataLoader = train_dataloader(data, self.loader_rows(t.micro_batch), t.seed, cfg.data)
        eval_rows = self.loader_rows(t.per_device_eval_batch_size)
        self.eval_dls = {"validation": eval_dataloader(data.validation, data, eval_rows, cfg.data)}
        if data.test is not None:
            self.eval_dls["test"] = eval_dataloader(data.test, data, eval_rows, cfg.data)
        self.predict_dls = {
            split: eval_dataloader(ds, data, eval_rows, cfg.data) for split, ds in data.unlabelled.items()
        }
        if t.torch_compile:
            model.compile()  # in place: the module keeps its class, state-dict keys and save_pretrained
        self.optimizer = build_optimizer(model, cfg)
        self.flops = ModelFlops.from_model(model)  # before setup(): DDP/DeepSpeed wrappers hide the config
        self.clock = StepClock(runtime.device)  # this process's step, data and forward time (cloudtrain.monitoring)

    # ------------------------------------------------------------ what subclasses provide
    mode = "plain PyTorch"

    own_options: tuple[str, ...] = ()  # options only this trainer reads; others refuse them
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

    def store_per_node(self) -> None:
        """Checkpoint folders are node-local: each node's first process must also write the shared files."""

    def loader_rows(self, per_process: int) -> int:
        """Rows a data loader yields per batch: one process's share (accelerate shards the loaders)."""
        return per_process

    def autocast(self):
        raise NotImplementedError

    def save_model(self, output_dir: Path) -> None:
        raise NotImplementedError

    def write_checkpoint(self, folder: Path) -> None:
        raise NotImplementedError

    def load_checkpoint(self, folder: Path) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ the loop
    def fit(self, checkpointer: Checkpointer | None = None, resume_from: Path | None = None) -> TrainResult:
        """Train for the configured steps, logging, evaluating and checkpointing on schedule."""
        if checkpointer:
            self.checkpoint_owner = checkpointer.owner
            if checkpointer.storage.per_node:
                self.store_per_node()  # before setup(): DeepSpeed reads its checkpoint settings there
        self.setup()
        self.model.train()  # from_pretrained returns the model in eval mode: dropout would stay off
        self._peak_flops = peak_flops(self._device)
        t, k = self.cfg.training, self.cfg.training.gradient_accumulation_steps
        steps_per_epoch = math.ceil(len(self.train_dl) / k)
        total_steps = t.max_steps or math.ceil(t.num_train_epochs * steps_per_epoch)
        self.scheduler = get_scheduler(
            t.lr_scheduler_type,
            self.optimizer,
            num_warmup_steps=round(t.warmup_ratio * total_steps),
            num_training_steps=total_steps,
        )
        state = self.resume(resume_from) if resume_from else TrainerState()
        self._announce(steps_per_epoch, total_steps)

        meter = Meter(self.runtime, state, self._device)
        guard = NonfiniteGuard(self._device, state.global_step)
        watch = self.cfg.monitoring.monitoring
        places = self.runtime.gather_objects(f"node {self.runtime.node}, {self.runtime.host}") if watch else []
        detector = AnomalyDetector(self.cfg.monitoring, places)
        bar = tqdm(
            total=total_steps,
            initial=state.global_step,
            desc="training",
            dynamic_ncols=True,
            disable=not self.is_main_process,
        )
        if t.eval_on_start and state.global_step == 0:
            self._evaluate_during_training(state, bar)
        self.phase = "the first step"
        try:
            with PreemptionSignal() as preemption, bar:
                while state.global_step < total_steps:
                    epoch, steps_done = divmod(state.global_step, steps_per_epoch)
                    set_epoch(self.train_dl, epoch)  # this epoch's order: seed + epoch
                    batches = skip_first_batches(self.train_dl, steps_done * k) if steps_done else self.train_dl
                    self.clock.start_step()
                    for window in micro_batch_windows(batches, k):
                        window = [self.move(batch) for batch in window]
                        self.clock.data_ready()
                        self.phase = "the all-reduce of the step's token count"
                        scale = self._loss_scale(window)
                        self.phase = "forward and backward (the gradient all-reduce)"
                        stats = self.backward_window(window, scale)
                        self.phase = "the optimizer step"
                        bad = self.runtime.any_process(~torch.isfinite(stats.loss_sum))  # stays on the device
                        self.apply_step(bad)
                        guard.add(bad)
                        meter.add(window, stats, applied=~bad & self.counts_batches)
                        self.scheduler.step()
                        self.clock.end_step()
                        state.global_step += 1
                        bar.update(1)
                        step, done = state.global_step, state.global_step >= total_steps
                        end_of_epoch = step % steps_per_epoch == 0
                        log_due = done or step % t.logging_steps == 0
                        eval_due = not done and (
                            (t.eval_strategy == "steps" and step % t.eval_steps == 0)  # type: ignore[operator]  # config checks it is set
                            or (t.eval_strategy == "epoch" and end_of_epoch)
                        )
                        save_due = bool(checkpointer and checkpointer.due(step, end_of_epoch))
                        # Flags are read where the loop syncs anyway: before anything is logged, evaluated or saved.
                        preempted = (log_due or eval_due or save_due) and self._read_flags(
                            guard, preemption, state, checkpointer
                        )
                        anomalies: list[Anomaly] = []
                        self.phase = "the logging step's all-reduce"
                        if log_due:
                            local = self.clock.read() + peak_memory(self._device) if watch else None
                            interval = meter.flush(local)
                            self._log_interval(step, step / steps_per_epoch, interval, stats, bar)
                            if watch:
                                anomalies = self._watch(detector, step, interval, bar)
                        act = self.cfg.monitoring.on_anomaly if anomalies else "warn"  # the same on every process
                        self.phase = "evaluation"
                        if eval_due:
                            self._evaluate_during_training(state, bar)
                        self.phase = "saving a checkpoint"
                        if checkpointer and (save_due or preempted or act != "warn"):
                            saved = self.save_checkpoint(checkpointer, state, meter)
                        if preempted or act == "stop":
                            where = (
                                f"checkpoint saved to {saved}" if checkpointer else "no checkpoint (none configured)"
                            )
                        if preempted:
                            raise TrainingStopped(
                                f"stopped by SIGTERM at step {step}; {where}: continue with "
                                "--resume_from_checkpoint latest",
                                143,
                            )
                        if act == "stop" and not done:  # at the end the model is saved as usual
                            raise TrainingStopped(
                                f"stopped at step {step} on {anomalies[0].kind.replace('_', ' ')} (--on_anomaly stop); "
                                f"{where}: look at the run, then continue with --resume_from_checkpoint latest",
                                3,
                                quiet=not self.is_main_process,
                            )
                        if done:
                            break
                        self.clock.start_step()
                        self.phase = "loading the data"
        except RuntimeError as err:  # gloo raises where the process waits; NCCL's watchdog names the operation
            if not (what := collective_failure(err, self.cfg.distributed.collective_timeout)):
                raise
            raise TrainingStopped(
                f"process {self.runtime.index} (node {self.runtime.node}) {what}, in {self.phase} after step "
                f"{state.global_step}; see the other processes' logs (the launcher names the one that "
                f"failed). Backend: {str(err).splitlines()[0][:160]}",
                1,
            ) from None
        return TrainResult(
            global_step=state.global_step,
            epoch=state.global_step / steps_per_epoch,
            train_loss=state.loss_sum / max(state.loss_count or state.samples, 1),
            runtime_s=state.runtime_s + meter.elapsed(),
            train_samples=state.samples,
            train_tokens=state.tokens,
        )

    def _loss_scale(self, window: list[dict]) -> torch.Tensor:
        """Process count / the step's count over all micro-batches and processes (one all-reduce)."""
        local = torch.stack([self.task.loss_count(batch) for batch in window]).sum().double()
        return (self.num_processes / self.runtime.reduce_sum(local).clamp(min=1)).float()

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

    def _read_flags(
        self,
        guard: NonfiniteGuard,
        preemption: PreemptionSignal,
        state: TrainerState,
        checkpointer: Checkpointer | None,
    ) -> bool:
        """Act on the non-finite steps since the last read: stop (default) or count them; then whether any
        process received SIGTERM (one small collective)."""
        count, first = guard.read()
        if count and self.cfg.checkpoint.nonfinite_loss == "skip":
            state.skipped_steps += count
            self.run_log.log({"train/skipped_steps": state.skipped_steps}, step=state.global_step)
        elif count:
            last = checkpointer.latest() if checkpointer else None
            where = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
            raise TrainingStopped(
                f"the loss became non-finite at step {first}; training stopped and no model "
                f"was saved ({where}). Lower --learning_rate or use --nonfinite_loss skip",
                1,
            )
        return self.runtime.agree([preemption.received])[0]

    def save_checkpoint(self, checkpointer: Checkpointer, state: TrainerState, meter: Meter) -> Path:
        runtime_s = self.runtime.share(state.runtime_s + meter.elapsed())  # every node writes the same state
        snapshot = dataclasses.replace(state, interval=meter.pending(), runtime_s=runtime_s)
        return checkpointer.save(
            state.global_step, self.write_checkpoint, type(self).__name__, self.runtime.mesh, snapshot
        )

    def resume(self, folder: Path) -> TrainerState:
        """Restore weights, optimizer, schedule and RNG from `folder`; returns its trainer state."""
        meta = read_state(folder)
        check_compatible(meta, folder, type(self).__name__, self.runtime.mesh)
        start = time.perf_counter()
        try:
            self.load_checkpoint(folder)
        except UserError:
            raise
        except Exception as err:  # torch, safetensors and accelerate raise many kinds for a damaged file
            raise UserError(
                f"checkpoint {folder} could not be loaded ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200]}); it may be damaged: pass another "
                "--resume_from_checkpoint"
            ) from None
        state = TrainerState(**meta["state"])
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

    def evaluate(self, split: str) -> dict:
        """The task's metrics of the current weights on one split, counted over every example exactly once."""
        return self.task.evaluate(
            self.model,
            self.eval_dls[split],
            self.data,
            gather=self.runtime.gather,
            move=self.move,
            autocast=self.autocast,
        )

    def predict(self, split: str):
        """The task's predictions for an unlabelled split, in the split's order."""
        return self.task.predict(
            self.model, self.predict_dls[split], gather=self.runtime.gather, move=self.move, autocast=self.autocast
        )

    def log_evaluation(self, metrics: dict, prefix: str, step: int) -> None:
        """An evaluation's numbers and tables to the run log."""
        self.run_log.log(scalar_metrics(metrics, f"{prefix}/"), step=step)
        for name, (header, rows) in self.task.tables(metrics).items():
            self.run_log.log_table(f"{prefix}/{name}", header, rows, step=step)

    def _evaluate_during_training(self, state: TrainerState, bar: tqdm) -> None:
        metrics = self.evaluate("validation")
        state.evaluations.append({"step": state.global_step, **scalar_metrics(metrics, "")})
        self.log_evaluation(metrics, "eval", state.global_step)
        if self.is_main_process:
            bar.write(f"eval @ step {state.global_step}: {self.task.describe_metrics(metrics)}")

    def _log_interval(self, step: int, epoch: float, interval: dict, stats: StepStats, bar: tqdm) -> None:
        values = {
            "train/loss": interval["loss"],
            "train/learning_rate": self.scheduler.get_last_lr()[0],
            "train/epoch": round(epoch, 4),
            "train/samples_per_s": interval["samples_per_s"],
            "train/tokens_per_s": interval["tokens_per_s"],
        }
        if stats.grad_norm is not None:
            values["train/grad_norm"] = float(stats.grad_norm)
        if self._peak_flops:
            flops = self.flops.training_flops(interval["tokens"], interval["squared_lengths"])
            values["train/mfu"] = flops / interval["seconds"] / self.num_processes / self._peak_flops
        values.update(self._monitored(interval["by_process"]))
        self.run_log.log(values, step=step)
        if self.is_main_process:
            bar.write(
                f"step {step}/{bar.total} | epoch {epoch:.2f} | loss {values['train/loss']:.4f} | "
                f"lr {values['train/learning_rate']:.2e} | {values['train/samples_per_s']:.1f} samples/s | "
                f"{values['train/tokens_per_s']:.0f} tokens/s"
                + (f" | MFU {values['train/mfu']:.1%}" if "train/mfu" in values else "")
                + (
                    f" | {values['train/step_time_s'] * 1000:.0f} ms/step, data {values['train/data_time_share']:.0%}"
                    f" | peak {values['train/peak_memory_gib']:.2f} GiB"
                    if "train/step_time_s" in values
                    else ""
                )
            )

    def _monitored(self, by_process: list[list[float]]) -> dict:
        """Step time, data share and peak memory from every process's [steps, step s, data s, forward s,
        memory, reserved memory] (empty with --monitoring false)."""
        if not by_process or not by_process[0] or not by_process[0][0]:
            return {}
        steps = sum(p[0] for p in by_process)
        step_s, data_s = sum(p[1] for p in by_process), sum(p[2] for p in by_process)
        values = {
            "train/step_time_s": step_s / steps,
            "train/data_time_share": data_s / max(step_s, 1e-9),
            "train/peak_memory_gib": max(p[4] for p in by_process),
        }
        if self._device.type == "cuda":
            values["train/peak_reserved_gib"] = max(p[5] for p in by_process)
        return values

    def _watch(self, detector: AnomalyDetector, step: int, interval: dict, bar: tqdm) -> list[Anomaly]:
        """Judge the interval (every process alike); the main process reports what it found."""
        first = step - len(interval["step_losses"]) + 1
        steps = list(range(first, step + 1))
        found = detector.check_steps(steps, interval["step_losses"], interval["grad_norms"])
        by_process = interval["by_process"]
        if by_process and by_process[0] and by_process[0][0]:
            step_s = sum(p[1] for p in by_process) / len(by_process)
            work = [(p[2] + p[3]) / max(p[0], 1) for p in by_process]  # data + forward: no waiting on others
            found += detector.check_interval(step, interval["tokens"] / max(step_s, 1e-9), work)
        for anomaly in found:
            self.run_log.event(anomaly.kind, anomaly.message, anomaly.value, step=anomaly.step)
            if self.is_main_process:
                bar.write(f"warning: {anomaly.message}")
        return found

    def parameter_counts(self) -> tuple[int, int]:
        """(all, trainable) parameters of the whole model."""
        return count_parameters(self.model), count_parameters(self.model, trainable=True)

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
                f"{t.gradient_accumulation_steps} accumulation), {total_steps} steps "
                f"({steps_per_epoch} per epoch)",
                flush=True,
            )
