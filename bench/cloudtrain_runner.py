"""Our two trainers, built from the task, runtime and trainer classes as cloudtrain.pipeline.build_run does.

The step clock wraps the trainer's optimizer step; evaluation is the trainer's own (`evaluate`), on
the test split. Checkpointing, trackers and saving are off: they are not the training loop.
"""

import tempfile

from common import Spec, StepClock, prepare

from cloudtrain.models.prepare import compile_model
from cloudtrain.models.prepare import prepare as prepare_model
from cloudtrain.observe.tracking import RunLog
from cloudtrain.parallel.runtime import Runtime
from cloudtrain.tasks import build_task
from cloudtrain.training import TRAINERS


def run(spec: Spec) -> dict:
    cfg, data, model, _ = prepare(spec)
    clock = StepClock()  # building the accelerator counts towards the time to the first step
    runtime = Runtime.for_launch(cfg)
    task = build_task(cfg)
    model = prepare_model(model, cfg, task, start=compile_model)  # the last of cloudtrain's model transforms
    with tempfile.TemporaryDirectory() as out:
        run_log = RunLog(cfg, out, True, run_info={})
        trainer = TRAINERS[cfg.training.training_type](cfg, task, model, data, run_log, runtime)
        step = trainer.optimizer_step

        def timed_step() -> None:
            step()
            clock.step_done()

        trainer.optimizer_step = timed_step
        result = trainer.fit()
        metrics = trainer.evaluate("test")
    return {
        **clock.result(spec.batch_size, result.train_samples, result.train_tokens),
        "eval_samples_per_s": metrics["samples_per_s"],
        "accuracy": metrics["accuracy"],
        "eval_samples": metrics["samples"],
        "train_loss": result.train_loss,
    }
