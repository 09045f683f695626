"""The chosen plan as files and a command: the accelerate config (and the DeepSpeed JSON it points to) that
`accelerate launch --config_file` takes unchanged, and the launch command with the training options that give
the chosen micro-batch, accumulation, checkpointing, adapters or pipeline. A library: it parses no options."""

import json
import shlex
from pathlib import Path
from typing import Any

import yaml

from cloudtrain.parallel.distributed import zero_config
from cloudtrain.planning.facts import ModelFacts
from cloudtrain.planning.known_models import hub_id
from cloudtrain.planning.search import Choice
from cloudtrain.planning.strategies import Candidate, Setup, Strategy

TRAINING_APPLICATION = "src/training_application.py"
NVME_PATH = "/local_nvme/cloudtrain-swap"  # ZeRO-Infinity's swap folder in an emitted config: edit to your disk's


def deepspeed_config(strategy: Strategy) -> dict:
    """The application's own ZeRO config (batch sizes, accumulation, clipping and precision "auto", so
    they always come from its flags), with reduce buckets sized from the hidden size as estimated."""
    offload = {True: "nvme" if strategy.nvme else "cpu", False: "none"}
    assert strategy.zero_stage is not None  # a ZeRO strategy's
    nvme = {"nvme_path": NVME_PATH, "block_size": 1048576, "queue_depth": 8} if strategy.nvme else None
    config = zero_config(
        strategy.zero_stage, offload[strategy.offload_optimizer], offload[strategy.offload_param], nvme
    )
    config["zero_optimization"]["reduce_bucket_size"] = "auto"  # hidden_size**2 (DeepSpeed's default: 5e8)
    return config


def accelerate_config(m: ModelFacts, cand: Candidate, setup: Setup, ds_path: Path | None) -> dict:
    """The accelerate config file (YAML) for `accelerate launch --config_file`."""
    s = cand.strategy
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": setup.mixed_precision,
        "num_machines": setup.num_nodes,
        "num_processes": setup.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if s.zero_stage is not None:
        assert ds_path is not None  # written for a ZeRO strategy
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "deepspeed_config_file": str(ds_path.resolve()),
            "zero3_init_flag": s.zero_stage == 3,
        }
        if setup.num_nodes > 1:
            config["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    else:
        config["distributed_type"] = "MULTI_GPU" if setup.world_size > 1 else "NO"
    return config


def write_configs(m: ModelFacts, choice: Choice, setup: Setup, output_dir: Path) -> dict[str, str]:
    """Write the accelerate YAML (and the DeepSpeed JSON it points to); returns their paths. A pipeline and FSDP2,
    launched by torchrun with their flags, need none."""
    c = choice.candidate
    if c.pipeline or c.strategy.fsdp or c.model_parallel > 1:
        return {}
    output_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    ds_path = None
    if choice.candidate.strategy.zero_stage is not None:
        ds_path = output_dir / "ds_config.json"
        ds_path.write_text(json.dumps(deepspeed_config(choice.candidate.strategy), indent=2) + "\n")
        files["deepspeed_config"] = str(ds_path)
    yaml_path = output_dir / "accelerate_config.yaml"
    yaml_path.write_text(yaml.safe_dump(accelerate_config(m, choice.candidate, setup, ds_path), sort_keys=False))
    files["accelerate_config"] = str(yaml_path)
    return files


def launch_command(m: ModelFacts, choice: Choice, setup: Setup, files: dict[str, str]) -> str:
    """accelerate launch with the written config; a pipeline, FSDP2, tensor or context parallelism: torchrun, its
    processes and their flags."""
    c = choice.candidate
    pipe = c.pipeline
    rows = choice.micro_batch * (pipe.microbatches if pipe else 1)  # a pipeline's --per_device_train_batch_size
    args = _launcher(setup, files) + (
        [TRAINING_APPLICATION, "--training_type", c.strategy.trainer]
        + _model_args(m)
        + [
            "--per_device_train_batch_size",
            str(rows),
            "--gradient_accumulation_steps",
            str(choice.accumulation),
            "--mixed_precision",
            setup.mixed_precision,
            "--max_length",
            str(setup.max_length),
        ]
    )
    args += c.strategy.fsdp_flags()
    if c.tensor_parallel > 1:
        args += ["--tensor_parallel_size", str(c.tensor_parallel)]
    if c.context_parallel > 1:
        args += ["--context_parallel_size", str(c.context_parallel)]
    if c.checkpointing:
        args += ["--gradient_checkpointing", "true"]
    if pipe:
        args += [
            "--pipeline_parallel_size",
            str(pipe.parallel_size),
            "--pipeline_schedule",
            pipe.schedule,
            "--pipeline_microbatches",
            str(pipe.microbatches),
        ]
        args += ["--pipeline_stages_per_rank", str(pipe.stages_per_rank)] if pipe.stages_per_rank > 1 else []
    if c.peft != "none":
        assert m.adapters is not None  # adapter candidates exist only with adapter facts
        spec = m.adapters.spec
        args += [
            "--peft",
            c.peft,
            "--lora_r",
            str(spec.r),
            "--lora_dropout",
            f"{spec.dropout:g}",
            "--lora_target_modules",
            ",".join(spec.target_modules),
        ]
    return shlex.join(args)


def _launcher(setup: Setup, files: dict[str, str]) -> list[str]:
    """accelerate launch with the written config, or torchrun (a pipeline, FSDP2: no config); on every node."""
    if "accelerate_config" not in files:
        args = ["torchrun", "--nproc_per_node", str(setup.num_gpus)]
        if setup.num_nodes > 1:
            args += ["--nnodes", str(setup.num_nodes), "--node_rank", "<rank of this node>"]
            args += ["--master_addr", "<node 0 address>", "--master_port", "29500"]
        return args
    args = ["accelerate", "launch", "--config_file", files["accelerate_config"]]
    if setup.num_nodes > 1:
        args += [
            "--machine_rank",
            "<rank of this node>",
            "--main_process_ip",
            "<node 0 address>",
            "--main_process_port",
            "29500",
        ]
    return args


def _model_args(m: ModelFacts) -> list[str]:
    """The launch command's task and model flags (a classifier's: the model alone, --task's default)."""
    name = m.name if m.from_config else hub_id(m.name)  # a well-known model by its short name: the Hub id
    if not m.decoder:
        return ["--model_name_or_path", name]
    args = ["--task", m.task, "--model_config" if m.from_config else "--model_name_or_path", name]
    if m.from_config or m.tokenizer:
        args += ["--tokenizer_name_or_path", m.tokenizer or "<tokenizer dir or Hub id>"]
    return args + list(m.task_args)
