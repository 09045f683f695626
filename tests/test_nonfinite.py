"""Non-finite losses and the training step's host syncs: a nan/inf step is skipped on the device, counted
or stopped on at the next sync point, and no step waits on the host."""

import sys
from pathlib import Path

import pytest
import torch
from test_training import tiny_setup

import cloudtrain
from cloudtrain.config import build_config
from cloudtrain.errors import TrainingStopped, UserError
from cloudtrain.observe.tracking import read_metrics
from cloudtrain.parallel.distributed import check_distributed
from cloudtrain.tasks.classification import ClassificationTask
from cloudtrain.training import AcceleratedTrainer, BasicTrainer

SRC = str(Path(cloudtrain.__file__).parent)
READS = ("__bool__", "item", "tolist", "__float__", "__int__", "cpu", "numpy")


def nan_at(monkeypatch, trainer_cls, *steps: int) -> None:
    """The loss of training steps `steps` (1-based; one micro-batch per step) becomes nan."""
    real, calls = ClassificationTask.loss, []

    def loss(self, model, batch):
        calls.append(1)
        summed, count = real(self, model, batch)
        return (summed * float("nan") if len(calls) in steps else summed), count

    monkeypatch.setattr(ClassificationTask, "loss", loss)


@pytest.mark.parametrize("trainer_cls", [BasicTrainer, AcceleratedTrainer])
def test_a_nan_step_is_skipped_and_counted(trainer_cls, tiny_model_dir, tmp_path, monkeypatch, capsys):
    trainer = tiny_setup(
        tiny_model_dir,
        tmp_path,
        trainer_cls,
        max_steps=6,
        per_device_train_batch_size=4,
        logging_steps=3,
        eval_strategy="no",
        nonfinite_loss="skip",
    )
    nan_at(monkeypatch, trainer_cls, 2)
    result = trainer.fit()
    assert result.global_step == 6
    assert result.summary()["skipped_steps"] == 1  # in train_results.json, and said (it was neither: audit)
    said = capsys.readouterr()
    assert (
        "warning: skipped 1 step(s) with a non-finite loss or gradients since the last sync, the first at step 2"
        in said.out + said.err
    )
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert {int(state["step"]) for state in optimizer.state.values()} == {5}  # AdamW applied 5 of 6 steps
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    logged = read_metrics(tmp_path / "metrics.jsonl")
    assert [(e["step"], e["train/skipped_steps"]) for e in logged if "train/skipped_steps" in e] == [(3, 1)]
    assert all(e["train/loss"] == e["train/loss"] for e in logged if "train/loss" in e)  # no nan logged


def test_an_interval_of_skipped_steps_logs_no_loss_not_zero(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Every step between two logging steps skipped: its loss is unknown, and a 0 drew a fall to 0 on every curve."""
    trainer = tiny_setup(
        tiny_model_dir, tmp_path, BasicTrainer, max_steps=6, per_device_train_batch_size=4, logging_steps=2,
        eval_strategy="no", nonfinite_loss="skip",
    )  # fmt: skip
    nan_at(monkeypatch, BasicTrainer, 3, 4)
    trainer.fit()
    logged = {e["step"]: e for e in read_metrics(tmp_path / "metrics.jsonl") if "train/learning_rate" in e}
    assert sorted(logged) == [2, 4, 6] and "train/loss" not in logged[4]
    assert all(logged[step]["train/loss"] > 0 for step in (2, 6))
    said = capsys.readouterr()
    assert "| loss - (every step skipped) |" in said.out + said.err


@pytest.mark.parametrize("trainer_cls", [BasicTrainer, AcceleratedTrainer])
def test_stop_names_the_first_bad_step_though_it_is_read_later(trainer_cls, tiny_model_dir, tmp_path, monkeypatch):
    trainer = tiny_setup(
        tiny_model_dir,
        tmp_path,
        trainer_cls,
        max_steps=8,
        per_device_train_batch_size=4,
        logging_steps=5,
        eval_strategy="no",
    )
    nan_at(monkeypatch, trainer_cls, 3)
    with pytest.raises(
        TrainingStopped, match="the loss or its gradients became non-finite at step 3; training stopped"
    ):
        trainer.fit()
    assert trainer.scheduler.last_epoch == 5  # read at the logging step 5, not before
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())  # the bad step was not applied


class NanGradient(torch.autograd.Function):
    """The identity forward; a nan gradient backward: a finite loss whose backward overflows."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


@pytest.mark.parametrize("trainer_cls", [BasicTrainer, AcceleratedTrainer])
@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clipped", "unclipped"])
def test_a_finite_loss_with_nan_gradients_is_a_bad_step(
    trainer_cls, clip, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """Found in audit: the step was applied (its loss was finite), every weight became nan, and the checkpoint
    named as "the last good one" held them. With clipping its norm says so; without, the gradients' own norm."""
    trainer = tiny_setup(
        tiny_model_dir, tmp_path, trainer_cls, max_steps=4, per_device_train_batch_size=4, logging_steps=2,
        eval_strategy="no", nonfinite_loss="skip", max_grad_norm=clip,
    )  # fmt: skip
    real, calls = ClassificationTask.loss, []

    def loss(self, model, batch):
        calls.append(1)
        summed, count = real(self, model, batch)
        return (NanGradient.apply(summed) if len(calls) == 2 else summed), count

    monkeypatch.setattr(ClassificationTask, "loss", loss)
    result = trainer.fit()
    assert result.summary()["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    said = capsys.readouterr()
    assert "skipped 1 step(s)" in said.out + said.err


@pytest.mark.parametrize("trainer_cls", [BasicTrainer, AcceleratedTrainer])
@pytest.mark.parametrize("adamw", ["auto", "foreach"])
def test_the_step_never_waits_on_the_host(trainer_cls, adamw, tiny_model_dir, tmp_path, monkeypatch):
    """Host reads from cloudtrain's own code happen at sync points (here the 2 logging steps of 20 steps),
    not in every step. With a non-fused AdamW the skip decision needs one read per step."""
    trainer = tiny_setup(
        tiny_model_dir,
        tmp_path,
        trainer_cls,
        max_steps=20,
        per_device_train_batch_size=2,
        logging_steps=10,
        eval_strategy="no",
        adamw_implementation=adamw,
    )
    reads = []
    for name in READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, __real=real, __name=name, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(SRC):
                reads.append(__name)
            return __real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    trainer.fit()
    monkeypatch.undo()
    if adamw == "auto":  # fused: skipped on the device
        assert len(reads) <= 2 * 4, reads
    else:
        assert reads.count("__bool__") >= 20


@pytest.mark.parametrize(
    "options, message",
    [
        ({"zero_stage": 0, "mixed_precision": "no"}, "ZeRO-0 in fp32 applies a step with nan/inf gradients"),
        ({"deepspeed_config": "bf16-off", "mixed_precision": "bf16"}, "sets bf16.check_grad_overflow = false"),
        ({"deepspeed_config": "no-norm", "mixed_precision": "no"}, "sets zero_optimization.compute_grad_norm = false"),
    ],
)
def test_deepspeed_set_ups_that_cannot_skip_are_refused_with_skip(options, message, tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("WORLD_SIZE", "1")  # as torchrun or accelerate launch start it

    configs = {
        "bf16-off": {"bf16": {"check_grad_overflow": False}, "zero_optimization": {"stage": 2}},
        "no-norm": {"zero_optimization": {"stage": 1, "compute_grad_norm": False}},
    }
    if "deepspeed_config" in options:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(configs[options["deepspeed_config"]]))
        options = {**options, "deepspeed_config": str(path)}
    with pytest.raises(UserError, match=message):
        check_distributed(build_config({**options, "nonfinite_loss": "skip"}))
    check_distributed(build_config({**options, "nonfinite_loss": "stop"}))  # stopping needs no skip
