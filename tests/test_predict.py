"""`cloudtrain predict` never replaces a file of the user's unasked, and feeds a sentence-pair model both texts.

- The output: an --output_file that is the --input_file (by its path, a relative path or a symlink), an existing
  file without --overwrite_output_file true, a folder that is a file or cannot be written: each refused in one
  line (exit 2) before any model loads, the files left as they were. A missing folder is made. With the flag the
  file is replaced, whole: a kill between writing and renaming leaves the previous file.
- Pairs: a classifier trained with --text_pair_column (and an encoder reward model: prompt and answer) gets
  (text, second text) through its tokenizer as in training, from --text/--text_pair or from the file's columns
  (the pair column defaults to the one in args.json); single texts for a pair model, or pairs for a single-text
  model, are refused naming the option to add or drop.
- Length: texts are truncated at the max_length in the run's args.json (what its evaluation used) unless
  --max_length says otherwise; a folder without one (or recording more than the model's positions) gets the
  model's context. A classifier, a sentence-pair classifier, a reward model and a --peft lora adapter alike.
Real tiny models trained here in a few seconds; refusals through a fresh interpreter that must not have imported
torch or transformers.
"""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ENTRY, REPO
from test_cli_startup import answers, assert_refused
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import cloudtrain
from cloudtrain.cli import main
from cloudtrain.errors import UserError
from cloudtrain.predict import predict

PREMISES = [
    "the team won the match",
    "shares fell on weak earnings",
    "a storm hit the coast",
    "the striker scored twice",
    "the bank raised interest rates",
    "snow closed the mountain roads",
]
# the label follows the second text alone: a model that sees only the premise cannot get both rows of a premise
HYPOTHESES = {"yes that is right": "agree", "no that is wrong": "disagree"}
COMMON = {
    "max_length": 32, "per_device_train_batch_size": 12, "warmup_ratio": 0.0, "mixed_precision": "no",
    "report_to": "none", "eval_strategy": "no", "logging_steps": 100,
}  # fmt: skip


def pair_rows() -> list[dict]:
    return [{"premise": p, "hypothesis": h, "label": label} for p in PREMISES for h, label in HYPOTHESES.items()]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """A sentence-pair classifier, an encoder reward model (no chat template: prompt and answer as a pair) and a
    single-text classifier's run folder (the pair classifier's, its args.json saying no text_pair_column)."""
    root = tmp_path_factory.mktemp("predict-runs")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in pair_rows()))
    cloudtrain.train(
        {**COMMON, "model_name_or_path": tiny_model_dir, "train_file": str(data), "validation_file": str(data)},
        text_column="premise", text_pair_column="hypothesis", output_dir=str(root / "nli"), max_steps=25,
        learning_rate=3e-3,
    )  # fmt: skip
    prefs = root / "prefs.jsonl"
    prefs.write_text(
        "".join(json.dumps({"prompt": p, "chosen": "yes that is right", "rejected": "no"}) + "\n" for p in PREMISES)
    )
    cloudtrain.train(
        {**COMMON, "model_name_or_path": tiny_model_dir, "train_file": str(prefs), "validation_file": str(prefs)},
        task="reward", output_dir=str(root / "reward"), max_steps=20, learning_rate=3e-3,
    )  # fmt: skip
    single = root / "single"
    shutil.copytree(root / "nli", single)
    recorded = json.loads((single / "args.json").read_text())
    (single / "args.json").write_text(json.dumps({**recorded, "text_column": "text", "text_pair_column": None}))
    return {"nli": root / "nli", "reward": root / "reward", "single": single, "data": data, "prefs": prefs}


def manual_forward(
    model_dir: Path, texts: list[str], pairs: list[str] | list[None], inputs: tuple[str, ...], max_length: int = 512
) -> torch.Tensor:
    """The logits of the saved model on each (text, pair), one at a time: the tokenizer's own pair encoding
    (its first `max_length` tokens, the longer part cut first), of which the model gets `inputs` (what its
    training passed)."""
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    logits = []
    with torch.no_grad():
        for text, pair in zip(texts, pairs, strict=True):
            encoded = tokenizer(text, pair, truncation=True, max_length=max_length, return_tensors="pt")
            logits.append(model(**{name: encoded[name] for name in inputs}).logits)
    return torch.cat(logits)


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["predict", *argv])
    said = capsys.readouterr()
    return code, said.out, said.err


def test_refusals_are_one_line_before_any_model_and_leave_the_files(runs, tmp_path, monkeypatch):
    texts = tmp_path / "texts.txt"
    texts.write_text("the team won\na storm hit\n")
    (tmp_path / "link.txt").symlink_to(texts)
    (tmp_path / "sub").mkdir()
    checkpoint = tmp_path / "sub" / "checkpoint-2"  # the folder holds model.safetensors: "no model" misled (audit)
    checkpoint.mkdir()
    for name in ("trainer_state.json", "model.safetensors"):
        (checkpoint / name).write_text("{}")
    old = tmp_path / "preds.jsonl"
    old.write_text("earlier predictions\n")
    fifo = tmp_path / "fifo"  # a reader may be waiting on it: a device or a FIFO is never replaced by a file
    os.mkfifo(fifo)
    nli, single, reward, data = runs["nli"], runs["single"], runs["reward"], runs["data"]
    predict_single = f"predict --model_dir {single} --input_file {texts}"
    cases = {
        f"{predict_single} --output_file {texts}": f"--output_file {texts} is the --input_file: the predictions "
        f"would replace the texts; write them to another file, such as {tmp_path / 'texts-predictions.jsonl'}",
        f"{predict_single} --output_file {tmp_path / 'link.txt'} --overwrite_output_file true": "is the --input_file",
        f"{predict_single} --output_file {tmp_path / 'sub' / '..' / 'texts.txt'}": "is the --input_file",
        f"{predict_single} --output_file ./sub/../texts.txt": "--output_file ./sub/../texts.txt is the --input_file",
        f"{predict_single} --output_file {old}": f"--output_file {old} exists and is not replaced: name a new file, "
        f"such as {tmp_path / 'preds-2.jsonl'}, or pass --overwrite_output_file true to replace it",
        f"{predict_single} --output_file {tmp_path / 'sub'}": "is a folder; name a file in it",
        f"{predict_single} --output_file {fifo} --overwrite_output_file true": f"--output_file {fifo} is a FIFO, not "
        "a regular file, and is never replaced: name a regular file, or leave out --output_file to print",
        f"{predict_single} --output_file {texts}/p.jsonl": f"{texts} is a file, not a folder; name a file in a folder",
        f"{predict_single} --output_file /proc/p.jsonl": "--output_file /proc/p.jsonl: /proc cannot be written",
        f"predict --model_dir {nli} --text hi": f"the model in {nli} was trained on text pairs (--text_column "
        'premise --text_pair_column hypothesis): give each --text its second text with --text_pair "..."',
        f"predict --model_dir {nli} --input_file {texts}": f"--input_file {texts} holds one text per line, with no "
        "second text; the model in",
        f"predict --model_dir {nli} --text a --text_pair b --text c": "1 --text_pair for 2 --text",
        f"predict --model_dir {nli} --input_file {data} --text_column premise --text_pair_column premise": (
            "--text_pair_column must differ from --text_column"
        ),
        f"predict --model_dir {nli} --input_file {data} --text a": "give each --text its second text",
        f"{predict_single} --text_pair_column b": f"the model in {single} was trained on single texts (its args.json "
        "records no text_pair_column): drop --text_pair_column",
        f"predict --model_dir {single} --text a --text_pair b": "drop --text_pair",
        f"predict --model_dir {single} --text a --max_length 4096": "--max_length 4096 is longer than the model's "
        "context (512 positions); pass --max_length 512 or less",
        f"predict --model_dir {reward} --text hi": "was trained on prompt and answer as a text pair: give each --text",
        f"predict --model_dir {reward} --input_file {data} --text_column premise": "with --text_pair_column",
        f"predict --model_dir {single} --text a --handle_impossible_answer": "--handle_impossible_answer is for "
        f"question-answering models; the model in {single} was trained for --task classification: drop it",
        f"predict --model_dir {checkpoint} --text a": f"--model_dir {checkpoint} is a training checkpoint (weights, "
        "optimizer state and progress), not a saved model: give the run's --output_dir",
    }
    if not Path("/proc").is_dir():  # root may write anywhere else
        cases = {line: refusal for line, refusal in cases.items() if "/proc" not in line}
    monkeypatch.chdir(tmp_path)  # the fresh interpreter's working folder: the relative path
    said = answers(list(cases))
    for line, refusal in cases.items():
        assert_refused(said[line], refusal)
        assert said[line][3] == [], line  # nothing heavy imported: no model was loaded
    assert texts.read_text() == "the team won\na storm hit\n" and old.read_text() == "earlier predictions\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.txt", "preds.jsonl", "sub", "texts.txt"]
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_the_output_is_new_or_replaced_only_with_the_flag(runs, tmp_path, capsys):
    single = str(runs["single"])
    out = tmp_path / "new" / "preds.jsonl"  # a missing folder is made
    assert run_main(capsys, "--model_dir", single, "--text", "a storm", "--output_file", str(out))[:2] == (
        0,
        f"wrote 1 prediction to {out}\n",
    )
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["text"] for row in first] == ["a storm"] and set(first[0]) == {"text", "label", "score"}
    out.chmod(0o640)
    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    argv = ["--model_dir", single, "--text", "one", "--text", "two", "--output_file", str(link)]
    assert run_main(capsys, *argv)[0] == 2 and out.read_text().count("\n") == 1  # refused: the link's file exists
    assert run_main(capsys, *argv, "--overwrite_output_file", "true")[0] == 0
    assert link.is_symlink() and [json.loads(line)["text"] for line in out.read_text().splitlines()] == ["one", "two"]
    assert out.stat().st_mode & 0o777 == 0o640  # the replaced file's permissions kept
    assert sorted(p.name for p in out.parent.iterdir()) == ["preds.jsonl"]  # no staged file left


def test_the_output_file_is_written_in_the_format_its_name_says(runs, tmp_path, capsys):
    """`--output_file p.csv` held JSON lines; a list or mapping in a csv cell is JSON text (write_rows)."""
    import csv

    from cloudtrain.predict import write_rows

    single, texts = str(runs["single"]), ["a storm, then rain", 'oil "prices" fell']
    argv = ["--model_dir", single, "--text", texts[0], "--text", texts[1]]
    for name in ("p.csv", "p.tsv", "p.json", "p.jsonl"):
        assert run_main(capsys, *argv, "--output_file", str(tmp_path / name))[0] == 0
    lines = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert json.loads((tmp_path / "p.json").read_text()) == lines
    for name, delimiter in (("p.csv", ","), ("p.tsv", "\t")):
        with open(tmp_path / name, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f, delimiter=delimiter))
        assert [r["text"] for r in rows] == texts and [r["label"] for r in rows] == [r["label"] for r in lines]
        assert [float(r["score"]) for r in rows] == [r["score"] for r in lines]
    out = tmp_path / "multi.csv"
    with open(out, "w", newline="", encoding="utf-8") as f:
        write_rows(f, [{"text": "t", "labels": ["a", "b"], "scores": {"a": 0.9, "b": 0.7}}], ".csv")
    with open(out, newline="", encoding="utf-8") as f:
        (row,) = csv.DictReader(f)
    assert json.loads(row["labels"]) == ["a", "b"] and json.loads(row["scores"]) == {"a": 0.9, "b": 0.7}


@pytest.mark.slow  # the fast tier's slowest (5-6 s): the full suite runs it
def test_a_kill_between_writing_and_renaming_leaves_the_previous_file(runs, tmp_path):
    out = tmp_path / "preds.jsonl"
    out.write_text("earlier predictions\n")
    env = {**os.environ, "CLOUDTRAIN_TEST_KILL_AT": "predict.output_staged"}
    command = [sys.executable, str(ENTRY), "predict", "--model_dir", str(runs["single"]), "--text", "hi"]
    command += ["--output_file", str(out), "--overwrite_output_file", "true"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert out.read_text() == "earlier predictions\n"
    staged = [p for p in tmp_path.iterdir() if p != out]  # the complete new file, under a hidden name
    assert len(staged) == 1 and staged[0].name.startswith(".preds.jsonl.") and '"text": "hi"' in staged[0].read_text()


def test_a_pair_model_gets_both_texts_as_its_tokenizer_pairs_them(runs, tmp_path, capsys):
    nli, rows = runs["nli"], pair_rows()
    premises, hypotheses = [r["premise"] for r in rows], [r["hypothesis"] for r in rows]
    out = tmp_path / "preds.jsonl"
    # the pair column comes from the run's args.json; the batch size splits the rows into padded batches
    argv = ["--model_dir", str(nli), "--input_file", str(runs["data"]), "--text_column", "premise"]
    assert run_main(capsys, *argv, "--batch_size", "5", "--output_file", str(out))[0] == 0
    predicted = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(p["text"], p["text_pair"]) for p in predicted] == list(zip(premises, hypotheses, strict=True))
    # classification training passes what the tokenizer names: the pair's token types too
    probabilities = manual_forward(nli, premises, hypotheses, ("input_ids", "token_type_ids", "attention_mask"))
    probabilities = probabilities.softmax(-1)
    labels = AutoModelForSequenceClassification.from_pretrained(nli).config.id2label
    assert [p["label"] for p in predicted] == [labels[int(i)] for i in probabilities.argmax(-1)]
    assert [p["score"] for p in predicted] == pytest.approx(probabilities.max(-1).values.tolist(), abs=1e-4)
    assert [p["label"] for p in predicted] == [r["label"] for r in rows]  # it learned to read the second text
    # inline pairs answer the same
    inline = [arg for r in rows[:4] for arg in ("--text", r["premise"], "--text_pair", r["hypothesis"])]
    code, printed, _ = run_main(capsys, "--model_dir", str(nli), *inline)
    assert code == 0 and [json.loads(line) for line in printed.splitlines()] == predicted[:4]
    # what predict did before: the premise alone, the same answer for both rows of a premise, half of them wrong
    alone = predict(str(nli), premises)
    assert [a["label"] for a in alone[::2]] == [a["label"] for a in alone[1::2]]
    assert sum(a["label"] != p["label"] for a, p in zip(alone, predicted, strict=True)) == len(PREMISES)


def test_an_encoder_reward_model_scores_prompt_and_answer_as_a_pair(runs, capsys):
    reward = runs["reward"]
    argv = ["--model_dir", str(reward), "--text", PREMISES[0], "--text_pair", "yes that is right"]
    code, printed, _ = run_main(capsys, *argv, "--text", PREMISES[0], "--text_pair", "no")
    scores = [json.loads(line) for line in printed.splitlines()]
    assert code == 0 and [s["label"] for s in scores] == ["reward", "reward"]
    # the reward loss calls the model with input_ids and attention_mask alone (cloudtrain.tasks.reward.rewards)
    inputs = ("input_ids", "attention_mask")
    expected = manual_forward(reward, [PREMISES[0]] * 2, ["yes that is right", "no"], inputs)[:, 0]
    assert [s["score"] for s in scores] == pytest.approx(expected.tolist(), abs=1e-4)
    with_types = manual_forward(reward, [PREMISES[0]] * 2, ["yes that is right", "no"], (*inputs, "token_type_ids"))
    assert (with_types[:, 0] - expected).abs().max() > 1e-3  # which the scores' 4 decimals would show
    assert scores[0]["score"] > scores[1]["score"]  # it learned to prefer the chosen answer, read as a pair


LONG = "the bank raised interest rates again as shares fell on weak earnings and a storm closed the mountain roads"
TRAINED_NOTE = "{} of {} {} were truncated to the 8 tokens the model was trained with; --max_length N to change"


def with_max_length(run: Path, folder: Path, max_length: int | None) -> Path:
    """A copy of a run folder whose args.json records `max_length` (None: a folder without args.json)."""
    shutil.copytree(run, folder)
    recorded = json.loads((folder / "args.json").read_text())
    if max_length is None:
        (folder / "args.json").unlink()
    else:
        (folder / "args.json").write_text(json.dumps({**recorded, "max_length": max_length}))
    return folder


def scores(code_out_err: tuple[int, str, str]) -> list[float]:
    code, out, _ = code_out_err
    assert code == 0
    return [json.loads(line)["score"] for line in out.splitlines()]


def notes(err: str) -> list[str]:
    """The note lines of stderr (transformers' progress bars write there too)."""
    return [line[len("note: ") :] for line in err.splitlines() if line.startswith("note: ")]


def test_texts_are_truncated_at_the_length_the_model_was_trained_with(runs, tmp_path, capsys):
    short = with_max_length(runs["single"], tmp_path / "short", 8)
    assert len(AutoTokenizer.from_pretrained(short)(LONG)["input_ids"]) > 16  # cut at 8 and at 16 alike
    inputs = ("input_ids", "token_type_ids", "attention_mask")
    logits = {n: manual_forward(short, [LONG], [None], inputs, n).softmax(-1).max(-1).values for n in (8, 16, 512)}
    assert min(abs(float(logits[a] - logits[b])) for a, b in ((8, 16), (8, 512), (16, 512))) > 2e-4  # told apart
    code, out, err = run_main(capsys, "--model_dir", str(short), "--text", LONG, "--text", "a storm")
    assert scores((code, out, err))[0] == pytest.approx(float(logits[8]), abs=1e-4)
    assert notes(err) == [TRAINED_NOTE.format(1, 2, "texts")]  # the short text kept all its tokens
    # an explicit --max_length wins, without a note
    code, out, err = run_main(capsys, "--model_dir", str(short), "--text", LONG, "--max_length", "16")
    assert scores((code, out, err)) == pytest.approx([float(logits[16])], abs=1e-4) and notes(err) == []
    # a folder without args.json, or recording more than the model's positions: the model's context
    for folder in (with_max_length(short, tmp_path / "none", None), with_max_length(short, tmp_path / "far", 4096)):
        code, out, err = run_main(capsys, "--model_dir", str(folder), "--text", LONG)
        assert scores((code, out, err)) == pytest.approx([float(logits[512])], abs=1e-4) and notes(err) == []


def test_pairs_and_reward_models_are_truncated_at_their_trained_length(runs, tmp_path, capsys):
    # the second text is the long one: cut first, longest first, as training cut it
    pair = ["a storm hit the coast", LONG]
    nli = with_max_length(runs["nli"], tmp_path / "nli", 8)
    inputs = ("input_ids", "token_type_ids", "attention_mask")
    probabilities = {n: manual_forward(nli, pair[:1], pair[1:], inputs, n).softmax(-1).max() for n in (8, 512)}
    assert abs(float(probabilities[8] - probabilities[512])) > 2e-4  # which the scores' 4 decimals would show
    code, out, err = run_main(capsys, "--model_dir", str(nli), "--text", pair[0], "--text_pair", pair[1])
    assert scores((code, out, err)) == pytest.approx([float(probabilities[8])], abs=1e-4)
    assert notes(err) == [TRAINED_NOTE.format(1, 1, "text pairs")]
    reward = with_max_length(runs["reward"], tmp_path / "reward", 8)
    expected = {n: manual_forward(reward, pair[:1], pair[1:], ("input_ids", "attention_mask"), n) for n in (8, 512)}
    assert abs(float(expected[8] - expected[512])) > 1e-3  # which the scores' 4 decimals would show
    code, out, err = run_main(capsys, "--model_dir", str(reward), "--text", pair[0], "--text_pair", pair[1])
    assert scores((code, out, err)) == pytest.approx([float(expected[8][0, 0])], abs=1e-4)


def test_an_adapter_is_truncated_at_the_length_it_was_trained_with(runs, tmp_path, tiny_model_dir, capsys):
    from cloudtrain.predict import load, trained_length, truncation_length
    from cloudtrain.publish.saving import read_arguments

    out = tmp_path / "lora"
    cloudtrain.train(
        {**COMMON, "model_name_or_path": tiny_model_dir, "train_file": str(runs["data"]),
         "validation_file": str(runs["data"]), "max_length": 8, "peft": "lora", "lora_r": 4, "lora_dropout": 0.0},
        text_column="premise", output_dir=str(out), max_steps=1,
    )  # fmt: skip
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
    # the adapter's folder holds the args.json; the base model's config its positions
    model, _ = load(str(out))
    assert truncation_length(model.config, None, trained_length(read_arguments(out))) == 8
    assert truncation_length(model.config, None, None) == 512
    # a one-step head barely moves with the length, so the note (from the tokenizer's own cut) tells it was 8
    code, _, err = run_main(capsys, "--model_dir", str(out), "--text", LONG, "--text", "a storm")
    assert code == 0 and notes(err) == [TRAINED_NOTE.format(1, 2, "texts")]
    code, _, err = run_main(capsys, "--model_dir", str(out), "--text", LONG, "--max_length", "8")
    assert code == 0 and notes(err) == []


def test_a_left_padding_tokenizer_gives_the_same_predictions_at_any_batch_size(tiny_gpt2_dir, tmp_path):
    """GPT-2 learns absolute positions: a left-padded row was read at shifted positions, so a decoder classifier
    whose tokenizer pads on the left (every SFT output's did) predicted other labels at --batch_size 1 (audit).
    Training's collator and predict pad on the right whatever the tokenizer's side."""
    from transformers import GPT2ForSequenceClassification

    from cloudtrain.data.processing import RightPadded

    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, "left"
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification.from_pretrained(tiny_gpt2_dir, num_labels=3)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp_path / "cls")
    tokenizer(["a", "a b"], padding=True)  # saved as the SFT outputs were: the fast backend padding on the left
    tokenizer.save_pretrained(tmp_path / "cls")
    assert AutoTokenizer.from_pretrained(tmp_path / "cls").padding_side == "left"
    texts = ["once upon a time there was a king", "the wolf", "a golden key in the snow, and a box"]
    batched, alone = predict(str(tmp_path / "cls"), texts, batch_size=3), predict(str(tmp_path / "cls"), texts, 1)
    assert [r["score"] for r in batched] == pytest.approx([r["score"] for r in alone], abs=1e-5)
    batch = RightPadded(tokenizer)([{"input_ids": [5, 6, 7], "label": 1}, {"input_ids": [5], "label": 0}])
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]] and batch["labels"].tolist() == [1, 0]
    from cloudtrain.data.word_tags import RightPaddedTags  # a tagger's batches too (found in review)

    tags = RightPaddedTags(tokenizer, label_pad_token_id=-100)(
        [{"input_ids": [5, 6], "labels": [1, 2]}, {"input_ids": [5], "labels": [0]}]
    )
    assert tags["attention_mask"].tolist() == [[1, 1], [1, 0]] and tags["labels"].tolist() == [[1, 2], [0, -100]]
    assert tokenizer.padding_side == "left"  # the tokenizer's own side is left as it was


def test_a_saved_tokenizer_keeps_its_side_after_a_left_padded_generation(tiny_gpt2_dir, tmp_path):
    """Batched generation pads on the left; transformers then saved the backend's left padding into
    tokenizer.json and read it back as the tokenizer's side: every SFT output's tokenizer padded on the left."""
    from cloudtrain.generate import _batch_ids
    from cloudtrain.models.load import save_tokenizer_files

    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    tokenizer.pad_token = tokenizer.eos_token
    ids, _ = _batch_ids(tokenizer, ["the wolf", "once upon a time"], add_special_tokens=False)
    assert ids[0, 0] == tokenizer.pad_token_id  # left-padded for generation
    save_tokenizer_files(tokenizer, tmp_path / "tok")
    assert AutoTokenizer.from_pretrained(tmp_path / "tok").padding_side == "right"


def test_blank_lines_of_a_text_file_are_skipped_with_a_note(tmp_path, capsys):
    """Five lines, two blank: three rows came back without a word, and a join on line numbers misaligned."""
    from cloudtrain.predict import read_texts

    file = tmp_path / "in.txt"
    file.write_text("the team won\n\nbank profit\n   \nrain storm\n")
    assert read_texts(str(file), "text") == ["the team won", "bank profit", "rain storm"]
    assert "note: 2 blank line(s) of " in capsys.readouterr().err
    file.write_text("a\nb\n")
    assert read_texts(str(file), "text") == ["a", "b"] and capsys.readouterr().err == ""


def test_a_text_file_gives_one_text_per_line_whatever_else_it_holds(tmp_path, capsys):
    """str.splitlines() also split at form feeds (pdftotext's page breaks), U+2028 and U+0085: four lines gave seven
    rows, and a join on line numbers misaligned (found in audit). Windows' line ends are line ends."""
    import argparse

    from cloudtrain.generate import read_prompts
    from cloudtrain.predict import read_texts

    file = tmp_path / "ff.txt"
    file.write_bytes(b"first line\nsecond part A\x0csecond part B\nthird \xe2\x80\xa8 still third\nfourth\xc2\x85x\n")
    lines = ["first line", "second part A\fsecond part B", "third \u2028 still third", "fourth\x85x"]
    assert read_texts(str(file), "text") == lines
    args = argparse.Namespace(chat=False, prompt=[], input_file=str(file), text_column="text")
    assert read_prompts(args) == lines  # generate reads its prompts through the same function
    file.write_bytes(b"one\r\ntwo \r three\r\n\r\nfour")  # a lone carriage return is no line end either
    assert read_texts(str(file), "text") == ["one", "two \r three", "four"]
    assert capsys.readouterr().err.count("note: 1 blank line(s) of ") == 1


def test_more_than_one_batch_shows_a_bar_where_bars_show(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A large --input_file showed nothing on stderr for minutes (found in audit): a bar counts the batches, where
    the console shows bars (a terminal, CLOUDTRAIN_PROGRESS_BARS=1) and there is more than one; it is cleared."""
    from transformers import AutoModelForQuestionAnswering, AutoModelForTokenClassification

    from cloudtrain.observe import console

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for name, auto in (("cls", AutoModelForSequenceClassification), ("ner", AutoModelForTokenClassification)):
        auto.from_pretrained(tiny_model_dir, num_labels=2).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    AutoModelForQuestionAnswering.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "qa")
    tokenizer.save_pretrained(tmp_path / "qa")
    texts = ["the team won", "a storm hit", "rain", "snow fell", "the bank"]
    capsys.readouterr()
    for bars, shown in ((True, True), (False, False)):
        monkeypatch.setattr(console, "_bars", bars)
        for model, what, total, pairs in (
            ("cls", "predicting", "/3 [", None), ("ner", "tagging", "/3 [", None), ("qa", "answering", "/5 [", texts),
        ):  # fmt: skip
            rows = predict(str(tmp_path / model), texts, batch_size=2, pairs=pairs)
            err = capsys.readouterr().err  # (how far it drew before it was cleared depends on the clock)
            assert len(rows) == 5 and (f"{what}: " in err and total in err) == shown, err
            assert err.endswith("\r") or not shown  # cleared: the next line starts on a line of its own
            predict(str(tmp_path / model), texts[:1] if pairs else texts, batch_size=5, pairs=pairs and texts[:1])
            assert what not in capsys.readouterr().err  # one batch: no bar


def test_the_input_files_words_fit_the_command(tmp_path, capsys):
    """The unsupported-format line listed .txt twice, predict's --help left out .parquet (which it reads), and
    generate said a blank line skipped meant "one output row per text line" (found in audit)."""
    import argparse

    from cloudtrain.cli import command_parser
    from cloudtrain.generate import read_prompts
    from cloudtrain.predict import read_columns, read_texts

    with pytest.raises(UserError) as refused:
        read_columns(str(tmp_path / "in.xml"), ["text"])
    assert str(refused.value) == (
        f"--input_file {tmp_path / 'in.xml'}: unsupported format '.xml'; use .txt (one text per line) or one of "
        ".csv, .tsv, .json, .jsonl, .parquet"
    )
    for command in ("predict", "generate"):
        assert "csv/tsv/json/jsonl/parquet" in " ".join(command_parser(command).format_help().split())
    file = tmp_path / "prompts.txt"
    file.write_text("once\n\nthe king\n")
    args = argparse.Namespace(chat=False, prompt=[], input_file=str(file), text_column="text")
    assert read_prompts(args) == ["once", "the king"]
    assert capsys.readouterr().err == f"note: 1 blank line(s) of {file} skipped: one text is generated per other line\n"
    assert read_texts(str(file), "text") == ["once", "the king"]
    assert capsys.readouterr().err == f"note: 1 blank line(s) of {file} skipped: one output row per text line\n"


def test_an_input_file_without_rows_is_called_the_input(tmp_path):
    """A csv of a header alone was "the train data in in.csv is empty" (left alone in an audit), and a JSON
    array of nothing was asked for a header."""
    from cloudtrain.predict import read_columns

    for name, content, holds in (("in.csv", "text\n", "a header and rows"), ("in.json", "[]\n", "records")):
        (tmp_path / name).write_text(content)
        with pytest.raises(UserError) as refused:
            read_columns(str(tmp_path / name), ["text"])
        assert str(refused.value) == f"the input data in {tmp_path / name} is empty; give a file with {holds}"


def test_empty_prompts_of_an_input_file_are_skipped_with_a_note(tmp_path, capsys):
    """An empty cell of a jsonl or csv file was skipped without a word (a .txt file's blank lines were said)."""
    import argparse

    from cloudtrain.generate import read_prompts

    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "once"}\n{"prompt": ""}\n{"prompt": "  "}\n{"prompt": "the king"}\n')
    args = argparse.Namespace(chat=False, prompt=["hi"], input_file=str(file), text_column="prompt")
    assert read_prompts(args) == ["hi", "once", "the king"]
    assert capsys.readouterr().err.count(f"note: 2 empty prompt(s) of {file} skipped\n") == 1
    file.write_text('{"prompt": "once"}\n')
    assert read_prompts(args) == ["hi", "once"] and "note:" not in capsys.readouterr().err


def test_a_model_folder_without_its_tokenizer_is_refused_in_one_line(runs, tmp_path, capsys):
    """transformers builds an empty 5-token tokenizer from a BERT's config: every word was [UNK] and predict gave
    wrong labels, generate an empty answer, both exiting 0 (found in audit)."""
    import shutil

    from cloudtrain.cli import main

    copy = tmp_path / "weights-only"
    copy.mkdir()
    for name in ("config.json", "model.safetensors", "args.json"):
        if (Path(runs["single"]) / name).is_file():
            shutil.copy(Path(runs["single"]) / name, copy / name)
    assert main(["predict", "--model_dir", str(copy), "--text", "the team won"]) != 0
    err = capsys.readouterr().err
    assert f"error: {copy} holds no tokenizer (tokenizer.json, tokenizer_config.json or vocabulary files)" in err
    assert "Traceback" not in err


def test_a_damaged_or_missing_labels_json_is_named_in_one_line(tmp_path, tiny_model_dir, capsys):
    """A hand-edited labels.json of another shape ({"x": 1}) was a KeyError traceback in predict; a missing one ended
    in "Error(s) in loading state_dict" (the adapter's head has 3 labels, the base's config 2) (found in audit)."""
    from peft import LoraConfig, get_peft_model

    from cloudtrain.models import adapters
    from cloudtrain.models.adapters import load_adapter_model

    torch.manual_seed(0)
    names = {0: "finance", 1: "sports", 2: "weather"}
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3, id2label=names)
    config = LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query", "value"])
    adapter = tmp_path / "adapter"
    adapters.save(get_peft_model(base, config), adapter)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(adapter)
    intact = (adapter / "labels.json").read_text()
    assert load_adapter_model(adapter)[0].config.id2label == names
    labels = adapter / "labels.json"
    shape = '{"id2label": {"0": "first label", "1": "second label", ...}, "problem_type": ...}'
    for content, wrong in (
        ({"x": 1}, "no id2label"),
        ({"id2label": {"1": "a", "2": "b"}}, "id2label's keys are not the label ids 0 to 1"),
        ({"id2label": {"0": "a", "1": 2}}, "an id2label name that is not text"),
        ({"id2label": {"0": "a"}, "problem_type": "ranking"}, "problem_type 'ranking', not one of "),
    ):
        labels.write_text(json.dumps(content))
        with pytest.raises(UserError) as refused:
            load_adapter_model(adapter)
        assert str(refused.value).startswith(f"{labels} holds {wrong}"), str(refused.value)
        assert str(refused.value).endswith(f"should read {shape}; restore the labels.json the training run wrote")
    labels.write_text('{"x": 1}')
    assert main(["predict", "--model_dir", str(adapter), "--text", "hi"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"error: {labels} holds no id2label")
    labels.unlink()
    missing = (
        f"{labels} is missing: the adapter's classifier has its labels there (names and count); restore the "
        "labels.json the training run wrote beside adapter_config.json"
    )
    with pytest.raises(UserError) as refused:  # the base's 2 labels against the adapter's 3
        load_adapter_model(adapter)
    assert str(refused.value) == missing
    (adapter / "labels.json").write_text(intact.replace('"sports"', '"sport"'))
    (adapter / "args.json").write_text('{"task": "classification"}')
    assert load_adapter_model(adapter)[0].config.id2label[1] == "sport"
    labels.unlink()  # a run wrote both: the base's names would be the wrong ones even where the counts agree
    with pytest.raises(UserError) as refused:
        load_adapter_model(adapter)
    assert str(refused.value) == missing
