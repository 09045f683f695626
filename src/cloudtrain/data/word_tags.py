"""The data of `--task token_classification`: one tag per word (named entities, parts of speech, chunks).

A row is its words and their tags. Words: a list per row (JSON lines, Parquet, a Hub `Sequence` column such as
CoNLL-2003's `tokens`) or a text split at whitespace (CSV). Tags: a list per row (a `Sequence(ClassLabel)` read by
its names, such as CoNLL-2003's `ner_tags`; strings; whole-number ids) or a text of tags split at whitespace, one
tag per word. The tag names are the `ClassLabel`'s, else the training data's, sorted with "O" first; a checkpoint's
token-classification head keeps its order where it has the same names.

Each word's tag goes to its first sub-word token; the word's other tokens and the special tokens are left out of
the loss and the metrics (-100), as transformers' token-classification examples do. Words past --max_length tokens
are cut off: neither trained on nor evaluated. An evaluation split without the tag column, or without a tag in any
row, is for predictions only: its `labels` mark each word's first token with 0 (the rest -100), so that the
predictions are read back one per word.
"""

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import datasets
from datasets import ClassLabel, Dataset, DatasetDict
from tokenizers import pre_tokenizers
from transformers import DataCollatorForTokenClassification, PreTrainedTokenizerBase

from cloudtrain.config import DataConfig
from cloudtrain.data.processing import LabelScheme, ProcessedData, cached_map, choose_rows, split_cache_key
from cloudtrain.errors import UserError

IGNORED = -100  # a token outside the loss and the metrics (transformers' ignore index)
CONLL_COLUMNS = {"text_column": "tokens", "label_column": "ner_tags"}  # what CoNLL-2003 and its kin name them


def with_conll_columns(cfg: DataConfig, columns: list[str]) -> DataConfig:
    """`cfg` reading CoNLL's column names where --text_column/--label_column are at their defaults, the training
    data (`columns`) has no such column and has CoNLL's."""
    defaults = DataConfig()
    text, label = (
        conll if given == default and given not in columns and conll in columns else given
        for given, default, conll in (
            (cfg.text_column, defaults.text_column, CONLL_COLUMNS["text_column"]),
            (cfg.label_column, defaults.label_column, CONLL_COLUMNS["label_column"]),
        )
    )
    return replace(cfg, text_column=text, label_column=label)


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
    return ProcessedData(
        train=splits["train"],
        validation=splits["validation"],
        test=splits.get("test"),
        collator=DataCollatorForTokenClassification(tokenizer, label_pad_token_id=IGNORED),
        label_names=scheme.names,
        unlabelled={split: _encode(ds, split, tokenizer, cfg, None) for split, ds in unlabelled.items()},
        unlabelled_texts={split: [read[split](v) for v in ds[cfg.text_column]] for split, ds in unlabelled.items()},
    )


def tag_scheme(raw: DatasetDict, cfg: DataConfig, order: list[str] | None = None) -> LabelScheme:
    """The tag column read as a list of tag ids per row."""
    column = cfg.label_column
    names = tag_names(raw["train"], column)
    if len(names) < 2:
        raise UserError(
            f"the training data has {len(names)} distinct tag(s) in {column!r}; --task token_classification needs at "
            "least 2 (a list of tags per row, one per word)"
        )
    if order is not None and sorted(order) == sorted(names):
        names = list(order)  # the head keeps its rows
    index = {name: i for i, name in enumerate(names)}

    def encoder(ds: Dataset) -> Callable[[Any], list[int]]:
        read = read_tags(ds, column)
        return lambda value: [index[tag] for tag in read(value)]

    def labelled(ds: Dataset, split: str) -> bool:
        if column not in ds.column_names:
            return False
        read = read_tags(ds, column)
        found = {tag for value in ds[column] for tag in read(value)}
        if not found:
            return False
        unseen = found - set(index)
        if unseen:
            raise UserError(
                f"the {split} data has tags the training data never saw: {', '.join(sorted(unseen)[:10])}; "
                "fix the tags or move those rows into the training data"
            )
        return True

    return LabelScheme(
        names=names,
        encoder=encoder,
        feature=datasets.List(datasets.Value("int32")),
        key=[names, "word-tags"],
        labelled=labelled,
        strata=lambda train: None,  # no one class per row to stratify the carve by
    )


def tag_names(train: Dataset, column: str) -> list[str]:
    """A `Sequence(ClassLabel)`'s names; else the tags of the training rows, sorted with "O" (outside) first."""
    inner = getattr(train.features[column], "feature", None)
    if isinstance(inner, ClassLabel):
        return list(inner.names)
    read = read_tags(train, column)
    found = {tag for value in train[column] for tag in read(value)}
    return sorted(found, key=lambda tag: (tag != "O", tag))


def check_rows(ds: Dataset, split: str, cfg: DataConfig) -> None:
    """Every row with tags has one per word (a split without the tag column, or a row without tags in an
    evaluation split, is for predictions); the training data has words."""
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
    for i, (row, value) in enumerate(zip(rows, ds[cfg.label_column], strict=True)):
        n = len(tags(value))
        if n != len(row) and (n or split == "train"):
            raise UserError(
                f"row {i} of the {split} data has {len(row)} words in {cfg.text_column!r} and {n} tags in "
                f"{cfg.label_column!r}; --task token_classification needs one tag per word"
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
    """value -> the row's tag names, for this split's column type."""
    feature = ds.features[column]
    inner = getattr(feature, "feature", None)
    if isinstance(inner, ClassLabel):
        return lambda value: [inner.int2str(int(i)) for i in value or []]
    if inner is not None:
        return lambda value: [_tag(v) for v in value or []]
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        return lambda value: (value or "").split()
    raise UserError(
        f"the {column!r} column holds {feature}, not a row's tags: --task token_classification reads a list of tags "
        "per row (names or whole-number ids), or a text of tags split at whitespace"
    )


def _tag(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():  # ids read as floats (a null among them)
        return str(int(value))
    return str(value).strip()


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
        out.append(IGNORED if word is None or word == previous else tags[word])
        previous = word
    return out


def _encode(
    ds: Dataset, split: str, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, scheme: LabelScheme | None
) -> Dataset:
    """Tokenized rows with each word's tag on its first token; without `scheme`, 0 there (predictions only)."""
    words_of = read_words(ds, cfg.text_column)
    tags_of = scheme.encoder(ds) if scheme is not None else None

    def encode(batch: dict) -> dict:
        words = [words_of(value) for value in batch[cfg.text_column]]
        encoded = tokenizer(words, is_split_into_words=True, truncation=True, max_length=cfg.max_length)
        out = {name: encoded[name] for name in tokenizer.model_input_names}
        tags = [tags_of(value) for value in batch[cfg.label_column]] if tags_of else [[0] * len(w) for w in words]
        out["labels"] = [aligned(encoded.word_ids(i), row) for i, row in enumerate(tags)]
        return out

    features = datasets.Features({name: datasets.List(datasets.Value("int32")) for name in tokenizer.model_input_names})
    features["labels"] = datasets.List(datasets.Value("int32"))
    names = [*scheme.key, "words"] if scheme is not None else ["words"]
    key = split_cache_key(ds, tokenizer, cfg, [cfg.text_column], names)
    return cached_map(ds, encode, features, cfg, split, key, f"Tokenizing {split}")
