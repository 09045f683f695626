"""The command lines cloudtrain prints start the way the user started it (cloudtrain.invocation)."""

import sys

import pytest

from cloudtrain import invocation

CASES = [  # sys.argv[0]: (prog, command, launch target)
    (
        "src/training_application.py",
        ("training_application.py", "python src/training_application.py", ["src/training_application.py"]),
    ),
    (
        "/opt/ml/code/training_application.py",
        (
            "training_application.py",
            "python /opt/ml/code/training_application.py",
            ["/opt/ml/code/training_application.py"],
        ),
    ),
    (
        "/home/a b/training_application.py",
        (
            "training_application.py",
            "python '/home/a b/training_application.py'",
            ["/home/a b/training_application.py"],
        ),
    ),
    ("/venv/bin/cloudtrain", ("cloudtrain", "cloudtrain", ["-m", "cloudtrain"])),
    ("/repo/src/cloudtrain/__main__.py", ("python -m cloudtrain", "python -m cloudtrain", ["-m", "cloudtrain"])),
    # a notebook's kernel or another program importing cloudtrain: the installed command
    ("/venv/lib/ipykernel_launcher.py", ("cloudtrain", "cloudtrain", ["-m", "cloudtrain"])),
    ("/venv/lib/python3.11/site-packages/pytest/__main__.py", ("cloudtrain", "cloudtrain", ["-m", "cloudtrain"])),
    ("", ("cloudtrain", "cloudtrain", ["-m", "cloudtrain"])),
]


@pytest.mark.parametrize("arg0,expected", CASES)
def test_printed_commands_start_as_this_process_was_started(arg0, expected, monkeypatch):
    monkeypatch.setattr(sys, "argv", [arg0, "predict"])
    assert (invocation.prog(), invocation.command(), invocation.launch_target()) == expected


def test_a_use_it_line_names_the_entry_script_and_a_pair_classifier_s_second_text(monkeypatch):
    from cloudtrain.config import build_config
    from cloudtrain.registry import TASKS

    monkeypatch.setattr(sys, "argv", ["src/training_application.py"])
    pair = TASKS["classification"](build_config({"train_file": "t.csv", "text_pair_column": "hypothesis"}))
    hint = 'python src/training_application.py predict --model_dir out/nli --text "..." --text_pair "..."'
    assert pair.inference_hint("out/nli") == hint
    monkeypatch.setattr(sys, "argv", ["/venv/bin/cloudtrain"])
    single = TASKS["classification"](build_config({}))
    assert single.inference_hint("my runs/r8") == "cloudtrain predict --model_dir 'my runs/r8' --text \"...\""
