"""Model preparation: the ordered transforms every loaded model goes through before a trainer takes it.

The order is fixed (`TRANSFORMS`), each step relying on those before it:
1. `attention`: --attn_implementation (varlen by default for packed rows; the all-to-all attention of
   cloudtrain.parallel.sequence under --context_parallel_size), the kernel every later step (and probe)
   computes with;
2. `gradient_checkpointing`: before adapters, which build on it (QLoRA readies the inputs for it);
3. `task_checks`: the task's checks of the model as it will compute (document isolation under --packing bfd);
   kernel options (fused modules and losses) belong here, before adapters wrap the modules they replace;
   `fused_cross_entropy`: --fused_cross_entropy, the loss from the hidden states; `liger_modules`: --liger_kernels
   (both on by default where Liger Kernel runs);
4. `task_before_adapters`: what the task keeps of the model before adapters change it (a DPO reference);
5. `adapters`: --peft freezes the base and adds adapters, and the modules the task trains in full;
   `embedding_noise`: --neftune_noise_alpha's hook on the input embeddings (the model as it trains);
6. `compile`: --torch_compile, last, over the final module or each decoder layer (--compile_layers), in place:
   its class, keys and saving stay.
After these the trainers only wrap and shard (DDP, DeepSpeed, FSDP, pipeline stages). A new transform is
one function `(model, cfg, task, announce) -> model` placed in the list.
"""

from collections.abc import Callable
from typing import Any

import torch
from transformers.integrations import is_deepspeed_zero3_enabled

from cloudtrain.config import Config
from cloudtrain.errors import UserError, first_line
from cloudtrain.hardware import resolve_precision
from cloudtrain.models.attention import VARLEN, varlen_kernel_available
from cloudtrain.models.embedding_noise import add_embedding_noise, has_input_embeddings
from cloudtrain.models.kernels import (
    apply_liger_modules,
    compile_layers,
    hidden_states_error,
    liger_auto_off,
    liger_available,
    liger_modules_error,
)
from cloudtrain.tasks.base import Task

CPU_VARLEN_FROM = 512  # --max_length from which varlen is the CPU default for --packing bfd
Transform = Callable[[Any, Config, Task, bool], Any]  # a PreTrainedModel in; it, or a PeftModel, out


def attention(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    """The model computes with --attn_implementation (default: `default_attention`), or the run stops: some
    models cannot switch and would only log a warning."""
    if cfg.distributed.context_parallel_size > 1:  # the all-to-all attention over whole rows, whatever was asked
        from cloudtrain.parallel.sequence import attend_across

        return attend_across(model)
    wanted = cfg.model.attn_implementation
    if not wanted:
        return _default_attention(model, cfg, task, announce)
    if wanted == VARLEN:
        check_varlen(model, cfg, task)
    if model.config._attn_implementation == wanted:
        return model
    try:
        model.set_attn_implementation(wanted)
    except (ImportError, ValueError) as err:
        fix = "install its package, or leave the option out" if "install" in str(err) else "leave the option out"
        raise UserError(
            f"--attn_implementation {wanted}: {first_line(err).rstrip('.')}; {fix} for the default kernel"
        ) from None
    if model.config._attn_implementation != wanted:
        raise UserError(
            f"--attn_implementation {wanted}: {type(model).__name__} cannot use it (it computes with "
            f"{model.config._attn_implementation}); leave the option out for transformers' choice"
        )
    return model


def check_attention_name(cfg: Config) -> None:
    """An --attn_implementation transformers cannot load is refused before data or model (it fails inside the
    model's loading otherwise, its message a screen long)."""
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.utils import import_utils

    wanted = cfg.model.attn_implementation
    if wanted == "flex_attention" and not torch.cuda.is_available():  # it fails at the first backward
        raise UserError(
            "--attn_implementation flex_attention trains on a CUDA GPU only (FlexAttention has no backward on CPU); "
            "use sdpa or eager here"
        )
    known = [k for k in dict.fromkeys([VARLEN, "eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]) if "|" not in k]
    if wanted and wanted.startswith("paged|"):  # continuous batching's kernels need its paged cache: no training
        raise UserError(
            f"--attn_implementation {wanted} attends over a paged cache for serving (continuous batching), not in "
            f"training; use {wanted.removeprefix('paged|')} or leave it out for the default"
        )
    if not wanted or wanted in known:
        return
    if not is_kernel(wanted):
        raise UserError(
            f"--attn_implementation {wanted} is not an attention kernel transformers knows: use one of "
            f"{', '.join(known)} or a Hub kernel (<org>/<repo>), or leave it out for the default"
        )
    if not import_utils.is_kernels_available():
        low, high = (getattr(import_utils, f"KERNELS_{end}_VERSION", None) for end in ("MIN", "MAX"))
        versions = f"kernels>={low},<{high}" if low and high else "kernels"
        raise UserError(f"--attn_implementation {wanted} is a Hub kernel: it needs pip install '{versions}'")


def _default_attention(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    """The default kernel where it applies and the model takes it; else the model keeps transformers' choice
    (the isolation probe still judges that one)."""
    config = getattr(model, "config", None)  # a user's own nn.Module has none: nothing to choose
    if config is None:
        return model
    chosen, before = default_attention(model, cfg, task), config._attn_implementation
    if not chosen or chosen == before:
        return model
    try:
        model.set_attn_implementation(chosen)
    except (ImportError, ValueError):
        return model
    if model.config._attn_implementation != chosen:
        model.set_attn_implementation(before)
        return model
    if announce:
        print(f"attention: {chosen} (the default for --packing {cfg.data.packing})", flush=True)
    return model


def default_attention(model: Any, cfg: Config, task: Task) -> str | None:
    """varlen for packed rows of a task that passes their lengths, where it is at least as fast as sdpa with
    the dense mask (docs/language-models.md); None (transformers' choice) otherwise."""
    if cfg.data.packing != "bfd" or not task.packed_attention or varlen_misfit(model.config):
        return None
    if not torch.cuda.is_available():
        # The per-document reference: no [B, 1, L, L] mask and fewer FLOPs, which outweigh its per-document calls
        # from rows of 512 tokens up (measured on CPU: docs/language-models.md).
        return VARLEN if cfg.data.max_length >= CPU_VARLEN_FROM else None
    # On CUDA only with a varlen kernel for the 16-bit attention of mixed precision; otherwise sdpa's own.
    return VARLEN if varlen_kernel_available() and resolve_precision(cfg.training.mixed_precision) != "no" else None


def check_varlen(model: Any, cfg: Config, task: Task) -> None:
    if not task.packed_attention:
        raise UserError(
            f"--attn_implementation {VARLEN} is for decoders on packed rows (--task causal_lm or sft); "
            "leave the option out for transformers' choice"
        )
    misfit = varlen_misfit(model.config)
    if misfit:
        raise UserError(f"--attn_implementation {VARLEN}: {type(model).__name__} {misfit}; use sdpa")


def varlen_misfit(config: Any) -> str | None:
    """Why a model's attention is more than causal softmax attention, which the varlen kernels compute."""
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "uses sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None):
        return "caps its attention logits"
    return None


def gradient_checkpointing(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    if cfg.model.gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", True):  # ALBERT, MPNet, XLNet, ...: a ValueError
            name = type(getattr(model, "get_base_model", lambda: model)()).__name__
            raise UserError(
                f"--gradient_checkpointing true: {name} does not support activation checkpointing in transformers; "
                "leave it out (a smaller --per_device_train_batch_size with more accumulation also saves memory)"
            )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def task_checks(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    task.check_model(model, cfg, announce)
    return model


def fused_cross_entropy(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    """--fused_cross_entropy: the task's loss from the hidden states (cloudtrain.models.kernels). auto turns it on
    where it is faster (Liger Kernel on CUDA); true also takes the chunked PyTorch one, and refuses where neither
    can run."""
    choice = cfg.model.fused_cross_entropy
    if choice == "false" or (choice == "auto" and not liger_available()):
        return model
    if not task.use_loss_kernel(None):
        if choice == "true":
            task_name = cfg.training.task
            raise UserError(f"--fused_cross_entropy true: --task {task_name} has no language-model loss; use false")
        return model
    problem = _fused_misfit(model, cfg)
    if problem:
        if choice == "true":
            raise UserError(f"--fused_cross_entropy true: {problem}; use false")
        return model
    backend = "liger" if liger_available() else "chunked"
    task.use_loss_kernel(backend)
    if announce:
        print(f"loss: fused linear cross-entropy ({backend}), no full logits in training", flush=True)
    return model


def liger_modules(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    """--liger_kernels: Liger's fused RMSNorm, SwiGLU and RoPE (cloudtrain.models.kernels). true: on, or one line
    why they cannot be; auto: on where Liger can run and bench/gpu.py measured them faster (`liger_auto_off`)."""
    choice = cfg.model.liger_kernels
    if choice is False:
        return model
    problem = liger_modules_error(model)
    if choice == "auto" and (problem or liger_auto_off(cfg)):
        return model
    if problem:
        raise UserError(f"--liger_kernels true: {problem}; use false")
    apply_liger_modules(model)
    if announce:
        chosen = " (--liger_kernels auto; false turns them off)" if choice == "auto" else ""
        print(f"kernels: Liger's fused RMSNorm, SwiGLU and RoPE{chosen}", flush=True)
    return model


def _fused_misfit(model: Any, cfg: Config) -> str | None:
    d = cfg.distributed
    # the head's weight is sharded outside the module's own forward
    if d.zero_stage == 3 or d.fsdp or is_deepspeed_zero3_enabled():
        return "the LM head's weight is sharded (ZeRO-3 or FSDP) where the loss reads it"
    if d.tensor_parallel_size > 1:  # a DTensor split by the plan (cloudtrain.parallel.tensor)
        return "the LM head's weight is split by --tensor_parallel_size where the loss reads it"
    return hidden_states_error(model)


def task_before_adapters(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    task.before_adapters(model, cfg, announce)
    return model


def adapters_for_task(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    if cfg.model.peft == "none":
        return model
    return task.attach_adapters(model, cfg, announce)


def embedding_noise(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    """--neftune_noise_alpha: NEFTune's noise on the input embeddings while training (models.embedding_noise)."""
    alpha = cfg.training.neftune_noise_alpha
    if not alpha:
        return model
    if not has_input_embeddings(model):
        raise UserError(f"--neftune_noise_alpha: {type(model).__name__} names no input embeddings; drop it")
    add_embedding_noise(model, alpha)
    if announce:
        print(f"NEFTune: noise of alpha {alpha:g} on the input embeddings in training", flush=True)
    return model


def compile_model(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    if not cfg.training.torch_compile:
        return model
    if not cfg.model.compile_layers:
        model.compile()  # in place: the module keeps its class, state-dict keys and save_pretrained
        return model
    compiled = compile_layers(model)
    if not compiled:
        raise UserError(
            f"--compile_layers: {type(model).__name__} names no decoder layer class (_no_split_modules); "
            "leave it out to compile the whole model"
        )
    if announce:
        blocks = ", ".join(f"{count} {name}" for name, count in compiled.items())
        print(f"compile: {blocks}, each on its own, static shapes", flush=True)
    return model


TRANSFORMS: list[Transform] = [
    attention,
    gradient_checkpointing,
    task_checks,
    fused_cross_entropy,
    liger_modules,
    task_before_adapters,
    adapters_for_task,
    embedding_noise,
    compile_model,
]


def prepare(
    model: Any,
    cfg: Config,
    task: Task,
    announce: bool = False,
    start: Transform | None = None,
    stop: Transform | None = None,
) -> Any:
    """`model` through the transforms in order, from `start` (default: the first) up to, not including, `stop`
    (default: through the last): the pipeline probes for the batch size between adapters and compile."""
    first = TRANSFORMS.index(start) if start else 0
    end = TRANSFORMS.index(stop) if stop else len(TRANSFORMS)
    for transform in TRANSFORMS[first:end]:
        model = transform(model, cfg, task, announce)
    return model
