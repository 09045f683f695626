"""`cloudtrain plan`: its options: the training options of the run to plan for (the application's own flags, with
their help and defaults) and the plan's. cloudtrain.planning estimates and chooses."""

import argparse

from cloudtrain.config import PEFT_METHODS, add_config_option

# The planner's GPUs (planning.accelerators.GPUS) and strategies (planning.strategies: "auto", STRATEGIES, PIPELINE,
# MODEL_PARALLEL) by name, in its order: importing the planner for them would import the tasks and torch.
# tests/test_cli_startup.py checks them against the planner's own.
GPU_NAMES = (
    "t4", "v100-16gb", "v100-32gb", "a10g", "l4", "rtx-4090", "l40s", "a100-40gb", "a100-80gb", "h100", "h200", "b200",
    "mi210", "mi250", "mi250x", "mi300x",
)  # fmt: skip
STRATEGY_CHOICES = (
    "auto", "ddp", "zero1", "zero2", "fsdp_no_shard", "fsdp_grad_op", "fsdp_hybrid", "fsdp", "zero3", "zero2_offload",
    "zero3_offload", "fsdp_offload", "zero3_offload_all", "zero3_nvme", "pipeline", "tp", "tp_fsdp", "cp_fsdp",
)  # fmt: skip

# the training options `plan` takes, as the application defines them (in this order in --help)
TRAINING_OPTIONS = (
    "task",
    "model_name_or_path",
    "model_config",
    "tokenizer_name_or_path",
    "trust_remote_code",
    "attn_implementation",
    "packing",
    "fused_cross_entropy",
    "per_device_train_batch_size",
    "max_length",
    "mixed_precision",
    "global_batch_size",
    "lora_r",
    "lora_target_modules",
    "lora_dropout",
    "preference_loss",
    "precompute_reference",
    "resolution",
    "train_text_encoder",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    training = parser.add_argument_group("training options (the application's: the run to plan for)")
    for name in TRAINING_OPTIONS:
        add_config_option(training, name)
    plan = parser.add_argument_group("plan options")
    plan.add_argument("--num_labels", type=int, default=2, help="Classes of the classification head (default: 2).")
    plan.add_argument("--num_gpus", type=int, default=1, help="GPUs per node (default: 1).")
    plan.add_argument("--num_nodes", type=int, default=1, help="Nodes (default: 1).")
    plan.add_argument(
        "--gpu",
        default=None,
        help=f"The GPU by name, for its memory: {', '.join(GPU_NAMES)} (MI250: per die, two per card).",
    )
    plan.add_argument(
        "--gpu_memory_gb", type=float, default=None, help="Memory of one GPU in GiB, e.g. 24 or 80 (wins over --gpu)."
    )
    plan.add_argument(
        "--cpu_memory_gb",
        type=float,
        default=None,
        help="CPU memory per node in GiB; offload plans needing more do not fit (default: unchecked).",
    )
    plan.add_argument(
        "--nvme_gb",
        type=float,
        default=None,
        help="Local NVMe disk per node in GiB for ZeRO-Infinity's swap files; NVMe rows fit only within it "
        "(default: no NVMe disk, those rows do not fit).",
    )
    plan.add_argument(
        "--strategy",
        choices=STRATEGY_CHOICES,
        default="auto",
        help="Emit the configs for this strategy instead of the fastest that fits; pipeline: the fastest "
        "pipeline + data parallel row; tp, tp_fsdp: the fastest tensor-parallel row (replicated groups, or with "
        "FSDP2); cp_fsdp: the fastest context-parallel row (with FSDP2) (default: auto).",
    )
    plan.add_argument(
        "--gradient_checkpointing",
        choices=["auto", "true", "false"],
        default="auto",
        help="Only consider plans with (true) or without (false) checkpointing (default: auto).",
    )
    plan.add_argument(
        "--peft",
        choices=("auto",) + PEFT_METHODS,
        default="auto",
        help="auto: full fine-tuning if any strategy fits it, else LoRA, else QLoRA; none: full "
        "fine-tuning only; lora, dora or qlora: only those adapters (default: auto).",
    )
    plan.add_argument("--output_dir", default="plan", help="Where the configs are written (default: ./plan).")
    plan.add_argument("--json", action="store_true", help="Print the plan as JSON instead of a table.")


def run(args: argparse.Namespace) -> None:
    from cloudtrain import planning  # the tasks, transformers and torch: only once the options parsed

    planning.run(args)
