"""The tasks cloudtrain trains; `--task` picks one (see cloudtrain.tasks.base for what a task owns).

A task is one module here whose class registers itself (`@TASKS.register`), plus its import below.
"""

from cloudtrain.config import Config
from cloudtrain.registry import TASKS

# isort: off
# registered in the order --help lists them
from cloudtrain.tasks import classification  # noqa: F401
from cloudtrain.tasks import multi_label  # noqa: F401
from cloudtrain.tasks import regression  # noqa: F401
from cloudtrain.tasks import token_classification  # noqa: F401
from cloudtrain.tasks import question_answering  # noqa: F401
from cloudtrain.tasks import seq2seq  # noqa: F401
from cloudtrain.tasks import causal_lm  # noqa: F401
from cloudtrain.tasks import sft  # noqa: F401
from cloudtrain.tasks import dpo  # noqa: F401
from cloudtrain.tasks import reward  # noqa: F401
from cloudtrain.tasks import text_to_image  # noqa: F401

# isort: on
from cloudtrain.tasks.base import DecoderTask, Task


def build_task(cfg: Config) -> Task:
    return TASKS[cfg.training.task](cfg)


__all__ = ["DecoderTask", "Task", "TASKS", "build_task"]
