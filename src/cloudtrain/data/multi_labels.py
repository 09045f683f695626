"""The label column of `--task multi_label`: any number of labels per row, as a multi-hot row.

A row's labels are a list (JSON lines, Parquet, a Hub `Sequence` column; ids of a `Sequence(ClassLabel)` by its
names), a multi-hot vector (rows of one length N of 0/1, label i present where position i is 1, the labels named
"0".."N-1"; told apart from a list of ids by a row that repeats a value), one text with the labels between
`--label_separator`s (CSV), or one whole-number id. An empty list, an empty text or no value is a row to which no
label applies. The names are a `Sequence(ClassLabel)`'s, else the training data's in order (numbers by value); a
checkpoint head's order is kept where it has the same names. Each split is read by its own column's type (a JSON
lines train and a CSV validation mix). An evaluation split with labels the training data never saw is an error; one
without the label column, or with no label in any row, is for predictions only.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import datasets
from datasets import ClassLabel, Dataset, DatasetDict

from cloudtrain.config import DataConfig
from cloudtrain.data.processing import LabelScheme, is_missing, refuse_unseen, sorted_names
from cloudtrain.errors import UserError


def multi_label_scheme(raw: DatasetDict, cfg: DataConfig, order: list[str] | None = None) -> LabelScheme:
    """The multi-hot encoding of `cfg.label_column` over the label names; `order`: a checkpoint head's names."""
    column, separator = cfg.label_column, cfg.label_separator
    width = multi_hot_width(raw["train"], column)
    names = multi_hot_names(raw["train"], column, width) if width else label_names(raw["train"], column, separator)
    if len(names) < 2:
        raise UserError(
            f"the training data has {len(names)} distinct label(s) in {column!r}; --task multi_label needs at least 2 "
            "(a column of lists, or texts of labels between --label_separator)"
        )
    if order is not None and sorted(order) == sorted(names):
        names = list(order)  # the head keeps its rows
    index = {name: i for i, name in enumerate(names)}

    def read_split(ds: Dataset) -> Callable[[Any], list[str]]:
        if width:
            return lambda value: [str(i) for i, bit in enumerate(value or []) if bit]
        return reader(ds, column, separator)

    def encoder(ds: Dataset) -> Callable[[Any], list[float]]:
        read = read_split(ds)

        def encode(value: Any) -> list[float]:
            row = [0.0] * len(names)
            for name in read(value):
                row[index[name]] = 1.0
            return row

        return encode

    def labelled(ds: Dataset, split: str) -> bool:
        if column not in ds.column_names or all(is_empty(value) for value in ds[column]):
            return False
        check_multi_hot(ds, column, width, split)
        read = read_split(ds)
        refuse_unseen(split, {name for value in ds[column] for name in read(value)} - set(index))
        return True

    return LabelScheme(
        names=names,
        encoder=encoder,
        feature=datasets.List(datasets.Value("float32")),
        key=[names, "multi-hot", separator, width],
        labelled=labelled,
        strata=lambda train: None,  # no one class per row to stratify by
    )


def label_names(train: Dataset, column: str, separator: str | None, how: str = "") -> list[str]:
    """A `Sequence(ClassLabel)`'s names; else those in the training rows, numbers by value, others sorted.
    `separator` and `how`: as `reader` takes them."""
    inner = getattr(train.features[column], "feature", None)
    if isinstance(inner, ClassLabel):
        return list(inner.names)
    read = reader(train, column, separator, how)
    found = {name for value in train[column] for name in read(value)}
    return sorted_names(found)


def multi_hot_width(ds: Dataset, column: str, train: bool = True) -> int | None:
    """N where the column's rows are multi-hot vectors of N labels: more than half the labelled rows of a numeric
    list column are lists of 0/1 of one length N >= 2, and some repeat a value (any such vector longer than 2 does;
    a list of ids has no reason to) or, in training data of such rows alone, all read as ids alike (every row the
    labels 0 and 1: nothing to learn). None: lists of ids or names, read as before (a row [1, 1] among them too)."""
    inner = getattr(ds.features[column], "feature", None)
    if not isinstance(inner, datasets.Value) or inner.dtype in ("string", "large_string"):
        return None
    rows = [v for v in ds[column] if not is_empty(v)]
    lengths = Counter(len(v) for v in rows if _bits(v))
    if not lengths:
        return None
    width, count = lengths.most_common(1)[0]
    vectors = [v for v in rows if _bits(v) and len(v) == width]
    repeats = any(len(set(v)) < width for v in vectors)
    alike = train and count == len(rows) and len({frozenset(v) for v in vectors}) == 1
    return width if width >= 2 and 2 * count > len(rows) and (repeats or alike) else None


def multi_hot_names(train: Dataset, column: str, width: int) -> list[str]:
    """The labels of a training column of multi-hot vectors, by position, once each row is checked; said on rank 0."""
    check_multi_hot(train, column, width, "train")
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"note: the {column!r} column reads as multi-hot vectors of {width} labels (label i where position i is "
            f"1), named 0..{width - 1}",
            flush=True,
        )
    return [str(i) for i in range(width)]


def check_multi_hot(ds: Dataset, column: str, width: int | None, split: str) -> None:
    """Every labelled row of a multi-hot column is a vector of `width` 0/1 values (None: the training data's are
    lists of labels, and so must this split's be): another length or form would be read as another label set,
    silently."""
    if width is None:
        if multi_hot_width(ds, column, train=False):  # [0, 1, 0] read as ids would be the labels "0" and "1"
            raise UserError(
                f"the {split} data's {column!r} column holds multi-hot vectors of 0/1, the training data's lists of "
                "labels; give both splits the same form"
            )
        return
    for row, value in enumerate(ds[column]):
        if not is_empty(value) and not (_bits(value) and len(value) == width):
            raise UserError(
                f"row {row + 1} of the {split} data's {column!r} column is {str(value)[:60]}, not a multi-hot vector "
                f"of {width} labels as its other rows are; give each row {width} values of 0 or 1 (or each row a list "
                "of its label names)"
            )


def _bits(value: Any) -> bool:
    """A list of only 0/1 (ints, floats or bools: 1 == 1.0 == True)."""
    return isinstance(value, list) and bool(value) and all(v is not None and v in (0, 1) for v in value)


def is_empty(value: Any) -> bool:
    """No label in this row: a missing value (processing.is_missing) or an empty list."""
    return is_missing(value, None) or (isinstance(value, list) and not value)


def reader(ds: Dataset, column: str, separator: str | None, how: str = "") -> Callable[[Any], list[str]]:
    """value -> the row's label names (strings), for this split's column type; a text is split at `separator` (None:
    at whitespace). `how`: what the task reads, for the refusal of a column of another type."""
    feature = ds.features[column]
    inner = getattr(feature, "feature", None)  # a list column's element type
    if isinstance(inner, ClassLabel):
        return lambda value: [inner.int2str(int(i)) for i in value or [] if i is not None and i >= 0]
    if inner is not None:
        return lambda value: [name for v in value or [] for name in _whole(v)]
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        return lambda value: [part.strip() for part in (value or "").split(separator) if part.strip()]
    if isinstance(feature, datasets.Value) and feature.dtype != "bool":  # one id per row; null: no label at all
        return _whole
    how = how or (
        f"--task multi_label reads a column of lists, texts of labels between --label_separator {separator!r}, or "
        "whole-number ids"
    )
    raise UserError(f"the {column!r} column holds {feature}, not a row's labels: {how}")


def _whole(value: Any) -> list[str]:
    """One label from a list item or a numeric cell: text as it is, a number as a whole-number id (a CSV column
    with empty cells reads as floats)."""
    if is_empty(value):
        return []
    if isinstance(value, float):
        if not value.is_integer():
            raise UserError(f"a label of {value:g} is not a name or a whole-number id; give names or whole-number ids")
        return [str(int(value))]
    if isinstance(value, (list, tuple, dict)):  # [["sports"]]: its Python spelling would become a label name
        raise UserError(
            f"a row's labels hold {type(value).__name__}s ({str(value)[:40]}), not label names; give each row a "
            "flat list of its labels"
        )
    return [str(value).strip()] if str(value).strip() else []
