"""`--help` and a refused option answer without importing the tasks and trainers (transformers, datasets,
torch.distributed: about 6 s of CPU): the parser reads cloudtrain.registry_table. So do every other command's
(`cloudtrain predict --help`...): their options are in cloudtrain.commands, which imports the module doing the
work only once they are valid. Checked by what a fresh interpreter has imported, not by timing."""

import json
import os
import subprocess
import sys

import torch
from conftest import REPO

from cloudtrain.cli import COMMANDS
from cloudtrain.commands import plan
from cloudtrain.config.training import muon_available
from cloudtrain.planning.accelerators import GPUS
from cloudtrain.planning.strategies import MODEL_PARALLEL, PIPELINE, STRATEGIES

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


COMMAND_HEAVY = (
    "torch", "transformers", "huggingface_hub", "peft", "safetensors", "deepspeed", "diffusers", "datasets"
)  # fmt: skip
# refusals of values that need no model, one or more per command, and the start of what each says
REFUSALS = {
    "generate --model_dir m --temperature 0": "--temperature must be greater than 0",
    "generate --model_dir m --top_p 2": "--top_p must be in (0, 1]",
    "predict --model_dir m --batch_size x": "argument --batch_size: invalid int value: 'x'",
    "push --output_dir d --hub_private_repo maybe": "argument --hub_private_repo: expected true or false, got 'maybe'",
    "plan --strategy turbo": "argument --strategy: invalid choice: 'turbo'",
    "plan --task regression": "--task: 'regression' is not one of classification",
    "merge --trust_remote_code true": "the following arguments are required: --output_dir",
    "preprocess --train_file a --tokenizer_name_or_path t --output_dir o --shard_documents 0": "--shard_documents",
    "preprocess --train_file a --tokenizer_name_or_path t --output_dir o --task sft": "--task sft needs --max_length",
}
COMMAND_SCRIPT = f"""
import contextlib, io, json, sys
from cloudtrain.cli import COMMANDS, run_command
cases = [[name, extra] for name in COMMANDS for extra in ("--help", "--bogus")]
cases += [argv.split() for argv in {list(REFUSALS)!r}]
for argv in cases:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run_command(argv)
        except SystemExit as exit:
            code = exit.code
    heavy = sorted(m for m in {COMMAND_HEAVY!r} if m in sys.modules)  # so far: the first case that imports one shows
    print(json.dumps([" ".join(argv), code, out.getvalue(), err.getvalue().strip(), heavy]))
"""


def test_each_command_s_help_and_refusals_import_nothing_heavy():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run(
        [sys.executable, "-c", COMMAND_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    answers = {argv: rest for argv, *rest in map(json.loads, result.stdout.splitlines())}
    assert {argv: heavy for argv, (*_, heavy) in answers.items() if heavy} == {}  # none imported, by any case
    for name in COMMANDS:
        code, out, said, _ = answers[f"{name} --help"]
        assert (code, said) == (0, "") and out.startswith(f"usage: cloudtrain {name} [-h]") and "options:" in out
        code, out, said, _ = answers[f"{name} --bogus"]  # unrecognized, or the required options missing first
        assert (code, out, said.count("\n")) == (2, "", 0) and said.startswith("error: ")
    for argv, refusal in REFUSALS.items():
        code, out, said, _ = answers[argv]
        assert (code, out, said.count("\n")) == (2, "", 0) and said.startswith(f"error: {refusal}"), (argv, said)


def test_the_plan_command_names_the_planner_s_gpus_and_strategies():
    assert plan.GPU_NAMES == tuple(GPUS)
    keys = [s.key for s in (*STRATEGIES, PIPELINE, *MODEL_PARALLEL)]
    assert plan.STRATEGY_CHOICES == ("auto", *keys)


def test_muon_is_known_available_without_importing_torch():
    assert muon_available() == hasattr(torch.optim, "Muon")
