"""Bad input a user can give: each is refused in one exact line (exit 2, no traceback), nothing is written to the
output, and a checkpoint's own code never runs unless asked for, even with a `y` waiting on standard input.

Real tiny models and real files throughout. The one-line property is checked through the real entry script in a
subprocess for the cases that raised library tracebacks before (a checkpoint's code, a truncated safetensors
file); the other cases call `cloudtrain.cli.main` in this process, which prints the same line.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENTRY, REPO, run_cli

from cloudtrain.cli import main

CUSTOM_CODE = """from pathlib import Path

Path({marker!r}).write_text("the checkpoint's code ran")
from transformers import BertConfig, BertForSequenceClassification


class TinyConfig(BertConfig):
    model_type = "tinycustom"


class TinyForSequenceClassification(BertForSequenceClassification):
    config_class = TinyConfig
"""


def _copy(source: str | Path, folder: Path, skip: tuple[str, ...] = ()) -> Path:
    folder.mkdir(parents=True)
    for file in Path(source).iterdir():
        if file.name not in skip:
            shutil.copy(file, folder / file.name)
    return folder


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """A tiny 3-label classifier, and copies of it damaged one way each (one with a decoder's config: generate
    reads no weights before it has checked them)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel, GPT2Config

    root = tmp_path_factory.mktemp("bad-models")
    torch.manual_seed(0)
    config = BertConfig.from_pretrained(tiny_model_dir, num_labels=3)
    classifier = root / "classifier"
    BertForSequenceClassification(config).save_pretrained(classifier)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(classifier)
    found = {"classifier": classifier}

    found["truncated"] = _copy(classifier, root / "truncated")
    _truncate(found["truncated"] / "model.safetensors")
    found["truncated_lm"] = _copy(found["truncated"], root / "truncated-lm")
    GPT2Config(n_layer=1, n_embd=8, n_head=1).save_pretrained(found["truncated_lm"])
    found["no_weights"] = _copy(classifier, root / "no-weights", skip=("model.safetensors",))
    found["bad_tokenizer"] = _copy(classifier, root / "bad-tokenizer")
    (found["bad_tokenizer"] / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    found["small_vocab"] = _copy(classifier, root / "small-vocab", skip=("model.safetensors",))
    BertModel(BertConfig.from_pretrained(tiny_model_dir, vocab_size=1000)).save_pretrained(found["small_vocab"])

    found["custom"] = custom = _copy(classifier, root / "custom")
    marker = root / "custom-code-ran"
    (custom / "custom_code.py").write_text(CUSTOM_CODE.format(marker=str(marker)))
    spec = json.loads((custom / "config.json").read_text())
    spec.update(
        model_type="tinycustom",
        architectures=["TinyForSequenceClassification"],
        auto_map={
            "AutoConfig": "custom_code.TinyConfig",
            "AutoModelForSequenceClassification": "custom_code.TinyForSequenceClassification",
        },
    )
    (custom / "config.json").write_text(json.dumps(spec))
    found["marker"] = marker
    return found


def refused(argv: list[str], capsys) -> str:
    """The one line `cloudtrain` prints for `argv` (exit status 2, nothing else on stderr but progress bars)."""
    assert main(argv) == 2, argv
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, lines
    return lines[0].removeprefix("error: ")


def train_args(model: Path | str, train_file: Path | str, out: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(model), "--train_file", str(train_file), "--output_dir", str(out),
            "--report_to", "none", "--max_steps", "1", *extra]  # fmt: skip


def run_entry(*args: str) -> subprocess.Popen:
    """The real entry script in a fresh interpreter, started now; its standard input is a pipe."""
    return subprocess.Popen(
        [sys.executable, str(ENTRY), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.slow  # a fresh interpreter per case: the full suite runs it
def test_one_line_and_no_question_through_the_real_entry_script(models, topic_csvs, tmp_path):
    """A `y` on standard input answers nothing: transformers is never left to ask. Both run at once (each
    interpreter starts in seconds)."""
    custom, truncated, out = models["custom"], models["truncated"], tmp_path / "out"
    runs = {
        "predict": run_entry("predict", "--model_dir", str(custom), "--text", "hi"),
        "train": run_entry(*train_args(truncated, topic_csvs["train"], out)),
    }
    expected = {
        "predict": f"error: {custom} needs its own Python code (custom_code.py) to load, which cloudtrain runs "
        "only with --trust_remote_code true: read that code first",
        "train": f"error: {truncated / 'model.safetensors'} is damaged (Error while deserializing header: "
        "incomplete metadata, file not fully covered); save or download the model again",
    }
    for name, process in runs.items():
        stdout, stderr = process.communicate("y\ny\n", timeout=120)  # a `y` for any question asked
        assert process.returncode == 2, (name, stderr)
        assert "Traceback" not in stderr and "[y/N]" not in stdout + stderr, (name, stderr)
        assert stderr.strip().splitlines()[-1] == expected[name], (name, stderr)
        assert sum(line.startswith("error: ") for line in stderr.splitlines()) == 1
    assert not models["marker"].exists() and not out.exists()


def test_no_command_runs_a_checkpoints_code_unless_asked(models, topic_csvs, tmp_path, capsys, monkeypatch):
    """train, predict, generate and plan refuse the checkpoint before its code runs, with `y` on stdin; with
    --trust_remote_code true predict runs it (the one way to ask)."""
    import io

    custom, out = models["custom"], tmp_path / "out"
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 8))  # what transformers' question would read
    refusal = (
        f"{custom} needs its own Python code (custom_code.py) to load, which cloudtrain runs only with "
        "--trust_remote_code true: read that code first"
    )
    for argv in (
        train_args(custom, topic_csvs["train"], out),
        ["predict", "--model_dir", str(custom), "--text", "hi", "--output_file", str(out / "p.jsonl")],
        ["generate", "--model_dir", str(custom), "--prompt", "hi"],
        ["plan", "--model_name_or_path", str(custom), "--num_gpus", "1", "--gpu_memory_gb", "24"],
    ):
        assert refused(argv, capsys) == refusal, argv
        assert not models["marker"].exists() and not out.exists(), argv
    assert main(["predict", "--model_dir", str(custom), "--text", "hi", "--trust_remote_code", "true"]) == 0
    assert models["marker"].read_text() == "the checkpoint's code ran"
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["text"] == "hi"
    models["marker"].unlink()


def test_damaged_or_missing_model_files(models, topic_csvs, tmp_path, capsys):
    out, train = tmp_path / "out", topic_csvs["train"]
    damaged = "is damaged (Error while deserializing header: incomplete metadata, file not fully covered); save or "
    cases = {
        "no weights": (
            train_args(models["no_weights"], train, out),
            f"--model_name_or_path {models['no_weights']} holds no weights (no model.safetensors or "
            "pytorch_model.bin), so the model would start from random weights; give a folder saved with its weights",
        ),
        "truncated, predict": (
            ["predict", "--model_dir", str(models["truncated"]), "--text", "hi"],
            f"{models['truncated'] / 'model.safetensors'} {damaged}download the model again",
        ),
        "truncated, generate": (
            ["generate", "--model_dir", str(models["truncated_lm"]), "--prompt", "hi"],
            f"{models['truncated_lm'] / 'model.safetensors'} {damaged}download the model again",
        ),
        "bad tokenizer, train": (
            train_args(models["bad_tokenizer"], train, out),
            f"could not load the tokenizer in {models['bad_tokenizer']}: {models['bad_tokenizer'] / 'tokenizer.json'} "
            "is not valid JSON; save or download it again",
        ),
        "bad tokenizer, predict": (
            ["predict", "--model_dir", str(models["bad_tokenizer"]), "--text", "hi"],
            f"could not load the tokenizer in {models['bad_tokenizer']}: {models['bad_tokenizer'] / 'tokenizer.json'} "
            "is not valid JSON; save or download it again",
        ),
    }
    for case, (argv, message) in cases.items():
        assert refused(argv, capsys) == message, case
        assert not out.exists(), case


def test_model_and_options_that_do_not_fit_together(models, topic_csvs, tmp_path, capsys):
    """Refused before any data is read: the same checks the causal-LM task makes."""
    out, train, classifier = tmp_path / "out", topic_csvs["train"], models["classifier"]
    cases = {
        "vocabulary smaller than the tokenizer's": (
            train_args(models["small_vocab"], train, out),
            "the tokenizer has 30522 tokens but the model's vocabulary has 1000; use the model's own tokenizer "
            "(only a chat template's new tokens grow the embeddings)",
        ),
        "max_length beyond the positions": (
            train_args(classifier, train, out, "--max_length", "600"),
            "--max_length 600 is longer than the model's context (512 positions); pass --max_length 512 or less",
        ),
        "predict's max_length beyond the positions": (
            ["predict", "--model_dir", str(classifier), "--text", "hi", "--max_length", "513"],
            "--max_length 513 is longer than the model's context (512 positions); pass --max_length 512 or less",
        ),
        "predict's batch size": (
            ["predict", "--model_dir", str(classifier), "--text", "hi", "--batch_size", "0"],
            "--batch_size must be at least 1, got 0",
        ),
        "a classifier from a config": (
            ["--train_file", str(train), "--output_dir", str(out), "--model_config", "llama-8m"]
            + ["--tokenizer_name_or_path", str(classifier)],
            "--model_config builds a decoder from scratch (--task causal_lm, sft or dpo); --task classification "
            "starts from a pretrained model: pass --model_name_or_path",
        ),
        "a nan learning rate": (
            train_args(classifier, train, out, "--learning_rate", "nan"),
            "--learning_rate: expected a finite number, got 'nan'",
        ),
    }
    for case, (argv, message) in cases.items():
        assert refused(argv, capsys) == message, case
        assert not out.exists(), case


def test_data_files_that_train_on_nothing_or_cannot_be_read(models, tmp_path, capsys):
    out, classifier = tmp_path / "out", models["classifier"]
    files = {
        "empty.csv": b"",
        "empty.txt": b"",  # a text file has no header (found in audit)
        "latin1.csv": "text,label\ncaf\xe9 au lait,drink\nna\xefve,word\n".encode("latin-1"),
        "latin1.txt": "caf\xe9\n".encode("latin-1"),
        # the JSON reader loads bytes unchecked: the first use of the text was a traceback (found in audit)
        "latin1.jsonl": b"".join(json.dumps({"text": f"t {i}", "label": "a"}).encode() + b"\n" for i in range(4))
                        + '{"text": "caf\xe9", "label": "b"}\n'.encode("latin-1"),
        "blank.csv": b"text,label\n" + b",a\n ,b\n" * 5,
        "fractions.csv": b"text,label\n" + b"".join(f"text {i},{i * 0.25}\n".encode() for i in range(8)),
        "multi.jsonl": b"".join(json.dumps({"text": f"t {i}", "label": ["a", "b"][: 1 + i % 2]}).encode() + b"\n"
                                for i in range(6)),
        "broken.jsonl": b'{"text": "a", "label": "x"}\n\n{"text": "b", "label": "y"}\n{"text": "c" "label": "y"}\n',
        "broken.json": b'[{"text": "a", "label": "x"},\n {"text": "b" "label": "y"}]\n',
        "lines.json": b'{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n{"text": "c", "label" "y"}\n',
    }  # fmt: skip
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    cases = {
        "empty.csv": f"--train_file {tmp_path / 'empty.csv'} is empty; give a file with a header and rows",
        "empty.txt": f"--train_file {tmp_path / 'empty.txt'} is empty; give a file with a text per line",
        "latin1.csv": f"{tmp_path / 'latin1.csv'} is not UTF-8 text (Latin-1 or another encoding?); save it as "
        "UTF-8 and try again",
        "latin1.jsonl": f"{tmp_path / 'latin1.jsonl'} is not UTF-8 text (Latin-1 or another encoding?); save it as "
        "UTF-8 and try again",
        "blank.csv": "the training data has no text in column 'text' (every row is empty); give data with text, "
        "or pass --text_column <name>",
        "fractions.csv": "the 'label' column holds fractional numbers (0.25, 0.5, 0.75, ...): --task regression "
        "learns numbers; classification needs class names or whole-number class ids",
        "multi.jsonl": "the 'label' column holds lists or records, not one label per row: --task multi_label trains "
        "any number of labels per text; for --task classification give each row one class name or id",
        # the line an editor shows (arrow said "in row 2", counting records from 0)
        "broken.jsonl": f"{tmp_path / 'broken.jsonl'} line 4, column 14: not valid JSON (Expecting ',' delimiter); "
        "fix that line and try again",
        "broken.json": f"{tmp_path / 'broken.json'} line 2, column 15: not valid JSON (Expecting ',' delimiter); fix "
        "that line and try again",
        # JSON lines in a .json file, as the reader takes them
        "lines.json": f"{tmp_path / 'lines.json'} line 3, column 23: not valid JSON (Expecting ':' delimiter); fix "
        "that line and try again",
    }
    for name, message in cases.items():
        assert refused(train_args(classifier, tmp_path / name, out), capsys) == message, name
        assert not out.exists(), name
    folder = tmp_path / "folder"  # a held-out file inside the training folder was trained on too (audit)
    folder.mkdir()
    (folder / "train.csv").write_bytes(b"text,label\na,x\nb,y\n")
    (folder / "valid.csv").write_bytes(b"text,label\nc,x\n")
    argv = [*train_args(classifier, folder, out), "--validation_file", str(folder / "valid.csv")]
    assert refused(argv, capsys) == (
        f"--validation_file {folder / 'valid.csv'} is also in the --train_file folder {folder}, so it would be "
        "trained on: move it out of that folder"
    )
    predict = ["predict", "--model_dir", str(classifier), "--output_file", str(out / "p.jsonl"), "--input_file"]
    assert refused([*predict, str(tmp_path / "latin1.csv")], capsys) == cases["latin1.csv"]
    assert refused([*predict, str(tmp_path / "latin1.txt")], capsys) == (
        f"--input_file {tmp_path / 'latin1.txt'} is not UTF-8 text; save it as UTF-8 and try again"
    )
    assert not out.exists()


def test_a_yaml_value_of_the_wrong_type_is_one_line(models, topic_csvs, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  learning_rate: [1.0e-4, 2.0e-4]\n")
    argv = ["--config", str(config), *train_args(models["classifier"], topic_csvs["train"], tmp_path / "out")]
    assert refused(argv, capsys) == (
        f"--learning_rate: expected one number, got a list [0.0001, 0.0002] (--learning_rate is set in {config})"
    )
    assert not (tmp_path / "out").exists()


def test_an_empty_data_model_or_output_option_is_refused_not_taken_for_its_default(tmp_path, capsys):
    """`--train_file "$DATA"` with DATA unset trained on the built-in R8 without a word; an empty --output_dir
    wrote to the default folder, an empty --model_name_or_path loaded the default model (found in audit)."""
    for name in ("train_file", "output_dir", "model_name_or_path", "dataset_name"):
        assert refused([f"--{name}", " ", "--max_steps", "1"], capsys) == (
            f"--{name} is empty (an unset shell variable?); give its value, or leave it out for the default"
        )
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  train_file: ''\n")
    assert refused(["--config", str(config)], capsys).startswith("--train_file is empty")


def test_tokenizers_that_differ_only_in_their_inputs_do_not_share_a_cache(models, topic_csvs, tmp_path):
    """A tokenizer whose own class needs its code loads under a generic class (no token_type_ids) with the same
    tokenizer.json: its tokenized data must not be read back from the cache of the full class (datasets then
    failed on a keys mismatch), and holds only the inputs it names."""
    from transformers import AutoTokenizer

    from cloudtrain.config import DataConfig
    from cloudtrain.data.processing import process_data
    from cloudtrain.data.sources import connect_data

    cfg = DataConfig(train_file=str(topic_csvs["train"]), cache_dir=str(tmp_path / "cache"))
    raw = connect_data(cfg)
    full = AutoTokenizer.from_pretrained(models["classifier"])
    generic = AutoTokenizer.from_pretrained(models["classifier"], model_input_names=["input_ids", "attention_mask"])
    assert "token_type_ids" in process_data(raw, full, cfg, seed=0).train.column_names
    assert process_data(raw, generic, cfg, seed=0).train.column_names == ["input_ids", "attention_mask", "labels"]


@pytest.mark.slow  # fresh processes: the full suite runs it
def test_a_file_datasets_cannot_read_is_said_once(models, tmp_path):
    """datasets logged its own "Failed to read file ... UnicodeDecodeError" line before ours (found in audit)."""
    latin = tmp_path / "latin1.csv"
    latin.write_bytes("text,label\ncaf\xe9 au lait,drink\nna\xefve,word\n".encode("latin-1"))
    result = run_cli(*train_args(models["classifier"], latin, tmp_path / "out"))
    said = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(said) == 1 and said[0].startswith("error: "), said


def test_an_mlflow_server_that_cannot_be_reached_is_refused_before_the_model_loads(
    models, topic_csvs, tmp_path, capsys, monkeypatch
):
    """The tracker's own check came after the data and the model had loaded (20 s here, minutes for a large model)
    and left metrics.jsonl and mlruns/ in the output folder (found in audit)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as closed:  # a port nothing listens on once the block ends
        port = closed.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    out = tmp_path / "out"
    argv = train_args(models["classifier"], topic_csvs["train"], out, "--report_to", "mlflow")
    assert refused(argv, capsys) == (
        f"MLflow at http://127.0.0.1:{port} (MLFLOW_TRACKING_URI) cannot be reached within 5 s: start its server, "
        "or change the URI"
    )
    assert not out.exists()  # refused before anything was read or written
