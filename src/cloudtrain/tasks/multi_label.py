"""Multi-label classification (`--task multi_label`): text (or text pairs) -> any number of labels.

Supports: a label column of lists (JSON lines, Parquet, a Hub `Sequence` column) or of texts with the labels between
`--label_separator`s (CSV), rows to which no label applies, a sigmoid per label trained with binary cross-entropy
(the model's config says `problem_type: multi_label_classification`, so transformers' pipeline and `predict` read
it as such), a label predicted where its probability is over 0.5; micro and macro F1, subset accuracy and loss;
unlabelled evaluation splits (predictions only); everything else as `--task classification`.
Does not support: per-label thresholds, label weights, hierarchical labels.
"""

import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import DatasetDict
from huggingface_hub import ModelCard
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from cloudtrain.config import Config
from cloudtrain.data.multi_labels import multi_label_scheme
from cloudtrain.data.processing import ProcessedData, process_data
from cloudtrain.evaluation import eval_mode
from cloudtrain.models.load import head_labels
from cloudtrain.predict import label_sets
from cloudtrain.publish.classifier_card import CardKind, build_model_card
from cloudtrain.publish.saving import write_jsonl
from cloudtrain.registry import TASKS
from cloudtrain.registry_table import TASK_ROWS
from cloudtrain.tasks.classification import ClassificationTask

# its card: every label's probability, those over 0.5 predicted
CARD = CardKind(
    purpose="multi-label text classification over {{ labels | length }} labels (each predicted where its probability "
    "is over 0.5)",
    metrics=(
        ("micro_f1", "f1", "Micro F1", {"average": "micro"}),
        ("macro_f1", "f1", "Macro F1", {"average": "macro"}),
        ("subset_accuracy", "accuracy", "Subset accuracy", None),
    ),
    output="probabilities = model(**inputs).logits.sigmoid()[0]\n"
    "print([model.config.id2label[i] for i, p in enumerate(probabilities.tolist()) if p > 0.5])",
    call_options=", top_k=None",
)


@TASKS.register
class MultiLabelTask(ClassificationTask):
    name = "multi_label"
    summary = "text -> any number of labels"
    reads_options = TASK_ROWS[name].reads_options  # the row says it for the parser too
    metrics: tuple[str, ...] = ("micro_f1", "macro_f1", "subset_accuracy", "loss")
    default_best_metric = "micro_f1"

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        labels = multi_label_scheme(raw, cfg.data, order=head_labels(cfg.model))
        return process_data(raw, tokenizer, cfg.data, cfg.training.seed, labels=labels)

    def build_config(self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
        config = super().build_config(cfg, data, tokenizer)
        config.problem_type = "multi_label_classification"  # transformers' name: a sigmoid per label
        return config

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Binary cross-entropy, the mean over labels per row (transformers' loss for this problem type), summed."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits.float()
        loss = F.binary_cross_entropy_with_logits(logits, batch["labels"].float(), reduction="sum")
        return loss / logits.shape[-1], self.loss_count(batch)

    @torch.no_grad()
    def evaluate(
        self,
        model: torch.nn.Module,
        batches: Iterable[dict],
        data: ProcessedData,
        gather: Callable,
        move: Callable,
        autocast: Callable,
    ) -> dict:
        predicted, referenced, losses = [], [], []
        start = time.perf_counter()
        with eval_mode(model):
            for batch in batches:
                batch = move(batch)
                labels = batch.pop("labels").float()
                with autocast():
                    logits = model(**batch).logits.float()
                loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").mean(dim=-1)
                pred, ref, loss = gather((logits > 0, labels > 0.5, loss))
                predicted.append(pred.cpu())
                referenced.append(ref.cpu())
                losses.append(loss.cpu())
        samples, runtime = sum(len(r) for r in referenced), time.perf_counter() - start
        return {
            **multi_label_metrics(torch.cat(predicted), torch.cat(referenced), data.label_names),
            "loss": torch.cat(losses).mean().item(),
            "samples": samples,
            "runtime_s": round(runtime, 3),
            "samples_per_s": round(samples / runtime, 2),
        }

    def tables(self, metrics: dict) -> dict[str, tuple[list[str], list[list]]]:
        """Each label's F1, logged as a table with the evaluation."""
        return {"label_f1": (["label", "f1"], [[name, f1] for name, f1 in metrics.get("label_f1", {}).items()])}

    @torch.no_grad()
    def predict(
        self, model: torch.nn.Module, batches: Iterable[dict], gather: Callable, move: Callable, autocast: Callable
    ) -> tuple[list, list]:
        """The ids of the labels over 0.5 and every label's probability, for each example of an unlabelled split, in
        the split's order."""
        probabilities: list[list[float]] = []
        with eval_mode(model):
            for batch in batches:
                with autocast():
                    probs = model(**move(batch)).logits.float().sigmoid()
                probabilities += gather(probs).cpu().tolist()
        return [[i for i, p in enumerate(row) if p > 0.5] for row in probabilities], probabilities

    def write_predictions(self, output_dir: Path, data: ProcessedData, split: str, predicted: tuple) -> None:
        texts, (_, probabilities) = data.unlabelled_texts[split], predicted
        rows = label_sets(texts, probabilities, data.label_names, data.unlabelled_pairs.get(split))
        write_jsonl(Path(output_dir) / f"{split}_predictions.jsonl", rows)

    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        return build_model_card(output_dir, cfg, results, CARD)

    def describe_metrics(self, metrics: dict) -> str:
        return (
            f"micro_f1 {metrics['micro_f1']:.4f} | macro_f1 {metrics['macro_f1']:.4f} | subset_accuracy "
            f"{metrics['subset_accuracy']:.4f} | loss {metrics['loss']:.4f} ({metrics['samples']} examples)"
        )


def multi_label_metrics(predicted: torch.Tensor, referenced: torch.Tensor, names: list[str]) -> dict:
    """Micro F1 (over every label decision), macro F1 (the mean of each label's F1, over the labels that occur in
    the references or the predictions), subset accuracy (rows with every label right) and the F1 of each label
    that occurs."""
    tp = (predicted & referenced).sum(dim=0).double()
    fp = (predicted & ~referenced).sum(dim=0).double()
    fn = (~predicted & referenced).sum(dim=0).double()
    wrong = fp + fn
    occurs = (tp + wrong) > 0
    per_label = torch.where(occurs, 2 * tp / (2 * tp + wrong).clamp(min=1), torch.full_like(tp, math.nan))
    total = 2 * tp.sum() + wrong.sum()
    return {
        "micro_f1": (2 * tp.sum() / total).item() if total else 0.0,  # nothing to find, nothing found: as sklearn
        "macro_f1": per_label[occurs].mean().item() if occurs.any() else 0.0,
        "subset_accuracy": (predicted == referenced).all(dim=-1).double().mean().item(),
        "label_f1": {name: round(f1, 4) for name, f1 in zip(names, per_label.tolist(), strict=True) if f1 == f1},
    }
