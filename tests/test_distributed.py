"""Real multi-process runs on CPU (2 processes, tiny model): DDP, DeepSpeed ZeRO-2/3, evaluation.

Each run is a real launch (torchrun or accelerate launch) of the real entry script. DeepSpeed builds
its shared-memory comm op on first use; `make test` builds it first into the suite's cache
(<venv>/torch_extensions, tests/conftest.py), so no test pays for it. The launches hide any GPU
(CUDA_VISIBLE_DEVICES=""): on a machine with one GPU two ranks would otherwise share it; these tests check
the CPU (gloo) paths on every machine, and tests/test_gpu.py the GPU ones.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import ENTRY, REPO, child_auto_precision, child_pythonpath, topic_rows
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from cloudtrain.config import build_config
from cloudtrain.data.processing import ProcessedData
from cloudtrain.errors import UserError
from cloudtrain.models.load import load_model
from cloudtrain.parallel.distributed import check_distributed, resolve_deepspeed_config, zero_config
from cloudtrain.tasks.classification import ClassificationTask
from cloudtrain.tasks.question_answering import QuestionAnsweringTask
from cloudtrain.tasks.token_classification import TokenClassificationTask

TINY_RUN = [
    "--training_type",
    "accelerated",
    "--eval_strategy",
    "no",
    "--per_device_train_batch_size",
    "4",
    "--learning_rate",
    "1e-2",
    "--warmup_ratio",
    "0",
    "--logging_steps",
    "8",
]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(
    launcher: list[str], *args: str, timeout: int = 300, kill_at: str | None = None
) -> subprocess.CompletedProcess:
    """The launch, which must succeed; with `kill_at` (a kill point, cloudtrain.faults) every process kills itself
    there, and the launch must fail."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("ACCELERATE_USE_CPU", None)
    if kill_at:
        env["CLOUDTRAIN_TEST_KILL_AT"] = kill_at
    result = subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert (result.returncode != 0) == bool(kill_at), (result.stdout[-2000:], result.stderr[-4000:])
    return result


def in_one_launch(launcher: list[str], runs: dict[str, list[str]], folder: Path) -> dict[str, str]:
    """Each of `runs` (name: a command line as `launch` takes it after the launcher: the entry script, then the
    application's arguments) one after another in one launch of tests/dist_runs.py by `launcher` (torchrun, or
    ONE_PROCESS): a launch's start (torch, transformers imported in every process) costs more than these tiny runs.
    Each run's stdout by name."""
    from dist_runs import run_outputs

    runs_file = folder / f"runs-{'-'.join(runs)}.json"
    runs_file.write_text(json.dumps([argv[1:] for argv in runs.values()]))  # dist_runs calls the entry's main
    timeout = 300 + 120 * len(runs)  # a launch's start, then each run (a loaded machine takes minutes for 7)
    result = launch(launcher, str(REPO / "tests" / "dist_runs.py"), str(runs_file), timeout=timeout)
    return dict(zip(runs, run_outputs(result.stdout, len(runs)), strict=True))


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", free_port()]


# A run of one process needs no launcher: without one the application trains with no process group, to the numbers
# of a 1-process launch, and a plain process spares the start of torchrun's agent (torch imported once more). A
# one-process DeepSpeed or FSDP run still needs torchrun (the application refuses to start it without).
ONE_PROCESS = [sys.executable]


def accelerate_launch(config: str, n: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / config),
        "--num_processes",
        str(n),
        "--main_process_port",
        free_port(),
    ]


def logged_losses(out: Path) -> list[float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [e["train/loss"] for e in lines if "train/loss" in e]


def data_args(topic_csvs, model_dir) -> list[str]:
    return [
        "--model_name_or_path",
        model_dir,
        "--train_file",
        str(topic_csvs["train"]),
        "--validation_file",
        str(topic_csvs["validation"]),
    ]


@pytest.mark.slow
def test_ddp_two_processes_match_one_process_with_twice_the_batch(tiny_model_dir, topic_csvs, tmp_path):
    common = (
        data_args(topic_csvs, tiny_model_dir)
        + TINY_RUN
        + ["--max_train_samples", "56", "--num_train_epochs", "2", "--mixed_precision", "no"]
    )
    two = launch(torchrun(2), str(ENTRY), *common, "--output_dir", str(tmp_path / "two"))
    launch(
        ONE_PROCESS, str(ENTRY), *common, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one")
    )
    assert "2 process(es) on cpu (DDP, precision no), effective batch 8 (4 per device x 2 x 1" in two.stdout
    assert two.stdout.count("trained 14 steps") == 1  # only the main process prints
    a, b = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-4)  # float reduction order differs
    assert logged_losses(tmp_path / "two") == pytest.approx(logged_losses(tmp_path / "one"), rel=1e-4)


USERS_DS_JSON = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
}


@pytest.fixture(scope="module")
def zero2_runs(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """The 2-process torchrun ZeRO-2 runs (plain, optimizer offloaded to the CPU, a user's DeepSpeed JSON with
    "auto" values) one after another in one launch of tests/dist_runs.py: a launch's start (DeepSpeed imported in
    both processes) costs more than these runs. Each run's stdout and output folder by name."""
    root = tmp_path_factory.mktemp("zero2-runs")
    csvs = {}
    for split, n, offset in (("train", 20, 0), ("validation", 4, 1)):  # topic_csvs' two splits these runs read
        csvs[split] = root / f"{split}.csv"
        pd.DataFrame(topic_rows(n, offset)).to_csv(csvs[split], index=False)
    (root / "ds.json").write_text(json.dumps(USERS_DS_JSON))
    common = [*data_args(csvs, tiny_model_dir), *TINY_RUN]
    runs = {
        "zero2-torchrun": [*common, "--num_train_epochs", "5", "--zero_stage", "2"],
        "zero2-offload-torchrun": [*common, "--num_train_epochs", "5", "--zero_stage", "2"],
        "users-json": [*common, "--gradient_accumulation_steps", "2", "--max_steps", "3"],
        "zero2-best": [*common, "--zero_stage", "2", "--max_steps", "40", *BEST_MODEL],
    }
    runs["zero2-offload-torchrun"] += ["--offload_optimizer", "cpu"]
    runs["users-json"] += ["--deepspeed_config", str(root / "ds.json")]
    lines = {name: [str(ENTRY), *argv, "--output_dir", str(root / name)] for name, argv in runs.items()}
    return {name: (stdout, root / name) for name, stdout in in_one_launch(torchrun(2), lines, root).items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero2-torchrun", "zero2-offload-torchrun", "zero3-accelerate-launch"])
def test_deepspeed_trains_and_saves_the_full_model(mode, tiny_model_dir, topic_csvs, tmp_path, request):
    """ZeRO-2 (the two torchrun runs share one launch: zero2_runs) and ZeRO-3 through accelerate launch."""
    if mode == "zero3-accelerate-launch":
        out = tmp_path / "out"
        args = [str(ENTRY), *data_args(topic_csvs, tiny_model_dir), *TINY_RUN, "--num_train_epochs", "5"]
        stdout = launch(accelerate_launch("configs/accelerate/zero3.yaml", 2), *args, "--output_dir", str(out)).stdout
    else:
        stdout, out = request.getfixturevalue("zero2_runs")[mode]
    stage = 3 if "zero3" in mode else 2
    # the ranks see no GPU, so --mixed_precision auto resolves as on a CPU
    assert f"2 process(es) on cpu (DeepSpeed ZeRO-{stage}, precision {child_auto_precision()})" in stdout
    losses = logged_losses(out)
    assert losses[-1] < 0.8 * losses[0], losses  # it learned
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3)
    saved = load_file(out / "model.safetensors")  # the gathered full model, not one rank's shard
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in reference.parameters())
    model, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]  # every weight came from the file
    torch.testing.assert_close(model.classifier.weight, saved["classifier.weight"], rtol=0, atol=0)
    assert model.config.id2label == {0: "finance", 1: "sports", 2: "weather"}


# evaluations and checkpoints every 2 steps; at this learning rate the loss soon fails to improve once
BEST_MODEL = ["--eval_strategy", "steps", "--eval_steps", "2", "--checkpointing_steps", "2", "--learning_rate", "0.05"]
BEST_MODEL += ["--early_stopping_patience", "1", "--load_best_model_at_end", "true", "--metric_for_best_model", "loss"]


@pytest.mark.slow
def test_zero2_stops_early_and_ends_with_the_best_checkpoint_s_model(zero2_runs):
    """Both processes stop at the same step and load the same checkpoint (run in zero2_runs' launch). The last
    step's evaluation was no better than the best (patience 1), so the best checkpoint's model is the run's."""
    stdout, out = zero2_runs["zero2-best"]
    stopped = int(stdout.split("note: early stopping after step ")[1].split()[0])
    chosen = int(stdout.split("best model: checkpoint-")[1].split("'")[0])
    assert chosen < stopped and f"trained {stopped} steps" in stdout
    state = json.loads((out / "checkpoints" / f"checkpoint-{chosen}" / "trainer_state.json").read_text())["state"]
    final = json.loads((out / "eval_results.json").read_text())
    assert final["loss"] == pytest.approx(state["evaluations"][-1]["loss"], rel=1e-4)  # that model, evaluated again
    assert json.loads((out / "train_results.json").read_text())["model_from_step"] == chosen


@pytest.mark.slow
def test_users_deepspeed_json_with_auto_values(zero2_runs):
    """A user's DeepSpeed JSON with "auto" values, filled from the options (run in zero2_runs' launch)."""
    stdout, out = zero2_runs["users-json"]
    assert "(DeepSpeed ZeRO-2, precision " in stdout
    assert "effective batch 16 (4 per device x 2 x 2 accumulation)" in stdout
    assert (out / "model.safetensors").exists()


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "train_micro_batch_size_per_gpu",
            8,
            "train_micro_batch_size_per_gpu = 8 but --per_device_train_batch_size gives 16",
        ),
        ("gradient_accumulation_steps", 4, "gradient_accumulation_steps = 4 but --gradient_accumulation_steps gives 1"),
        ("gradient_clipping", 0.5, "gradient_clipping = 0.5 but --max_grad_norm gives 1.0"),
        ("bf16", {"enabled": True}, "bf16.enabled = true but --mixed_precision gives false"),
        ("train_batch_size", 64, "train_batch_size = 64 but per-device batch x accumulation x processes gives 16"),
    ],
)
def test_conflicting_deepspeed_json_names_both_values(key, value, message, tmp_path):
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({**zero_config(2), key: value}))
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_distributed(build_config({"deepspeed_config": str(ds_json), "mixed_precision": "no"}))


def test_auto_values_are_filled_from_the_options():
    cfg = build_config(
        {
            "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 2,
            "mixed_precision": "bf16",
            "max_grad_norm": 0.5,
        }
    )
    filled = resolve_deepspeed_config("test", zero_config(3), cfg, world_size=4)
    assert (
        filled["train_micro_batch_size_per_gpu"],
        filled["gradient_accumulation_steps"],
        filled["train_batch_size"],
        filled["gradient_clipping"],
    ) == (8, 2, 64, 0.5)
    assert filled["bf16"]["enabled"] is True and filled["fp16"]["enabled"] is False
    assert filled["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.slow
def test_evaluation_counts_every_example_once(tiny_model_dir, tiny_t5_dir, tmp_path):
    """13 examples on 2 processes x batch 4: the gathered predictions are exactly the 13, metrics as 1 process; for
    a sequence classifier, a token classifier (rows of different lengths), a question-answering model (questions
    over several windows) and an encoder-decoder (beam-searched generations of different lengths, every process
    stepping together)."""
    from test_question_answering import squad_rows
    from test_seq2seq import headline_rows, headline_writer
    from test_token_classification import TAGS, tagged_rows, write_jsonl

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    saved = {
        "classifier": (ClassificationTask(), ["finance", "sports", "weather"]),
        "tagger": (TokenClassificationTask(), TAGS),
        "reader": (QuestionAnsweringTask(), []),
    }
    for name, (task, names) in saved.items():
        labels = ProcessedData(train=None, validation=None, test=None, collator=None, label_names=names)
        model = load_model(build_config({"model_name_or_path": tiny_model_dir}), task, labels, tokenizer)
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    pd.DataFrame(topic_rows(10)).to_csv(tmp_path / "train.csv", index=False)
    pd.DataFrame(topic_rows(5, offset=3)[:13]).to_csv(tmp_path / "val.csv", index=False)
    runs = [
        {"train_file": str(tmp_path / "train.csv"), "validation_file": str(tmp_path / "val.csv")},
        {
            "task": "token_classification",
            "train_file": write_jsonl(tmp_path / "train.jsonl", tagged_rows(20, 0)),
            "validation_file": write_jsonl(tmp_path / "val.jsonl", tagged_rows(13, 1)),
            "test_file": write_jsonl(tmp_path / "test.jsonl", [{"tokens": r["tokens"]} for r in tagged_rows(7, 2)]),
        },
        {  # contexts over several windows of 48 tokens: an example's windows may land on both processes
            "task": "question_answering",
            "train_file": write_jsonl(tmp_path / "qa.jsonl", squad_rows(20, 0)),
            "validation_file": write_jsonl(tmp_path / "qa-val.jsonl", squad_rows(13, 1, unanswerable=0.2)),
            "max_length": 48,
            "doc_stride": 16,
        },
        {
            "task": "seq2seq",
            "train_file": write_jsonl(tmp_path / "s2s.jsonl", headline_rows(20, 0)),
            "validation_file": write_jsonl(tmp_path / "s2s-val.jsonl", headline_rows(13, 1)),
            "test_file": write_jsonl(
                tmp_path / "s2s-test.jsonl", [{"document": r["document"]} for r in headline_rows(7, 2)]
            ),
            "max_target_length": 8,
            "generation_num_beams": 2,  # beam search, every process stepping together
        },
    ]
    models = [str(tmp_path / name) for name in saved] + [headline_writer(tiny_t5_dir, tmp_path)]
    results = []
    for n in (1, 2):
        options = tmp_path / f"options{n}.json"
        common = {"per_device_eval_batch_size": 4}
        options.write_text(
            json.dumps(
                [
                    {
                        **run,
                        **common,
                        "model_name_or_path": model,
                        "output_dir": str(tmp_path / f"run{i}-{n}"),
                    }
                    for i, (run, model) in enumerate(zip(runs, models, strict=True))
                ]
            )
        )
        launcher = torchrun(n) if n > 1 else ONE_PROCESS
        launch(launcher, str(REPO / "tests" / "dist_eval.py"), str(options), str(tmp_path / f"result{n}.json"))
        results.append(json.loads((tmp_path / f"result{n}.json").read_text()))
    (one, one_tags, one_answers, one_texts), (two, two_tags, two_answers, two_texts) = results
    assert (one["num_processes"], two["num_processes"]) == (1, 2)
    assert one["samples"] == two["samples"] == 13
    assert sum(map(sum, two["confusion_matrix"])) == 13
    assert two["confusion_matrix"] == one["confusion_matrix"]
    assert (two["accuracy"], two["macro_f1"]) == (one["accuracy"], one["macro_f1"])
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert one_tags["samples"] == two_tags["samples"] == 13
    for metric in ("f1", "precision", "recall", "accuracy", "entity_f1"):
        assert two_tags[metric] == one_tags[metric], metric
    assert two_tags["loss"] == pytest.approx(one_tags["loss"], rel=1e-5)
    tags, probabilities = two_tags["test"]  # an unlabelled split's predictions: each row's words, in order
    assert [sorted(map(int, row)) for row in tags] == [list(range(len(r["tokens"]))) for r in tagged_rows(7, 2)]
    assert tags == one_tags["test"][0]
    for mine, theirs in zip(probabilities, one_tags["test"][1], strict=True):
        assert mine == pytest.approx(theirs)
    assert one_answers["samples"] == two_answers["samples"] == 13  # questions, whatever their windows
    assert (two_answers["f1"], two_answers["exact_match"]) == (one_answers["f1"], one_answers["exact_match"])
    assert two_answers["loss"] == pytest.approx(one_answers["loss"], rel=1e-5)
    assert one_texts["samples"] == two_texts["samples"] == 13
    for metric in ("rougeL", "rouge1", "rouge2", "rougeLsum", "bleu", "generated_tokens"):
        assert two_texts[metric] == one_texts[metric], metric
    assert two_texts["loss"] == pytest.approx(one_texts["loss"], rel=1e-5)
    texts, lengths = two_texts["test"]
    assert len(texts) == 7 and two_texts["test"] == one_texts["test"]  # in the split's order
    assert len(set(texts)) > 1 and len({n for n, _ in lengths}) > 1 and any(ended for _, ended in lengths)


@pytest.mark.slow
def test_basic_trainer_under_a_multi_process_launcher_is_refused(tiny_model_dir, topic_csvs):
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [*torchrun(2), str(ENTRY), "--training_type", "basic", *data_args(topic_csvs, tiny_model_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert (
        errors
        == [
            "error: the BasicTrainer runs one process without DeepSpeed or FSDP; use --training_type "
            "accelerated for multi-process, DeepSpeed and FSDP runs"
        ]
        * 2
    )  # each process, no training


NEEDS_NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where there is no GPU")


@pytest.mark.parametrize(
    "options, env, message",
    [
        ({"fsdp": True}, {}, "FSDP needs a launcher"),
        ({}, {"ACCELERATE_USE_FSDP": "true"}, "FSDP needs a launcher"),
        ({"zero_stage": 2}, {"ACCELERATE_USE_CPU": "true"}, "ACCELERATE_USE_CPU=true makes accelerate drop DeepSpeed"),
        ({"offload_param": "cpu", "zero_stage": 2}, {}, "--offload_param needs --zero_stage 3"),
        ({"offload_optimizer": "cpu"}, {}, "need DeepSpeed"),
        ({"zero_stage": 2, "fsdp": True}, {}, "choose one"),
        pytest.param({"zero_stage": 2}, {}, "DeepSpeed on CPU needs a launcher", marks=NEEDS_NO_GPU),
        ({"mixed_precision": "no"}, {"ACCELERATE_MIXED_PRECISION": "bf16"}, "pass --mixed_precision bf16"),
    ],
)
def test_refusals_before_anything_loads(options, env, message, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=message):
        check_distributed(build_config(options))


def test_missing_deepspeed_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(UserError, match="pip install --no-build-isolation deepspeed==0.19.8"):
        check_distributed(build_config({"zero_stage": 2}))


def test_shipped_configs_are_valid():
    from accelerate.commands.config.config_args import load_config_from_file

    for stage in (1, 2, 3):
        assert json.loads((REPO / f"configs/deepspeed/zero{stage}.json").read_text()) == zero_config(stage)
    names = {p.stem for p in (REPO / "configs" / "accelerate").glob("*.yaml")}
    assert names == {
        "single_gpu",
        "multi_gpu",
        "zero1",
        "zero2",
        "zero3",
        "zero3_offload",
        "fsdp",
        "two_nodes",
        "cpu_multiprocess",
    }
    for name in names:
        config = load_config_from_file(str(REPO / "configs" / "accelerate" / f"{name}.yaml"))
        assert config.mixed_precision == "no"  # precision is the application's --mixed_precision
    fsdp = load_config_from_file(str(REPO / "configs/accelerate/fsdp.yaml"))
    assert fsdp.fsdp_config["fsdp_version"] == 2


def test_ddp_s_broadcast_buffers_warning_stays_off_every_process():
    """torch 2.13 warns on every process of a DDP run that broadcast_buffers is deprecated, a screen of text that
    reads like a problem (found in audit); accelerate passes that name, which every supported torch takes."""
    import inspect
    import warnings

    import cloudtrain.parallel.distributed  # noqa: F401  (installs the filter)

    said = "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead."
    source = inspect.getsource(torch.nn.parallel.DistributedDataParallel.__init__)
    assert "broadcast_buffers" in source  # the option this run passes still exists
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(said, FutureWarning, stacklevel=1)
    assert caught == []
