"""The one typed configuration that flows through the pipeline.

Every option lives in exactly one section (a dataclass in this package, one file per topic) and has exactly one
flag, `--<field name>`. A section may define `check(self)`, run with the cross-section checks of
`cloudtrain.config.checks` on every resolved config. How values are read and merged: `cloudtrain.config.parse`.
"""

from cloudtrain.config.checks import validate
from cloudtrain.config.data import PACKING, DataConfig
from cloudtrain.config.distributed import OFFLOAD, PIPELINE_SCHEDULES, DistributedConfig
from cloudtrain.config.fields import opt
from cloudtrain.config.images import ImagesConfig
from cloudtrain.config.model import PEFT_METHODS, ModelConfig
from cloudtrain.config.parse import (
    ConfigParser,
    _coerce,
    _help,
    add_config_arguments,
    add_config_option,
    build_config,
    config_from_namespace,
    flatten,
    load_config_file,
    parse_bool,
    resolve_options,
)
from cloudtrain.config.preference import PREFERENCE_LOSSES, PreferenceConfig
from cloudtrain.config.root import Config, differs_from_default, option_default, option_fields, save_arguments
from cloudtrain.config.run import (
    HUB_STRATEGIES,
    ON_ANOMALY,
    TRACKERS,
    CheckpointConfig,
    HubConfig,
    MonitoringConfig,
    OutputConfig,
    TrackingConfig,
)
from cloudtrain.config.training import (
    ADAMW_IMPLEMENTATIONS,
    EVAL_STRATEGIES,
    MIXED_PRECISION,
    PRECISIONS,
    SCHEDULERS,
    TrainingConfig,
)

__all__ = [
    "ADAMW_IMPLEMENTATIONS",
    "EVAL_STRATEGIES",
    "HUB_STRATEGIES",
    "MIXED_PRECISION",
    "OFFLOAD",
    "ON_ANOMALY",
    "PACKING",
    "PEFT_METHODS",
    "PIPELINE_SCHEDULES",
    "PREFERENCE_LOSSES",
    "PRECISIONS",
    "SCHEDULERS",
    "TRACKERS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DistributedConfig",
    "HubConfig",
    "ImagesConfig",
    "ModelConfig",
    "MonitoringConfig",
    "OutputConfig",
    "PreferenceConfig",
    "TrackingConfig",
    "TrainingConfig",
    "ConfigParser",
    "_coerce",
    "option_default",
    "option_fields",
    "_help",
    "add_config_arguments",
    "add_config_option",
    "build_config",
    "config_from_namespace",
    "differs_from_default",
    "flatten",
    "load_config_file",
    "opt",
    "parse_bool",
    "resolve_options",
    "save_arguments",
    "validate",
]
