"""Training: the loop (`Trainer.fit` in trainer.py), its hooks (hooks.py), and the trainers, by
--training_type: BasicTrainer (plain PyTorch), AcceleratedTrainer (accelerate) and PipelineTrainer
(torch.distributed.pipelining). Each registers itself (`@TRAINERS.register`)."""

from cloudtrain.registry import TRAINERS

# isort: off
# registered in the order --help lists them
from cloudtrain.training import basic  # noqa: F401
from cloudtrain.training import accelerated  # noqa: F401
from cloudtrain.training import pipeline  # noqa: F401

# isort: on
from cloudtrain.training.accelerated import AcceleratedTrainer
from cloudtrain.training.basic import BasicTrainer
from cloudtrain.training.hooks import Hook, LoopState, Request
from cloudtrain.training.pipeline import PipelineTrainer
from cloudtrain.training.result import TrainResult
from cloudtrain.training.trainer import Trainer
from cloudtrain.training.weights import count_parameters

__all__ = [
    "AcceleratedTrainer",
    "BasicTrainer",
    "Hook",
    "LoopState",
    "PipelineTrainer",
    "Request",
    "TRAINERS",
    "TrainResult",
    "Trainer",
    "count_parameters",
]
