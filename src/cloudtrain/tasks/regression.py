"""Regression (`--task regression`): text (or text pairs) -> one number (a rating, a score, a similarity).

Supports: a numeric label column, one output trained with mean squared error (the model's config says
`problem_type: regression`, so transformers' pipeline and `predict` give the raw value), RMSE, MAE, Pearson's and
Spearman's correlations; unlabelled evaluation splits (predictions only); everything else as
`--task classification` (text pairs, adapters, trainers, the Hub push).
Does not support: several targets per row, target scaling (the loss is in the target's own units).
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
from cloudtrain.data.processing import ProcessedData, process_data
from cloudtrain.data.regression_targets import regression_scheme
from cloudtrain.evaluation import eval_mode
from cloudtrain.models.load import pad_as_batches, read_config
from cloudtrain.predict import scored
from cloudtrain.publish.classifier_card import CardKind, build_model_card
from cloudtrain.publish.saving import write_jsonl
from cloudtrain.registry import TASKS
from cloudtrain.registry_table import TASK_ROWS
from cloudtrain.tasks.classification import ClassificationTask

# its card: the one output is the number
CARD = CardKind(
    purpose="text regression (one number per text, `{{ labels[0] }}`)",
    metrics=(
        ("rmse", "mse", "RMSE", {"squared": False}),
        ("mae", "mae", "MAE", None),
        ("pearson", "pearsonr", "Pearson", None),
        ("spearman", "spearmanr", "Spearman", None),
    ),
    labelled=False,
    output="print(model(**inputs).logits[0, 0].item())",
    call_options=', function_to_apply="none"',
    adapter_options=", num_labels=1",  # PEFT rebuilds the base's head: two outputs by default, the saved one has one
)


@TASKS.register
class RegressionTask(ClassificationTask):
    name = "regression"
    summary = "text -> a number"
    reads_options = TASK_ROWS[name].reads_options  # the row says it for the parser too
    metrics: tuple[str, ...] = ("loss", "rmse", "mae", "pearson", "spearman")
    default_best_metric = "loss"
    nouns = ("examples", "targets")

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        return process_data(raw, tokenizer, cfg.data, cfg.training.seed, labels=regression_scheme(raw, cfg.data))

    def build_config(self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
        config = read_config(cfg.model, id2label={0: data.label_names[0]}, label2id={data.label_names[0]: 0})
        config.problem_type = "regression"  # transformers' name: one raw output, mean squared error
        pad_as_batches(config, tokenizer)
        return config

    def fit_model(
        self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: Config, announce: bool
    ) -> None:
        """The one-output head computes in fp32 under autocast: bf16 spaces numbers near 1000 by 8, so every
        prediction of a target in the thousands landed on a few values (the correlations nan)."""
        super().fit_model(model, tokenizer, cfg, announce)  # type: ignore[arg-type]
        heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 1]
        if heads:
            heads[-1].register_forward_hook(_in_fp32)

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        predicted = model(**inputs).logits.float()[:, 0]
        return F.mse_loss(predicted, batch["labels"].float(), reduction="sum"), self.loss_count(batch)

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
        predicted, referenced = [], []
        import scipy.stats  # noqa: F401  (before the clock: regression_metrics' import is not evaluation)

        start = time.perf_counter()
        with eval_mode(model):
            for batch in batches:
                batch = move(batch)
                labels = batch.pop("labels").float()
                with autocast():
                    values = model(**batch).logits.float()[:, 0]
                pred, ref = gather((values, labels))
                predicted.append(pred.cpu())
                referenced.append(ref.cpu())
        result = regression_metrics(torch.cat(predicted), torch.cat(referenced))
        runtime = time.perf_counter() - start
        return {**result, "runtime_s": round(runtime, 3), "samples_per_s": round(result["samples"] / runtime, 2)}

    @torch.no_grad()
    def predict(
        self, model: torch.nn.Module, batches: Iterable[dict], gather: Callable, move: Callable, autocast: Callable
    ) -> tuple[list, list]:
        """The predicted number for each example of an unlabelled split, in the split's order (twice: as ids and
        scores are for a classifier)."""
        values: list[float] = []
        with eval_mode(model):
            for batch in batches:
                with autocast():
                    values += gather(model(**move(batch)).logits.float()[:, 0]).cpu().tolist()
        return values, values

    def write_predictions(self, output_dir: Path, data: ProcessedData, split: str, predicted: tuple) -> None:
        rows = scored(data.unlabelled_texts[split], predicted[0], data.unlabelled_pairs.get(split))
        write_jsonl(Path(output_dir) / f"{split}_predictions.jsonl", rows)

    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        return build_model_card(output_dir, cfg, results, CARD)

    def describe_data(self, data: ProcessedData) -> str:
        return self.data_summary(data, f"examples, target {data.label_names[0]!r}")

    def describe_metrics(self, metrics: dict) -> str:
        return (
            f"loss (MSE) {metrics['loss']:.4f} | rmse {metrics['rmse']:.4f} | mae {metrics['mae']:.4f} | pearson "
            f"{metrics['pearson']:.4f} | spearman {metrics['spearman']:.4f} ({metrics['samples']} examples)"
        )


def regression_metrics(predicted: torch.Tensor, referenced: torch.Tensor) -> dict:
    """Mean squared error (the loss), its root, mean absolute error, and Pearson's and Spearman's correlations
    (nan where either side is constant)."""
    from scipy.stats import spearmanr  # here: scipy is a second of import for every run

    p, r = predicted.double(), referenced.double()
    mse = ((p - r) ** 2).mean().item()
    both = torch.stack([p, r])
    pearson = torch.corrcoef(both)[0, 1].item() if p.std() > 0 and r.std() > 0 else math.nan
    spearman = float(spearmanr(p.numpy(), r.numpy()).statistic) if p.std() > 0 and r.std() > 0 else math.nan
    return {
        "loss": mse,
        "rmse": math.sqrt(mse),
        "mae": (p - r).abs().mean().item(),
        "pearson": pearson,
        "spearman": spearman,
        "samples": len(r),
    }


def _in_fp32(head: torch.nn.Linear, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """The head's output computed again in fp32, outside autocast (what it gave is dropped)."""
    with torch.autocast(output.device.type, enabled=False):
        bias = None if head.bias is None else head.bias.float()
        return F.linear(inputs[0].float(), head.weight.float(), bias)
