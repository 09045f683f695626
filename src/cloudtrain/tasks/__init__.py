"""The tasks cloudtrain trains; `--task` picks one (see cloudtrain.tasks.base for what a task owns)."""

from cloudtrain.config import Config
from cloudtrain.tasks.base import Task
from cloudtrain.tasks.classification import ClassificationTask


def build_task(cfg: Config) -> Task:
    if cfg.training.task == "causal_lm":
        from cloudtrain.tasks.causal_lm import CausalLMTask

        return CausalLMTask(cfg)
    if cfg.training.task == "sft":
        from cloudtrain.tasks.sft import SFTTask

        return SFTTask(cfg)
    return ClassificationTask()


__all__ = ["Task", "build_task"]
