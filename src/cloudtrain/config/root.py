"""`Config`: the sections together, and questions asked of every field."""

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloudtrain.config.data import DataConfig
from cloudtrain.config.distributed import DistributedConfig
from cloudtrain.config.fields import OnlyFields
from cloudtrain.config.images import ImagesConfig
from cloudtrain.config.model import ModelConfig
from cloudtrain.config.preference import PreferenceConfig
from cloudtrain.config.run import CheckpointConfig, HubConfig, MonitoringConfig, OutputConfig, TrackingConfig
from cloudtrain.config.training import TrainingConfig


@dataclass
class Config(OnlyFields):
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self, include_secrets: bool = False) -> dict:
        """Flat {flag name: value}; secrets are left out unless asked for."""
        return {
            f.name: getattr(section, f.name)
            for section in self.sections()
            for f in dataclasses.fields(section)
            if include_secrets or not f.metadata["secret"]
        }

    def sections(self) -> list:
        return [getattr(self, s.name) for s in dataclasses.fields(self)]


def option_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """{flag name: (section name, field)} over every section."""
    hints = typing.get_type_hints(Config)
    return {
        f.name: (section.name, f)
        for section in dataclasses.fields(Config)
        for f in dataclasses.fields(hints[section.name])
    }


def option_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def differs_from_default(cfg: Config, name: str) -> bool:
    """Whether option `name` was given a value other than its default."""
    section, f = option_fields()[name]
    default = option_default(f)
    return getattr(getattr(cfg, section), name) != default


def save_arguments(cfg: Config, path: Path) -> None:
    """The resolved arguments as JSON, without secrets."""
    path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
