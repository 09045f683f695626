"""The runtime of one launch: who this process is, and how tensors meet across processes.

Built once per launch (`Runtime.for_launch`) and handed to the pipeline and the trainers, so nothing
else asks whether it runs under accelerate:
- one process (`--training_type basic`): main, index 0 of 1, CUDA when present else CPU; every
  collective is the identity;
- accelerate (`--training_type accelerated`, any launcher): the Accelerator that
  cloudtrain.parallel.distributed builds for this launch, whose collectives these methods call;
- pipeline (`--training_type pipeline`, torchrun or accelerate launch): a torch.distributed process
  group laid out as a (data-parallel, pipeline) mesh, with no accelerate (`PipelineRuntime`).
"""

import atexit
import contextlib
import datetime
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather, gather_object, recursively_apply

from cloudtrain.config import Config
from cloudtrain.parallel.mesh import Mesh

# How long the others wait while the owners of a cache fill it (tokenizing a large dataset once per node): work of
# unknown length, not a hung peer, so it is not cut at --collective_timeout (transformers' users meet that as the
# watchdog's timeout in main_process_first and raise ddp_timeout for it).
PREPARATION_WAIT_S = 24 * 3600.0


class Runtime:
    """Process identity and collectives; `accelerator` is None for a plain one-process run."""

    collective_timeout: float | None = None  # --collective_timeout once set on the launch's process groups

    def __init__(self, accelerator: Accelerator | None = None):
        self.accelerator = accelerator
        acc = accelerator
        self.is_main: bool = acc.is_main_process if acc else True
        self.index: int = acc.process_index if acc else 0
        self.count: int = acc.num_processes if acc else 1
        self.device: torch.device = acc.device if acc else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.node, self.host = node_index(), socket.gethostname()
        # one process or DDP; for_launch sets the trainer's own
        self.mesh = Mesh(world=self.count, dp_replicate=self.count)

    @classmethod
    def for_launch(cls, cfg: Config, mesh: Mesh | None = None) -> "Runtime":
        """The runtime of the `--training_type` trainer (it builds the Accelerator or process group it needs),
        arranged as `mesh` (default: the trainer's mesh for this launch)."""
        from cloudtrain.registry import TRAINERS

        trainer = TRAINERS[cfg.training.training_type]
        runtime = trainer.launch(cfg)
        runtime.mesh = mesh or trainer.mesh(cfg, runtime.count)
        if cfg.training.tf32:
            use_tf32(runtime)
        return runtime

    def barrier(self) -> None:
        if self.accelerator:
            self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def owner_first(self, owner: bool) -> Iterator[None]:
        """The owners of a folder (checkpointing.Storage: one per node on local disks, one in all on a shared
        filesystem) run the block first, filling a cache there; then the others, which read it. Their wait is
        not cut at --collective_timeout (PREPARATION_WAIT_S)."""
        if self.count > 1 and not owner:
            self.patient_barrier()
        yield
        if self.count > 1 and owner:
            self.patient_barrier()

    def set_collective_timeout(self, seconds: float) -> None:
        """How long a collective of any group this process is in waits for the others before the run stops."""
        set_collective_timeout(seconds)
        self.collective_timeout = seconds

    def patient_barrier(self) -> None:
        """A barrier that waits up to PREPARATION_WAIT_S (or --collective_timeout if longer)."""
        if self.collective_timeout is None:
            return self.barrier()
        set_collective_timeout(max(self.collective_timeout, PREPARATION_WAIT_S))
        try:
            self.barrier()
        finally:  # a notebook's run that failed here leaves the group as it found it
            set_collective_timeout(self.collective_timeout)

    def gather_objects(self, value: Any) -> list:
        """Every process's `value` (picklable), in process order, on every process."""
        return gather_object([value]) if self.count > 1 else [value]

    def gather(self, tensors: Any) -> Any:
        """Per-example tensors of every process, each example once (the last batch's duplicates dropped)."""
        return self.accelerator.gather_for_metrics(tensors) if self.accelerator else tensors

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over processes, on every process."""
        return self.accelerator.reduce(tensor, reduction="sum") if self.accelerator else tensor

    def any_process(self, flag: torch.Tensor) -> torch.Tensor:
        """A device flag, true on every process if it is true on any; no host sync."""
        return self.reduce_sum(flag.float()) > 0

    def agree(self, flags: list[bool]) -> list[bool]:
        """Each host flag is true on every process if it is true on any."""
        if self.count == 1:
            return flags
        assert self.accelerator is not None  # there is one with more than one process
        votes = self.accelerator.gather(torch.tensor([flags], dtype=torch.int32, device=self.device))
        return votes.amax(dim=0).bool().tolist()

    def smallest(self, value: int) -> int:
        """The smallest of each process's `value`, on every process."""
        if self.count == 1:
            return value
        assert self.accelerator is not None  # there is one with more than one process
        values = self.accelerator.gather(torch.tensor([value], dtype=torch.int64, device=self.device))
        return int(values.min())

    def set_batch(self, micro_batch: int, accumulation: int) -> None:
        """Tell the launch a micro-batch chosen after it was set up (--per_device_train_batch_size auto)."""
        if self.accelerator:
            from cloudtrain.parallel.distributed import set_batch

            set_batch(self.accelerator, micro_batch, accumulation)

    def share(self, value: Any) -> Any:
        """The main process's `value` (a picklable object), on every process."""
        return broadcast_object_list([value])[0] if self.count > 1 else value

    def close(self) -> None:
        """Leave the launch's process group at the end of a multi-process run: left alive, gloo's threads can abort
        the interpreter's exit (SIGABRT after a complete ZeRO-3 run, seen under load). One process has no group of
        its own (accelerate's state, which in-process runs share, stays)."""
        if self.count > 1 and dist.is_initialized():
            _destroy_group()

    def run_on_main(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the main process only; its result on every process."""
        return self.share(fn() if self.is_main else None)


class GroupRuntime(Runtime):
    """The accelerate runtime on a (data parallel, group) mesh, where a group's processes take the same rows
    (tensor or context parallelism): rank = data-parallel index x degree + group rank, so a group's processes
    are neighbours (on one node where they fit). `gather` keeps each row once, `combine`d over its group."""

    dim = ""  # the group's mesh dimension: "tp" or "cp"

    def __init__(self, accelerator: Accelerator, degree: int, data_parallel: str = "dp_replicate"):
        super().__init__(accelerator)
        from torch.distributed.device_mesh import init_device_mesh

        self.degree = degree
        self.data_mesh = init_device_mesh(
            self.device.type, (self.count // degree, degree), mesh_dim_names=(data_parallel, self.dim)
        )
        self.group_rank: int = self.data_mesh.get_local_rank(self.dim)

    def combine(self, grouped: torch.Tensor) -> torch.Tensor:
        """[data-parallel, degree, rows, ...] -> [data-parallel, rows, ...]: a group's values of each row as one."""
        raise NotImplementedError

    def gather(self, tensors: Any) -> Any:
        assert self.accelerator is not None  # built with one
        state, every = self.accelerator.gradient_state, gather(tensors)  # in process order

        def once(tensor: torch.Tensor) -> torch.Tensor:
            grouped = tensor.reshape(self.count // self.degree, self.degree, -1, *tensor.shape[1:])
            rows = self.combine(grouped).flatten(0, 1)
            if state.end_of_dataloader and state.remainder > 0:  # the last batch's padding rows
                rows = rows[: state.remainder]
            return rows

        return recursively_apply(once, every)


class PipelineRuntime(Runtime):
    """Processes on a (dp, pp) mesh: rank = dp_rank * pp_size + pp_rank, so each pipeline's processes are
    neighbours (on one node where they fit: stage-to-stage traffic is the heavy one). Collectives of the
    Runtime interface span every process."""

    def __init__(self, pp_size: int, collective_timeout: float):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        self.device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        join_launch("nccl" if self.device.type == "cuda" else "gloo")
        self.accelerator = None
        self.node, self.host = node_index(), socket.gethostname()
        self.index, self.count = dist.get_rank(), dist.get_world_size()
        self.is_main = self.index == 0
        self.pp_size, self.dp_size = pp_size, self.count // pp_size
        self.mesh = Mesh(world=self.count, dp_replicate=self.dp_size, pp=pp_size)
        self.dp_rank, self.pp_rank = divmod(self.index, pp_size)
        # Every process creates every group, each with the timeout from the start: gloo's sends and receives
        # (stage to stage) keep a group's first timeout, whatever is set later.
        timeout = datetime.timedelta(seconds=collective_timeout)
        pipes = [list(range(d * pp_size, (d + 1) * pp_size)) for d in range(self.dp_size)]
        self.pp_group = [dist.new_group(ranks, timeout=timeout) for ranks in pipes][self.dp_rank]
        replicas = [list(range(p, self.count, pp_size)) for p in range(pp_size)]  # each stage's, across pipelines
        self.dp_group = [dist.new_group(ranks, timeout=timeout) for ranks in replicas][self.pp_rank]
        # the first and last process of each pipeline (tied embeddings)
        self.ends_group = [dist.new_group([p[0], p[-1]], timeout=timeout) for p in pipes][self.dp_rank]
        self.set_collective_timeout(collective_timeout)

    def barrier(self) -> None:
        dist.barrier()

    def gather_objects(self, value: Any) -> list:
        parts: list = [None] * self.count
        dist.all_gather_object(parts, value)
        return parts

    def gather(self, tensors: Any) -> Any:
        parts: list = [None] * self.count
        dist.all_gather_object(parts, tensors)
        if isinstance(tensors, torch.Tensor):
            return torch.cat([p.to(self.device) for p in parts])
        return type(tensors)(torch.cat([p[i].to(self.device) for p in parts]) for i in range(len(tensors)))

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    def agree(self, flags: list[bool]) -> list[bool]:
        votes = torch.tensor(flags, dtype=torch.int32, device=self.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return votes.bool().tolist()

    def smallest(self, value: int) -> int:
        values = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
        return int(values)

    def share(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():  # left alive, gloo's threads can abort the interpreter's exit
            _destroy_group()


def node_index() -> int:
    """This process's node: torchrun's GROUP_RANK, else derived from the ranks, else 0."""
    env = os.environ
    if "GROUP_RANK" in env:
        return int(env["GROUP_RANK"])
    if "RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return int(env["RANK"]) // max(int(env["LOCAL_WORLD_SIZE"]), 1)
    return 0


def collective_failure(err: BaseException, timeout: float) -> str | None:
    """What a backend error says happened to the launch, in words, or None if it is no such error."""
    text = str(err)
    if "Timed out waiting" in text or "Application timeout" in text or isinstance(err, dist.DistBackendError):
        return f"waited longer than --collective_timeout {timeout:g}s for the other processes"  # gloo; NCCL's
    if "closed by peer" in text or "reset by peer" in text or isinstance(err, dist.DistNetworkError):
        return "lost a peer: another process of the launch died"
    return None


def set_collective_timeout(seconds: float) -> None:
    """How long a collective of any group this process is in waits for the others: the launch's group and those
    made since (a device mesh's, DeepSpeed's, the pipeline's), which torch otherwise gives its defaults (10 min
    on NCCL, 30 min on gloo). Groups made later need it again: the AcceleratedTrainer sets it after prepare()
    (DeepSpeed's and FSDP's groups), the background save makes its group with it.

    Set after the group exists, not through init_process_group(timeout=...): under torchrun that argument
    makes restarted workers read the dead workers' gloo addresses from the store (tried: --max-restarts
    then fails to connect)."""
    if not dist.is_initialized():
        return
    for group in list(dist.distributed_c10d._world.pg_map):  # only the groups this process is a member of
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def join_launch(backend: str) -> None:
    """Join the launch's process group (a no-op for one process, or when joined already).

    torchrun keeps one store for the whole launch, also across the restarts of --max-restarts: workers of
    a restart that joined through it directly would find the dead workers' keys (tried: gloo then fails
    to connect, or waits forever). Each attempt's keys, and each join of a process, get a prefix of their own."""
    env = os.environ
    if dist.is_initialized() or int(env.get("WORLD_SIZE", "1")) == 1 or "MASTER_ADDR" not in env:
        return  # (no MASTER_ADDR: the Python API under a launcher of another kind; accelerate joins its way)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    hosts_store = rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # else torchrun's agent does
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=hosts_store)
    dist.init_process_group(backend, store=dist.PrefixStore(join_prefix(store, rank, world), store), rank=rank,
                            world_size=world)  # fmt: skip
    atexit.register(_leave)  # the group goes before the interpreter does: gloo's threads can abort its exit


def join_prefix(store: Any, rank: int, world: int) -> str:
    """The store prefix of this join's keys, the same on every process of the group and new for each group: the
    count of joins by the processes of this rank (at this world size), kept in the launch's store. Every process
    joins once per attempt of torchrun's, and once per run (cloudtrain.train twice in one process), so the counts
    agree. (torchrun's restart count does not: after one node's worker died, a c10d launch restarts the healthy
    node's workers with their count unchanged, and the two nodes waited on each other's keys.)"""
    joins = store.add(f"cloudtrain/world-{world}/rank-{rank}/joins", 1)
    return f"cloudtrain/world-{world}/join-{joins}"


def _leave() -> None:
    if dist.is_initialized():
        _destroy_group()


def use_tf32(runtime: Runtime) -> None:
    """--tf32: float32 matmuls and convolutions in TF32 on this launch's CUDA device, before the model loads
    (nothing to set elsewhere: TF32 is a mode of NVIDIA tensor cores)."""
    if runtime.device.type != "cuda":
        if runtime.is_main:
            print(f"note: --tf32 has no effect on {runtime.device.type} (TF32 is a CUDA matmul mode)")
        return
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "tf32"  # type: ignore[attr-defined]  # present, not in the stubs


_LEFT: list = []  # the groups a process of a launch has left, kept until it exits (see _destroy_group)


def _destroy_group() -> None:
    """Leave the process group; through DeepSpeed where it is loaded, which then forgets the groups it cached
    (a next run in this process would otherwise use a group of the destroyed one: "not registered").

    A process of a launch keeps the groups' objects: else the last reference to a gloo group can be a DDP model's,
    freed with the GIL held just after the last collective, and the group's destructor then waits for its worker
    thread, which waits for the GIL to free that collective's tensors (a stopped launch hung, 1 in 12 under load).
    They go at the interpreter's exit, before its teardown (where gloo's threads can abort it)."""
    if dist.get_world_size() > 1:
        _LEFT.extend(dist.distributed_c10d._world.pg_map)
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and ds_comm.cdb is not None:
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()


@atexit.register  # at import: the last to run, after a group left by _leave
def _free_left() -> None:
    if _LEFT:
        time.sleep(0.1)  # without the GIL: a group's thread still freeing its last collective can finish
        _LEFT.clear()
