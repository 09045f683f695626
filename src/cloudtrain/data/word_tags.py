"""The data of `--task token_classification`: one tag per word (named entities, parts of speech, chunks).

A row is its words and their tags. Words: a list per row (JSON lines, Parquet, a Hub `Sequence` column such as
CoNLL-2003's `tokens`) or a text split at whitespace (CSV). Tags: a list of names per row (a `Sequence(ClassLabel)` is
read by its names, such as CoNLL-2003's `ner_tags`) or a text of names split at whitespace, one tag per word; bare ids
are refused, since entities are read from the names. The tag names are the `ClassLabel`'s, else the training data's,
sorted with "O" first; a checkpoint's token-classification head keeps its order where it has the same names.

Each word's tag goes to its first sub-word token; the word's other tokens and the special tokens are left out of
the loss and the metrics (-100), as transformers' token-classification examples do. Words past --max_length tokens
are cut off: neither trained on nor evaluated. An evaluation split without the tag column, or without a tag in any
row, is for predictions only: its `labels` hold each word's index on the word's first token (the rest -100), so that
the predictions are read back per word.
"""

import json
from collections.abc import Callable
from typing import Any

import datasets
from datasets import ClassLabel, Dataset, DatasetDict
from tokenizers import pre_tokenizers
from transformers import DataCollatorForTokenClassification, PreTrainedTokenizerBase

from cloudtrain.config import DataConfig
from cloudtrain.data.multi_labels import label_names, reader
from cloudtrain.data.packing import IGNORE_INDEX
from cloudtrain.data.processing import (
    LabelScheme,
    ProcessedData,
    cached_map,
    choose_rows,
    refuse_unseen,
    split_cache_key,
)
from cloudtrain.errors import UserError

HOW_TAGS = "--task token_classification reads a list of tags per row (names), or a text of tags split at whitespace"
CONLL_COLUMNS = {"text_column": "tokens", "label_column": "ner_tags"}  # what CoNLL-2003 and its kin name them


class RightPaddedTags(DataCollatorForTokenClassification):
    """transformers' token-classification collator, padding on the right whatever the tokenizer's side, as
    processing.RightPadded does for sentences (and `predict` for both): a decoder of learned positions read a
    left-padded row at shifted positions."""

    def __call__(self, features: list[dict], return_tensors: str | None = None) -> dict:
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "right"
        try:
            return super().__call__(features, return_tensors)
        finally:
            self.tokenizer.padding_side = side


def process_word_tags(
    raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, seed: int, order: list[str] | None = None
) -> ProcessedData:
    """Every split tokenized word by word, with its tags on each word's first token; `order`: the tag names of a
    checkpoint's token-classification head."""
    for split, ds in raw.items():
        check_rows(ds, split, cfg)
    scheme = tag_scheme(raw, cfg, order)
    chosen, unlabelled = choose_rows(raw, scheme, cfg, seed)
    splits = {split: _encode(ds, split, tokenizer, cfg, scheme) for split, ds in chosen.items()}
    read = {split: read_words(ds, cfg.text_column) for split, ds in unlabelled.items()}
    unscored = {split: unscored_words(chosen[split], rows, scheme, cfg) for split, rows in splits.items()}
    lost, total, _ = unscored["train"]
    if total and lost == total:  # it trained on nothing, and logged a loss of 0 as if perfect
        raise UserError(
            f"none of the {total} training words keeps a token within --max_length {cfg.max_length}: nothing to "
            "train on; raise --max_length, or check the words (text the tokenizer reads as nothing)"
        )
    return ProcessedData(
        train=splits["train"],
        validation=splits["validation"],
        test=splits.get("test"),
        collator=RightPaddedTags(tokenizer, label_pad_token_id=IGNORE_INDEX),
        label_names=scheme.names,
        unlabelled={split: _encode(ds, split, tokenizer, cfg, None) for split, ds in unlabelled.items()},
        unlabelled_texts={split: [read[split](v) for v in ds[cfg.text_column]] for split, ds in unlabelled.items()},
        extras={"unscored": {split: counts for split, counts in unscored.items() if counts[0]}},
    )


def unscored_words(ds: Dataset, encoded: Dataset, scheme: LabelScheme, cfg: DataConfig) -> tuple[int, int, int]:
    """(words with no token, all words, tagged words among the first) of a split: past --max_length, or tokenized to
    nothing (a zero-width space); neither trained nor scored."""
    outside = scheme.names.index("O") if "O" in scheme.names else None
    tags_of = scheme.encoder(ds)
    lost = tagged = total = 0
    for value, labels in zip(ds[cfg.label_column], encoded["labels"], strict=True):
        tags = tags_of(value)
        kept = {i for i, label in enumerate(labels) if label != IGNORE_INDEX}
        total += len(tags)
        lost += len(tags) - len(kept)
        tagged += sum(tag != outside for tag in tags) - sum(labels[i] != outside for i in kept)
    return lost, total, tagged


def tag_scheme(raw: DatasetDict, cfg: DataConfig, order: list[str] | None = None) -> LabelScheme:
    """The tag column read as a list of tag ids per row."""
    column = cfg.label_column
    names = tag_names(raw["train"], column)
    if len(names) < 2:
        raise UserError(
            f"the training data has {len(names)} distinct tag(s) in {column!r}; --task token_classification needs at "
            "least 2 (a list of tags per row, one per word)"
        )
    if order is not None and set(names) <= set(order):
        names = list(order)  # the head keeps its rows, also a tag this data lacks (a NER model's MISC)
    index = {name: i for i, name in enumerate(names)}

    def encoder(ds: Dataset) -> Callable[[Any], list[int]]:
        read = read_tags(ds, column)
        return lambda value: [index[tag] for tag in read(value)]

    def labelled(ds: Dataset, split: str) -> bool:
        if column not in ds.column_names:
            return False
        read = read_tags(ds, column)
        found = {tag for value in ds[column] for tag in read(value)}
        refuse_unseen(split, found - set(index), "tags")
        return bool(found)

    return LabelScheme(
        names=names,
        encoder=encoder,
        feature=datasets.List(datasets.Value("int32")),
        key=[names, "word-tags"],
        labelled=labelled,
        strata=lambda train: None,  # no one class per row to stratify the carve by
    )


def tag_names(train: Dataset, column: str) -> list[str]:
    """A `Sequence(ClassLabel)`'s names; else the tags of the training rows, sorted with "O" (outside) first. Bare ids
    are refused: entities are read from the tags' names."""
    names = label_names(train, column, None, HOW_TAGS)
    if isinstance(getattr(train.features[column], "feature", None), ClassLabel):
        return names
    if names and all(name.lstrip("-").isdigit() for name in names):
        raise UserError(
            f"the {column!r} column holds tag ids ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) without "
            "their names: entities are read from names such as B-PER, I-PER and O; write the names in the data, or "
            "load the Hub dataset, whose tag column carries them"
        )
    return sorted(names, key=lambda tag: tag != "O")  # stable: the rest stay sorted


def check_rows(ds: Dataset, split: str, cfg: DataConfig) -> None:
    """Every row with tags has one per word, and an evaluation split has tags in every row with words or in none
    (then it is for predictions); the training data has words."""
    words = read_words(ds, cfg.text_column)
    rows = [words(value) for value in ds[cfg.text_column]]
    if split == "train" and not any(rows):
        raise UserError(
            f"the training data has no words in column {cfg.text_column!r}; give a list of words per row (or a text), "
            "or pass --text_column <name>"
        )
    if cfg.label_column not in ds.column_names:
        return
    tags = read_tags(ds, cfg.label_column)
    counts = [len(tags(value)) for value in ds[cfg.label_column]]
    untagged = sum(1 for row, n in zip(rows, counts, strict=True) if row and not n)
    worded = sum(1 for row in rows if row)
    if split != "train" and 0 < untagged < worded:
        raise UserError(
            f"{untagged} of the {worded} rows with words of the {split} data have no tags; tag them or drop them (a "
            f"{split} split with no tags at all is used for predictions only)"
        )
    for i, (row, n) in enumerate(zip(rows, counts, strict=True)):
        if n != len(row) and (n or split == "train"):
            raise UserError(
                f"row {i} of the {split} data has {len(row)} words in {cfg.text_column!r} and {n} tags in "
                f"{cfg.label_column!r} (an empty tag is none); --task token_classification needs one tag per word"
            )


def read_words(ds: Dataset, column: str) -> Callable[[Any], list[str]]:
    """value -> the row's words, for this split's column type: a list of words, or a text split at whitespace."""
    feature = ds.features[column]
    if getattr(feature, "feature", None) is not None:
        return lambda value: ["" if word is None else str(word) for word in value or []]
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        return lambda value: (value or "").split()
    raise UserError(
        f"the {column!r} column holds {feature}, not a row's words: --task token_classification reads a list of words "
        "per row, or a text split at whitespace"
    )


def read_tags(ds: Dataset, column: str) -> Callable[[Any], list[str]]:
    """value -> the row's tag names, for this split's column type (cloudtrain.data.multi_labels reads them as a row's
    labels: a text is split at whitespace; a null, or a `ClassLabel` -1, is no tag)."""
    return reader(ds, column, None, HOW_TAGS)


def joins_words(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer reads each given word as if no space came before it: a byte-level BPE one (GPT-2's,
    RoBERTa's) without `add_prefix_space`, which would read the word "Paris" as "Paris", not as the "ĠParis" of
    running text. (A pre-tokenizer that splits before its byte-level step, as Llama 3's, is left as it is: a space
    before each of its pieces would break words apart.)"""
    spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    return spec.get("type") == "ByteLevel" and not spec.get("add_prefix_space")


def space_words(tokenizer: PreTrainedTokenizerBase) -> None:
    """Make a `joins_words` tokenizer put a space before each word, in its tokenizer.json (a tokenizer class that
    takes `add_prefix_space` should be loaded with it instead: it would reset this from its own option)."""
    if joins_words(tokenizer):
        spec = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
            add_prefix_space=True, use_regex=spec.get("use_regex", True)
        )


def aligned(word_ids: list[int | None], tags: list[int]) -> list[int]:
    """Per token: the tag of the word it starts, or -100 (a word's later tokens, special tokens)."""
    out, previous = [], None
    for word in word_ids:
        out.append(IGNORE_INDEX if word is None or word == previous else tags[word])
        previous = word
    return out


def _encode(
    ds: Dataset, split: str, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, scheme: LabelScheme | None
) -> Dataset:
    """Tokenized rows with each word's tag on its first token; without `scheme` (predictions only), the word's
    index there: a word that tokenizes to nothing (a zero-width space) or is cut off has no token to predict from."""
    words_of = read_words(ds, cfg.text_column)
    tags_of = scheme.encoder(ds) if scheme is not None else None

    def encode(batch: dict) -> dict:
        words = [words_of(value) for value in batch[cfg.text_column]]
        encoded = tokenizer(words, is_split_into_words=True, truncation=True, max_length=cfg.max_length)
        out = {name: encoded[name] for name in tokenizer.model_input_names}
        tags = [tags_of(v) for v in batch[cfg.label_column]] if tags_of else [list(range(len(w))) for w in words]
        out["labels"] = [aligned(encoded.word_ids(i), row) for i, row in enumerate(tags)]
        return out

    features = datasets.Features({name: datasets.List(datasets.Value("int32")) for name in tokenizer.model_input_names})
    features["labels"] = datasets.List(datasets.Value("int32"))
    # unlabelled rows hold word indices where labelled ones hold tags: a key of their own
    names = [*scheme.key, "words"] if scheme is not None else ["word-index"]
    key = split_cache_key(ds, tokenizer, cfg, [cfg.text_column], names)
    return cached_map(ds, encode, features, cfg, split, key, f"Tokenizing {split}")
