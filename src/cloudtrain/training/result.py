"""What a run's training reports: where a launch took the run up (`LaunchStart`) and its totals (`TrainResult`,
written as train_results.json)."""

from dataclasses import dataclass

from cloudtrain.checkpointing import TrainerState
from cloudtrain.observe import cost
from cloudtrain.training.hooks import LoopState


@dataclass(frozen=True)
class LaunchStart:
    """Where this launch took the run up: the step, and the run's samples and tokens so far (logged, or pending
    in the checkpoint's logging sums: the first logging step of this launch adds those to the run's totals)."""

    step: int = 0
    samples: int = 0
    tokens: int = 0
    device_s: float = 0.0  # the earlier launches' training time x their processes
    job_s: float = 0.0  # the wall time of earlier sessions of this SageMaker job (cost.earlier_job_seconds)

    @classmethod
    def of(cls, state: TrainerState, processes: int) -> "LaunchStart":
        pending = list(state.interval) + [0.0, 0.0]  # examples, tokens, ... (every process's, in the checkpoint)
        samples, tokens = state.samples + int(pending[0]), state.tokens + int(pending[1])
        job_s = cost.earlier_job_seconds(state.job, state.job_wall_s)
        return cls(state.global_step, samples, tokens, state.earlier_device_s(processes), job_s)


@dataclass
class TrainResult:
    global_step: int = 0
    epoch: float | None = 0.0  # None: a stream, which has no epochs (left out of train_results.json)
    train_loss: float = float("nan")
    runtime_s: float = 0.0  # the run's training time, earlier launches included
    train_samples: int = 0
    train_tokens: int = 0
    sources: dict | None = None  # a stream's documents and tokens per source (cloudtrain.data.streaming)
    resumed_at: int | None = None  # the checkpoint's step this launch resumed at; None: a fresh run
    launch_runtime_s: float = 0.0  # this launch's training time
    launch_samples: int = 0
    launch_tokens: int = 0
    earlier_device_s: float | None = None  # a resumed launch: the earlier launches' training time x processes
    model_step: int | None = None  # the step whose model the run ends with, where not its last (best_model)
    earlier_job_s: float = 0.0  # the wall time of earlier sessions of this SageMaker job
    skipped_steps: int = 0  # --nonfinite_loss skip: the steps not applied

    @classmethod
    def of(cls, loop: LoopState, start: LaunchStart | None = None) -> "TrainResult":
        """The run's result; `start`: where a resumed launch began (None: a fresh run, the launch is the run)."""
        state, elapsed = loop.state, loop.meter.elapsed()
        if start is None:
            launch = (state.samples, state.tokens)
        elif state.global_step > start.step:
            launch = (state.samples - start.samples, state.tokens - start.tokens)
        else:  # resumed at or past the last step: the checkpoint's pending sums were never added
            launch = (0, 0)
        return cls(
            global_step=state.global_step,
            epoch=loop.epoch,
            train_loss=state.loss_sum / max(state.loss_count or state.samples, 1),
            runtime_s=state.runtime_s + elapsed,
            train_samples=state.samples,
            train_tokens=state.tokens,
            resumed_at=start.step if start else None,
            launch_runtime_s=elapsed,
            launch_samples=launch[0],
            launch_tokens=launch[1],
            earlier_device_s=start.device_s if start else None,
            earlier_job_s=start.job_s if start else 0.0,
            model_step=loop.model_step,
            skipped_steps=state.skipped_steps,
        )

    @property
    def launch_steps(self) -> int:
        return self.global_step - (self.resumed_at or 0)

    def summary(self) -> dict:
        """train_results.json: the run's totals; a resumed launch adds what it trained itself (launch_*), its
        throughput only where it trained a step."""
        runtime = max(self.runtime_s, 1e-9)
        summary = {
            "global_step": self.global_step,
            **({"epoch": round(self.epoch, 4)} if self.epoch is not None else {}),
            "train_loss": self.train_loss,
            "train_runtime_s": round(self.runtime_s, 2),
            "train_samples": self.train_samples,
            "train_samples_per_s": round(self.train_samples / runtime, 2),
            "train_tokens_per_s": round(self.train_tokens / runtime, 1),
        }
        if self.resumed_at is not None:
            summary |= {
                "resumed_at_step": self.resumed_at,
                "launch_steps": self.launch_steps,
                "launch_runtime_s": round(self.launch_runtime_s, 2),
                "launch_samples": self.launch_samples,
            }
            if self.launch_steps:
                launch = max(self.launch_runtime_s, 1e-9)
                summary |= {
                    "launch_samples_per_s": round(self.launch_samples / launch, 2),
                    "launch_tokens_per_s": round(self.launch_tokens / launch, 1),
                }
        summary |= {"model_from_step": self.model_step} if self.model_step is not None else {}
        summary |= {"skipped_steps": self.skipped_steps} if self.skipped_steps else {}
        return summary | ({"sources": self.sources} if self.sources is not None else {})
