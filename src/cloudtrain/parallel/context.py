"""Context parallelism (`--context_parallel_size N`): all-to-all (Ulysses-style) sequence parallelism, the same
on CPU (gloo) and GPUs (NCCL).

The N processes of a context-parallel group take the same rows (accelerate's loaders, told the (data, cp) mesh),
and each keeps one contiguous Nth of every row's sequence (`cut_batch`): token ids, position ids (RoPE gets the
global positions) and the next-token targets, shifted before the cut (`shift_labels`) so that a slice's last
position keeps its target from the next slice. The attention (cloudtrain.parallel.sequence) exchanges heads for
sequence: every process attends over the whole rows for H/N of the heads, with the whole rows' document lengths,
so packed documents stay apart. The loss of a slice is summed over its own targets: the trainer's global token
normalisation then counts each target once, and gradients averaged over the launch equal one process's.
Evaluation sums a group's per-row partial sums once (`ContextParallelRuntime.gather`).

This module holds the refusals, the mesh, the cut and the runtime; why Ulysses and not ring attention, and the
limits: docs/parallelism.md.
"""

import torch
from accelerate import Accelerator

from cloudtrain.config import Config
from cloudtrain.data.packing import IGNORE_INDEX
from cloudtrain.errors import UserError
from cloudtrain.models.attention import VARLEN
from cloudtrain.parallel.mesh import Mesh
from cloudtrain.parallel.runtime import GroupRuntime, Runtime

ATTENTION_REFUSAL = (
    "computes attention with its all-to-all over cloudtrain's varlen kernels: leave --attn_implementation out"
)


def degree(cfg: Config) -> int:
    return cfg.distributed.context_parallel_size


def attention_fits(attn_implementation: str | None) -> bool:
    """Whether context parallelism can run with this --attn_implementation (its attention is the varlen kernels)."""
    return attn_implementation in (None, "", VARLEN)


def context_mesh(cfg: Config, processes: int) -> Mesh:
    """The launch's processes as (data-parallel replicas, or FSDP2 shards with --fsdp) x (context-parallel group);
    FSDP2 shards over every process: the tokens a process holds do not matter to it."""
    return Mesh.split(processes, sharded=cfg.distributed.fsdp, cp=degree(cfg))


def check_context_parallel(cfg: Config, processes: int) -> None:
    """Every refusal of --context_parallel_size, before anything heavy loads (reads the model's config only)."""
    cp = degree(cfg)
    if cp == 1:
        return
    from cloudtrain.parallel.distributed import split_refusals

    d = cfg.distributed
    refusals = split_refusals(cfg, cp, processes) + [
        (
            d.fsdp and d.fsdp_sharding_strategy == "hybrid_shard",
            "with --fsdp shards over every process: use --fsdp_sharding_strategy full_shard or shard_grad_op",
        ),
        (not attention_fits(cfg.model.attn_implementation), ATTENTION_REFUSAL),
    ]
    for refused, why in refusals:
        if refused:
            raise UserError(f"--context_parallel_size {cp} {why}")
    check_model_divides(cfg, cp)


def check_model_divides(cfg: Config, cp: int) -> None:
    """Each process attends with heads / N of the heads and KV heads: both must split evenly, and the attention
    must be plain causal softmax attention (what the varlen kernels compute over the whole rows)."""
    from cloudtrain.models.load import trained_config
    from cloudtrain.models.prepare import varlen_misfit

    config = trained_config(cfg.model)
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    sizes = {"attention heads": heads, "KV heads": getattr(text, "num_key_value_heads", None) or heads}
    for what, size in sizes.items():
        if size is not None and size % cp:
            raise UserError(
                f"--context_parallel_size {cp} does not divide the model's {what} ({size}): each process attends "
                f"with 1/{cp} of them; choose a divisor of {size}"
            )
    misfit = varlen_misfit(text)
    if misfit:
        raise UserError(
            f"--context_parallel_size {cp}: the model {misfit}, which its attention does not compute; drop "
            "--context_parallel_size (--fsdp true or --tensor_parallel_size share the model's memory instead)"
        )


# ------------------------------------------------------------ the cut
def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target is the next token (the last position has none), so that a cut keeps every target."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def row_bounds(batch: dict) -> tuple[torch.Tensor, int]:
    """The cumulative lengths of the flattened batch's sequences and the longest: the collator's for packed rows
    (every document, and each row's padding), else one sequence per row (padding sits at a row's end, after
    what a causal mask lets real tokens see)."""
    if "cu_seqlens" in batch:
        return batch["cu_seqlens"], batch["max_seqlen"].shape[-1]
    rows, width = batch["input_ids"].shape
    return torch.arange(0, rows * width + 1, width, dtype=torch.int32, device=batch["input_ids"].device), width


def widen(batch: dict, multiple: int) -> dict:
    """Rows padded at their end to a multiple of `multiple` tokens (ignored targets, not real tokens), each row's
    last sequence taking the padding; the cumulative lengths moved without a sync with the device."""
    rows, width = batch["input_ids"].shape
    pad = -width % multiple
    bounds, longest = row_bounds(batch)
    if not pad:
        return {**batch, "cu_seqlens": bounds, "max_seqlen": bounds.new_empty((0, longest))}
    fill = {"input_ids": 0, "position_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0}
    out = {
        key: torch.nn.functional.pad(batch[key], (0, pad), value=value) for key, value in fill.items() if key in batch
    }
    # a bound x closes a sequence of row r - 1 (ceil(x / width) = r); a row's end moves with the row's padding
    row = (bounds + width - 1) // width
    moved = bounds + (row - 1) * pad + pad * (bounds == row * width)
    out.update(cu_seqlens=moved.to(bounds.dtype), max_seqlen=bounds.new_empty((0, longest + pad)))
    return out


def cut_batch(batch: dict, cp: int, rank: int) -> dict:
    """Process `rank`'s contiguous 1/cp of every row of a collated causal-LM batch: token ids, position ids, the
    padding mask and the next-token `targets` (shifted before the cut; no `labels`: nothing may shift again).
    The whole rows' `cu_seqlens`/`max_seqlen` stay whole: the attention runs over whole rows. `counted_rows`:
    the rows this slice counts in the logged samples (the group's first process counts them)."""
    whole = widen(batch, cp)
    width = whole["input_ids"].shape[1] // cp
    part = slice(rank * width, (rank + 1) * width)
    out = {key: whole[key][:, part] for key in ("input_ids", "position_ids", "attention_mask") if key in whole}
    out.update(targets=shift_labels(whole["labels"])[:, part], cu_seqlens=whole["cu_seqlens"])
    out["max_seqlen"] = whole["max_seqlen"]
    # the logged rows: each row once per group, by the process whose slice holds its first token
    out["counted_rows"] = whole["attention_mask"].any(dim=1) & (rank == 0)
    return out


def unshard(parts: list[torch.Tensor]) -> torch.Tensor:
    """The whole rows from every process's slice, in process order (the inverse of `cut_batch`'s cut)."""
    return torch.cat(parts, dim=1)


# ------------------------------------------------------------ the runtime
class ContextParallelRuntime(GroupRuntime):
    """The accelerate runtime on a (data parallel, cp) mesh (neighbours: the attention's all-to-all is per layer).
    `share_rows` tells accelerate's loaders the mesh (a group's processes then take the same rows); `gather`
    adds a group's per-row partial sums (sums over a slice's targets: loss and count), each row once."""

    dim = "cp"

    def __init__(self, accelerator: Accelerator, cp: int, data_parallel: str = "dp_replicate"):
        super().__init__(accelerator, cp, data_parallel)
        self.cp_group = self.data_mesh.get_group("cp")

    def share_rows(self) -> None:
        """Read by accelerate's prepare_data_loader; set after the model is prepared (FSDP2 would take its
        sharding mesh from it, and it shards over every process)."""
        assert self.accelerator is not None  # built with one
        self.accelerator.state.device_mesh = self.data_mesh

    def cut(self, batch: dict) -> dict:
        from cloudtrain.parallel import sequence

        out = cut_batch(batch, self.degree, self.group_rank)
        sequence.mark_cut(out["cu_seqlens"])
        return out

    def combine(self, grouped: torch.Tensor) -> torch.Tensor:
        return grouped.sum(dim=1)


def launch_runtime(accelerator: Accelerator, cfg: Config) -> Runtime:
    return ContextParallelRuntime(accelerator, degree(cfg), "dp_shard" if cfg.distributed.fsdp else "dp_replicate")
