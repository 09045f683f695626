"""The typed config: precedence, file formats, explicit booleans, help, and early validation."""

import argparse
import json
import re

import pytest

from cloudtrain.config import (
    Config,
    ConfigParser,
    add_config_arguments,
    build_config,
    config_from_namespace,
    load_config_file,
    option_fields,
    resolve_options,
)
from cloudtrain.errors import UserError


def parse(*argv: str) -> Config:
    parser = ConfigParser(prog="t")
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


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--num_epochs", "2"], "; did you mean --num_train_epochs?"),  # Transformers' Trainer's names
        (["--per_gpu_train_batch_size", "8"], "; did you mean --per_device_train_batch_size?"),
        (["--evaluation_strategy", "steps"], "; did you mean --eval_strategy?"),
        (["--fp16"], "; did you mean --mixed_precision fp16?"),
        (["--do_train"], "; not needed: a run always trains"),
        (["--lerning_rate", "1e-4"], "; did you mean --learning_rate?"),  # a typo: the closest name
        (["--zzz", "1"], " (see"),  # nothing close: no guess
    ],
)
def test_an_unknown_flag_is_told_cloudtrains_name_for_it(argv, hint):
    with pytest.raises(UserError) as refused:
        parse(*argv)
    assert str(refused.value).startswith(f"unrecognized arguments: {' '.join(argv)}{hint}"), refused.value


def test_a_config_file_is_told_the_section_and_the_yaml_spelling(tmp_path):
    file = tmp_path / "run.yaml"
    for text, message in [
        ("trainig:\n  learning_rate: 0.1\n", "unknown option 'trainig'; did you mean the section training?"),
        ("num_epochs: 2\n", "unknown option 'num_epochs'; did you mean num_train_epochs?"),
        ("run_name: yes\n", "--run_name: got true (YAML reads an unquoted yes, no, on or off as true); quote"),
    ]:
        file.write_text(text)
        with pytest.raises(UserError, match=re.escape(message)):
            parse("--config", str(file))
    file.write_text("mixed_precision: no\n")  # YAML's false, where the choices spell it no
    assert parse("--config", str(file)).training.mixed_precision == "no"


@pytest.mark.parametrize(
    "text, where",
    [
        ("a:\n  b: 1\n c: 2\n", "line 3, column 2: expected <block end>, but found '<block mapping start>' "
         "(while parsing a block mapping at line 1, column 1)"),
        ("seed: [1, 2\nmax_steps: 3\n", "line 2, column 10: expected ',' or ']', but got ':' "
         "(while parsing a flow sequence at line 1, column 7)"),
        ("training:\n  seed: 1\n   lr: 2\n", "line 3, column 6: mapping values are not allowed here"),
        ('run_name: "open\n', "line 2, column 1: found unexpected end of stream (while scanning a quoted scalar at "
         "line 1, column 11)"),
        # PyYAML kept the last copy of a key: a section written twice lost every option of its first copy
        ("training:\n  learning_rate: 5.0e-3\ndata:\n  max_length: 64\ntraining:\n  num_train_epochs: 1\n",
         "line 5, column 1: 'training' is given twice (first at line 1)"),
        ("seed: 1\nseed: 2\n", "line 2, column 1: 'seed' is given twice (first at line 1)"),
    ],
)  # fmt: skip
def test_bad_yaml_says_where_in_one_line(tmp_path, text, where):
    """PyYAML's marks (problem, and the construct it was reading) stay in the one line, counted from 1."""
    file = tmp_path / "bad.yaml"
    file.write_text(text)
    with pytest.raises(UserError) as caught:
        parse("--config", str(file))
    assert str(caught.value) == f"config file {file} is not valid YAML/JSON: {where}"


def test_yaml_merge_keys_still_work_and_an_unhashable_key_is_one_line(tmp_path):
    """The duplicate-key check refused `<<: *anchor` and crashed on a list used as a key (found in review)."""
    merged = tmp_path / "merged.yaml"
    merged.write_text("datasets:\n  - &web {path: a.jsonl, weight: 0.5}\n  - <<: *web\n    path: b.jsonl\n")
    assert load_config_file(str(merged))["datasets"] == [
        {"path": "a.jsonl", "weight": 0.5},
        {"path": "b.jsonl", "weight": 0.5},
    ]
    unhashable = tmp_path / "unhashable.yaml"
    unhashable.write_text("{[learning_rate]: 0.1}\n")
    with pytest.raises(UserError, match="is not valid YAML/JSON: .*unhashable key"):
        parse("--config", str(unhashable))


def test_a_config_folder_and_a_nested_config_key_get_the_right_hint(tmp_path):
    """`config: base.yaml` was told "did you mean model_config?", and a folder "does not exist" (found in audit)."""
    with pytest.raises(UserError, match=f"config file {tmp_path} is a folder; give a YAML or JSON file"):
        parse("--config", str(tmp_path))
    nested = tmp_path / "child.yaml"
    nested.write_text("config: base.yaml\n")
    with pytest.raises(UserError, match="unknown option 'config'; not needed: a config file starts from another with"):
        parse("--config", str(nested))
    # a command that reads no config file was told the same, about extends: (found in audit)
    from cloudtrain.config.parse import unknown_option_hint

    assert (
        unknown_option_hint("config", ["task"], "--")
        == "; this command reads no config file: give its options as flags"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("learning_rate: 5.0e-3\ntraining:\n  learning_rate: 2.0e-4\n",
         "learning_rate is given both at the top level and under training; keep one"),
        ("training:\n  learning_rate: 2.0e-4\nlearning_rate: 5.0e-3\n",
         "learning_rate is given both under training and at the top level; keep one"),
    ],
)  # fmt: skip
def test_an_option_given_flat_and_under_its_section_is_refused_either_way_round(tmp_path, text, message):
    """Whichever came later in the file won, silently."""
    file = tmp_path / "twice.yaml"
    file.write_text(text)
    with pytest.raises(UserError, match=re.escape(f"config file {file}: {message}")):
        parse("--config", str(file))


@pytest.mark.parametrize("flag", ["output_dir", "checkpoint_dir", "profile_dir", "cache_dir"])
def test_a_url_for_a_folder_the_run_writes_is_refused(flag):
    """`--output_dir s3://bucket/run` saved the model into a local folder named `s3:` (found in audit)."""
    with pytest.raises(UserError, match=f"--{flag} s3://bucket/run must be a local folder"):
        parse(f"--{flag}", "s3://bucket/run", "--profile", "true")


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("max_steps", "two", "a whole number"),
        ("learning_rate", "fast", "a number"),
        ("max_length", "1e3", "a whole number"),
    ],
)
def test_a_bad_number_says_the_same_in_a_file_and_on_the_command_line(tmp_path, name, value, expected):
    message = f"--{name}: expected {expected}, got {value!r}"
    with pytest.raises(UserError) as flag:
        parse(f"--{name}", value)
    file = tmp_path / "run.yaml"
    file.write_text(f"{name}: {value}\n")
    with pytest.raises(UserError) as in_file:
        parse("--config", str(file))
    assert str(flag.value) == message
    assert str(in_file.value) == f"{message} (--{name} is set in {file})"


def test_a_bad_value_from_an_extended_file_names_that_file(tmp_path):
    """The refusal named the extending file for a value its base set (left alone earlier): the user looked in the
    wrong file. The nearer file's value wins, and is named, where both set it."""
    (tmp_path / "base.yaml").write_text("learning_rate: fast\nmax_steps: 2\n")
    (tmp_path / "run.yaml").write_text("extends: base.yaml\nmax_steps: 3\n")
    (tmp_path / "mine.yaml").write_text("extends: base.yaml\nlearning_rate: 1e-4\nmax_steps: two\n")
    with pytest.raises(UserError) as inherited:
        parse("--config", str(tmp_path / "run.yaml"))
    assert str(inherited.value).endswith(f"(--learning_rate is set in {tmp_path / 'base.yaml'})")
    with pytest.raises(UserError) as own:
        parse("--config", str(tmp_path / "mine.yaml"))
    assert (
        str(own.value)
        == f"--max_steps: expected a whole number, got 'two' (--max_steps is set in {tmp_path / 'mine.yaml'})"
    )


def test_a_key_yaml_reads_as_a_value_is_one_line_and_an_empty_section_is_empty(tmp_path):
    """`on: 2` (YAML's true) and `1: 2` crashed in the did-you-mean; a section with its options commented out was
    "unknown option 'training'" (found in audit)."""
    file = tmp_path / "run.yaml"
    for text, shown in (("on: 2\n", "True"), ("1: 2\n", "1"), ("training:\n  on: 2\n", "True under training")):
        file.write_text(text)
        with pytest.raises(UserError, match=f"^config file {file}: {shown} is not an option name .*; quote it$"):
            parse("--config", str(file))
    file.write_text("training:\n  # learning_rate: 0.1\nseed: 3\n")
    assert parse("--config", str(file)).training.seed == 3


def test_an_option_under_another_section_is_refused_naming_its_own(tmp_path):
    """Sections group options by where they belong: `training: {max_length: 64}` is a misplaced data option, told
    where it goes; under its own section or at the top level it is read."""
    file = tmp_path / "run.yaml"
    file.write_text("training:\n  seed: 3\n  max_length: 64\n")
    with pytest.raises(UserError) as caught:
        parse("--config", str(file))
    assert str(caught.value) == (
        f"config file {file}: max_length belongs to the data section, not training; move it under data: "
        "(or to the top level)"
    )
    with pytest.raises(UserError, match="^the config: peft belongs to the model section, not data;"):
        resolve_options({"data": {"peft": "lora"}}, {})  # a dict given to train(...) alike
    file.write_text("training:\n  seed: 3\ndata:\n  max_length: 64\nlora_r: 8\n")
    cfg = parse("--config", str(file))
    assert (cfg.training.seed, cfg.data.max_length, cfg.model.lora_r) == (3, 64, 8)
    file.write_text("training:\n  lerning_rate: 0.1\n")  # a typo under a section keeps its hint
    with pytest.raises(UserError, match="unknown option 'lerning_rate'; did you mean learning_rate"):
        parse("--config", str(file))


def test_a_mistyped_required_option_is_named_not_reported_missing():
    """argparse checks the required options first; a required option mistyped is both missing and unknown, and
    the unknown one is the cause."""
    parser = ConfigParser(prog="t")
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--text")
    with pytest.raises(UserError) as caught:
        parser.parse_args(["--modeldir", "x", "--text", "hi"])
    assert str(caught.value) == "unrecognized arguments: --modeldir x; did you mean --model_dir? (see t --help)"
    with pytest.raises(UserError) as caught:
        parser.parse_args(["--text", "hi"])
    assert str(caught.value) == "the following arguments are required: --model_dir (see t --help)"
    assert parser.parse_args(["--model_dir", "m"]).model_dir == "m"


def test_unknown_file_key_suggests_the_right_one(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("learning_rat: 0.1\n")
    with pytest.raises(UserError, match="did you mean learning_rate"):
        parse("--config", str(file))
    file.write_text("model: gpt2\n")  # a section given a value: "did you mean log_model?" before (audit)
    with pytest.raises(UserError, match=r"'model'; model is a section: give its options under it \(model_name_or_"):
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
    for name in option_fields():
        assert f"--{name}" in text
    assert "(default: 16)" in text and "(default: accelerated)" in text
    # a flag's booleans as typed and as docs/options.md shows them (found in audit: False/True in --help)
    assert "(default: false)" in text and "(default: False)" not in text and "(default: True)" not in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset_name", "x", "--train_file", "y.csv"], "give one of them"),
        (["--text_pair_column", "text"], "must differ from --text_column"),
        (["--validation_split_percentage", "100"], "above 0 and below 100"),
        (["--learning_rate", "0"], "must be positive"),
        (["--gradient_accumulation_steps", "0"], "at least 1"),
        (["--eval_strategy", "steps"], "needs --eval_steps"),
        (["--eval_strategy", "steps", "--eval_steps", "0"], "--eval_steps must be at least 1"),  # 'needs' (audit)
        (["--push_to_hub", "true"], "needs --hub_model_id"),
        (["--report_to", "none,wandb"], "cannot be combined"),
        (["--throughput_drop_ratio", "1.5"], "--throughput_drop_ratio must be in .0, 1. .a share"),
        (["--straggler_ratio", "0.8"], "--straggler_ratio must be above 1"),
        (["--max_length", "abc"], "--max_length: expected a whole number, got 'abc'"),
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


OPTIONAL = [name for name, (_, f) in option_fields().items() if "None" in str(f.type)]


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


@pytest.mark.parametrize(
    "values, message",
    [
        ({"learning_rate": "nan"}, "--learning_rate: expected a finite number, got 'nan'"),
        ({"learning_rate": float("nan")}, "--learning_rate: expected a finite number, got nan"),
        ({"num_train_epochs": "inf"}, "--num_train_epochs: expected a finite number, got 'inf'"),
        ({"weight_decay": float("-inf")}, "--weight_decay: expected a finite number, got -inf"),
        ({"learning_rate": [1, 2]}, "--learning_rate: expected one number, got a list [1, 2]"),
        ({"max_length": [128]}, "--max_length: expected one whole number, got a list [128]"),
        ({"max_length": {"a": 1}}, "--max_length: expected one whole number, got a mapping {'a': 1}"),
        ({"max_length": 2.5}, "--max_length: expected a whole number, got 2.5"),
        ({"max_length": True}, "--max_length: expected a whole number, got true"),
        ({"run_name": ["a", "b"]}, "--run_name: expected one value, got a list ['a', 'b']"),
        ({"report_to": {"wandb": 1}}, "--report_to: expected a list, got a mapping {'wandb': 1}"),
        ({"seed": -1}, "--seed must be between 0 and 4294967295"),
    ],
)
def test_values_of_the_wrong_type_or_not_finite_are_refused(values, message):
    """What a config file's YAML types or a flag can carry that Python would convert silently (or that passes a
    `<= 0` check, as nan does) is refused in one line naming the option."""
    with pytest.raises(UserError) as caught:
        resolve_options(values, {})
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_wrong_types_in_a_config_file_and_nan_on_the_command_line(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("training:\n  learning_rate: [1.0e-4, 2.0e-4]\n")
    with pytest.raises(UserError, match=r"^--learning_rate: expected one number, got a list \[0.0001, 0.0002\] "):
        parse("--config", str(file))
    with pytest.raises(UserError, match="^--max_grad_norm: expected a finite number, got 'NaN'$"):
        parse("--max_grad_norm", "NaN")


def test_a_refused_value_from_a_config_file_names_the_file(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("training:\n  learning_rate: abc\n  max_steps: -5\n")
    with pytest.raises(
        UserError, match=f"^--learning_rate: expected a number, got 'abc' .*set in {re.escape(str(file))}"
    ):
        parse("--config", str(file))
    with pytest.raises(UserError, match=f"^--max_steps must be at least 1 .*set in {re.escape(str(file))}"):
        parse("--config", str(file), "--learning_rate", "1e-4")  # a check of the whole config, not one value
    file.write_text("learning_rat: 1\n")
    with pytest.raises(UserError) as unknown:
        parse("--config", str(file))
    assert (
        str(unknown.value)
        == f"unknown option 'learning_rat'; did you mean learning_rate? (learning_rat is set in {file})"
    )
    file.write_text("training:\n  max_steps: -5\n")
    with pytest.raises(UserError, match=r"^--max_steps must be at least 1$"):  # the flag, not the file, is wrong
        parse("--config", str(file), "--learning_rate", "1e-4", "--max_steps", "0")


def test_whole_floats_still_count_as_whole_numbers():
    cfg = resolve_options({"max_length": 64.0, "learning_rate": 1, "num_train_epochs": "3"}, {})
    assert (cfg.data.max_length, cfg.training.learning_rate, cfg.training.num_train_epochs) == (64, 1.0, 3.0)


def test_a_config_file_extends_another_through_a_chain(tmp_path):
    """`extends` is relative to the extending file; the nearer file wins, and flags win over every file."""
    (tmp_path / "recipes").mkdir()
    (tmp_path / "base.yaml").write_text("seed: 1\nmax_length: 32\nlearning_rate: 1.0e-3\nreport_to: none\n")
    (tmp_path / "recipes" / "middle.yaml").write_text("extends: ../base.yaml\ntraining:\n  seed: 2\n  max_steps: 5\n")
    (tmp_path / "recipes" / "run.yaml").write_text("extends: middle.yaml\nmax_steps: 7\n")
    cfg = parse("--config", str(tmp_path / "recipes" / "run.yaml"), "--learning_rate", "0.5")
    assert cfg.data.max_length == 32 and cfg.tracking.report_to == ["none"]  # from base
    assert cfg.training.seed == 2  # middle overrides base
    assert cfg.training.max_steps == 7  # run overrides middle
    assert cfg.training.learning_rate == 0.5  # the flag overrides every file
    assert "extends" not in load_config_file(str(tmp_path / "recipes" / "run.yaml"))


def test_an_extends_cycle_is_refused_naming_the_chain(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\nseed: 1\n")
    (tmp_path / "b.yaml").write_text("extends: c.yaml\n")
    (tmp_path / "c.yaml").write_text("extends: a.yaml\n")
    chain = " -> ".join(str(tmp_path / name) for name in ("a.yaml", "b.yaml", "c.yaml", "a.yaml"))
    with pytest.raises(UserError) as caught:
        parse("--config", str(tmp_path / "a.yaml"))
    assert str(caught.value) == f"config files extend each other in a cycle: {chain}"
    (tmp_path / "self.yaml").write_text("extends: self.yaml\n")
    with pytest.raises(UserError, match="in a cycle: .*self.yaml -> .*self.yaml$"):
        parse("--config", str(tmp_path / "self.yaml"))


@pytest.mark.parametrize(
    "content, message",
    [
        ("extends: missing.yaml\n", "extends missing.yaml, which does not exist"),
        ("extends: [a.yaml, b.yaml]\n", "extends takes the path of one config file, got ['a.yaml', 'b.yaml']"),
    ],
)
def test_a_bad_extends_is_one_line(tmp_path, content, message):
    (tmp_path / "run.yaml").write_text(content)
    with pytest.raises(UserError, match=re.escape(message)):
        parse("--config", str(tmp_path / "run.yaml"))


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    (tmp_path / "run.yaml").write_bytes("run_name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"could not read config file .*run.yaml \(UTF-8 YAML or JSON\)"):
        parse("--config", str(tmp_path / "run.yaml"))


def test_a_leading_tilde_is_the_home_folder_wherever_the_path_comes_from(tmp_path, monkeypatch):
    """The shell expands ~ only at a word's start: `--output_dir=~/run` and a config file's `~/run` made a folder
    named ~ in the working directory (found in audit)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = str(tmp_path / "home")
    file = tmp_path / "run.yaml"
    file.write_text("output_dir: ~/run\nstreaming: true\ndatasets:\n  - path: ~/c.jsonl\n")
    cfg = parse("--config", str(file), "--validation_file=~/v.csv", "--text_column", "~text")
    assert cfg.output.output_dir == f"{home}/run"
    assert cfg.data.datasets == [{"path": f"{home}/c.jsonl"}]
    assert cfg.data.validation_file == f"{home}/v.csv"
    assert cfg.data.text_column == "~text"  # not a path: as given
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "seed.yaml").write_text("seed: 5\n")
    assert parse("--config=~/seed.yaml").training.seed == 5
    sources = parse("--train_file", "a.csv,~/b.csv", "--validation_file", "v.csv").data.train_file
    assert sources == f"a.csv,{home}/b.csv"  # each source of a comma-separated list


def test_config_given_twice_applies_both_files_in_order(tmp_path):
    """The second --config replaced the first without a word (found in audit): now each overrides the ones
    before it, and the flags override them all."""
    base, over = tmp_path / "base.yaml", tmp_path / "over.yaml"
    base.write_text("learning_rate: 0.5\nmax_steps: 2\nseed: 1\n")
    over.write_text("seed: 3\n")
    cfg = parse("--config", str(base), "--config", str(over), "--max_steps", "4")
    assert (cfg.training.learning_rate, cfg.training.seed, cfg.training.max_steps) == (0.5, 3, 4)


def test_a_commands_own_path_options_expand_a_leading_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    parser = ConfigParser(prog="t")
    parser.add_argument("--model_dir")
    parser.add_argument("--output_dir")  # push's and preprocess's, named as a training option is (review)
    parser.add_argument("--hub_model_id")
    args = parser.parse_args(["--model_dir=~/run", "--output_dir=~/out", "--hub_model_id=~me/x"])
    assert (args.model_dir, args.output_dir, args.hub_model_id) == (f"{tmp_path}/run", f"{tmp_path}/out", "~me/x")


def test_only_a_list_of_sources_takes_mappings_or_json():
    """datasets: may hold mappings, as YAML or as JSON text (a SageMaker hyperparameter); another list option keeps
    JSON-looking text as its text, and refuses a mapping in a config file (review)."""
    sources = '[{"path": "s3://b/a.jsonl", "weight": 2}]'
    assert build_config({"streaming": True, "datasets": sources}).data.datasets == [
        {"path": "s3://b/a.jsonl", "weight": 2}
    ]
    chat = '[{"role": "user", "content": "Hi"}]'
    assert build_config({"sample_prompts": chat}).data.sample_prompts == [chat]
    with pytest.raises(UserError, match="--sample_prompts: expected a list of values, got"):
        build_config({"sample_prompts": [{"role": "user", "content": "Hi"}]})


def test_a_typed_config_takes_its_own_options_only():
    """cfg.training.learning_rat = 0.5 (a typo) and cfg.learning_rate (another section's) were taken without a
    word; the run trained at the default rate (found in audit)."""
    cfg = Config()
    cfg.training.learning_rate = 0.5
    with pytest.raises(AttributeError, match="TrainingConfig has no option 'learning_rat'; did you mean learning_rate"):
        cfg.training.learning_rat = 0.5
    with pytest.raises(AttributeError, match="Config has no option 'learning_rate'; it is an option of cfg.training"):
        cfg.learning_rate = 0.5
    assert resolve_options(cfg, {}).training.learning_rate == 0.5


def test_train_takes_its_config_by_keyword_too(tmp_path):
    """train(config="run.yaml") was told "unknown option 'config'; not needed: ... extends" (found in audit)."""
    import cloudtrain

    (tmp_path / "run.yaml").write_text("lerning_rate: 0.1\n")
    with pytest.raises(UserError, match="unknown option 'lerning_rate'; did you mean learning_rate"):
        cloudtrain.train(config=str(tmp_path / "run.yaml"))


def test_a_list_option_given_as_a_json_list_is_that_list():
    """The SageMaker SDK sends a Python list hyperparameter as JSON text: --tags '["a", "b"]' recorded the tags
    '["a"' and '"b"]' (found in audit); other text starting with a bracket is the option's own."""
    assert build_config({"tags": '["a", "b"]'}).tracking.tags == ["a", "b"]
    assert build_config({"report_to": '["tensorboard"]'}).tracking.report_to == ["tensorboard"]
    prompts = build_config({"task": "text_to_image", "validation_prompts": "[dog] in a park|a cat"})
    assert prompts.images.validation_prompts == ["[dog] in a park", "a cat"]
