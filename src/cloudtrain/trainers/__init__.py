"""The two trainers: BasicTrainer (plain PyTorch) and AcceleratedTrainer (accelerate)."""

from cloudtrain.trainers.accelerated import AcceleratedTrainer
from cloudtrain.trainers.base import Trainer, TrainResult, count_parameters
from cloudtrain.trainers.basic import BasicTrainer

__all__ = ["AcceleratedTrainer", "BasicTrainer", "TrainResult", "Trainer", "count_parameters"]
