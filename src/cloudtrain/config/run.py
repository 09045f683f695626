"""Options of what a run watches and writes: monitoring, tracking, the Hub, checkpoints and the output folder."""

from dataclasses import dataclass

from cloudtrain.config.fields import OnlyFields, opt
from cloudtrain.errors import UserError, refuse_first
from cloudtrain.registry import TASKS

TRACKERS = ("none", "wandb", "trackio", "tensorboard", "mlflow")
HUB_STRATEGIES = ("end", "every_save", "checkpoint")
ON_ANOMALY = ("warn", "checkpoint", "stop")


@dataclass
class MonitoringConfig(OnlyFields):
    monitoring: bool = opt(
        True,
        "Log step time, data-loading share and peak memory at each logging step, and watch for anomalies.",
    )
    loss_spike_threshold: float = opt(
        6.0, "Warn when a step's loss exceeds its running mean by this many standard deviations (0: off)."
    )
    grad_norm_spike_threshold: float = opt(
        6.0,
        "The same for the gradient norm, which must also be over twice the largest of the last 20 steps' "
        "(logged when --max_grad_norm > 0; 0: off).",
    )
    throughput_drop_ratio: float = opt(
        0.5,
        "Warn when tokens/s stays below this share of its running median for two logging intervals in a row "
        "(0: off; a node shared with other jobs may want it lower).",
    )
    straggler_ratio: float = opt(
        1.5,
        "With several processes, warn when one spends more than this many times the median on its own data "
        "loading and forward passes (0: off).",
    )
    on_anomaly: str = opt(
        "warn",
        "On a loss or gradient-norm spike, a throughput drop or a straggler: warn, save a checkpoint at once "
        "(checkpoint), or save and stop so that someone can look (stop). Memory near the limit only warns.",
        ON_ANOMALY,
    )
    profile: bool = opt(
        False,
        "Write a torch.profiler trace of the --profile_steps steps (main process), for Perfetto or TensorBoard.",
    )
    profile_steps: str = opt(
        "5:8",
        "The optimizer steps --profile traces, first:last (from 1, inclusive); the step before first warms "
        "the profiler up.",
    )
    profile_dir: str | None = opt(None, "Where --profile writes its trace (default: <output_dir>/profile).", path=True)

    def check(self) -> None:
        """The thresholds' ranges; --profile_steps is read as first:last before any work; the profile options need
        --profile."""
        refuse_first(
            [
                (self.loss_spike_threshold < 0, "--loss_spike_threshold must not be negative (0: off)"),
                (self.grad_norm_spike_threshold < 0, "--grad_norm_spike_threshold must not be negative (0: off)"),
                (
                    not 0 <= self.throughput_drop_ratio < 1,
                    "--throughput_drop_ratio must be in [0, 1) (a share of the running median; 0: off)",
                ),
                (
                    self.straggler_ratio != 0 and self.straggler_ratio <= 1,
                    "--straggler_ratio must be above 1 (times the median process; 0: off)",
                ),
            ]
        )
        profile_window(self.profile_steps)
        if self.profile_dir and not self.profile:
            raise UserError("--profile_dir needs --profile true")


def profile_window(steps: str) -> tuple[int, int]:
    """--profile_steps first:last as (first, last), or a UserError saying how to write it."""
    first, sep, last = steps.partition(":")
    try:
        window = (int(first), int(last)) if sep else (int(first), int(first))
    except ValueError:
        window = (0, 0)
    if not 1 <= window[0] <= window[1]:
        raise UserError(f"--profile_steps {steps!r}: give first:last optimizer steps, 1 <= first <= last (say 5:8)")
    return window


@dataclass
class TrackingConfig(OnlyFields):
    report_to: list = opt(["none"], "Experiment trackers, comma-separated.", TRACKERS)
    project_name: str = opt("cloudtrain", "Tracker project name.")
    run_name: str | None = opt(None, "Tracker run name.")
    tags: list = opt([], "Tags for the tracker run, comma-separated.")
    log_model: bool = opt(False, "Also upload the saved model as a W&B artifact.")

    def check(self) -> None:
        if "none" in self.report_to and len(self.report_to) > 1:
            raise UserError("--report_to none cannot be combined with other trackers")
        twice = next((name for i, name in enumerate(self.report_to) if name in self.report_to[:i]), None)
        if twice is not None:  # two W&B runs ended the run with a traceback; TensorBoard logged everything twice
            raise UserError(f"--report_to names {twice} twice; name each tracker once")


@dataclass
class HubConfig(OnlyFields):
    push_to_hub: bool = opt(False, "Push the trained model to the Hugging Face Hub.")
    hub_model_id: str | None = opt(None, "Hub repository, <user or org>/<name>.")
    hub_token: str | None = opt(
        None,
        "Hub token; prefer HF_TOKEN or --hub_token_file (a value here shows in ps and shell history). "
        "Never saved or logged.",
        secret=True,
    )
    hub_token_file: str | None = opt(
        None,
        "A file holding the Hub token (a mounted secret, say). Default: HF_TOKEN, else the stored login.",
        path=True,
    )
    hub_private_repo: bool = opt(False, "Create the Hub repository as private.")
    hub_revision: str | None = opt(None, "Branch of the Hub repository to push to (default: main).")
    hub_strategy: str = opt(
        "end",
        "end: push once after training; every_save: push each saved model in the "
        "background; checkpoint: also push the latest checkpoint.",
        HUB_STRATEGIES,
    )

    def check(self) -> None:
        if self.push_to_hub and not self.hub_model_id:
            raise UserError("--push_to_hub true needs --hub_model_id <user>/<name>")


@dataclass
class CheckpointConfig(OnlyFields):
    checkpointing_steps: str | None = opt(
        None, "Save a checkpoint every N optimizer steps, or at every epoch end (epoch). Unset: no checkpoints."
    )
    checkpoint_dir: str | None = opt(None, "Where checkpoints go (default: <output_dir>/checkpoints).", path=True)
    save_total_limit: int | None = opt(
        None, "Keep at most this many checkpoints; the newest and the best are always kept."
    )
    resume_from_checkpoint: str | None = opt(
        None,
        "A checkpoint directory, or latest: the newest checkpoint complete on every node in "
        "--checkpoint_dir (a fresh start if none). Default: none, but latest for a worker that torchrun "
        "--max-restarts restarted, and inside a SageMaker job with checkpoints.",
        path=True,
    )
    metric_for_best_model: str | None = opt(
        None,
        lambda: (
            "The evaluation metric that names the best checkpoint (default: "
            + ", ".join(f"{row.default_best_metric} for {name}" for name, row in TASKS.rows().items())
            + ")."
        ),
        lambda: tuple(dict.fromkeys(metric for row in TASKS.rows().values() for metric in row.metrics)),
    )
    load_best_model_at_end: bool = opt(
        False,
        "End with the best model (by --metric_for_best_model): the best checkpoint's, where it beats the last "
        "step's (evaluated for the comparison), is evaluated, saved and pushed. Needs a checkpoint at evaluation "
        "steps: --checkpointing_steps a multiple of --eval_steps, or epoch for both.",
    )
    nonfinite_loss: str = opt(
        "stop",
        "On a nan/inf loss (or nan/inf gradients): stop (keeping the last good checkpoint) or skip the step and "
        "count it.",
        ("stop", "skip"),
    )
    async_checkpointing: bool = opt(
        False,
        "Write checkpoints in the background: the loop waits only while the state is copied to CPU memory "
        "(the basic trainer, or the accelerated one on one process or DDP: not DeepSpeed, FSDP or tensor "
        "parallelism).",
    )

    def check(self) -> None:
        every = self.checkpointing_steps
        if every is not None and every != "epoch" and not (every.isdigit() and int(every) > 0):
            raise UserError("--checkpointing_steps takes a number of steps or epoch")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise UserError("--save_total_limit must be at least 1")
        if self.resume_from_checkpoint is not None and not self.resume_from_checkpoint.strip():
            raise UserError("--resume_from_checkpoint is empty: give a checkpoint directory, latest, or none")


@dataclass
class OutputConfig(OnlyFields):
    output_dir: str | None = opt(
        None, "Where the model, metrics and arguments are saved (default: outputs/<model>-<dataset>).", path=True
    )
    overwrite_output_dir: bool = opt(False, "Allow replacing a model already saved in --output_dir.")
    merge_adapters: bool = opt(
        False,
        "With --peft: also write the base model with the adapter merged in to "
        "<output_dir>/merged, loadable with plain transformers.",
    )
