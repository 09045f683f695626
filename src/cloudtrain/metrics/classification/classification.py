"""Classification metric for `evaluate`: accuracy, macro F1 and the confusion matrix in one pass.

Lives in the repository and is loaded by path (`evaluate.load(<this folder>)`), so it works offline.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy, macro-averaged F1 over the classes present, and the confusion matrix."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted class ids.
    references (list of int): true class ids.
    num_classes (int, optional): size of the confusion matrix (default: largest id seen + 1).
Returns:
    accuracy (float), macro_f1 (float), confusion_matrix (list of lists, rows = true class).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Classification(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, num_classes: int | None = None) -> dict:
        pred, ref = np.asarray(predictions, dtype=np.int64), np.asarray(references, dtype=np.int64)
        n = num_classes or int(max(pred.max(initial=0), ref.max(initial=0))) + 1
        matrix = np.zeros((n, n), dtype=np.int64)
        np.add.at(matrix, (ref, pred), 1)
        true_pos = np.diag(matrix).astype(float)
        predicted, actual = matrix.sum(axis=0), matrix.sum(axis=1)
        denom = predicted + actual
        f1 = np.divide(2 * true_pos, denom, out=np.zeros(n), where=denom > 0)
        present = denom > 0  # classes neither predicted nor in the references do not count
        return {
            "accuracy": float(true_pos.sum() / max(len(ref), 1)),
            "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
            "confusion_matrix": matrix.tolist(),
        }
