"""The label column of `--task multi_label`: any number of labels per row, as a multi-hot row.

A row's labels are a list (JSON lines, Parquet, a Hub `Sequence` column; ids of a `Sequence(ClassLabel)` by its
names) or one text with the labels between `--label_separator`s (CSV). An empty list, an empty text or no value
is a row to which no label applies. The names are the training data's, sorted; an evaluation split with labels
the training data never saw is an error, and one without the label column is for predictions only.
"""

from __future__ import annotations

import datasets
from datasets import ClassLabel, Dataset, DatasetDict

from cloudtrain.config import DataConfig
from cloudtrain.data.processing import LabelScheme
from cloudtrain.errors import UserError


def multi_label_scheme(raw: DatasetDict, cfg: DataConfig) -> LabelScheme:
    """The multi-hot encoding of `cfg.label_column` over the training data's label names."""
    column = cfg.label_column
    read = reader(raw["train"], column, cfg.label_separator)
    names = sorted({name for value in raw["train"][column] for name in read(value)})
    if len(names) < 2:
        raise UserError(
            f"the training data has {len(names)} distinct label(s) in {column!r}; --task multi_label needs at least 2 "
            "(a column of lists, or texts of labels between --label_separator)"
        )
    index = {name: i for i, name in enumerate(names)}

    def encode(value) -> list[float]:
        row = [0.0] * len(names)
        for name in read(value):
            row[index[name]] = 1.0
        return row

    def labelled(ds: Dataset, split: str) -> bool:
        if column not in ds.column_names:
            return False
        split_read = reader(ds, column, cfg.label_separator)
        unseen = {name for value in ds[column] for name in split_read(value)} - set(index)
        if unseen:
            raise UserError(
                f"the {split} data has labels the training data never saw: {', '.join(sorted(unseen)[:10])}; "
                "fix the labels or move those rows into the training data"
            )
        return True

    return LabelScheme(
        names=names,
        encode=encode,
        feature=datasets.List(datasets.Value("float32")),
        labelled=labelled,
        strata=lambda train: None,  # no one class per row to stratify by
    )


def reader(ds: Dataset, column: str, separator: str):
    """value -> the row's label names (strings), for the column's type."""
    feature = ds.features[column]
    inner = getattr(feature, "feature", None)  # a list column's element type
    if isinstance(inner, ClassLabel):
        return lambda value: [inner.int2str(int(i)) for i in value or []]
    if inner is not None:
        return lambda value: [str(v).strip() for v in value or [] if v is not None and str(v).strip()]
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        return lambda value: [part.strip() for part in (value or "").split(separator) if part.strip()]
    raise UserError(
        f"the {column!r} column holds {feature}, not a row's labels: --task multi_label reads a column of lists, or "
        f"texts of labels between --label_separator {separator!r}"
    )
