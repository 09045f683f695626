"""The planner for a diffusers text-to-image pipeline (`--task text_to_image`): memory per GPU of its denoiser
(a UNet, or SD3's transformer) trained in full or with LoRA/DoRA (and its CLIP text encoders with
--train_text_encoder, in full or with the same adapters), the frozen parts (SD3's T5 encoder among them,
always), and the activations at the resolution, under DDP and DeepSpeed ZeRO-2, with and without gradient
checkpointing of the denoiser. The formulas: docs/planner.md.

What the run holds (cloudtrain.models.diffusion.load_text_to_image_model): the frozen parts in the compute
dtype (fp32 without mixed precision), a part trained in full in fp32, in the compute dtype under adapters whose
weights are fp32; under ZeRO-2, DeepSpeed's bf16/fp16 mode casts the trained weights to 16 bits and keeps their
fp32 master copy, gradients and AdamW states partitioned over the processes. The activations are what autograd
saves in one forward of the denoiser (and of a trained text encoder), traced on the meta device (no memory, no
compute) for one row at the resolution, times the micro-batch.
"""

import contextlib
import importlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cloudtrain.errors import UserError, first_line
from cloudtrain.models import diffusion, sd3, sdxl
from cloudtrain.parallel.distributed import Sharding
from cloudtrain.planning.memory import CUDA_CONTEXT_BYTES, FRAGMENTATION, GIB, MAX_MICRO_BATCH

ENCODERS = ("text_encoder", "text_encoder_2")  # SDXL and SD3 have the second; SD3's T5 is never trained
STRATEGIES = {"ddp": Sharding(), "zero2": Sharding(zero_stage=2)}  # what the task runs and is planned here
LABELS = {"ddp": "DDP", "zero2": "ZeRO-2"}


def is_pipeline(path: str) -> bool:
    """Whether `path` is a diffusers pipeline folder (what --task text_to_image trains)."""
    return (Path(path) / diffusion.MODEL_INDEX).is_file()


@dataclass(frozen=True)
class PipelineFacts:
    name: str
    denoiser_params: int
    adapter_params: int  # LoRA on the denoiser's attention projections at --lora_r (DoRA adds a magnitude each)
    dora_params: int
    frozen_params: dict[str, int]  # the text encoders' (frozen unless --train_text_encoder; T5 always) and the VAE's
    text_adapter_params: int  # LoRA on the text encoder's q/k/v/out projections (--train_text_encoder --peft lora)
    text_dora_params: int
    latent_side: int  # the denoiser's input is latent_channels x side x side
    text_tokens: int  # the tokens of a caption (the tokenizer's max length; SD3: CLIP's and T5's one after the other)
    saved_fp32_per_row: int  # what autograd saves in one fp32 forward of the denoiser, per row
    saved_half_per_row: int  # the same in 16 bits (SDXL: with its pooled embedding and time ids)
    checkpointed_fp32_per_row: int  # the peak of the same with --gradient_checkpointing
    checkpointed_half_per_row: int
    text_saved_fp32_per_row: int  # what a text encoder trained in full saves in its forward, for one caption
    text_saved_half_per_row: int
    text_lora_saved_fp32_per_row: int  # the same with LoRA on it
    text_lora_saved_half_per_row: int
    vae_fp32: bool = False  # SDXL's VAE stays in fp32 where its config asks (force_upcast), as the run loads it


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


def _traced(module: torch.nn.Module, dtype: torch.dtype, forward: Callable[[torch.nn.Module], object]) -> int:
    """What autograd saves in `forward(module)` (on the meta device): every saved tensor once, the parameters
    left out (they are counted as parameters)."""
    module = module.to(dtype).train()
    # a storage (its C++ object: meta tensors have no addresses) once, as views and repeats share it
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    saved: dict[int, int] = {}
    with _saving(saved, params), _fused_attention():
        forward(module)
    return sum(saved.values())


def _saving(saved: dict[int, int], params: set[int]) -> contextlib.AbstractContextManager:
    """Saved-tensor hooks that note each saved storage's bytes in `saved` (the parameters' left out)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            saved[storage._cdata] = storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def saved_bytes(denoiser: torch.nn.Module, latent: tuple[int, int], text: tuple[int, int], dtype: torch.dtype) -> int:
    """What autograd saves in one training forward of `denoiser` for one row."""
    return _traced(denoiser, dtype, _denoiser_forward(latent, text, dtype))


def _denoiser_forward(latent: tuple[int, int], text: tuple[int, int], dtype: torch.dtype) -> Callable:
    channels, side = latent
    sample = torch.empty(1, channels, side, side, device="meta", dtype=dtype, requires_grad=True)
    states = torch.empty(1, *text, device="meta", dtype=dtype)
    timestep = torch.zeros(1, dtype=torch.long, device="meta")
    pooled = torch.empty(1, 0, device="meta", dtype=dtype)

    def forward(denoiser: torch.nn.Module) -> object:
        config: Any = denoiser.config
        if "pooled_projection_dim" in config:  # SD3's transformer: the CLIP encoders' pooled projections
            pooled_projections = pooled.new_empty(1, int(config.pooled_projection_dim))
            return denoiser(
                hidden_states=sample,
                timestep=timestep,
                encoder_hidden_states=states,
                pooled_projections=pooled_projections,
            )
        return denoiser(sample, timestep, states, added_cond_kwargs=_added_cond(denoiser, dtype))

    return forward


def _added_cond(unet: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """SDXL's pooled text embedding and six time ids (the UNet's text_time embedding), else nothing."""
    config: Any = unet.config
    if config.addition_embed_type != "text_time":
        return None
    pooled = int(config.projection_class_embeddings_input_dim) - 6 * int(config.addition_time_embed_dim)
    return {
        "text_embeds": torch.empty(1, pooled, device="meta", dtype=dtype),
        "time_ids": torch.empty(1, 6, device="meta", dtype=dtype),
    }


def checkpointed_saved_bytes(
    denoiser: torch.nn.Module, latent: tuple[int, int], text: tuple[int, int], dtype: torch.dtype
) -> int:
    """The peak of saved activations with --gradient_checkpointing, for one row: what the forward saves outside
    the checkpointed blocks, the blocks' inputs (kept for their recompute), and the largest block's own saves
    (recomputed one block at a time in the backward). diffusers hands each block to the checkpointing function
    its enable_gradient_checkpointing takes; this one runs the block under hooks of its own."""
    # the parameters in `dtype` first, then their storages: taken before the cast, they were the previous trace's
    # dtype's, freed by it, and activations given their addresses were left out (the peak varied run to run)
    denoiser = denoiser.to(dtype).train()
    params = {p.untyped_storage()._cdata for p in denoiser.parameters()}
    saved: dict[int, int] = {}
    blocks: list[int] = []

    def checkpointed(block: torch.nn.Module, *args: Any) -> Any:
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.untyped_storage()._cdata not in params:
                saved[arg.untyped_storage()._cdata] = arg.untyped_storage().nbytes()
        inside: dict[int, int] = {}
        with _saving(inside, params):
            out = block(*args)
        blocks.append(sum(inside.values()))
        return out

    denoiser.enable_gradient_checkpointing(checkpointed)  # type: ignore[operator]  # diffusers' ModelMixin
    try:
        with _saving(saved, params), _fused_attention():
            _denoiser_forward(latent, text, dtype)(denoiser)
    finally:
        denoiser.disable_gradient_checkpointing()  # type: ignore[operator]
    return sum(saved.values()) + max(blocks, default=0)


def text_saved_bytes(encoder: torch.nn.Module, tokens: int, dtype: torch.dtype, lora_r: int = 0) -> int:
    """What autograd saves in one training forward of a text encoder (--train_text_encoder) for one caption. With
    LoRA (`lora_r`): only the adapted projections' weights want gradients (a LoRA layer saves the input its base
    would for its own weight, and its r-wide inner activation), so the frozen layers between keep less."""
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")  # SDXL asks for the hidden states: no more saved
    targets = [m for name, m in encoder.named_modules() if name.rsplit(".", 1)[-1] in diffusion.TEXT_LORA_TARGETS]
    encoder.requires_grad_(not lora_r)
    for module in targets if lora_r else []:
        module.requires_grad_(True)
    try:
        inner = len(targets) * tokens * lora_r * dtype.itemsize if lora_r else 0
        return _traced(encoder, dtype, lambda text_encoder: text_encoder(ids)) + inner
    finally:
        encoder.requires_grad_(True)


class _FusedAttention(torch.autograd.Function):
    """What a fused SDPA kernel (flash, memory-efficient; the CPU's flash kernel too) keeps for its backward: q, k,
    v, the output and one fp32 log-sum-exp per query and head. On the meta device torch decomposes SDPA into the
    math path instead, which would keep the [s x s] scores."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # in the layout the kernels return ([batch, tokens, heads, dim] in memory), so the attention block's
        # transpose back is a view, not a copy autograd would save again
        b, h, n = q.shape[:-1]
        out = q.new_empty(b, n, h, v.shape[-1]).transpose(1, 2)
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


def pipeline_facts(
    path: str, resolution: int, lora_r: int, lora_targets: list[str], t5_tokens: int = 77
) -> PipelineFacts:
    """The pipeline's sizes and one row's saved activations; `t5_tokens`: SD3's --max_sequence_length."""
    index = diffusion.read_model_index(path)
    factor = diffusion.vae_scale_factor(path)
    if resolution % factor:
        raise UserError(f"--resolution {resolution} is not divisible by {factor}, the VAE's downscaling factor")
    flow = sd3.is_sd3(index)
    encoders = ENCODERS if sdxl.is_xl(index) or flow else ENCODERS[:1]
    frozen_only = ("text_encoder_3",) if flow and sd3.has_t5(index) else ()
    name, _ = diffusion.denoiser_class(index)
    try:
        parts = {part: _build(path, index, part) for part in (name, "vae", *encoders, *frozen_only)}
        tokenizer = json.loads((Path(path) / "tokenizer" / "tokenizer_config.json").read_text())
        vae_config = json.loads((Path(path) / "vae" / "config.json").read_text())
    except (OSError, ValueError, AttributeError, ImportError) as err:
        raise UserError(f"could not read the pipeline in {path}: {first_line(err)}") from None
    denoiser = parts[name]
    config: Any = denoiser.config  # diffusers' FrozenDict of the denoiser's options
    clip_tokens = int(tokenizer.get("model_max_length", 77))
    if flow:  # the CLIP states padded to T5's width, then T5's (zeros without T5: as long)
        text = (clip_tokens + t5_tokens, int(config.joint_attention_dim))
    else:
        text = (clip_tokens, int(config.cross_attention_dim))
    latent = (int(config.in_channels), resolution // factor)
    lora, dora = _adapter_params(denoiser, lora_r, lora_targets)
    text_adapters = [_adapter_params(parts[name], lora_r, diffusion.TEXT_LORA_TARGETS) for name in encoders]
    return PipelineFacts(
        name=path,
        denoiser_params=sum(p.numel() for p in denoiser.parameters()),
        adapter_params=lora,
        dora_params=dora,
        frozen_params={
            part: sum(p.numel() for p in parts[part].parameters()) for part in (*encoders, *frozen_only, "vae")
        },
        text_adapter_params=sum(lora for lora, _ in text_adapters),
        text_dora_params=sum(dora for _, dora in text_adapters),
        latent_side=latent[1],
        vae_fp32=len(encoders) > 1 and bool(vae_config.get("force_upcast", True)),
        text_tokens=text[0],
        saved_fp32_per_row=saved_bytes(denoiser, latent, text, torch.float32),
        saved_half_per_row=saved_bytes(denoiser, latent, text, torch.bfloat16),
        checkpointed_fp32_per_row=checkpointed_saved_bytes(denoiser, latent, text, torch.float32),
        checkpointed_half_per_row=checkpointed_saved_bytes(denoiser, latent, text, torch.bfloat16),
        **{
            f"text{'_lora' if adapted else ''}_saved_{name}_per_row": sum(
                text_saved_bytes(parts[encoder], clip_tokens, dtype, lora_r if adapted else 0) for encoder in encoders
            )
            for adapted in (False, True)
            for name, dtype in (("fp32", torch.float32), ("half", torch.bfloat16))
        },
    )


@dataclass(frozen=True)
class Training:
    """One planned way to train: --peft, --train_text_encoder, and the strategy (a key of STRATEGIES)."""

    peft: str = "none"
    text_encoder: bool = False
    strategy: str = "ddp"
    processes: int = 1  # ZeRO-2 partitions over them
    checkpointing: bool = False  # --gradient_checkpointing: the denoiser's blocks recomputed in the backward


@dataclass(frozen=True)
class PipelineEstimate:
    """Bytes per GPU of one row at one micro-batch."""

    parameters: int  # the trained parts (and their adapters) and the frozen ones
    frozen: int  # of which the frozen weights of the text encoder and the VAE
    gradients: int
    optimizer_states: int
    activations: int
    overhead: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.overhead


def text_params(f: PipelineFacts) -> int:
    """The text encoders' parameters (SDXL's two)."""
    return sum(n for name, n in f.frozen_params.items() if name in ENCODERS)


def trained_params(f: PipelineFacts, t: Training) -> tuple[int, int]:
    """(the denoiser's, the text encoder's) trained parameters."""
    adapters = {"lora": (f.adapter_params, f.text_adapter_params), "dora": (f.dora_params, f.text_dora_params)}
    unet, text = (f.denoiser_params, text_params(f)) if t.peft == "none" else adapters[t.peft]
    return unet, text if t.text_encoder else 0


def estimate(
    f: PipelineFacts, peft: str, half: bool, micro_batch: int, how: Training | None = None
) -> PipelineEstimate:
    """DDP: a part trained in full holds fp32 weights, or its compute-dtype base and the adapters' fp32 weights;
    fp32 gradients and AdamW states of what trains, and autocast's 16-bit copies of it with the gradients.
    ZeRO-2 over n processes: the trained weights in DeepSpeed's 16 bits (fp32 without mixed precision), their
    16-bit and fp32 gradient partitions, AdamW states and the fp32 master copy partitioned. The frozen parts in
    the compute dtype; the saved activations."""
    t = replace(how or Training(), peft=peft)
    c = 2 if half else 4
    unet, text = trained_params(f, t)
    T = unet + text
    E, V = text_params(f), f.frozen_params["vae"]
    zero2, n = t.strategy == "zero2", t.processes
    w = c if zero2 else 4  # a trained weight's bytes: DeepSpeed casts the module to the compute dtype
    full = t.peft == "none"
    frozen = (4 if f.vae_fp32 else c) * V + (0 if t.text_encoder and full else c * E)
    frozen += c * f.frozen_params.get("text_encoder_3", 0)  # SD3's T5: frozen, in the compute dtype
    trained = w * T + (0 if full else c * f.denoiser_params)  # a LoRA'd denoiser keeps its base in the compute dtype
    if zero2:
        grads, states = (c + 4) * T // n, 12 * T // n
    else:
        grads, states = 4 * T + (2 * T if half else 0), 8 * T
    if t.checkpointing:
        denoiser = f.checkpointed_half_per_row if half else f.checkpointed_fp32_per_row
    else:
        denoiser = f.saved_half_per_row if half else f.saved_fp32_per_row
    per_row = denoiser + (text_saved(f, full, half) if t.text_encoder else 0)
    saved = per_row * micro_batch
    held = trained + frozen + grads + states
    overhead = CUDA_CONTEXT_BYTES + round(FRAGMENTATION * (held + saved))
    return PipelineEstimate(trained + frozen, frozen, grads, states, saved, overhead)


def text_saved(f: PipelineFacts, full: bool, half: bool) -> int:
    """What a trained text encoder's forward saves per caption: in full, or with adapters."""
    if full:
        return f.text_saved_half_per_row if half else f.text_saved_fp32_per_row
    return f.text_lora_saved_half_per_row if half else f.text_lora_saved_fp32_per_row


def max_micro_batch(f: PipelineFacts, t: Training, half: bool, budget: int) -> int:
    if estimate(f, t.peft, half, 1, t).total > budget:
        return 0
    low, high = 1, MAX_MICRO_BATCH
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if estimate(f, t.peft, half, mid, t).total <= budget else (low, mid - 1)
    return low


def trainings(
    text_encoder: bool, processes: int, checkpointing: str, refusal: Callable[[str, Sharding], str | None]
) -> list[Training]:
    """The rows, full fine-tuning before adapters, DDP before ZeRO-2 and each without checkpointing (faster)
    before with it (`checkpointing`: auto, true or false); those the run refuses (`refusal(peft, sharding)`: the
    task's Task.sharding_refusal) left out."""
    return [
        Training(peft, text_encoder, strategy, processes, ckpt)
        for peft in ("none", "lora", "dora")
        for strategy, sharding in STRATEGIES.items()
        for ckpt in (False, True)
        if checkpointing in ("auto", str(ckpt).lower()) and refusal(peft, sharding) is None
    ]


def plan(
    f: PipelineFacts, half: bool, budget: int, options: list[int], per_gpu: int, rows_to_plan: list[Training]
) -> dict:
    """Every row at the first of `options` (the micro-batches dividing the `per_gpu` examples each process takes
    per optimizer step, largest first: the one asked), and the recommendation: the first row that fits it, else
    the first that fits the largest smaller one, with the accumulation that keeps the global batch."""
    rows: list[dict[str, Any]] = []
    for t in rows_to_plan:
        e = estimate(f, t.peft, half, options[0], t)
        rows.append(
            {
                **asdict(t),
                "estimate": {**asdict(e), "total": e.total},
                "max_micro_batch": max_micro_batch(f, t, half, budget),
            }
        )
    chosen = next(((i, b) for b in options for i, r in enumerate(rows) if r["max_micro_batch"] >= b), None)
    recommendation = None
    if chosen:
        (i, b), t = chosen, rows_to_plan[chosen[0]]
        e = estimate(f, t.peft, half, b, t)
        recommendation = {
            **rows[i],
            "estimate": {**asdict(e), "total": e.total},
            "micro_batch": b,
            "gradient_accumulation_steps": per_gpu // b,
        }
    return {"model": asdict(f), "strategies": rows, "recommendation": recommendation}


def row_label(r: dict) -> str:
    what = {"none": "full fine-tuning", "lora": "LoRA", "dora": "DoRA"}[r["peft"]]
    text = " + text encoder" if r["text_encoder"] else ""
    return what + text + f" + {LABELS[r['strategy']]}" + (" + checkpointing" if r["checkpointing"] else "")


def launch_flags(r: dict) -> str:
    """The options that run the row (beside the ones planned with)."""
    flags = [f"--peft {r['peft']}" if r["peft"] != "none" else "full fine-tuning"]
    flags += ["--train_text_encoder true"] if r["text_encoder"] else []
    flags += ["--gradient_checkpointing true"] if r["checkpointing"] else []
    flags += ["--zero_stage 2 (--training_type accelerated)"] if r["strategy"] == "zero2" else ["under DDP"]
    return " ".join(flags)


def render(result: dict, budget: int, micro_batch: int) -> str:
    """The table of `plan`'s rows at `micro_batch` (result["mixed_precision"]: the precision planned for), the
    notes, and the recommendation with its micro-batch and accumulation."""
    m = result["model"]
    processes = result["strategies"][0]["processes"] if result["strategies"] else 1
    precision = result.get("mixed_precision", "no")
    lines = [
        f"{m['name']}: denoiser {m['denoiser_params'] / 1e6:.1f}M parameters (LoRA {m['adapter_params'] / 1e6:.2f}M), "
        + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in m["frozen_params"].items())
        + f" (text encoder LoRA {m['text_adapter_params'] / 1e6:.2f}M)"
        + f"; latents {m['latent_side']}x{m['latent_side']}, {m['text_tokens']} caption tokens",
        *(f"note: {note}" for note in result.get("notes", [])),
        f"per GPU at micro-batch {micro_batch}, "
        + (f"mixed precision {precision}" if precision != "no" else "fp32 (no mixed precision)")
        + f", ZeRO-2 over {processes} process{'es' if processes > 1 else ''}, budget {budget / GIB:.1f} GiB:",
        f"  {'row':<60} {'params':>8} {'frozen':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'total':>8} {'max b':>6}",
    ]
    for r in result["strategies"]:
        e = r["estimate"]
        cells = [e[k] / GIB for k in ("parameters", "frozen", "gradients", "optimizer_states", "activations", "total")]
        lines.append(f"  {row_label(r):<60} " + " ".join(f"{c:>7.2f}G" for c in cells) + f" {r['max_micro_batch']:>6}")
    rec = result["recommendation"]
    if rec is None:
        lines.append("Nothing fits, not even micro-batch 1: a lower --resolution, or GPUs with more memory.")
    else:
        b, accumulation = rec["micro_batch"], rec["gradient_accumulation_steps"]
        lines.append(
            f"Recommended: {launch_flags(rec)}, --per_device_train_batch_size {b} --gradient_accumulation_steps "
            f"{accumulation} ({rec['estimate']['total'] / GIB:.1f} GiB per GPU)."
        )
        if b < micro_batch:
            lines.append(
                f"Micro-batch {micro_batch} fits no row; {b} is the largest that one fits, so gradient accumulation "
                "makes up the global batch."
            )
    lines.append(
        "ZeRO-3 and FSDP2 are not estimated for a pipeline yet, and plan writes no configs or launch command for it "
        "(--output_dir is not used): launch with the options named."
    )
    return "\n".join(lines)
