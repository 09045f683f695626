"""DeepSpeed specifics on 2 CPU processes: what zero.Init's partitioned parameters must not break."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, child_pythonpath
from safetensors.torch import load_file
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

pytestmark = pytest.mark.slow


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("ACCELERATE_USE_CPU", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
    launch = subprocess.Popen(
        [*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env
    )
    try:
        stdout, stderr = launch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launch.kill()  # with the ranks and a compiler they started (conftest._kill_tree)
        stdout, stderr = launch.communicate()  # where it stood when it was stopped
        tail = stdout[-3000:], stderr[-3000:]
        raise AssertionError(f"no end after {timeout} s; the launch's last output: {tail}") from None
    assert launch.returncode == 0, (stdout[-2000:], stderr[-4000:])
    return subprocess.CompletedProcess(launch.args, launch.returncode, stdout, stderr)


def test_zero3_groups_weight_decay_by_real_shape_and_replaces_a_head(tiny_model_dir, topic_csvs, tmp_path):
    """Under zero.Init every parameter has shape [0]: weight decay must still reach the matrices, and a
    checkpoint's 2-label head must be replaced by a fresh 3-label one, gathered intact at the end."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(7)
    checkpoint = tmp_path / "sentiment"
    BertForSequenceClassification(
        BertConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            id2label={0: "negative", 1: "positive"},
            label2id={"negative": 0, "positive": 1},
        )
    ).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    options = tmp_path / "options.json"
    options.write_text(
        json.dumps(
            {
                "model_name_or_path": str(checkpoint),
                "train_file": str(topic_csvs["train"]),
                "validation_file": str(topic_csvs["validation"]),
                "weight_decay": 0.1,
            }
        )
    )
    result = torchrun(str(REPO / "tests" / "dist_zero3.py"), str(options), str(tmp_path))
    assert result.stdout.count("replacing the 2-label head of") == 1

    decay, no_decay = json.loads((tmp_path / "result.json").read_text())["groups"]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["shapes"] and all(len(shape) == 2 for shape in decay["shapes"])
    assert no_decay["shapes"] and all(len(shape) == 1 for shape in no_decay["shapes"])
    assert decay["local_numel"] == 0  # the parameters really were partitioned when the groups were built

    saved, gathered = load_file(checkpoint / "model.safetensors"), load_file(tmp_path / "gathered.safetensors")
    assert gathered["classifier.weight"].shape == (3, 32)
    assert gathered["classifier.weight"].std() > 0 and torch.all(gathered["classifier.bias"] == 0)
    body = [name for name in saved if not name.startswith("classifier")]
    assert all(torch.equal(saved[name], gathered[name]) for name in body if name in gathered)
    # saved under the checkpoint's own names: transformers' ZeRO-3 load recorded BERT's legacy renaming and the
    # save reverted it, writing every LayerNorm as gamma/beta (found in audit)
    assert set(load_file(tmp_path / "saved" / "model.safetensors")) == set(saved)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_zero2_skips_a_nan_step_on_every_rank_and_counts_it(precision, tiny_model_dir, topic_csvs, tmp_path):
    """A nan loss on rank 0 at step 3: DeepSpeed (which steps inside backward) skips it on both ranks,
    the run counts it once, and training goes on with finite weights."""
    out = tmp_path / "out"
    options = tmp_path / "options.json"
    options.write_text(
        json.dumps(
            {
                "model_name_or_path": tiny_model_dir,
                "train_file": str(topic_csvs["train"]),
                "validation_file": str(topic_csvs["validation"]),
                "output_dir": str(out),
                "zero_stage": 2,
                "mixed_precision": precision,
                "nonfinite_loss": "skip",
                "max_steps": 6,
                "logging_steps": 2,
                "per_device_train_batch_size": 4,
                "eval_strategy": "no",
                "learning_rate": 1e-3,
            }
        )
    )
    torchrun(str(REPO / "tests" / "dist_nonfinite.py"), str(options), "3")
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(e["step"], e["train/skipped_steps"]) for e in logged if "train/skipped_steps" in e] == [(4, 1)]
    losses = [e["train/loss"] for e in logged if "train/loss" in e]
    assert len(losses) == 3 and all(loss == loss for loss in losses)  # no nan reached the logged loss
    saved = load_file(out / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in saved.values())
    # under bf16 the module DeepSpeed holds is 16-bit: the saved model is the optimizer's fp32 weights, as every
    # other launch saves (it was the bf16 copy: found in audit)
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert any((t != t.to(torch.bfloat16).float()).any() for t in saved.values())  # not bf16 values in fp32


def test_users_json_trains_with_its_own_optimizer_and_schedule(tiny_model_dir, topic_csvs, tmp_path):
    """A DeepSpeed JSON as users write it (AdamW, WarmupDecayLR, fp16 with dynamic loss scaling, batch numbers
    "auto"): DeepSpeed builds its optimizer and schedule under ZeRO-2 on 2 processes; the logged learning
    rate of each step is the file's schedule, and the optimizer state saved is the file's AdamW."""
    warmup, total, peak = 3, 8, 1e-3
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(
        json.dumps(
            {
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                # torch_adam: DeepSpeed's AdamW as torch's, not its FusedAdam (a C++ build of minutes on CPU)
                "optimizer": {
                    "type": "AdamW",
                    "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.98], "torch_adam": True},
                },
                "scheduler": {
                    "type": "WarmupDecayLR",
                    "params": {
                        "warmup_min_lr": "auto",
                        "warmup_max_lr": "auto",
                        "warmup_num_steps": warmup,
                        "total_num_steps": total,
                        "warmup_type": "linear",
                    },
                },
                "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
                "zero_optimization": {"stage": 2},
            }
        )
    )
    out = tmp_path / "out"
    options = [
        "--model_name_or_path", tiny_model_dir, "--train_file", str(topic_csvs["train"]),
        "--validation_file", str(topic_csvs["validation"]), "--output_dir", str(out),
        "--deepspeed_config", str(ds_json), "--max_steps", str(total), "--logging_steps", "1",
        "--per_device_train_batch_size", "4", "--eval_strategy", "no", "--learning_rate", str(peak),
        "--mixed_precision", "no", "--checkpointing_steps", str(total),
    ]  # fmt: skip
    result = torchrun(str(REPO / "src" / "training_application.py"), *options)
    assert "(DeepSpeed ZeRO-2, precision no)" in result.stdout

    def file_schedule(i: int) -> float:  # WarmupDecayLR, linear warmup, at the engine's iteration i
        return peak * i / warmup if i < warmup else peak * (total - i) / (total - warmup)

    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = {e["step"]: e["train/learning_rate"] for e in logged if "train/learning_rate" in e}
    # the engine steps its schedule after each optimizer step: step k is taken at iteration k - 2's rate (step 1 at
    # the rate before the schedule started, 0), and logs it (it logged the next step's; found in review)
    assert rates == pytest.approx({k: file_schedule(k - 2) if k > 1 else 0.0 for k in range(1, total + 1)})

    states = list(out.glob("checkpoints/*/pytorch_model/*optim_states.pt"))
    assert states, sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    saved = torch.load(states[0], weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
    assert [g["betas"] for g in saved["param_groups"]] == [(0.9, 0.98)] * 2  # the file's, not torch's default
    assert [g["weight_decay"] for g in saved["param_groups"]] == [0.01, 0.0]  # "auto" from the options; 1-d: 0


def aio_builds() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


@pytest.mark.slow
@pytest.mark.alone  # twice out of time beside the other worker: it compiled the async I/O op (docs/testing.md)
def test_zero_infinity_offloads_to_nvme_where_async_io_builds_else_refuses_in_one_line(
    tiny_model_dir, topic_csvs, tmp_path
):
    """ZeRO-3 with parameters and optimizer states swapped to files under --nvme_path (ZeRO-Infinity) trains on
    2 processes and saves the full model; where DeepSpeed's async I/O cannot be built (no libaio) the same
    command is refused before anything loads, naming the library."""
    swap, out = tmp_path / "nvme", tmp_path / "out"
    swap.mkdir()
    options = [
        "--model_name_or_path", tiny_model_dir, "--train_file", str(topic_csvs["train"]),
        "--output_dir", str(out), "--max_steps", "4", "--per_device_train_batch_size", "4",
        "--eval_strategy", "no", "--mixed_precision", "no", "--zero_stage", "3",
        "--offload_param", "nvme", "--offload_optimizer", "nvme", "--nvme_path", str(swap),
    ]  # fmt: skip
    if not aio_builds():
        from cloudtrain.cli import main

        assert main(options) == 2 and not out.exists()
        return
    result = torchrun(str(REPO / "src" / "training_application.py"), *options)
    assert "(DeepSpeed ZeRO-3, precision no)" in result.stdout
    assert any(p.suffix == ".swp" for p in swap.rglob("*")), sorted(swap.rglob("*"))  # the states went to disk
    saved = load_file(out / "model.safetensors")
    reference = BertForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3)
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in reference.parameters())


def test_nvme_offload_options_are_checked_in_one_line():
    from cloudtrain.config import build_config, validate
    from cloudtrain.errors import UserError

    for options, message in (
        ({"zero_stage": 3, "offload_param": "nvme"}, "needs --nvme_path"),
        ({"zero_stage": 2, "offload_optimizer": "nvme", "nvme_path": "/tmp"}, "needs --zero_stage 3"),
        ({"nvme_path": "/tmp"}, "is used only with --offload_optimizer nvme"),
    ):
        with pytest.raises(UserError, match=message):
            validate(build_config(options))


def test_a_lock_left_by_a_killed_op_build_is_removed_unless_a_build_is_running(tmp_path, monkeypatch, capsys):
    """torch waits forever on an op build's lock; one a killed build left (old, no compiler running) goes."""
    from cloudtrain.parallel.distributed import clear_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    old, fresh = tmp_path / "extensions" / "async_io" / "lock", tmp_path / "extensions" / "cpu_adam" / "lock"
    for lock in (old, fresh):
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
    os.utime(old, (time.time() - 600, time.time() - 600))
    ninja = tmp_path / "bin" / "ninja"  # a process named ninja in the op's folder: a build under way
    ninja.parent.mkdir()
    ninja.symlink_to(shutil.which("sleep"))
    building = subprocess.Popen([str(ninja), "30"], cwd=old.parent)
    try:
        time.sleep(0.2)
        clear_stale_build_locks()
        assert old.exists() and fresh.exists()  # the build may hold it
    finally:
        building.kill()
        building.wait()
    clear_stale_build_locks()
    assert not old.exists() and fresh.exists()  # a minute old at least, before it counts as stale
    assert f"removed {old}, left by an op build that was killed" in capsys.readouterr().out


def test_a_cached_async_io_op_counts_as_built_only_when_built_from_this_install(tmp_path, monkeypatch):
    """torch's extension cache is shared between checkouts: an async_io.so whose build.ninja names another
    install's DeepSpeed sources would be compiled again by the run, so the "compiled ahead" check says no."""
    import deepspeed

    from cloudtrain.parallel.distributed import aio_built

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory("async_io", verbose=False))
    assert not aio_built()
    (folder / "async_io.so").write_bytes(b"")
    (folder / "build.ninja").write_text("build aio.o: compile /elsewhere/site-packages/deepspeed/ops/csrc/aio.cpp\n")
    assert not aio_built()
    ours = Path(deepspeed.__file__).parent / "ops" / "csrc" / "aio.cpp"
    (folder / "build.ninja").write_text(f"build aio.o: compile {ours}\n")
    assert aio_built()
