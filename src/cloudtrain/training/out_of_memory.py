"""Out of memory during a run, said in one line instead of a traceback: what the run was doing, what it asked
for, and the options that need less memory, where the step with the same global batch comes first (a checkpoint
of the run resumes with it). `cloudtrain plan` estimates each choice (docs/planner.md). A data loader worker
killed under the run (most often by the host's out-of-memory killer) is one line too."""

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from cloudtrain.config import Config
from cloudtrain.errors import UserError

if TYPE_CHECKING:
    from cloudtrain.tasks.base import Task

ASKED = re.compile(r"[Tt]ried to allocate (\d+(?:\.\d+)? ?[KMGT]i?B|\d+ bytes)")
# torch's words for a worker gone: its SIGCHLD handler's, and the loader's when the worker's queue goes quiet
WORKER_KILLED = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (is killed by signal: [^.]+|exited unexpectedly)"
)
SIGNS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "can't allocate memory")  # CUDA, cuBLAS, the CPU allocator


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or any(sign in str(err) for sign in SIGNS)


@contextlib.contextmanager
def said_in_one_line(cfg: Config, task: "Task", doing: Callable[[], str]) -> Iterator[None]:
    """Turn running out of memory into a UserError naming `doing()` (what the run was doing) and the remedies."""
    try:
        yield
    except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
        if killed := WORKER_KILLED.search(str(err)):
            raise UserError(worker_killed(cfg, killed)) from None
        if not is_out_of_memory(err):
            raise
        raise UserError(explain(cfg, task, doing(), err)) from None


def worker_killed(cfg: Config, killed: re.Match) -> str:
    workers = cfg.data.dataloader_num_workers
    fewer = f"fewer --dataloader_num_workers than {workers}, or " if workers > 1 else ""
    resume = "; then --resume_from_checkpoint latest continues" if cfg.checkpoint.checkpointing_steps else ""
    return (
        f"a data loader worker (pid {killed.group(1)}) {killed.group(2).replace('is killed', 'was killed')} (most "
        f"often the host's out-of-memory killer): give {fewer}more host memory{resume}"
    )


def explain(cfg: Config, task: "Task", doing: str, err: BaseException) -> str:
    where = doing.split(" (")[0]  # a step's phase names its collectives in brackets: not what ran out
    asked = ASKED.search(str(err))
    size = f" (asked for {readable(asked.group(1))})" if asked else ""
    fixes = "; or ".join(remedies(cfg, task, where))
    return (
        f"out of memory in {where}{size}: {fixes}; `cloudtrain plan` with the same options estimates the memory "
        "each choice needs"
    )


def remedies(cfg: Config, task: "Task", where: str) -> list[str]:
    """What needs less memory where the run ran out, the first the least change to the training itself."""
    adapters = ["--peft lora (or qlora on CUDA)"] if cfg.model.peft == "none" else []
    if where.startswith(("loading", "placing", "saving")):  # the whole model at once, before or after the steps
        return [*adapters, "--zero_stage 3 or --fsdp true over several GPUs (the weights and states sharded)"]
    size = f"a smaller --{task.size_option} than {cfg.to_dict()[task.size_option]}"
    if where.startswith(("evaluation", "prediction")):
        rows = cfg.training.per_device_eval_batch_size
        return [f"lower --per_device_eval_batch_size {rows} to {rows // 2}" if rows > 1 else size]
    t, fixes = cfg.training, []
    micro = t.per_device_train_batch_size
    if isinstance(micro, int) and micro > 1:
        from cloudtrain.batch_size import largest_divisor  # (that module imports this one)

        smaller = largest_divisor(micro, micro // 2)
        fixes.append(
            f"--per_device_train_batch_size {smaller} --gradient_accumulation_steps "
            f"{t.gradient_accumulation_steps * micro // smaller} (the same global batch)"
        )
    if not cfg.model.gradient_checkpointing:
        fixes.append("--gradient_checkpointing true")
    if not isinstance(micro, int) or micro == 1:
        fixes.append(size)
    return [*fixes, *adapters][:3]


def readable(size: str) -> str:
    """'6553600000 bytes' as GiB; a size torch already wrote in units as it is."""
    if size.endswith("bytes"):
        return f"{int(size.split()[0]) / 2**30:.1f} GiB"
    return size
