"""Options of the training loop: task, trainer, batch, optimizer, schedule, precision, evaluation."""

from dataclasses import dataclass

from cloudtrain.config.fields import opt
from cloudtrain.registry import TASKS, TRAINERS

PRECISIONS = ("no", "fp16", "bf16")
MIXED_PRECISION = ("auto", *PRECISIONS)
SCHEDULERS = ("linear", "cosine", "constant")
EVAL_STRATEGIES = ("epoch", "steps", "no")
ADAMW_IMPLEMENTATIONS = ("auto", "for_loop", "foreach", "fused")


@dataclass
class TrainingConfig:
    task: str = opt(
        "classification",
        lambda: "What to train: " + "; ".join(f"{c.name}: {c.summary}" for c in TASKS) + ".",
        TASKS.names,
    )
    training_type: str = opt(
        "accelerated",
        lambda: "; ".join(f"{c.name}: {c.summary}" for c in TRAINERS) + ".",
        TRAINERS.names,
    )
    num_train_epochs: float = opt(2.0, "Number of passes over the training data.")
    max_steps: int | None = opt(None, "Stop after this many optimizer steps (overrides --num_train_epochs).")
    per_device_train_batch_size: int | str = opt(
        16,
        "Training batch size per process (the micro-batch), or auto: the largest that fits, found by probing "
        "on CUDA and from the planner's estimate elsewhere; the accumulation then keeps the global batch.",
        auto=True,
    )
    global_batch_size: int | None = opt(
        None,
        "Examples per optimizer step over all processes; sets the accumulation to global / (per-device "
        "batch x processes). Unset: per-device batch x processes x --gradient_accumulation_steps.",
    )
    per_device_eval_batch_size: int = opt(64, "Evaluation batch size per process.")
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step; the update equals one big batch.")
    learning_rate: float = opt(1e-4, "Peak learning rate of AdamW.")
    weight_decay: float = opt(0.01, "AdamW weight decay (not applied to biases and LayerNorm).")
    max_grad_norm: float = opt(1.0, "Clip gradients to this global norm (0 disables clipping).")
    lr_scheduler_type: str = opt("linear", "Learning-rate decay after warmup.", SCHEDULERS)
    warmup_ratio: float = opt(0.1, "Fraction of the training steps spent warming up.")
    mixed_precision: str = opt(
        "auto",
        "Mixed precision: auto (bf16 where the device computes it natively: CUDA "
        "GPUs from Ampere on, CPUs with AVX512-BF16 or AMX; else no), no (fp32), "
        "fp16 (CUDA only) or bf16.",
        MIXED_PRECISION,
    )
    seed: int = opt(42, "Random seed: the same seed gives the same result.")
    logging_steps: int = opt(20, "Print and log loss, learning rate and throughput every N steps.")
    eval_strategy: str = opt("epoch", "When to evaluate during training (always at the end).", EVAL_STRATEGIES)
    eval_steps: int | None = opt(None, "Evaluate every N steps with --eval_strategy steps.")
    eval_on_start: bool = opt(False, "Also evaluate before the first step (the starting point of the curves).")
    torch_compile: bool = opt(
        False, "Compile the model with torch.compile (slow first steps, and a recompile per new sequence length)."
    )
    keep_freed_memory: bool = opt(
        True,
        "CPU training on Linux: keep freed tensor memory for reuse instead of "
        "returning it to the OS and page-faulting it back every step.",
    )
    sample_max_new_tokens: int = opt(32, "Causal LM: tokens generated for each sample prompt at evaluation.")

    @property
    def micro_batch(self) -> int:
        """The per-device batch, once `auto` is resolved (cloudtrain.batch_size.choose)."""
        if not isinstance(self.per_device_train_batch_size, int):
            raise ValueError("per_device_train_batch_size auto: resolve it with cloudtrain.batch_size first")
        return self.per_device_train_batch_size

    adamw_implementation: str = opt(
        "auto",
        "AdamW kernel: auto (fused, the fastest on CPU and CUDA), for_loop, foreach or fused.",
        ADAMW_IMPLEMENTATIONS,
    )
