"""Rows without labels (-1 or missing, as in GLUE-style test splits): a split with none is used for
predictions only, some unlabelled rows are an error naming the count."""

import json

import pandas as pd
import pytest
from conftest import topic_rows
from datasets import ClassLabel, Dataset, DatasetDict
from transformers import AutoTokenizer

from cloudtrain.config import DataConfig, build_config
from cloudtrain.data.processing import process_data
from cloudtrain.errors import UserError
from cloudtrain.pipeline import run_training

NAMES = ["finance", "sports", "weather"]


def classlabel_split(rows: list[dict], unlabelled: slice | None = None) -> Dataset:
    """Rows with a ClassLabel column; the rows in `unlabelled` get -1, the datasets convention for no label."""
    labels = [NAMES.index(row["label"]) for row in rows]
    for i in range(len(labels))[unlabelled] if unlabelled else []:
        labels[i] = -1
    return Dataset.from_dict({"text": [row["text"] for row in rows], "label": labels}).cast_column(
        "label", ClassLabel(names=NAMES)
    )


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    return AutoTokenizer.from_pretrained(minilm_dir)


def test_a_test_split_of_minus_ones_is_kept_for_predictions(tokenizer):
    test = classlabel_split(topic_rows(2, offset=2), unlabelled=slice(None))
    raw = DatasetDict(
        {"train": classlabel_split(topic_rows(8)), "validation": classlabel_split(topic_rows(2)), "test": test}
    )
    data = process_data(raw, tokenizer, DataConfig(), seed=0)
    assert data.test is None and set(data.unlabelled) == {"test"}
    assert "labels" not in data.unlabelled["test"].column_names and len(data.unlabelled["test"]) == 6
    assert data.unlabelled_texts["test"] == test["text"]


def test_an_unlabelled_validation_split_is_replaced_by_one_carved_from_train(tokenizer):
    raw = DatasetDict(
        {
            "train": Dataset.from_list(topic_rows(10)),
            "validation": Dataset.from_dict({"text": ["a", "b"], "label": [None, None]}),
        }
    )
    data = process_data(raw, tokenizer, DataConfig(validation_split_percentage=20), seed=0)
    assert len(data.validation) == 6 and len(data.train) == 24
    assert set(data.unlabelled) == {"validation"}


@pytest.mark.parametrize("split", ["validation", "test"])
def test_a_split_with_some_unlabelled_rows_is_an_error_naming_the_count(tokenizer, split):
    raw = DatasetDict(
        {"train": classlabel_split(topic_rows(4)), split: classlabel_split(topic_rows(4), unlabelled=slice(0, 5))}
    )
    with pytest.raises(UserError, match=f"5 of 12 rows of the {split} data have no 'label' value"):
        process_data(raw, tokenizer, DataConfig(), seed=0)


@pytest.mark.parametrize("missing", [None, -1], ids=["empty", "classlabel-minus-one"])
def test_unlabelled_training_rows_are_an_error_naming_the_count(tokenizer, missing):
    train = (
        classlabel_split(topic_rows(3), unlabelled=slice(0, 2))
        if missing == -1
        else Dataset.from_dict({"text": ["a", "b", "c"], "label": ["x", None, "y"]})
    )
    count = "2 of 9" if missing == -1 else "1 of 3"
    with pytest.raises(UserError, match=f"{count} training rows have no 'label' value"):
        process_data(DatasetDict({"train": train}), tokenizer, DataConfig(), seed=0)


@pytest.mark.parametrize("training_type", ["basic", "accelerated"])
def test_a_glue_style_test_file_gets_predictions(tiny_model_dir, topic_csvs, tmp_path, training_type):
    """A csv test split whose label column is all -1 (GLUE's test split written out) trains, evaluates on
    validation and writes one prediction per test row, in order, instead of crashing."""
    test_rows = topic_rows(3, offset=2)
    test_file = tmp_path / "test.csv"
    pd.DataFrame({"text": [row["text"] for row in test_rows], "label": -1}).to_csv(test_file, index=False)
    out = tmp_path / "out"
    results = run_training(
        build_config(
            {
                "model_name_or_path": tiny_model_dir,
                "train_file": str(topic_csvs["train"]),
                "validation_file": str(topic_csvs["validation"]),
                "test_file": str(test_file),
                "output_dir": str(out),
                "max_steps": 2,
                "training_type": training_type,
                "per_device_eval_batch_size": 4,
            }
        )
    )
    assert "test" not in results and "eval" in results
    lines = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    assert [line["text"] for line in lines] == [row["text"] for row in test_rows]
    assert all(line["label"] in NAMES and 0 < line["score"] <= 1 for line in lines)
