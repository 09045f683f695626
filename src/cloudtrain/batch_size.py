"""The micro-batch and the accumulation: `--per_device_train_batch_size auto` and `--global_batch_size`.

`--global_batch_size G` fixes the examples per optimizer step over all processes; the accumulation
becomes G / (micro-batch x processes). With `auto` the micro-batch is found for this model on this
device, and the accumulation follows, so the global batch stays what was asked: G, or without it the
default micro-batch's (16 x processes x --gradient_accumulation_steps).

How `auto` finds it:
- CUDA without DeepSpeed or FSDP, where out-of-memory can be caught: forward and backward of worst-case
  batches (the longest training row, repeated) while the optimizer states' memory and a 5% headroom
  are held, growing by doubling from the planner's estimate, then bisecting between the last fit and
  the first failure. Every process probes its own device without collectives (the model is not
  wrapped yet), and the processes agree after each probe: one rank out of memory fails the probe for
  all. Every probe and the choice are printed.
- elsewhere: CPU, and DeepSpeed or FSDP (they shard or offload what a lone process would have to hold
  whole, so a probe would measure another set-up): the planner's estimate (cloudtrain.planning) against
  the memory available, said as such.
The choice is stored in every checkpoint; a resume takes it from there instead of searching again.
The chosen micro-batch divides the examples each process sees per step, so the global batch is exact.
"""

import gc
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from cloudtrain.config import Config, TrainingConfig
from cloudtrain.errors import UserError
from cloudtrain.hardware import autocast
from cloudtrain.planning.search import run_micro_batch
from cloudtrain.training.out_of_memory import is_out_of_memory

if TYPE_CHECKING:
    from cloudtrain.data.processing import ProcessedData
    from cloudtrain.parallel.runtime import Runtime
    from cloudtrain.tasks.base import Task

DEFAULT_MICRO_BATCH = 16  # the option's default; `auto` without --global_batch_size keeps its global batch


def target_global_batch(t: TrainingConfig, processes: int) -> int | None:
    """The examples per optimizer step over all processes that the options ask for (None: whatever the
    fixed micro-batch and accumulation give)."""
    if t.global_batch_size:
        return t.global_batch_size
    if t.per_device_train_batch_size == "auto":
        return DEFAULT_MICRO_BATCH * processes * t.gradient_accumulation_steps
    return None


def check(cfg: Config, processes: int) -> None:
    """Refuse a global batch that the processes (and a fixed micro-batch) cannot split evenly; no I/O."""
    t = cfg.training
    target = target_global_batch(t, processes)
    if target is None:
        return
    if target % processes:
        raise UserError(
            f"--global_batch_size {target} does not split over {processes} processes; use a multiple of {processes}"
        )
    micro, accumulation = t.per_device_train_batch_size, t.gradient_accumulation_steps
    if (
        t.global_batch_size
        and accumulation != 1
        and (not isinstance(micro, int) or target != micro * processes * accumulation)
    ):
        raise UserError(
            f"--gradient_accumulation_steps {accumulation} and --global_batch_size {target} disagree (with "
            f"--per_device_train_batch_size {micro} on {processes} process(es)); leave out "
            "--gradient_accumulation_steps: the global batch sets it"
        )
    if isinstance(micro, int) and (target // processes) % micro:
        raise UserError(
            f"--global_batch_size {target} gives each of the {processes} process(es) {target // processes} "
            f"examples per step, not a multiple of --per_device_train_batch_size {micro}; change one of them "
            "(or use --per_device_train_batch_size auto)"
        )


def with_batch(cfg: Config, micro: int, processes: int) -> Config:
    """`cfg` with this micro-batch and the accumulation that reaches the target global batch."""
    t = cfg.training
    target = target_global_batch(t, processes)
    accumulation = target // (micro * processes) if target else t.gradient_accumulation_steps
    return replace(
        cfg, training=replace(t, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)
    )


def fixed(cfg: Config, processes: int) -> Config:
    """Checked (`check`); then for a numeric micro-batch, the accumulation that --global_batch_size asks for."""
    check(cfg, processes)
    micro = cfg.training.per_device_train_batch_size
    return with_batch(cfg, micro, processes) if isinstance(micro, int) else cfg


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of n that is at most `at_most` (1 at least)."""
    return next(d for d in range(min(n, max(at_most, 1)), 0, -1) if n % d == 0)


def search(
    probe: Callable[[int], None],
    start: int,
    cap: int,
    agree: Callable[[list[bool]], list[bool]],
    say: Callable[[str], None],
) -> int:
    """The largest micro-batch in [1, cap] whose `probe` runs out of memory on no process (0: not even 1).

    Doubling from `start` while probes fit, then bisecting; a first probe that fails halves instead.
    `agree` makes each probe's outcome the same on every process (any failure fails it for all); an
    error other than out-of-memory on any process stops every process.
    """

    def fits(size: int) -> bool:
        out_of_memory = failed = False
        try:
            probe(size)
        except Exception as err:
            if not is_out_of_memory(err):
                say(f"batch size: micro-batch {size} failed: {type(err).__name__}: {str(err)[:200]}")
                failed = True
            out_of_memory = True
        if torch.cuda.is_available():  # the failed probe's activations are garbage now: give the memory back
            gc.collect()
            torch.cuda.empty_cache()
        out_of_memory, failed = agree([out_of_memory, failed])
        if failed:
            raise UserError(
                "the batch-size search failed on a process (see above); pass a number to --per_device_train_batch_size"
            )
        say(f"batch size: micro-batch {size}: {'out of memory' if out_of_memory else 'fits'}")
        return not out_of_memory

    size = min(max(start, 1), cap)
    if fits(size):
        low, high = size, None
        while high is None and low < cap:
            grown = min(low * 2, cap)
            low, high = (grown, None) if fits(grown) else (low, grown)
        if high is None:
            return low
    else:
        low, high = 0, size
        while low == 0 and high > 1:
            halved = high // 2
            low, high = (halved, high) if fits(halved) else (0, halved)
        if low == 0:
            return 0
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def worst_case_probe(
    model: torch.nn.Module, data, task, precision: str, device: torch.device
) -> tuple[Callable[[int], None], int]:
    """(probe, the longest row's tokens): probe(b) runs forward and backward of b copies of the task's costliest
    training row (`Task.probe_row`) on `device`, then frees the gradients."""
    row = task.probe_row(data.train)
    longest = task.probe_tokens(row)

    def probe(size: int) -> None:
        try:
            batch = {k: v.to(device) for k, v in data.collator([row] * size).items()}
            with autocast(precision, device):
                summed, _ = task.loss(model, batch)
            summed.backward()
        finally:
            model.zero_grad(set_to_none=True)

    return probe, longest


def reserve(model: torch.nn.Module, device: torch.device, processes: int) -> torch.Tensor | None:
    """Hold what AdamW's two moments (and DDP's gradient buckets) will take, and 5% of the device as headroom
    (the optimizer step's temporaries, fragmentation from uneven rows, evaluation), so probes see it taken."""
    if device.type != "cuda":  # the search runs on CPU only in tests, with out-of-memory injected
        return None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_parameter = 8 + (4 if processes > 1 else 0)
    headroom = torch.cuda.get_device_properties(device).total_memory // 20
    return torch.empty(trainable * per_parameter + headroom, dtype=torch.uint8, device=device)


def available_bytes(device: torch.device, local: int) -> int:
    """Memory this process may still use: its share of the host's free memory plus what it holds already
    (CPU: `local` processes share this host), or the device's free memory plus what torch has reserved (CUDA)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device)
    import psutil

    return psutil.virtual_memory().available // local + psutil.Process().memory_info().rss


def planner_estimate(
    cfg: Config, num_labels: int, processes: int, local: int, memory: int, seq_len: int
) -> tuple[int, str]:
    """(the largest micro-batch the planner fits into `memory` per process, or 0; why if it could not tell)."""
    try:
        return run_micro_batch(cfg, num_labels, local, max(processes // local, 1), memory, seq_len), ""
    except Exception as err:  # a model the planner cannot read (remote code, an unknown layout): probe from 1
        return 0, f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def rows_per_process(train, processes: int) -> int:
    """The training rows each process reads in an epoch: a micro-batch takes no more than these (8 samples of a
    small set as --per_device_train_batch_size 4096 warned "fits at most 1199": found in audit). A stream's are
    planned, not known: unbounded."""
    if not hasattr(train, "column_names"):  # a stream (StreamPlan): its length is an estimate
        return sys.maxsize
    try:
        return -(-len(train) // processes)  # each process reads its share of the rows, rounded up
    except TypeError:  # an iterable dataset without a length
        return sys.maxsize


def warn_beyond_estimate(cfg: Config, data: "ProcessedData", task: "Task", runtime: "Runtime") -> None:
    """A fixed micro-batch larger than the planner fits in the memory this process has: one warning before training
    (the estimate is within about 10% where measured: a warning, not a refusal). Silent where it cannot tell: a
    task it does not plan, a model split over processes, and under ZeRO-3, where building the planner's model on
    one process would join collectives the others never enter (deepspeed.zero.Init)."""
    from cloudtrain.parallel.distributed import sharding

    mesh = runtime.mesh
    if not task.plans_micro_batch or mesh.data_parallel != mesh.world or sharding(cfg).zero_stage == 3:
        return
    micro, processes = cfg.training.micro_batch, mesh.data_parallel
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(processes)))
    memory = available_bytes(runtime.device, local)
    try:  # a stream's rows are --max_length long; a task without token rows is not planned
        longest = (
            cfg.data.max_length
            if not hasattr(data.train, "column_names")
            else task.probe_tokens(task.probe_row(data.train))
        )
    except Exception:
        return
    estimate, why = planner_estimate(cfg, len(data.label_names) or 2, processes, local, memory, longest)
    if why or estimate >= min(micro, rows_per_process(data.train, processes)):
        return
    fits = f"at most {estimate}" if estimate else "not even one"
    keep = ""
    if estimate:
        smaller = largest_divisor(micro, estimate)
        accumulation = cfg.training.gradient_accumulation_steps * micro // smaller
        keep = (
            f" (--per_device_train_batch_size {smaller} --gradient_accumulation_steps {accumulation} keeps the batch)"
        )
    print(
        f"warning: micro-batch {micro} may not fit: the planner fits {fits} row(s) of {longest} tokens in the "
        f"{memory / 2**30:.1f} GiB this process has; lower --per_device_train_batch_size{keep}, or pass "
        "--per_device_train_batch_size auto",
        flush=True,
    )


def choose(cfg: Config, model: torch.nn.Module, data, task, runtime, stored: dict | None) -> Config:
    """`cfg` with `auto` replaced by the micro-batch found (or stored in the checkpoint being resumed), and
    the accumulation that keeps the global batch."""
    from cloudtrain.parallel.distributed import sharding

    say = print if runtime.is_main else (lambda text: None)
    processes = runtime.mesh.data_parallel
    per_process = target_global_batch(cfg.training, processes) // processes
    if stored:
        micro = stored["per_device_train_batch_size"]
        if per_process % micro:
            raise UserError(
                f"the checkpoint's micro-batch {micro} does not divide the {per_process} examples per process per "
                "step this run asks for; resume with the global batch it was trained with"
            )
        say(f"batch size: {micro} per device, as stored in the checkpoint (no new search)")
        return with_batch(cfg, micro, processes)
    device = runtime.device
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(processes)))  # processes on this node
    memory = runtime.smallest(available_bytes(device, local))
    probe, longest = worst_case_probe(model, data, task, cfg.training.mixed_precision, device)
    estimate, why = planner_estimate(cfg, len(data.label_names) or 2, processes, local, memory, longest)
    say(
        f"batch size: the planner fits micro-batch {estimate} in {memory / 2**30:.1f} GiB per process "
        f"(rows of {longest} tokens)" + (f"; it could not estimate: {why}" if why else "")
    )
    shards = sharding(cfg)
    if device.type == "cuda" and shards.zero_stage is None and not shards.fsdp:
        found = probe_on_device(model, probe, device, processes, estimate, per_process, runtime, say)
    else:
        where = (
            "DeepSpeed and FSDP shard or offload what a probe would hold whole"
            if device.type == "cuda"
            else (f"out-of-memory cannot be caught on {device.type}")
        )
        fallback = "" if estimate else " (it fits none, or could not tell: micro-batch 1, which may not fit)"
        say(f"batch size: no probing ({where}): the planner's estimate is used as is{fallback}")
        found = estimate or 1
    micro = largest_divisor(per_process, found)
    chosen = with_batch(cfg, micro, processes)
    if found >= per_process:
        why = f" (up to {found} fit; each process takes {per_process} per step)" if found > per_process else ""
    else:
        why = f" (up to {found} fit; {micro} divides the {per_process} each process takes per step)" * (micro != found)
    accumulation = chosen.training.gradient_accumulation_steps
    say(
        f"batch size: {micro} per device x {processes} process(es) x {accumulation} accumulation = "
        f"global batch {micro * processes * accumulation}{why}"
    )
    return chosen


def probe_on_device(model, probe, device, processes: int, estimate: int, cap: int, runtime, say) -> int:
    """The search on a CUDA device, with the optimizer states' memory and the headroom held; UserError if
    nothing fits. Placing the model is agreed on too: a rank that cannot hold it must not leave the others
    waiting in the first probe's collective."""
    was_training = model.training
    held, failed = None, None
    try:
        model.to(device).train()
        held = reserve(model, device, processes)
    except Exception as err:  # agreed on below, so that no process is left waiting in the first probe
        failed = err
    out_of_memory, other = runtime.agree([failed is not None and is_out_of_memory(failed), failed is not None])
    if out_of_memory:
        raise UserError(
            "the model and its optimizer states do not fit on the GPU: shard with --zero_stage 3, offload, or "
            "train adapters (--peft lora/qlora); `cloudtrain plan` compares them"
        )
    if other:
        what = f"{type(failed).__name__}: {str(failed)[:200]}" if failed else "on another process"
        raise UserError(
            f"placing the model on the GPU for the batch-size search failed ({what}); pass a number to "
            "--per_device_train_batch_size"
        )
    try:
        found = search(probe, estimate or 1, cap, runtime.agree, say)
    finally:
        del held
        model.train(was_training)
        torch.cuda.empty_cache()
    if found == 0:
        raise UserError(
            "not even micro-batch 1 fits in GPU memory: enable --gradient_checkpointing true, shard with "
            "--zero_stage 3, or train adapters (--peft lora/qlora); `cloudtrain plan` compares them"
        )
    return found
