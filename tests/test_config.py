"""The typed config: precedence, file formats, explicit booleans, help, and early validation."""

import argparse
import json

import pytest

from cloudtrain.config import Config, _fields, _Parser, add_config_arguments, build_config, config_from_namespace
from cloudtrain.errors import UserError


def parse(*argv: str) -> Config:
    parser = _Parser(prog="t")
    add_config_arguments(parser)
    return config_from_namespace(parser.parse_args(list(argv)))


def test_defaults_then_file_then_flags(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("training:\n  learning_rate: 3.0e-5\n  seed: 7\nmax_length: 64\n")
    cfg = parse("--config", str(file), "--seed", "9")
    assert cfg.training.learning_rate == 3e-5  # from the file (grouped under its section)
    assert cfg.data.max_length == 64  # from the file (flat key)
    assert cfg.training.seed == 9  # the flag wins over the file
    assert cfg.training.per_device_train_batch_size == 16  # the default


def test_json_config_file(tmp_path):
    file = tmp_path / "run.json"
    file.write_text(json.dumps({"training_type": "basic", "report_to": "none", "max_steps": 5}))
    cfg = parse("--config", str(file))
    assert (cfg.training.training_type, cfg.training.max_steps, cfg.tracking.report_to) == ("basic", 5, ["none"])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--overwrite_output_dir"], True),
        (["--overwrite_output_dir", "true"], True),
        (["--overwrite_output_dir", "True"], True),
        (["--overwrite_output_dir", "false"], False),
        ([], False),
    ],
)
def test_booleans_take_explicit_values(argv, expected):
    assert parse(*argv).output.overwrite_output_dir is expected


def test_bad_boolean_is_one_clear_error():
    with pytest.raises(UserError, match="--trust_remote_code: expected true or false"):
        parse("--trust_remote_code", "maybe")


def test_unknown_file_key_suggests_the_right_one(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("learning_rat: 0.1\n")
    with pytest.raises(UserError, match="did you mean learning_rate"):
        parse("--config", str(file))


def test_unknown_flag_and_bad_choice():
    with pytest.raises(UserError, match="unrecognized arguments"):
        parse("--learning_rat", "0.1")
    with pytest.raises(UserError, match="--training_type: 'fancy' is not one of basic, accelerated"):
        build_config({"training_type": "fancy"})


def test_help_lists_every_option_with_its_default():
    parser = argparse.ArgumentParser(prog="t", formatter_class=lambda prog: argparse.HelpFormatter(prog, width=400))
    add_config_arguments(parser)
    text = parser.format_help()
    for name in _fields():
        assert f"--{name}" in text
    assert "(default: 16)" in text and "(default: accelerated)" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset_name", "x", "--train_file", "y.csv"], "give one of them"),
        (["--text_pair_column", "text"], "must differ from --text_column"),
        (["--validation_split_percentage", "100"], "between 0 and 100"),
        (["--learning_rate", "0"], "must be positive"),
        (["--gradient_accumulation_steps", "0"], "at least 1"),
        (["--eval_strategy", "steps"], "needs --eval_steps"),
        (["--push_to_hub", "true"], "needs --hub_model_id"),
        (["--report_to", "none,wandb"], "cannot be combined"),
        (["--max_length", "abc"], "--max_length: invalid literal"),
    ],
)
def test_contradictory_or_invalid_values_fail_early(argv, message):
    with pytest.raises(UserError, match=message):
        parse(*argv)


def test_secrets_stay_out_of_saved_arguments():
    cfg = parse("--hub_token", "hf_secret123", "--hub_model_id", "me/model")
    assert "hub_token" not in cfg.to_dict()
    assert "hf_secret123" not in json.dumps(cfg.to_dict())
    assert cfg.to_dict()["hub_model_id"] == "me/model"


OPTIONAL = [name for name, (_, f) in _fields().items() if "None" in str(f.type)]


@pytest.mark.parametrize("word", ["none", "null", "None", "NULL"])
def test_none_unsets_every_optional_option(word):
    """Each `X | None` option (strings included) goes back to unset with none/null, on the command line
    and in a config file, so a default can be turned off."""
    assert {"resume_from_checkpoint", "hub_revision", "run_name", "checkpointing_steps"} <= set(OPTIONAL)
    cfg = build_config({name: word for name in OPTIONAL})
    assert all(value is None for name, value in cfg.to_dict(include_secrets=True).items() if name in OPTIONAL)
    assert parse("--run_name", word, "--hub_revision", word).tracking.run_name is None


def test_a_sagemaker_job_can_turn_off_its_default_resume(tmp_path, monkeypatch):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("CLOUDTRAIN_CHECKPOINT_DIR", str(checkpoints))
    assert parse().checkpoint.resume_from_checkpoint == "latest"  # the job's default
    assert parse("--resume_from_checkpoint", "none").checkpoint.resume_from_checkpoint is None


def test_none_is_still_a_value_where_an_option_is_required():
    assert parse("--report_to", "none").tracking.report_to == ["none"]
    with pytest.raises(UserError, match="--max_length: a value is required"):
        parse("--max_length", "none")
