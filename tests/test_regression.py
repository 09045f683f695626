"""--task regression (cloudtrain.tasks.regression, cloudtrain.data.regression_targets): the metrics against
scipy's, a run that learns, predicts for an unlabelled split, saves a model that `predict` and transformers'
pipeline read as one number, its card, best-model choice by a lower-is-better metric, and every refusal."""

import json
import math
import random

import pytest
import torch
from conftest import TOPICS, assert_each_refused
from scipy.stats import pearsonr, spearmanr
from test_multi_label import write_jsonl

from cloudtrain.cli import main
from cloudtrain.predict import predict
from cloudtrain.tasks.regression import regression_metrics
from cloudtrain.training.best_model import better

LEVEL = {"finance": 1.0, "sports": 3.0, "weather": 5.0}  # a topic's score


def scored_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topic = rng.choice(sorted(TOPICS))
        rows.append({"text": f"{TOPICS[topic][(i + seed) % 5]} {i}", "score": LEVEL[topic] + rng.uniform(-0.3, 0.3)})
    return rows


def test_metrics_equal_scipy_s():
    generator = torch.Generator().manual_seed(0)
    referenced = torch.randn(300, generator=generator)
    predicted = referenced + 0.5 * torch.randn(300, generator=generator)
    got = regression_metrics(predicted, referenced)
    p, r = predicted.double().numpy(), referenced.double().numpy()
    assert got["loss"] == pytest.approx(((p - r) ** 2).mean()) and got["rmse"] == pytest.approx(got["loss"] ** 0.5)
    assert got["mae"] == pytest.approx(abs(p - r).mean())
    assert got["pearson"] == pytest.approx(pearsonr(p, r).statistic)
    assert got["spearman"] == pytest.approx(spearmanr(p, r).statistic)
    assert better(0.5, 0.6, "rmse") and better(0.5, 0.6, "mae") and better(0.9, 0.8, "pearson")  # lower is better


def test_a_run_learns_predicts_saves_and_the_saved_model_reads_as_a_number(tiny_model_dir, tmp_path, capsys):
    texts = [r["text"] for r in scored_rows(5, 2)]
    out = tmp_path / "out"
    options = {
        "task": "regression",
        "model_name_or_path": tiny_model_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", scored_rows(120, 0)),
        "validation_file": write_jsonl(tmp_path / "validation.jsonl", scored_rows(30, 1)),
        "test_file": write_jsonl(tmp_path / "test.jsonl", [{"text": t} for t in texts]),
        "label_column": "score",
        "output_dir": str(out),
        "num_train_epochs": 20,
        "per_device_train_batch_size": 8,
        "learning_rate": 3e-3,
        "mixed_precision": "no",
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    said = capsys.readouterr().out
    results = json.loads((out / "eval_results.json").read_text())
    assert results["pearson"] > 0.8 and results["rmse"] < 1.0 and results["samples"] == 30, results
    assert f"eval: loss (MSE) {results['loss']:.4f} | rmse " in said
    config = json.loads((out / "config.json").read_text())
    assert config["problem_type"] == "regression" and config["id2label"] == {"0": "score"}

    written = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    predicted = predict(str(out), texts)  # the `predict` command's rows
    assert [set(r) for r in predicted] == [{"text", "score"}] * len(texts)
    assert [r["score"] for r in written] == pytest.approx([r["score"] for r in predicted], abs=1e-3)

    from transformers import pipeline

    raw = pipeline("text-classification", model=str(out), function_to_apply="none")(texts[:1])[0]
    assert raw["score"] == pytest.approx(predicted[0]["score"], abs=1e-3)

    from cloudtrain.config.parse import resolve_options
    from cloudtrain.tasks import build_task

    cfg = resolve_options(None, {**options, "push_to_hub": True, "hub_model_id": "me/scores"})
    train = json.loads((out / "train_results.json").read_text())
    card = build_task(cfg).model_card(out, cfg, {"train": train, "eval": results}).text
    assert "text regression (one number per text, `score`)" in card and 'function_to_apply="none"' in card
    assert f"- RMSE: {results['rmse']:.4f}" in card and "## Labels" not in card
    constant = {**results, "pearson": float("nan"), "spearman": None}  # constant predictions: in memory, on file
    card = build_task(cfg).model_card(out, cfg, {"train": train, "eval": constant}).text
    assert "- Pearson: n/a" in card and "- Spearman: n/a" in card


def test_the_head_computes_in_fp32_under_bf16_autocast(tiny_model_dir):
    """Under the default bf16, a target in the thousands was predicted on bf16's grid of 8 (the run's metrics, and
    its training, saw every prediction land on a few values; `predict`, in fp32, disagreed; found in audit)."""
    from transformers import AutoModelForSequenceClassification

    from cloudtrain.config import build_config
    from cloudtrain.tasks import build_task

    cfg = build_config({"task": "regression", "model_name_or_path": tiny_model_dir})
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).eval()
    with torch.no_grad():
        model.classifier.bias.fill_(1234.6)
    build_task(cfg).fit_model(model, None, cfg, announce=False)
    ids = torch.randint(1000, 2000, (6, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(input_ids=ids).logits[:, 0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model(input_ids=ids).logits[:, 0]
    assert mixed.dtype == torch.float32 and len(set(mixed.tolist())) == 6  # bf16 gave one or two values
    assert (mixed - exact).abs().max() < 0.05


def test_an_adapter_s_card_snippet_loads_its_one_output_head(tiny_model_dir, tmp_path, capsys):
    """PEFT rebuilds the base's head, two outputs by default: the card's snippet without num_labels=1 failed to
    load the saved one-output head (found in audit). The snippet runs as written, the repo id a local folder."""
    import re

    from cloudtrain.config.parse import resolve_options
    from cloudtrain.tasks import build_task

    out = tmp_path / "out"
    options = {"task": "regression", "model_name_or_path": tiny_model_dir, "label_column": "score",
               "train_file": write_jsonl(tmp_path / "train.jsonl", scored_rows(16, 0)), "peft": "lora",
               "output_dir": str(out), "max_steps": 2, "eval_strategy": "no", "mixed_precision": "no"}  # fmt: skip
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    cfg = resolve_options(None, {**options, "push_to_hub": True, "hub_model_id": "me/scores"})
    train = json.loads((out / "train_results.json").read_text())
    card = build_task(cfg).model_card(out, cfg, {"train": train}).text
    snippet = re.findall(r"```python\n(.*?)```", card, re.DOTALL)[0].replace('"me/scores"', repr(str(out)))
    assert "num_labels=1" in snippet
    capsys.readouterr()
    exec(snippet, {})
    assert math.isfinite(float(capsys.readouterr().out.strip().splitlines()[-1]))  # the number it predicted


def test_results_files_are_strict_json_with_null_for_a_number_that_is_not_finite(tmp_path):
    from cloudtrain.publish.saving import write_json

    write_json(tmp_path / "r.json", {"pearson": float("nan"), "rmse": 0.5, "rows": [float("inf"), 1.0]})
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"pearson": None, "rmse": 0.5, "rows": [None, 1.0]}


def test_each_refusal_is_one_line(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    train = write_jsonl(tmp_path / "train.jsonl", scored_rows(20, 0))
    words = write_jsonl(tmp_path / "words.jsonl", [{"text": f"t {i}", "score": "high"} for i in range(8)])
    gaps = write_jsonl(tmp_path / "gaps.jsonl", [{"text": f"t {i}", "score": None if i % 2 else i} for i in range(8)])
    flat = write_jsonl(tmp_path / "flat.jsonl", [{"text": f"t {i}", "score": 2.0} for i in range(8)])
    endless = tmp_path / "endless.csv"  # one infinite target: a non-finite loss, blamed on the learning rate (audit)
    endless.write_text("text,score\n" + "".join(f"t {i},{'inf' if i == 3 else i}\n" for i in range(8)))
    base = {"task": "regression", "model_name_or_path": tiny_model_dir, "train_file": train, "label_column": "score",
            "output_dir": str(out), "report_to": "none", "max_steps": 2}  # fmt: skip
    cases = {
        "words": ({**base, "train_file": words}, "column of the training data holds Value('string') ('high',"),
        "gaps": ({**base, "train_file": gaps}, "4 of 8 rows of the training data have no 'score' value"),
        "infinite": ({**base, "train_file": str(endless)}, "1 of 8 rows of the training data have an infinite 'score'"),
        "flat": ({**base, "train_file": flat}, "every training row has the 'score' value 2: there is nothing to learn"),
        "a metric of another task": ({**base, "metric_for_best_model": "accuracy"}, "is not a metric of --task"),
    }
    assert_each_refused(cases, capsys, out)


def test_an_adapter_reads_as_a_number(tiny_model_dir, tmp_path):
    out = tmp_path / "lora"
    options = {"task": "regression", "model_name_or_path": tiny_model_dir, "label_column": "score",
               "train_file": write_jsonl(tmp_path / "train.jsonl", scored_rows(40, 0)), "output_dir": str(out),
               "peft": "lora", "max_steps": 3, "report_to": "none"}  # fmt: skip
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    assert json.loads((out / "labels.json").read_text())["problem_type"] == "regression"
    assert set(predict(str(out), ["the team won the match"])[0]) == {"text", "score"}


def test_a_glue_style_test_split_of_minus_ones_is_for_predictions(capsys):
    """STS-B's test split marks every row -1: it was scored as targets (found in audit)."""
    from datasets import Dataset, DatasetDict

    from cloudtrain.config import DataConfig
    from cloudtrain.data.regression_targets import regression_scheme

    train = Dataset.from_dict({"text": ["a", "b", "c"], "score": [0.5, 3.0, 5.0]})
    scheme = regression_scheme(DatasetDict({"train": train}), DataConfig(label_column="score"))
    test = Dataset.from_dict({"text": ["x", "y"], "score": [-1.0, -1.0]})
    assert not scheme.labelled(test, "test")
    assert "note: every test row has the 'score' value -1, which training never has" in capsys.readouterr().out
    assert scheme.labelled(Dataset.from_dict({"text": ["x", "y"], "score": [-1.0, 2.0]}), "validation")
    negative = Dataset.from_dict({"text": ["a", "b"], "score": [-1.0, 1.0]})  # -1 is a real target here
    assert regression_scheme(DatasetDict({"train": negative}), DataConfig(label_column="score")).labelled(test, "test")
