"""Options of the training loop: task, trainer, batch, optimizer, schedule, precision, evaluation."""

import dataclasses
from dataclasses import dataclass

from cloudtrain.config.fields import OnlyFields, opt
from cloudtrain.errors import UserError, refuse_first
from cloudtrain.registry import TASKS, TRAINERS

PRECISIONS = ("no", "fp16", "bf16")
MAX_ROWS = 1_000_000  # rows in a batch, or micro-batches in a step: more is a typo (and overflows an index)
MIXED_PRECISION = ("auto", *PRECISIONS)
SCHEDULERS = (
    "linear",
    "cosine",
    "constant",
    "constant_with_warmup",
    "cosine_with_min_lr",
    "warmup_stable_decay",
    "polynomial",
    "inverse_sqrt",
)
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit", "adafactor", "muon")
CUDA_OPTIMIZERS = ("adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit")  # bitsandbytes: CUDA kernels only
# the schedule options that shape only some schedules: set for another they would silently do nothing
SCHEDULE_OPTIONS = {
    "min_lr_ratio": ("cosine_with_min_lr", "warmup_stable_decay", "polynomial"),
    "decay_ratio": ("warmup_stable_decay",),
    "polynomial_power": ("polynomial",),
}


MUON_TORCH = (2, 9)


def muon_available() -> bool:
    """torch.optim.Muon arrived in torch 2.9; older installs lack it. Read from the installed version, not by
    importing torch: --help shows this, and importing torch costs more than the rest of --help."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("torch").split(".")[:2]
    except PackageNotFoundError:
        return False
    return (int(major), int(minor)) >= MUON_TORCH


def _optim_help() -> str:
    muon = "" if muon_available() else " (not in this torch install: it needs torch 2.9 or later)"
    return (
        "Optimizer: adamw (torch AdamW; its kernel from --adamw_implementation), adamw_8bit, paged_adamw_32bit, "
        "paged_adamw_8bit (bitsandbytes; CUDA only), adafactor (transformers' Adafactor at --learning_rate), "
        f"muon{muon} (torch.optim.Muon for the hidden layers' matrices, AdamW for embeddings, heads and 1-d "
        "weights). 1-d weights (biases, norms) never get weight decay."
    )


EVAL_STRATEGIES = ("epoch", "steps", "no")
ADAMW_IMPLEMENTATIONS = ("auto", "for_loop", "foreach", "fused")


@dataclass
class TrainingConfig(OnlyFields):
    task: str = opt(
        "classification",
        lambda: "What to train: " + "; ".join(f"{name}: {row.summary}" for name, row in TASKS.rows().items()) + ".",
        TASKS.names,
    )
    training_type: str = opt(
        "accelerated",
        lambda: "; ".join(f"{name}: {row.summary}" for name, row in TRAINERS.rows().items()) + ".",
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
    optim: str = opt("adamw", _optim_help, OPTIMIZERS)
    learning_rate: float = opt(1e-4, "Peak learning rate.")
    weight_decay: float = opt(0.01, "Weight decay (not applied to biases and LayerNorm).")
    max_grad_norm: float = opt(1.0, "Clip gradients to this global norm (0 disables clipping).")
    lr_scheduler_type: str = opt(
        "linear",
        "Learning-rate schedule after a linear warmup from 0 (docs/optimizers.md gives each formula): linear, "
        "cosine (to 0), constant (no warmup), constant_with_warmup, cosine_with_min_lr (to --min_lr_ratio x "
        "peak), warmup_stable_decay (flat, then a cosine to --min_lr_ratio x peak over the last --decay_ratio "
        "of the steps), polynomial (to --min_lr_ratio x peak, power --polynomial_power), inverse_sqrt "
        "(peak x sqrt(warmup / step) after warmup).",
        SCHEDULERS,
    )
    warmup_ratio: float = opt(0.1, "Fraction of the training steps spent warming up (see --warmup_steps).")
    warmup_steps: int | None = opt(
        None, "Optimizer steps spent warming up; when given it wins over --warmup_ratio, as in transformers."
    )
    min_lr_ratio: float = opt(
        0.0, "cosine_with_min_lr, warmup_stable_decay, polynomial: the final learning rate as a share of the peak."
    )
    decay_ratio: float = opt(0.1, "warmup_stable_decay: the share of the training steps in the final decay.")
    polynomial_power: float = opt(1.0, "polynomial: the power of the decay (1: linear).")
    tf32: bool = opt(
        False,
        "CUDA: run float32 matmuls and convolutions in TF32 (Ampere and later; faster, 10-bit mantissa). "
        "A no-op, with a note, on other devices.",
    )
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
    early_stopping_patience: int | None = opt(
        None,
        "End the run when --metric_for_best_model has not improved for N evaluations in a row; it then ends as "
        "at its last step (logged, evaluated, saved, pushed). Default: no early stopping.",
    )
    early_stopping_threshold: float = opt(
        0.0, "Early stopping: how much the metric must improve on its best to count, in the metric's own units."
    )
    label_smoothing: float = opt(
        0.0,
        "Label smoothing of the training loss (--task classification, token_classification, seq2seq, causal_lm "
        "and sft; not under --training_type pipeline): of K "
        "classes the target gets 1 - e + e/K of the probability, every other class e/K (0.1 is usual for "
        "translation; 0: off). Evaluation reports the plain cross-entropy.",
    )
    neftune_noise_alpha: float = opt(
        0.0,
        "NEFTune (--task sft, causal_lm and the classifiers): uniform noise of scale alpha / sqrt(row "
        "length x hidden size) added to the input embeddings while training (5 is a common choice for instruction "
        "tuning; 0: off). The row length is the padded or packed row's. Not under tensor, context or pipeline "
        "parallelism.",
    )
    torch_compile: bool = opt(
        False, "Compile the model with torch.compile (slow first steps, and a recompile per new sequence length)."
    )
    keep_freed_memory: bool = opt(
        True,
        "CPU training on Linux: keep freed tensor memory for reuse instead of "
        "returning it to the OS and page-faulting it back every step.",
    )
    sample_max_new_tokens: int = opt(32, "Causal LM: tokens generated for each sample prompt at evaluation.")
    callbacks: list = opt(
        [],
        "User callbacks, comma-separated module:name (or path/to/file.py:name): a function, or a class (made "
        "without arguments) with any of on_train_begin, on_step_end, on_evaluate, on_save, on_train_end; called "
        "on the main process unless it sets all_processes = True (docs/extending.md, Callbacks).",
    )

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

    def check(self) -> None:
        """The loop's values, and the optimizer and schedule options that contradict each other (the device is
        checked in preflight)."""
        rows = self.per_device_train_batch_size if isinstance(self.per_device_train_batch_size, int) else 0
        refuse_first(
            [
                (
                    self.num_train_epochs <= 0 and self.max_steps is None,
                    "--num_train_epochs must be positive (or set --max_steps)",
                ),
                (self.max_steps is not None and self.max_steps < 1, "--max_steps must be at least 1"),
                (
                    isinstance(self.per_device_train_batch_size, int) and self.per_device_train_batch_size < 1,
                    "--per_device_train_batch_size must be at least 1 (or auto)",
                ),
                (
                    self.global_batch_size is not None and self.global_batch_size < 1,
                    "--global_batch_size must be at least 1",
                ),
                (self.per_device_eval_batch_size < 1, "--per_device_eval_batch_size must be at least 1"),
                (self.gradient_accumulation_steps < 1, "--gradient_accumulation_steps must be at least 1"),
                (
                    max(
                        self.gradient_accumulation_steps,
                        self.per_device_eval_batch_size,
                        self.global_batch_size or 0,
                        rows,
                    )
                    > MAX_ROWS,
                    "--per_device_train_batch_size, --per_device_eval_batch_size, --global_batch_size and "
                    f"--gradient_accumulation_steps take at most {MAX_ROWS:,}",
                ),  # fmt: skip
                (self.learning_rate <= 0, "--learning_rate must be positive"),
                (self.weight_decay < 0, "--weight_decay must not be negative"),
                (self.max_grad_norm < 0, "--max_grad_norm must not be negative (0 disables clipping)"),
                (not 0 <= self.warmup_ratio < 1, "--warmup_ratio must be in [0, 1)"),
                (self.logging_steps < 1, "--logging_steps must be at least 1"),
                (
                    not 0 <= self.seed < 2**32,
                    "--seed must be between 0 and 4294967295 (2**32 - 1), as numpy's generator takes",
                ),
                (self.eval_steps is not None and self.eval_steps < 1, "--eval_steps must be at least 1"),
                (
                    self.eval_strategy == "steps" and self.eval_steps is None,
                    "--eval_strategy steps needs --eval_steps N (or use --eval_strategy epoch)",
                ),
                (
                    self.early_stopping_patience is not None and self.early_stopping_patience < 1,
                    "--early_stopping_patience must be at least 1",
                ),
                (self.early_stopping_threshold < 0, "--early_stopping_threshold must not be negative"),
                (self.neftune_noise_alpha < 0, "--neftune_noise_alpha must not be negative (0: off)"),
                (not 0 <= self.label_smoothing < 1, "--label_smoothing must be in [0, 1) (0: off; 0.1 is usual)"),
                (
                    self.early_stopping_patience and self.eval_strategy == "no",
                    "--early_stopping_patience counts evaluations: set --eval_strategy steps (with --eval_steps N) "
                    "or epoch",
                ),
                (self.sample_max_new_tokens < 1, "--sample_max_new_tokens must be at least 1"),
            ]
        )
        changed = {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}
        for name, schedules in SCHEDULE_OPTIONS.items():
            if name in changed and self.lr_scheduler_type not in schedules:
                raise UserError(
                    f"--{name} shapes only --lr_scheduler_type {' or '.join(schedules)} "
                    f"(this run's is {self.lr_scheduler_type})"
                )
        warms = (self.warmup_steps or 0) > 0 or ("warmup_ratio" in changed and self.warmup_ratio > 0)
        if warms and self.lr_scheduler_type == "constant":
            raise UserError(
                "--lr_scheduler_type constant has no warmup, so --warmup_steps/--warmup_ratio would do nothing: use "
                "--lr_scheduler_type constant_with_warmup"
            )
        if "adamw_implementation" in changed and self.optim != "adamw":
            raise UserError(f"--adamw_implementation applies to --optim adamw (this run's is {self.optim})")
        if self.optim == "muon" and not muon_available():
            raise UserError("--optim muon needs torch.optim.Muon (torch 2.9 or later); this torch has none")
        bad = [
            (self.warmup_steps is not None and self.warmup_steps < 0, "--warmup_steps must not be negative"),
            (not 0 <= self.min_lr_ratio < 1, "--min_lr_ratio must be in [0, 1)"),
            (not 0 < self.decay_ratio <= 1, "--decay_ratio must be in (0, 1]"),
            (self.polynomial_power <= 0, "--polynomial_power must be positive"),
            (
                self.lr_scheduler_type == "warmup_stable_decay"
                and self.warmup_steps is None
                and self.warmup_ratio + self.decay_ratio > 1,
                "--warmup_ratio + --decay_ratio exceed 1: warmup_stable_decay has no steps left to run them",
            ),
        ]
        refuse_first(bad)
