"""FSDP2 through accelerate, the same on GPUs and on CPU (gloo): the plugin from the options, its layer classes.

accelerate shards with `torch.distributed.fsdp.fully_shard` (FSDP2): each repeated layer, then the input
embedding, the final norm with the head, then the root. cloudtrain builds the plugin itself (from the flags or
from an `accelerate launch` FSDP config) and chooses the layers to shard: the model's repeated blocks, never a
module that holds the input embedding (accelerate would shard that embedding twice, which fails). On a machine
with no GPU accelerate never enters its FSDP mode; `enable_on_cpu` puts its state there, so the CPU runs the
code path a GPU runs. See docs/distributed.md (FSDP2).
"""

import os
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from cloudtrain.config import Config
from cloudtrain.errors import UserError
from cloudtrain.models.embedding_noise import has_input_embeddings
from cloudtrain.parallel.mesh import Mesh

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
# what an `accelerate launch` FSDP config's sharding strategy names (FSDP1 numbers or names) mean here
LAUNCHER_STRATEGIES = {
    "1": "full_shard", "FULL_SHARD": "full_shard", "2": "shard_grad_op", "SHARD_GRAD_OP": "shard_grad_op",
    "3": "no_shard", "NO_SHARD": "no_shard", "4": "hybrid_shard", "HYBRID_SHARD": "hybrid_shard",
    "5": "hybrid_shard", "_HYBRID_SHARD_ZERO2": "hybrid_shard",
}  # fmt: skip


class LayerWrapPlugin(FullyShardedDataParallelPlugin):
    """accelerate's FSDP plugin, wrapping the model's repeated layers (`layer_classes`) unless told which."""

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        one_shared_embedding(model)
        if getattr(self, "transformer_cls_names_to_wrap", None) is None:
            self.transformer_cls_names_to_wrap = layer_classes(model)
        super().set_auto_wrap_policy(model)


def one_shared_embedding(model: torch.nn.Module) -> int:
    """Encoder-decoders (T5, BART) hold their shared input embedding as three modules tied by weight: the model's,
    the encoder's and the decoder's. FSDP2 keeps a parameter in one group and accelerate groups only the model's
    module, so the stacks are given that module itself; the forward is the same. Returns how many modules were
    replaced; a tied copy that computes differently is refused. (An adapter's wrapper of the embedding holds the
    weight in a module of its own, which is left as it is.)"""
    if not has_input_embeddings(model):  # a plain module of the user's, a diffusion model
        return 0
    shared = model.get_input_embeddings()  # type: ignore[operator]
    weight, own = getattr(shared, "weight", None), set(shared.modules())
    replaced = 0
    for path, parent in list(model.named_modules()):
        if parent in own:
            continue
        for name, child in list(parent.named_children()):
            if child in own or not isinstance(child, torch.nn.Embedding) or child.weight is not weight:
                continue
            if type(child) is not type(shared) or _settings(child) != _settings(shared):
                raise UserError(
                    f"--fsdp: {type(model).__name__}'s {path}.{name} shares the input embedding's weight but not "
                    "its class, settings or hooks, so FSDP2 cannot shard them as one; use --zero_stage 3 (or 1 or 2)"
                )
            setattr(parent, name, shared)
            replaced += 1
    return replaced


def _settings(module: torch.nn.Module) -> dict[str, Any]:
    """What an embedding computes with besides its weight (padding index, BART's scale) and its hooks."""
    hooks = (module._forward_hooks, module._forward_pre_hooks)
    public = {key: value for key, value in vars(module).items() if not key.startswith("_")}
    return {**public, "hooks": [list(h.values()) for h in hooks]}


def layer_classes(model: torch.nn.Module) -> list[str]:
    """The class names FSDP2 shards one unit each: the model's no-split blocks that hold no embedding (an
    embedding block would be sharded twice: as a block, then as the input embedding), else the class of the
    longest ModuleList's items."""
    named = {type(m).__name__: m for m in model.modules()}
    declared: set[str] = set()
    for module in model.modules():
        declared.update(getattr(module, "_no_split_modules", None) or [])
    blocks = [
        name
        for name in sorted(declared)
        if name in named and not any(isinstance(m, torch.nn.Embedding) for m in named[name].modules())
    ]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    lists = [m for m in lists if len({type(item) for item in m}) == 1]
    return [type(max(lists, key=len)[0]).__name__] if lists else []


def fsdp_settings(cfg: Config) -> dict[str, Any]:
    """The FSDP options of this launch: the flags, or what an `accelerate launch` FSDP config set (its variables)
    where the flag was left at its default."""
    from cloudtrain.config import differs_from_default

    d, env = cfg.distributed, os.environ
    strategy = d.fsdp_sharding_strategy
    if not differs_from_default(cfg, "fsdp_sharding_strategy") and "FSDP_SHARDING_STRATEGY" in env:
        strategy = LAUNCHER_STRATEGIES.get(env["FSDP_SHARDING_STRATEGY"].upper(), strategy)
    offload = d.fsdp_cpu_offload
    if not differs_from_default(cfg, "fsdp_cpu_offload") and "FSDP_OFFLOAD_PARAMS" in env:
        offload = env["FSDP_OFFLOAD_PARAMS"].lower() == "true"
    reshard = d.fsdp_reshard_after_forward
    if reshard is None and "FSDP_RESHARD_AFTER_FORWARD" in env and strategy != "shard_grad_op":
        reshard = env["FSDP_RESHARD_AFTER_FORWARD"].lower() in ("true", "1", "full_shard")
    if reshard is None:
        reshard = strategy != "shard_grad_op"
    return {"strategy": strategy, "cpu_offload": offload, "reshard_after_forward": reshard}


def shard_degrees(strategy: str, processes: int, per_node: int) -> tuple[int, int]:
    """(replicate, shard): full_shard and shard_grad_op shard over every process, hybrid_shard within a node
    (replicated across nodes), no_shard replicates the whole model on every process."""
    if strategy == "no_shard":
        return processes, 1
    if strategy == "hybrid_shard":
        per_node = max(1, min(per_node, processes))
        return processes // per_node, per_node
    return 1, processes


def mesh(cfg: Config, processes: int) -> Mesh:
    """The launch's mesh under FSDP: sharded over every process, or (hybrid_shard) within each node."""
    replicate, shard = shard_degrees(fsdp_settings(cfg)["strategy"], processes, processes_per_node())
    return Mesh(world=processes, dp_replicate=replicate, dp_shard=shard)


def processes_per_node() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def build_plugin(cfg: Config) -> LayerWrapPlugin:
    settings = fsdp_settings(cfg)
    return LayerWrapPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        state_dict_type="SHARDED_STATE_DICT",  # checkpoints: each process writes its shard (DCP)
        reshard_after_forward=settings["reshard_after_forward"],
        cpu_offload=offload_policy(settings["cpu_offload"]),
        cpu_ram_efficient_loading=False,  # every process loads the model: no meta-device round trip
        transformer_cls_names_to_wrap=_launcher_layer_classes(),
    )


def offload_policy(offload: bool) -> OffloadPolicy:
    """FSDP2's offload: the shards in (pinned, where there is a GPU to copy to) CPU memory, or kept on the device."""
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()


def _launcher_layer_classes() -> list[str] | None:
    names = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    return [name.strip() for name in names.split(",") if name.strip()] or None


def parallelism(cfg: Config, processes: int) -> ParallelismConfig | None:
    """The data-parallel mesh of a hybrid or unsharded launch (None: one shard dimension over every process)."""
    replicate, shard = shard_degrees(fsdp_settings(cfg)["strategy"], processes, processes_per_node())
    if replicate == 1:
        return None
    return ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard)


def enable(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin, cfg: Config) -> None:
    """The launch's data-parallel mesh (hybrid or unsharded), given to accelerate after it is built, the same on
    GPUs and CPU (accelerate would refuse it on CPU before its FSDP mode is on there)."""
    if accelerator.device.type == "cpu":
        enable_on_cpu(accelerator, plugin)
    config = parallelism(cfg, accelerator.num_processes)
    if config is not None:
        accelerator.state.parallelism_config = config
        accelerator.state.device_mesh = config.get_device_mesh(accelerator.device.type)
        config._validate_accelerator(accelerator)


def enable_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """accelerate enters its FSDP mode only on accelerator devices; on CPU it would silently run DDP. FSDP2's
    fully_shard runs on CPU with gloo, so the state is set as it would be on a GPU."""
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # each AcceleratorState() copies it
    state.fsdp_plugin = plugin
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)


def place_like(copy: torch.nn.Module, model: torch.nn.Module, device: torch.device) -> None:
    """A frozen `copy` of `model` (DPO's reference) put where the trainer put `model`: sharded over its mesh under
    FSDP2, as accelerate sharded it (each repeated layer one unit, then the rest, with the launch's precision and
    offload), else moved whole to `device`."""
    weight = next(model.parameters())
    if not isinstance(weight, DTensor):
        copy.to(device)
        return
    plugin = AcceleratorState().fsdp_plugin
    options: dict[str, Any] = {
        "mesh": weight.device_mesh,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "offload_policy": plugin.cpu_offload,
    }
    layers = set(getattr(plugin, "transformer_cls_names_to_wrap", None) or layer_classes(copy))
    for module in copy.modules():
        if type(module).__name__ in layers:
            fully_shard(module, **options)
    fully_shard(copy, **options)
    if PartialState().is_main_process:
        print(f"reference model: sharded as the policy, {len(layers)} layer class(es) a unit each", flush=True)
