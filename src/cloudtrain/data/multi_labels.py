"""The label column of `--task multi_label`: any number of labels per row, as a multi-hot row.

A row's labels are a list (JSON lines, Parquet, a Hub `Sequence` column; ids of a `Sequence(ClassLabel)` by its
names), one text with the labels between `--label_separator`s (CSV), or one whole-number id. An empty list, an
empty text or no value is a row to which no label applies. The names are a `Sequence(ClassLabel)`'s, else the
training data's in order (numbers by value); a checkpoint head's order is kept where it has the same names. Each
split is read by its own column's type (a JSON lines train and a CSV validation mix). An evaluation split with labels
the training data never saw is an error; one without the label column, or with no label in any row, is for
predictions only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import datasets
from datasets import ClassLabel, Dataset, DatasetDict

from cloudtrain.config import DataConfig
from cloudtrain.data.processing import LabelScheme, is_missing, refuse_unseen
from cloudtrain.errors import UserError


def multi_label_scheme(raw: DatasetDict, cfg: DataConfig, order: list[str] | None = None) -> LabelScheme:
    """The multi-hot encoding of `cfg.label_column` over the label names; `order`: a checkpoint head's names."""
    column, separator = cfg.label_column, cfg.label_separator
    names = label_names(raw["train"], column, separator)
    if len(names) < 2:
        raise UserError(
            f"the training data has {len(names)} distinct label(s) in {column!r}; --task multi_label needs at least 2 "
            "(a column of lists, or texts of labels between --label_separator)"
        )
    if order is not None and sorted(order) == sorted(names):
        names = list(order)  # the head keeps its rows
    index = {name: i for i, name in enumerate(names)}

    def encoder(ds: Dataset) -> Callable[[Any], list[float]]:
        read = reader(ds, column, separator)

        def encode(value: Any) -> list[float]:
            row = [0.0] * len(names)
            for name in read(value):
                row[index[name]] = 1.0
            return row

        return encode

    def labelled(ds: Dataset, split: str) -> bool:
        if column not in ds.column_names or all(is_empty(value) for value in ds[column]):
            return False
        read = reader(ds, column, separator)
        refuse_unseen(split, {name for value in ds[column] for name in read(value)} - set(index))
        return True

    return LabelScheme(
        names=names,
        encoder=encoder,
        feature=datasets.List(datasets.Value("float32")),
        key=[names, "multi-hot", separator],
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
    if all(name.lstrip("-").isdigit() for name in found):
        return sorted(found, key=lambda name: (int(name), name))  # 01 and 1: one order on every run
    return sorted(found)


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
