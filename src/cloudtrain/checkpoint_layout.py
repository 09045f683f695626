"""Whether a checkpoint resumes under this run's trainer, process count and process layout (`check_compatible`):
the mesh it was written with (cloudtrain.parallel.mesh), the global batch its step is a position in, and the states
another process count can read. A layout that differs is refused naming the options that make the checkpoint's
(`layout_options`). The checkpoints themselves: cloudtrain.checkpointing."""

from pathlib import Path

from cloudtrain.errors import UserError
from cloudtrain.parallel.mesh import Mesh

# the option that sets each degree of the mesh (Mesh.degrees); data-parallel replication is what the others leave
LAYOUT_OPTIONS = {
    "tp": "--tensor_parallel_size",
    "cp": "--context_parallel_size",
    "pp": "--pipeline_parallel_size",
}
LAYOUT_NAMES = {"dp_replicate": "replicated", "dp_shard": "sharded", "pp": "pipeline", "tp": "tensor", "cp": "context"}


def layout_options(stored: dict, now: dict) -> list[str]:
    """The options that arrange the processes as the checkpoint's `stored` degrees, where this run's are `now`."""
    found = [f"{flag} {stored.get(k, 1)}" for k, flag in LAYOUT_OPTIONS.items() if stored.get(k, 1) != now.get(k, 1)]
    shards = stored.get("dp_shard", 1)
    if shards != now.get("dp_shard", 1):
        if shards > 1 and now.get("dp_shard", 1) > 1:  # both shard, over groups of another size: hybrid vs full
            replicas = stored.get("dp_replicate", 1)
            how = f"hybrid_shard over {replicas} nodes" if replicas > 1 else "full_shard (or shard_grad_op)"
            found.append(f"--fsdp_sharding_strategy {how} (states sharded over {shards} processes)")
        else:
            sharded = f"--fsdp true or the --zero_stage it was written with (states sharded over {shards} processes)"
            found.append(sharded if shards > 1 else "neither --fsdp nor --zero_stage")
    return found


def _describe_layout(degrees: dict) -> str:
    parts = [f"{LAYOUT_NAMES.get(k, k)} {v}" for k, v in degrees.items() if k != "world"]
    return " x ".join(parts) or "one replica each"


def check_compatible(
    meta: dict,
    path: Path,
    trainer: str,
    mesh: Mesh,
    global_rows: int | None = None,
    reshards: bool = False,
    rows_per_process: int | None = None,
) -> None:
    """A checkpoint resumes only under the trainer, process count and mesh that wrote it (a ZeRO checkpoint
    holds shards a DDP run cannot read, and the other way round). Older checkpoints stored no mesh.

    The data position is global (a stream's cursor; the stored rows' order, micro-batch b to process
    b % processes), so a checkpoint whose states any process count can read also resumes at another count:
    a replicated (DDP) one, where every process holds the whole model and optimizer state, and an FSDP one
    (`reshards`: this run loads FSDP's sharded states, which torch.distributed.checkpoint re-cuts for the
    processes that read them). `global_rows` (stored rows: this run's rows per step over all processes)
    must then be the checkpoint's, since its step is the position; a stream's cursor (None) resumes at any
    global batch. At the same count, `rows_per_process` (per-device rows x accumulation) must be the checkpoint's,
    for the same reason."""
    if (
        meta["trainer"] == trainer
        and meta["num_processes"] != mesh.world
        and _any_count_reads(meta, path, mesh, reshards)
    ):
        _check_global_rows(meta, path, mesh, global_rows)
        return
    if meta["trainer"] != trainer or meta["num_processes"] != mesh.world:
        also = f" ({_fixed_count(meta, path, reshards)})" if meta["trainer"] == trainer else ""
        raise UserError(
            f"checkpoint {path} was written by the {meta['trainer']} with {meta['num_processes']} "
            f"process(es); this run is the {trainer} with {mesh.world}: resume it the same way{also}"
        )
    stored = meta.get("mesh", mesh.degrees())
    if stored != mesh.degrees():
        flags = " and ".join(layout_options(stored, mesh.degrees())) or "the options that wrote it"
        raise UserError(
            f"checkpoint {path} was written with its {meta['num_processes']} processes arranged as "
            f"{_describe_layout(stored)}; this run arranges them as {_describe_layout(mesh.degrees())}: resume "
            f"with {flags}"
        )
    batch = meta.get("batch") or {}
    stored = batch.get("per_device_train_batch_size", 0) * batch.get("gradient_accumulation_steps", 0)
    if global_rows is not None and rows_per_process is not None and stored and stored != rows_per_process:
        raise UserError(
            f"checkpoint {path} took {stored} rows per process per step ({batch['per_device_train_batch_size']} "
            f"rows x {batch['gradient_accumulation_steps']} accumulation); this run takes {rows_per_process}, and "
            "the checkpoint's step is its position in the data: give --per_device_train_batch_size and "
            f"--gradient_accumulation_steps whose product is {stored}"
        )


DCP_STATES = ("pytorch_model_fsdp_0", "optimizer_0")  # accelerate's folders of FSDP's sharded states


def _any_count_reads(meta: dict, path: Path, mesh: Mesh, reshards: bool) -> bool:
    """Whether this run may read the checkpoint's states at another process count: both replicated, or both
    data-parallel FSDP with the states in torch.distributed.checkpoint folders."""
    replicated, data_parallel = {"world", "dp_replicate"}, {"world", "dp_replicate", "dp_shard"}
    stored = set(meta.get("mesh", {"world": 1}))
    if stored <= replicated and set(mesh.degrees()) <= replicated and not reshards:
        return not _dcp_states(path)
    return reshards and stored <= data_parallel and set(mesh.degrees()) <= data_parallel and _dcp_states(path)


def _fixed_count(meta: dict, path: Path, reshards: bool) -> str:
    """Why a checkpoint of this trainer does not resume at this run's process count, for the refusal."""
    stored = set(meta.get("mesh", {"world": 1}))
    if stored - {"world", "dp_replicate", "dp_shard"}:
        return "a tensor-, context- or pipeline-parallel checkpoint resumes at its own layout only"
    if _dcp_states(path):
        return "an FSDP checkpoint resumes at another process count under --fsdp true only"
    if "dp_shard" in stored:
        return "a ZeRO checkpoint cannot change its process count; a DDP or FSDP one can"
    return "a DDP checkpoint resumes at another process count without FSDP or ZeRO"


def _dcp_states(path: Path) -> bool:
    return all((path / name / ".metadata").is_file() for name in DCP_STATES)


def _check_global_rows(meta: dict, path: Path, mesh: Mesh, global_rows: int | None) -> None:
    batch = meta.get("batch") or {}
    rows = batch.get("per_device_train_batch_size", 0) * batch.get("gradient_accumulation_steps", 0)
    rows *= meta["num_processes"]
    if global_rows is None or rows == global_rows:
        return
    if not rows:  # an older checkpoint stored no batch
        raise UserError(
            f"checkpoint {path} was written by an older cloudtrain with {meta['num_processes']} process(es); "
            f"this run has {mesh.world}: resume it the same way"
        )
    raise UserError(
        f"checkpoint {path} took {rows} rows per step ({meta['num_processes']} process(es) x "
        f"{batch.get('per_device_train_batch_size')} rows x {batch.get('gradient_accumulation_steps')} "
        f"accumulation); this run takes {global_rows}: at {mesh.world} process(es) give "
        "--per_device_train_batch_size and --gradient_accumulation_steps whose product is "
        f"{rows / mesh.world:g}"
    )
