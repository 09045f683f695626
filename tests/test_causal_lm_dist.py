"""--task causal_lm under real launches: 2-process DDP against 1 process, exact resume with 2 processes,
ZeRO-3 with gradient checkpointing, a Hub push with a text-generation card, and a SageMaker-style job."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import test_hub
import torch
from conftest import ENTRY, REPO, built_once, child_pythonpath, lm_documents
from safetensors.torch import load_file
from test_distributed import ONE_PROCESS, in_one_launch, launch, logged_losses, torchrun
from test_hub import TOKEN, hub_env, run_app

hub = test_hub.hub  # the local Hub server fixture, taken by name

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-corpus")
    for split, n, seed in (("train", 48, 0), ("validation", 8, 1)):
        (folder / f"{split}.txt").write_text("\n".join(lm_documents(n, seed)) + "\n")
    return folder


def lm_args(model_dir, corpus, out, *extra: str) -> list[str]:
    return [
        str(ENTRY),
        "--task",
        "causal_lm",
        "--model_name_or_path",
        model_dir,
        "--train_file",
        str(corpus / "train.txt"),
        "--validation_file",
        str(corpus / "validation.txt"),
        "--output_dir",
        str(out),
        "--max_length",
        "48",
        "--learning_rate",
        "3e-3",
        "--logging_steps",
        "1",
        "--mixed_precision",
        "no",
        "--sample_max_new_tokens",
        "4",
        "--eval_strategy",
        "no",
        *extra,
    ]


DDP = ["--packing", "none", "--max_steps", "6", "--checkpointing_steps", "4"]  # the DDP test's runs' options


def test_ddp_two_processes_match_one_process_with_twice_the_batch_and_resume_exactly(
    tiny_llama_dir, corpus, two_process_runs, tmp_path
):
    """Unpadded rows of uneven token counts: the loss is normalised by the global token count, so 2 processes
    x 4 rows give the update of 1 process x 8 rows. Then the 2-process run (two_process_runs's "two", copied
    here: the resume rewrites its folder), resumed from its mid-epoch checkpoint, ends with the same weights and
    losses."""
    shutil.copytree(two_process_runs / "two", tmp_path / "two")
    two = (two_process_runs / "two.out").read_text()
    launch(ONE_PROCESS, *lm_args(tiny_llama_dir, corpus, tmp_path / "one", *DDP, "--per_device_train_batch_size", "8"))
    assert "2 process(es) on cpu" in two and two.count("trained 6 steps") == 1
    a, b = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-5)
    assert logged_losses(tmp_path / "two") == pytest.approx(logged_losses(tmp_path / "one"), rel=1e-4)
    assert grad_norms(tmp_path / "two") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4)

    losses = logged_losses(tmp_path / "two")
    checkpoint = tmp_path / "two" / "checkpoints" / "checkpoint-4"
    resumed = launch(
        torchrun(2),
        *lm_args(
            tiny_llama_dir,
            corpus,
            tmp_path / "two",
            *DDP,
            "--per_device_train_batch_size",
            "4",
            "--overwrite_output_dir",
            "true",
            "--resume_from_checkpoint",
            str(checkpoint),
        ),
    )
    assert "at step 4" in resumed.stdout
    again = load_file(tmp_path / "two" / "model.safetensors")
    assert all(torch.equal(a[name], again[name]) for name in a)
    assert logged_losses(tmp_path / "two") == pytest.approx(losses, rel=1e-12)


def grad_norms(out) -> list[float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [e["train/grad_norm"] for e in lines if "train/grad_norm" in e]


ZERO_STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def two_process_runs(tiny_llama_dir, corpus, tmp_path_factory) -> Path:
    """The module's uninterrupted 2-process runs one after another in one launch (a launch's start, DeepSpeed
    imported in both processes, costs more than these few-step runs), built once for both of `make test`'s
    workers: the DDP test's "two" first (4 rows, 6 steps, a checkpoint at step 4), then the three ZeRO stages'
    zero<stage>. Each run's output folder and its stdout <name>.out."""

    def build(root: Path) -> None:
        runs = {"two": lm_args(tiny_llama_dir, corpus, root / "two", *DDP, "--per_device_train_batch_size", "4")}
        for stage in ZERO_STAGES:
            extra = ["--gradient_checkpointing", "true", "--packing", "bfd"] if stage == 3 else ["--packing", "wrapped"]
            zero = ["--zero_stage", str(stage), "--max_steps", "2", "--per_device_train_batch_size", "2", *extra]
            runs[f"zero{stage}"] = lm_args(tiny_llama_dir, corpus, root / f"zero{stage}", *zero)
        for name, stdout in in_one_launch(torchrun(2), runs, root).items():
            (root / f"{name}.out").write_text(stdout)

    return built_once(tmp_path_factory, "causal-lm-two-process-runs", build)


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_zero_stages_train_and_save_the_full_model(stage, tiny_llama_dir, two_process_runs):
    """ZeRO-1/2/3 on 2 processes; ZeRO-3 with gradient checkpointing and bfd packing (its isolation probe is
    skipped there, said in one line). The three runs share one launch (two_process_runs)."""
    out = two_process_runs / f"zero{stage}"
    stdout = (two_process_runs / f"zero{stage}.out").read_text()
    assert f"ZeRO-{stage}" in stdout and "perplexity" in stdout
    assert stdout.count("not probed under ZeRO-3") == (stage == 3)
    saved, initial = load_file(out / "model.safetensors"), load_file(f"{tiny_llama_dir}/model.safetensors")
    assert set(saved) == set(initial) and all(saved[k].shape == initial[k].shape for k in saved)
    assert any(not torch.equal(saved[k], initial[k]) for k in saved)  # it trained


def test_sagemaker_job_trains_a_language_model_from_its_channels(tiny_llama_dir, corpus, tmp_path):
    """The SageMaker contract with a text channel: data and model from SM_CHANNEL_*, the model in SM_MODEL_DIR."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "opt-ml" / "model"
    env = {
        **os.environ,
        "SM_MODEL_DIR": str(model_dir),
        "SM_CHANNEL_TRAIN": str(corpus),
        "SM_CHANNEL_MODEL": tiny_llama_dir,
        "PYTHONPATH": child_pythonpath(),
        "CUDA_VISIBLE_DEVICES": "",
    }
    (corpus / "validation.txt").rename(tmp_path / "validation.txt")  # the train channel holds one split
    try:
        result = subprocess.run(
            [
                sys.executable,
                str(ENTRY),
                "--task",
                "causal_lm",
                "--max_steps",
                "2",
                "--max_length",
                "32",
                "--sample_max_new_tokens",
                "2",
                "--mixed_precision",
                "no",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
            env=env,
        )
    finally:
        (tmp_path / "validation.txt").rename(corpus / "validation.txt")
    assert result.returncode == 0, result.stderr[-3000:]
    assert AutoModelForCausalLM.from_pretrained(model_dir).config.architectures == ["LlamaForCausalLM"]
    assert json.loads((model_dir / "args.json").read_text())["train_file"] == str(corpus)


def test_a_pushed_language_model_gets_a_text_generation_card(hub, tiny_llama_dir, corpus, tmp_path):
    from huggingface_hub import ModelCard

    out = tmp_path / "pushed"
    args = lm_args(
        tiny_llama_dir,
        corpus,
        out,
        "--max_steps",
        "2",
        "--push_to_hub",
        "true",
        "--hub_model_id",
        "alice/tales",
        "--hub_token",
        TOKEN,
    )
    result = run_app(hub_env(hub, tmp_path / "no-stored-token"), *args[1:])
    assert result.returncode == 0, result.stderr[-3000:]
    upload = hub.history("alice/tales")[-1]
    assert "eval perplexity" in upload.summary
    card = ModelCard(upload.added["README.md"].decode())
    assert card.data.pipeline_tag == "text-generation"
    perplexity = json.loads((out / "eval_results.json").read_text())["perplexity"]
    on_card = {r.metric_type: r.metric_value for r in card.data.eval_results if r.dataset_split == "validation"}
    assert on_card["perplexity"] == round(perplexity, 4)
