"""Context parallelism (`--context_parallel_size N`): the pieces that do not depend on the attention kernel, and
the refusal of what cannot run.

Each sequence is cut into 2N chunks and process r takes chunks r and 2N-1-r (a causal mask makes late positions
attend to more keys: pairing an early chunk with a late one gives every process the same attention work). The
labels are shifted for next-token prediction before the cut, so a chunk's last position keeps its target from
the next chunk, and the summed losses of the shards add up to the loss of the whole sequence. Position ids are
cut alike: RoPE and the document boundaries of packed rows (cloudtrain.data.packing) travel with their tokens.

The attention itself (ring attention through torch.distributed.tensor.experimental.context_parallel) runs only on
CUDA's SDPA kernels: on CPU, torch (2.13 here) has no sharding rule for its SDPA kernel
(aten._scaled_dot_product_flash_attention_for_cpu: tests/test_context_parallel.py checks it against the installed
torch), and its math kernel, tried by hand, adds a plain causal mask to DTensors. cloudtrain does not wire it into a
trainer yet: --context_parallel_size above 1 is refused in one line. See docs/parallelism.md.
"""

import torch

from cloudtrain.config import Config
from cloudtrain.data.packing import IGNORE_INDEX
from cloudtrain.errors import UserError


def check_context_parallel(cfg: Config) -> None:
    """Why --context_parallel_size cannot run here, in one line."""
    cp = cfg.distributed.context_parallel_size
    if cp == 1:
        return
    if not torch.cuda.is_available():
        raise UserError(
            f"--context_parallel_size {cp} needs CUDA GPUs: torch's context_parallel runs ring attention only "
            "through CUDA's SDPA kernels (flash, memory-efficient, cuDNN; its CPU kernel has no sharding rule), and "
            "this machine has none; leave it at 1"
        )
    raise UserError(
        f"--context_parallel_size {cp} is not wired into a trainer yet (sequence splitting is, attention is not); "
        "leave it at 1, and use --tensor_parallel_size or --gradient_checkpointing for long sequences"
    )


def chunk_order(cp: int) -> list[int]:
    """The 2 x cp chunks of a sequence in the order the processes hold them: process r holds r and 2cp-1-r."""
    return [chunk for rank in range(cp) for chunk in (rank, 2 * cp - 1 - rank)]


def check_length(length: int, cp: int) -> None:
    if length % (2 * cp):
        raise UserError(
            f"--context_parallel_size {cp}: rows of {length} tokens do not cut into {2 * cp} equal chunks; "
            f"choose --max_length a multiple of {2 * cp}"
        )


def shard(sequence: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Process `rank`'s part of `sequence` (dim 1 is the sequence): chunks rank and 2cp-1-rank, in that order."""
    check_length(sequence.shape[1], cp)
    chunks = sequence.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)


def unshard(shards: list[torch.Tensor], cp: int) -> torch.Tensor:
    """The whole sequence from every process's shard, in process order (the inverse of `shard`)."""
    pieces: list[torch.Tensor] = [torch.empty(0)] * (2 * cp)
    for rank, part in enumerate(shards):
        first, second = part.chunk(2, dim=1)
        pieces[rank], pieces[2 * cp - 1 - rank] = first, second
    return torch.cat(pieces, dim=1)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target is the next token (the last position has none), so that a cut keeps every target."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def split_batch(batch: dict, cp: int, rank: int) -> dict:
    """Process `rank`'s share of a collated causal-LM batch: token ids, position ids and next-token targets
    (`shift_labels`) cut alike; the loss over it is `shard_loss`."""
    out = {key: shard(batch[key], cp, rank) for key in ("input_ids", "position_ids")}
    out["targets"] = shard(shift_labels(batch["labels"]), cp, rank)
    return out


def shard_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, number of targets) of one shard: the shards' sums add up to the whole sequence's."""
    loss = torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (targets != IGNORE_INDEX).sum()


def attention_work(positions: torch.Tensor) -> int:
    """Query-key pairs a causal mask lets the given positions compute: each attends to itself and what precedes."""
    return int((positions + 1).sum())
