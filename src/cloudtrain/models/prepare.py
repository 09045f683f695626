"""Model preparation: the ordered transforms every loaded model goes through before a trainer takes it.

The order is fixed (`TRANSFORMS`), each step relying on those before it:
1. `attention`: --attn_implementation, the kernel every later step (and probe) computes with;
2. `gradient_checkpointing`: before adapters, which build on it (QLoRA readies the inputs for it);
3. `task_checks`: the task's checks of the model as it will compute (document isolation under --packing bfd);
   kernel options (fused modules and losses) belong here, before adapters wrap the modules they replace;
4. `adapters`: --peft freezes the base and adds adapters, and the modules the task trains in full;
5. `compile`: --torch_compile, last, over the final module (in place: its class, keys and saving stay).
After these the trainers only wrap and shard (DDP, DeepSpeed, FSDP, pipeline stages). A new transform is
one function `(model, cfg, task, announce) -> model` placed in the list.
"""

from collections.abc import Callable
from typing import Any

from cloudtrain.config import Config
from cloudtrain.errors import UserError, first_line
from cloudtrain.models import adapters
from cloudtrain.tasks.base import Task

Transform = Callable[[Any, Config, Task, bool], Any]  # a PreTrainedModel in; it, or a PeftModel, out


def attention(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    implementation = cfg.model.attn_implementation
    if implementation:
        try:
            model.set_attn_implementation(implementation)
        except (ImportError, ValueError) as err:
            raise UserError(f"--attn_implementation {implementation}: {first_line(err)}") from None
    return model


def gradient_checkpointing(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def task_checks(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    task.check_model(model, cfg, announce)
    return model


def adapters_for_task(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    if cfg.model.peft == "none":
        return model
    return adapters.attach(model, cfg, task.peft_task_type, task.train_in_full(model))


def compile_model(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    if cfg.training.torch_compile:
        model.compile()  # in place: the module keeps its class, state-dict keys and save_pretrained
    return model


TRANSFORMS: list[Transform] = [attention, gradient_checkpointing, task_checks, adapters_for_task, compile_model]


def prepare(model: Any, cfg: Config, task: Task, announce: bool = False) -> Any:
    """`model` through every transform, in order."""
    for transform in TRANSFORMS:
        model = transform(model, cfg, task, announce)
    return model
