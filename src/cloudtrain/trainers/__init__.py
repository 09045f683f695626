"""The two trainers: BasicTrainer (plain PyTorch) and AcceleratedTrainer (accelerate)."""

from cloudtrain.trainers.accelerated import AcceleratedTrainer
from cloudtrain.trainers.base import Trainer, TrainResult
from cloudtrain.trainers.basic import BasicTrainer

TRAINERS = {"basic": BasicTrainer, "accelerated": AcceleratedTrainer}

__all__ = ["AcceleratedTrainer", "BasicTrainer", "TRAINERS", "TrainResult", "Trainer"]
