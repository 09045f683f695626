"""The local paths a training run's options name, checked with light I/O and no torch, transformers or datasets
import: the CLI and the Python API check them before the heavy imports, so a mistyped path answers at once; the
pipeline's preflight checks them again, with the same messages. Last, the Hub ids among them: one that only the
Hub can give while it cannot be reached is refused here too (cloudtrain.hub_reach)."""

import os
from pathlib import Path

from cloudtrain.assets import default_model_dir
from cloudtrain.config import Config, ModelConfig
from cloudtrain.config.checks import written_folders
from cloudtrain.data.files import check_data_files
from cloudtrain.errors import UserError
from cloudtrain.hub_reach import HubId, check_hub_ids, looks_like_repo_id
from cloudtrain.publish.atomic import SEALED, check_writable, staging_dir
from cloudtrain.publish.output_dir import (
    TOKENIZER_PATTERNS,
    check_location,
    claim,
    earlier_model_refusal,
    holds_saved_model,
)


def resolve_model_path(cfg: ModelConfig, name: str | None = None) -> str:
    """The path or Hub id to load (`name`, else the model's); a path that looks local must exist."""
    flag = "--tokenizer_name_or_path" if name else "--model_name_or_path"
    name = name or cfg.model_name_or_path or default_model_dir()
    looks_local = name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).exists()
    if not looks_local:
        return name
    folder = Path(name).expanduser()
    if folder.is_file():
        raise UserError(f"{flag} {name} is a file; give the folder it lies in")
    if not folder.is_dir():
        raise UserError(f"{flag} {name} does not exist; give a model directory or a Hub id like <org>/<name>")
    if flag == "--tokenizer_name_or_path" and not any(any(folder.glob(p)) for p in TOKENIZER_PATTERNS):
        raise UserError(
            f"{flag} {name} holds no tokenizer (no tokenizer.json, tokenizer_config.json or vocabulary file); give "
            "a folder a tokenizer was saved to (save_pretrained), or a Hub id"
        )
    return str(folder)


def check_folder(flag: str, folder: str) -> Path:
    if not Path(folder).is_dir():
        raise UserError(f"{flag} {folder} is not a folder")
    return Path(folder)


def check_deepspeed_config(path: str) -> Path:
    """--deepspeed_config (or the accelerate config's deepspeed_config_file) names a file."""
    if not Path(path).is_file():
        raise UserError(
            f"DeepSpeed config {path} does not exist; give a DeepSpeed JSON file (configs/deepspeed/ has "
            "examples) or --zero_stage 1|2|3"
        )
    return Path(path)


def check_output_folder(output_dir: Path, flag: str = "--output_dir") -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"{flag} {output_dir} is a file; give a directory")


def torchrun_restarts() -> int:
    """How often torchrun restarted this launch's workers (--max-restarts): a restarted one resumes."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def checkpoint_dir(cfg: Config, output_dir: Path) -> Path:
    """Where the run's checkpoints go: --checkpoint_dir, else <output_dir>/checkpoints."""
    return Path(cfg.checkpoint.checkpoint_dir) if cfg.checkpoint.checkpoint_dir else Path(output_dir) / "checkpoints"


def resumes_here(path: Path | str | None, folder: Path) -> bool:
    """Whether the checkpoint resumed is one of `folder`'s (the run that wrote this folder's checkpoints and log
    goes on; a branch set aside in `abandoned-<time>/` too), not another run's copied in."""
    return path is not None and Path(path).resolve().is_relative_to(Path(folder).resolve())


def check_earlier_model(cfg: Config, output_dir: Path) -> None:
    """The pipeline's refusal of a model an earlier run saved in --output_dir (pipeline.check_output_dir), where
    the options and the folder decide it alone: with --overwrite_output_dir, or a run resumed into its folder
    (--resume_from_checkpoint latest or one of the folder's checkpoints, or a worker torchrun restarted: it resumes
    from the latest checkpoint), the pipeline decides once it knows the checkpoint. Another folder's checkpoint
    starts a run of its own here, refused like a fresh one."""
    resume = cfg.checkpoint.resume_from_checkpoint
    checkpoints = checkpoint_dir(cfg, output_dir)
    if cfg.output.overwrite_output_dir or resume == "latest" or resumes_here(resume, checkpoints):
        return
    if torchrun_restarts() > 0 or not holds_saved_model(output_dir):  # restarts: resume.restarted_defaults
        return
    if resume is not None:
        raise UserError(
            f"--resume_from_checkpoint {resume} is not in this run's checkpoint folder {checkpoints}, and "
            f"--output_dir {output_dir} already holds a model: give --checkpoint_dir {Path(resume).parent} if it is "
            "this run's, or pass --overwrite_output_dir true to continue it here as a run of its own"
        )
    raise UserError(earlier_model_refusal(output_dir))


def model_folders(cfg: Config, default: bool = True) -> list[str]:
    """The model and tokenizer the run reads (paths or Hub ids); without `default`, the model only when named."""
    m = cfg.model
    named = m.model_name_or_path or default
    models = [resolve_model_path(m)] if named and not m.model_config else []
    return models + ([resolve_model_path(m, m.tokenizer_name_or_path)] if m.tokenizer_name_or_path else [])


def check_users_files(output_dir: Path) -> None:
    """The pipeline's refusal of the user's files under names a run writes (output_dir.claim), before the heavy
    imports; where a kill left a sealed save to finish, the pipeline finishes it first and decides then."""
    if not (staging_dir(output_dir) / SEALED).is_file():
        # another node's folder holds its own checkpoints, which only the main process's manifest lists
        claim(output_dir, ignore=("checkpoints",))


def hub_ids(cfg: Config) -> list[HubId]:
    """The model, tokenizer and dataset that the options name by Hub id (not a local path)."""
    named = [
        ("--model_name_or_path", cfg.model.model_name_or_path, "model"),
        ("--tokenizer_name_or_path", cfg.model.tokenizer_name_or_path, "model"),
    ]
    if not cfg.data.streaming:  # streamed, it is hf://datasets/<id>: data.remote checks the Hub itself
        named.append(("--dataset_name", cfg.data.dataset_name, "dataset"))
    return [
        HubId(flag, name, kind)
        for flag, name, kind in named
        if name and looks_like_repo_id(name) and not Path(name).exists()
    ]


def check_named_files(cfg: Config) -> None:
    """The checkpoint and token file the options name, where one process on one node decides: a launch's
    processes agree on a missing checkpoint in the run (naming the node without it), only the main process reads
    the token, and a restarted worker resumes from the latest checkpoint whatever was named."""
    resume, token_file = cfg.checkpoint.resume_from_checkpoint, cfg.hub.hub_token_file
    if resume not in (None, "latest") and not Path(resume).expanduser().exists():
        raise UserError(f"--resume_from_checkpoint {resume} does not exist; give a checkpoint directory, or latest")
    if cfg.hub.push_to_hub and token_file and not Path(token_file).expanduser().is_file():
        raise UserError(f"--hub_token_file {token_file} cannot be read (no such file); give a file holding the token")


def check_local_paths(cfg: Config, nodes: int = 1) -> None:
    """The paths the user typed: data files, image folders, the DeepSpeed config, the model and tokenizer folders
    exist; --output_dir is a folder this machine can write, holding no model an earlier run saved (unless asked
    to replace it). (Which of them the task reads, and what they hold, is the preflight's.) Then the Hub ids
    named: cached, or the Hub answers. `nodes`: the launch's (`cloudtrain launch --nnodes`)."""
    check_data_files(cfg.data)
    images = cfg.images
    folders = {"--train_data_dir": images.train_data_dir, "--instance_data_dir": images.instance_data_dir,
               "--class_data_dir": images.class_data_dir}  # fmt: skip
    for flag, folder in folders.items():
        if folder:
            check_folder(flag, folder)
    if cfg.distributed.deepspeed_config not in (None, "none"):
        check_deepspeed_config(cfg.distributed.deepspeed_config)
    if cfg.model.model_name_or_path:
        resolve_model_path(cfg.model)
    if cfg.model.tokenizer_name_or_path:
        resolve_model_path(cfg.model, cfg.model.tokenizer_name_or_path)
    if nodes == 1 and os.environ.get("WORLD_SIZE", "1").strip() == "1" and torchrun_restarts() == 0:
        check_named_files(cfg)
    if cfg.output.output_dir:
        check_output_folder(Path(cfg.output.output_dir))
        check_writable(Path(cfg.output.output_dir))
        models = model_folders(cfg, default=False)  # (the default model's: the pipeline checks it)
        check_location(cfg, Path(cfg.output.output_dir), models, cfg.checkpoint.resume_from_checkpoint)
        check_earlier_model(cfg, Path(cfg.output.output_dir))
        check_users_files(Path(cfg.output.output_dir))
    written = written_folders(cfg)
    if not cfg.data.cache_dir and os.environ.get("CLOUDTRAIN_CACHE"):  # the default cache's own variable
        written["CLOUDTRAIN_CACHE"] = os.environ["CLOUDTRAIN_CACHE"]
    for variable in ("HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE"):  # a file there was blamed on the data file
        if os.environ.get(variable):
            check_output_folder(Path(os.environ[variable]), variable)
    for flag, folder in written.items():  # folders the run writes into as it goes: refused now, not mid-run
        if folder:
            check_output_folder(Path(folder), flag)
            check_writable(Path(folder), flag)
    check_hub_ids(hub_ids(cfg), may_go_offline=not cfg.hub.push_to_hub)  # last: local mistakes need no request
