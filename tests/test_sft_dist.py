"""--task sft under real launches: 2-process DDP against 1 process and exact resume, ZeRO-3 (the chat
template's tokens grow partitioned embeddings), a SageMaker-style job and a Hub push with a chat card."""

import json
import os
import random
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
def chats(tmp_path_factory):
    """train.jsonl / validation.jsonl: conversations of one or two exchanges, answers of uneven length."""
    folder = tmp_path_factory.mktemp("sft-chats")
    rng = random.Random(0)
    for split, n in (("train", 32), ("validation", 6)):
        rows = []
        for i, answer in enumerate(lm_documents(n, seed=len(split))):
            turns = [{"role": "user", "content": f"Tell me tale {i}."}, {"role": "assistant", "content": answer}]
            if rng.random() < 0.3:
                turns += [{"role": "user", "content": "Shorter?"}, {"role": "assistant", "content": answer[:20]}]
            rows.append({"messages": turns})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def sft_args(model_dir, chats, out, *extra: str) -> list[str]:
    return [
        str(ENTRY),
        "--task",
        "sft",
        "--model_name_or_path",
        model_dir,
        "--train_file",
        str(chats / "train.jsonl"),
        "--validation_file",
        str(chats / "validation.jsonl"),
        "--output_dir",
        str(out),
        "--max_length",
        "128",
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


DDP = ["--max_steps", "5", "--checkpointing_steps", "3"]  # the DDP test's runs' options


@pytest.fixture(scope="module")
def two_process_runs(tiny_llama_dir, chats, tmp_path_factory):
    """The module's uninterrupted 2-process runs one after another in one launch (a launch's start, DeepSpeed
    imported in both processes, costs more than these few-step runs), built once for both of `make test`'s
    workers: the DDP test's "two" first (4 examples, 5 steps, a checkpoint at step 3), then "zero3" (2 steps, bfd
    packing). Each run's output folder and its stdout <name>.out."""

    def build(root: Path) -> None:
        zero3 = ["--zero_stage", "3", "--max_steps", "2", "--per_device_train_batch_size", "2", "--packing", "bfd"]
        runs = {
            "two": sft_args(tiny_llama_dir, chats, root / "two", *DDP, "--per_device_train_batch_size", "4"),
            "zero3": sft_args(tiny_llama_dir, chats, root / "zero3", *zero3),
        }
        for name, stdout in in_one_launch(torchrun(2), runs, root).items():
            (root / f"{name}.out").write_text(stdout)

    return built_once(tmp_path_factory, "sft-two-process-runs", build)


def test_ddp_two_processes_match_one_process_and_resume_exactly(tiny_llama_dir, chats, two_process_runs, tmp_path):
    """Examples with uneven answer-token counts: the loss is normalised by the global count of answer tokens,
    so 2 processes x 4 examples give the update of 1 process x 8. The 2-process run (two_process_runs's "two",
    copied here: the resume rewrites its folder), resumed from its mid-epoch checkpoint, ends with the same
    weights and losses."""
    shutil.copytree(two_process_runs / "two", tmp_path / "two")
    two = (two_process_runs / "two.out").read_text()
    launch(ONE_PROCESS, *sft_args(tiny_llama_dir, chats, tmp_path / "one", *DDP, "--per_device_train_batch_size", "8"))
    assert "2 process(es) on cpu" in two and two.count("grew the embeddings") == 1
    a, b = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-5)
    losses = logged_losses(tmp_path / "two")
    assert losses == pytest.approx(logged_losses(tmp_path / "one"), rel=1e-4)

    checkpoint = tmp_path / "two" / "checkpoints" / "checkpoint-3"
    resumed = launch(
        torchrun(2),
        *sft_args(
            tiny_llama_dir,
            chats,
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
    assert "at step 3" in resumed.stdout
    again = load_file(tmp_path / "two" / "model.safetensors")
    assert all(torch.equal(a[name], again[name]) for name in a)
    assert logged_losses(tmp_path / "two") == pytest.approx(losses, rel=1e-12)


def test_zero3_grows_the_partitioned_embeddings_and_saves_the_full_model(tiny_llama_dir, two_process_runs):
    """ZeRO-3 on 2 processes (two_process_runs's "zero3"): the chat template's tokens grow the partitioned
    embeddings, and the full model is saved."""
    out = two_process_runs / "zero3"
    stdout = (two_process_runs / "zero3.out").read_text()
    assert "ZeRO-3" in stdout and "exact_match" in stdout
    saved, initial = load_file(out / "model.safetensors"), load_file(f"{tiny_llama_dir}/model.safetensors")
    grown = saved["model.embed_tokens.weight"]
    assert grown.shape[0] % 64 == 0 and grown.shape[0] > initial["model.embed_tokens.weight"].shape[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id


def test_sagemaker_job_fine_tunes_from_its_channels(tiny_llama_dir, chats, tmp_path):
    """The SageMaker contract: the chats in SM_CHANNEL_TRAIN, the base model in SM_CHANNEL_MODEL, the chat
    model (its template with it) in SM_MODEL_DIR."""
    from transformers import AutoTokenizer

    channel = tmp_path / "train-channel"
    channel.mkdir()
    (channel / "train.jsonl").write_text((chats / "train.jsonl").read_text())
    model_dir = tmp_path / "opt-ml" / "model"
    env = {
        **os.environ,
        "SM_MODEL_DIR": str(model_dir),
        "SM_CHANNEL_TRAIN": str(channel),
        "SM_CHANNEL_MODEL": tiny_llama_dir,
        "PYTHONPATH": child_pythonpath(),
        "CUDA_VISIBLE_DEVICES": "",
    }
    result = subprocess.run(
        [
            sys.executable,
            str(ENTRY),
            "--task",
            "sft",
            "--max_steps",
            "2",
            "--max_length",
            "128",
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
    assert result.returncode == 0, result.stderr[-3000:]
    assert AutoTokenizer.from_pretrained(model_dir).chat_template  # saved with the model
    assert (model_dir / "chat_template.jinja").is_file()


def test_a_pushed_chat_model_gets_a_card_with_chat_usage(hub, tiny_llama_dir, chats, tmp_path):
    from huggingface_hub import ModelCard

    args = sft_args(
        tiny_llama_dir,
        chats,
        tmp_path / "pushed",
        "--max_steps",
        "2",
        "--push_to_hub",
        "true",
        "--hub_model_id",
        "alice/chat",
        "--hub_token",
        TOKEN,
    )
    result = run_app(hub_env(hub, tmp_path / "no-stored-token"), *args[1:])
    assert result.returncode == 0, result.stderr[-3000:]
    upload = hub.history("alice/chat")[-1]
    assert "chat_template.jinja" in upload.added and "generation_config.json" in upload.added
    card = ModelCard(upload.added["README.md"].decode())
    assert card.data.pipeline_tag == "text-generation" and "apply_chat_template" in card.text
    assert "### Sample answers" in card.text
