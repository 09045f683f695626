"""`cloudtrain plan`: its options: the training options of the run to plan for (the application's own flags, with
their help and defaults) and the plan's. cloudtrain.planning estimates and chooses."""

import argparse
from pathlib import Path

from cloudtrain.config import PEFT_METHODS, add_config_option, parse_bool
from cloudtrain.config.training import MAX_ROWS
from cloudtrain.errors import UserError, refuse_first
from cloudtrain.planning.accelerators import GPUS, gpu_by_name
from cloudtrain.planning.strategies import MODEL_PARALLEL, PIPELINE, STRATEGIES
from cloudtrain.publish.atomic import check_writable

# The planner's GPUs and strategies, by name: these two modules import no task, transformers or torch.
GPU_NAMES = tuple(GPUS)
STRATEGY_CHOICES = ("auto", *(strategy.key for strategy in (*STRATEGIES, PIPELINE, *MODEL_PARALLEL)))

# GPUs per node and nodes a plan may name: more is a typo (and the search over their divisors would not end)
MAX_GPUS_PER_NODE, MAX_NODES = 1024, 100_000

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
    "liger_kernels",
    "per_device_train_batch_size",
    "max_length",
    "max_target_length",
    "mixed_precision",
    "global_batch_size",
    "lora_r",
    "lora_target_modules",
    "lora_dropout",
    "preference_loss",
    "precompute_reference",
    "resolution",
    "max_sequence_length",
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
        help="CPU memory per node in GiB; a row needing more (offloaded states, or loading the model) does not fit "
        "(default: unchecked).",
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
        type=str.lower,
        nargs="?",
        const="true",  # bare, as the training flag takes it
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
    plan.add_argument(
        "--json",
        type=_boolean,
        nargs="?",
        const=True,
        default=False,
        metavar="true|false",
        help="Print the plan as JSON instead of a table.",
    )


def _boolean(value: str) -> bool:
    try:
        return parse_bool(value)
    except ValueError as err:  # argparse's own wording would name the function
        raise argparse.ArgumentTypeError(str(err)) from None


def check_options(args: argparse.Namespace) -> None:
    """What needs no model: the numbers in range and the GPU known; one UserError naming the fix otherwise (what
    depends on the task and the model: cloudtrain.planning.command)."""
    world = args.num_gpus * args.num_nodes
    micro_batch = args.per_device_train_batch_size  # a number, or auto
    refuse_first(
        [
            (args.num_gpus < 1, "--num_gpus must be at least 1"),
            (args.num_nodes < 1, "--num_nodes must be at least 1"),
            (
                args.num_gpus > MAX_GPUS_PER_NODE,
                f"--num_gpus {args.num_gpus} is GPUs per node: at most {MAX_GPUS_PER_NODE:,} (give the nodes "
                "in --num_nodes)",
            ),
            (args.num_nodes > MAX_NODES, f"--num_nodes {args.num_nodes}: at most {MAX_NODES:,}"),
            (
                max(micro_batch if isinstance(micro_batch, int) else 0, args.global_batch_size or 0) > MAX_ROWS,
                f"--per_device_train_batch_size and --global_batch_size take at most {MAX_ROWS:,} (as the run does)",
            ),
            (
                args.gpu_memory_gb is None and args.gpu is None,
                f"give --gpu NAME (one of {', '.join(GPU_NAMES)}) or --gpu_memory_gb",
            ),
            (_not_gib(args.gpu_memory_gb), f"--gpu_memory_gb {args.gpu_memory_gb} must be a positive number, e.g. 24"),
            (_not_gib(args.cpu_memory_gb), f"--cpu_memory_gb {args.cpu_memory_gb} must be a positive number, e.g. 512"),
            (_not_gib(args.nvme_gb), f"--nvme_gb {args.nvme_gb} must be a positive number, e.g. 3500"),
            (args.num_labels < 1, "--num_labels must be at least 1"),
            (
                args.model_config and args.model_name_or_path,
                "--model_config builds a model from scratch and --model_name_or_path loads one; give one of them",
            ),
            (isinstance(micro_batch, int) and micro_batch < 1, "--per_device_train_batch_size must be at least 1"),
            (args.lora_r < 1, "--lora_r must be at least 1"),
            (not 0 <= args.lora_dropout < 1, "--lora_dropout must be in [0, 1)"),
            (not args.lora_target_modules, "--lora_target_modules needs all-linear or module names"),
            (args.max_length < 2, "--max_length must be at least 2"),
            (args.max_target_length < 1, "--max_target_length must be at least 1"),
            (
                args.global_batch_size is not None and args.global_batch_size % world != 0,
                f"--global_batch_size {args.global_batch_size} must be a positive multiple of the {world} GPUs",
            ),
            (
                args.global_batch_size is not None and args.global_batch_size < world,
                f"--global_batch_size must be at least the number of GPUs ({world})",
            ),
        ]
    )
    if args.gpu_memory_gb is None:
        gpu_by_name(args.gpu)  # a UserError for a GPU it does not know
    check_output_dir(args.output_dir)


def check_output_dir(output_dir: str) -> None:
    """--output_dir names a folder plan can make or write in, checked before the estimate (a file there, or a
    path under one, was a traceback once the plan was computed; an existing file got its configs beside it)."""
    if Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise UserError(f"--output_dir {output_dir} is a file; give a folder for the plan's configs")
    check_writable(Path(output_dir))  # a path under a file, a read-only or pseudo filesystem: the run's own line


def run(args: argparse.Namespace) -> None:
    check_options(args)
    from cloudtrain import planning  # the tasks, transformers and torch: only once the options parsed

    planning.run(args)


def _not_gib(size: float | None) -> bool:
    """A memory size given but not a positive number of GiB a machine could have (nan, inf, 1e300 too)."""
    return size is not None and not 0 < size < 2**30
