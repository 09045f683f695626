"""The Hub push is not in this version yet: --push_to_hub stops with a clear message before training."""

from pathlib import Path

from cloudtrain.config import Config, HubConfig
from cloudtrain.errors import UserError


def check_access(cfg: HubConfig) -> None:
    raise UserError("--push_to_hub is not in this version yet; the model is saved in --output_dir")


def push_output_dir(output_dir: Path, cfg: Config, results: dict) -> str:
    raise UserError("--push_to_hub is not in this version yet; the model is saved in --output_dir")
