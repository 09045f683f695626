"""Rows, batches and the forward call for causal language modelling, with sequence packing.

Tokenized documents become training rows in one of three ways (`PACKING`):

- "none": one document per row (documents longer than the block are cut into pieces);
- "wrapped": the classic recipe: all documents concatenated and cut into blocks, so attention
  crosses document boundaries by design;
- "bfd": whole documents packed into blocks by best-fit-decreasing, each document kept apart
  from the others in its row.

Each row records the lengths of its segments (documents). `CausalLMCollator` turns rows into a
batch whose position_ids restart at 0 for every segment and whose labels never ask the model to
predict a document's first token from the previous document. `causal_lm_forward` is the one
model call training and evaluation use; `isolation_error` checks that a model, called that way,
really keeps packed documents apart.

transformers 5.23 derives the per-document block mask from restarting position_ids only when
attention_mask is None and no KV cache is built (`masking_utils._preprocess_mask_arguments`).
Measured on CPU, Llama and GPT-2: "sdpa" and "eager" (and "flex_attention" for Llama; GPT-2 has
none) isolate documents with `use_cache=False` and no mask (logits equal within 1e-7). Leaving
use_cache to the config (True) leaks in train AND eval mode, as does passing an all-ones
attention_mask or position_ids that do not restart (differences 0.07-0.5 on the tiny test models).
For bfd rows the collator also gives the documents' cumulative lengths, which the varlen attention
(cloudtrain.models.attention) and FlashAttention's varlen path keep documents apart by, with no dense mask.
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Callable
from itertools import accumulate, chain
from typing import Any

import torch
import torch.nn.functional as F

from cloudtrain.evaluation import eval_mode

__all__ = [
    "PACKING",
    "CausalLMCollator",
    "attention_implementation",
    "causal_lm_forward",
    "forward_inputs",
    "chunk",
    "isolation_error",
    "pack",
    "pack_examples",
    "shifted_loss",
    "target_loss",
]

PACKING = ("none", "wrapped", "bfd")
IGNORE_INDEX = -100


def chunk(doc: list[int], block_size: int) -> list[list[int]]:
    """`doc` cut into consecutive pieces of at most `block_size` tokens (no token lost)."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    doc = list(doc)
    return [doc[i : i + block_size] for i in range(0, len(doc), block_size)]


def _row(segments: list[list[int]]) -> dict:
    return {"input_ids": list(chain.from_iterable(segments)), "seq_lengths": [len(s) for s in segments]}


def _wrapped(docs: list[list[int]], block_size: int) -> list[dict]:
    stream = list(chain.from_iterable(docs))
    return [_row([piece]) for piece in chunk(stream, block_size)]


def _best_fit_decreasing(lengths: list[int], block_size: int) -> list[list[int]]:
    """Bins (lists of indices into `lengths`) of total length at most `block_size`."""
    # sorted() is stable, so equal lengths keep their input order: the packing is deterministic.
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    # (remaining room, bin index) of the open bins, sorted: the first entry >= (length, -1) is the
    # tightest bin that fits, ties going to the oldest bin. Full bins leave the list.
    room: list[tuple[int, int]] = []
    for i in order:
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at == len(room):
            index, left = len(bins), block_size
            bins.append([])
        else:
            left, index = room.pop(at)
        bins[index].append(i)
        if left - lengths[i] > 0:
            bisect.insort(room, (left - lengths[i], index))
    return bins


def pack(docs: list[list[int]], block_size: int, packing: str) -> list[dict]:
    """Training rows `{"input_ids", "seq_lengths"}` of at most `block_size` tokens from tokenized `docs`.

    Empty documents are dropped (a zero-length segment has nothing to learn from).
    """
    if packing not in PACKING:
        raise ValueError(f"packing must be one of {PACKING}, got {packing!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if packing == "wrapped":
        return _wrapped(docs, block_size)
    # Only long documents are cut (and so copied); the rows below copy each token once.
    pieces = [piece for doc in docs for piece in (chunk(doc, block_size) if len(doc) > block_size else [doc]) if piece]
    if packing == "none":
        return [_row([piece]) for piece in pieces]
    return [_row([pieces[i] for i in bin_]) for bin_ in _best_fit_decreasing([len(p) for p in pieces], block_size)]


def pack_examples(examples: list[list[int]], loss_masks: list[list[int]], block_size: int, packing: str) -> list[dict]:
    """Rows `{"input_ids", "seq_lengths", "loss_mask"}` of whole examples (each at most `block_size` tokens):
    one per row ("none") or several per row ("bfd"). `loss_mask` marks the tokens the loss is taken on."""
    if packing not in ("none", "bfd"):
        raise ValueError(f"examples are packed whole: none or bfd, got {packing!r}")
    if any(len(example) > block_size for example in examples):
        raise ValueError(f"an example is longer than the block ({block_size} tokens); truncate it first")
    bins = (
        [[i] for i in range(len(examples))]
        if packing == "none"
        else _best_fit_decreasing([len(example) for example in examples], block_size)
    )
    return [
        {**_row([examples[i] for i in bin_]), "loss_mask": list(chain.from_iterable(loss_masks[i] for i in bin_))}
        for bin_ in bins
    ]


class CausalLMCollator:
    """Right-pads rows into a batch: input_ids, position_ids, labels and attention_mask, all [B, L].

    A row with a "loss_mask" (supervised fine-tuning) keeps labels only where the mask is 1.

    The attention_mask (1 = real token) counts real tokens (throughput); only the varlen attention is given it
    (cloudtrain.models.attention), which keeps documents apart by their lengths. With any other kernel,
    transformers 5.23 keeps packed documents apart from restarting position_ids only when attention_mask is
    None. Padding sits at the end of each row and attention is causal, so real tokens never see it anyway.

    `pad_to` pads every batch to that width (static shapes for compiled layers, --compile_layers).

    With `cu_seqlens=True` (packed rows) the batch also holds the cumulative lengths of the flattened batch's
    sequences, every document and each row's padding one sequence (`cu_seqlens`, int32, [N + 1]), and the
    longest of them as the width of an empty tensor (`max_seqlen`, [0, longest]): a shape, so that the
    forward reads it without waiting for the device, and moving the batch moves it like any tensor.
    """

    def __init__(self, pad_token_id: int, cu_seqlens: bool = False, pad_to: int | None = None):
        self.pad_token_id = pad_token_id
        self.cu_seqlens = cu_seqlens
        self.pad_to = pad_to  # a fixed width (static shapes for compiled layers); else the longest row's

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(self.pad_to or 0, *(len(row["input_ids"]) for row in rows))
        # A fixed handful of whole-batch tensor ops, none per row or per document: this is the per-batch cost
        # of both stored and streamed input paths, which a small model's step on a GPU would feel.
        tokens: list[int] = []  # the rows' real tokens, concatenated
        targets: list[int] | None = None  # the same, with IGNORE_INDEX where a loss_mask is 0 (SFT)
        counts: list[int] = []  # real tokens per row
        sequences: list[int] = []  # the length of every sequence of the flattened batch, in order
        for b, row in enumerate(rows):
            ids, lengths = _as_list(row["input_ids"]), _as_list(row["seq_lengths"])
            n = len(ids)
            if sum(lengths) != n or min(lengths, default=1) < 1:
                raise ValueError(f"row {b}: seq_lengths {lengths} do not split its {n} tokens")
            if "loss_mask" in row and targets is None:
                targets = list(tokens)
            if targets is not None:  # supervised fine-tuning: only the marked (answer) tokens are targets
                mask = _as_list(row["loss_mask"]) if "loss_mask" in row else [1] * n
                targets += [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]
            tokens += ids
            counts.append(n)
            # Positions restart per segment, and for the padding too: it then reads as one more
            # segment rather than as a continuation of the last document.
            sequences += [*lengths, width - n] if width > n else lengths
        shape = (len(rows), width)
        real = torch.arange(width) < torch.tensor(counts)[:, None]  # row-major order: `tokens`' order
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        input_ids[real] = torch.tensor(tokens, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        labels[real] = input_ids[real] if targets is None else torch.tensor(targets, dtype=torch.long)
        lengths_all = torch.tensor(sequences, dtype=torch.long)
        starts = torch.cumsum(lengths_all, 0) - lengths_all  # every sequence's first index, flattened
        position_ids = (torch.arange(len(rows) * width) - torch.repeat_interleave(starts, lengths_all)).view(shape)
        # No document's first token is predicted from the previous document's last one (padding is ignored).
        labels.view(-1)[starts] = IGNORE_INDEX
        batch = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "labels": labels,
            "attention_mask": real.long(),
        }
        if self.cu_seqlens:
            batch["cu_seqlens"] = torch.tensor([0, *accumulate(sequences)], dtype=torch.int32)
            batch["max_seqlen"] = torch.empty((0, max(sequences)), dtype=torch.int32)
        return batch


def _as_list(values: Any) -> list:
    """A row's field as a plain list (rows are lists, but a tensor or an array is taken too)."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


def causal_lm_forward(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The logits of `model` on a collated batch: the call training and evaluation use."""
    return model(**forward_inputs(model, batch)).logits


def forward_inputs(model: torch.nn.Module, batch: dict) -> dict[str, Any]:
    """The model's keyword arguments for a collated batch.

    No KV cache, and no attention_mask but for the varlen attention: with either, transformers 5.23 ignores
    the per-document structure of position_ids and packed documents attend to each other. The cumulative
    lengths go to every kernel: the varlen one and FlashAttention's varlen path use them, sdpa and eager
    ignore them (they mask from position_ids).
    """
    inputs: dict[str, Any] = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    inputs["use_cache"] = False
    if "cu_seqlens" in batch:
        longest = batch["max_seqlen"].shape[-1]
        inputs.update(
            cu_seq_lens_q=batch["cu_seqlens"],
            cu_seq_lens_k=batch["cu_seqlens"],
            max_length_q=longest,
            max_length_k=longest,
        )
        if attention_implementation(model) == "varlen":
            # A padding mask skips transformers' search of position_ids for packing (a sync with the device);
            # the varlen kernel keeps documents apart by the lengths and ignores it.
            inputs["attention_mask"] = batch["attention_mask"]
    return inputs


def attention_implementation(model: Any) -> str | None:
    """The attention implementation `model` computes with, through DDP/DeepSpeed (`.module`) and PEFT wrappers."""
    inner = getattr(model, "module", model)
    return getattr(getattr(inner, "config", None), "_attn_implementation", None)


def shifted_loss(
    logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Summed next-token cross-entropy, number of predicted tokens), both on the logits' device; `smoothing`:
    --label_smoothing.

    Sums rather than a mean, so that batches and processes can be combined exactly by adding.
    """
    return target_loss(logits[:, :-1], labels[:, 1:], smoothing)


def target_loss(
    logits: torch.Tensor, targets: torch.Tensor, smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Summed cross-entropy of each position's logits against its target, number of targets): targets already
    shifted (a context-parallel slice's, whose sums over slices add up to the whole rows')."""
    loss = F.cross_entropy(
        logits.float().flatten(0, 1),
        targets.to(logits.device).flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=smoothing,
    )
    return loss, (targets != IGNORE_INDEX).sum()


def _vocab_size(model: Any) -> int:  # a transformers model, or a PeftModel around one
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None) or model.config.vocab_size


def isolation_error(
    model: torch.nn.Module, forward: Callable[[torch.nn.Module, dict], torch.Tensor] = causal_lm_forward
) -> str | None:
    """None if `model`, called through `forward`, keeps packed documents apart; else why not, in one line.

    Runs two short documents packed into two rows (in both orders) and each alone, and compares the logits of
    the document that comes second in its row.
    """
    config = getattr(model, "config", None)
    name = f"{type(model).__name__} with attn_implementation {getattr(config, '_attn_implementation', None)!r}"
    parameters = inspect.signature(model.forward).parameters.values()
    if not any(p.name == "position_ids" or p.kind is p.VAR_KEYWORD for p in parameters):
        return f"{name} takes no position_ids, so packed documents cannot be kept apart"
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(0, _vocab_size(model), (n,), generator=generator).tolist() for n in (5, 7))
    # Two rows, as in training: some kernels tell packed rows apart only in a batch of one.
    collate = CausalLMCollator(pad_token_id=0, cu_seqlens=True)
    packed = collate(
        [{"input_ids": first + second, "seq_lengths": [5, 7]}, {"input_ids": second + first, "seq_lengths": [7, 5]}]
    )
    alone = collate([{"input_ids": second, "seq_lengths": [7]}, {"input_ids": first, "seq_lengths": [5]}])
    parameter = next(model.parameters())
    with eval_mode(model), torch.no_grad():
        logits = forward(model, {k: v.to(parameter.device) for k, v in packed.items()}).float()
        reference = forward(model, {k: v.to(parameter.device) for k, v in alone.items()}).float()
    packed_logits = torch.cat([logits[0, 5:], logits[1, 7:]])
    alone_logits = torch.cat([reference[0, :7], reference[1, :5]])
    difference = (packed_logits - alone_logits).abs().max().item()
    # Half-precision kernels round differently for different sequence lengths: allow a few percent of
    # the logits' scale there (a leak moves logits by about their own size).
    tolerance = (
        1e-4 if parameter.dtype in (torch.float32, torch.float64) else 0.05 * max(1.0, alone_logits.abs().max().item())
    )
    if difference <= tolerance:
        return None
    return f"{name} lets packed documents attend to each other (max logit difference {difference:.3g})"


def pack_buffer(items: list[tuple], block_size: int, packing: str) -> list[dict]:
    """Rows of one streamed buffer: `items` are (source, key, token ids, loss mask or None) in stream order.

    The same rows as `pack`/`pack_examples` give (wrapped: one stream cut into blocks, its last row short;
    bfd: whole documents, long ones cut, isolated by seq_lengths; none: one per row), each row also telling
    which documents start in it (`starts`: their keys) and how many of its tokens each source gave (`tokens`).
    """
    if packing == "wrapped":
        return _wrapped_rows(items, block_size)
    pieces = [
        (source, key if start == 0 else None, ids[start : start + block_size], None if mask is None else mask[start:])
        for source, key, ids, mask in items
        for start in range(0, len(ids), block_size)
    ]
    bins = (
        [[i] for i in range(len(pieces))]
        if packing == "none"
        else _best_fit_decreasing([len(p[2]) for p in pieces], block_size)
    )
    return [_buffer_row([pieces[i] for i in bin_]) for bin_ in bins]


def _buffer_row(pieces: list[tuple]) -> dict:
    row = _row([piece[2] for piece in pieces])
    if any(piece[3] is not None for piece in pieces):
        row["loss_mask"] = [m for piece in pieces for m in piece[3][: len(piece[2])]]
    row["starts"] = [piece[1] for piece in pieces if piece[1] is not None]
    row["tokens"] = _tally((piece[0], len(piece[2])) for piece in pieces)
    return row


def _tally(pairs) -> dict[int, int]:
    counts: dict[int, int] = {}
    for source, n in pairs:
        counts[source] = counts.get(source, 0) + n
    return counts


def _wrapped_rows(items: list[tuple], block_size: int) -> list[dict]:
    """One stream of the buffer's documents cut into blocks; what each row holds of which source."""
    ids = list(chain.from_iterable(item[2] for item in items))
    spans, at = [], 0  # (first token, last token + 1, source, key) of each document in the stream
    for source, key, doc, _ in items:
        spans.append((at, at + len(doc), source, key))
        at += len(doc)
    rows, d = [], 0
    for start in range(0, len(ids), block_size):
        end = min(start + block_size, len(ids))
        row = _row([ids[start:end]])
        while d < len(spans) and spans[d][1] <= start:
            d += 1
        inside = [s for s in spans[d:] if s[0] < end]
        row["starts"] = [s[3] for s in inside if s[0] >= start]
        row["tokens"] = _tally((s[2], min(s[1], end) - max(s[0], start)) for s in inside)
        rows.append(row)
    return rows
