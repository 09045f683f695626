"""--task token_classification (cloudtrain.tasks.token_classification, cloudtrain.data.word_tags,
cloudtrain.entities): entities and scores against seqeval's, words and tags read from lists and texts, each word's
tag on its first token, a run that learns and predicts for an unlabelled split, `predict` and transformers' pipeline
on the saved model, its card, an adapter, and every refusal in one line (two processes: test_distributed.py)."""

import contextlib
import json
import random
from pathlib import Path

import pytest
from conftest import assert_each_refused
from datasets import ClassLabel, Dataset, DatasetDict, Features, List, Value
from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score
from seqeval.metrics.sequence_labeling import get_entities

from cloudtrain.cli import main
from cloudtrain.config import DataConfig
from cloudtrain.data.packing import IGNORE_INDEX
from cloudtrain.data.word_tags import process_word_tags, tag_scheme
from cloudtrain.entities import entity_scores, entity_spans, scored_entities
from cloudtrain.errors import UserError
from cloudtrain.predict import predict

PEOPLE = [["john", "smith"], ["mary"], ["peter", "jones"], ["anna", "brown"], ["david"]]
PLACES = [["paris"], ["new", "york"], ["london"], ["berlin"], ["san", "francisco"]]
ORGS = [["acme", "corp"], ["the", "bank"], ["general", "motors"], ["apple"], ["oxford", "university"]]
FILLERS = ["visited", "met", "saw", "left", "joined", "called", "in", "with", "today", "yesterday", "and", "later"]
TAGS = ["O", "B-LOC", "B-ORG", "B-PER", "I-LOC", "I-ORG", "I-PER"]  # sorted, "O" first


def tagged_rows(n: int, seed: int) -> list[dict]:
    """Rows of CoNLL's shape ("tokens", "ner_tags"): people, places and organisations among filler words."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words, tags = [], []
        for _ in range(rng.randint(2, 5)):
            if rng.random() < 0.6:
                kind, pool = rng.choice([("PER", PEOPLE), ("LOC", PLACES), ("ORG", ORGS)])
                entity = rng.choice(pool)
                words += entity
                tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(entity) - 1)
            else:
                words.append(rng.choice(FILLERS))
                tags.append("O")
        rows.append({"tokens": words, "ner_tags": tags})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_entities_and_scores_equal_seqeval_s():
    rng = random.Random(0)
    tags = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "E-PER", "S-LOC", "I-ORG"]  # IOB2, IOB1 and IOBES mixed
    for _ in range(2000):
        row = [rng.choice(tags) for _ in range(rng.randint(0, 10))]
        assert [(kind, a, b - 1) for kind, a, b in entity_spans(row)] == get_entities(row), row
    references = [[rng.choice(tags[:5]) for _ in range(rng.randint(1, 10))] for _ in range(300)]
    predictions = [[rng.choice(tags[:5]) if rng.random() < 0.3 else t for t in row] for row in references]
    got = entity_scores(references, predictions)
    assert got["f1"] == pytest.approx(f1_score(references, predictions))
    assert got["precision"] == pytest.approx(precision_score(references, predictions))
    assert got["recall"] == pytest.approx(recall_score(references, predictions))
    assert got["accuracy"] == pytest.approx(accuracy_score(references, predictions))
    assert set(got["entity_f1"]) == {"PER", "LOC"}
    # plain IO tags (no prefix) are entities too; BILOU reads as IOBES
    assert entity_spans(["PER", "PER", "O", "LOC"]) == [("PER", 0, 2), ("LOC", 3, 4)]
    assert entity_spans(["B-PER", "L-PER", "U-LOC"]) == [("PER", 0, 2), ("LOC", 2, 3)]
    # a word with no tag (no token to predict from) is passed over, as evaluation leaves it out
    assert scored_entities(["B-LOC", None, "I-LOC", "O"], [0.5, 0.0, 0.7, 0.9]) == [("LOC", 0, 3, 0.6)]


def test_lists_and_texts_read_the_same_and_each_word_s_tag_is_on_its_first_token(bert_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bert_tokenizer_dir)
    rows = [{"text": ["unbelievably", "john", "smith"], "label": ["O", "B-PER", "I-PER"]}] + [
        {"text": r["tokens"], "label": r["ner_tags"]} for r in tagged_rows(30, 0)
    ]
    texts = [{"text": " ".join(r["text"]), "label": " ".join(r["label"])} for r in rows]
    cfg = DataConfig(validation_split_percentage=20)
    a = process_word_tags(DatasetDict({"train": Dataset.from_list(rows)}), tokenizer, cfg, seed=0)
    b = process_word_tags(DatasetDict({"train": Dataset.from_list(texts)}), tokenizer, cfg, seed=0)
    assert a.label_names == b.label_names == TAGS
    assert a.train["labels"] == b.train["labels"] and a.validation["input_ids"] == b.validation["input_ids"]

    first = next(r for r in a.train.to_list() + a.validation.to_list() if r["input_ids"][1:3] != [101, 102])
    words = tokenizer.convert_ids_to_tokens(first["input_ids"])
    for token, label in zip(words, first["labels"], strict=True):  # a word's later pieces and [CLS]/[SEP]: -100
        assert (label == IGNORE_INDEX) == (token.startswith("##") or token in ("[CLS]", "[SEP]")), (words, first)
    batch = a.collator([a.train[0], a.train[1]])
    assert batch["labels"].shape == batch["input_ids"].shape  # padded with -100 to the batch's longest row

    csv = tmp_path / "test.csv"  # a CSV split whose tag column is empty throughout reads as numbers: no tags
    csv.write_text("text,label\njohn smith left,\nmary saw paris,\n")
    raw = DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_csv(str(csv))})
    assert set(process_word_tags(raw, tokenizer, cfg, seed=0).unlabelled) == {"test"}

    names = ["O", "B-X", "I-X"]  # a Sequence(ClassLabel) column is read by its names, in its order
    features = Features({"tokens": List(Value("string")), "ner_tags": List(ClassLabel(names=names))})
    hub = DatasetDict({"train": Dataset.from_dict({"tokens": [["a", "b"]], "ner_tags": [[1, 2]]}, features=features)})
    scheme = tag_scheme(hub, DataConfig(label_column="ner_tags"))
    assert scheme.names == names and scheme.encoder(hub["train"])([1, 2]) == [1, 2]
    hidden = Dataset.from_dict({"tokens": [["a", "b"]], "ner_tags": [[-1, -1]]}, features=features)  # GLUE-style test
    assert not scheme.labelled(hidden, "test")


def test_words_with_no_token_are_counted_and_said(bert_tokenizer_dir):
    """Words past --max_length, or tokenized to nothing, are neither trained nor scored: the evaluation's recall
    left their entities out without a word (found in audit: 29 of 47 gold entities scored)."""
    from transformers import AutoTokenizer

    from cloudtrain.config import build_config
    from cloudtrain.tasks.token_classification import TokenClassificationTask

    tokenizer = AutoTokenizer.from_pretrained(bert_tokenizer_dir)
    rows = [
        {"text": ["john", "\u200b", "visited"], "label": ["B-PER", "B-LOC", "O"]},  # a word of no token
        {"text": ["mary", "saw", "paris", "and", "rome", "today"], "label": ["B-PER", "O", "B-LOC", "O", "B-LOC", "O"]},
    ]
    raw = DatasetDict({"train": Dataset.from_list(rows), "validation": Dataset.from_list(rows)})
    cfg = DataConfig(max_length=6)  # [CLS] + 4 words + [SEP]: "rome" and "today" are cut
    data = process_word_tags(raw, tokenizer, cfg, seed=0)
    assert data.extras["unscored"] == {"train": (3, 9, 2), "validation": (3, 9, 2)}
    task = TokenClassificationTask(build_config({"task": "token_classification", "max_length": 6}))
    said = task.describe_data(data)
    assert "note: 3 of the 9 validation words (2 tagged other than O) have no token within --max_length 6" in said
    whole = process_word_tags(raw, tokenizer, DataConfig(max_length=64), seed=0)
    assert whole.extras["unscored"] == {"train": (1, 9, 1), "validation": (1, 9, 1)}  # the zero-width space alone
    with pytest.raises(UserError, match=r"^none of the 9 training words keeps a token within --max_length 2: "):
        process_word_tags(raw, tokenizer, DataConfig(max_length=2), seed=0)  # [CLS] [SEP]: it trained on nothing


def test_an_evaluation_that_scores_no_word_has_no_loss_not_a_perfect_one(tiny_model_dir, bert_tokenizer_dir):
    """A loss of 0.0 over no token looked perfect (found in audit)."""
    import math

    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from cloudtrain.config import build_config
    from cloudtrain.tasks.token_classification import TokenClassificationTask

    tokenizer = AutoTokenizer.from_pretrained(bert_tokenizer_dir)
    rows = [{"text": ["john", "visited"], "label": ["B-PER", "O"]}, {"text": ["\u200b"], "label": ["B-PER"]}]
    raw = DatasetDict({"train": Dataset.from_list(rows[:1]), "validation": Dataset.from_list(rows[1:])})
    data = process_word_tags(raw, tokenizer, DataConfig(max_length=16), seed=0)  # validation: a word of no token
    cfg = build_config({"task": "token_classification", "max_length": 16})
    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=len(data.label_names))
    batches = [data.collator([row]) for row in data.validation]
    same = lambda x: x  # noqa: E731 (one process, on the CPU)
    results = TokenClassificationTask(cfg).evaluate(model, batches, data, same, same, contextlib.nullcontext)
    assert math.isnan(results["loss"]) and results["samples"] == 1


def test_a_heads_tags_are_kept_when_the_data_lacks_some_of_them():
    """A NER model fine-tuned on data without its MISC tags had its trained head replaced (found in audit)."""
    raw = DatasetDict({"train": Dataset.from_list([{"text": "john left paris", "label": ["B-PER", "O", "B-LOC"]}])})
    head = ["O", "B-MISC", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    assert tag_scheme(raw, DataConfig(), order=head).names == head
    assert tag_scheme(raw, DataConfig(), order=["O", "B-PER"]).names == ["O", "B-LOC", "B-PER"]  # LOC: a new head


@pytest.mark.parametrize("kind", ["generic", "roberta"])
def test_a_byte_level_tokenizer_reads_each_word_as_in_running_text(lm_tokenizer_dir, tmp_path, kind):
    """Split into words, a byte-level BPE tokenizer would read "upon" as a word's start, not the " upon" of running
    text; the task's tokenizer puts a space before each word, and so does the one saved with the model."""
    from transformers import AutoTokenizer, RobertaTokenizerFast

    from cloudtrain.config import build_config
    from cloudtrain.tasks.token_classification import TokenClassificationTask

    folder = tmp_path / kind
    if kind == "roberta":  # a class with its own add_prefix_space option, which it saves and reapplies on loading
        RobertaTokenizerFast(tokenizer_file=str(Path(lm_tokenizer_dir) / "tokenizer.json")).save_pretrained(folder)
    else:
        AutoTokenizer.from_pretrained(lm_tokenizer_dir).save_pretrained(folder)
    words = ["once", "upon", "a", "time"]
    plain = AutoTokenizer.from_pretrained(folder)
    running = plain.tokenize(" " + " ".join(words))
    assert plain.tokenize(words, is_split_into_words=True) != running  # the problem: "upon" without its space
    cfg = build_config({"task": "token_classification", "model_name_or_path": str(folder)})
    TokenClassificationTask(cfg).load_tokenizer(cfg).save_pretrained(tmp_path / "saved")
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").tokenize(words, is_split_into_words=True) == running


def test_a_run_learns_predicts_and_the_saved_model_reads_as_a_token_classifier(tiny_model_dir, tmp_path, capsys):
    unlabelled = [{"tokens": r["tokens"]} for r in tagged_rows(6, 2)]
    unlabelled[0]["tokens"] = ["john", "\u200b", "smith", "visited", "paris"]  # the second: no token at all
    unlabelled.append({"tokens": ["mary", "saw", "new york"]})  # one word with a space in it: still one word
    out = tmp_path / "out"
    options = {  # CoNLL's column names: read without --text_column/--label_column
        "task": "token_classification",
        "model_name_or_path": tiny_model_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", tagged_rows(120, 0)),
        "validation_file": write_jsonl(tmp_path / "validation.jsonl", tagged_rows(30, 1)),
        "test_file": write_jsonl(tmp_path / "test.jsonl", unlabelled),
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
    assert results["f1"] > 0.8 and results["samples"] == 30, results  # the entities are words no other tag has
    assert set(results["entity_f1"]) == {"PER", "LOC", "ORG"}
    assert f"eval: f1 {results['f1']:.4f} | precision " in said and "7 tags: O, B-LOC" in said
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForTokenClassification"] and list(config["label2id"]) == sorted(TAGS)

    written = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    assert [r["words"] for r in written] == [r["tokens"] for r in unlabelled]
    assert written[0]["tags"][1] is None and None not in written[0]["tags"][2:]  # the later words keep their own
    assert written[0]["entities"][0]["text"].startswith("john")
    texts = [" ".join(r["tokens"]) for r in unlabelled]
    predicted = predict(str(out), [r["tokens"] for r in unlabelled])  # the `predict` command's rows, of word lists
    for mine, theirs, text in zip(written, predicted, texts, strict=True):
        assert mine["tags"] == theirs["tags"] and len(mine["tags"]) == len(mine["words"])
        assert [e["text"] for e in mine["entities"]] == [e["text"] for e in theirs["entities"]]
        assert theirs["text"] == text and all(text[e["start"] : e["end"]] == e["text"] for e in theirs["entities"])
    assert predict(str(out), texts[:2]) == predicted[:2]  # a text's words are split at whitespace
    from_file = tmp_path / "from_file.jsonl"  # `predict --input_file` of the test file: its word lists
    argv = ["predict", "--model_dir", str(out), "--input_file", str(options["test_file"]), "--text_column", "tokens"]
    assert main([*argv, "--output_file", str(from_file)]) == 0
    assert [json.loads(line)["tags"] for line in from_file.read_text().splitlines()] == [r["tags"] for r in written]

    from transformers import pipeline  # transformers reads the saved model as a token classifier

    grouped = pipeline("token-classification", model=str(out), aggregation_strategy="first")(texts[1])
    assert [(g["entity_group"], g["word"]) for g in grouped] == [
        (e["type"], e["text"]) for e in predicted[1]["entities"]
    ]

    from cloudtrain.config.parse import resolve_options
    from cloudtrain.tasks import build_task

    cfg = resolve_options(None, {**options, "push_to_hub": True, "hub_model_id": "me/ner"})
    card = build_task(cfg).model_card(
        out, cfg, {"train": json.loads((out / "train_results.json").read_text()), "eval": results}
    )
    assert card.data.pipeline_tag == "token-classification"
    assert "token classification (a tag per word, entity-level scores) with 7 tags" in card.text
    assert 'aggregation_strategy="first"' in card.text and f"- F1: {results['f1']:.4f}" in card.text


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_llama_dir"])  # an encoder, and a decoder's last layer
def test_an_adapter_and_its_merged_model_tag_words(model, tmp_path, request):
    out = tmp_path / "lora"
    options = {
        "task": "token_classification",
        "model_name_or_path": request.getfixturevalue(model),
        "train_file": write_jsonl(tmp_path / "train.jsonl", tagged_rows(40, 0)),
        "output_dir": str(out),
        "peft": "lora",
        "merge_adapters": "true",
        "max_steps": 3,
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "TOKEN_CLS"
    rows = [predict(str(model_dir), ["john smith visited paris"])[0] for model_dir in (out, out / "merged")]
    assert rows[0]["tags"] == rows[1]["tags"] and len(rows[0]["tags"]) == 4 and set(rows[0]["tags"]) <= set(TAGS)


def test_each_refusal_is_one_line(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rows = tagged_rows(20, 0)
    short = [{**rows[0], "ner_tags": rows[0]["ner_tags"][:-1]}, *rows[1:]]
    base = {
        "task": "token_classification",
        "model_name_or_path": tiny_model_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", rows),
        "output_dir": str(out),
        "report_to": "none",
        "max_steps": 2,
    }
    one = [{"tokens": r["tokens"], "ner_tags": ["O"] * len(r["tokens"])} for r in rows]
    ids = [{"tokens": r["tokens"], "ner_tags": [TAGS.index(t) for t in r["ner_tags"]]} for r in rows]
    partly = [rows[0], {"tokens": ["mary", "left"], "ner_tags": []}, {"tokens": ["x"], "ner_tags": None}]
    numbers = [{"tokens": 7, "ner_tags": ["O"]} for _ in range(4)]
    cases = {
        "pairs": ({**base, "text_pair_column": "other"}, "tags the words of one text; drop --text_pair_column"),
        "a tag short": (
            {**base, "train_file": write_jsonl(tmp_path / "short.jsonl", short)},
            f"row 0 of the train data has {len(rows[0]['tokens'])} words in 'tokens' and "
            f"{len(rows[0]['tokens']) - 1} tags in 'ner_tags' (an empty tag is none); --task token_classification "
            "needs one tag per word",
        ),
        "one tag": (
            {**base, "train_file": write_jsonl(tmp_path / "one.jsonl", one)},
            "has 1 distinct tag(s) in 'ner_tags'; --task token_classification needs at least 2",
        ),
        "unseen": (
            {**base, "validation_file": write_jsonl(tmp_path / "v.jsonl", [{"tokens": ["x"], "ner_tags": ["B-DATE"]}])},
            "the validation data has tags the training data never saw: B-DATE",
        ),
        "numbers": (
            {**base, "train_file": write_jsonl(tmp_path / "n.jsonl", numbers)},
            "not a row's words: --task token_classification reads a list of words per row",
        ),
        "missing column": ({**base, "label_column": "tags"}, "column 'tags' is not in the train data"),
        "bare ids": (
            {**base, "train_file": write_jsonl(tmp_path / "ids.jsonl", ids)},
            "the 'ner_tags' column holds tag ids (0, 1, 2, 3, ...) without their names: entities are read from names",
        ),
        "some rows untagged": (
            {**base, "validation_file": write_jsonl(tmp_path / "partly.jsonl", partly)},
            "2 of the 3 rows with words of the validation data have no tags; tag them or drop them",
        ),
    }
    assert_each_refused(cases, capsys, out)


def test_the_planner_s_launch_command_keeps_the_task(tiny_model_dir, tmp_path, capsys):
    argv = ["plan", "--task", "token_classification", "--model_name_or_path", tiny_model_dir, "--num_gpus", "1"]
    assert main([*argv, "--gpu_memory_gb", "24", "--output_dir", str(tmp_path / "plan")]) == 0
    said = capsys.readouterr().out
    assert f"--task token_classification --model_name_or_path {tiny_model_dir}" in said, said
    assert "No process sends anything to another in an optimizer step." in said  # one GPU: nothing to exchange


@pytest.mark.parametrize("labels", [3, len(TAGS)])
def test_a_sentence_classifier_s_head_gives_way_to_a_token_classifier_s(labels, tiny_model_dir, tmp_path, capsys):
    """BERT names both heads `classifier`: another label count was transformers' size-mismatch traceback, the same
    count loaded the sentence head's weights as the tagger's, unsaid (found in audit). Now a new head, said."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    source = tmp_path / "sentiment"
    BertForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=labels).save_pretrained(source)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(source)
    out = tmp_path / "out"
    options = {
        "task": "token_classification",
        "model_name_or_path": str(source),
        "train_file": write_jsonl(tmp_path / "train.jsonl", tagged_rows(16, 0)),
        "output_dir": str(out),
        "max_steps": 1,
        "eval_strategy": "no",
        "mixed_precision": "no",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    said = capsys.readouterr().out
    assert f"replacing the head of {source} (BertForSequenceClassification) with a new 7-label token-" in said
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForTokenClassification"] and len(config["id2label"]) == len(TAGS)
