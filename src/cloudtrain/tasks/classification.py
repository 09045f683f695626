"""Sequence classification (`--task classification`, the default): text (or text pairs) -> one label.

Supports: string or integer labels (their names become the model's id2label), encoders and decoders
with a sequence-classification head (a checkpoint's own head is kept when it has the data's labels),
unlabelled evaluation splits (predictions only), accuracy / macro F1 / loss and confusion matrices.
Does not support: several labels per text (--task multi_label) or a number per text (--task regression).
"""

import shlex
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import DatasetDict
from huggingface_hub import ModelCard
from transformers import (
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.auto_factory import _BaseAutoModelClass

from cloudtrain import invocation
from cloudtrain.config import Config, DataConfig
from cloudtrain.data.processing import ProcessedData, process_data, with_named_columns
from cloudtrain.errors import UserError
from cloudtrain.evaluation import evaluate_model, predict_labels
from cloudtrain.models.load import (
    check_checkpoint,
    check_sizes,
    head_labels,
    load_tokenizer,
    other_classifier,
    pad_as_batches,
    read_config,
)
from cloudtrain.paths import resolve_model_path
from cloudtrain.predict import records
from cloudtrain.publish.classifier_card import build_model_card
from cloudtrain.publish.saving import write_jsonl
from cloudtrain.registry import TASKS
from cloudtrain.registry_table import TASK_ROWS, TEXTS
from cloudtrain.tasks.base import Task


@TASKS.register
class ClassificationTask(Task):
    name = "classification"
    summary = "text -> label"
    reads_options = TASK_ROWS[name].reads_options  # the row says it for the parser too
    predicts: str | None = TEXTS
    metrics: tuple[str, ...] = ("accuracy", "macro_f1", "loss")
    default_best_metric = "accuracy"
    auto_class: type[_BaseAutoModelClass] = AutoModelForSequenceClassification
    adds_head = True
    load_error = "could not load a sequence-classification model"
    peft_task_type = "SEQ_CLS"
    embedding_noise = True
    bounds_length = True
    head = "ForSequenceClassification"  # how the name of a checkpoint architecture with this task's head ends
    nouns = ("examples", "labels")  # what the data summary calls the rows and the classes
    # a dataset family's column names (option -> column: CoNLL's, SQuAD's), read where the options are at defaults
    named_columns: dict[str, str] = {}

    def check_options(self, cfg: Config) -> None:
        """Before any data or weights load: a checkpoint with readable weights, whose vocabulary holds the
        tokenizer's and whose positions hold --max_length (past either, training fails mid-run)."""
        if cfg.model.model_config:
            raise UserError(
                "--model_config builds a decoder from scratch (--task causal_lm, sft or dpo); --task "
                f"{self.name} starts from a pretrained model: pass --model_name_or_path"
            )
        check_checkpoint(resolve_model_path(cfg.model), "--model_name_or_path")
        config, tokenizer = read_config(cfg.model), load_tokenizer(cfg.model)
        check_sizes(config, tokenizer, cfg.data.max_length)
        self.check_fit(config, tokenizer, cfg)

    def check_fit(self, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> None:
        """A task's own checks of the checkpoint's config and tokenizer (read once, by `check_options`)."""

    def connect(self, cfg: Config) -> DatasetDict:
        """The raw splits, holding the columns `data_options` reads."""
        from cloudtrain.data.sources import check_columns, connect_data

        raw = connect_data(cfg.data, {})
        check_columns(raw, self.columns(self.data_options(cfg, raw)))
        return raw

    def data_options(self, cfg: Config, raw: DatasetDict) -> DataConfig:
        """The data options as this data is read: `named_columns` where the column options are at their defaults."""
        return with_named_columns(cfg.data, raw["train"].column_names, self.named_columns)

    def columns(self, cfg: DataConfig) -> dict[str, tuple[str, bool]]:
        needed = {"--text_column": (cfg.text_column, True), "--label_column": (cfg.label_column, False)}
        if cfg.text_pair_column:
            needed["--text_pair_column"] = (cfg.text_pair_column, True)
        return needed

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        order = self.resumed_labels or head_labels(cfg.model)
        return process_data(raw, tokenizer, cfg.data, cfg.training.seed, label_order=order)

    def build_config(self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
        """The checkpoint's config with a head for the data's labels (names by id), padding as the tokenizer."""
        id2label = dict(enumerate(data.label_names))
        # id2label alone sets the number of labels; num_labels beside it made transformers warn that it disagrees
        # with a checkpoint head's own labels, just before the line saying that head is replaced
        config = read_config(cfg.model, id2label=id2label, label2id={n: i for i, n in id2label.items()})
        config.problem_type = "single_label_classification"  # a multi-label checkpoint's would make readers sigmoid
        pad_as_batches(config, tokenizer)
        return config

    def replaces_head(self, cfg: Config, data: ProcessedData, announce: bool) -> bool:
        """A checkpoint's head is kept when it has exactly the data's labels (data processing ordered them as the
        head's), else replaced by a new one, said in one line when `announce`; so is the other kind of classifier
        head (a sentence classifier's on a token classification run), whatever its labels."""
        if other := other_classifier(cfg.model, self.head):
            if announce:
                name = cfg.model.model_name_or_path or resolve_model_path(cfg.model)
                kind = "token" if self.head == "ForTokenClassification" else "sequence"
                print(
                    f"replacing the head of {name} ({other}) with a new {len(data.label_names)}-label "
                    f"{kind}-classification head",
                    flush=True,
                )
            return True
        existing = head_labels(cfg.model, self.head)
        # a head saved before names were stripped (" sports") keeps its order and ids under the stripped names
        if existing is None or [name.strip() for name in existing] == data.label_names:
            return False
        if announce:
            name = cfg.model.model_name_or_path or resolve_model_path(cfg.model)
            print(
                f"replacing the {len(existing)}-label head of {name} with a new "
                f"{len(data.label_names)}-label head (its labels: {', '.join(existing)})",
                flush=True,
            )
        return True

    def train_in_full(self, model: PreTrainedModel) -> list[str]:
        """Everything outside the pretrained body: the head, and what some heads add (DistilBERT's pre_classifier,
        DeBERTa's pooler), new from the seed; frozen, they would stay random and differ on every reload."""
        return [
            name
            for name, child in model.named_children()
            if name != model.base_model_prefix and any(True for _ in child.parameters())
        ]

    def loss_count(self, batch: dict) -> torch.Tensor:
        return torch.full((), len(batch["labels"]), device=batch["labels"].device)

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits
        loss = F.cross_entropy(logits.float(), batch["labels"], reduction="sum", label_smoothing=self.smoothing())
        return loss, self.loss_count(batch)

    def evaluate(
        self,
        model: torch.nn.Module,
        batches: Iterable[dict],
        data: ProcessedData,
        gather: Callable,
        move: Callable,
        autocast: Callable,
    ) -> dict:
        return evaluate_model(model, batches, len(data.label_names), gather=gather, move=move, autocast=autocast)

    def predict(
        self, model: torch.nn.Module, batches: Iterable[dict], gather: Callable, move: Callable, autocast: Callable
    ) -> tuple[list, list]:
        """Predicted label ids and their probabilities for an unlabelled split, in the split's order."""
        return predict_labels(model, batches, gather=gather, move=move, autocast=autocast)

    def write_predictions(self, output_dir: Path, data: ProcessedData, split: str, predicted: tuple) -> None:
        ids, scores = predicted
        write_jsonl(
            Path(output_dir) / f"{split}_predictions.jsonl",
            records(
                data.unlabelled_texts[split],
                ids,
                scores,
                dict(enumerate(data.label_names)),
                data.unlabelled_pairs.get(split),
            ),
        )

    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        return build_model_card(output_dir, cfg, results)

    def describe_data(self, data: ProcessedData) -> str:
        rows, labels = self.nouns
        return self.data_summary(data, f"{rows}, {len(data.label_names)} {labels}: {', '.join(data.label_names)}")

    def data_summary(self, data: ProcessedData, held: str) -> str:
        """The splits' sizes and what they hold (`held`), then a line per split kept for predictions only."""
        test = f" / {len(data.test)} test" if data.test is not None else ""
        lines = [f"data: {len(data.train)} train / {len(data.validation)} validation{test} {held}"]
        lines += [
            f"the {split} data has no {self.nouns[1]}: it is used for predictions only ({split}_predictions.jsonl)"
            for split in data.unlabelled
        ]
        return "\n".join(lines)

    def describe_metrics(self, metrics: dict) -> str:
        return (
            f"accuracy {metrics['accuracy']:.4f} | macro_f1 {metrics['macro_f1']:.4f} | "
            f"loss {metrics['loss']:.4f} ({metrics['samples']} examples)"
        )

    def inference_hint(self, output_dir: str) -> str:
        pair = ' --text_pair "..."' if self.cfg and self.cfg.data.text_pair_column else ""
        return f'{invocation.command()} predict --model_dir {shlex.quote(output_dir)} --text "..."{pair}'
