"""The label column of `--task regression`: one number per row (a score, a rating, a similarity).

Numbers as the file gives them (a CSV column reads as integers or floats; a JSON lines one as numbers); a text or a
row without a value in the training data is an error naming the count. An evaluation split without the column, with
no value in any row, or with -1 in every row where training has none (GLUE's test splits), is for predictions only;
one with some rows missing is an error.
"""

from __future__ import annotations

import math

import datasets
from datasets import Dataset, DatasetDict

from cloudtrain.config import DataConfig
from cloudtrain.data.processing import LabelScheme, is_missing
from cloudtrain.errors import UserError


def regression_scheme(raw: DatasetDict, cfg: DataConfig) -> LabelScheme:
    """The target `cfg.label_column` as one float per row: the model's one output."""
    column = cfg.label_column
    check_numbers(raw["train"], column, "training")
    values = [float(v) for v in raw["train"][column]]
    if max(values) == min(values):
        raise UserError(f"every training row has the {column!r} value {values[0]:g}: there is nothing to learn")

    def labelled(ds: Dataset, split: str) -> bool:
        if column not in ds.column_names or all(is_missing(v, None) for v in ds[column]):
            return False
        check_numbers(ds, column, split)
        if -1 not in values and all(v == -1 for v in ds[column]):  # GLUE's test splits (STS-B's) mark "no label" so
            print(f"note: every {split} row has the {column!r} value -1, which training never has: predictions only")
            return False
        return True

    return LabelScheme(
        names=[column],  # one output, named by the target
        encoder=lambda ds: float,
        feature=datasets.Value("float32"),
        key=[column, "regression"],
        labelled=labelled,
        strata=lambda train: None,
    )


def check_numbers(ds: Dataset, column: str, split: str) -> None:
    """Every row of `ds` has a number in `column`."""
    feature = ds.features[column]
    if not isinstance(feature, datasets.Value) or not feature.dtype.startswith(("int", "uint", "float")):
        shown = ", ".join(repr(v) for v in ds[column][:3])
        raise UserError(
            f"the {column!r} column of the {split} data holds {feature} ({shown}, ...), not numbers: --task "
            "regression learns one number per row"
        )
    values = ds[column]
    missing = sum(is_missing(v, None) for v in values)
    if missing:
        raise UserError(
            f"{missing} of {len(ds)} rows of the {split} data have no {column!r} value; give each a number or drop "
            "those rows"
        )
    endless = sum(isinstance(v, float) and math.isinf(v) for v in values)  # a non-finite loss at its first batch
    if endless:
        raise UserError(
            f"{endless} of {len(ds)} rows of the {split} data have an infinite {column!r} value; give each a finite "
            "number or drop those rows"
        )
