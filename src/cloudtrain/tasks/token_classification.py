"""Token classification (`--task token_classification`): a tag per word (named entities, parts of speech, chunks).

Supports: rows of words and tags (CoNLL-2003's `tokens`/`ner_tags` are read without options; else --text_column
and --label_column), lists or whitespace-separated texts, tags as names, ids or a `Sequence(ClassLabel)`; IOB2,
IOB1, IOBES/BILOU and IO tags; each word's tag trained on its first token; entity-level precision, recall and F1
(seqeval's default mode), word accuracy and each entity type's F1; unlabelled evaluation splits (each word's tag in
`<split>_predictions.jsonl`); `cloudtrain predict` (entities with character offsets); adapters, both trainers and the
Hub push as `--task classification`.
Does not support: text pairs, tags on every sub-word token, words longer than --max_length tokens in all (the words
past it are neither trained nor evaluated).
"""

import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import DatasetDict
from huggingface_hub import ModelCard
from transformers import AutoModelForTokenClassification, PretrainedConfig, PreTrainedTokenizerBase

from cloudtrain.config import Config
from cloudtrain.data.processing import ProcessedData
from cloudtrain.data.word_tags import (
    IGNORED,
    joins_words,
    process_word_tags,
    space_words,
    with_conll_columns,
)
from cloudtrain.entities import entity_scores, entity_spans
from cloudtrain.errors import UserError
from cloudtrain.evaluation import eval_mode
from cloudtrain.models.load import head_labels, load_tokenizer
from cloudtrain.publish.classifier_card import build_model_card
from cloudtrain.publish.saving import write_jsonl
from cloudtrain.registry import TASKS
from cloudtrain.tasks.classification import ClassificationTask


@TASKS.register
class TokenClassificationTask(ClassificationTask):
    name = "token_classification"
    summary = "a tag per word: named entities, parts of speech"
    metrics: tuple[str, ...] = ("f1", "precision", "recall", "accuracy", "loss")
    default_best_metric = "f1"
    auto_class = AutoModelForTokenClassification
    load_error = "could not load a token-classification model"
    peft_task_type = "TOKEN_CLS"
    head = "ForTokenClassification"

    def check_options(self, cfg: Config) -> None:
        if cfg.data.text_pair_column:
            raise UserError("--task token_classification tags the words of one text; drop --text_pair_column")
        super().check_options(cfg)

    def connect(self, cfg: Config) -> DatasetDict:
        """The raw splits, holding the columns `with_conll_columns` reads."""
        from cloudtrain.data.sources import check_columns, connect_data

        raw = connect_data(cfg.data, {})
        check_columns(raw, self.columns(with_conll_columns(cfg.data, raw["train"].column_names)))
        return raw

    def load_tokenizer(self, cfg: Config) -> PreTrainedTokenizerBase:
        """The model's tokenizer; a byte-level BPE one (RoBERTa's, GPT-2's) with a space before every word, so a
        word is tokenized as in running text, not as the start of one (saved with the model: `predict` does so too)."""
        tokenizer = load_tokenizer(cfg.model)
        if joins_words(tokenizer):
            tokenizer = load_tokenizer(cfg.model, add_prefix_space=True)  # the classes of GPT-2 and RoBERTa keep it
            space_words(tokenizer)  # one that ignores the option (PreTrainedTokenizerFast) keeps it in tokenizer.json
        return tokenizer

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        data = with_conll_columns(cfg.data, raw["train"].column_names)
        return process_word_tags(raw, tokenizer, data, cfg.training.seed, head_labels(cfg.model, self.head))

    def build_config(self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
        config = super().build_config(cfg, data, tokenizer)
        config.problem_type = None  # a sequence classifier's; a token classifier's loss has none
        return config

    def loss_count(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] != IGNORED).sum()

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy summed over the words' first tokens."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORED, reduction="sum")
        return loss, self.loss_count(batch)

    def _padded(self, t: torch.Tensor, value: float) -> torch.Tensor:
        """A batch's [rows, tokens] padded to --max_length tokens: every process gathers the same width."""
        assert self.cfg is not None
        return F.pad(t, (0, self.cfg.data.max_length - t.shape[1]), value=value)

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
        references: list[list[str]] = []
        predictions: list[list[str]] = []
        loss_sum = tokens = 0.0
        start = time.perf_counter()
        with eval_mode(model):
            for batch in batches:
                batch = move(batch)
                labels = batch.pop("labels").long()
                with autocast():
                    logits = model(**batch).logits.float()
                losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORED, reduction="none")
                counted = labels != IGNORED
                pred, ref, loss, count = gather(
                    (
                        self._padded(logits.argmax(-1), IGNORED),
                        self._padded(labels, IGNORED),
                        losses.sum(-1),
                        counted.sum(-1),
                    )
                )
                loss_sum, tokens = loss_sum + loss.sum().item(), tokens + count.sum().item()
                for p, r in zip(pred.cpu(), ref.cpu(), strict=True):
                    kept = r != IGNORED
                    references.append([data.label_names[i] for i in r[kept].tolist()])
                    predictions.append([data.label_names[i] for i in p[kept].tolist()])
        runtime = time.perf_counter() - start
        return {
            **entity_scores(references, predictions),
            "loss": loss_sum / tokens if tokens else 0.0,
            "samples": len(references),
            "runtime_s": round(runtime, 3),
            "samples_per_s": round(len(references) / runtime, 2),
        }

    def tables(self, metrics: dict) -> dict[str, tuple[list[str], list[list]]]:
        """Each entity type's F1, logged as a table with the evaluation."""
        return {"entity_f1": (["type", "f1"], [[kind, f1] for kind, f1 in metrics.get("entity_f1", {}).items()])}

    @torch.no_grad()
    def predict(
        self, model: torch.nn.Module, batches: Iterable[dict], gather: Callable, move: Callable, autocast: Callable
    ) -> tuple[list, list]:
        """Each word's tag id and its probability, per row of an unlabelled split, in the split's order (the words
        cut off at --max_length have none)."""
        ids: list[list[int]] = []
        scores: list[list[float]] = []
        with eval_mode(model):
            for batch in batches:
                batch = move(batch)
                starts = (batch.pop("labels") != IGNORED).long()  # each word's first token (word_tags marks them)
                with autocast():
                    probs, best = model(**batch).logits.float().softmax(-1).max(-1)
                best, probs, starts = gather(
                    (self._padded(best, IGNORED), self._padded(probs, 0.0), self._padded(starts, 0))
                )
                for b, p, s in zip(best.cpu(), probs.cpu(), starts.cpu(), strict=True):
                    ids.append(b[s.bool()].tolist())
                    scores.append(p[s.bool()].tolist())
        return ids, scores

    def write_predictions(self, output_dir: Path, data: ProcessedData, split: str, predicted: tuple) -> None:
        rows = []
        for words, ids, scores in zip(data.unlabelled_texts[split], *predicted, strict=True):
            tags = [data.label_names[i] for i in ids]
            entities = [
                {
                    "type": kind,
                    "text": " ".join(words[a:b]),
                    "start": a,
                    "end": b,
                    "score": round(sum(scores[a:b]) / (b - a), 4),
                }
                for kind, a, b in entity_spans(tags)
            ]
            rows.append({"words": words, "tags": tags + [None] * (len(words) - len(tags)), "entities": entities})
        write_jsonl(Path(output_dir) / f"{split}_predictions.jsonl", rows)

    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        return build_model_card(output_dir, cfg, results, kind="token_classification")

    def describe_data(self, data: ProcessedData) -> str:
        test = f" / {len(data.test)} test" if data.test is not None else ""
        lines = [
            f"data: {len(data.train)} train / {len(data.validation)} validation{test} rows, "
            f"{len(data.label_names)} tags: {', '.join(data.label_names)}"
        ]
        lines += [f"the {split} data has no tags: it is used for predictions only" for split in data.unlabelled]
        return "\n".join(lines)

    def describe_metrics(self, metrics: dict) -> str:
        return (
            f"f1 {metrics['f1']:.4f} | precision {metrics['precision']:.4f} | recall {metrics['recall']:.4f} | "
            f"accuracy {metrics['accuracy']:.4f} | loss {metrics['loss']:.4f} ({metrics['samples']} rows)"
        )
