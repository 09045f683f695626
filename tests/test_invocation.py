"""The command lines cloudtrain prints start the way the user started it (cloudtrain.invocation)."""

import sys
from pathlib import Path

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


def interpreter_on_path(monkeypatch, tmp_path, names: dict[str, bool]) -> Path:
    """A PATH holding `python`/`python3` (True: as links to this interpreter, False: to another one)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    other = tmp_path / "other-python"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    for name, this in names.items():
        (folder / name).symlink_to(sys.executable if this else other)
    monkeypatch.setenv("PATH", str(folder))
    return folder


@pytest.mark.parametrize("arg0,expected", CASES)
def test_printed_commands_start_as_this_process_was_started(arg0, expected, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", [arg0, "predict"])
    monkeypatch.setattr(sys, "executable", str(interpreter_on_path(monkeypatch, tmp_path, {"python": True}) / "python"))
    assert (invocation.prog(), invocation.command(), invocation.launch_target()) == expected


@pytest.mark.parametrize(
    "on_path,inside,expected",
    [
        ({"python": True, "python3": True}, False, "python"),
        ({"python3": True}, False, "python3"),  # Debian: no `python`
        ({"python": False, "python3": True}, False, "python3"),  # `python` is another interpreter
        ({"python": False}, True, ".venv/bin/python"),  # a venv not activated, below the current folder
        ({}, False, "{exe}"),  # elsewhere: its full path
        ({}, "bin", "./python"),  # in its own folder: not a bare name, which the shell looks up on PATH
    ],
)
def test_the_interpreter_is_named_as_it_can_be_run_from_here(on_path, inside, expected, monkeypatch, tmp_path):
    interpreter_on_path(monkeypatch, tmp_path, on_path)
    venv = tmp_path / "project" / ".venv" / "bin"
    venv.mkdir(parents=True)
    exe = venv / "python"
    exe.symlink_to(sys.executable)
    here = {True: tmp_path / "project", False: tmp_path / "bin", "bin": venv}[inside]  # bin: not above the venv
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "executable", str(exe))
    if on_path.get("python") or on_path.get("python3"):  # the names on PATH link to this interpreter's file
        monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / expected))
    monkeypatch.setattr(sys, "argv", ["src/training_application.py"])
    assert invocation.command() == f"{expected.format(exe=exe)} src/training_application.py"


def test_a_use_it_line_names_the_entry_script_and_a_pair_classifier_s_second_text(monkeypatch, tmp_path):
    from cloudtrain.config import build_config
    from cloudtrain.registry import TASKS

    monkeypatch.setattr(sys, "executable", str(interpreter_on_path(monkeypatch, tmp_path, {"python": True}) / "python"))
    monkeypatch.setattr(sys, "argv", ["src/training_application.py"])
    pair = TASKS["classification"](build_config({"train_file": "t.csv", "text_pair_column": "hypothesis"}))
    hint = 'python src/training_application.py predict --model_dir out/nli --text "..." --text_pair "..."'
    assert pair.inference_hint("out/nli") == hint
    monkeypatch.setattr(sys, "argv", ["/venv/bin/cloudtrain"])
    single = TASKS["classification"](build_config({}))
    assert single.inference_hint("my runs/r8") == "cloudtrain predict --model_dir 'my runs/r8' --text \"...\""
