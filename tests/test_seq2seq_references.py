"""--task seq2seq with several references per row: BLEU and ROUGE against hand-computed values (and sacreBLEU,
rouge_score's score_multi), list targets as rows (one training pair per reference, evaluation rows keeping all of
them), a run that trains on them, and each bad list refused in one line."""

import json
import math
import random

import pytest
import sacrebleu
from conftest import SEQ2SEQ_WORDS, assert_each_refused
from datasets import Dataset, DatasetDict
from rouge_score import rouge_scorer
from test_seq2seq import headline_rows, write_jsonl
from transformers import AutoTokenizer

from cloudtrain.cli import main
from cloudtrain.config import DataConfig
from cloudtrain.data.source_target import SPLIT_IDS, SourceTargetCollator, process_source_target
from cloudtrain.errors import UserError
from cloudtrain.metrics.text_overlap import bleu, closest_length, rouge


def test_bleu_of_several_references_equals_the_definition():
    # row 1: "the cat sat on the mat" against two references of 6 and 7 words
    #   1-grams 5/6 (the x2, cat, on, mat; "sat" in neither), 2-grams 3/5 (the cat, on the, the mat),
    #   3-grams 1/4 (on the mat), 4-grams 0/3; length 6, the closest reference 6: no brevity penalty
    # row 2: "a b c d e" against references of 7 and 6 words holding it: every n-gram matches (5/5 4/4 3/3 2/2),
    #   length 5, the closest reference 6
    predictions = ["the cat sat on the mat", "a b c d e"]
    references = [["the cat is on the mat", "there is a cat on the mat"], ["a b c d e f g", "a b c d e f"]]
    alone = 100 * (5 / 6 * 3 / 5 * 1 / 4 * 1 / (2 * 3)) ** (1 / 4)  # the empty 4-gram order smoothed: 1 / (2 * 3)
    assert bleu(predictions[:1], references[:1]) == pytest.approx(alone, abs=1e-9)
    assert bleu(predictions[1:], references[1:]) == pytest.approx(100 * math.exp(1 - 6 / 5), abs=1e-9)
    corpus = 100 * math.exp(1 - 12 / 11) * (10 / 11 * 7 / 9 * 4 / 7 * 2 / 5) ** (1 / 4)  # lengths 11 against 6 + 6
    assert bleu(predictions, references) == pytest.approx(corpus, abs=1e-9)
    # two references as close (4 and 6 words around 5): the shorter counts, so no brevity penalty
    assert closest_length(5, [6, 4]) == 4 == closest_length(5, [4, 6])
    assert bleu(["a b c d e"], [["a b c d e f", "a b c d"]]) == pytest.approx(100)
    for ours, refs in ((alone, references[:1]), (corpus, references)):
        streams = [list(stream) for stream in zip(*refs, strict=True)]
        assert sacrebleu.corpus_bleu(predictions[: len(refs)], streams).score == pytest.approx(ours, abs=1e-9)


def test_bleu_and_rouge_of_several_references_equal_the_reference_packages():
    rng = random.Random(2)
    words = 'the cat sat on a mat . , 3.5 dog\'s "quoted" x-ray (big) over! Yes? CAT'.split()

    def text(least: int) -> str:
        return " ".join(rng.choices(words, k=rng.randint(least, 12)))

    predictions = [text(0) for _ in range(200)]
    references = [[text(1) for _ in range(3)] for _ in range(200)]
    streams = [list(stream) for stream in zip(*references, strict=True)]
    for size in (200, 30, 2):
        theirs = sacrebleu.corpus_bleu(predictions[:size], [s[:size] for s in streams]).score
        assert bleu(predictions[:size], references[:size]) == pytest.approx(theirs, abs=1e-9)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    ours = rouge(predictions, references)
    for name in ("rouge1", "rouge2", "rougeL"):
        best = [scorer.score_multi(refs, p)[name].fmeasure for p, refs in zip(predictions, references, strict=True)]
        assert ours[name] == pytest.approx(100 * sum(best) / len(best), abs=1e-9), name


def test_rouge_takes_each_metrics_best_reference():
    # "a b c d" against "a b": rouge1 F 2/3 (P 2/4, R 2/2), rouge2 F 1/2 (ab of 3 bigrams; 1 of 1), LCS 2: 2/3
    # against "d c b a x": rouge1 F 8/9 (P 4/4, R 4/5), rouge2 0, LCS 1: F 2/9
    scores = rouge(["a b c d"], [["a b", "d c b a x"]])
    assert scores == pytest.approx({"rouge1": 800 / 9, "rouge2": 50.0, "rougeL": 200 / 3, "rougeLsum": 200 / 3})
    # one reference in a list scores as that reference alone (bit for bit)
    predictions, targets = ["red cat runs", "a dog"], ["the red cat", "a big dog sleeps"]
    assert rouge(predictions, [[t] for t in targets]) == rouge(predictions, targets)
    assert bleu(predictions, [[t] for t in targets]) == bleu(predictions, targets)


def reference_rows(n: int, seed: int) -> list[dict]:
    """Headline rows whose summary is a list: the first four words, and the first three."""
    return [
        {"document": row["document"], "summary": [row["summary"], row["summary"].rsplit(" ", 1)[0]]}
        for row in headline_rows(n, seed)
    ]


def test_list_targets_train_once_per_reference_and_evaluate_against_all(tiny_t5_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_t5_dir)
    train, validation = reference_rows(10, 0), reference_rows(3, 1)
    validation[2]["summary"] = validation[2]["summary"][:1] + ["red cat", "dog"]  # rows may differ in count
    raw = DatasetDict({"train": Dataset.from_list(train), "validation": Dataset.from_list(validation)})
    cfg = DataConfig(text_column="document", label_column="summary", max_target_length=32, cache_dir=str(tmp_path))
    data = process_source_target(raw, tokenizer, cfg, seed=0)
    assert len(data.train) == 20 and data.extras["training_rows"] == 10  # every reference its own pair
    pairs = {(tokenizer.decode(r["input_ids"]), tokenizer.decode(r["labels"], skip_special_tokens=True).strip())
             for r in data.train}  # fmt: skip
    assert pairs == {(row["document"], text) for row in train for text in row["summary"]}
    assert data.validation["row"] == [2 * SPLIT_IDS + i for i in range(3)]  # numbered, after train's k = 1
    assert [data.extras["references"][i] for i in data.validation["row"]] == [row["summary"] for row in validation]
    first = [tokenizer.decode(r["labels"], skip_special_tokens=True).strip() for r in data.validation]
    assert first == [row["summary"][0] for row in validation]  # the loss's target: the first reference
    batch = SourceTargetCollator(tokenizer.pad_token_id)([data.validation[0], data.validation[1]])
    assert batch["row"].tolist() == data.validation["row"][:2]

    carved = process_source_target(DatasetDict({"train": Dataset.from_list(train)}), tokenizer, cfg, seed=0)
    assert len(carved.validation) == 1 and len(carved.train) == 18  # a carved row keeps its references
    (row,) = carved.validation["row"]
    assert carved.extras["references"][row] in [r["summary"] for r in train]


def test_a_bad_list_of_references_is_refused_in_one_line(tiny_t5_dir, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(tiny_t5_dir)
    cfg = DataConfig(text_column="document", label_column="summary", cache_dir=str(tmp_path))
    fix = "give each row one target text, or a list of non-empty reference texts"
    for bad, problem in (
        ([], "an empty list of references"),
        (["red cat", " "], "an empty reference text (['red cat', ' '])"),
    ):
        rows = reference_rows(4, 0)
        rows[2]["summary"] = bad
        raw = DatasetDict({"train": Dataset.from_list(rows)})
        with pytest.raises(UserError) as refused:
            process_source_target(raw, tokenizer, cfg, seed=0)
        assert str(refused.value) == f"row 3 of 4 of the train data's 'summary' column holds {problem}; {fix}"
    numbers = [{"document": row["document"], "summary": [1, 2]} for row in headline_rows(3, 0)]
    raw = DatasetDict({"train": Dataset.from_list(reference_rows(4, 0)), "validation": Dataset.from_list(numbers)})
    with pytest.raises(UserError, match=r"row 1 of 3 of the validation data's 'summary' column holds a list of int"):
        process_source_target(raw, tokenizer, cfg, seed=0)

    out = tmp_path / "out"
    base = {
        "task": "seq2seq",
        "model_name_or_path": tiny_t5_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", reference_rows(20, 0)),
        "output_dir": str(out),
        "report_to": "none",
        "max_steps": 2,
    }
    empty = [{**row, "summary": []} if i == 4 else row for i, row in enumerate(reference_rows(6, 2))]
    cases = {
        "an empty list in a validation row": (
            {**base, "validation_file": write_jsonl(tmp_path / "empty.jsonl", empty)},
            f"row 5 of 6 of the validation data's 'summary' column holds an empty list of references; {fix}",
        ),
        "lists of numbers": (
            {**base, "train_file": write_jsonl(tmp_path / "numbers.jsonl", numbers)},
            "row 1 of 3 of the train data's 'summary' column holds a list of int ([1, 2]), not of texts",
        ),
        "texts and lists": (  # found in review: "holds lists, not one target text per row" told to do as it did
            {
                **base,
                "validation_file": write_jsonl(
                    tmp_path / "mixed.jsonl",
                    [{**row, "summary": "one text"} if i == 1 else row for i, row in enumerate(reference_rows(3, 2))],
                ),
            },
            "the validation data's 'summary' column mixes single target texts and lists of references; write "
            'every row\'s target as a list (["text"] for one reference), or every one as a single text',
        ),
    }
    assert_each_refused(cases, capsys, out)


@pytest.mark.slow  # twelve short epochs over 320 pairs, as the headline run
def test_a_run_trains_on_every_reference_and_scores_against_all(tiny_t5_dir, tmp_path, capsys):
    out = tmp_path / "out"
    validation = reference_rows(4, 1)
    options = {
        "task": "seq2seq",
        "model_name_or_path": tiny_t5_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", reference_rows(160, 0)),
        "validation_file": write_jsonl(tmp_path / "validation.jsonl", validation),
        "output_dir": str(out),
        "max_target_length": 12,
        "num_train_epochs": 12,
        "per_device_train_batch_size": 16,
        "learning_rate": 3e-3,
        "mixed_precision": "no",
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    said = capsys.readouterr().out
    assert "data: 320 train / 4 validation (source, target) pairs (160 training rows: 320 pairs from their " in said
    results = json.loads((out / "eval_results.json").read_text())
    assert results["samples"] == 4  # rows, not pairs
    shown = results["generations"]
    assert [g["target"] for g in shown] == [row["summary"] for row in validation]  # every reference
    generated = [g["generated"] for g in shown]
    references = [g["target"] for g in shown]
    assert results["bleu"] == pytest.approx(bleu(generated, references))
    for name, value in rouge(generated, references).items():
        assert results[name] == pytest.approx(value)
    assert results["rougeL"] > 45, results  # it learned the headlines
    assert all(word in SEQ2SEQ_WORDS for text in generated for word in text.split())
