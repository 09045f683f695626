"""The repo's evaluate metric module, loaded by path, against scikit-learn."""

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

from cloudtrain.evaluation import load_metric


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_sklearn(seed):
    rng = np.random.default_rng(seed)
    refs = rng.integers(0, 5, 300)
    preds = np.where(rng.random(300) < 0.6, refs, rng.integers(0, 4, 300))  # class 4 never predicted
    result = load_metric().compute(predictions=preds.tolist(), references=refs.tolist(), num_classes=5)
    assert result["accuracy"] == pytest.approx(accuracy_score(refs, preds))
    assert result["macro_f1"] == pytest.approx(f1_score(refs, preds, average="macro"))
    assert result["confusion_matrix"] == confusion_matrix(refs, preds, labels=range(5)).tolist()


def test_classes_absent_everywhere_do_not_count():
    result = load_metric().compute(predictions=[0, 1, 1], references=[0, 1, 0], num_classes=4)
    assert result["macro_f1"] == pytest.approx(f1_score([0, 1, 0], [0, 1, 1], average="macro"))
