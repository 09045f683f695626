"""The planner: the memory per GPU of a training run, and the distributed strategy that fits.

- `facts`: what the estimate needs from the model, read off its config and a meta-device build;
- `strategies`: what is planned: the strategies, a pipeline's layout, the candidates and their meshes;
- `memory`: the memory model, bytes per GPU of one candidate at one micro-batch (docs/planner-formulas.md);
- `search`: the candidates' rows, the choice, and the micro-batch of a training run's `auto`;
- `reasons`: why the choice, and what would fit when nothing does;
- `writers`: the accelerate/DeepSpeed configs and the launch command of the choice (no option parsing);
- `report`: the plan as JSON and as a table;
- `command`: the `plan` command's run (its options: cloudtrain.commands.plan, parsed without torch).

Its public names below are imported on first use, so that the plan command's options can read
`accelerators` and `strategies` without the tasks, transformers and torch that `facts` needs.
"""

import importlib
from typing import Any

_EXPORTS = {
    "cloudtrain.commands.plan": ("TRAINING_OPTIONS", "add_arguments"),
    "cloudtrain.planning.command": ("make_plan", "run"),
    "cloudtrain.planning.facts": (
        "AdapterFacts",
        "LoraSpec",
        "ModelFacts",
        "StageFacts",
        "adapter_facts",
        "is_decoder",
        "model_facts",
        "stage_facts",
        "task_for",
    ),
    "cloudtrain.planning.memory": (
        "CUDA_CONTEXT_BYTES",
        "FRAGMENTATION",
        "GIB",
        "Estimate",
        "activation_bytes",
        "adapter_activation_bytes",
        "adapter_state_bytes",
        "cpu_bytes",
        "estimate",
        "fits",
        "frozen_base_bytes",
        "logits_bytes",
        "max_micro_batch",
        "model_state_bytes",
        "nvme_bytes",
        "overhead_bytes",
        "rank_estimates",
    ),
    "cloudtrain.planning.report": ("render",),
    "cloudtrain.planning.search": (
        "Choice",
        "Row",
        "choose",
        "fsdp_strategy",
        "pipeline_candidates",
        "run_micro_batch",
        "run_strategy",
    ),
    "cloudtrain.planning.strategies": (
        "ADAPTER_STRATEGIES",
        "PIPELINE",
        "STRATEGIES",
        "Candidate",
        "Pipeline",
        "Setup",
        "Strategy",
        "candidates",
    ),
    "cloudtrain.planning.writers": ("accelerate_config", "deepspeed_config", "launch_command"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """`planning.estimate` and `from cloudtrain.planning import estimate`: the name from its module, on first use."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
