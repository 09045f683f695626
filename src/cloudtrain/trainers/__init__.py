"""The trainers, by --training_type: BasicTrainer (plain PyTorch), AcceleratedTrainer (accelerate) and
PipelineTrainer (torch.distributed.pipelining). Each registers itself (`@TRAINERS.register`)."""

from cloudtrain.registry import TRAINERS

# isort: off
# registered in the order --help lists them
from cloudtrain.trainers import basic  # noqa: F401
from cloudtrain.trainers import accelerated  # noqa: F401
from cloudtrain.trainers import pipeline  # noqa: F401

# isort: on
from cloudtrain.trainers.accelerated import AcceleratedTrainer
from cloudtrain.trainers.base import Trainer, TrainResult, count_parameters
from cloudtrain.trainers.basic import BasicTrainer
from cloudtrain.trainers.pipeline import PipelineTrainer

__all__ = [
    "AcceleratedTrainer",
    "BasicTrainer",
    "PipelineTrainer",
    "TRAINERS",
    "TrainResult",
    "Trainer",
    "count_parameters",
]
