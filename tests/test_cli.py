"""The command line as a user meets it: bad input gets one clear line, exit 2, and nothing is touched."""

import contextlib
import hashlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import ENTRY, REPO, run_cli

import cloudtrain
from cloudtrain.cli import main
from cloudtrain.errors import UserError
from cloudtrain.publish.output_dir import record
from cloudtrain.registry_table import TASK_ROWS


def snapshot(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


@pytest.fixture
def existing_output(tmp_path) -> Path:
    """An output dir holding a model an earlier run saved, which no failed run may touch."""
    out = users_model(tmp_path)
    record(out, ["config.json", "model.safetensors"])
    return out


def users_model(tmp_path) -> Path:
    """A user's own model folder: no cloudtrain manifest."""
    out = tmp_path / "earlier-run"
    out.mkdir()
    (out / "config.json").write_text('{"earlier": true}')
    (out / "model.safetensors").write_bytes(b"weights of an earlier run")
    return out


def bad_inputs(tmp_path, topic_csvs, tiny_model_dir) -> dict[str, tuple[list[str], str]]:
    unseen = tmp_path / "unseen.csv"
    pd.DataFrame([{"text": "a recipe", "label": "cooking"}]).to_csv(unseen, index=False)
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n")
    train = ["--model_name_or_path", tiny_model_dir, "--train_file", str(topic_csvs["train"])]
    return {
        "missing data file": (["--train_file", str(tmp_path / "nope.csv")], "--train_file .*nope.csv does not exist"),
        "missing text column": (train + ["--text_column", "body"], "column 'body' is not in the train data"),
        "missing label column": (train + ["--label_column", "topic"], "column 'topic' is not in the train data"),
        "unseen validation labels": (
            train + ["--validation_file", str(unseen)],
            "validation data has labels the training data never saw: cooking",
        ),
        "empty dataset": (["--model_name_or_path", tiny_model_dir, "--train_file", str(empty)], "is empty"),
        "unknown training type": (["--training_type", "turbo"], "'turbo' is not one of basic, accelerated"),
        "model path missing": (["--model_name_or_path", str(tmp_path / "no-model")], "does not exist"),
        "contradictory data sources": (
            ["--dataset_name", "ag_news", "--train_file", str(topic_csvs["train"])],
            "give one of them",
        ),
        "fp16 without a GPU": (["--mixed_precision", "fp16"], "fp16 needs a CUDA GPU"),
        "config file missing": (["--config", str(tmp_path / "nope.yaml")], "config file .* does not exist"),
    }


CASES = [
    "missing data file",
    "missing text column",
    "missing label column",
    "unseen validation labels",
    "empty dataset",
    "unknown training type",
    "model path missing",
    "contradictory data sources",
    "fp16 without a GPU",
    "config file missing",
]


NO_GPU_ONLY = {"fp16 without a GPU"}  # refused only where torch sees no CUDA device


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            case,
            marks=pytest.mark.skipif(
                case in NO_GPU_ONLY and torch.cuda.is_available(),
                reason="fp16 is refused only on a machine without a CUDA GPU",
            ),
        )
        for case in CASES
    ],
)
def test_bad_input_is_one_line_and_touches_nothing(case, tmp_path, topic_csvs, tiny_model_dir, existing_output, capsys):
    argv, message = bad_inputs(tmp_path, topic_csvs, tiny_model_dir)[case]
    before = snapshot(existing_output)
    code = main(argv + ["--output_dir", str(existing_output), "--overwrite_output_dir", "true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: ")
    assert pytest.importorskip("re").search(message, err[-1]), err[-1]
    assert snapshot(existing_output) == before


def test_an_earlier_model_is_never_overwritten_by_default(existing_output, capsys):
    before = snapshot(existing_output)
    assert main(["--output_dir", str(existing_output)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --output_dir {existing_output} already holds a model from an earlier run (kept); "
        f"choose a new folder, e.g. --output_dir {existing_output}-2, or pass --overwrite_output_dir true to replace it"
    )
    assert snapshot(existing_output) == before


def test_a_model_cloudtrain_did_not_write_is_never_replaced_even_with_overwrite(tmp_path, capsys):
    out = users_model(tmp_path)
    before = snapshot(out)
    for overwrite in ("false", "true"):
        assert main(["--output_dir", str(out), "--overwrite_output_dir", overwrite]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: --output_dir {out} holds config.json, model.safetensors, which cloudtrain did not "
            f"write and a run would replace; move them elsewhere, or choose a new folder, e.g. --output_dir {out}-2"
        )
    assert snapshot(out) == before


def test_process_exit_code_and_no_traceback(tmp_path):
    result = run_cli("--train_file", str(tmp_path / "missing.csv"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: --train_file {tmp_path / 'missing.csv'} does not exist"]


def test_help_and_predict_help():
    result = run_cli("--help")
    assert result.returncode == 0 and "--per_device_train_batch_size" in result.stdout and "predict" in result.stdout
    described = " ".join(result.stdout.split())  # every task is named (6 of 11 were; found in audit)
    assert all(f"{name}, " in described for name in TASK_ROWS), described[:2000]
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"cloudtrain {cloudtrain.__version__}"
    result = run_cli("predict", "--help")
    assert result.returncode == 0 and "--model_dir" in result.stdout


def test_sagemaker_folder_never_shadows_the_sdk():
    assert not (REPO / "sagemaker" / "__init__.py").exists()
    entry_dir = REPO / "src"  # the entry script's folder is what Python puts first on sys.path
    assert not (entry_dir / "sagemaker").exists() and not (entry_dir / "sagemaker.py").exists()


def test_options_this_run_leaves_unused_are_noted_once_before_its_work(
    tmp_path, topic_csvs, tiny_model_dir, capsys, monkeypatch
):
    """`--lora_r` without `--peft` (every weight trains) and sft's options on a classifier: one note each, printed
    before the run reads any data (here it then stops at a missing column), and by the first process only."""
    argv = ["--model_name_or_path", tiny_model_dir, "--train_file", str(topic_csvs["train"]), "--text_column", "body"]
    argv += ["--lora_r", "4", "--chat_template", "chatml", "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if line.startswith("note: ")] == [
        "note: --chat_template chatml has no effect on --task classification; it counts for --task sft, dpo or reward",
        "note: --lora_r 4 has no effect without --peft lora, dora or qlora",
    ]
    assert out.startswith("note: ") and "column 'body' is not in the train data" in err.strip().splitlines()[-1]
    assert main([*argv, "--peft", "lora"]) == 2  # adapters: --lora_r counts
    assert "--lora_r" not in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")  # another process of a launch: rank 0 says it
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "note: " not in out and "column 'body' is not in the train data" in err.strip().splitlines()[-1]


def test_generate_notes_sampling_options_under_greedy_decoding(tmp_path, capsys):
    """--temperature, --top_k and --top_p shape sampling only: without --do_sample true each is one note, before
    the model loads (here: a folder with none)."""
    argv = ["generate", "--model_dir", str(tmp_path), "--prompt", "hi", "--temperature", "0.5", "--top_k", "5"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "note: --temperature 0.5 has no effect without --do_sample true",
        "note: --top_k 5 has no effect without --do_sample true",
        f"error: --model_dir {tmp_path} holds no config.json; pass a directory written by the training application",
    ]
    assert main([*argv, "--do_sample", "true"]) == 2
    assert "note:" not in capsys.readouterr().err


def test_plan_tells_a_decoder_preset_to_add_the_task(capsys):
    assert main(["plan", "--model_config", "llama-600m", "--gpu", "h100"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --model_config is for --task causal_lm, sft or dpo, not classification: add --task causal_lm "
        "(or sft or dpo)"
    )


@pytest.mark.slow  # two fresh interpreters that import torch: the full suite runs it
def test_output_into_a_pipe_its_reader_closed_ends_quietly_as_sigpipe_would(tmp_path, tiny_model_dir, tiny_llama_dir):
    """`cloudtrain predict ... | head -c 10` and `generate ... | head -n 1` ended in a BrokenPipeError traceback and
    exit 1 (found in audit): now nothing on stderr and status 141, as a tool that dies of SIGPIPE."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    classifier = tmp_path / "cls"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2).save_pretrained(classifier)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(classifier)
    for argv in (
        ["predict", "--model_dir", str(classifier), "--text", "the team won", "--text", "rain"],
        ["generate", "--model_dir", tiny_llama_dir, "--prompt", "a", "--prompt", "b", "--max_new_tokens", "3"],
    ):
        read, write = os.pipe()
        os.close(read)  # the reader has gone before anything is written: every write to stdout fails
        try:
            result = subprocess.run(
                [sys.executable, str(ENTRY), *argv], stdout=write, stderr=subprocess.PIPE, text=True, cwd=REPO
            )
        finally:
            os.close(write)
        assert (result.returncode, result.stderr) == (141, ""), result.stderr


def test_a_broken_pipe_other_than_the_output_is_not_hidden(monkeypatch, capsys):
    """Only a reader that stopped reading stdout ends a command quietly: another pipe's failure keeps its traceback."""
    import cloudtrain.cli

    def broken(name, argv):
        raise BrokenPipeError("a tracker's pipe")

    monkeypatch.setattr(cloudtrain.cli, "command_main", broken)
    with pytest.raises(BrokenPipeError, match="a tracker's pipe"):
        main(["predict", "--model_dir", "x", "--text", "hi"])


def test_a_file_given_as_the_run_folder_is_called_a_file(tmp_path, capsys):
    """predict, generate and merge said a file given as the run's folder "does not exist" (found in audit)."""
    file = tmp_path / "preds.jsonl"
    file.write_text("{}\n")
    for argv, flag in (
        (["predict", "--model_dir", str(file), "--text", "hi"], "--model_dir"),
        (["generate", "--model_dir", str(file), "--prompt", "hi"], "--model_dir"),
        (["merge", "--output_dir", str(file)], "--output_dir"),
        (["merge", "--model_dir", str(file)], "--model_dir"),
    ):
        assert main(argv) == 2
        said = capsys.readouterr().err.strip()
        assert said == f"error: {flag} {file} is a file; give the folder a training run wrote"
    assert main(["predict", "--model_dir", str(tmp_path / "gone"), "--text", "hi"]) == 2
    assert capsys.readouterr().err.strip().endswith("gone does not exist; pass the output_dir of a training run")


@pytest.mark.parametrize(
    "command, required",
    [("predict", "--model_dir"), ("generate", "--model_dir"), ("push", "--output_dir"), ("merge", "--output_dir")],
)
def test_help_shows_a_commands_required_option_as_required(command, required):
    """The usage line bracketed --model_dir as optional ([--model_dir MODEL_DIR]; found in audit): the parser holds
    required options optional while it looks for a mistyped one first, and --help was asked in between."""
    from cloudtrain.cli import command_parser

    parser = command_parser(command)
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as shown:
        parser.parse_args(["--help"])
    usage = " ".join(shown.getvalue().split())
    metavar = required.removeprefix("--").upper()
    assert f" {required} {metavar} " in usage and f"[{required} {metavar}]" not in usage
    with pytest.raises(UserError, match=f"the following arguments are required: {required}"):
        parser.parse_args([])  # still required after --help


def test_the_help_of_generate_prompt_and_push_token_file_says_what_the_code_does():
    """--prompt said an empty prompt starts from the BOS token (a chat model's is an empty user message); push's
    --hub_token_file left out the token file args.json records, used before the login (found in audit)."""
    prompt = " ".join(run_cli("generate", "--help").stdout.split())
    assert "an empty prompt starts from the BOS token, or for a chat model is an empty user message" in prompt
    token = " ".join(run_cli("push", "--help").stdout.split())
    order = "HF_TOKEN, else the training run's token file recorded in args.json if it is still there, else the login"
    assert f"(default: {order})" in token
