"""A held-out split whose label column differs from the training data's only in case (`Label` for `label`) was kept
for predictions only, validation carved from train, with a note that it "has no labels" (found in audit)."""

import pytest
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer

from cloudtrain.config import DataConfig
from cloudtrain.data.processing import process_data
from cloudtrain.errors import UserError


def split(label_column: str, n: int) -> Dataset:
    return Dataset.from_dict({"text": [f"text {i}" for i in range(n)], label_column: ["a", "b"] * (n // 2)})


@pytest.mark.parametrize("held_out", ["validation", "test"])
def test_a_label_column_named_in_another_case_is_refused_naming_it(minilm_dir: str, tmp_path, held_out: str) -> None:
    raw = DatasetDict({"train": split("label", 20), held_out: split("Label", 4)})
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    with pytest.raises(UserError, match=f"the {held_out} data has no 'label' column but has 'Label'.*rename"):
        process_data(raw, tokenizer, DataConfig(cache_dir=str(tmp_path)), seed=0)


def test_a_split_with_no_label_column_at_all_is_still_for_predictions(minilm_dir: str, tmp_path) -> None:
    test = Dataset.from_dict({"text": ["x", "y"]})
    raw = DatasetDict({"train": split("label", 20), "test": test})
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    data = process_data(raw, tokenizer, DataConfig(cache_dir=str(tmp_path)), seed=0)
    assert list(data.unlabelled) == ["test"]
