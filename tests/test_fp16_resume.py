"""fp16 resume: a run resumed from a mid-run checkpoint continues exactly as the run never stopped, its
GradScaler included (scale and growth tracker), in both trainers.

The application refuses fp16 without CUDA (cloudtrain.pipeline), but the BasicTrainer's fp16 path (fp16
autocast, a GradScaler, fused AdamW reading the scaler's found_inf) runs on CPU in recent torch: the CPU
test builds that trainer directly. accelerate keeps no GradScaler on CPU, so the AcceleratedTrainer's
fp16 resume is checked on a GPU only, as a user runs it.
"""

import json
import math

import pytest
import torch
from conftest import run_cli, topic_rows
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer

from cloudtrain.checkpointing import Checkpointer
from cloudtrain.config import DataConfig, build_config
from cloudtrain.data.processing import process_data
from cloudtrain.models.load import load_model
from cloudtrain.observe.tracking import RunLog
from cloudtrain.parallel.runtime import Runtime
from cloudtrain.tasks.classification import ClassificationTask
from cloudtrain.training import BasicTrainer, Hook, LoopState

STEPS, SAVED_AT = 8, 4  # 5 steps per epoch: the resumed run starts mid-epoch and crosses into the next


class Recorder(Hook):
    """Each step's mean loss and the scaler's state after it (host reads: this is a test)."""

    def __init__(self, trainer: BasicTrainer):
        self.trainer, self.losses, self.scales = trainer, {}, {}

    def on_step_end(self, loop: LoopState) -> None:
        assert loop.stats is not None
        self.losses[loop.step] = float(loop.stats.loss_sum / loop.stats.count)
        self.scales[loop.step] = self.trainer.scaler.state_dict()


def fp16_trainer(tiny_model_dir, out, device: str) -> tuple[BasicTrainer, Recorder]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw = DatasetDict({"train": Dataset.from_list(topic_rows(10)), "validation": Dataset.from_list(topic_rows(2))})
    data = process_data(raw, tokenizer, DataConfig(), seed=0)
    cfg = build_config(
        {
            "model_name_or_path": tiny_model_dir,
            "mixed_precision": "fp16",
            "max_steps": STEPS,
            "per_device_train_batch_size": 2,
            "learning_rate": 1e-2,
            "logging_steps": 3,
            "eval_strategy": "no",
            "checkpointing_steps": SAVED_AT,
        }
    )
    torch.manual_seed(0)
    model = load_model(build_config({"model_name_or_path": tiny_model_dir}), ClassificationTask(), data, tokenizer)
    trainer = BasicTrainer(cfg, ClassificationTask(), model, data, RunLog(cfg, out, True, run_info={}), Runtime())
    assert trainer.runtime.device.type == device
    recorder, real = Recorder(trainer), trainer.hooks
    trainer.hooks = lambda *args: [*real(*args), recorder]  # type: ignore[method-assign]
    return trainer, recorder


def check_fp16_resume_is_exact(tiny_model_dir, tmp_path, device: str) -> None:
    whole, seen = fp16_trainer(tiny_model_dir, tmp_path / "whole", device)
    whole.fit(Checkpointer(whole.cfg, tmp_path / "whole" / "checkpoints", tmp_path / "whole", True, lambda: None))
    checkpoint = tmp_path / "whole" / "checkpoints" / f"checkpoint-{SAVED_AT}"
    saved = torch.load(checkpoint / "training_state.pt", weights_only=True)["scaler"]
    assert saved == seen.scales[SAVED_AT]  # the checkpoint holds the scaler as it was after that step
    assert 0 < saved["scale"] < math.inf and saved["_growth_tracker"] == SAVED_AT  # no overflow: it counts on

    resumed, after = fp16_trainer(tiny_model_dir, tmp_path / "resumed", device)
    resumed.fit(
        Checkpointer(resumed.cfg, tmp_path / "resumed" / "checkpoints", tmp_path / "resumed", True, lambda: None),
        resume_from=checkpoint,
    )
    assert sorted(after.losses) == list(range(SAVED_AT + 1, STEPS + 1))
    assert all(map(math.isfinite, after.losses.values())), after.losses
    # bit-for-bit: the same weights, optimizer moments, RNG (dropout) and scale as the run never stopped
    assert after.losses == {step: seen.losses[step] for step in after.losses}
    assert after.scales == {step: seen.scales[step] for step in after.scales}
    for name, value in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


def test_fp16_resume_continues_exactly_on_cpu(tiny_model_dir, tmp_path):
    if not hasattr(torch.amp, "GradScaler"):
        pytest.fail("this torch has no device-generic GradScaler (torch.amp.GradScaler)")
    check_fp16_resume_is_exact(tiny_model_dir, tmp_path, "cpu")


@pytest.mark.gpu
def test_fp16_resume_continues_exactly_on_cuda(tiny_model_dir, tmp_path):
    check_fp16_resume_is_exact(tiny_model_dir, tmp_path, "cuda")


def cli_args(tiny_model_dir, topic_csvs, out, training_type: str, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", tiny_model_dir, "--train_file", str(topic_csvs["train"]),
        "--validation_file", str(topic_csvs["validation"]), "--output_dir", str(out),
        "--training_type", training_type, "--mixed_precision", "fp16", "--per_device_train_batch_size", "8",
        "--max_steps", "12", "--learning_rate", "1e-2", "--warmup_ratio", "0", "--logging_steps", "1",
        "--checkpointing_steps", "6", "--eval_strategy", "no", "--report_to", "none", *extra,
    ]  # fmt: skip


def logged_losses(out) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def scaler_state(checkpoint, training_type: str) -> dict:
    if training_type == "basic":
        return torch.load(checkpoint / "training_state.pt", weights_only=True)["scaler"]
    return torch.load(checkpoint / "scaler.pt", weights_only=True)


@pytest.mark.gpu
@pytest.mark.parametrize("training_type", ["basic", "accelerated"])
def test_fp16_cli_resume_equals_the_run_never_stopped(training_type, tiny_model_dir, topic_csvs, tmp_path):
    """As a user runs it: the resumed run logs the same losses as the whole one, and its final checkpoint
    holds the same GradScaler state (accelerate writes its own scaler.pt)."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    result = run_cli(*cli_args(tiny_model_dir, topic_csvs, whole, training_type))
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = whole / "checkpoints" / "checkpoint-6"
    result = run_cli(
        *cli_args(tiny_model_dir, topic_csvs, resumed, training_type, "--resume_from_checkpoint", str(checkpoint))
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "at step 6" in result.stdout
    expected = {step: loss for step, loss in logged_losses(whole).items() if step > 6}
    continued = {step: loss for step, loss in logged_losses(resumed).items() if step > 6}  # the log is carried on
    assert continued == expected and len(expected) == 6
    final = "checkpoints/checkpoint-12"
    assert scaler_state(resumed / final, training_type) == scaler_state(whole / final, training_type)
    assert 0 < scaler_state(whole / final, training_type)["scale"] < math.inf
