"""Tensor parallelism (`--tensor_parallel_size N`): each decoder layer's attention and MLP weights split across N
processes with the model's own plan (transformers' `base_model_tp_plan`: column-wise q/k/v, gate and up
projections, row-wise o and down projections), and the launch's processes / N data-parallel replicas of that
group. transformers shards the model as it loads (`load_options`), on a (dp_replicate, tp) mesh; with more than
one replica it also wraps the model in FSDP2 with a shard degree of 1, which all-reduces (averages) the
gradients across the replicas. With --fsdp the data-parallel processes shard the states instead (FSDP2 on a
(dp_shard, tp) mesh: 2-D), still through transformers, so it runs on CPU too. The ranks of one tensor-parallel
group take the same rows (accelerate's loaders, told the mesh), every group its own. Checkpoints hold each
process's shards (torch.distributed.checkpoint); the final model is gathered to full tensors and written as
ordinary safetensors by the main process. What runs where and why: docs/parallelism.md.
"""

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from cloudtrain.config import Config
from cloudtrain.errors import UserError
from cloudtrain.parallel.mesh import Mesh
from cloudtrain.parallel.runtime import GroupRuntime, Runtime

SHARDS = "tensor_parallel"
# PEFT 0.21 builds a row-split layer's adapter (lora_A) at the local input width, and transformers 5.23's rowwise
# forward reads that width as the global one (docs/parallelism.md#adapters)
PEFT_REFUSAL = (
    "does not combine with --peft: PEFT 0.21 builds the adapters of row-split layers (o_proj, down_proj) at their "
    "local width, which transformers' tensor-parallel forward reads as the whole width (it fails on the first "
    "batch); train adapters with --fsdp true or ZeRO instead"
)  # a checkpoint's subfolder with every process's shards of weights and optimizer state


def degree(cfg: Config) -> int:
    return cfg.distributed.tensor_parallel_size


def shards_states(cfg: Config) -> bool:
    """--fsdp beside --tensor_parallel_size: the data-parallel processes shard the states (FSDP2 through
    transformers, 2-D with the tensor-parallel dimension) instead of replicating them."""
    return cfg.distributed.fsdp


def tensor_mesh(cfg: Config, processes: int) -> Mesh:
    """The launch's processes as (data-parallel replicas or shards) x (tensor-parallel group)."""
    return Mesh.split(processes, sharded=shards_states(cfg), tp=degree(cfg))


def check_tensor_parallel(cfg: Config, processes: int) -> None:
    """Every refusal of --tensor_parallel_size, before anything heavy loads (reads the model's config only)."""
    tp = degree(cfg)
    if tp == 1:
        return
    from cloudtrain.parallel.distributed import split_refusals

    flag = f"--tensor_parallel_size {tp}"
    t, d = cfg.training, cfg.distributed
    refusals = split_refusals(cfg, tp, processes) + [
        (
            cfg.distributed.fsdp
            and (
                d.fsdp_sharding_strategy != "full_shard"
                or d.fsdp_cpu_offload
                or d.fsdp_reshard_after_forward is not None
            ),
            "with --fsdp shards fully, through transformers: drop --fsdp_sharding_strategy, --fsdp_cpu_offload and "
            "--fsdp_reshard_after_forward",
        ),
        (cfg.model.peft != "none", PEFT_REFUSAL),
        (
            cfg.model.fused_cross_entropy == "true",
            "does not combine with --fused_cross_entropy true (the LM head is split); use false or auto",
        ),
        (
            cfg.model.liger_kernels is True,
            "does not combine with --liger_kernels true (its kernels are not tested on DTensor weights and "
            "activations); use false or auto",
        ),
        (t.mixed_precision == "fp16", "needs --mixed_precision bf16 or no (fp16's loss scaler is not wired here)"),
        (
            bool(cfg.model.model_config),
            "loads a saved model sharded, not one built from --model_config: save the model built from the config "
            "first (a one-process run of --max_steps 1) and pass its output folder to --model_name_or_path",
        ),
        (cfg.checkpoint.async_checkpointing, "does not combine with --async_checkpointing; leave it false"),
    ]
    for refused, why in refusals:
        if refused:
            raise UserError(f"{flag} {why}")
    check_model_divides(cfg, tp)


def supported_tasks() -> tuple[str, ...]:
    """The tasks that say their model is one decoder loaded as it is (`Task.tensor_parallel`)."""
    from cloudtrain.registry import TASKS as REGISTRY

    return tuple(task.name for task in REGISTRY if task.tensor_parallel)


def check_model_divides(cfg: Config, tp: int) -> None:
    """The model family has a plan in transformers, and its heads, KV heads and MLP width split evenly."""
    from cloudtrain.models.load import trained_config

    config = trained_config(cfg.model)
    family = getattr(config, "model_type", type(config).__name__)
    if not getattr(config, "base_model_tp_plan", None):
        raise UserError(
            f"--tensor_parallel_size: the {family} model family has no tensor-parallel plan in transformers; "
            "use --tensor_parallel_size 1 (data parallel, ZeRO or FSDP) or a family with one (Llama, Qwen, ...)"
        )
    sizes = {
        "attention heads": getattr(config, "num_attention_heads", None),
        "KV heads": getattr(config, "num_key_value_heads", None),
        "intermediate size": getattr(config, "intermediate_size", None),
    }
    for what, size in sizes.items():
        if size is not None and size % tp:
            raise UserError(
                f"--tensor_parallel_size {tp} does not divide the model's {what} ({size}); choose a divisor of {size}"
            )


def check_embeddings_fit(tokenizer: Any, config: Any, tp: int) -> None:
    """A task that talks through a chat template (sft) adds the template's special tokens to its tokenizer (set up
    by the task's check_options, which calls this); their embedding rows must be in the checkpoint already:
    transformers' resize_token_embeddings cannot grow a sharded model (the input embeddings and the LM head are
    split by vocabulary rows)."""
    rows = config.get_text_config().vocab_size
    if len(tokenizer) > rows:
        missing = ", ".join(tokenizer.convert_ids_to_tokens(list(range(rows, len(tokenizer)))))
        raise UserError(
            f"--tensor_parallel_size {tp}: the chat template's tokens ({missing}) have no embedding rows in the "
            f"model ({rows} rows), and a sharded model cannot grow them; grow them in one process first (a --task "
            "sft run without --tensor_parallel_size saves the model with them, e.g. --max_steps 1) and pass its "
            "output folder to --model_name_or_path, or use a model whose embeddings hold its chat template's tokens"
        )


def load_options(cfg: Config, processes: int) -> dict:
    """What from_pretrained needs to load the model sharded on the launch's (dp_replicate or dp_shard, tp) mesh."""
    tp = degree(cfg)
    if tp == 1:
        return {}
    from transformers.distributed import DistributedConfig

    dp = processes // tp
    if shards_states(cfg):  # 2-D: FSDP2 over the data-parallel dimension
        return {"distributed_config": DistributedConfig(tp_size=tp, fsdp_size=dp)}
    return {"distributed_config": DistributedConfig(tp_size=tp, dp_replicate_size=dp)}


class TensorParallelRuntime(GroupRuntime):
    """The accelerate runtime, told the (dp_replicate, tp) mesh: its loaders give a tensor-parallel group the
    same rows, and `gather` keeps each row once (from the first process of each group)."""

    dim = "tp"

    def __init__(self, accelerator: Accelerator, tp: int, data_parallel: str = "dp_replicate"):
        super().__init__(accelerator, tp, data_parallel)
        accelerator.state.device_mesh = self.data_mesh  # read by accelerate's prepare_data_loader

    def combine(self, grouped: torch.Tensor) -> torch.Tensor:
        return grouped[:, 0]


def launch_runtime(accelerator: Accelerator, cfg: Config) -> Runtime:
    if degree(cfg) == 1:
        return Runtime(accelerator)
    return TensorParallelRuntime(accelerator, degree(cfg), "dp_shard" if shards_states(cfg) else "dp_replicate")


def mixed_precision_forward(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """The forward under the launch's autocast (what accelerate's prepare would add to a model it wraps)."""
    if accelerator.mixed_precision == "no":
        return
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = autocast_forward  # type: ignore[method-assign]


def save_shards(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every process's shards of the weights and optimizer state (a collective: every process calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model, optimizer)
    dcp.save({"model": weights, "optim": optim}, checkpoint_id=str(folder / SHARDS))


def load_shards(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what `save_shards` wrote, with the same layout (Trainer.resume checks the mesh)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    weights, optim = get_state_dict(model, optimizer)
    dcp.load({"model": weights, "optim": optim}, checkpoint_id=str(folder / SHARDS))  # in place
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim)


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The whole model as plain CPU tensors on the main process ({} elsewhere), gathered one tensor at a time
    (a collective: every process calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@contextlib.contextmanager
def saved_as_one(model: torch.nn.Module) -> Iterator[None]:
    """save_pretrained with full tensors given: transformers must not gather them again (its gather is a
    collective the other processes would not join)."""
    config = getattr(model, "config", None)
    kept = getattr(config, "distributed_config", None)
    if config is not None:
        config.distributed_config = None
    try:
        yield
    finally:
        if config is not None:
            config.distributed_config = kept


def is_tensor_parallel(runtime: Runtime) -> bool:
    return isinstance(runtime, TensorParallelRuntime)


def tp_rank(runtime: Runtime) -> int:
    return runtime.group_rank if isinstance(runtime, TensorParallelRuntime) else 0
