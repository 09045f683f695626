"""Ending a run at its best, judged by --metric_for_best_model: early stopping (--early_stopping_patience) and the
best model at the end (--load_best_model_at_end).

- Patience counts the run's evaluations as a checkpoint keeps them (TrainerState.evaluations): a resumed run stops
  where the run it continues would have, and one resumed at the step where it had stopped trains nothing more.
- A run that stops early ends as at its last step: the steps since the last logging step are logged, and the run
  evaluates, saves and pushes its model (`Trainer._end_here`).
- The best model at the end: the last step's model is evaluated and compared with the best checkpoint's (scored by
  the evaluation at its own step); the better one is the run's model, evaluated, saved and pushed. It is loaded
  after the checkpoint hook's end (a background save completes first) and before the callbacks' on_train_end.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from cloudtrain.checkpointing import LOWER_IS_BETTER, PREFIX, STATE_FILE, Checkpointer, complete_checkpoints, score
from cloudtrain.evaluation import scalar_metrics
from cloudtrain.publish.atomic import write_whole
from cloudtrain.training.hooks import Hook, LoopState, Request

if TYPE_CHECKING:
    from cloudtrain.training.trainer import Trainer


def better(value: float, than: float, metric: str, by: float = 0.0) -> bool:
    """Whether `value` beats `than` by more than `by` (lower is better for a loss or a perplexity)."""
    if math.isnan(value):
        return False
    return (than - value if metric in LOWER_IS_BETTER else value - than) > by or math.isnan(than)


def since_best(evaluations: list[dict], metric: str, threshold: float) -> tuple[int, dict | None]:
    """(how many evaluations in a row have not beaten the best by more than `threshold`, the best evaluation)."""
    best, waited = None, 0
    for record in evaluations:
        if best is None or better(record[metric], best[metric], metric, threshold):
            best, waited = record, 0
        else:
            waited += 1
    return waited, best


class EarlyStoppingHook(Hook):
    """After an evaluation that leaves the metric --early_stopping_patience evaluations without improving, the
    step just taken becomes the run's last. Every process ends at the same step: the main process decides."""

    phase = "early stopping"

    def __init__(self, trainer: Trainer):
        self.trainer, t = trainer, trainer.cfg.training
        self.metric = trainer.cfg.checkpoint.metric_for_best_model or trainer.task.default_best_metric
        self.patience, self.threshold = t.early_stopping_patience or 0, t.early_stopping_threshold

    def on_train_start(self, loop: LoopState) -> None:
        if loop.step and not loop.done and (why := self._exhausted(loop)):  # resumed where the patience ran out
            if self.trainer.is_main_process:
                print(
                    f"note: early stopping at step {loop.step}, where this run resumed: {why}; nothing left to train",
                    flush=True,
                )
            loop.total_steps = loop.step

    def on_step_end(self, loop: LoopState) -> Request | None:
        if not loop.done and (why := self._exhausted(loop)):
            loop.ending = f"early stopping after step {loop.step} of {loop.total_steps}: {why}; the run ends there"
        return None

    def _exhausted(self, loop: LoopState) -> str:
        """Why the evaluation at this step used up the patience; empty where it did not (or there was none)."""
        evaluations = loop.state.evaluations
        if not evaluations or evaluations[-1]["step"] != loop.step:
            return ""
        waited, best = since_best(evaluations, self.metric, self.threshold)
        if not self.trainer.runtime.share(waited >= self.patience):
            return ""
        assert best is not None  # there were evaluations
        return (
            f"eval {self.metric} has not improved on {best[self.metric]:.4g} (step {best['step']}) for {waited} "
            f"evaluations (--early_stopping_patience {self.patience})"
        )


class BestModelHook(Hook):
    """--load_best_model_at_end: at the run's end, the model becomes the best checkpoint's where it beats the last
    step's (`keep_best_model`); `loop.model_step` says which step's model the run ends with."""

    phase = "loading the best model (--load_best_model_at_end)"

    def __init__(self, trainer: Trainer, checkpointer: Checkpointer):
        self.trainer, self.checkpointer = trainer, checkpointer

    def on_train_end(self, loop: LoopState) -> None:
        loop.model_step = keep_best_model(self.trainer, self.checkpointer, loop)


def keep_best_model(trainer: Trainer, checkpointer: Checkpointer, loop: LoopState) -> int | None:
    """--load_best_model_at_end: load the best checkpoint's model where it beats the last step's. Returns the step
    of the model the run ends with when it is not the last step's, else None. Every process takes part."""
    metric = trainer.cfg.checkpoint.metric_for_best_model or trainer.task.default_best_metric
    last_step, evaluations, own = loop.step, loop.state.evaluations, None
    if evaluations and evaluations[-1]["step"] == last_step:  # the last step was evaluated (early stopping)
        last = evaluations[-1][metric]
    else:
        own = trainer.evaluate("validation")  # every process: a collective
        last = scalar_metrics(own, "")[metric]
        if trainer.is_main_process:
            record_final_evaluation(checkpointer, last_step, scalar_metrics(own, ""))
    chosen = None
    if trainer.is_main_process:
        # checkpoints past this step are an abandoned run's (this one resumed from an earlier one)
        values = {step: v for step, v in checkpoint_values(checkpointer, metric).items() if step <= last_step}
        oriented = {step: score(metric, value) for step, value in values.items()}
        best = max(oriented, key=lambda step: (oriented[step], -step), default=None)  # a tie: the earliest, as rotation
        if best is not None and best != last_step and better(values[best], last, metric):
            chosen = best
            said = f"{PREFIX}{best}'s (eval {metric} {values[best]:.4g}; the last step's {last:.4g})"
        else:
            said = f"the last step's (eval {metric} {last:.4g})"
        print(f"best model: {said}; --load_best_model_at_end", flush=True)
    chosen = trainer.runtime.share(chosen)
    if chosen is not None:
        if own is not None:  # the curve's last point is this step's own model (the final evaluation is the best's)
            trainer.log_evaluation(own, "eval", last_step)
        trainer.load_checkpoint(checkpointer.folder / f"{PREFIX}{chosen}")
        trainer.runtime.barrier()
    return chosen


def record_final_evaluation(checkpointer: Checkpointer, step: int, scalars: dict) -> None:
    """The last step's evaluation, which the loop leaves to the run's end, into that step's checkpoint: rotation
    (--save_total_limit) and a later run's best model judge a checkpoint by its own step's numbers (without them
    a run extended from this one deleted its best checkpoint, scored by an earlier evaluation). Main process."""
    path = checkpointer.folder / f"{PREFIX}{step}" / STATE_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):  # no checkpoint at the last step
        return
    evaluations = meta["state"]["evaluations"]
    if evaluations and evaluations[-1]["step"] == step:
        return
    evaluations.append({"step": step, **scalars})
    if (value := scalars.get(meta.get("metric"))) is not None:
        meta["score"] = score(meta["metric"], value)
    write_whole(path, json.dumps(meta, indent=2), sync=True)


def checkpoint_values(checkpointer: Checkpointer, metric: str) -> dict[int, float]:
    """Each complete checkpoint's `metric` at the evaluation of its own step (a number, not nan)."""
    values = {}
    for step, path in complete_checkpoints(checkpointer.folder):
        evaluations = json.loads((path / STATE_FILE).read_text())["state"]["evaluations"]
        if evaluations and evaluations[-1]["step"] == step and not math.isnan(evaluations[-1].get(metric, math.nan)):
            values[step] = evaluations[-1][metric]
    return values
