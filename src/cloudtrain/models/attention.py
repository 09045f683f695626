"""`--attn_implementation varlen`: attention over packed rows, one document at a time, without a dense mask.

Registered with transformers' AttentionInterface (and its mask interface) under `VARLEN`. A packed batch carries
cumulative sequence lengths (`cu_seq_lens_q`, from `CausalLMCollator(cu_seqlens=True)`): every document of every
row, and each row's padding, is one sequence of the flattened batch. The kernel then runs, best first:

- flash-attn's `flash_attn_varlen_func` (CUDA, 16-bit), when the package is installed;
- PyTorch's `torch.nn.attention.varlen.varlen_attn` (CUDA, 16-bit, no dropout), where the installed torch has it;
- on CPU, the reference: scaled_dot_product_attention once per document (its own causal kernel, no mask);
- anywhere else, sdpa with a block-diagonal causal mask built on the device from the lengths.

Grouped-query attention stays native in each (no repeated K/V) where the kernel takes it. Without lengths (a
KV-cache decode, a pipeline stage, a caller that only gives position_ids) it falls back to sdpa with the mask
that position_ids and the padding mask imply, so every caller keeps documents apart. Why and how fast:
docs/language-models.md.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from cloudtrain.hardware import autocast_dtype

__all__ = ["VARLEN", "kernel_name", "register", "varlen_attention", "varlen_kernel_available"]

VARLEN = "varlen"
HALF = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_attn() -> Callable | None:
    if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # installed for another torch or CUDA: unusable, not an error here
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen() -> tuple[Callable, frozenset[str]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = frozenset(inspect.signature(varlen_attn).parameters)
    # Causal attention spelled `is_causal` (torch 2.9-2.10) or as a (left, right) window (later): else unusable.
    return (varlen_attn, parameters) if {"window_size", "is_causal"} & parameters else None


def varlen_kernel_available(device: torch.device | str = "cuda") -> bool:
    """Whether a variable-length CUDA kernel (flash-attn or PyTorch's) serves 16-bit attention on `device`."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available() and bool(_flash_attn() or _torch_varlen())


def kernel_name(device: torch.device, dtype: torch.dtype, dropout: float = 0.0) -> str:
    """The kernel `varlen_attention` runs for packed inputs on `device` in `dtype` (for logs and tests)."""
    if device.type == "cuda" and dtype in HALF:
        if _flash_attn():
            return "flash_attn"
        if _torch_varlen() and dropout == 0.0:
            return "torch_varlen"
    return "per_document_sdpa" if device.type == "cpu" else "block_mask_sdpa"


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The AttentionInterface function: query [B, Hq, L, D], key/value [B, Hkv, S, D] -> ([B, L, Hq, D], None)."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None and query.shape[2] == key.shape[2]:
        out = _packed(query, key, value, cu_seqlens, int(kwargs["max_length_q"]), scaling, dropout)
    else:
        out = _masked(query, key, value, attention_mask, kwargs.get("position_ids"), scaling, dropout)
    return out, None


@torch.compiler.disable  # eager inside compiled layers: the number of documents varies from batch to batch
def _packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    batch, heads, length, dim = query.shape
    # Under autocast over fp32 weights, transformers' rotary embedding hands over fp32 queries and keys (its cos
    # and sin follow the fp32 residual stream): the kernel is chosen, and fed, in autocast's dtype, the cast sdpa
    # would do. Chosen by the queries' own fp32, it was the dense-mask fallback (measured on an H100).
    dtype = autocast_dtype(query)
    kernel = kernel_name(query.device, dtype, dropout)
    if kernel == "per_document_sdpa":
        return _per_document(query, key, value, cu_seqlens, scaling, dropout)
    if kernel == "block_mask_sdpa":
        return _block_mask_sdpa(query, key, value, cu_seqlens, scaling, dropout)
    # [B, H, L, D] -> [B*L, H, D]: the flattened batch the cumulative lengths index.
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], dim).to(dtype) for x in (query, key, value))
    if kernel == "flash_attn":
        flash = _flash_attn()
        assert flash is not None
        cu = cu_seqlens.to(torch.int32)
        out = flash(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout, softmax_scale=scaling, causal=True)
    else:
        out = _torch_varlen_call(q, k, v, cu_seqlens, max_seqlen, scaling)
    return out.reshape(batch, length, heads, dim)


def _torch_varlen_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int, scaling: float | None
) -> torch.Tensor:
    found = _torch_varlen()
    assert found is not None
    varlen_attn, parameters = found
    options: dict[str, Any] = {}
    if "scale" in parameters:
        options["scale"] = scaling
    elif scaling is not None:  # the kernel scales by 1/sqrt(D): the queries carry the rest
        q = q * (scaling * q.shape[-1] ** 0.5)
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:  # an older torch: the K/V heads repeated, as sdpa does without native GQA
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    cu = cu.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **options)


def _per_document(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """The CPU reference: each document through sdpa alone, causal, GQA native (the lengths are on the host).
    [B, H, L, D] in (no sequence crosses a row: each row's padding is its own), [B, L, H, D] out."""
    batch, _, length, _ = query.shape
    bounds = cu.tolist()
    gqa = key.shape[1] != query.shape[1]
    # Pieces joined with cat, not written into one tensor: autograd would copy the whole gradient per write.
    pieces: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            row, first = divmod(start, length)
            pieces[row].append(
                F.scaled_dot_product_attention(
                    query[row, :, first : first + end - start],
                    key[row, :, first : first + end - start],
                    value[row, :, first : first + end - start],
                    is_causal=True,
                    dropout_p=dropout,
                    scale=scaling,
                    enable_gqa=gqa,
                )
            )
    rows = [torch.cat(row, dim=1) if row else query.new_empty(0) for row in pieces]
    if any(row.shape[1:2] != (length,) for row in rows):  # lengths that do not tile each row: the mask instead
        return _block_mask_sdpa(query, key, value, cu, scaling, dropout)
    return torch.stack(rows).transpose(1, 2).contiguous()


def _block_mask_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Any device, any dtype: a [B, 1, L, L] block-diagonal causal mask from the lengths, built without a sync."""
    batch, _, length, _ = query.shape
    tokens = torch.arange(batch * length, device=query.device)
    document = torch.searchsorted(cu_seqlens.to(query.device, torch.long), tokens, right=True).view(batch, length)
    return _sdpa(query, key, value, _document_mask(document), scaling, dropout)


def _document_mask(document: torch.Tensor) -> torch.Tensor:
    """[B, L] document ids -> [B, 1, L, L] boolean mask: same document and not in the future."""
    length = document.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


def _masked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """No lengths: sdpa with the mask the inputs imply (documents from restarting position_ids, the padding mask,
    causality offset by the cached keys)."""
    batch, _, q_len, _ = query.shape
    k_len = key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4:  # a mask built already (a boolean or additive one)
        return _sdpa(query, key, value, attention_mask, scaling, dropout)
    mask = None
    if position_ids is not None and q_len == k_len and q_len > 1:
        starts = position_ids.expand(batch, -1) == 0
        mask = _document_mask(starts.cumsum(dim=-1))
    if attention_mask is not None:  # [B, S]: 1 for a real key
        keys = attention_mask[:, -k_len:].to(torch.bool)[:, None, None, :]
        if mask is None:
            offset = k_len - q_len  # the queries are the last q_len positions
            rows = torch.arange(q_len, device=query.device)[:, None] + offset
            mask = (torch.arange(k_len, device=query.device)[None, :] <= rows)[None, None]
        mask = mask & keys
    if mask is None:
        return _sdpa(query, key, value, None, scaling, dropout, causal=q_len > 1)
    return _sdpa(query, key, value, mask, scaling, dropout)


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    causal: bool = False,
) -> torch.Tensor:
    if mask is not None and mask.dtype == torch.bool:
        # A query that sees no key (padding in a left-padded prompt) would come out NaN: it sees all instead.
        mask = mask | mask.any(dim=-1, keepdim=True).logical_not()
    gqa = key.shape[1] != query.shape[1]
    if gqa and mask is not None and query.device.type != "cpu":
        # CUDA's masked (memory-efficient) sdpa kernel takes no GQA: the K/V heads repeated, as transformers does.
        key, value = (x.repeat_interleave(query.shape[1] // x.shape[1], dim=1) for x in (key, value))
        gqa = False
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling, enable_gqa=gqa
    )
    return out.transpose(1, 2).contiguous()


def document_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask interface's entry: the 2D padding mask as given (never a dense [B, 1, L, L] one, and no check
    that would sync with the device); `varlen_attention` works out the rest."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


@functools.cache
def register() -> None:
    """Make `VARLEN` a name `set_attn_implementation` and `attn_implementation=` accept (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, document_mask)


register()  # at import: `from_pretrained(attn_implementation=VARLEN)` may come before any transform
