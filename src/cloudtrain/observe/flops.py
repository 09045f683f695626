"""Training FLOPs of a transformer, for the model FLOPs utilization (MFU): PaLM's appendix-B count (as nanoGPT's
`estimate_mfu`), 4N + 2N_t per real token for the matmul weights plus attention summed per document
(`attention_squared_lengths`), over the device's dense peak for the run's matmul precision (`DEVICES`,
`identify`; no MFU on a CPU or an unknown GPU). docs/benchmarks.md gives the formula, what it leaves out, the
constants and their sources.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DEVICES",
    "DeviceInfo",
    "DevicePeak",
    "ModelFlops",
    "attention_dims",
    "attention_squared_lengths",
    "device_peak",
    "full_numel",
    "identify",
    "matmul_parameters",
    "matmul_precision",
    "no_peak_reason",
    "peak_flops",
    "sum_squared_lengths",
]


def full_numel(p: torch.nn.Parameter) -> int:
    """The full size, also when DeepSpeed ZeRO-3 has partitioned the parameter (it then holds a shard) and when
    bitsandbytes holds it in 4 bits (packed two to a byte, four to a 16-bit element under FSDP2: QLoRA)."""
    quantized = getattr(getattr(p, "quant_state", None), "shape", None)
    if quantized is not None:
        return math.prod(quantized)
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
        n = full_numel(p)
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


def attention_squared_lengths(batch: Mapping[str, Any]) -> torch.Tensor:
    """Sum over the documents of a batch of each document's real length squared, for the attention FLOPs.

    A packed row holds several documents that attend only within themselves, so the attention work is
    the sum over documents of len^2, not rows x row_len^2. The collator's `position_ids` restart at 0 for
    every document (cloudtrain.data.packing), and the sum of 2p + 1 over positions p = 0..len-1 is len^2:
    summing 2p + 1 over the real tokens gives the count without finding the documents, on the device,
    without a sync. A batch without position_ids (classification, preference pairs) counts whole rows.
    """
    mask = batch["attention_mask"]
    positions = batch.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.shape != mask.shape:
        return sum_squared_lengths(mask)
    return ((2 * positions.to(torch.float64) + 1) * mask.to(torch.float64)).sum()


# ---------------------------------------------------------------- the device's peak
@dataclass(frozen=True)
class DevicePeak:
    """A device's dense peaks in FLOP/s from its vendor's data sheet (sparsity figures halved), and the
    number of SMs (AMD: compute units) of the full chip, to scale a MIG slice. None: not computed natively.
    docs/benchmarks.md lists the sources."""

    label: str
    bf16: float | None  # bf16 tensor cores (fp16 the same on every device listed, except where bf16 is None)
    fp16: float
    tf32: float | None  # fp32 matmuls on tensor cores (torch allow_tf32 / float32_matmul_precision "high")
    fp32: float  # plain fp32
    sms: int


DEVICES = {
    "H100 SXM": DevicePeak("H100 SXM", 989e12, 989e12, 494e12, 67e12, 132),
    "H100 NVL": DevicePeak("H100 NVL", 835e12, 835e12, 417e12, 60e12, 132),
    "H100 PCIe": DevicePeak("H100 PCIe", 756e12, 756e12, 378e12, 51e12, 114),
    "H200 SXM": DevicePeak("H200 SXM", 989e12, 989e12, 494e12, 67e12, 132),
    "H200 NVL": DevicePeak("H200 NVL", 835e12, 835e12, 417e12, 60e12, 132),
    "GH200": DevicePeak("GH200", 989e12, 989e12, 494e12, 67e12, 132),
    "B200": DevicePeak("B200", 2250e12, 2250e12, 1125e12, 75e12, 148),
    "GB200": DevicePeak("GB200", 2500e12, 2500e12, 1250e12, 80e12, 152),
    "A100": DevicePeak("A100", 312e12, 312e12, 156e12, 19.5e12, 108),
    "A10G": DevicePeak("A10G", 70e12, 70e12, 35e12, 35e12, 80),
    "A10": DevicePeak("A10", 125e12, 125e12, 62.5e12, 31.2e12, 72),
    "L40S": DevicePeak("L40S", 362e12, 362e12, 183e12, 91.6e12, 142),
    "L4": DevicePeak("L4", 121e12, 121e12, 60e12, 30.3e12, 58),
    "V100": DevicePeak("V100", None, 125e12, None, 15.7e12, 80),
    "T4": DevicePeak("T4", None, 65e12, None, 8.1e12, 40),
    "MI300X": DevicePeak("MI300X", 1307e12, 1307e12, 654e12, 163e12, 304),
}
GIB = 2**30


@dataclass(frozen=True)
class DeviceInfo:
    """What torch says about a GPU: torch.cuda.get_device_properties' name, total_memory,
    multi_processor_count and (ROCm) gcnArchName."""

    name: str
    memory: int = 0
    sms: int = 0
    arch: str = ""

    @classmethod
    def of(cls, device: torch.device) -> DeviceInfo:
        props = torch.cuda.get_device_properties(device)
        return cls(props.name, props.total_memory, props.multi_processor_count, getattr(props, "gcnArchName", ""))


def _hopper(tokens: set[str], info: DeviceInfo) -> str | None:
    """H100/H800 in its three forms. The name says PCIe or NVL, or "80GB HBM3" for the SXM part; where it
    says none of these, the SM count and memory do: 114 SMs are the PCIe card, 132 with about 94 GB the
    NVL card, 132 with 80 GB the SXM part. Anything else is not guessed."""
    if "PCIE" in tokens:
        return "H100 PCIe"
    if "NVL" in tokens:
        return "H100 NVL"
    if {"80GB", "HBM3"} <= tokens:  # the SXM part's name, also on a MIG slice (whose SMs and memory are a share)
        return "H100 SXM"
    if info.sms == 114:
        return "H100 PCIe"
    if info.sms == 132:
        return "H100 NVL" if info.memory > 85 * GIB else "H100 SXM"
    return None


def identify(info: DeviceInfo) -> str | None:
    """The key of DEVICES for a GPU, or None when it is not one of them (or its variant cannot be told).

    Names are matched by whole words (split at spaces, dashes and underscores), so L4 is not L40S and
    A10 is neither A100 nor A10G."""
    tokens = set(re.split(r"[\s\-_]+", info.name.upper()))
    if tokens & {"MI300X", "MI325X"} or (not info.name.strip() and info.arch.startswith("gfx942") and info.sms == 304):
        return "MI300X"  # MI325X: the MI300X's compute with more memory; older ROCm may leave the name empty
    if tokens & {"H100", "H800"}:
        return _hopper(tokens, info)
    if "GH200" in tokens:
        return "GH200"
    if "H200" in tokens:
        return "H200 NVL" if "NVL" in tokens else "H200 SXM"
    for key in ("GB200", "B200", "A100", "A10G", "A10", "L40S", "L4", "V100", "T4"):
        if key in tokens:
            return key
    return None


def device_peak(info: DeviceInfo, precision: str) -> float | None:
    """Dense peak FLOP/s of the device for a run's matmul precision, or None (unknown device, or a precision
    it does not compute natively). precision: bf16, fp16, tf32 or fp32. A MIG slice ("MIG" in the name), or an
    MI300X in a compute partition (CPX: its name unchanged, 38 of 304 CUs), gets its share of the chip's SMs."""
    key = identify(info)
    if key is None:
        return None
    spec = DEVICES[key]
    peak = {"bf16": spec.bf16, "fp16": spec.fp16, "tf32": spec.tf32, "fp32": spec.fp32}[precision]
    sliced = "MIG" in info.name.upper().split() or key == "MI300X"
    if peak is not None and sliced and 0 < info.sms < spec.sms:
        peak *= info.sms / spec.sms
    return peak


def matmul_precision(mixed_precision: str) -> str:
    """What the matmuls of a run compute in: its autocast dtype, else tf32 where torch allows it for fp32."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch >= 2.9 refuses the legacy getter once the per-backend setting is used (--tf32)
        return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"
    return "fp32" if legacy == "highest" else "tf32"


def peak_flops(device: torch.device, precision: str = "bf16") -> float | None:
    """The device's dense peak FLOP/s for `precision` (bf16, fp16, tf32, fp32), or None: a CPU, or a GPU
    this table does not know (then no MFU is logged rather than a wrong one; `no_peak_reason` says why)."""
    if device.type != "cuda":
        return None
    return device_peak(DeviceInfo.of(device), precision)


def no_peak_reason(device: torch.device, precision: str) -> str | None:
    """One line saying why a GPU gets no MFU, or None when it gets one (and on a CPU, which never does)."""
    if device.type != "cuda":
        return None
    info = DeviceInfo.of(device)
    if device_peak(info, precision) is not None:
        return None
    key = identify(info)
    if key is None:
        what = f"{info.name!r} ({info.sms} SMs, {info.memory / GIB:.0f} GiB) is not a GPU whose peak cloudtrain knows"
    else:
        what = f"{DEVICES[key].label} has no native {precision} peak"
    return f"no MFU logged: {what} (cloudtrain.observe.flops.DEVICES; docs/benchmarks.md)"
