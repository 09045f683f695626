"""Training FLOPs of a transformer, for the model FLOPs utilization (MFU).

The estimate follows the one in appendix B of the PaLM paper (Chowdhery et al., 2022), which
nanoGPT's `estimate_mfu` also uses. Per real (non-padding) token:

- Matmul weights. Every weight that multiplies activations costs 2 FLOPs per token in the forward
  pass (a multiply and an add), 2 more in the backward pass for the gradient with respect to the
  activations, and 2 more for the gradient with respect to the weight itself. With N such
  parameters, N_t of them trainable: 2N + 2N + 2N_t, which is the familiar 6N when everything
  trains. A frozen weight skips only its own gradient GEMM.
- Embedding tables (word, position, token type: `torch.nn.Embedding` modules) are looked up, not
  multiplied, so they are left out of N. The output embedding / LM head (`get_output_embeddings()`)
  does a d_model x vocab matmul per token, so it is counted, once, also when it shares its weight
  with the input embedding.
- Attention. Per layer, the scores Q K^T and the weighted sum of V each cost 2 * l * d_attn FLOPs
  per token of a sequence of length l (d_attn = heads * head_dim, usually hidden_size), so
  4 * l * d_attn forward and three times that for forward plus backward: 12 * n_layers * d_attn * l
  per token, or 12 * n_layers * d_attn * l^2 for the whole sequence. Summed over the sequences of an
  interval this needs the sum of their squared lengths, not only the token count.

What is left out or approximated: non-matmul work (softmax, normalisation, activations, the loss,
the optimizer step); causal masking (a decoder needs only about half the attention scores, counted
in full here as PaLM and nanoGPT do); padding (only real tokens count, which is the point of MFU);
heads that run once per sequence rather than per token (BERT's pooler, counted per token, under 1%
of MiniLM); and recomputation under activation checkpointing. The backward pass is assumed to reach
every matmul weight: when the frozen parts come first (a frozen base under a trainable head), autograd
stops earlier and the true count lies below 4N + 2N_t. If the config gives no layer count or width,
the attention term is left out (`ModelFlops.attention` is False).

The MFU divides by the device's dense bf16/fp16 tensor-core peak (PEAK_FLOPS), so an fp32 run reads
low; on a CPU or a GPU not in the table no MFU is logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PEAK_FLOPS", "ModelFlops", "attention_dims", "matmul_parameters", "peak_flops", "sum_squared_lengths"]


def _numel(p: torch.nn.Parameter) -> int:
    """The full size, also when DeepSpeed ZeRO-3 has partitioned the parameter (it then holds a shard)."""
    return int(getattr(p, "ds_numel", p.numel()))


def _output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    if get is None:
        return None
    try:
        out = get()
    except (NotImplementedError, AttributeError):
        return None
    return out if isinstance(out, torch.nn.Module) else None


def matmul_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(all, trainable) parameters that do matmul work per token.

    Parameters of `torch.nn.Embedding` modules are left out, except those of the output embedding /
    LM head, which are counted even when tied to the input embedding. Each tensor counts once.
    """
    head = _output_embeddings(model)
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    table_ids = {
        id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)
    } - head_ids
    total = trainable = 0
    for p in model.parameters():  # deduplicated: a tied weight appears once
        if id(p) in table_ids:
            continue
        n = _numel(p)
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable


def _first_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def attention_dims(config: Any) -> tuple[int, int] | None:
    """(n_layers, d_attn) from a Hugging Face config, or None when either cannot be found.

    d_attn is heads * head_dim when the config sets head_dim (Llama-style models where it differs
    from hidden_size / heads), else the model width. For grouped-query attention the query heads count:
    every query head computes its own scores against the shared keys and values.
    """
    if config is None:
        return None
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            config = get_text(decoder=True)
        except (TypeError, ValueError, AttributeError):
            pass
    layers = _first_int(config, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    heads = _first_int(config, "num_attention_heads", "n_head", "num_heads", "n_heads")
    head_dim = _first_int(config, "head_dim")
    width = _first_int(config, "hidden_size", "n_embd", "d_model", "dim")
    d_attn = heads * head_dim if heads and head_dim else width
    return (layers, d_attn) if layers and d_attn else None


def sum_squared_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """Sum over the rows of a (batch, seq) attention mask of each row's real length squared.

    Returned as a tensor on the mask's device, so a training loop can accumulate it without a sync.
    """
    lengths = attention_mask.sum(dim=-1, dtype=torch.float64)
    return (lengths * lengths).sum()


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs counts of one model, built once (`from_model`) and asked per logging interval.

    matmul_params: N, non-embedding parameters that do matmul work (LM head included).
    trainable_matmul_params: N_t, those of them that require a gradient.
    n_layers, d_attn: for the attention term; None when the config did not give them.
    """

    matmul_params: int
    trainable_matmul_params: int
    n_layers: int | None = None
    d_attn: int | None = None

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelFlops:
        total, trainable = matmul_parameters(model)
        dims = attention_dims(getattr(model, "config", None))
        n_layers, d_attn = dims if dims else (None, None)
        return cls(total, trainable, n_layers, d_attn)

    @property
    def attention(self) -> bool:
        """Whether the attention term is included (the config gave layers and width)."""
        return self.n_layers is not None and self.d_attn is not None

    @property
    def dense_flops_per_token(self) -> int:
        """Forward 2N, activation gradients 2N, weight gradients 2N_t: 6N when everything trains."""
        return 4 * self.matmul_params + 2 * self.trainable_matmul_params

    def attention_flops(self, sum_sq_lengths: float) -> float:
        """Forward plus backward attention FLOPs of sequences whose squared lengths sum to this."""
        if self.n_layers is None or self.d_attn is None:  # not self.attention
            return 0.0
        return 12.0 * self.n_layers * self.d_attn * float(sum_sq_lengths)

    def training_flops(self, tokens: float, sum_sq_lengths: float = 0.0) -> float:
        """Training FLOPs (forward and backward) of `tokens` real tokens in sequences whose squared
        real lengths sum to `sum_sq_lengths`. Divide by seconds and by the peak for the MFU."""
        return self.dense_flops_per_token * float(tokens) + self.attention_flops(sum_sq_lengths)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token when every sequence has `seq_len` real tokens."""
        return self.dense_flops_per_token + self.attention_flops(seq_len * seq_len) / max(seq_len, 1)


# Dense bf16/fp16 tensor-core peak per GPU, by a substring of torch.cuda.get_device_name(). The first key
# found in the name wins, so a key that is part of another (L4 of L40S, A10 of A100 and A10G) comes after it.
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
