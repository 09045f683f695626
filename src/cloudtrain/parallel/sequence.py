"""The attention of context parallelism: all-to-all (Ulysses-style) sequence parallelism, registered with
transformers' AttentionInterface under `ULYSSES`.

A process of a context-parallel group holds 1/N of every row's tokens (cloudtrain.parallel.context.cut_batch), so
its q, k and v arrive as [B, H, S/N, D]. One all-to-all in the group trades sequence for heads: [B, H/N, S, D],
the whole rows for H/N heads (KV heads likewise, so grouped-query attention stays native). The varlen attention
(cloudtrain.models.attention) then runs over the whole rows with the whole rows' cumulative lengths (every packed
document apart, each row's padding its own sequence), and a second all-to-all trades back: [B, S/N, H, D], what
transformers expects of an attention function. Both exchanges carry gradients
(torch's functional all_to_all_single_autograd), on gloo and NCCL alike.

Only forwards of cut batches exchange: their `cu_seq_lens_q` is a tensor the cut made (`mark_cut`). Any other
call (generation with a KV cache on whole prompts, every process the same) attends locally, as `varlen` does.
"""

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol  # torch's collectives with autograd

from cloudtrain.models.attention import document_mask, varlen_attention

ULYSSES = "ulysses"

_GROUP: list[Any] = []  # the installed context-parallel process group (one model per process)
# the whole rows' lengths of the cut batches still alive, by identity (a tensor's == compares its elements)
_CUT: dict[int, weakref.ref] = {}


def mark_cut(cu_seqlens: torch.Tensor) -> None:
    """`cu_seqlens` belongs to a cut batch: forwards given it exchange heads for sequence."""
    key = id(cu_seqlens)
    _CUT[key] = weakref.ref(cu_seqlens, lambda _: _CUT.pop(key, None))


def is_cut(cu_seqlens: Any) -> bool:
    ref = _CUT.get(id(cu_seqlens))
    return ref is not None and ref() is cu_seqlens


def attend_across(model: Any) -> Any:
    """The model attends through `ulysses_attention` (cloudtrain.models.prepare's attention step, under
    --context_parallel_size); its forwards exchange once the trainer gives the group (`use_group`)."""
    register()
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.set_attn_implementation(ULYSSES)
    return model


def use_group(group: Any) -> None:
    """The context-parallel process group the exchanges run in (the launch's mesh: one per process)."""
    _GROUP[:] = [group]


def install(model: Any, group: Any) -> None:
    """Both at once (a model prepared outside the application, as the tests do)."""
    attend_across(model)
    use_group(group)


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    """all_to_all over dim 0 (chunk i to process i of `group`, chunk i from it), with gradients."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), None, None, group))


def sequence_for_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H, S/N, D] (this process's slice, every head) -> [B, H/N, S, D] (the whole rows, this process's heads)."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = _exchange(x.reshape(b, n, h // n, s, d).transpose(0, 1), group)  # [N (slice), B, H/N, S/N, D]
    return parts.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_for_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, S, H/N, D] (attention output of the whole rows) -> [B, S/N, H, D] (this process's slice, every head)."""
    n = dist.get_world_size(group)
    b, length, h, d = x.shape
    s = length // n
    parts = _exchange(x.reshape(b, n, s, h, d).transpose(0, 1), group)  # [N (head group), B, S/N, H/N, D]
    return parts.permute(1, 2, 0, 3, 4).reshape(b, s, n * h, d)


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The AttentionInterface function: query [B, Hq, S/N, D], key/value [B, Hkv, S/N, D] -> ([B, S/N, Hq, D],
    None), over the whole rows; a forward of no cut batch attends locally (`varlen_attention`)."""
    bounds = kwargs.get("cu_seq_lens_q")
    if _GROUP and module.training and not is_cut(bounds):
        # each process would attend within its own slice only: wrong weights, no error
        raise RuntimeError("context parallelism: a training forward was given no cut batch (trainer.move cuts it)")
    if not is_cut(bounds) or not _GROUP:
        return varlen_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    group = _GROUP[0]
    q, k, v = (sequence_for_heads(x, group) for x in (query, key, value))
    whole = {"cu_seq_lens_q": bounds, "max_length_q": kwargs["max_length_q"]}
    out, _ = varlen_attention(module, q, k, v, None, scaling, dropout, **whole)
    return heads_for_sequence(out, group), None


@functools.cache
def register() -> None:
    """Make `ULYSSES` a name `set_attn_implementation` accepts; its mask is varlen's (the padding mask as given)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ULYSSES, ulysses_attention)
    AttentionMaskInterface.register(ULYSSES, document_mask)
