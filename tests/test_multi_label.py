"""--task multi_label (cloudtrain.tasks.multi_label, cloudtrain.data.multi_labels): label columns of lists and of
separated texts, the metrics against scikit-learn's, a run that learns, predicts for an unlabelled split, saves a
model that `predict` and transformers' pipeline read as multi-label, its card, and every refusal in one line."""

import json
import random
import re
from pathlib import Path

import pytest
import torch
from conftest import TOPICS, assert_each_refused
from datasets import Dataset, DatasetDict
from sklearn.metrics import f1_score

from cloudtrain.cli import main
from cloudtrain.config import DataConfig
from cloudtrain.data.multi_labels import multi_label_scheme
from cloudtrain.errors import UserError
from cloudtrain.predict import predict
from cloudtrain.tasks.multi_label import multi_label_metrics

NAMES = sorted(TOPICS)


def labelled_rows(n: int, seed: int) -> list[dict]:
    """Texts of none, one or two topics' sentences; their labels are the topics."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        chosen = sorted(rng.sample(NAMES, rng.choice([0, 1, 1, 2, 2])))
        parts = [TOPICS[topic][(i + seed) % 5] for topic in chosen] or ["nothing much happened"]
        rows.append({"text": ". ".join(parts) + f" {i}", "labels": chosen})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_metrics_equal_scikit_learn_s():
    generator = torch.Generator().manual_seed(0)
    referenced = torch.rand(200, 5, generator=generator) > 0.6
    predicted = referenced ^ (torch.rand(200, 5, generator=generator) > 0.8)  # a fifth of the decisions flipped
    got = multi_label_metrics(predicted, referenced, list("abcde"))
    y, p = referenced.numpy(), predicted.numpy()
    assert got["micro_f1"] == pytest.approx(f1_score(y, p, average="micro"))
    assert got["macro_f1"] == pytest.approx(f1_score(y, p, average="macro"))
    assert got["subset_accuracy"] == pytest.approx((y == p).all(axis=1).mean())
    assert list(got["label_f1"].values()) == pytest.approx(list(f1_score(y, p, average=None)), abs=1e-4)
    absent = multi_label_metrics(
        torch.tensor([[True, False, False]]), torch.tensor([[True, False, False]]), list("abc")
    )
    assert absent["label_f1"] == {"a": 1.0} and absent["macro_f1"] == 1.0  # labels that never occur are left out
    nothing = torch.zeros(2, 3, dtype=torch.bool)
    assert multi_label_metrics(nothing, nothing, list("abc"))["micro_f1"] == 0.0  # as scikit-learn


def test_a_column_of_lists_and_one_of_separated_texts_read_the_same():
    rows = labelled_rows(30, 0)
    lists = DatasetDict({"train": Dataset.from_list(rows)})
    texts = DatasetDict({"train": Dataset.from_list([{**r, "labels": " | ".join(r["labels"])} for r in rows])})
    a = multi_label_scheme(lists, DataConfig(label_column="labels"))
    b = multi_label_scheme(texts, DataConfig(label_column="labels", label_separator="|"))
    assert a.names == b.names == NAMES
    encode_a, encode_b = a.encoder(lists["train"]), b.encoder(texts["train"])
    assert [encode_a(v) for v in lists["train"]["labels"]] == [encode_b(v) for v in texts["train"]["labels"]]
    assert encode_a(["finance", "weather"]) == [1.0, 0.0, 1.0] and encode_a([]) == [0.0, 0.0, 0.0]


def test_each_split_is_read_by_its_own_column_type_and_an_empty_one_is_for_predictions():
    rows = labelled_rows(30, 0)
    raw = DatasetDict(
        {
            "train": Dataset.from_list(rows),  # lists
            "validation": Dataset.from_list([{**r, "labels": "|".join(r["labels"])} for r in rows[:6]]),  # texts
            "test": Dataset.from_list([{"text": r["text"], "labels": None} for r in rows[:3]]),  # no labels at all
        }
    )
    scheme = multi_label_scheme(raw, DataConfig(label_column="labels", label_separator="|"))
    train, validation = (scheme.encoder(raw[split]) for split in ("train", "validation"))
    assert [validation(v) for v in raw["validation"]["labels"]] == [train(r["labels"]) for r in rows[:6]]
    assert scheme.labelled(raw["validation"], "validation") and not scheme.labelled(raw["test"], "test")
    ids = DatasetDict({"train": Dataset.from_list([{"text": "t", "labels": [n]} for n in (10, 2, 1)])})
    assert multi_label_scheme(ids, DataConfig(label_column="labels")).names == ["1", "2", "10"]  # by value
    head = ["weather", "sports", "finance"]  # a checkpoint head's order is kept
    assert multi_label_scheme(raw, DataConfig(label_column="labels"), order=head).names == head


def test_multi_hot_vectors_read_by_position_and_lists_of_ids_as_before(capsys):
    """[0, 1, 0] over 3 labels was read as the label set {"0", "1"} (found in audit): a row of 0/1 that repeats a
    value marks the column as multi-hot vectors, label i present where position i is 1."""
    vectors = [[0, 1, 0], [1, 1, 0], [0, 0, 1], [0.0, 1.0, 1.0], [True, False, False]]
    raw = DatasetDict(
        {
            "train": Dataset.from_list([{"text": f"t {i}", "labels": v} for i, v in enumerate(vectors[:3])]),
            "validation": Dataset.from_list([{"text": f"t {i}", "labels": v} for i, v in enumerate(vectors[3:4])]),
        }
    )
    scheme = multi_label_scheme(raw, DataConfig(label_column="labels"))
    assert "reads as multi-hot vectors of 3 labels" in capsys.readouterr().out
    assert scheme.names == ["0", "1", "2"] and scheme.labelled(raw["validation"], "validation")
    encode = scheme.encoder(raw["train"])
    assert [encode(v) for v in vectors] == [[float(bit) for bit in v] for v in vectors]
    bools = DatasetDict({"train": Dataset.from_list([{"text": "t", "labels": [True, False, False]}] * 2)})
    assert multi_label_scheme(bools, DataConfig(label_column="labels")).names == ["0", "1", "2"]
    ids = DatasetDict({"train": Dataset.from_list([{"text": "t", "labels": v} for v in ([0, 1], [2], [1, 0])])})
    assert multi_label_scheme(ids, DataConfig(label_column="labels")).names == ["0", "1", "2"]  # ids, no vectors
    assert multi_label_scheme(ids, DataConfig(label_column="labels")).encoder(ids["train"])([2]) == [0.0, 0.0, 1.0]
    for rows, said in (
        ([[0, 1, 0], [1, 1, 0], [1, 0]], "row 3 of the train data's 'labels' column is [1, 0], not a multi-hot vector"),
        ([[0, 1, 0], [0, 0, 1], [1, 2, 0]], "row 3 of the train data's 'labels' column is [1, 2, 0], not a multi-hot"),
    ):
        bad = DatasetDict({"train": Dataset.from_list([{"text": "t", "labels": v} for v in rows])})
        with pytest.raises(UserError, match=re.escape(said)):
            multi_label_scheme(bad, DataConfig(label_column="labels"))
    # two wide, no row repeating: as ids every row was both labels, silently; a repeated id among ids stays ids (review)
    two = DatasetDict({"train": Dataset.from_list([{"text": "t", "labels": v} for v in ([0, 1], [1, 0], [1, 0])])})
    assert multi_label_scheme(two, DataConfig(label_column="labels")).encoder(two["train"])([1, 0]) == [1.0, 0.0]
    repeated = DatasetDict({"train": Dataset.from_list([{"text": "t", "labels": v} for v in ([3, 5], [1, 1], [2])])})
    assert multi_label_scheme(repeated, DataConfig(label_column="labels")).names == ["1", "2", "3", "5"]
    mixed = DatasetDict({"train": ids["train"], "validation": raw["train"]})
    with pytest.raises(UserError, match="validation data's 'labels' column holds multi-hot vectors of 0/1, the tr"):
        multi_label_scheme(mixed, DataConfig(label_column="labels")).labelled(mixed["validation"], "validation")


@pytest.mark.slow
def test_a_run_learns_predicts_saves_and_the_saved_model_reads_as_multi_label(tiny_model_dir, tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", labelled_rows(120, 0))
    validation = write_jsonl(tmp_path / "validation.jsonl", labelled_rows(30, 1))
    unlabelled = [{"text": r["text"]} for r in labelled_rows(6, 2)]
    test = write_jsonl(tmp_path / "test.jsonl", unlabelled)
    out = tmp_path / "out"
    options = {
        "task": "multi_label",
        "model_name_or_path": tiny_model_dir,
        "train_file": train,
        "validation_file": validation,
        "test_file": test,
        "label_column": "labels",
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
    assert results["micro_f1"] > 0.8 and results["samples"] == 30, results  # sentences name their topics
    assert f"eval: micro_f1 {results['micro_f1']:.4f} | macro_f1 " in said
    config = json.loads((out / "config.json").read_text())
    assert config["problem_type"] == "multi_label_classification" and sorted(config["label2id"]) == NAMES

    written = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    texts = [r["text"] for r in unlabelled]
    predicted = predict(str(out), texts)  # the `predict` command's rows
    assert [r["text"] for r in written] == texts
    for mine, theirs in zip(written, predicted, strict=True):
        assert mine["labels"] == theirs["labels"] and set(theirs["scores"]) == set(NAMES)
        assert theirs["labels"] == [n for n, p in theirs["scores"].items() if p > 0.5]
        assert mine["scores"] == pytest.approx(theirs["scores"], abs=1e-3)

    from transformers import pipeline  # transformers reads the saved config's problem type: a sigmoid per label

    scores = pipeline("text-classification", model=str(out), top_k=None)(texts[:1])[0]
    assert {s["label"]: s["score"] for s in scores} == pytest.approx(predicted[0]["scores"], abs=1e-3)

    from cloudtrain.config.parse import resolve_options
    from cloudtrain.tasks import build_task

    cfg = resolve_options(None, {**options, "push_to_hub": True, "hub_model_id": "me/topics"})
    card = (
        build_task(cfg)
        .model_card(out, cfg, {"train": json.loads((out / "train_results.json").read_text()), "eval": results})
        .text
    )
    assert "multi-label text classification over 3 labels" in card and "top_k=None" in card
    assert f"- Micro F1: {results['micro_f1']:.4f}" in card and "| split | examples | Micro F1 |" in card


def test_each_refusal_is_one_line(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    train = write_jsonl(tmp_path / "train.jsonl", labelled_rows(20, 0))
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"text": f"t {i}", "labels": i * 0.5} for i in range(8)])
    one = write_jsonl(tmp_path / "one.jsonl", [{"text": f"t {i}", "labels": ["sports"]} for i in range(8)])
    unseen = write_jsonl(tmp_path / "unseen.jsonl", [{"text": "t", "labels": ["politics"]}])
    nested = write_jsonl(tmp_path / "nested.jsonl", [{"text": f"t {i}", "labels": [["sports"]]} for i in range(8)])
    base = {
        "task": "multi_label",
        "model_name_or_path": tiny_model_dir,
        "train_file": train,
        "label_column": "labels",
        "output_dir": str(out),
        "report_to": "none",
        "max_steps": 2,
    }
    cases = {
        "numbers": ({**base, "train_file": numbers}, "a label of 0.5 is not a name or a whole-number id"),
        "one label": ({**base, "train_file": one}, "has 1 distinct label(s) in 'labels'; --task multi_label needs"),
        "unseen": (
            {**base, "validation_file": unseen},
            "the validation data has labels the training data never saw: politics",
        ),
        "separator": ({**base, "label_separator": ""}, "--label_separator must not be empty"),
        "nested lists": ({**base, "train_file": nested}, "a row's labels hold lists (['sports']), not label names"),
    }
    assert_each_refused(cases, capsys, out)


def test_the_planner_s_launch_command_keeps_the_task(tiny_model_dir, tmp_path, capsys):
    argv = ["plan", "--task", "multi_label", "--model_name_or_path", tiny_model_dir, "--num_gpus", "1"]
    assert main([*argv, "--gpu_memory_gb", "24", "--json", "--output_dir", str(tmp_path / "plan")]) == 0
    command = json.loads(capsys.readouterr().out)["recommendation"]["command"]
    assert f"--task multi_label --model_name_or_path {tiny_model_dir}" in command, command


def test_an_adapter_and_its_merged_model_read_as_multi_label(tiny_model_dir, tmp_path):
    out = tmp_path / "lora"
    options = {
        "task": "multi_label",
        "model_name_or_path": tiny_model_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", labelled_rows(40, 0)),
        "label_column": "labels",
        "output_dir": str(out),
        "peft": "lora",
        "merge_adapters": "true",
        "max_steps": 3,
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    assert json.loads((out / "labels.json").read_text())["problem_type"] == "multi_label_classification"
    assert json.loads((out / "merged" / "config.json").read_text())["problem_type"] == "multi_label_classification"
    for model_dir in (out, out / "merged"):
        rows = predict(str(model_dir), ["the team won the match"])
        assert set(rows[0]) == {"text", "labels", "scores"} and set(rows[0]["scores"]) == set(NAMES), rows


def test_a_classifier_trained_from_a_multi_label_checkpoint_is_single_label(tiny_model_dir, topic_csvs, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    checkpoint = tmp_path / "multi"
    head = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_dir, num_labels=3, problem_type="multi_label_classification"
    )
    head.save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(checkpoint)
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(checkpoint), "--train_file", str(topic_csvs["train"]), "--output_dir", str(out)]
    assert main([*argv, "--max_steps", "2", "--report_to", "none"]) == 0
    assert json.loads((out / "config.json").read_text())["problem_type"] == "single_label_classification"
    assert set(predict(str(out), ["the team won the match"])[0]) == {"text", "label", "score"}
