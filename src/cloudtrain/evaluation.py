"""Evaluation shared by the trainers: predictions per example, gathered, then the repo's metric.

Each process predicts its shard; `gather` (the runtime's: accelerate's `gather_for_metrics`, or
torch.distributed's all-gather) collects per-example tensors, never per-batch
averages, so duplicated padding samples of the last batch are dropped by count and every example
counts exactly once.
"""

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    import evaluate

METRIC_DIR = Path(__file__).resolve().parent / "metrics" / "classification"


def pad_to_width(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """A batch's [rows, positions] padded to `width` positions, so that every process gathers the same shape (rows
    are cut at --max_length: a wider batch would lose columns to a negative pad, hence the check)."""
    assert t.shape[1] <= width, (t.shape, width)
    return F.pad(t, (0, width - t.shape[1]), value=value)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode inside the block, and back in the mode it had after it (also when the block raises)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def whole_root(model: torch.nn.Module) -> Iterator[None]:
    """Under FSDP2, the root unit's parameters whole inside the block, for code that calls the model's parts one by
    one (generation's encoder, a pipeline's denoiser) and so never runs the root's forward, whose hooks would
    gather them; the layers sharded on their own gather themselves when called, on every process alike."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


@functools.cache
def load_metric() -> "evaluate.EvaluationModule":
    """The classification metric module that lives in this repository (no Hub access); loaded once."""
    import evaluate  # here: it pulls in scipy and pandas, a second of start-up for every process of every run

    return evaluate.load(str(METRIC_DIR), keep_in_memory=True)


@torch.no_grad()
def evaluate_model(
    model: torch.nn.Module,
    batches: Iterable[dict],
    num_labels: int,
    gather: Callable = lambda tensors: tensors,
    move: Callable = lambda batch: batch,
    autocast: Callable = contextlib.nullcontext,
) -> dict:
    """Accuracy, macro F1, mean loss and the confusion matrix over every example of `batches`."""
    metric = load_metric()  # before the clock starts: loading is not evaluation
    with eval_mode(model):
        start = time.perf_counter()
        predictions: list[torch.Tensor] = []
        references: list[torch.Tensor] = []
        losses: list[torch.Tensor] = []
        for batch in batches:
            batch = move(batch)
            labels = batch.pop("labels")
            with autocast():
                logits = model(**batch).logits.float()
            loss = F.cross_entropy(logits, labels, reduction="none")
            pred, ref, loss = gather((logits.argmax(dim=-1), labels, loss))
            predictions.append(pred.cpu())
            references.append(ref.cpu())
            losses.append(loss.float().cpu())
    predicted, referenced = torch.cat(predictions), torch.cat(references)
    result = metric.compute(predictions=predicted.tolist(), references=referenced.tolist(), num_classes=num_labels)
    runtime = time.perf_counter() - start
    result.update(
        loss=torch.cat(losses).mean().item(),
        samples=len(referenced),
        runtime_s=round(runtime, 3),
        samples_per_s=round(len(referenced) / runtime, 2),
    )
    return result


def scalar_metrics(result: dict, prefix: str) -> dict:
    """The numeric entries of an evaluation result, named `<prefix><metric>` (e.g. prefix "eval/")."""
    return {f"{prefix}{k}": v for k, v in result.items() if isinstance(v, (int, float))}


@torch.no_grad()
def predict_labels(
    model: torch.nn.Module,
    batches: Iterable[dict],
    gather: Callable = lambda tensors: tensors,
    move: Callable = lambda batch: batch,
    autocast: Callable = contextlib.nullcontext,
) -> tuple[list[int], list[float]]:
    """The top class and its probability for every example of `batches` (an unlabelled split), in order."""
    with eval_mode(model):
        ids, scores = [], []
        for batch in batches:
            with autocast():
                probs = model(**move(batch)).logits.float().softmax(dim=-1)
            score, pred = gather(probs.max(dim=-1))
            ids += pred.cpu().tolist()
            scores += score.cpu().tolist()
    return ids, scores
