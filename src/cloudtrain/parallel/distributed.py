"""Distributed set-up, in one place: the Accelerator for this launch on this machine.

Launchers: plain `python` (1 process), `torchrun --nproc_per_node N`, `accelerate launch` (with or
without `--config_file configs/accelerate/*.yaml`), several nodes, SageMaker (torchrun). Modes:
- DDP: NCCL on GPUs; on a machine with no GPU, gloo (accelerate's MULTI_CPU), whatever the launcher
  said, so `--multi_gpu` on a laptop still gives cooperating processes.
- DeepSpeed ZeRO 0-3 through DeepSpeedPlugin, from `--zero_stage`/`--offload_*`, from a user's JSON
  (`--deepspeed_config`, or `deepspeed_config_file` in an accelerate config), or from an accelerate
  config's `deepspeed_config` section. The JSON's "auto" values are filled from the application's
  options; values that disagree with them are an error naming both. With no GPU, gloo is passed
  explicitly (never `cpu=True`, which makes accelerate drop DeepSpeed).
- FSDP2 (torch's fully_shard) through accelerate's FSDP plugin, built by cloudtrain.parallel.fsdp from the
  --fsdp_* flags or an accelerate FSDP config; on GPUs, and on CPU processes (gloo), where accelerate's FSDP
  mode is switched on explicitly (it would otherwise silently run DDP).
- A user JSON may carry its own `optimizer` and `scheduler` sections: DeepSpeed then builds them (the
  optimizer from accelerate's placeholder, cloudtrain.training.optim), their "auto" values filled from
  --learning_rate, --weight_decay, --warmup_steps and --max_steps; --optim or schedule options given
  beside them are refused, since one of the two would be silently ignored. A file with one of the two takes
  the other from the options, as HF Trainer does: only `optimizer`: --lr_scheduler_type drives the engine's
  optimizer (cloudtrain.training.optim builds it after prepare()); only `scheduler`: the engine steps the
  file's schedule over --optim's optimizer.
Tensor parallelism: cloudtrain.parallel.tensor (the model sharded as it loads); context parallelism:
cloudtrain.parallel.context (each process a slice of every row's tokens); pipelines: --training_type pipeline.
Not supported: Megatron-LM.
"""

import contextlib
import copy
import importlib.util
import io
import json
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
)

from cloudtrain import invocation
from cloudtrain.config import Config, differs_from_default
from cloudtrain.config.checks import engine_conflicts
from cloudtrain.errors import UserError, refuse_first
from cloudtrain.invocation import check_launcher_variables
from cloudtrain.parallel.fsdp import build_plugin, fsdp_settings, processes_per_node, shard_degrees
from cloudtrain.parallel.fsdp import enable as enable_fsdp
from cloudtrain.paths import check_deepspeed_config

DEEPSPEED_INSTALL = "pip install --no-build-isolation deepspeed==0.19.8 (or `make setup`)"
# What building a run's Accelerator writes into (or takes out of) the environment, where the next Accelerator of
# the same process (cloudtrain.train again) would read it as a launcher's request
ACCELERATE_FLAGS = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_CONFIG_DS_FIELDS")


# torch 2.13's FutureWarning for DDP's broadcast_buffers=False (below), a screen of text on every process of every
# multi-process run; the option does what it did (see accelerator())
warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def launched_processes() -> int:
    """How many processes the launcher started (torchrun, accelerate launch, SageMaker all set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def zero_config(
    stage: int, offload_optimizer: str = "none", offload_param: str = "none", nvme: dict | None = None
) -> dict:
    """A DeepSpeed config for one ZeRO stage; "auto" values are filled from the application's options. `nvme`
    (nvme_path, block_size, queue_depth) places offloaded states on a local disk (ZeRO-Infinity)."""
    zero: dict = {"stage": stage, "overlap_comm": stage > 0, "contiguous_gradients": stage > 0}
    if offload_optimizer != "none":
        zero["offload_optimizer"] = offload_target(offload_optimizer, nvme)
    if stage == 3:
        if offload_param != "none":
            zero["offload_param"] = offload_target(offload_param, nvme)
        zero.update(
            stage3_gather_16bit_weights_on_model_save=True,
            stage3_param_persistence_threshold="auto",
            stage3_prefetch_bucket_size="auto",
            reduce_bucket_size="auto",
        )
    extra = {"aio": aio_config(nvme)} if nvme and "nvme" in (offload_optimizer, offload_param) else {}
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        **extra,
    }


def offload_target(device: str, nvme: dict | None) -> dict:
    """DeepSpeed's offload section: CPU memory (pinned), or swap files under nvme_path."""
    if device != "nvme":
        return {"device": device, "pin_memory": True}
    assert nvme is not None  # DistributedConfig.check: nvme needs --nvme_path
    return {"device": "nvme", "nvme_path": nvme["nvme_path"], "pin_memory": False}


def aio_config(nvme: dict) -> dict:
    """DeepSpeed's async I/O settings for the NVMe swap files."""
    return {
        "block_size": nvme["block_size"],
        "queue_depth": nvme["queue_depth"],
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    }


def nvme_settings(cfg: Config) -> dict | None:
    d = cfg.distributed
    if not d.nvme_path:
        return None
    return {"nvme_path": d.nvme_path, "block_size": d.aio_block_size, "queue_depth": d.aio_queue_depth}


def requested_deepspeed(cfg: Config) -> tuple[str, dict] | None:
    """(where it came from, the DeepSpeed config as given) or None; flags win over the launcher's config."""
    d = cfg.distributed
    json_file = d.deepspeed_config or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if json_file != "none":
        return json_file, _read_json(json_file)
    if d.zero_stage is not None:
        return "--zero_stage", zero_config(d.zero_stage, d.offload_optimizer, d.offload_param, nvme_settings(cfg))
    if env_flag("ACCELERATE_USE_DEEPSPEED"):
        stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        return "the accelerate config", zero_config(
            stage,
            os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
            os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none"),
        )
    return None


@dataclass(frozen=True)
class Sharding:
    """How a launch shards the model: from the flags, a DeepSpeed JSON or the accelerate config."""

    zero_stage: int | None = None  # None: no DeepSpeed
    offload_optimizer: bool = False
    offload_param: bool = False
    fsdp: bool = False


def sharding(cfg: Config) -> Sharding:
    requested = requested_deepspeed(cfg)
    if requested is None:
        return Sharding(fsdp=fsdp_shards(cfg))
    zero = requested[1].get("zero_optimization", {})

    def offloaded(key: str) -> bool:
        return (zero.get(key) or {}).get("device", "none") not in ("none", None)

    return Sharding(int(zero.get("stage", 0)), offloaded("offload_optimizer"), offloaded("offload_param"))


def _read_json(path: str) -> dict:
    check_deepspeed_config(path)
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"DeepSpeed config {path} is not valid JSON: {err}") from None


def resolve_deepspeed_config(source: str, given: dict, cfg: Config, world_size: int) -> dict:
    """Fill the "auto" values we own from the options; a value that disagrees with them is an error."""
    t = cfg.training
    ours = {
        ("train_micro_batch_size_per_gpu",): (t.per_device_train_batch_size, "--per_device_train_batch_size"),
        ("gradient_accumulation_steps",): (t.gradient_accumulation_steps, "--gradient_accumulation_steps"),
        ("train_batch_size",): (
            t.per_device_train_batch_size * t.gradient_accumulation_steps * world_size,
            "per-device batch x accumulation x processes",
        ),
        ("gradient_clipping",): (t.max_grad_norm, "--max_grad_norm"),
        ("fp16", "enabled"): (t.mixed_precision == "fp16", "--mixed_precision"),
        ("bf16", "enabled"): (t.mixed_precision == "bf16", "--mixed_precision"),
    }
    batch_keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    if t.per_device_train_batch_size == "auto":  # found after the model loads; set_batch fills them in then
        fixed = [key for key in batch_keys if given.get(key, "auto") != "auto"]
        if fixed:
            raise UserError(
                f"DeepSpeed config ({source}) fixes {', '.join(fixed)}, which --per_device_train_batch_size auto "
                'chooses; set them to "auto" or give a number'
            )
        ours = {keys: value for keys, value in ours.items() if keys[0] not in batch_keys}
    resolved = copy.deepcopy(given)
    for keys, (value, flag) in ours.items():
        parent = resolved
        for key in keys[:-1]:
            parent = parent.setdefault(key, {})
        current = parent.get(keys[-1], "auto")
        if current != "auto" and current != value:
            name = ".".join(keys)
            raise UserError(
                f"DeepSpeed config ({source}) sets {name} = {json.dumps(current)} but {flag} gives "
                f'{json.dumps(value)}; make them agree or set {name} to "auto"'
            )
        parent[keys[-1]] = value
    zero = resolved.setdefault("zero_optimization", {})
    stage = cfg.distributed.zero_stage
    if stage is not None and zero.get("stage", stage) != stage:
        raise UserError(
            f"DeepSpeed config ({source}) sets zero_optimization.stage = {zero['stage']} but "
            f"--zero_stage is {stage}; make them agree"
        )
    check_own_sections(source, resolved, cfg)
    fill_own_sections(source, resolved, cfg)
    if zero.get("stage") == 3:  # the final model must be the gathered full model
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    resolved.setdefault("zero_force_ds_cpu_optimizer", False)  # torch AdamW with offload is fine
    return resolved


def deepspeed_sections(cfg: Config) -> set[str]:
    """Which of `optimizer` and `scheduler` the launch's DeepSpeed JSON defines itself (DeepSpeed builds them)."""
    requested = requested_deepspeed(cfg)
    return {key for key in ("optimizer", "scheduler") if requested and key in requested[1]}


# the options a section of the user's JSON takes over: given beside it, one of the two would be ignored
SECTION_OPTIONS = {
    "optimizer": ("optim", "adamw_implementation"),
    "scheduler": ("lr_scheduler_type", "min_lr_ratio", "decay_ratio", "polynomial_power"),
}


def check_own_sections(source: str, ds_config: dict, cfg: Config) -> None:
    """Refuse an option that a section of the JSON takes over; DeepSpeed's optimizer needs whole-parameter
    optimizers no more than cloudtrain's does, so only the contradiction is refused."""
    for section, options in SECTION_OPTIONS.items():
        given = [name for name in options if section in ds_config and differs_from_default(cfg, name)]
        if given:
            raise UserError(
                f"DeepSpeed config ({source}) has its own {section} section, which --{given[0]} would contradict; "
                f"drop --{given[0]} or the section"
            )


def fill_own_sections(source: str, ds_config: dict, cfg: Config) -> None:
    """The "auto" values of the JSON's optimizer and scheduler params, from the options; an explicit value
    wins unless the option was also given with another value (then both are named)."""
    t = cfg.training
    warmup = t.warmup_steps
    if warmup is None and t.max_steps is not None:
        warmup = round(t.warmup_ratio * t.max_steps)
    ours: dict[str, dict[str, tuple]] = {
        "optimizer": {"lr": (t.learning_rate, "learning_rate"), "weight_decay": (t.weight_decay, "weight_decay")},
        "scheduler": {
            "warmup_max_lr": (t.learning_rate, "learning_rate"),
            "warmup_min_lr": (0.0, None),
            "warmup_num_steps": (warmup, "warmup_ratio" if t.warmup_steps is None else "warmup_steps"),
            "total_num_steps": (t.max_steps, "max_steps"),
        },
    }
    for section, values in ours.items():
        params = ds_config.get(section, {}).get("params", {})
        for key, current in params.items():
            value, flag = values.get(key, (None, None))
            if current == "auto" and value is None:
                raise UserError(
                    f'DeepSpeed config ({source}) leaves {section}.params.{key} "auto", which no option fills '
                    f"here; give it a value{' or pass --' + flag if flag else ''}"
                )
            if current == "auto":
                params[key] = value
            elif flag and differs_from_default(cfg, flag) and current != value:
                raise UserError(
                    f"DeepSpeed config ({source}) sets {section}.params.{key} = {json.dumps(current)} but "
                    f'--{flag} gives {json.dumps(value)}; make them agree or set {key} to "auto"'
                )


def check_deepspeed_skips(source: str, ds_config: dict, precision: str) -> None:
    """--nonfinite_loss skip under DeepSpeed relies on the engine's own overflow check (it steps inside
    backward, before the loop sees the loss): refuse the set-ups in which the engine has none."""
    zero = ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    fix = "use --nonfinite_loss stop, or"
    if stage == 0 and precision == "no":
        raise UserError(
            f"--nonfinite_loss skip: DeepSpeed ZeRO-0 in fp32 applies a step with nan/inf gradients; "
            f"{fix} --zero_stage 1, 2 or 3, or bf16"
        )
    if stage in (1, 2) and precision == "bf16" and ds_config.get("bf16", {}).get("check_grad_overflow") is False:
        raise UserError(
            f"--nonfinite_loss skip: DeepSpeed config ({source}) sets bf16.check_grad_overflow = false, "
            f"so nan/inf steps would be applied; {fix} remove that setting"
        )
    if stage in (1, 2) and precision == "no" and zero.get("compute_grad_norm") is False:
        raise UserError(
            f"--nonfinite_loss skip: DeepSpeed config ({source}) sets zero_optimization.compute_grad_norm "
            f"= false, so nan/inf steps would be applied; {fix} remove that setting"
        )


def deepspeed_requested(cfg: Config) -> bool:
    d = cfg.distributed
    return d.zero_stage is not None or bool(d.deepspeed_config) or env_flag("ACCELERATE_USE_DEEPSPEED")


def fsdp_requested(cfg: Config) -> bool:
    return cfg.distributed.fsdp or env_flag("ACCELERATE_USE_FSDP")


def fsdp_shards(cfg: Config) -> bool:
    """FSDP was asked for and shards: no_shard (and hybrid_shard with one process per node) replicates the whole
    model on every process, which is DDP."""
    if not fsdp_requested(cfg):
        return False
    strategy, processes = fsdp_settings(cfg)["strategy"], launched_processes()
    _, shard = shard_degrees(strategy, processes, processes_per_node())
    return strategy != "no_shard" and (shard > 1 or processes == 1)


def split_refusals(cfg: Config, degree: int, processes: int) -> list[tuple[bool, str]]:
    """The refusals tensor and context parallelism share (a degree splitting the model or its rows over groups
    of `degree` processes): (refused, why) pairs, each `why` following the option's flag."""
    t = cfg.training
    return [
        (
            processes % degree != 0,
            f"needs a multiple of {degree} processes, and this launch has {processes}: launch with torchrun "
            f"--nproc_per_node {degree} (or {2 * degree}, ...)",
        ),
        (deepspeed_requested(cfg), "does not combine with DeepSpeed ZeRO; drop --zero_stage/--deepspeed_config"),
        (
            fsdp_requested(cfg) and not cfg.distributed.fsdp,
            "shards with FSDP through --fsdp true, not through an accelerate FSDP config",
        ),
        (t.torch_compile, "does not combine with --torch_compile yet; leave it false"),
        (t.per_device_train_batch_size == "auto", "needs a number for --per_device_train_batch_size, not auto"),
        (cfg.data.streaming, "does not combine with --streaming yet; use stored rows"),
    ]


@contextlib.contextmanager
def launch_environment_kept() -> Iterator[None]:
    """A run's changes to accelerate's flags (`ACCELERATE_FLAGS`) undone when it ends: accelerate sets
    ACCELERATE_USE_FSDP/_DEEPSPEED when handed a plugin, and the process's next run would otherwise find FSDP or
    DeepSpeed asked for by the launcher."""
    before = {name: os.environ.get(name) for name in ACCELERATE_FLAGS}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_distributed(cfg: Config) -> None:
    """Cheap checks of the distributed options, before anything is loaded."""
    from cloudtrain.parallel.context import check_context_parallel
    from cloudtrain.parallel.tensor import check_tensor_parallel
    from cloudtrain.registry import TRAINERS
    from cloudtrain.training.optim import check_optimizer

    check_optimizer(cfg)  # the device the optimizer needs: refused here, in preflight, with the launch's checks
    check_launcher_variables()  # the command line checked it already; the Python API comes here first
    d = cfg.distributed
    wants_deepspeed, wants_fsdp = deepspeed_requested(cfg), fsdp_requested(cfg)
    launcher_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    follows_launcher = TRAINERS[cfg.training.training_type].follows_launcher
    if follows_launcher and launcher_precision not in ("no", cfg.training.mixed_precision):
        raise UserError(
            f"the accelerate config asks for {launcher_precision} mixed precision but --mixed_precision "
            f"is {cfg.training.mixed_precision}; pass --mixed_precision {launcher_precision}"
        )
    refuse_first(engine_conflicts(cfg, wants_deepspeed, wants_fsdp))  # (the options alone: config.validate)
    if wants_deepspeed:
        if importlib.util.find_spec("deepspeed") is None:
            raise UserError(f"DeepSpeed was requested but the deepspeed package is not installed: {DEEPSPEED_INSTALL}")
        if d.nvme_path:
            check_nvme(Path(d.nvme_path))
        if env_flag("ACCELERATE_USE_CPU"):
            raise UserError(
                "ACCELERATE_USE_CPU=true makes accelerate drop DeepSpeed; unset it "
                "(cloudtrain picks the gloo backend itself on a machine with no GPU)"
            )
        requested = requested_deepspeed(cfg)
        assert requested is not None  # what wants_deepspeed checked
        source, given = requested
        resolved = resolve_deepspeed_config(source, given, cfg, launched_processes())
        if cfg.checkpoint.nonfinite_loss == "skip":
            check_deepspeed_skips(source, resolved, cfg.training.mixed_precision)
        if "WORLD_SIZE" not in os.environ and not torch.cuda.is_available():
            raise UserError(
                "DeepSpeed on CPU needs a launcher to start its process group: torchrun --nproc_per_node N "
                f"{' '.join(invocation.launch_target())} ... (or accelerate launch), also for one process"
            )
    check_tensor_parallel(cfg, launched_processes())  # cloudtrain.parallel.tensor: each refusal in one line
    check_context_parallel(cfg, launched_processes())  # cloudtrain.parallel.context: each refusal in one line
    check_fsdp_launch(cfg)


def check_fsdp_launch(cfg: Config) -> None:
    """FSDP shards over a process group, which a launcher starts (plain `python` would train unsharded)."""
    if fsdp_requested(cfg) and "WORLD_SIZE" not in os.environ:
        raise UserError(
            "FSDP needs a launcher to start its process group: torchrun --nproc_per_node N "
            f"{' '.join(invocation.launch_target())} ... (or accelerate launch), also for one process"
        )


def set_batch(accelerator: Accelerator, micro_batch: int, accumulation: int) -> None:
    """A micro-batch and accumulation chosen after the Accelerator was built, before `prepare`."""
    accelerator.gradient_accumulation_steps = accumulation
    plugin = accelerator.state.deepspeed_plugin
    if plugin:
        plugin.gradient_accumulation_steps = accumulation
        plugin.deepspeed_config.update(
            train_micro_batch_size_per_gpu=micro_batch,
            gradient_accumulation_steps=accumulation,
            train_batch_size=micro_batch * accumulation * accelerator.num_processes,
        )


def build_accelerator(cfg: Config) -> Accelerator:
    """The Accelerator for this launch; refuses a launch whose processes did not form one group."""
    t, gpu = cfg.training, torch.cuda.is_available()
    deepspeed = requested_deepspeed(cfg)
    plugin = None
    if deepspeed:
        clear_stale_build_locks()  # DeepSpeed compiles its ops as it starts
        ds_config = resolve_deepspeed_config(*deepspeed, cfg, launched_processes())
        zero = ds_config["zero_optimization"]
        # The launcher's deepspeed_config fields are folded into ds_config already; without this,
        # accelerate refuses a full config dict next to them.
        os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
        plugin = DeepSpeedPlugin(
            hf_ds_config=ds_config,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            gradient_clipping=t.max_grad_norm,
            zero_stage=zero.get("stage", 0),
            zero3_init_flag=zero.get("stage") == 3,
            zero3_save_16bit_model=zero.get("stage3_gather_16bit_weights_on_model_save"),
        )
    tensor_parallel = cfg.distributed.tensor_parallel_size > 1  # TP x FSDP2: transformers wraps the model instead
    fsdp = build_plugin(cfg) if fsdp_shards(cfg) and not tensor_parallel else None
    if fsdp_requested(cfg) and fsdp is None:  # no_shard: DDP, also where an accelerate config asked for FSDP
        os.environ.pop("ACCELERATE_USE_FSDP", None)
    accelerator = Accelerator(
        mixed_precision=t.mixed_precision,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        deepspeed_plugin=plugin,
        fsdp_plugin=fsdp,
        cpu=not gpu and plugin is None,  # no GPU: accelerate's MULTI_CPU path, which uses gloo
        dataloader_config=DataLoaderConfiguration(non_blocking=True),  # with pinned loaders: the host never waits
        kwargs_handlers=[
            *([InitProcessGroupKwargs(backend="gloo")] if plugin and not gpu else []),
            # A transformer's buffers (position ids, rotary frequencies) never change: DDP need not broadcast them
            # before every forward, and without that collective a forward pass times only this process's work.
            # (torch 2.13 names it forward_sync_buffers and warns on every process; accelerate passes the old
            # name, which torch 2.11 and later all take)
            DistributedDataParallelKwargs(broadcast_buffers=False),
        ],
    )
    if fsdp is not None:
        enable_fsdp(accelerator, fsdp, cfg)
    if accelerator.num_processes != launched_processes():
        raise UserError(
            f"the launcher started {launched_processes()} processes but they did not join one "
            f"process group (each sees {accelerator.num_processes}); they would train unsynchronised. "
            "Launch with torchrun or `accelerate launch --multi_gpu --num_processes N`"
        )
    if not accelerator.is_main_process:  # only the main process prints library progress and warnings
        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    return accelerator


def check_nvme(path: Path) -> None:
    """ZeRO-Infinity's swap folder is writable and DeepSpeed's async I/O op can be built (it needs libaio)."""
    from cloudtrain.publish.atomic import check_writable

    try:
        check_writable(path)
    except UserError as err:
        raise UserError(str(err).replace("--output_dir", "--nvme_path")) from None
    from deepspeed.ops.op_builder import AsyncIOBuilder

    with contextlib.redirect_stdout(io.StringIO()):  # its verbose report goes to stdout
        compatible = AsyncIOBuilder().is_compatible(verbose=False)
    if not compatible:
        raise UserError(
            "--offload_* nvme needs DeepSpeed's async I/O, which builds against libaio: install it "
            "(apt-get install libaio-dev, or yum install libaio-devel) or use --offload_* cpu"
        )
    if not aio_built() and os.environ.get("RANK", "0") == "0":
        print(
            "DeepSpeed compiles its async I/O op at the start of this run, once (minutes on a small machine; "
            "cached in torch's extension folder): `make deepspeed-ops` compiles it ahead",
            flush=True,
        )


COMPILERS = {"ninja", "cc1plus", "c++", "g++", "gcc", "cc", "x86_64-linux-gnu-g++", "nvcc", "cicc"}


def clear_stale_build_locks() -> None:
    """torch's extension builds (DeepSpeed's ops, compiled on first use) hold `<op>/lock` while they compile, and
    a build waits without end or message while another holds it: a build that was killed (Ctrl-C, a launch out of
    time) leaves it behind. Older than a minute with no compiler running in that folder, a lock is stale."""
    import psutil
    from torch.utils.cpp_extension import _get_build_directory

    root = Path(_get_build_directory("async_io", verbose=False)).parent
    stale = [lock for lock in root.glob("*/lock") if time.time() - lock.stat().st_mtime > 60]

    def building(process: psutil.Process) -> bool:  # torch runs ninja, and ninja the compiler, in the op's folder
        try:
            return process.info["name"] in COMPILERS and Path(process.cwd()).is_relative_to(root)
        except psutil.NoSuchProcess:  # (a zombie too)
            return False  # ended while we looked: it builds nothing now
        except psutil.Error:
            return process.info["name"] in COMPILERS  # not ours to look into: it may be building

    if not stale or any(building(p) for p in psutil.process_iter(["name"])):
        return
    for lock in stale:
        lock.unlink(missing_ok=True)
        print(f"removed {lock}, left by an op build that was killed (it would wait forever)", flush=True)


def aio_built() -> bool:
    """Whether DeepSpeed's async I/O op loads without compiling: installed with DeepSpeed (DS_BUILD_AIO=1) or
    compiled before into torch's extension cache."""
    import deepspeed
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    if installed_ops.get("async_io"):
        return True
    folder = Path(_get_build_directory("async_io", verbose=False))
    if not (folder / "async_io.so").exists() or not (folder / "build.ninja").is_file():
        return False
    # the cache is shared: a build from another install names its own sources, and this run compiles again
    return str(Path(deepspeed.__file__).parent) in (folder / "build.ninja").read_text(errors="replace")
