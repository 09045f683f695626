"""`--help` and a refused option answer without importing the tasks and trainers (transformers, datasets,
torch.distributed: about 6 s of CPU): the parser reads cloudtrain.registry_table. Checked by what a fresh
interpreter has imported, not by timing."""

import json
import os
import subprocess
import sys

import torch
from conftest import REPO

from cloudtrain.config.training import muon_available

HEAVY = ("torch", "transformers", "datasets", "torch.distributed", "sympy", "scipy")
SCRIPT = f"""
import contextlib, io, json, sys
from cloudtrain.cli import run_command
cases = (["--help"], ["train", "--help"], ["--bogus", "1"], ["--task", "regression"],
         ["--training_type", "turbo"], ["--metric_for_best_model", "bleu"], ["--optim", "sgd"])
for argv in cases:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run_command(argv)
        except SystemExit as exit:
            code = exit.code
    print(json.dumps([" ".join(argv), code, len(out.getvalue().splitlines()), err.getvalue().strip()]))
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""


def test_help_and_refusals_import_no_task_or_trainer():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    *cases, heavy = map(json.loads, result.stdout.splitlines())
    assert heavy == []  # neither the answers nor building the parser imported them
    answers = {argv: (code, lines, said) for argv, code, lines, said in cases}
    assert answers["--help"][:2] == answers["train --help"][:2] and answers["--help"][0] == 0
    assert answers["--help"][1] > 100  # the whole help, task and trainer summaries included
    for argv, refusal in [
        ("--bogus 1", "unrecognized arguments: --bogus 1"),
        ("--task regression", "'regression' is not one of classification, causal_lm, sft, dpo, reward, text_to_image"),
        ("--training_type turbo", "'turbo' is not one of basic, accelerated, pipeline"),
        ("--metric_for_best_model bleu", "'bleu' is not one of accuracy, macro_f1, loss, perplexity, exact_match"),
        ("--optim sgd", "'sgd' is not one of adamw"),
    ]:
        code, lines, said = answers[argv]
        assert (code, lines, said.count("\n")) == (2, 0, 0) and said.startswith("error: ") and refusal in said


def test_muon_is_known_available_without_importing_torch():
    assert muon_available() == hasattr(torch.optim, "Muon")
