"""The two trainers: BasicTrainer (plain PyTorch) and AcceleratedTrainer (accelerate), by --training_type."""

from cloudtrain.trainers.accelerated import AcceleratedTrainer
from cloudtrain.trainers.base import Trainer, TrainResult, count_parameters
from cloudtrain.trainers.basic import BasicTrainer

TRAINERS = {"basic": BasicTrainer, "accelerated": AcceleratedTrainer}

__all__ = ["AcceleratedTrainer", "BasicTrainer", "TRAINERS", "TrainResult", "Trainer", "count_parameters"]
