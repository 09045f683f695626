"""`--help` and a refused option answer without importing the tasks and trainers (transformers, datasets,
torch.distributed: about 6 s of CPU): the parser reads cloudtrain.registry_table. So do every other command's
(`cloudtrain predict --help`...): their options are in cloudtrain.commands, which imports the module doing the
work only once they are valid. Checked by what a fresh interpreter has imported, not by timing."""

import json
import os
import subprocess
import sys

import torch
from conftest import child_pythonpath

from cloudtrain.cli import COMMANDS
from cloudtrain.config.training import muon_available

HEAVY = (
    "torch", "torch.distributed", "transformers", "datasets", "huggingface_hub", "peft", "safetensors", "deepspeed",
    "diffusers", "sympy", "scipy",
)  # fmt: skip
SCRIPT = """
import contextlib, io, json, sys
from cloudtrain.cli import run_command
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run_command(argv)
        except SystemExit as exit:
            code = exit.code
    heavy = sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)  # so far: the first case to import shows
    print(json.dumps([" ".join(argv), code, out.getvalue(), err.getvalue().strip(), heavy]))
"""


def answers(cases: list[str]) -> dict[str, list]:
    """Each command line through the CLI in one fresh interpreter: {line: [exit code, stdout, stderr, the heavy
    modules imported by then]}."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    argvs, heavy = json.dumps([case.split() for case in cases]), json.dumps(HEAVY)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, argvs, heavy], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return {line: rest for line, *rest in map(json.loads, result.stdout.splitlines())}


def assert_refused(answer: list, refusal: str) -> None:
    code, out, said, _ = answer
    assert (code, out, said.count("\n")) == (2, "", 0) and said.startswith("error: ") and refusal in said, said


def test_help_and_refusals_import_no_task_or_trainer():
    train = {
        "--bogus 1": "unrecognized arguments: --bogus 1",
        "--task translation": "'translation' is not one of classification, multi_label, regression, "
        "token_classification, question_answering, seq2seq, causal_lm, sft, dpo, reward, text_to_image",
        "--training_type turbo": "'turbo' is not one of basic, accelerated, pipeline",
        "--metric_for_best_model meteor": "'meteor' is not one of accuracy, macro_f1, loss, micro_f1, "
        "subset_accuracy, rmse, mae, pearson, spearman, f1, precision, recall, exact_match, rougeL, rouge1, rouge2, "
        "rougeLsum, bleu, perplexity",
        "--optim sgd": "'sgd' is not one of adamw",
    }
    said = answers(["--help", "train --help", *train])
    assert {line: heavy for line, (*_, heavy) in said.items() if heavy} == {}  # neither answers nor the parser
    assert said["--help"][0] == said["train --help"][0] == 0 and said["--help"][2] == said["train --help"][2] == ""
    assert said["--help"][1].startswith("usage: cloudtrain [-h] ")  # the usage as the user wrote the command
    assert said["train --help"][1].startswith("usage: cloudtrain train [-h] ")
    assert said["--help"][1].split("options:", 1)[1] == said["train --help"][1].split("options:", 1)[1]
    assert len(said["--help"][1].splitlines()) > 100  # the whole help, task and trainer summaries included
    for line, refusal in train.items():
        assert_refused(said[line], refusal)


# refusals of values that need no model, one or more per command, and the start of what each says
REFUSALS = {
    "generate --model_dir m --temperature 0": "--temperature must be greater than 0",
    "generate --model_dir m --top_p 2": "--top_p must be in (0, 1]",
    "predict --model_dir m --batch_size x": "argument --batch_size: invalid int value: 'x'",
    "push --output_dir d --hub_private_repo maybe": "argument --hub_private_repo: expected true or false, got 'maybe'",
    "plan --strategy turbo": "argument --strategy: invalid choice: 'turbo'",
    "plan --task translation": "--task: 'translation' is not one of classification",
    "merge --trust_remote_code true": "the following arguments are required: --output_dir",
    "merge --output_dir /no/such/run": "--output_dir /no/such/run does not exist; pass the output_dir of a training",
    "merge --output_dir /": "--output_dir / holds no adapter (adapter_config.json)",
    "predict --model_dir /no/such/run --text hi": "--model_dir /no/such/run does not exist",
    "predict --model_dir / --text hi": "--model_dir / holds no saved model",
    "predict --model_dir m --text hi --batch_size 0": "--batch_size must be at least 1, got 0",
    "predict --model_dir m --text hi --max_length 0": "--max_length must be at least 1, got 0",
    "predict --model_dir m": "nothing to classify: pass --text",
    "predict --model_dir m --input_file /no/such.txt": "--input_file /no/such.txt does not exist",
    "generate --model_dir /no/such/run --prompt hi": "--model_dir /no/such/run does not exist",
    "generate --model_dir m": "nothing to generate from: pass --prompt",
    "generate --model_dir m --chat --prompt hi": "--chat reads the conversation from the terminal",
    "plan": "give --gpu NAME (one of t4, v100-16gb, ",
    "plan --gpu h1000": "--gpu h1000 is not a GPU the planner knows (t4, ",
    "plan --gpu tpu-v5e": "--gpu tpu-v5e: Google TPUs (XLA) are not supported",
    "plan --gpu h100 --num_gpus 0": "--num_gpus must be at least 1",
    "launch --node_rank 2": "--node_rank 2 is not a node of --nnodes 1; give 0",
    "launch --nproc_per_node 2 --learning_rate -1": "--learning_rate must be positive",
    "plan --gpu h100 --lora_dropout 1": "--lora_dropout must be in [0, 1)",
    "preprocess --train_file a --tokenizer_name_or_path t --output_dir o --shard_documents 0": "--shard_documents",
    "preprocess --train_file a --tokenizer_name_or_path t --output_dir o --task sft": "--task sft needs --max_length",
}


def test_a_mistyped_command_is_told_the_command_before_any_import():
    """Training takes no positional arguments: a first word that is not an option is a command, and a mistyped
    one is told the closest command (or all of them), not training's 'unrecognized arguments'."""
    commands = ", ".join(["train", *COMMANDS])
    refusals = {
        "predcit --model_dir x": "error: unknown command 'predcit'; did you mean predict?",
        "genrate --prompt hi": "error: unknown command 'genrate'; did you mean generate?",
        "trian --max_steps 1": "error: unknown command 'trian'; did you mean train?",
        "fit --max_steps 1": f"error: unknown command 'fit'; the commands are {commands}",
        "predict --modeldir x": "error: unrecognized arguments: --modeldir x; did you mean --model_dir? (see "
        "cloudtrain predict --help)",  # the cause, not the required --model_dir it leaves missing
        "generate --prompt hi --model-dir m": "error: unrecognized arguments: --model-dir m; did you mean "
        "--model_dir? (see cloudtrain generate --help)",
    }
    said = answers(list(refusals))
    assert {line: heavy for line, (*_, heavy) in said.items() if heavy} == {}
    for line, refusal in refusals.items():
        assert said[line][:3] == [2, "", refusal]


def test_each_command_s_help_and_refusals_import_nothing_heavy():
    said = answers([f"{name} {extra}" for name in COMMANDS for extra in ("--help", "--bogus")] + list(REFUSALS))
    assert {line: heavy for line, (*_, heavy) in said.items() if heavy} == {}  # none imported, by any case
    for name in COMMANDS:
        code, out, err, _ = said[f"{name} --help"]
        assert (code, err) == (0, "") and out.startswith(f"usage: cloudtrain {name} [-h]") and "options:" in out
        assert_refused(said[f"{name} --bogus"], "")  # unrecognized, or the required options missing first
    for line, refusal in REFUSALS.items():
        assert_refused(said[line], f"error: {refusal}")


def test_a_mistyped_path_is_refused_before_the_training_imports(tmp_path):
    a_file, empty, sheet = tmp_path / "notes.txt", tmp_path / "empty.csv", tmp_path / "sheet.xlsx"
    a_file.write_text("not a folder\n")
    empty.write_text("")
    sheet.write_text("a,b\n")
    no = tmp_path / "no"
    mine = tmp_path / "mine"  # the user's own files under names a run writes: refused 6 s later before (audit)
    mine.mkdir()
    (mine / "args.json").write_text("{}")
    refusals = {
        f"--train_file {no}.csv": f"--train_file {no}.csv does not exist",
        f"--train_file {a_file} --test_file {empty}": f"--test_file {empty} is empty",
        f"--train_file {sheet}": f"--train_file {sheet}: unsupported format '.xlsx'; use one of .csv",
        f"--validation_file {a_file}": "--validation_file/--test_file need a --train_file too",
        f"--model_name_or_path {no}": f"--model_name_or_path {no} does not exist; give a model directory or a Hub id",
        f"--tokenizer_name_or_path {no}": f"--tokenizer_name_or_path {no} does not exist",
        f"--model_name_or_path {a_file}": f"--model_name_or_path {a_file} is a file; give the folder it lies in",
        f"--tokenizer_name_or_path {tmp_path}": f"--tokenizer_name_or_path {tmp_path} holds no tokenizer (no tokenizer",
        f"--task text_to_image --train_data_dir {no}": f"--train_data_dir {no} is not a folder",
        f"--deepspeed_config {no}.json": f"DeepSpeed config {no}.json does not exist; give a DeepSpeed JSON file",
        f"--output_dir {a_file}": f"--output_dir {a_file} is a file; give a directory",
        f"--output_dir {a_file}/run": "cannot be written",
        # folders a run writes into as it goes: refused now, not after the first step
        f"--checkpoint_dir {a_file}": f"--checkpoint_dir {a_file} is a file; give a directory",
        f"--profile true --profile_dir {a_file}/p": f"--profile_dir {a_file}/p cannot be written (Not a directory)",
        f"--cache_dir {a_file}": f"--cache_dir {a_file} is a file; give a directory",
        f"--output_dir {mine}": f"--output_dir {mine} holds args.json, which cloudtrain did not write",
        "--zero_stage 2 --fsdp true": "DeepSpeed and FSDP were both requested; choose one",
        "--offload_param cpu": "--offload_optimizer/--offload_param need DeepSpeed: add --zero_stage 2 or 3",
        "--optim muon --fsdp true": "--optim muon orthogonalises whole weight matrices",
        "--dataloader_num_workers 100000": "--dataloader_num_workers 100000 is more than",
        "--gradient_accumulation_steps 10000000000000000000": "--gradient_accumulation_steps take at most 1,000,000",
    }
    said = answers(list(refusals))
    assert {line: heavy for line, (*_, heavy) in said.items() if heavy} == {}
    for line, refusal in refusals.items():
        assert_refused(said[line], refusal)


def test_a_launcher_s_variables_or_a_cache_that_is_a_file_in_the_environment_are_refused_in_one_line(
    tmp_path, monkeypatch
):
    """Each used to end in a traceback or blame the data file: WORLD_SIZE left over from a launch (accelerate waited
    for an address), a CLOUDTRAIN_CACHE naming a file (after the model loaded), an HF_DATASETS_CACHE naming one."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder\n")
    for variable in ("CLOUDTRAIN_CACHE", "HF_DATASETS_CACHE"):
        with monkeypatch.context() as env:
            env.setenv(variable, str(a_file))
            said = answers(["--max_steps 1"])["--max_steps 1"]
            assert_refused(said, f"{variable} {a_file} is a file; give a directory")
    monkeypatch.setenv("CLOUDTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for world, refusal in (
        ("2", "the environment sets WORLD_SIZE=2 but no launcher started this process (no MASTER_ADDR): start it "
         "with torchrun or cloudtrain launch, which set both, or unset WORLD_SIZE"),
        ("two", "the environment sets WORLD_SIZE=two, not a number of processes: unset it"),
    ):  # fmt: skip
        monkeypatch.setenv("WORLD_SIZE", world)
        said = answers(["--max_steps 1"])["--max_steps 1"]
        assert_refused(said, refusal)
        assert said[-1] == []  # before the training's imports


def test_a_text_to_image_output_given_to_a_text_command_is_named_for_what_it_is(tmp_path):
    pipeline, lora = tmp_path / "pipeline", tmp_path / "lora"
    for folder, file in ((pipeline, "model_index.json"), (lora, "pytorch_lora_weights.safetensors")):
        folder.mkdir()
        (folder / file).write_text("{}")
    refusals = {
        f"generate --model_dir {pipeline} --prompt hi": f"--model_dir {pipeline} holds a diffusers pipeline from",
        f"merge --output_dir {lora}": f"--output_dir {lora} holds a diffusers LoRA from --task text_to_image, not a",
        # predict said "holds no saved model" (found in audit)
        f"predict --model_dir {lora} --text hi": f"--model_dir {lora} holds a diffusers LoRA from --task text_to_",
    }
    said = answers(list(refusals))
    assert {line: heavy for line, (*_, heavy) in said.items() if heavy} == {}
    for line, refusal in refusals.items():
        assert_refused(said[line], refusal)


def test_muon_is_known_available_without_importing_torch():
    assert muon_available() == hasattr(torch.optim, "Muon")


# cloudtrain.train(...) from a fresh interpreter: what it raised, and the heavy modules imported by then
API_SCRIPT = """
import json, sys
import cloudtrain
from cloudtrain.errors import UserError
try:
    cloudtrain.train(**json.loads(sys.argv[1]))
    said = None
except UserError as err:
    said = str(err)
print(json.dumps([said, sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)]))
"""


def api_answer(options: dict) -> tuple[str | None, list[str]]:
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    result = subprocess.run(
        [sys.executable, "-c", API_SCRIPT, json.dumps(options), json.dumps(HEAVY)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    said, heavy = json.loads(result.stdout.splitlines()[-1])
    return said, heavy


def earlier_run(folder):
    """A folder holding a model an earlier run saved (the names are in cloudtrain's manifest)."""
    from cloudtrain.publish.output_dir import record

    folder.mkdir()
    for name in ("config.json", "model.safetensors", "args.json"):
        (folder / name).write_text("{}")
    record(folder, ["config.json", "model.safetensors", "args.json"])
    return folder


def test_the_python_api_checks_paths_as_the_command_line_does_before_the_hub_and_the_imports(tmp_path):
    corpus = tmp_path / "corpus.txt"  # docs/getting-started.md's example, its corpus missing
    said, heavy = api_answer({"task": "causal_lm", "model_name_or_path": "gpt2", "train_file": str(corpus)})
    assert (said, heavy) == (f"--train_file {corpus} does not exist", [])
    out = earlier_run(tmp_path / "run")
    said, heavy = api_answer({"output_dir": str(out)})
    assert said and said.startswith(f"--output_dir {out} already holds a model from an earlier run") and not heavy


def test_an_output_folder_holding_an_earlier_model_is_refused_before_the_training_imports(tmp_path):
    out = earlier_run(tmp_path / "run")
    (tmp_path / "run-2").mkdir()  # taken: the suggestion is the first free name
    said = answers([f"--output_dir {out}"])
    assert said[f"--output_dir {out}"][-1] == []
    assert_refused(
        said[f"--output_dir {out}"],
        f"error: --output_dir {out} already holds a model from an earlier run (kept); choose a new folder, e.g. "
        f"--output_dir {tmp_path / 'run-3'}, or pass --overwrite_output_dir true to replace it",
    )
