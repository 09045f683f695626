"""The planner: the memory per GPU of a training run, and the distributed strategy that fits.

- `facts`: what the estimate needs from the model, read off its config and a meta-device build;
- `strategies`: what is planned: the strategies, a pipeline's layout, the candidates and their meshes;
- `memory`: the memory model, bytes per GPU of one candidate at one micro-batch (docs/planner-formulas.md);
- `search`: the candidates' rows, the choice and its reasons, and the micro-batch of a training run's `auto`;
- `writers`: the accelerate/DeepSpeed configs and the launch command of the choice (no option parsing);
- `report`: the plan as JSON and as a table;
- `command`: the `plan` command's run (its options: cloudtrain.commands.plan, parsed without torch).
"""

from cloudtrain.commands.plan import TRAINING_OPTIONS, add_arguments
from cloudtrain.planning.command import make_plan, run
from cloudtrain.planning.facts import (
    AdapterFacts,
    LoraSpec,
    ModelFacts,
    StageFacts,
    adapter_facts,
    is_decoder,
    model_facts,
    stage_facts,
    task_for,
)
from cloudtrain.planning.memory import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION,
    GIB,
    Estimate,
    activation_bytes,
    adapter_activation_bytes,
    adapter_state_bytes,
    cpu_bytes,
    estimate,
    fits,
    frozen_base_bytes,
    logits_bytes,
    max_micro_batch,
    model_state_bytes,
    nvme_bytes,
    overhead_bytes,
    rank_estimates,
)
from cloudtrain.planning.report import render
from cloudtrain.planning.search import (
    Choice,
    Row,
    choose,
    fsdp_strategy,
    pipeline_candidates,
    run_micro_batch,
    run_strategy,
)
from cloudtrain.planning.strategies import (
    ADAPTER_STRATEGIES,
    PIPELINE,
    STRATEGIES,
    Candidate,
    Pipeline,
    Setup,
    Strategy,
    candidates,
)
from cloudtrain.planning.writers import TRAINING_APPLICATION, accelerate_config, deepspeed_config, launch_command

__all__ = [
    "ADAPTER_STRATEGIES",
    "AdapterFacts",
    "CUDA_CONTEXT_BYTES",
    "Candidate",
    "Choice",
    "Estimate",
    "FRAGMENTATION",
    "GIB",
    "LoraSpec",
    "ModelFacts",
    "PIPELINE",
    "Pipeline",
    "Row",
    "STRATEGIES",
    "Setup",
    "StageFacts",
    "Strategy",
    "TRAINING_APPLICATION",
    "TRAINING_OPTIONS",
    "accelerate_config",
    "activation_bytes",
    "adapter_activation_bytes",
    "adapter_facts",
    "adapter_state_bytes",
    "add_arguments",
    "candidates",
    "choose",
    "cpu_bytes",
    "deepspeed_config",
    "estimate",
    "fits",
    "frozen_base_bytes",
    "fsdp_strategy",
    "is_decoder",
    "launch_command",
    "logits_bytes",
    "make_plan",
    "max_micro_batch",
    "model_facts",
    "model_state_bytes",
    "nvme_bytes",
    "overhead_bytes",
    "pipeline_candidates",
    "rank_estimates",
    "render",
    "run",
    "run_micro_batch",
    "run_strategy",
    "stage_facts",
    "task_for",
]
