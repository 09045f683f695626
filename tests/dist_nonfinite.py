"""Run under torchrun by test_deepspeed.py and test_context_parallel.py: the real pipeline with the loss of one
training step made nan on rank 0 only (the options' task; one micro-batch per step).

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_nonfinite.py OPTIONS_JSON NAN_STEP
"""

import json
import os
import sys
from pathlib import Path

from cloudtrain.config import build_config
from cloudtrain.pipeline import run_training
from cloudtrain.registry import TASKS


def main(options_file: str, nan_step: str) -> None:
    cfg = build_config(json.loads(Path(options_file).read_text()))
    task = TASKS[cfg.training.task]
    real, calls = task.loss, []

    def loss(self, model, batch):  # one micro-batch per step: the n-th call is step n
        calls.append(1)
        summed, count = real(self, model, batch)
        bad = len(calls) == int(nan_step) and os.environ["RANK"] == "0"
        return (summed * float("nan") if bad else summed), count

    task.loss = loss
    run_training(cfg)


if __name__ == "__main__":
    from dist_runs import exit_without_teardown

    main(*sys.argv[1:])
    exit_without_teardown()
