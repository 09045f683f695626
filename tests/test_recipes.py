"""configs/recipes/*.yaml, the configs users start from: each loads and validates, says in its header what it
trains, what it needs and how to launch it, passes the option checks that need no model; those that can run on
CPU train a few steps through the real application with a tiny model and tiny local data in place of the Hub's
(the substitutions are listed per recipe in CPU_RUNS), and their other options reach args.json as written."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO, lm_documents

from cloudtrain.cli import main
from cloudtrain.config import build_config, load_config_file, validate
from cloudtrain.errors import UserError
from cloudtrain.models import adapters
from cloudtrain.parallel.distributed import check_distributed
from cloudtrain.pipeline import resolve
from cloudtrain.tasks import build_task

RECIPE_DIR = REPO / "configs" / "recipes"
RECIPES = sorted(RECIPE_DIR.glob("*.yaml"))
LAUNCHERS = ("src/training_application.py", "cloudtrain train", "sagemaker/launch.py")

# Per recipe, what its CPU run changes (besides COMMON): the tiny model for the Hub's, tiny local files for the
# Hub's data, and the options this machine cannot run. {name} placeholders are filled from the test's files.
COMMON = {"max_steps": "2", "logging_steps": "1", "output_dir": "{out}", "checkpoint_dir": "{out}/ckpt"}
CPU_RUNS = {
    "classification_cpu.yaml": {
        "model_name_or_path": "{tiny_bert}",  # the built-in MiniLM and R8 take minutes; the recipe's job otherwise
        "train_file": "{topics_train}",
        "validation_file": "{topics_validation}",
        "test_file": "{topics_test}",
    },
    "full_finetune_1b_zero3_8gpu.yaml": {
        "model_name_or_path": "{tiny_llama}",  # for TinyLlama/TinyLlama_v1.1 (Hub)
        "dataset_name": "none",  # trl-lib/Capybara (Hub) -> local conversations
        "train_file": "{chats}",
        "validation_file": "{chats}",
        "max_length": "64",
        "sample_max_new_tokens": "4",
        # DeepSpeed off: on CPU it needs torchrun and compiles its comm op at every start (36-50 s measured here for
        # 2 steps); tests/test_causal_lm_dist.py trains ZeRO-3 with checkpointing and bfd packing. bf16 stays.
        "zero_stage": "none",
    },
    "qlora_sft_8b_24gb.yaml": {
        "model_name_or_path": "{tiny_llama}",  # for Qwen/Qwen2.5-7B (Hub)
        "peft": "lora",  # qlora loads the base in 4-bit with bitsandbytes: CUDA only
        "dataset_name": "none",  # trl-lib/Capybara (Hub) -> local conversations
        "train_file": "{chats}",
        "validation_file": "{chats}",
        "max_length": "64",
        "sample_max_new_tokens": "4",
    },
    "pretrain_packing_2nodes.yaml": {
        "model_name_or_path": "{tiny_llama}",  # for TinyLlama/TinyLlama_v1.1 (Hub); 1 process instead of 16
        "dataset_name": "none",  # Salesforce/wikitext (Hub) -> local text, one document per line
        "dataset_config": "none",
        "train_file": "{lm_train}",
        "validation_file": "{lm_validation}",
        "max_length": "32",
        "sample_max_new_tokens": "4",
    },
    "sagemaker_spot.yaml": {
        "model_name_or_path": "{tiny_bert}",  # for sentence-transformers/all-MiniLM-L6-v2 (Hub)
        "dataset_name": "none",  # fancyzhx/ag_news (Hub) -> local csv (as a --train channel would give)
        "train_file": "{topics_train}",
        "validation_file": "{topics_validation}",
        "test_file": "{topics_test}",
    },
}

CHATS = [
    ("Who found the golden key?", "The poor boy in the snow."),
    ("What did the wolf eat?", "Six little goats and chalk."),
    ("Where did the king live?", "In a castle by the sea."),
    ("How many brothers were there?", "Twelve brothers and a sister."),
    ("What fell into the well?", "The golden ball of the princess."),
    ("Who knocked at the door?", "The wolf with a soft voice."),
]


def header(recipe: Path) -> list[str]:
    """The leading comment lines, without '#', continuation lines (ending in a backslash) joined."""
    lines = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1].rstrip() + " " + text
        else:
            lines.append(text)
    return lines


def recipe_config(recipe: Path):
    cfg = build_config(load_config_file(str(recipe)))
    validate(cfg)
    return cfg


def test_there_are_recipes_and_each_cpu_run_names_one():
    names = {recipe.name for recipe in RECIPES}
    assert len(names) >= 5
    assert set(CPU_RUNS) <= names, set(CPU_RUNS) - names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_validates_and_its_header_says_how_to_launch_it(recipe):
    cfg = recipe_config(recipe)
    lines = header(recipe)
    text = "\n".join(lines)
    for part in ("Recipe:", "Trains:", "Needs:", "Launch", "Expect"):
        assert part in text, f"{recipe.name}: the header says nothing under {part!r}"
    launches = [
        line
        for line in lines
        if any(launcher in line for launcher in LAUNCHERS) and f"--config configs/recipes/{recipe.name}" in line
    ]
    assert launches, f"{recipe.name}: no launch command line with --config configs/recipes/{recipe.name}"
    for line in lines:  # every accelerate config a command names exists
        for config_file in re.findall(r"--config_file (\S+)", line):
            assert (REPO / config_file).is_file(), (recipe.name, config_file)
    if cfg.distributed.zero_stage is not None:
        assert "deepspeed" in text.lower()
    if cfg.model.peft == "qlora":
        assert "bitsandbytes" in text
    if cfg.tracking.report_to == ["none"]:
        assert "report_to" in text, f"{recipe.name}: say how to turn tracking on"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_passes_the_option_checks_that_need_no_model(recipe, monkeypatch):
    """The checks of the real run's preflight that read no model or data: the task's metric and packing, the
    distributed options (DeepSpeed config included), the adapter options. As its launcher starts it: the
    recipes are launched with torchrun or accelerate launch (WORLD_SIZE set)."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = recipe_config(recipe)
    task = build_task(cfg)
    cfg = resolve(cfg, task)
    assert cfg.checkpoint.metric_for_best_model in task.metrics
    if task.name == "sft":
        assert cfg.data.packing in ("none", "bfd")
    check_distributed(cfg)
    if cfg.checkpoint.checkpointing_steps not in (None, "epoch") and cfg.training.eval_strategy == "steps":
        # the best checkpoint is judged by the last evaluation before it: evaluate at least as often
        assert int(cfg.checkpoint.checkpointing_steps) % cfg.training.eval_steps == 0, recipe.name
    if cfg.model.peft == "qlora" and not (torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes")):
        pytest.skip("adapters.check_options for --peft qlora needs a CUDA GPU and bitsandbytes (the others passed)")
    adapters.check_options(cfg, task.auto_class)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_qlora_recipe_is_refused_on_cpu_with_the_way_out():
    cfg = recipe_config(RECIPE_DIR / "qlora_sft_8b_24gb.yaml")
    with pytest.raises(UserError, match="needs a CUDA GPU; use --peft lora"):
        adapters.check_options(cfg, build_task(cfg).auto_class)


def test_sagemaker_recipe_as_the_launcher_sends_it(capsys):
    """launch.py's own processing of the spot recipe: the options become hyperparameters (nothing to upload),
    checkpoints are on, so a spot job resumes instead of starting over."""
    spec_ = importlib.util.spec_from_file_location("cloudtrain_sagemaker_launch", REPO / "sagemaker" / "launch.py")
    launch = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(launch)
    spec = launch.JobSpec(
        instance_type="ml.g5.xlarge", config=str(RECIPE_DIR / "sagemaker_spot.yaml"), spot=True, max_run=7200
    )
    hyperparameters, channels, cfg = launch.job_options(spec)
    assert channels == {}
    assert hyperparameters["checkpointing_steps"] == "500" and hyperparameters["dataset_name"] == "fancyzhx/ag_news"
    assert hyperparameters["model_name_or_path"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert "output_dir" not in hyperparameters and "checkpoint_dir" not in hyperparameters
    assert cfg.checkpoint.checkpointing_steps == "500"
    launch.check_environment(spec, cfg, {}, hyperparameters)
    assert "starts over" not in capsys.readouterr().out
    assert launch.stopping_condition(spec).max_wait_time_in_seconds == 14400


# ---------------------------------------------------------------- a few steps on CPU


@pytest.fixture
def files(tmp_path, tiny_model_dir, tiny_llama_dir, topic_csvs) -> dict:
    data = tmp_path / "data"
    data.mkdir()
    chats = data / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            for q, a in CHATS
        )
    )
    lm = {}
    for split, n, seed in (("train", 40, 0), ("validation", 8, 1)):
        lm[split] = data / f"{split}.txt"
        lm[split].write_text("\n".join(lm_documents(n, seed)) + "\n")
    return {
        "out": str(tmp_path / "out"),
        "tiny_bert": tiny_model_dir,
        "tiny_llama": tiny_llama_dir,
        "chats": str(chats),
        "lm_train": str(lm["train"]),
        "lm_validation": str(lm["validation"]),
        **{f"topics_{split}": str(path) for split, path in topic_csvs.items()},
    }


@pytest.mark.parametrize("name", CPU_RUNS)
def test_recipe_trains_on_cpu_with_a_tiny_model(name, files, capsys):
    recipe = RECIPE_DIR / name
    changes = {key: value.format(**files) for key, value in {**CPU_RUNS[name], **COMMON}.items()}
    argv = ["--config", str(recipe), *(item for kv in changes.items() for item in (f"--{kv[0]}", kv[1]))]
    code = main(argv)  # in process (fast), as `python src/training_application.py --config ...`
    captured = capsys.readouterr()
    stdout = captured.out + captured.err
    assert code == 0, stdout[-4000:]

    out = Path(files["out"])
    recipe_cfg = build_config(load_config_file(str(recipe)))
    saved = "adapter_config.json" if recipe_cfg.model.peft != "none" else "config.json"
    assert (out / saved).is_file(), sorted(p.name for p in out.iterdir())
    args = json.loads((out / "args.json").read_text())
    assert args["max_steps"] == 2 and args["output_dir"] == files["out"]
    written = recipe_cfg.to_dict()
    taken = [key for key in load_config_file(str(recipe)) if key not in changes]
    assert len(taken) >= 10, taken
    for key in taken:
        if written[key] == "auto":  # made concrete for this machine
            assert args[key] not in ("auto", None), key
        else:
            assert args[key] == written[key], (key, args[key], written[key])
    assert "step 2/2" in stdout and "step 3/" not in stdout
