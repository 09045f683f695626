"""Stages 3-6 with a tiny random model: accumulation exactness, determinism, outputs of a run."""

import json

import pytest
import torch
from conftest import topic_rows
from datasets import Dataset, DatasetDict
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from cloudtrain.checkpointing import Checkpointer
from cloudtrain.config import DataConfig, build_config, validate
from cloudtrain.data.processing import process_data
from cloudtrain.errors import TrainingStopped
from cloudtrain.models.load import load_model
from cloudtrain.observe.tracking import RunLog
from cloudtrain.parallel.distributed import build_accelerator
from cloudtrain.parallel.runtime import Runtime
from cloudtrain.pipeline import run_training
from cloudtrain.tasks.classification import ClassificationTask
from cloudtrain.training import AcceleratedTrainer, BasicTrainer, Hook, LoopState, Request


def tiny_setup(tiny_model_dir, tmp_path, trainer_cls, **overrides):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw = DatasetDict({"train": Dataset.from_list(topic_rows(10)), "validation": Dataset.from_list(topic_rows(2))})
    data = process_data(raw, tokenizer, DataConfig(), seed=0)
    cfg = build_config({"model_name_or_path": tiny_model_dir, "max_grad_norm": 0, "mixed_precision": "no", **overrides})
    torch.manual_seed(0)
    model = load_model(build_config({"model_name_or_path": tiny_model_dir}), ClassificationTask(), data, tokenizer)
    run_log = RunLog(cfg, tmp_path, True, run_info={})
    runtime = Runtime(build_accelerator(cfg)) if trainer_cls is AcceleratedTrainer else Runtime()
    return trainer_cls(cfg, ClassificationTask(), model, data, run_log, runtime)


@pytest.mark.parametrize("trainer_cls", [BasicTrainer, AcceleratedTrainer])
@pytest.mark.parametrize("sizes", [[4, 4, 4], [5, 5, 2]], ids=["equal", "short-last"])
def test_accumulation_equals_one_big_batch(tiny_model_dir, tmp_path, trainer_cls, sizes):
    """k micro-batches with accumulation give the same update as one batch holding all of them."""
    updated = []
    for k, window_sizes in ((len(sizes), sizes), (1, [sum(sizes)])):
        trainer = tiny_setup(tiny_model_dir, tmp_path, trainer_cls, gradient_accumulation_steps=k)
        # Plain SGD: its update is proportional to the gradient, so a mis-scaled loss would show.
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.5)
        trainer.setup()
        rows = [trainer.data.train[i] for i in range(sum(sizes))]
        window, start = [], 0
        for size in window_sizes:
            window.append(trainer.move(trainer.data.collator(rows[start : start + size])))
            start += size
        stats = trainer.backward_window(window, trainer._loss_scale(window))
        trainer.optimizer_step()
        updated.append(
            (stats.loss_sum / stats.count, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        )
    (loss_acc, params_acc), (loss_big, params_big) = updated
    assert float(loss_acc) == pytest.approx(float(loss_big), rel=1e-5)
    for name, value in params_big.items():
        torch.testing.assert_close(params_acc[name], value, rtol=1e-5, atol=1e-6)
    initial = dict(tiny_setup(tiny_model_dir, tmp_path, trainer_cls).model.named_parameters())
    assert not torch.equal(params_big["classifier.weight"], initial["classifier.weight"])  # the step did move


@pytest.mark.parametrize("trainer_cls", [BasicTrainer, AcceleratedTrainer])
def test_the_task_loss_runs_under_the_steps_autocast(tiny_model_dir, tmp_path, trainer_cls):
    """A loss that runs matmuls of its own (the fused cross-entropy: the head over the hidden states) runs them in
    the step's 16-bit dtype. accelerate's prepare() wraps only the model's forward in autocast: outside it, on an
    H100, the head's matmuls ran in fp32."""
    trainer = tiny_setup(tiny_model_dir, tmp_path, trainer_cls, mixed_precision="bf16")
    trainer.setup()
    seen, task_loss = [], trainer.task.loss

    def loss(model, batch):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return task_loss(model, batch)

    trainer.task.loss = loss
    window = [trainer.move(trainer.data.collator([trainer.data.train[i] for i in range(4)]))]
    stats = trainer.backward_window(window, trainer._loss_scale(window))
    assert seen == [torch.bfloat16] and torch.isfinite(stats.loss_sum)


def run_tiny(tiny_model_dir, topic_csvs, out, **overrides):
    cfg = build_config(
        {
            "model_name_or_path": tiny_model_dir,
            "train_file": str(topic_csvs["train"]),
            "validation_file": str(topic_csvs["validation"]),
            "test_file": str(topic_csvs["test"]),
            "output_dir": str(out),
            "max_steps": 6,
            "per_device_train_batch_size": 8,
            "logging_steps": 2,
            "learning_rate": 1e-3,
            **overrides,
        }
    )
    validate(cfg)
    return run_training(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("training_type", ["basic", "accelerated"])
def test_same_seed_same_result(tiny_model_dir, topic_csvs, tmp_path, training_type):
    runs = [
        run_tiny(tiny_model_dir, topic_csvs, tmp_path / f"run{i}", training_type=training_type, seed=seed)
        for i, seed in enumerate((1, 1, 2))
    ]
    weights = [load_file(tmp_path / f"run{i}" / "model.safetensors") for i in range(3)]
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    assert not all(torch.equal(weights[0][n], weights[2][n]) for n in weights[0])
    assert runs[0]["train"]["train_loss"] == runs[1]["train"]["train_loss"]


@pytest.mark.parametrize("trainer_cls", [BasicTrainer, AcceleratedTrainer])
def test_training_steps_run_in_train_mode(tiny_model_dir, tmp_path, trainer_cls):
    """Dropout is on while training (from_pretrained hands the model over in eval mode), off in evaluation."""
    trainer = tiny_setup(
        tiny_model_dir,
        tmp_path,
        trainer_cls,
        max_steps=2,
        per_device_train_batch_size=4,
        eval_strategy="steps",
        eval_steps=1,
    )
    assert not trainer.model.training
    modes = []
    trainer.model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    trainer.fit()
    # step 1, evaluation after step 1 (one batch of 2), step 2
    assert modes == [True, False, True]


def test_run_writes_every_output(tiny_model_dir, topic_csvs, tmp_path):
    out = tmp_path / "out"
    results = run_tiny(tiny_model_dir, topic_csvs, out, eval_strategy="steps", eval_steps=3, hub_token="hf_x1")
    names = {p.name for p in out.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "args.json",
        "train_results.json",
        "eval_results.json",
        "test_results.json",
        "metrics.jsonl",
    } <= names
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.id2label == {0: "finance", 1: "sports", 2: "weather"}
    args = json.loads((out / "args.json").read_text())
    assert args["max_steps"] == 6 and "hub_token" not in args
    assert not any("hf_x1" in p.read_text(errors="ignore") for p in out.iterdir() if p.suffix in (".json", ".jsonl"))
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if "train/loss" in e] == [2, 4, 6]
    assert [e["step"] for e in events if "eval/accuracy" in e] == [3, 6]  # mid-run, then the final one
    assert json.loads((out / "eval_results.json").read_text())["samples"] == 12 == results["eval"]["samples"]
    assert results["test"]["samples"] == 12


def test_a_new_concern_is_one_hook(tiny_model_dir, tmp_path, monkeypatch):
    """A hook added to Trainer.hooks runs after every step; a step where it is due is a sync point (the
    device flags are read there), and a Request with a reason stops the run once the checkpoint hook,
    which runs last, has saved."""

    class EveryThirdStep(Hook):
        def __init__(self):
            self.seen: list[tuple[int, bool]] = []

        def due(self, loop: LoopState) -> bool:
            return loop.step % 3 == 0

        def on_step_end(self, loop: LoopState) -> Request | None:
            self.seen.append((loop.step, loop.sync))
            return Request("stopped by the test at step 6", "nothing to do", 5) if loop.step == 6 else None

    hook, real = EveryThirdStep(), BasicTrainer.hooks

    def hooks(self, checkpointer, preemption):
        *concerns, checkpoint = real(self, checkpointer, preemption)
        return [*concerns, hook, checkpoint]

    monkeypatch.setattr(BasicTrainer, "hooks", hooks)
    trainer = tiny_setup(
        tiny_model_dir, tmp_path, BasicTrainer, max_steps=10, per_device_train_batch_size=2, logging_steps=4
    )
    checkpointer = Checkpointer(trainer.cfg, tmp_path / "checkpoints", tmp_path, True, lambda: None)
    with pytest.raises(TrainingStopped) as stopped:
        trainer.fit(checkpointer)
    saved = tmp_path / "checkpoints" / "checkpoint-6"
    assert str(stopped.value) == f"stopped by the test at step 6; checkpoint saved to {saved}: nothing to do"
    assert stopped.value.exit_code == 5 and saved.is_dir()
    assert hook.seen == [(1, False), (2, False), (3, True), (4, True), (5, False), (6, True)]  # 4: a logging step
