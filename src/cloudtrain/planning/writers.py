"""The chosen plan as files and a command: the accelerate config (and the DeepSpeed JSON it points to) that
`accelerate launch --config_file` takes unchanged, and the launch command with the training options that give
the chosen micro-batch, accumulation, checkpointing, adapters or pipeline. A library: it parses no options.

The configs are the user's to edit (docs/planner.md says to set `nvme_path`), so a re-run never replaces an
edit: `.cloudtrain-plan.json` in the folder keeps the SHA-256 of each file as plan wrote it. A file plan wrote
and nobody changed (or one holding exactly what plan writes now) is replaced; a folder holding any other file
of those names is left alone and the configs go to the first of `<output_dir>-2`, `-3`, ... that may take
them, which the plan names. (Chosen over a refusal: the estimate and the launch command stay one command away,
the printed command names the folder its configs are in, and re-runs keep going to the same free folder.)
Every file is written whole, then renamed into place.
"""

import hashlib
import itertools
import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from cloudtrain import invocation
from cloudtrain.config import TrainingConfig
from cloudtrain.errors import UserError
from cloudtrain.parallel.distributed import zero_config
from cloudtrain.planning.facts import ModelFacts
from cloudtrain.planning.known_models import hub_id
from cloudtrain.planning.search import Choice
from cloudtrain.planning.strategies import Candidate, Setup, Strategy
from cloudtrain.publish.atomic import write_whole

NVME_PATH = "/local_nvme/cloudtrain-swap"  # ZeRO-Infinity's swap folder in an emitted config: edit to your disk's
DS_CONFIG, YAML = "ds_config.json", "accelerate_config.yaml"
WRITTEN = ".cloudtrain-plan.json"  # {"written": {name: [SHA-256 of a content plan wrote]}}


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


def write_configs(m: ModelFacts, choice: Choice, setup: Setup, output_dir: Path) -> tuple[dict[str, str], str | None]:
    """Write the accelerate YAML (and the DeepSpeed JSON it points to); returns their paths, and a line saying where
    they went when `output_dir` holds a file the user edited (kept as is). A pipeline and FSDP2, launched by
    torchrun with their flags, need none."""
    c = choice.candidate
    if c.pipeline or c.strategy.fsdp or c.model_parallel > 1:
        return {}, None
    folder = output_dir
    try:
        folder = next(f for f in _folders(output_dir) if _replaceable(f, _contents(m, choice, setup, f)))
        contents = _contents(m, choice, setup, folder)
        _write_all(folder, contents)
    except OSError as err:  # a path under a file, a read-only or pseudo filesystem, a full disk: one line
        raise UserError(
            f"cannot write the plan's configs in {folder} ({err.strerror or err}); give --output_dir a folder you "
            "can write to"
        ) from None
    files = {key: str(folder / name) for key, name in (("deepspeed_config", DS_CONFIG), ("accelerate_config", YAML))}
    files = {key: path for key, path in files.items() if Path(path).name in contents}
    if folder == output_dir:
        return files, None
    if not output_dir.is_dir():
        return files, f"{output_dir} is not a folder; this plan's configs are in {folder}"
    foreign, ours = _foreign(output_dir, _contents(m, choice, setup, output_dir)), _written(output_dir)
    edited, theirs = ([str(output_dir / n) for n in foreign if (n in ours) == mine] for mine in (True, False))
    said = [f"{', '.join(edited)} changed since plan wrote {'them' if len(edited) > 1 else 'it'}"] if edited else []
    said += [f"plan did not write {', '.join(theirs)}"] if theirs else []
    return files, f"{'; '.join(said)} (kept as is); this plan's configs are in {folder}"


def _contents(m: ModelFacts, choice: Choice, setup: Setup, folder: Path) -> dict[str, bytes]:
    """What the plan writes in `folder`, by name (the YAML names the DeepSpeed JSON by its path)."""
    files = {}
    ds_path = None
    if choice.candidate.strategy.zero_stage is not None:
        ds_path = folder / DS_CONFIG
        files[DS_CONFIG] = (json.dumps(deepspeed_config(choice.candidate.strategy), indent=2) + "\n").encode()
    config = accelerate_config(m, choice.candidate, setup, ds_path)
    files[YAML] = yaml.safe_dump(config, sort_keys=False).encode()
    return files


def _folders(output_dir: Path) -> Iterator[Path]:
    """`output_dir`, then `<output_dir>-2`, `-3`, ...: where the configs may go."""
    yield output_dir
    for i in itertools.count(2):
        yield Path(f"{output_dir}-{i}")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _written(folder: Path) -> dict[str, list[str]]:
    """The contents plan wrote in `folder`, by name (nothing when its record is missing or unreadable)."""
    try:
        written = json.loads((folder / WRITTEN).read_text())["written"]
        return {str(name): [str(h) for h in hashes] for name, hashes in written.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _foreign(folder: Path, contents: dict[str, bytes]) -> list[str]:
    """The names plan would write that hold something else than what plan wrote there or writes now: an edit."""
    ours = _written(folder)
    foreign = []
    for name, data in contents.items():
        try:
            present = (folder / name).read_bytes()
        except FileNotFoundError:
            continue
        except OSError:  # a folder of that name, unreadable: not plan's to replace
            foreign.append(name)
            continue
        if present != data and _digest(present) not in ours.get(name, []):
            foreign.append(name)
    return foreign


def _replaceable(folder: Path, contents: dict[str, bytes]) -> bool:
    return not folder.exists() or (folder.is_dir() and not _foreign(folder, contents))


def _write_all(folder: Path, contents: dict[str, bytes]) -> None:
    """Each file whole, then renamed into place. The record accepts the old and the new content while the files
    are replaced, so a kill at any moment leaves each file as plan wrote it (old or new) and known as such."""
    folder.mkdir(parents=True, exist_ok=True)
    written = _written(folder)
    during = dict(written)
    for name, data in contents.items():
        try:
            present = [_digest((folder / name).read_bytes())]
        except OSError:
            present = []
        during[name] = [h for h in written.get(name, []) if h in present] + [_digest(data)]
    write_whole(folder / WRITTEN, (json.dumps({"written": during}, indent=1) + "\n").encode(), sync=True)
    for name, data in contents.items():
        write_whole(folder / name, data, sync=True)
    after = {**written, **{name: [_digest(data)] for name, data in contents.items()}}
    write_whole(folder / WRITTEN, (json.dumps({"written": after}, indent=1) + "\n").encode(), sync=True)


def launch_command(m: ModelFacts, choice: Choice, setup: Setup, files: dict[str, str]) -> str:
    """accelerate launch with the written config; a pipeline, FSDP2, tensor or context parallelism: torchrun, its
    processes and their flags."""
    c = choice.candidate
    pipe = c.pipeline
    rows = choice.micro_batch * (pipe.microbatches if pipe else 1)  # a pipeline's --per_device_train_batch_size
    args = _launcher(setup, files) + (
        [*invocation.launch_target(), "--training_type", c.strategy.trainer]
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
    """The launch command's task and model flags (a classifier's: the model, and --task where not the default),
    with --tokenizer_name_or_path and --trust_remote_code true wherever they were given (the run loads the model
    and its tokenizer by them; a checkpoint with its own code is refused without the second)."""
    name = m.name if m.from_config else hub_id(m.name)  # a well-known model by its short name: the Hub id
    if not m.decoder:
        task = ["--task", m.task] if m.task != TrainingConfig.task else []
        args = [*task, "--model_name_or_path", name]
    else:
        args = ["--task", m.task, "--model_config" if m.from_config else "--model_name_or_path", name]
    if m.tokenizer or (m.decoder and m.from_config):  # a preset's vocabulary is the tokenizer's: it needs one
        args += ["--tokenizer_name_or_path", m.tokenizer or "<tokenizer dir or Hub id>"]
    if m.trust_remote_code:
        args += ["--trust_remote_code", "true"]
    return args + list(m.task_args)
