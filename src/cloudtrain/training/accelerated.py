"""AcceleratedTrainer: the same loop through Hugging Face accelerate.

Differences from the BasicTrainer, and nothing else: `accelerator.prepare` places the model and
shards the data across processes, `accelerator.backward` handles mixed precision, `no_sync` skips
the gradient all-reduce on all but the last micro-batch of a window, `clip_grad_norm_` and
`gather_for_metrics` work across processes, and saving gathers the full state dict first.

Supports: everything cloudtrain.parallel.distributed sets up (one or many processes and nodes, DDP, DeepSpeed
ZeRO 0-3 with offload, FSDP on GPUs), fp16 (GPU) and bf16 mixed precision, gradient accumulation.
"""

import contextlib
import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
from accelerate.utils import (
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_NAME,
    SCALER_NAME,
    DistributedType,
    load,
    send_to_device,
)
from transformers import PreTrainedModel

from cloudtrain.async_save import cpu_copy, weights_snapshot
from cloudtrain.checkpointing import read_state
from cloudtrain.config import Config
from cloudtrain.data.processing import ProcessedData
from cloudtrain.errors import UserError
from cloudtrain.observe.tracking import RunLog
from cloudtrain.parallel import context, fsdp, sequence, tensor
from cloudtrain.parallel.distributed import build_accelerator, deepspeed_requested, fsdp_requested, sharding
from cloudtrain.parallel.mesh import Mesh
from cloudtrain.parallel.runtime import Runtime, join_launch
from cloudtrain.registry import TRAINERS
from cloudtrain.resume import load_failure
from cloudtrain.tasks.base import Task
from cloudtrain.training.meter import StepStats
from cloudtrain.training.trainer import Trainer, save_weights
from cloudtrain.training.weights import load_trainable_state, trainable_state, trains_everything

# how the run line names accelerate's distributed types (its own names: NO, MULTI_CPU, ...)
MODES = {"NO": "accelerate", "MULTI_CPU": "DDP", "MULTI_GPU": "DDP", "DEEPSPEED": "DeepSpeed", "FSDP": "FSDP2"}


@TRAINERS.register
class AcceleratedTrainer(Trainer):
    name = "accelerated"
    summary = "Hugging Face accelerate (DDP, DeepSpeed, FSDP)"
    own_options = ("tensor_parallel_size", "context_parallel_size")  # groups of processes over its device mesh

    @classmethod
    def mesh(cls, cfg: Config, processes: int) -> Mesh:
        """Tensor parallel groups (x replicas or FSDP shards); ZeRO (any stage) and FSDP shard the data-parallel
        processes' states; plain DDP replicates them."""
        shards = sharding(cfg)
        if context.degree(cfg) > 1:
            return context.context_mesh(cfg, processes)
        if tensor.degree(cfg) > 1:
            return tensor.tensor_mesh(cfg, processes)
        if shards.fsdp:
            return fsdp.mesh(cfg, processes)
        if shards.zero_stage:
            return Mesh(world=processes, dp_shard=processes)
        return super().mesh(cfg, processes)

    @classmethod
    def launch(cls, cfg: Config) -> Runtime:
        join_launch("cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo")  # before accelerate would
        accelerator = build_accelerator(cfg)
        if context.degree(cfg) > 1:
            runtime = context.launch_runtime(accelerator, cfg)
        else:  # a plain Runtime without --tensor_parallel_size
            runtime = tensor.launch_runtime(accelerator, cfg)
        runtime.set_collective_timeout(cfg.distributed.collective_timeout)
        return runtime

    def __init__(
        self, cfg: Config, task: Task, model: PreTrainedModel, data: ProcessedData, run_log: RunLog, runtime: Runtime
    ):
        super().__init__(cfg, task, model, data, run_log, runtime)
        if runtime.accelerator is None:
            raise ValueError("the AcceleratedTrainer needs a Runtime built with an Accelerator")
        accelerator = self.accelerator = runtime.accelerator  # built by cloudtrain.parallel.distributed for this launch
        kind = MODES.get(accelerator.distributed_type.value, accelerator.distributed_type.value)
        if self._zero_stage() is not None:
            kind += f" ZeRO-{self._zero_stage()}"
        parts = []
        self.tensor_parallel = tensor.is_tensor_parallel(runtime)
        if self.tensor_parallel:  # a group's processes take the same rows: the first one's enter the logged sums
            parts.append(f"tensor parallel {runtime.mesh.tp}" + (" x FSDP2" if runtime.mesh.dp_shard > 1 else ""))
            self.counts_batches = tensor.tp_rank(runtime) == 0
            self.step_collectives = "the tensor-parallel all-reduces, the gradient all-reduce"
        # context parallel: a group's processes take the same rows, each its slice of their tokens (`move`)
        self.context = runtime if isinstance(runtime, context.ContextParallelRuntime) else None
        if self.context:
            self.step_collectives = "the context-parallel all-to-alls, the gradient all-reduce"
            parts.append(f"context parallel {runtime.mesh.cp} (all-to-all)")
        self.mode = " ".join(parts if parts and kind in ("DDP", "accelerate") else [kind, *parts])  # what the run does

    @property
    def reshards_states(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.FSDP and not self.tensor_parallel

    @classmethod
    def async_refusal(cls, cfg: Config) -> str | None:
        """DDP and one process: each process copies its part of accelerate's files to CPU (`checkpoint_snapshot`).
        DeepSpeed's engine, FSDP and tensor-parallel shards are written by code that reads the live, sharded
        state as it writes (collectively for the first two), so they cannot be handed a CPU copy."""
        if deepspeed_requested(cfg):
            return "with DeepSpeed ZeRO (its engine writes the partitioned states collectively, from live tensors)"
        if fsdp_requested(cfg):
            return "with FSDP (the sharded states are written collectively from the live tensors)"
        if tensor.degree(cfg) > 1:
            return "with --tensor_parallel_size (each process's shards are written from the live model)"
        return None

    def setup(self) -> None:
        # The scheduler stays outside prepare(): the base loop steps it once per optimizer step.
        if self.tensor_parallel:  # the model was sharded as it loaded; only the loaders are accelerate's
            tensor.mixed_precision_forward(self.model, self.accelerator)
            self.train_dl, *loaders = self.accelerator.prepare(
                self.train_dl, *self.eval_dls.values(), *self.predict_dls.values()
            )
        elif self.context:  # the model first: FSDP2 shards over every process, not over the loaders' mesh
            sequence.use_group(self.context.cp_group)  # the model attends with it (models.prepare)
            self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
            self.context.share_rows()
            self.train_dl, *loaders = self.accelerator.prepare(
                self.train_dl, *self.eval_dls.values(), *self.predict_dls.values()
            )
        else:
            self.model, self.optimizer, self.train_dl, *loaders = self.accelerator.prepare(
                self.model, self.optimizer, self.train_dl, *self.eval_dls.values(), *self.predict_dls.values()
            )
        self.runtime.set_collective_timeout(self.cfg.distributed.collective_timeout)  # groups prepare() made
        self.eval_dls = dict(zip(self.eval_dls, loaders[: len(self.eval_dls)], strict=True))
        self.predict_dls = dict(zip(self.predict_dls, loaders[len(self.eval_dls) :], strict=True))
        # adapters: checkpoints hold the trainable weights only (DeepSpeed is told in save/load_state; FSDP
        # saves its own way, whole)
        self.partial = not trains_everything(self.model)
        self.sharded = self.accelerator.distributed_type == DistributedType.FSDP or self._zero_stage() == 3
        # what clipping walks each step: the trainable parameters (a diffusion pipeline has hundreds of frozen
        # ones); FSDP keeps the model's own list, by which accelerate recognises its path
        fsdp = self.accelerator.distributed_type == DistributedType.FSDP
        self.clipped = (
            list(self.model.parameters()) if fsdp else [p for p in self.model.parameters() if p.requires_grad]
        )
        if self.partial and self.accelerator.distributed_type in (
            DistributedType.NO,
            DistributedType.MULTI_CPU,
            DistributedType.MULTI_GPU,
        ):
            self.accelerator.register_save_state_pre_hook(self._keep_trainable)
            self.accelerator.register_load_state_pre_hook(self._load_trainable)

    def move(self, batch: dict) -> dict:
        """Stored batches come placed by accelerate's prepared loader; a stream's loader is not accelerate's
        (cloudtrain.data.streaming): its host batches are placed here as accelerate places the others. Under
        context parallelism each process keeps its slice of the rows' tokens (cloudtrain.parallel.context): the
        one place a batch is cut, for training and evaluation alike."""
        if self.streams:
            batch = send_to_device(batch, self.accelerator.device, non_blocking=True)
        return self.context.cut(batch) if self.context else batch

    @staticmethod
    def _keep_trainable(models: list, weights: list, folder: str) -> None:
        for i, model in enumerate(models):
            names = trainable_state(model)
            weights[i] = {name: tensor for name, tensor in weights[i].items() if name in names}

    @staticmethod
    def _load_trainable(models: list, folder: str) -> None:
        for i, model in enumerate(models):
            name = SAFE_WEIGHTS_NAME if i == 0 else SAFE_WEIGHTS_NAME.replace(".", f"_{i}.")
            device = str(next(model.parameters()).device)
            load_trainable_state(model, safetensors.torch.load_file(Path(folder) / name, device=device))
        models.clear()  # loaded: accelerate must not load them again, strictly

    def autocast(self):
        # prepare() wrapped the model's forward in autocast, but not what runs around it: a task's loss with matmuls
        # of its own (the fused cross-entropy's head), and what generate() calls underneath (a PEFT base model)
        return self.accelerator.autocast()

    def backward_window(self, window: list[dict], scale: torch.Tensor) -> StepStats:
        accelerator, k = self.accelerator, self.cfg.training.gradient_accumulation_steps
        loss_sum: Any = 0  # tensors from the first batch on (a window is never empty)
        count: Any = 0
        for i, batch in enumerate(window):
            last = i == len(window) - 1
            accelerator.sync_gradients = last  # the accumulation boundary (DeepSpeed steps here)
            with contextlib.nullcontext() if last else accelerator.no_sync(self.model):
                with self.clock.forward(), self.autocast():
                    summed, n = self.task.loss(self.model, batch)
                accelerator.backward(summed * scale * k)  # backward() divides by k; the scale is already exact
            loss_sum, count = loss_sum + summed.detach(), count + n
        grad_norm = None
        if self.cfg.training.max_grad_norm > 0:
            grad_norm = accelerator.clip_grad_norm_(self.clipped, self.cfg.training.max_grad_norm)
        return StepStats(loss_sum=loss_sum, count=count, grad_norm=grad_norm)

    def apply_step(self, bad: torch.Tensor) -> None:
        if self.accelerator.state.deepspeed_plugin:
            # The engine already stepped in backward(), or skipped a step with non-finite gradients on every
            # rank itself (its overflow check; cloudtrain.parallel.distributed refuses the set-ups where it has none).
            self.optimizer_step()
        else:
            super().apply_step(bad)

    def optimizer_step(self) -> None:
        self.optimizer.step()  # under DeepSpeed a no-op: the engine stepped in backward()
        self.optimizer.zero_grad(set_to_none=True)

    def store_per_node(self) -> None:
        self.accelerator.project_configuration.save_on_each_node = True  # weights, optimizer, scheduler
        if self.accelerator.state.deepspeed_plugin:  # the model states file, on each node's local rank 0
            config = self.accelerator.state.deepspeed_plugin.deepspeed_config
            config.setdefault("checkpoint", {})["use_node_local_storage"] = True

    def write_checkpoint(self, folder: Path) -> None:
        frozen = {"exclude_frozen_parameters": True} if self.partial and self.accelerator.state.deepspeed_plugin else {}
        self.accelerator.save_state(
            str(folder), **frozen
        )  # model (safetensors), optimizer, scaler, RNG of every process
        if self.tensor_parallel:  # every process's shards of weights and optimizer state
            tensor.save_shards(folder, self.model, self.optimizer)
        if self.checkpoint_owner:
            torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")

    def checkpoint_snapshot(self) -> Callable[[Path], None]:
        """CPU copies of the files `write_checkpoint` writes under DDP or one process (accelerate's save_state:
        the model and optimizer by the process that writes shared files, the RNG states by each), taken now."""
        accelerator = self.accelerator
        if accelerator._custom_objects:  # cloudtrain registers none; their files would be missing
            raise ValueError("checkpoint_snapshot does not copy accelerate's registered custom objects")
        state = accelerator.state
        on_each_node = accelerator.project_configuration.save_on_each_node
        shared = state.is_local_main_process if on_each_node else state.is_main_process  # as accelerate's `save`
        weights: list[dict] = []
        optimizers: list[dict] = []
        scaler = None
        if shared:
            live = [accelerator.get_state_dict(model, unwrap=False) for model in accelerator._models]
            for hook in accelerator._save_model_state_pre_hook.values():
                hook(accelerator._models, live, "")  # adapters: the trainable weights only (`_keep_trainable`)
            weights = [weights_snapshot(state_dict)[0] for state_dict in live]
            optimizers = [cpu_copy(optimizer.state_dict()) for optimizer in accelerator._optimizers]
            scaler = cpu_copy(accelerator.scaler.state_dict()) if accelerator.scaler else None
        samplers = {i: copy.deepcopy(sampler) for i, sampler in _saved_samplers(accelerator._dataloaders)}
        rng = cpu_copy(_accelerate_rng_state(accelerator.step))
        schedule = cpu_copy(self.scheduler.state_dict()) if self.checkpoint_owner else None
        index = state.process_index

        def write(folder: Path) -> None:
            for i, tensors in enumerate(weights):
                name = SAFE_WEIGHTS_NAME if i == 0 else SAFE_WEIGHTS_NAME.replace(".", f"_{i}.")
                safetensors.torch.save_file(tensors, str(folder / name), metadata={"format": "pt"})
            for i, optimizer in enumerate(optimizers):
                torch.save(optimizer, folder / (f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"))
            for i, sampler in samplers.items() if shared else ():
                torch.save(sampler, folder / ("sampler.bin" if i == 0 else f"sampler_{i}.bin"))
            if scaler is not None:
                torch.save(scaler, folder / SCALER_NAME)
            torch.save(rng, folder / f"{RNG_STATE_NAME}_{index}.pkl")
            if schedule is not None:
                torch.save(schedule, folder / "scheduler.pt")

        return write

    def check_resume_files(self, folder: Path) -> None:
        """Every process's RNG states readable, agreed before any loads (accelerate skips a missing or damaged
        one with an info-level log, and the resume then draws other dropout and noise than the run that
        stopped); one line on every process, so none waits inside a sharded load for one that stopped."""
        problem = _rng_states_problem(folder, self.accelerator.process_index)
        problems = [p for p in self.runtime.gather_objects(problem) if p]
        if problems:
            raise UserError(problems[0], quiet=not self.is_main_process)

    def load_checkpoint(self, folder: Path) -> None:
        frozen = {"load_module_strict": False} if self.partial and self.accelerator.state.deepspeed_plugin else {}
        self.accelerator.load_state(str(folder), **frozen)
        if self.tensor_parallel:
            tensor.load_shards(folder, self.model, self.optimizer)
        self.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))

    def _zero_stage(self) -> int | None:
        plugin = self.accelerator.state.deepspeed_plugin
        return plugin.zero_stage if plugin else None

    def save_model(self, output_dir: Path) -> None:
        if self.tensor_parallel:  # every rank gathers; the main process writes the full tensors
            full = tensor.full_state_dict(self.model)
            with tensor.saved_as_one(self.model):
                if self.is_main_process:
                    save_weights(self.model, output_dir, state_dict=full)
            self.accelerator.wait_for_everyone()
            return
        # every rank: ZeRO-3 and FSDP gather here; unsharded adapters need nothing gathered (PEFT takes its few MB)
        state_dict = None if self.partial and not self.sharded else self.accelerator.get_state_dict(self.model)
        masters = self._fp32_masters()  # every rank: DeepSpeed's trained fp32 weights behind its 16-bit module
        if self.is_main_process:
            module = self.accelerator.unwrap_model(self.model)
            if masters:
                state_dict = {**(module.state_dict() if state_dict is None else state_dict), **masters}
            save_weights(module, output_dir, state_dict=state_dict)
            if masters and (output_dir / "config.json").is_file():  # its dtype is the 16-bit module's: say fp32
                config = json.loads((output_dir / "config.json").read_text())
                config["dtype"] = "float32"
                (output_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        self.accelerator.wait_for_everyone()

    def _fp32_masters(self) -> dict[str, torch.Tensor]:
        """Under DeepSpeed with bf16 or fp16 the module holds 16-bit copies and the optimizer the fp32 weights it
        trains: those, by name, on the main process (each one gathered from every process), so the saved model is
        fp32 as every other launch saves it. Empty otherwise."""
        if self._zero_stage() is None or self.cfg.training.mixed_precision not in ("bf16", "fp16"):
            return {}
        from deepspeed.utils import safe_get_full_fp32_param

        masters = {}
        for name, parameter in self.accelerator.unwrap_model(self.model).named_parameters():
            if parameter.requires_grad and (full := safe_get_full_fp32_param(parameter)) is not None:
                if self.is_main_process:
                    masters[name] = full.detach().float().cpu()
        return masters


def _rng_states_problem(folder: Path, index: int) -> str | None:
    """Why process `index` cannot read its RNG states from checkpoint `folder` (None: it can, or, beyond the
    processes that wrote it, has none to read)."""
    if index >= int(read_state(folder).get("num_processes", 1)):
        return None
    try:
        load(folder / f"{RNG_STATE_NAME}_{index}.pkl")
    except Exception as err:  # noqa: BLE001 (a missing file, or any unpickling error of a damaged one)
        return str(load_failure(folder, err))
    return None


def _saved_samplers(dataloaders: list) -> list[tuple[int, Any]]:
    """(loader index, sampler) of what accelerate's save_state writes as sampler_<index>.bin: the samplers of
    sharded iterable datasets. A stateful loader's state it writes too is refused: cloudtrain makes none."""
    found = []
    for i, loader in enumerate(dataloaders):
        if getattr(loader, "use_stateful_dataloader", False):
            raise ValueError("checkpoint_snapshot does not copy a stateful data loader's state")
        if isinstance(loader.dataset, IterableDatasetShard):
            sampler = loader.get_sampler()
            if isinstance(sampler, SeedableRandomSampler):
                found.append((i, sampler))
    return found


def _accelerate_rng_state(step: int) -> dict:
    """This process's RNG states as accelerate's save_state writes them (random_states_<index>.pkl)."""
    state = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return state
