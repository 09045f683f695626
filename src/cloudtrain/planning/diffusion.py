"""The planner for a diffusers text-to-image pipeline (`--task text_to_image`): memory per GPU of its denoiser
trained in full or with LoRA/DoRA, its frozen text encoder and VAE, and the denoiser's activations at the
resolution, for DDP without gradient checkpointing (not estimated yet). The formulas: docs/planner.md.

What the run holds (cloudtrain.models.diffusion.load_text_to_image_model): the frozen parts in the compute
dtype (fp32 without mixed precision), the denoiser in fp32 when it trains in full, in the compute dtype under
adapters whose weights are fp32. The activations are what autograd saves in one forward of the denoiser,
traced on the meta device (no memory, no compute) for one row at the resolution, times the micro-batch.
"""

import contextlib
import importlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cloudtrain.errors import UserError, first_line
from cloudtrain.models import diffusion
from cloudtrain.planning.memory import CUDA_CONTEXT_BYTES, FRAGMENTATION, GIB, MAX_MICRO_BATCH

FROZEN = ("text_encoder", "vae")  # the parts that never train here (--train_text_encoder is not planned)


def is_pipeline(path: str) -> bool:
    """Whether `path` is a diffusers pipeline folder (what --task text_to_image trains)."""
    return (Path(path) / diffusion.MODEL_INDEX).is_file()


@dataclass(frozen=True)
class PipelineFacts:
    name: str
    denoiser_params: int
    adapter_params: int  # LoRA on the denoiser's attention projections at --lora_r (DoRA adds a magnitude each)
    dora_params: int
    frozen_params: dict[str, int]  # the text encoder's and the VAE's
    latent_side: int  # the denoiser's input is latent_channels x side x side
    text_tokens: int  # the tokens of a caption (the tokenizer's max length)
    saved_fp32_per_row: int  # what autograd saves in one fp32 forward of the denoiser, per row
    saved_half_per_row: int  # the same in 16 bits


def _build(path: str, index: dict, name: str) -> torch.nn.Module:
    """The part `name` with its config and no weights (the meta device)."""
    library, class_name = index[name]
    cls = getattr(importlib.import_module(library), class_name)
    folder = str(Path(path) / name)
    with torch.device("meta"):
        if library == "diffusers":
            return cls.from_config(cls.load_config(folder))
        from transformers import AutoConfig

        return cls(AutoConfig.from_pretrained(folder))


def _adapter_params(denoiser: torch.nn.Module, r: int, targets: list[str]) -> tuple[int, int]:
    """(LoRA, DoRA) trainable parameters on the Linear and 1x1 conv projections named by `targets`."""
    lora = dora = 0
    for module_name, module in denoiser.named_modules():
        if not any(module_name == t or module_name.endswith("." + t) for t in targets):
            continue
        if isinstance(module, torch.nn.Linear):
            n_in, n_out = module.in_features, module.out_features
        elif isinstance(module, torch.nn.Conv2d):
            n_in, n_out = module.in_channels, module.out_channels
        else:
            continue
        lora += r * (n_in + n_out)
        dora += r * (n_in + n_out) + n_out
    return lora, dora


def saved_bytes(denoiser: torch.nn.Module, latent: tuple[int, int], text: tuple[int, int], dtype: torch.dtype) -> int:
    """What autograd saves in one training forward of `denoiser` (on the meta device) for one row: every saved
    tensor once, the parameters left out (they are counted as parameters)."""
    denoiser = denoiser.to(dtype).train()
    # a storage (its C++ object: meta tensors have no addresses) once, as views and repeats share it
    params = {p.untyped_storage()._cdata for p in denoiser.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            saved[storage._cdata] = storage.nbytes()
        return t

    channels, side = latent
    sample = torch.empty(1, channels, side, side, device="meta", dtype=dtype, requires_grad=True)
    states = torch.empty(1, *text, device="meta", dtype=dtype)
    timestep = torch.zeros(1, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _fused_attention():
        denoiser(sample, timestep, states)
    return sum(saved.values())


class _FusedAttention(torch.autograd.Function):
    """What a fused SDPA kernel (flash, memory-efficient; the CPU's flash kernel too) keeps for its backward: q, k,
    v, the output and one fp32 log-sum-exp per query and head. On the meta device torch decomposes SDPA into the
    math path instead, which would keep the [s x s] scores."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError  # traced forward only


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    original = F.scaled_dot_product_attention

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _FusedAttention.apply(q, k, v)

    F.scaled_dot_product_attention = fused  # type: ignore[assignment]  # diffusers calls it through the module
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def pipeline_facts(path: str, resolution: int, lora_r: int, lora_targets: list[str]) -> PipelineFacts:
    index = diffusion.read_model_index(path)
    factor = diffusion.vae_scale_factor(path)
    if resolution % factor:
        raise UserError(f"--resolution {resolution} is not divisible by {factor}, the VAE's downscaling factor")
    try:
        parts = {name: _build(path, index, name) for name in ("unet", *FROZEN)}
        tokenizer = json.loads((Path(path) / "tokenizer" / "tokenizer_config.json").read_text())
    except (OSError, ValueError, AttributeError, ImportError) as err:
        raise UserError(f"could not read the pipeline in {path}: {first_line(err)}") from None
    denoiser = parts["unet"]
    config: Any = denoiser.config  # diffusers' FrozenDict of the UNet's options
    text = (int(tokenizer.get("model_max_length", 77)), int(config.cross_attention_dim))
    latent = (int(config.in_channels), resolution // factor)
    lora, dora = _adapter_params(denoiser, lora_r, lora_targets)
    return PipelineFacts(
        name=path,
        denoiser_params=sum(p.numel() for p in denoiser.parameters()),
        adapter_params=lora,
        dora_params=dora,
        frozen_params={name: sum(p.numel() for p in parts[name].parameters()) for name in FROZEN},
        latent_side=latent[1],
        text_tokens=text[0],
        saved_fp32_per_row=saved_bytes(denoiser, latent, text, torch.float32),
        saved_half_per_row=saved_bytes(denoiser, latent, text, torch.bfloat16),
    )


@dataclass(frozen=True)
class PipelineEstimate:
    """Bytes per GPU of one DDP row at one micro-batch."""

    parameters: int  # the denoiser (and its adapters) and the frozen parts
    frozen: int  # of which the text encoder and the VAE
    gradients: int
    optimizer_states: int
    activations: int
    overhead: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.overhead


def estimate(f: PipelineFacts, peft: str, half: bool, micro_batch: int) -> PipelineEstimate:
    """DDP: the denoiser's fp32 weights, gradients and AdamW states (full), or its compute-dtype base and the
    adapters' fp32 weights, gradients and states; autocast's 16-bit copies of trained weights with the gradients;
    the frozen parts in the compute dtype; the saved activations."""
    c = 2 if half else 4
    U = f.denoiser_params
    T = U if peft == "none" else (f.dora_params if peft == "dora" else f.adapter_params)
    frozen = c * sum(f.frozen_params.values())
    base = 4 * U if peft == "none" else c * U + 4 * T
    grads = 4 * T + (2 * T if half else 0)
    per_row = f.saved_half_per_row if half else f.saved_fp32_per_row
    saved = per_row * micro_batch
    states = base + frozen + grads + 8 * T
    overhead = CUDA_CONTEXT_BYTES + round(FRAGMENTATION * (states + saved))
    return PipelineEstimate(base + frozen, frozen, grads, 8 * T, saved, overhead)


def max_micro_batch(f: PipelineFacts, peft: str, half: bool, budget: int) -> int:
    if estimate(f, peft, half, 1).total > budget:
        return 0
    low, high = 1, MAX_MICRO_BATCH
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if estimate(f, peft, half, mid).total <= budget else (low, mid - 1)
    return low


def plan(f: PipelineFacts, half: bool, budget: int, micro_batch: int) -> dict:
    """Every row (full fine-tuning, LoRA, DoRA under DDP), and the first that fits `micro_batch`: full
    fine-tuning before adapters."""
    rows: list[dict[str, Any]] = []
    for peft in ("none", "lora", "dora"):
        e = estimate(f, peft, half, micro_batch)
        rows.append(
            {
                "peft": peft,
                "estimate": {**asdict(e), "total": e.total},
                "max_micro_batch": max_micro_batch(f, peft, half, budget),
            }
        )
    fitting = [r for r in rows if r["max_micro_batch"] >= micro_batch]
    return {"model": asdict(f), "strategies": rows, "recommendation": fitting[0] if fitting else None}


def render(result: dict, budget: int, micro_batch: int) -> str:
    m = result["model"]
    lines = [
        f"{m['name']}: denoiser {m['denoiser_params'] / 1e6:.1f}M parameters (LoRA {m['adapter_params'] / 1e6:.2f}M), "
        + ", ".join(f"{k} {v / 1e6:.1f}M frozen" for k, v in m["frozen_params"].items())
        + f"; latents {m['latent_side']}x{m['latent_side']}, {m['text_tokens']} caption tokens",
        f"per GPU at micro-batch {micro_batch}, DDP, budget {budget / GIB:.1f} GiB:",
        f"  {'row':<36} {'params':>8} {'frozen':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'total':>8} {'max b':>6}",
    ]
    for r in result["strategies"]:
        e = r["estimate"]
        label = {"none": "full fine-tuning", "lora": "LoRA", "dora": "DoRA"}[r["peft"]] + " + DDP"
        cells = [e[k] / GIB for k in ("parameters", "frozen", "gradients", "optimizer_states", "activations", "total")]
        lines.append(f"  {label:<36} " + " ".join(f"{c:>7.2f}G" for c in cells) + f" {r['max_micro_batch']:>6}")
    rec = result["recommendation"]
    if rec is None:
        lines.append("Nothing fits at this micro-batch: a smaller --per_device_train_batch_size or --resolution.")
    else:
        how = f"--peft {rec['peft']}" if rec["peft"] != "none" else "full fine-tuning"
        lines.append(f"Recommended: {how} under DDP ({rec['estimate']['total'] / GIB:.1f} GiB per GPU).")
    lines.append("Gradient checkpointing, ZeRO and FSDP2 are not estimated for a pipeline yet.")
    return "\n".join(lines)
