"""The trainers, by --training_type: BasicTrainer (plain PyTorch), AcceleratedTrainer (accelerate) and
PipelineTrainer (torch.distributed.pipelining)."""

from cloudtrain.trainers.accelerated import AcceleratedTrainer
from cloudtrain.trainers.base import Trainer, TrainResult, count_parameters
from cloudtrain.trainers.basic import BasicTrainer
from cloudtrain.trainers.pipeline import PipelineTrainer

TRAINERS = {"basic": BasicTrainer, "accelerated": AcceleratedTrainer, "pipeline": PipelineTrainer}

__all__ = [
    "AcceleratedTrainer",
    "BasicTrainer",
    "PipelineTrainer",
    "TRAINERS",
    "TrainResult",
    "Trainer",
    "count_parameters",
]
