"""Model preparation: the ordered transforms every loaded model goes through before a trainer takes it.

The order is fixed (`TRANSFORMS`), each step relying on those before it:
1. `attention`: --attn_implementation, the kernel every later step (and probe) computes with;
2. `gradient_checkpointing`: before adapters, which build on it (QLoRA readies the inputs for it);
3. `task_checks`: the task's checks of the model as it will compute (document isolation under --packing bfd);
   kernel options (fused modules and losses) belong here, before adapters wrap the modules they replace;
4. `task_before_adapters`: what the task keeps of the model before adapters change it (a DPO reference);
5. `adapters`: --peft freezes the base and adds adapters, and the modules the task trains in full;
6. `compile`: --torch_compile, last, over the final module (in place: its class, keys and saving stay).
After these the trainers only wrap and shard (DDP, DeepSpeed, FSDP, pipeline stages). A new transform is
one function `(model, cfg, task, announce) -> model` placed in the list.
"""

from collections.abc import Callable
from typing import Any

from cloudtrain.config import Config
from cloudtrain.errors import UserError, first_line
from cloudtrain.tasks.base import Task

Transform = Callable[[Any, Config, Task, bool], Any]  # a PreTrainedModel in; it, or a PeftModel, out


def attention(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    """The model computes with --attn_implementation, or the run stops: some models cannot switch and would
    only log a warning."""
    wanted = cfg.model.attn_implementation
    if not wanted or model.config._attn_implementation == wanted:
        return model
    try:
        model.set_attn_implementation(wanted)
    except (ImportError, ValueError) as err:
        raise UserError(f"--attn_implementation {wanted}: {first_line(err)}") from None
    if model.config._attn_implementation != wanted:
        raise UserError(
            f"--attn_implementation {wanted}: {type(model).__name__} cannot use it (it computes with "
            f"{model.config._attn_implementation}); leave the option out for transformers' choice"
        )
    return model


def gradient_checkpointing(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def task_checks(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    task.check_model(model, cfg, announce)
    return model


def task_before_adapters(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    task.before_adapters(model, cfg, announce)
    return model


def adapters_for_task(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    if cfg.model.peft == "none":
        return model
    return task.attach_adapters(model, cfg)


def compile_model(model: Any, cfg: Config, task: Task, announce: bool) -> Any:
    if cfg.training.torch_compile:
        model.compile()  # in place: the module keeps its class, state-dict keys and save_pretrained
    return model


TRANSFORMS: list[Transform] = [
    attention,
    gradient_checkpointing,
    task_checks,
    task_before_adapters,
    adapters_for_task,
    compile_model,
]


def prepare(
    model: Any,
    cfg: Config,
    task: Task,
    announce: bool = False,
    start: Transform | None = None,
    stop: Transform | None = None,
) -> Any:
    """`model` through the transforms in order, from `start` (default: the first) up to, not including, `stop`
    (default: through the last): the pipeline probes for the batch size between adapters and compile."""
    first = TRANSFORMS.index(start) if start else 0
    end = TRANSFORMS.index(stop) if stop else len(TRANSFORMS)
    for transform in TRANSFORMS[first:end]:
        model = transform(model, cfg, task, announce)
    return model
