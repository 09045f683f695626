"""A user's own nn.Module through cloudtrain.train(model=..., train_dataset=..., eval_dataset=...): it trains with
both trainers, saves its state_dict and class name, resumes exactly, and what does not apply to it is refused in
one line; under DDP and DeepSpeed ZeRO-2 on 2 CPU processes it trains, checkpoints and resumes exactly. The same
launch trains ZeRO-2 with a user's DeepSpeed JSON holding only one of its optimizer and scheduler sections."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, child_pythonpath
from safetensors.torch import load_file
from test_distributed import free_port
from torch import nn

import cloudtrain
import cloudtrain.cli
from cloudtrain.errors import TrainingStopped, UserError


class TinyRegressor(nn.Module):
    """y = w.x + noise, through a small MLP; the forward returns a dict with the batch's mean loss."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x, y):
        return {"loss": nn.functional.mse_loss(self.body(x), y), "prediction": self.body(x)}


def rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    w = torch.tensor([1.0, -2.0, 0.5, 3.0])
    xs = torch.randn(n, 4, generator=g)
    return [{"x": x, "y": (x @ w).unsqueeze(0)} for x in xs]


def fresh_module() -> TinyRegressor:
    torch.manual_seed(0)
    return TinyRegressor()


def eval_loss(module: nn.Module, data: list[dict]) -> float:
    x, y = torch.stack([r["x"] for r in data]), torch.stack([r["y"] for r in data])
    with torch.no_grad():
        return float(nn.functional.mse_loss(module.body(x), y))


OPTIONS = {
    "max_steps": 8,
    "per_device_train_batch_size": 8,
    "learning_rate": 5e-2,
    "warmup_ratio": 0.0,
    "logging_steps": 4,
    "eval_strategy": "no",
    "mixed_precision": "no",
}


@pytest.mark.parametrize("training_type", ["basic", "accelerated"])
def test_trains_with_each_trainer_and_saves_its_state_dict(tmp_path, training_type, capsys):
    train, evaluation = rows(64, 0), rows(16, 1)
    module = fresh_module()
    before = eval_loss(module, evaluation)
    out = tmp_path / "run"
    results = cloudtrain.train(
        model=module, train_dataset=train, eval_dataset=evaluation, output_dir=str(out),
        training_type=training_type, label_smoothing=0.1, **OPTIONS,
    )  # fmt: skip
    # the module's forward computes its own loss: a task's option is said to be unused, as for a --task
    assert "note: --label_smoothing 0.1 has no effect on your own module (model=); it counts for --task " in (
        capsys.readouterr().out
    )
    assert results["train"]["global_step"] == 8
    assert results["eval"]["loss"] < 0.8 * before
    saved = fresh_module()
    saved.load_state_dict(load_file(out / "model.safetensors"))
    assert results["eval"]["loss"] == pytest.approx(eval_loss(saved, evaluation), rel=1e-5)
    info = json.loads((out / "module.json").read_text())
    assert info["class"] == f"{__name__}:TinyRegressor" and info["parameters"] == 97
    assert not (out / "tokenizer.json").exists() and not (out / "config.json").exists()
    for command in ("predict", "generate"):  # the saved folder is no transformers model: one line, not a traceback
        assert (
            cloudtrain.cli.main(
                [command, "--model_dir", str(out), "--text" if command == "predict" else "--prompt", "x"]
            )
            == 2
        )


def test_resumes_exactly_after_a_stop(tmp_path):
    """A run stopped after its step-4 checkpoint (a callback raising) and resumed ends with the weights of an
    uninterrupted run."""
    train, evaluation = rows(64, 0), rows(16, 1)
    common = {"train_dataset": train, "eval_dataset": evaluation, "checkpointing_steps": "4", **OPTIONS}
    cloudtrain.train(model=fresh_module(), output_dir=str(tmp_path / "whole"), **common)

    def stop_after_checkpoint(state):
        if state.event == "on_save" and state.global_step == 4:
            raise RuntimeError("interrupted")

    out = str(tmp_path / "resumed")
    with pytest.raises(TrainingStopped, match="interrupted"):
        cloudtrain.train(model=fresh_module(), output_dir=out, callbacks=[stop_after_checkpoint], **common)
    resumed = cloudtrain.train(model=fresh_module(), output_dir=out, resume_from_checkpoint="latest", **common)
    assert resumed["train"]["global_step"] == 8
    whole, again = (
        load_file(tmp_path / "whole" / "model.safetensors"),
        load_file(tmp_path / "resumed" / "model.safetensors"),
    )
    assert whole.keys() == again.keys()
    for name in whole:
        torch.testing.assert_close(whole[name], again[name], rtol=0, atol=0)


class NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x, y):
        return self.linear(x)  # predictions, not a loss


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"push_to_hub": True, "hub_model_id": "me/x"}, "--push_to_hub: a plain module has no Hub format"),
        ({"peft": "lora"}, "--peft lora needs a transformers PreTrainedModel"),
        ({"per_device_train_batch_size": "auto"}, "--per_device_train_batch_size auto"),
        ({"train_file": "data.csv"}, "model= takes its data as train_dataset="),
        # found in audit: each was ignored without a word, or (rows' keys) a TypeError inside the first step
        ({"validation_file": "v.csv", "test_file": "t.csv"}, "leave out --validation_file, --test_file"),
        ({"eval_datset": []}, "unknown option 'eval_datset'; did you mean eval_dataset=?"),  # (hinted eval_strategy)
        ({"tokenizer_name_or_path": "tok"}, "which no tokenizer reads: leave out --tokenizer_name_or_path"),
        ({"train_dataset": [{"x": torch.ones(1), "z": torch.ones(1)}]}, "rows hold 'z', which TinyRegressor.forward"),
        # a mask the rows hold reaches the forward too (found in review: a TypeError in the first step)
        (
            {"train_dataset": [{"x": torch.ones(4), "y": torch.ones(1), "attention_mask": torch.ones(1)}] * 4},
            "rows hold 'attention_mask', which TinyRegressor.forward",
        ),
        ({"model_name_or_path": "gpt2"}, "model= is the model"),
        ({"train_dataset": [{"x": [1.0]}]}, "rows must be dicts of tensors"),
        ({"model": NoLoss()}, "it must return the batch's loss"),
        ({"training_type": "pipeline"}, "--training_type pipeline trains decoders"),
    ],
)
def test_what_does_not_apply_is_refused_in_one_line(tmp_path, options, says):
    call = {"model": fresh_module(), "train_dataset": rows(16, 0), "output_dir": str(tmp_path / "run"), **OPTIONS}
    with pytest.raises(UserError) as refused:
        cloudtrain.train(**{**call, **options})
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def two_process_launch(tmp_path_factory):
    """tests/dist_own_module.py under torchrun on 2 CPU processes (one launch for every check below)."""
    out = tmp_path_factory.mktemp("own-module-dist")
    port = free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    environment = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [*launcher, str(REPO / "tests" / "dist_own_module.py"), str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=environment,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "zero2"])
def test_trains_checkpoints_and_resumes_exactly_under_ddp_and_zero2(two_process_launch, mode):
    """cloudtrain.train(model=...) on each of 2 processes, under DDP and DeepSpeed ZeRO-2: it learns, saves
    checkpoints, and a run of its first 4 steps resumed to step 8 ends bit-exact with the run of 8."""
    out, stdout = two_process_launch
    result = json.loads((out / f"{mode}.json").read_text())
    assert (result["whole_step"], result["half_step"], result["resumed_step"]) == (8, 4, 8)
    assert result["whole_eval"] < 0.5 * result["before_eval"]
    # each of the 15 rows counted once: the padded last batch's mean had counted row 0 in row 14's loss (audit)
    assert result["whole_eval"] == pytest.approx(result["true_eval"], rel=1e-5)
    assert result["checkpoints"] == ["checkpoint-4", "checkpoint-8"]
    assert result["bit_exact"] and result["keys"] == ["body.0.bias", "body.0.weight", "body.2.bias", "body.2.weight"]
    # the DDP and ZeRO-2 runs, then the two runs of the DeepSpeed JSONs below (ZeRO-2)
    assert stdout.count("2 process(es) on cpu (DDP, precision no)") == 3
    assert stdout.count("2 process(es) on cpu (DeepSpeed ZeRO-2, precision no)") == 5


@pytest.mark.slow
def test_a_deepspeed_json_with_only_an_optimizer_section_runs_cloudtrains_schedule(two_process_launch):
    """The file's AdamW (its betas in the state DeepSpeed saved), driven by --lr_scheduler_type linear with
    --warmup_steps 2 over 8 steps: step k logs the rate it was taken at, the schedule's after k - 1 steps."""
    out, _ = two_process_launch
    result = json.loads((out / "json_optimizer_only.json").read_text())
    peak, warmup, total = 1e-2, 2, 8
    linear = {str(k + 1): peak * (k / warmup if k < warmup else (total - k) / (total - warmup)) for k in range(8)}
    assert result["steps"] == 8 and result["rates"] == pytest.approx(linear)
    assert result["betas"] == [[0.9, 0.98], [0.9, 0.98]]


@pytest.mark.slow
def test_a_deepspeed_json_with_only_a_scheduler_section_drives_cloudtrains_optimizer(two_process_launch):
    """cloudtrain's AdamW (torch's default betas in the state DeepSpeed saved), driven by the file's WarmupDecayLR
    (log warmup over 3 steps, total_num_steps "auto" from --max_steps 8): step k logs the rate it is taken at,
    iteration k - 2's (step 1's: 0, before the schedule started)."""
    out, _ = two_process_launch
    result = json.loads((out / "json_scheduler_only.json").read_text())
    peak, warmup, total = 1e-2, 3, 8

    def file_schedule(i: int) -> float:
        return peak * math.log(i + 1) / math.log(warmup) if i < warmup else peak * (total - i) / (total - warmup)

    assert result["steps"] == 8 and result["rates"] == pytest.approx(
        {str(k): file_schedule(k - 2) if k > 1 else 0.0 for k in range(1, 9)}
    )
    assert result["betas"] == [[0.9, 0.999], [0.9, 0.999]]


def test_a_tied_weight_of_a_users_module_is_saved_as_one_value(tmp_path):
    """Under DeepSpeed bf16 the fp32 weights replace the first name of a tied pair only: the other name kept the
    16-bit copy, and loading took it (found in review). Each name of a tied weight is saved with the same value."""
    from cloudtrain.training.trainer import save_weights

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.emb.weight

    module = Tied()
    state = {"emb.weight": module.emb.weight.detach().float() + 1, "head.weight": module.emb.weight.detach().bfloat16()}
    save_weights(module, tmp_path, state_dict=state)
    saved = load_file(tmp_path / "model.safetensors")
    assert torch.equal(saved["emb.weight"], state["emb.weight"])
    assert torch.equal(saved["head.weight"], saved["emb.weight"])


class CalledNotForwarded(nn.Module):
    """A module that overrides __call__ (no forward): trained before the forward-signature check (found in review)."""

    def __init__(self):
        super().__init__()
        self.body = TinyRegressor()

    def __call__(self, **batch):
        return self.body(batch["x"], batch["y"])


def test_a_module_called_otherwise_than_through_its_forward_trains(tmp_path):
    results = cloudtrain.train(
        model=CalledNotForwarded(), train_dataset=rows(16, 0), output_dir=str(tmp_path / "run"), **OPTIONS
    )
    assert results["train"]["global_step"] > 0


class InBatch(nn.Module):
    """A loss of the whole batch (as in-batch contrastive losses are): each row scored against the batch's mean."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x, y):
        return ((x - x.mean(0)) * self.scale).pow(2).mean()


def test_one_process_evaluates_each_batch_whole(tmp_path):
    """A batch's loss is the module's own: on one process no batch is split into rows (found in review: the last
    one was, and an in-batch loss came out other than the module's)."""
    data = rows(16, 1)
    results = cloudtrain.train(
        model=InBatch(), train_dataset=rows(16, 0), eval_dataset=data, output_dir=str(tmp_path / "run"),
        **{**OPTIONS, "per_device_eval_batch_size": 8, "learning_rate": 1e-9},
    )  # fmt: skip
    x = torch.stack([r["x"] for r in data])
    by_hand = sum(float(((x[i : i + 8] - x[i : i + 8].mean(0)) ** 2).mean()) for i in (0, 8)) / 2
    assert results["eval"]["loss"] == pytest.approx(by_hand, rel=1e-4)
