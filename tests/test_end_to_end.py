"""End to end, as a user runs it: the real MiniLM on a few hundred real R8 texts, both trainers.

Each run must learn: accuracy well above the majority-class rate of the same evaluation rows.
Then the saved model reloads with from_pretrained and the `predict` entry classifies with it.
"""

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import built_once, run_cli
from transformers import AutoModelForSequenceClassification

from cloudtrain.predict import predict

pytestmark = pytest.mark.slow  # the real MiniLM trained on real R8 texts, twice

# 20 steps (2 epochs of 160 texts), 100 validation and test texts: on 2 cores the test accuracy is 0.80 against a
# majority-class rate of 0.42 (the assertion needs majority + 0.2), and the earnings text is predicted "earn".
R8_QUICK = [
    "--max_train_samples",
    "160",
    "--max_eval_samples",
    "100",
    "--max_length",
    "64",
    "--num_train_epochs",
    "2",
    "--learning_rate",
    "2e-4",
    "--logging_steps",
    "5",
]


@pytest.fixture(scope="module", params=["basic", "accelerated"])
def trained(request, tmp_path_factory):
    """(training type, output dir, the run's stdout), trained once per session for each type."""

    def train(folder: Path) -> None:
        result = run_cli("--training_type", request.param, "--output_dir", str(folder / "model"), *R8_QUICK)
        assert result.returncode == 0, result.stderr[-3000:]
        (folder / "stdout.txt").write_text(result.stdout)
        (folder / "stderr.txt").write_text(result.stderr)

    folder = built_once(tmp_path_factory, f"e2e-{request.param}", train)
    return request.param, folder / "model", (folder / "stdout.txt").read_text()


def test_the_model_learned(trained):
    training_type, out, stdout = trained
    test = json.loads((out / "test_results.json").read_text())
    matrix = test["confusion_matrix"]
    majority_rate = max(sum(row) for row in matrix) / test["samples"]  # rows are the true classes
    assert test["samples"] == 100
    assert test["accuracy"] >= majority_rate + 0.2, (test["accuracy"], majority_rate)
    assert f"{'BasicTrainer' if training_type == 'basic' else 'AcceleratedTrainer'}:" in stdout
    assert f"model saved to {out.resolve()}" in stdout
    assert "test: accuracy" in stdout
    assert "Setting accelerator to CPU" not in (out.parent / "stderr.txt").read_text()  # DeepSpeed's, on CPU


def test_reload_and_predict(trained):
    _, out, _ = trained
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert set(model.config.id2label.values()) == {
        "acq",
        "crude",
        "earn",
        "grain",
        "interest",
        "money-fx",
        "ship",
        "trade",
    }
    texts = [
        "company reports net profit rose to 12 mln dlrs per share dividend quarterly earnings",
        "company agreed to acquire all outstanding shares in a merger takeover bid",
    ]
    in_process = predict(str(out), texts)
    assert [p["label"] for p in in_process][0] == "earn"
    assert all(0 < p["score"] <= 1 for p in in_process)
    result = run_cli("predict", "--model_dir", str(out), "--text", texts[0], "--text", texts[1])
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [p["label"] for p in lines] == [p["label"] for p in in_process]


def test_predict_from_a_file(trained, tmp_path):
    _, out, _ = trained
    file = tmp_path / "texts.txt"
    file.write_text("oil prices and crude output opec barrels\nwheat grain harvest tonnes exports\n")
    result = run_cli(
        "predict", "--model_dir", str(out), "--input_file", str(file), "--output_file", str(tmp_path / "preds.jsonl")
    )
    assert result.returncode == 0, result.stderr[-2000:]
    preds = [json.loads(line) for line in (tmp_path / "preds.jsonl").read_text().splitlines()]
    assert len(preds) == 2 and Counter(p["text"] for p in preds) == Counter(file.read_text().splitlines())
