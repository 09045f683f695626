"""Token classification (`--task token_classification`): a tag per word (named entities, parts of speech, chunks).

Supports: rows of words and tags (CoNLL-2003's `tokens`/`ner_tags` are read without options; else --text_column
and --label_column), lists or whitespace-separated texts, tags as names or a `Sequence(ClassLabel)`; IOB2,
IOB1, IOBES/BILOU and IO tags; each word's tag trained on its first token; entity-level precision, recall and F1
(seqeval's default mode), word accuracy and each entity type's F1; unlabelled evaluation splits (each word's tag in
`<split>_predictions.jsonl`); `cloudtrain predict` (entities with character offsets); adapters, both trainers and the
Hub push as `--task classification`.
Does not support: text pairs, tags on every sub-word token, bare tag ids (entities are read from names), rows longer
than --max_length tokens (the words past it are neither trained nor evaluated).
"""

import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import DatasetDict
from huggingface_hub import ModelCard
from transformers import AutoModelForTokenClassification, PretrainedConfig, PreTrainedTokenizerBase

from cloudtrain.config import Config
from cloudtrain.data.packing import IGNORE_INDEX
from cloudtrain.data.processing import ProcessedData
from cloudtrain.data.word_tags import (
    CONLL_COLUMNS,
    joins_words,
    process_word_tags,
    space_words,
)
from cloudtrain.entities import entity_scores, scored_entities
from cloudtrain.errors import UserError
from cloudtrain.evaluation import eval_mode, pad_to_width
from cloudtrain.models.load import head_labels, load_tokenizer
from cloudtrain.publish.classifier_card import CardKind, build_model_card
from cloudtrain.publish.saving import write_jsonl
from cloudtrain.registry import TASKS
from cloudtrain.registry_table import TASK_ROWS
from cloudtrain.tasks.classification import ClassificationTask

# its card: a tag per token, entity-level scores
CARD = CardKind(
    purpose="token classification (a tag per word, entity-level scores) with {{ labels | length }} tags",
    metrics=(
        ("f1", "f1", "F1", None),
        ("precision", "precision", "Precision", None),
        ("recall", "recall", "Recall", None),
        ("accuracy", "accuracy", "Accuracy", None),
    ),
    pipeline=("token-classification", "Token Classification", "AutoPeftModelForTokenClassification"),
    output="tags = model(**inputs).logits.argmax(-1)[0].tolist()\n"
    "print([model.config.id2label[i] for i in tags])  # a tag per token: the first of each word is the word's",
    pipeline_options=', aggregation_strategy="first"',
)


@TASKS.register
class TokenClassificationTask(ClassificationTask):
    name = "token_classification"
    summary = "a tag per word: named entities, parts of speech"
    reads_options = TASK_ROWS[name].reads_options  # the row says it for the parser too
    metrics: tuple[str, ...] = ("f1", "precision", "recall", "accuracy", "loss")
    default_best_metric = "f1"
    auto_class = AutoModelForTokenClassification
    load_error = "could not load a token-classification model"
    peft_task_type = "TOKEN_CLS"
    head = "ForTokenClassification"
    nouns = ("rows", "tags")
    named_columns = CONLL_COLUMNS

    def check_options(self, cfg: Config) -> None:
        if cfg.data.text_pair_column:
            raise UserError("--task token_classification tags the words of one text; drop --text_pair_column")
        super().check_options(cfg)

    def load_tokenizer(self, cfg: Config) -> PreTrainedTokenizerBase:
        """The model's tokenizer; a byte-level BPE one (RoBERTa's, GPT-2's) with a space before every word, so a
        word is tokenized as in running text, not as the start of one (saved with the model: `predict` does so too)."""
        tokenizer = load_tokenizer(cfg.model)
        if joins_words(tokenizer):
            tokenizer = load_tokenizer(cfg.model, add_prefix_space=True)  # the classes of GPT-2 and RoBERTa keep it
            space_words(tokenizer)  # one that ignores the option (PreTrainedTokenizerFast) keeps it in tokenizer.json
        return tokenizer

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        data = self.data_options(cfg, raw)
        return process_word_tags(raw, tokenizer, data, cfg.training.seed, head_labels(cfg.model, self.head))

    def build_config(self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
        config = super().build_config(cfg, data, tokenizer)
        config.problem_type = None  # a sequence classifier's; a token classifier's loss has none
        return config

    def loss_count(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy summed over the words' first tokens."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits.float()
        loss = F.cross_entropy(
            logits.flatten(0, 1),
            batch["labels"].flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
            label_smoothing=self.smoothing(),
        )
        return loss, self.loss_count(batch)

    def _padded(self, t: torch.Tensor, value: float) -> torch.Tensor:
        assert self.cfg is not None
        return pad_to_width(t, self.cfg.data.max_length, value)

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
                losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
                counted = labels != IGNORE_INDEX
                pred, ref, loss, count = gather(
                    (
                        self._padded(logits.argmax(-1), IGNORE_INDEX),
                        self._padded(labels, IGNORE_INDEX),
                        losses.sum(-1),
                        counted.sum(-1),
                    )
                )
                loss_sum, tokens = loss_sum + loss.sum().item(), tokens + count.sum().item()
                for p, r in zip(pred.cpu(), ref.cpu(), strict=True):
                    kept = r != IGNORE_INDEX
                    references.append([data.label_names[i] for i in r[kept].tolist()])
                    predictions.append([data.label_names[i] for i in p[kept].tolist()])
        runtime = time.perf_counter() - start
        return {
            **entity_scores(references, predictions),
            "loss": loss_sum / tokens if tokens else math.nan,  # no scored word: no loss, not a perfect one
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
        """Per row of an unlabelled split, in the split's order: {word index: tag id} and {word index: probability},
        for each word with a token to predict from (word_tags put each word's index on its first token)."""
        ids: list[dict[int, int]] = []
        scores: list[dict[int, float]] = []
        with eval_mode(model):
            for batch in batches:
                batch = move(batch)
                words = batch.pop("labels")
                with autocast():
                    probs, best = model(**batch).logits.float().softmax(-1).max(-1)
                padded = (self._padded(best, IGNORE_INDEX), self._padded(probs, 0.0), self._padded(words, IGNORE_INDEX))
                for b, p, w in zip(*(t.cpu() for t in gather(padded)), strict=True):
                    at = w != IGNORE_INDEX
                    ids.append(dict(zip(w[at].tolist(), b[at].tolist(), strict=True)))
                    scores.append(dict(zip(w[at].tolist(), p[at].tolist(), strict=True)))
        return ids, scores

    def write_predictions(self, output_dir: Path, data: ProcessedData, split: str, predicted: tuple) -> None:
        """Each row's words, their tags (null for a word with no token: cut off at --max_length, or tokenized to
        nothing) and its entities, with word offsets."""
        rows = []
        for words, ids, probs in zip(data.unlabelled_texts[split], *predicted, strict=True):
            tags = [data.label_names[ids[i]] if i in ids else None for i in range(len(words))]
            found = scored_entities(tags, [probs.get(i, 0.0) for i in range(len(words))])
            entities = [
                {"type": kind, "text": " ".join(words[a:b]), "start": a, "end": b, "score": score}
                for kind, a, b, score in found
            ]
            rows.append({"words": words, "tags": tags, "entities": entities})
        write_jsonl(Path(output_dir) / f"{split}_predictions.jsonl", rows)

    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        return build_model_card(output_dir, cfg, results, CARD)

    def describe_data(self, data: ProcessedData) -> str:
        notes = [
            f"\nnote: {lost} of the {total} {split} words ({tagged} tagged other than O) have no token within "
            f"--max_length {self.cfg.data.max_length if self.cfg else '?'} (or tokenize to nothing): they are "
            f"neither trained nor scored"
            for split, (lost, total, tagged) in data.extras.get("unscored", {}).items()
        ]
        return super().describe_data(data) + "".join(notes)

    def describe_metrics(self, metrics: dict) -> str:
        return (
            f"f1 {metrics['f1']:.4f} | precision {metrics['precision']:.4f} | recall {metrics['recall']:.4f} | "
            f"accuracy {metrics['accuracy']:.4f} | loss {metrics['loss']:.4f} ({metrics['samples']} rows)"
        )
