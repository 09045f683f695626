"""--task question_answering (cloudtrain.tasks.question_answering, cloudtrain.data.answer_spans, cloudtrain.answers):
SQuAD's metrics, answers chosen over windows, answers read as records or texts and their targets, a run that
learns (questions without an answer among them) and predicts for an unlabelled split, `predict` and transformers'
pipeline on the saved model, its card, an adapter, and every refusal in one line (two processes:
test_distributed.py)."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_each_refused
from datasets import Dataset, DatasetDict

from cloudtrain.answers import Window, best_answer, normalize, squad_scores
from cloudtrain.cli import main
from cloudtrain.config import DataConfig
from cloudtrain.data.answer_spans import process_answer_spans
from cloudtrain.errors import UserError
from cloudtrain.predict import predict

PEOPLE = ["john", "mary", "peter", "anna", "david", "susan"]
CITIES = ["paris", "london", "berlin", "madrid", "rome", "vienna"]
FILLER = "the weather was mild and the market was busy while trains came and left all day long".split()


def squad_rows(n: int, seed: int, unanswerable: float = 0.0) -> list[dict]:
    """SQuAD-shaped rows: a trip among filler words; "who travelled?" asks for the person, "where did someone go?"
    for the city; a share of the contexts have no trip (no answer)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        person, city = rng.choice(PEOPLE), rng.choice(CITIES)
        filler = [rng.choice(FILLER) for _ in range(rng.randint(5, 60))]
        at = rng.randint(0, len(filler))
        trip = f"{person} went to {city}"
        context = " ".join([*filler[:at], trip, *filler[at:]])
        question, answer = rng.choice([("who travelled?", person), ("where did someone go?", city)])
        if rng.random() < unanswerable:
            rows.append(
                {"question": question, "context": " ".join(filler), "answers": {"text": [], "answer_start": []}}
            )
            continue
        start = context.index(trip) + (0 if answer == person else len(trip) - len(city))
        rows.append({"question": question, "context": context, "answers": {"text": [answer], "answer_start": [start]}})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_squad_metrics():
    assert normalize("The  Eiffel Tower!") == "eiffel tower"
    scores = squad_scores(
        ["the Eiffel tower", "in Paris", "", "Rome"],
        [["Eiffel Tower"], ["Paris", "in Paris"], [], ["Vienna"]],
    )
    assert scores["exact_match"] == pytest.approx(75.0)  # 1, 1 ("in Paris" is a reference), 1 (no answer), 0
    # F1 per example: 1, 1, 1, 0
    assert scores["f1"] == pytest.approx(75.0)
    # SQuAD 2.0's breakdown: the three answered questions (HasAns), the one without (NoAns)
    assert (scores["has_answer_total"], scores["no_answer_total"]) == (3, 1)
    assert scores["has_answer_exact_match"] == scores["has_answer_f1"] == pytest.approx(200 / 3)
    assert scores["no_answer_exact_match"] == scores["no_answer_f1"] == 100.0
    article = squad_scores(["paris", "london"], [["the"], ["London"]])  # a reference of an article alone scores
    assert article["f1"] == 50.0 and set(article) == {"exact_match", "f1"}  # as "", yet the question has an answer
    unanswerable = squad_scores(["", "rome"], [[], []])  # no question with an answer: no has_answer scores
    assert unanswerable["no_answer_f1"] == 50.0 and not [k for k in unanswerable if k.startswith("has_answer")]
    partial = squad_scores(["paris france"], [["in Paris, France"]])  # 2 of 2 predicted words, 2 of 3 expected
    assert partial["exact_match"] == 0 and partial["f1"] == pytest.approx(100 * 2 * 1 * (2 / 3) / (1 + 2 / 3))
    assert set(partial) == {"exact_match", "f1"}  # every question answerable: no breakdown


def test_the_best_span_over_windows_in_the_context_and_no_answer_where_it_scores_higher():
    context = "john went to paris"
    offsets = np.array([(-1, -1), (0, 4), (5, 9), (10, 12), (13, 18), (-1, -1)])  # [CLS] question.. context [SEP]
    first, second = Window(0, offsets), Window(0, offsets)
    low, high = torch.zeros(6), torch.zeros(6)
    high[4] = 5.0  # the second window is sure of "paris"
    text, start, probability = best_answer([first, second], [low, high], [low, high], context, 30, False)
    assert (text, start) == ("paris", 13) and 0 < probability <= 1
    outside = torch.zeros(6)
    outside[5] = 9.0  # a special token's high score is never an answer
    assert best_answer([first], [outside], [outside], context, 30, False)[0] != ""
    none = torch.zeros(6)
    none[0] = 9.0  # the first token's score: no answer, where the data has such questions
    text, start, probability = best_answer([first], [none], [none], context, 30, True)
    assert (text, start) == ("", -1) and probability == pytest.approx(torch.softmax(none, 0)[0].item() ** 2)
    assert best_answer([first], [high], [high], context, 30, True)[0] == "paris"
    blank = np.array([(-1, -1), (0, 1), (1, 3), (3, 4), (-1, -1), (-1, -1)])  # "a", "\n\n", "b"
    sure = torch.zeros(6)
    sure[2] = 9.0  # whitespace alone is never an answer, however sure the model is
    assert best_answer([Window(0, blank)], [sure], [sure], "a\n\nb", 30, False)[0] in ("a", "b", "a\n\nb")
    spaced = np.array([(-1, -1), (0, 4), (4, 9), (9, 12), (12, 18), (-1, -1)])  # byte-level: a word takes its space
    assert best_answer([Window(0, spaced)], [high], [high], context, 30, False)[:2] == ("paris", 13)
    long = torch.zeros(6)
    long[1], long[4] = 5.0, 0.0
    ends = torch.zeros(6)
    ends[4] = 5.0  # "john went to paris" is 4 tokens: too long for --max_answer_length 2
    assert best_answer([first], [long], [ends], context, 2, False)[0] != context


def test_answers_as_records_or_texts_and_their_targets_over_windows(bert_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bert_tokenizer_dir)
    rows = squad_rows(20, 0)
    texts = [{**r, "answers": r["answers"]["text"][0]} for r in rows]  # a CSV's answer column: the text alone
    cfg = DataConfig(text_column="question", text_pair_column="context", label_column="answers", max_length=32,
                     doc_stride=8, validation_split_percentage=20)  # fmt: skip
    a = process_answer_spans(DatasetDict({"train": Dataset.from_list(rows)}), tokenizer, cfg, seed=0)
    b = process_answer_spans(DatasetDict({"train": Dataset.from_list(texts)}), tokenizer, cfg, seed=0)
    assert a.train["start_positions"] == b.train["start_positions"] and len(a.train) > 16  # windows: more rows
    found = 0
    for window in a.train:
        start, end = window["start_positions"], window["end_positions"]
        if start:  # the window holds the answer: its tokens are it
            found += 1
            answer = tokenizer.decode(window["input_ids"][start : end + 1])
            assert answer in PEOPLE + CITIES, answer
        else:
            assert end == 0
    assert 16 <= found < len(a.train)  # each training question's answer is in a window, not in all of them
    assert all(w.offsets.shape[1] == 2 for w in a.extras["windows"].values())
    assert len(a.extras["examples"]) == 4 and not a.extras["allow_none"]  # the carved validation questions
    assert a.extras["cut_answers"] == (0, 16) and "example" not in a.train.column_names


def test_answers_that_lie_whole_in_no_window_are_counted_and_said(bert_tokenizer_dir):
    """An answer longer than a window's context, or across every window's edge, trained as "no answer" without a
    word (found in audit: 18 of 30 answers)."""
    from transformers import AutoTokenizer

    from cloudtrain.config import build_config
    from cloudtrain.tasks.question_answering import QuestionAnsweringTask

    tokenizer = AutoTokenizer.from_pretrained(bert_tokenizer_dir)
    long = "the old man who lived by the sea with his seven grey cats"
    rows = [
        {
            "question": "who?",
            "context": f"yesterday {long} came home",
            "answers": {"text": [long], "answer_start": [10]},
        }
    ] * 3 + squad_rows(4, 0)
    cfg = build_config({"task": "question_answering", "max_length": 16, "doc_stride": 4, "label_column": "answers",
                        "text_column": "question", "text_pair_column": "context"})  # fmt: skip
    data = process_answer_spans(DatasetDict({"train": Dataset.from_list(rows)}), tokenizer, cfg.data, seed=0)
    cut, kept = data.extras["cut_answers"]
    assert cut >= 1 and kept >= 1  # the long answer fits no 16-token window; the short ones do
    said = QuestionAnsweringTask(cfg).describe_data(data)
    assert f"note: {cut} training answers lie whole in no window of --max_length 16 with --doc_stride 4" in said


@pytest.mark.slow  # about 40 s: the tiny model needs ten epochs of windows to tell a person from a city
def test_a_run_learns_predicts_and_the_saved_model_answers(tiny_model_dir, tmp_path, capsys):
    unlabelled = [{"question": r["question"], "context": r["context"]} for r in squad_rows(5, 3)]
    unlabelled += [{"question": "who travelled?", "context": " ".join(FILLER)}] * 2  # no trip: no answer
    out = tmp_path / "out"
    options = {  # SQuAD's column names: read without options
        "task": "question_answering",
        "model_name_or_path": tiny_model_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", squad_rows(240, 0, unanswerable=0.1)),
        "validation_file": write_jsonl(tmp_path / "validation.jsonl", squad_rows(40, 1, unanswerable=0.1)),
        "test_file": write_jsonl(tmp_path / "test.jsonl", unlabelled),
        "output_dir": str(out),
        "max_length": 48,
        "doc_stride": 16,
        "num_train_epochs": 10,
        "per_device_train_batch_size": 16,
        "learning_rate": 3e-3,
        "mixed_precision": "no",
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    said = capsys.readouterr().out
    results = json.loads((out / "eval_results.json").read_text())
    assert results["f1"] > 70 and results["samples"] == 40, results  # the answer's kind follows the question
    assert results["has_answer_total"] + results["no_answer_total"] == 40 and results["no_answer_total"] > 0
    assert f"eval: f1 {results['f1']:.2f} | exact_match {results['exact_match']:.2f} | has_answer_f1 " in said
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForQuestionAnswering"]

    written = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    questions, contexts = [r["question"] for r in unlabelled], [r["context"] for r in unlabelled]
    assert [r["answer"] for r in written[5:]] == ["", ""]  # it learnt "no answer" from the training data's
    assert "predict --model_dir " in said and '--text_pair "<context>" --handle_impossible_answer true' in said
    predicted = predict(str(out), questions, pairs=contexts, allow_none=True)  # --handle_impossible_answer
    for mine, theirs, context in zip(written, predicted, contexts, strict=True):
        assert mine["answer"] == theirs["answer"] and mine["start"] == theirs["start"]
        assert context[theirs["start"] : theirs["end"]] == theirs["answer"] or theirs["end"] == -1
    assert predicted[5]["score"] > 0.5  # no answer's probability
    spans = predict(str(out), questions, pairs=contexts)  # by default the best span, as transformers' pipeline
    assert spans[:5] == predicted[:5] and all(row["answer"] in " ".join(FILLER) and row["answer"] for row in spans[5:])

    from transformers import AutoModelForQuestionAnswering, AutoTokenizer  # as the card's snippet reads it

    tokenizer, model = AutoTokenizer.from_pretrained(out), AutoModelForQuestionAnswering.from_pretrained(out)
    short = next(i for i, c in enumerate(contexts) if len(tokenizer(questions[i], c)["input_ids"]) <= 48)
    inputs = tokenizer(questions[short], contexts[short], return_tensors="pt")  # one window: the argmax is the span
    scores = model(**inputs)
    first, last = scores.start_logits.argmax(-1).item(), scores.end_logits.argmax(-1).item()
    assert tokenizer.decode(inputs["input_ids"][0, first : last + 1]) == predicted[short]["answer"]

    from cloudtrain.config.parse import resolve_options
    from cloudtrain.tasks import build_task

    cfg = resolve_options(None, {**options, "push_to_hub": True, "hub_model_id": "me/qa"})
    card = build_task(cfg).model_card(
        out, cfg, {"train": json.loads((out / "train_results.json").read_text()), "eval": results}
    )
    assert card.data.pipeline_tag == "question-answering" and "extractive question answering" in card.text
    assert "AutoModelForQuestionAnswering.from_pretrained" in card.text and "## Labels" not in card.text


def test_an_adapter_and_its_merged_model_answer(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "lora"
    options = {
        "task": "question_answering",
        "model_name_or_path": tiny_model_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", squad_rows(40, 0)),
        "output_dir": str(out),
        "peft": "lora",
        "merge_adapters": "true",
        "max_steps": 3,
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "QUESTION_ANS"
    context = "the market was busy and john went to paris"
    rows = [predict(str(d), ["who travelled?"], pairs=[context])[0] for d in (out, out / "merged")]
    assert rows[0]["answer"] == rows[1]["answer"] and rows[0]["answer"] in context
    short = predict(str(out), ["who travelled?"], max_length=24, pairs=[context * 3])[0]  # shorter windows than trained
    assert short["answer"] in context and (context * 3)[short["start"] : short["end"]] == short["answer"]
    elsewhere = tmp_path / "elsewhere"  # an adapter from another tool: no args.json
    elsewhere.mkdir()
    for file in out.iterdir():
        if file.is_file() and file.name != "args.json":
            (elsewhere / file.name).write_bytes(file.read_bytes())
    assert main(["predict", "--model_dir", str(elsewhere), "--text", "who travelled?"]) == 2
    assert "give each --text its second text" in capsys.readouterr().err
    assert main(["predict", "--model_dir", str(out), "--text", "who travelled?"]) == 2  # a question needs a context
    assert "was trained on a question and its context (--text QUESTION --text_pair CONTEXT): give each --text its " in (
        capsys.readouterr().err
    )


def test_each_refusal_is_one_line(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rows = squad_rows(20, 0)
    moved = [{**rows[0], "answers": {"text": ["nowhere"], "answer_start": [3]}}, *rows[1:]]
    base = {
        "task": "question_answering",
        "model_name_or_path": tiny_model_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", rows),
        "output_dir": str(out),
        "report_to": "none",
        "max_steps": 2,
    }
    no_context = [{"question": r["question"], "passage": r["context"], "answers": r["answers"]} for r in rows]
    uneven = [{**rows[0], "answers": {"text": ["a", "b"], "answer_start": [0]}}, *rows[1:]]
    wordy_start = [{**rows[0], "answers": {**rows[0]["answers"], "answer_start": ["abc"]}}, *rows[1:]]  # (audit)
    wordy = [{**rows[0], "question": "who " * 40}, *rows[1:]]
    unset = [rows[0], {**rows[1], "context": None}, *rows[2:]]  # "'x' is not at character 12 of its context" (audit)
    listed = [{**r, "question": [r["question"]]} for r in rows]  # was trained on "['who travelled?']" (audit)
    cases = {
        "a row without its context": (
            {**base, "train_file": write_jsonl(tmp_path / "unset.jsonl", unset)},
            "row 1 of the train data has an answer but an empty 'context' column; give each question its context",
        ),
        "a list of questions": (
            {**base, "train_file": write_jsonl(tmp_path / "listed.jsonl", listed)},
            "the train data's 'question' column holds lists (['who travelled?']), not one question text per row; "
            "give one question per row",
        ),
        "no context column": (
            {**base, "train_file": write_jsonl(tmp_path / "nc.jsonl", no_context)},
            "the data has no 'context' column; pass --text_pair_column <name>",
        ),
        "answer elsewhere": (
            {**base, "train_file": write_jsonl(tmp_path / "moved.jsonl", moved)},
            "row 0 of the train data: the answer 'nowhere' is not at character 3 of its context",
        ),
        "stride": (
            {**base, "doc_stride": "128", "max_length": "128"},
            "--doc_stride 128 must be less than --max_length 128",
        ),
        "answer length": ({**base, "max_answer_length": "0"}, "--max_answer_length must be at least 1"),
        "starts": (
            {**base, "train_file": write_jsonl(tmp_path / "uneven.jsonl", uneven)},
            "the 'answers' column has a row with 2 answer texts and 1 answer_start values; give one start per answer",
        ),
        "a start that is no offset": (
            {**base, "train_file": write_jsonl(tmp_path / "start.jsonl", wordy_start)},
            "the 'answers' column has an answer_start 'abc' that is no character offset",
        ),
        "long question": (
            {**base, "train_file": write_jsonl(tmp_path / "wordy.jsonl", wordy), "max_length": "48", "doc_stride": "8"},
            "row 0 of the train data: the question is 40 tokens, which leaves 5 of --max_length 48 for its context, "
            "not more than --doc_stride 8; raise --max_length, lower --doc_stride or shorten the question",
        ),
    }
    assert_each_refused(cases, capsys, out)


def test_numbers_in_questions_contexts_and_answers_read_as_their_text(bert_tokenizer_dir, tiny_model_dir, tmp_path):
    """A context of digits alone (a jsonl 1000) was kept as an int and sliced as a text (TypeError), and a csv
    answer column of years was refused as "holds int values" (found in audit): each is read as its text, a csv's
    as written ('007' stays '007')."""
    from transformers import AutoTokenizer

    from cloudtrain.config.parse import resolve_options
    from cloudtrain.data.answer_spans import _answers
    from cloudtrain.tasks import build_task

    assert _answers(1834, "answers") == [("1834", None)]
    with pytest.raises(UserError, match="holds float values"):  # 2.0 for "version 2.0" was cut to "2" (review)
        _answers(2.0, "answers")
    tokenizer = AutoTokenizer.from_pretrained(bert_tokenizer_dir)
    cfg = DataConfig(text_column="question", text_pair_column="context", label_column="answers", max_length=32,
                     doc_stride=8, validation_split_percentage=50)  # fmt: skip
    for rows in (
        [{"question": "what?", "context": 1000 + i, "answers": 1000 + i} for i in range(8)],
        [{"question": 7, "context": f"built in {1800 + i}", "answers": 1800 + i} for i in range(8)],
    ):
        data = process_answer_spans(DatasetDict({"train": Dataset.from_list(rows)}), tokenizer, cfg, seed=0)
        examples = list(data.extras["examples"].values())
        assert len(examples) == 4 and all(isinstance(c, str) and a[0] in c for c, a in examples), examples
    lines = ["question,context,answers"] + [f"when was tower {i} built?,tower {i} was built in 18{i}4,18{i}4" for i in
             range(8)] + ["who is 007?,the agent 007 is bond,007"]  # fmt: skip
    (tmp_path / "years.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "numbers.csv").write_text("question,context\nwhat number?,18611\n")
    options = {"task": "question_answering", "model_name_or_path": tiny_model_dir, "output_dir": str(tmp_path / "out"),
               "train_file": str(tmp_path / "years.csv"), "test_file": str(tmp_path / "numbers.csv"), "max_steps": 1,
               "report_to": "none"}  # fmt: skip
    raw = build_task(resolve_options(None, options)).connect(resolve_options(None, options))
    assert raw["train"]["answers"][-2:] == ["1874", "007"] and raw["test"]["context"] == ["18611"]
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    predicted = json.loads((tmp_path / "out" / "test_predictions.jsonl").read_text())
    answer, start = predicted["answer"], predicted["start"]
    assert predicted["question"] == "what number?" and "18611"[start : start + len(answer)] == answer, predicted
    validation = write_jsonl(tmp_path / "validation.jsonl", squad_rows(3, 1))  # SQuAD's columns, read without options
    argv = ["predict", "--model_dir", str(tmp_path / "out"), "--input_file", validation, "--output_file"]
    assert main([*argv, str(tmp_path / "answers.jsonl")]) == 0  # was "column 'text' is not in ..." (audit)
    answered = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [r["text"] for r in answered] == [r["question"] for r in squad_rows(3, 1)]


def test_a_record_of_one_answer_is_read_as_squads_record_of_one():
    """{"text": "went", "answer_start": 5} was refused with "the column holds dict values" (found in audit)."""
    from cloudtrain.data.answer_spans import _answers

    assert _answers({"text": "went", "answer_start": 5}, "answers") == [("went", 5)]
    assert _answers({"text": "went"}, "answers") == [("went", None)]  # found in the context
    assert _answers([{"text": "went", "answer_start": "5"}], "answers") == [("went", 5)]
    assert _answers({"text": ["went"], "answer_start": 5}, "answers") == [("went", 5)]  # (a TypeError: review)


def test_an_unanswered_validation_file_is_for_predictions_and_a_decoder_pads_on_the_right(tiny_llama_dir, tmp_path):
    """A decoder's tokenizer saved padding on the left still trains on the right targets (its loss is that of a
    guess among the window's tokens, not of padded positions), and a validation file without answers is predicted
    while validation is carved from train; empty answer texts are questions without an answer."""
    from transformers import AutoTokenizer

    model = tmp_path / "left"
    AutoTokenizer.from_pretrained(tiny_llama_dir, padding_side="left").save_pretrained(model)
    for name in ("config.json", "model.safetensors"):
        (model / name).write_bytes((Path(tiny_llama_dir) / name).read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer.padding_side == "left"
    rows = squad_rows(30, 0)
    rows[1]["answers"] = {"text": [""], "answer_start": [0]}  # no answer
    questions = [{"question": r["question"], "context": r["context"]} for r in squad_rows(6, 1)]
    out = tmp_path / "out"
    options = {
        "task": "question_answering",
        "model_name_or_path": str(model),
        "train_file": write_jsonl(tmp_path / "train.jsonl", rows),
        "validation_file": write_jsonl(tmp_path / "questions.jsonl", questions),
        "output_dir": str(out),
        "max_length": "64",
        "doc_stride": "16",
        "max_steps": "2",
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    assert AutoTokenizer.from_pretrained(out).padding_side == "right"
    loss = json.loads((out / "train_results.json").read_text())["train_loss"]
    assert loss < 2 * np.log(64), loss  # a padded target would cost about 1e4
    answers = [json.loads(line) for line in (out / "validation_predictions.jsonl").read_text().splitlines()]
    assert [a["question"] for a in answers] == [q["question"] for q in questions]
    for answer, question in zip(answers, questions, strict=True):
        assert question["context"][answer["start"] : answer["start"] + len(answer["answer"])] == answer["answer"]
