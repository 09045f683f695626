"""Faults injected into the real application, for the monitoring and fault-tolerance tests.

    python -m torch.distributed.run ... tests/dist_faults.py FAULTS_JSON <training options>

or `install(faults)` in the test process. FAULTS_JSON keys (steps count from 1, ranks from RANK):
    hang          {"rank": r, "step": n}: rank r stops answering at step n (sleeps in its forward pass)
    slow_forward  {"rank": r, "seconds": s}: rank r's every forward pass takes s longer (a straggler)
    loss_scale    {"step": n, "factor": f}: step n's loss (and so its gradients) times f; with "from_step": n
                  instead, every step from n on (a factor of -1: gradient ascent, a model that gets worse)
    slow_data     {"from_step": n, "seconds": s}: from step n on, each batch arrives s later
    slow_prepare  {"rank": r, "seconds": s}: rank r's data processing (tokenizing) takes s longer
"""

import json
import os
import sys
import time

from cloudtrain.cli import main
from cloudtrain.training.trainer import Trainer


def install(faults: dict, setattr=setattr) -> None:
    """Patch the classes (with `setattr`: a test passes monkeypatch.setattr, so that it is undone)."""
    rank = int(os.environ.get("RANK", "0"))
    step = [0]  # the optimizer step being computed (the loss scale is computed once per step, in fit only)

    def counted(real_scale):
        def loss_scale(self, window):
            step[0] += 1
            return real_scale(self, window)

        return loss_scale

    def slowed(real_move):
        def move(self, batch):
            slow = faults.get("slow_data")
            if slow and step[0] + 1 >= slow["from_step"]:  # fetched for the coming step
                time.sleep(slow["seconds"])
            return real_move(self, batch)

        return move

    for trainer in _trainer_classes("_loss_scale"):  # the pipeline's scale is its own
        setattr(trainer, "_loss_scale", counted(trainer.__dict__["_loss_scale"]))
    from cloudtrain.training.pipeline import PipelineTrainer  # its last stage's loss is not the task's

    setattr(PipelineTrainer, "_loss", _hanging(PipelineTrainer._loss, faults, rank, step))
    for trainer in _trainer_classes("move"):  # each class with its own input path (the accelerated one places streams)
        setattr(trainer, "move", slowed(trainer.__dict__["move"]))
    for task in _task_classes():
        setattr(task, "loss", _faulty_loss(_hanging(task.loss, faults, rank, step), faults, rank, step))
        setattr(task, "process", _slow_process(task.process, faults, rank))


def _trainer_classes(method: str) -> list[type]:
    from cloudtrain.registry import TRAINERS

    return [cls for cls in {Trainer, *TRAINERS} if method in cls.__dict__]


def _hanging(real, faults: dict, rank: int, step: list[int]):
    """`real` (a loss), made to stop answering on the faulty rank at the faulty step."""

    def loss(*args, **kwargs):
        hang = faults.get("hang")
        if hang and rank == hang["rank"] and step[0] == hang["step"]:
            time.sleep(600)
        return real(*args, **kwargs)

    return loss


def _task_classes() -> list[type]:
    from cloudtrain.tasks.causal_lm import CausalLMTask
    from cloudtrain.tasks.classification import ClassificationTask

    return [ClassificationTask, CausalLMTask]


def _slow_process(real, faults: dict, rank: int):
    def process(self, *args, **kwargs):
        slow = faults.get("slow_prepare")
        if slow and rank == slow["rank"]:
            time.sleep(slow["seconds"])
        return real(self, *args, **kwargs)

    return process


def _faulty_loss(real, faults: dict, rank: int, step: list[int]):
    def loss(self, model, batch):
        slow, scale = faults.get("slow_forward"), faults.get("loss_scale")
        if slow and rank == slow["rank"]:
            time.sleep(slow["seconds"])
        summed, count = real(self, model, batch)
        if scale and (step[0] == scale.get("step") or step[0] >= scale.get("from_step", float("inf"))):
            summed = summed * scale["factor"]
        return summed, count

    return loss


if __name__ == "__main__":
    install(json.loads(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
