"""Run under torchrun by test_pipeline.py: one optimizer step's gradients of the real PipelineTrainer.

python -m torch.distributed.run --nproc_per_node N tests/dist_pipeline.py SCENARIOS_JSON RESULT_DIR

For each scenario (a dict of options; one launch runs them all, one process group), builds the run as the
application does (build_run), takes the first accumulation window, and runs the trainer's own
backward_window (schedule, loss scale, data-parallel and tied-embedding sums). RESULT_DIR/<i>/rank<R>.pt
gets that process's gradients by checkpoint name, its summed loss and count, and whether its last stage hands
the loss its hidden states (--fused_cross_entropy); rank 0 also writes
<i>/reference.pt: the gradients, loss and count of one process training the whole model on the same
window, every row of every pipeline.
"""

import json
import sys
from pathlib import Path

import torch

from cloudtrain.config import build_config
from cloudtrain.models.load import load_model
from cloudtrain.pipeline import build_run
from cloudtrain.training.trainer import set_epoch


def main() -> None:
    for i, options in enumerate(json.loads(sys.argv[1])):
        out = Path(sys.argv[2]) / str(i)
        out.mkdir(parents=True, exist_ok=True)
        one_step(options, out)


def one_step(options: dict, out: Path) -> None:
    run = build_run(build_config(options))
    trainer, rank = run.trainer, run.runtime.index
    trainer.setup()
    set_epoch(trainer.train_dl, 0)
    k = run.cfg.training.gradient_accumulation_steps
    loader = iter(trainer.train_dl)
    raw = [next(loader) for _ in range(k)]  # every pipeline's rows
    window = [trainer.move(batch) for batch in raw]
    stats = trainer.backward_window(window, trainer._loss_scale(window))
    grads = {name: p.grad.clone() for stage in trainer.stages for name, p in stage.named_parameters()}
    head_in_loss = any(stage.head_in_loss for stage in trainer.stages)  # the last stage's loss applies the head
    torch.save(
        {"grads": grads, "loss_sum": stats.loss_sum, "count": stats.count, "head_in_loss": head_in_loss},
        out / f"rank{rank}.pt",
    )
    if rank == 0:
        reference(run, raw, out)


def reference(run, raw: list[dict], out: Path) -> None:
    model = load_model(run.cfg, run.task, run.data, run.tokenizer)  # the same weights
    model.train()
    losses = [run.task.loss(model, batch) for batch in raw]
    loss_sum, count = sum(s for s, _ in losses), sum(n for _, n in losses)
    (loss_sum / count).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.save({"grads": grads, "loss_sum": loss_sum.detach(), "count": count}, out / "reference.pt")


if __name__ == "__main__":
    main()
