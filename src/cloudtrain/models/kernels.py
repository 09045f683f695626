"""Fused kernels as options: a linear cross-entropy that never holds the full logits (`--fused_cross_entropy`),
Liger Kernel's fused decoder modules (`--liger_kernels`), and the decoder layers compiled one by one.

The language-model loss needs the logits [tokens, vocabulary] only to reduce them to one number per token. Two
implementations compute the summed next-token cross-entropy straight from the final hidden states and the output
embedding:

- "liger": Liger Kernel's fused linear cross-entropy (CUDA, triton), when the `liger-kernel` package is installed;
- "chunked": plain PyTorch, here: rows in chunks through the head and the cross-entropy; the gradients of each chunk
  are computed as it goes, so the largest tensor alive is one chunk's logits. It runs on any device.

`hidden_states` gets the hidden states from the model's own forward (so DDP, FSDP and adapters see the usual call)
with no logits computed. Measurements and the choice of the default: docs/language-models.md.
"""

from __future__ import annotations

import functools
import importlib.util
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from cloudtrain.evaluation import eval_mode
from cloudtrain.hardware import autocast_dtype

__all__ = [
    "BACKENDS",
    "apply_liger_modules",
    "chunked_linear_cross_entropy",
    "compile_layers",
    "decoder_layers",
    "hidden_states",
    "liger_auto_off",
    "liger_available",
    "liger_installed",
    "liger_knows",
    "linear_cross_entropy",
]

BACKENDS = ("liger", "chunked")
IGNORE_INDEX = -100
CHUNK_ROWS = 4096  # rows per chunk: at a 32k vocabulary, 512 MiB of fp32 logits


@functools.cache
def _liger() -> Callable | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:  # installed without triton, or for another torch: unusable, not an error here
        return None
    return liger_fused_linear_cross_entropy


def liger_available() -> bool:
    """Liger Kernel is installed and this machine has the CUDA GPU its triton kernels need."""
    return torch.cuda.is_available() and _liger() is not None


def liger_installed() -> bool:
    """Liger Kernel can be imported here: the planner's question, whose GPU runs its kernels."""
    return _liger() is not None


def liger_knows(model_type: str | None) -> bool:
    """Whether Liger Kernel, installed here, has fused decoder modules for `model_type` models."""
    if _liger() is None:
        return False
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:  # a liger-kernel made for another transformers: no modules it can patch
        return False
    return model_type in MODEL_TYPE_TO_APPLY_LIGER_FN


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(hidden @ weight.T + bias, targets, label_smoothing), one chunk of rows at a
    time."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_rows: int,
        smoothing: float,
    ) -> torch.Tensor:
        dtype = autocast_dtype(hidden)
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if grads else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if grads else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if grads and bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False):  # the casts above are the ones autocast would do
            for start in range(0, hidden.shape[0], chunk_rows):
                h = hidden[start : start + chunk_rows].to(dtype)
                t = targets[start : start + chunk_rows]
                logits = F.linear(h, w, b).float()
                total += F.cross_entropy(
                    logits, t, ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=smoothing
                )
                if grads:
                    # d(sum CE)/d logits = softmax - the smoothed one-hot ((1 - e) on the target, e / V on every
                    # class), on the rows that have a target
                    grad_logits = logits.softmax(dim=-1)
                    if smoothing:
                        grad_logits.sub_(smoothing / logits.shape[-1])
                    keep = t != IGNORE_INDEX
                    hit = -(1 - smoothing) * keep[:, None].to(grad_logits.dtype)
                    grad_logits.scatter_add_(1, t.clamp(min=0)[:, None], hit).mul_(keep[:, None])
                    g = grad_logits.to(dtype)
                    grad_hidden[start : start + chunk_rows] = g @ w  # type: ignore[index]
                    grad_weight.addmm_(g.t().float(), h.float())  # type: ignore[union-attr]
                    if grad_bias is not None:
                        grad_bias += grad_logits.sum(dim=0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        scale = grad_output.float()
        return (
            None if grad_hidden is None else (grad_hidden.float() * scale).to(grad_hidden.dtype),
            None if grad_weight is None else (grad_weight * scale).to(weight_dtype),
            None if grad_bias is None else (grad_bias * scale).to(bias_dtype),
            None,
            None,
            None,
        )


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_rows: int = CHUNK_ROWS,
    smoothing: float = 0.0,
) -> torch.Tensor:
    """Summed cross-entropy of `hidden` [N, H] through the head (`weight` [V, H], `bias`) against `targets` [N]
    (IGNORE_INDEX: no loss; `smoothing`: label smoothing), with at most `chunk_rows` rows of logits alive at a
    time."""
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_rows, smoothing)


def linear_cross_entropy(
    backend: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    smoothing: float = 0.0,
) -> torch.Tensor:
    """The summed cross-entropy of `hidden` through the head (label-smoothed by `smoothing`), by `backend` (one
    of BACKENDS)."""
    if backend == "liger":
        liger = _liger()
        assert liger is not None
        dtype = autocast_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            return liger(
                hidden.to(dtype),
                weight.to(dtype),
                targets,
                None if bias is None else bias.to(dtype),
                ignore_index=IGNORE_INDEX,
                label_smoothing=smoothing,
                reduction="sum",
            ).float()
    return chunked_linear_cross_entropy(hidden, weight, bias, targets, smoothing=smoothing)


def hidden_states(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The final hidden states [B, L, H] (after the last norm) from the model's own forward, no logits computed:
    `logits_to_keep` keeps none of them, and the hidden states are the forward's last ones."""
    keep_none = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
    out = model(**inputs, output_hidden_states=True, logits_to_keep=keep_none)
    return out.hidden_states[-1]


def output_head(model: Any) -> torch.nn.Module:
    """The output embedding (LM head) of `model`, through DDP/DeepSpeed (`.module`) and PEFT wrappers; a head PEFT
    trains in full (`modules_to_save`: grown for a chat template's tokens) is its trained copy, a plain Linear."""
    inner = getattr(model, "module", model)
    head = inner.get_output_embeddings()
    copies = getattr(head, "modules_to_save", None)
    if copies is not None:
        active = head.active_adapter
        name = active[0] if isinstance(active, (list, tuple)) else active
        if name in copies and not getattr(head, "disable_adapters", False):
            return copies[name]
    return head


def hidden_states_error(model: torch.nn.Module) -> str | None:
    """None if the head applied to `hidden_states` gives the model's logits (checked on 8 tokens); else why not."""
    name = type(model).__name__
    parameter = next(model.parameters())
    ids = torch.arange(8, device=parameter.device)[None] % max(1, getattr(model.config, "vocab_size", 8) or 8)
    inputs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
    try:
        with eval_mode(model), torch.no_grad():
            logits = model(**inputs).logits.float()
            head = output_head(model)
            fused = head(hidden_states(model, inputs)).float()
    except (TypeError, ValueError, AttributeError, IndexError) as err:
        return f"{name} does not give its hidden states without logits ({str(err).splitlines()[0]})"
    if fused.shape != logits.shape or (fused - logits).abs().max().item() > 1e-3 * max(1.0, logits.abs().max().item()):
        return f"{name}'s logits are more than its head over its last hidden states (a scaling or soft-capping)"
    return None


def liger_modules_error(model: Any) -> str | None:
    """None if Liger's fused RMSNorm, SwiGLU and RoPE can replace `model`'s; else why not, in a few words."""
    if not torch.cuda.is_available():
        return "Liger Kernel's triton kernels need a CUDA GPU"
    if _liger() is None:
        return "the liger-kernel package is not installed (pip install liger-kernel)"
    config = getattr(model, "config", None)
    if config is None:  # not a transformers model (a diffusion pipeline, a module of one's own)
        return f"{type(model).__name__} is not a transformers model with a model type Liger Kernel knows"
    model_type = getattr(config, "model_type", None)
    if not liger_knows(model_type):
        return f"Liger Kernel has no fused modules for {model_type!r} models"
    return None


def liger_auto_off(cfg: Any) -> str | None:
    """Why --liger_kernels auto leaves Liger's modules off for these options, or None. They were measured faster
    for full fine-tuning on an H100 (docs/benchmarks.md); adapters and compiled models are not measured yet."""
    d = cfg.distributed
    if d.tensor_parallel_size > 1:
        return "tensor parallelism: its weights and activations are DTensors (refused with true)"
    if d.context_parallel_size > 1:
        return "context parallelism: not measured yet"
    if cfg.model.peft != "none":
        return "adapters: not measured yet"
    if cfg.training.torch_compile:
        return "--torch_compile: the compiler fuses these operations itself"
    return None


def apply_liger_modules(model: Any) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE in place of `model`'s (its loss stays ours: --fused_cross_entropy)."""
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    options = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False}
    _apply_liger_kernel_to_instance(model, fused_linear_cross_entropy=False, **options)


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of a transformers model: the modules of the classes it names as never split."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [module for module in model.modules() if type(module).__name__ in names]


def compile_layers(model: Any) -> Counter[str]:
    """Compile each decoder layer in place; how many of each class were compiled (an encoder names its embeddings
    too). With rows padded to one width its tensors keep one shape, and dynamo makes the integers that vary
    (document lengths) dynamic after their first change."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()  # rows of one width (pad_to); the varying document lengths stay outside the graphs
    return Counter(type(layer).__name__ for layer in layers)
