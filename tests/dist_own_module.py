"""Run under torchrun by test_own_module.py: a user's own nn.Module through cloudtrain.train(model=...) on every
process, under DDP and under DeepSpeed ZeRO-2, in one launch.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_own_module.py RESULT_DIR

For each of DDP and ZeRO-2: an uninterrupted run of 8 steps (checkpoints at 4 and 8); a run of its first 4 steps
(a constant learning rate, so the same updates); that run resumed from `latest` to step 8. (A stop by a raising
callback, tests/test_own_module.py's way, leaves the stopped run's gloo group to be freed while the other process joins
the next run's: it hung there, in a launch that trains several times in one process.) RESULT_DIR/<mode>.json
(main process) gets the evaluation loss before and after training (and the saved model's, by hand), the steps
each run reached, the checkpoints, and whether the resumed run's final weights equal the uninterrupted run's bit
for bit. Then ZeRO-2 with a user's
DeepSpeed JSON holding only an optimizer section (cloudtrain's schedule drives it), and one holding only a
scheduler section (over cloudtrain's optimizer): RESULT_DIR/json_*.json gets the learning rate logged at each
step and the betas of the optimizer state DeepSpeed saved.
"""

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

import cloudtrain

MODES = {"zero2": {"zero_stage": 2}, "ddp": {}}


class TinyRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x, y):
        return {"loss": nn.functional.mse_loss(self.body(x), y)}


def rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, 4, generator=g)
    return [{"x": x, "y": (x @ torch.tensor([1.0, -2.0, 0.5, 3.0])).unsqueeze(0)} for x in xs]


def fresh() -> TinyRegressor:
    torch.manual_seed(0)
    return TinyRegressor()


def train(**options) -> dict:
    """cloudtrain.train, which joins the launch's process group afresh each time (and leaves it at the end): each
    join's keys in torchrun's store get a prefix of their own (cloudtrain.parallel.runtime.join_prefix)."""
    forget_deepspeed_groups()
    return cloudtrain.train(**options)


def forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the process groups of its first initialize in module globals; the next run in this process
    (a new launch group) must not find them (a launch that trains once per process, as the CLI does, never does)."""
    from deepspeed.utils import groups

    for name, value in vars(groups).items():
        if isinstance(value, torch.distributed.ProcessGroup) or name in ("mesh_device", "mpu"):
            setattr(groups, name, None)
        elif name.startswith("_") and name.isupper() and isinstance(value, dict):
            value.clear()


def check(mode: str, options: dict, out: Path) -> dict:
    common = {
        "train_dataset": rows(64, 0),
        "eval_dataset": rows(15, 1),  # 8 batches of 2: the second process's last is filled up with row 0
        "per_device_eval_batch_size": 2,
        "training_type": "accelerated",
        "max_steps": 8,
        "checkpointing_steps": "4",
        "per_device_train_batch_size": 4,
        "learning_rate": 5e-2,
        "warmup_ratio": 0.0,
        "lr_scheduler_type": "constant",  # the same rates in a run of 4 steps and one of 8: the halves join exactly
        "logging_steps": 4,
        "eval_strategy": "no",
        "mixed_precision": "no",
        **options,
    }
    whole = train(model=fresh(), output_dir=str(out / "whole"), **common)
    result: dict = {"whole_step": whole["train"]["global_step"], "whole_eval": whole["eval"]["loss"]}
    with torch.no_grad():
        data = rows(15, 1)
        x, y = torch.stack([r["x"] for r in data]), torch.stack([r["y"] for r in data])
        result["before_eval"] = float(nn.functional.mse_loss(fresh().body(x), y))

    half = train(model=fresh(), output_dir=str(out / "resumed"), **{**common, "max_steps": 4})
    result["half_step"] = half["train"]["global_step"]
    again = train(model=fresh(), output_dir=str(out / "resumed"), resume_from_checkpoint="latest", **common)
    result["resumed_step"] = again["train"]["global_step"]
    if os.environ.get("RANK", "0") != "0":  # the main process writes the final model (and may still be at it)
        return result
    a, b = load_file(out / "whole" / "model.safetensors"), load_file(out / "resumed" / "model.safetensors")
    trained = fresh()
    trained.load_state_dict(a)
    with torch.no_grad():  # the saved model's evaluation loss by hand, every row once
        result["true_eval"] = float(nn.functional.mse_loss(trained.body(x), y))
    result["keys"] = sorted(a)
    result["bit_exact"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    result["checkpoints"] = sorted(p.name for p in (out / "resumed" / "checkpoints").iterdir())
    return result


# a user's DeepSpeed JSON with only one of its optimizer and scheduler sections: cloudtrain supplies the other
ADAMW = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.98], "torch_adam": True}}
WARMUP_DECAY = {
    "type": "WarmupDecayLR",
    "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 3, "total_num_steps": "auto"},
}
SECTIONS = {
    "json_optimizer_only": ({"optimizer": ADAMW}, {"lr_scheduler_type": "linear", "warmup_steps": 2}),
    "json_scheduler_only": ({"scheduler": WARMUP_DECAY}, {}),
}


def one_section(name: str, sections: dict, options: dict, out: Path) -> dict:
    """Train 8 steps with the JSON's section and cloudtrain's other half; the rates logged at each step and the
    betas of the optimizer state DeepSpeed saved."""
    out.mkdir(parents=True, exist_ok=True)
    # every process writes it: whole, then renamed, or one read the file another was rewriting (empty)
    mine = out / f"ds.json.{os.environ.get('RANK', '0')}"
    mine.write_text(json.dumps({"zero_optimization": {"stage": 2}, **sections}))
    os.replace(mine, out / "ds.json")
    run = train(
        model=fresh(), train_dataset=rows(64, 0), eval_dataset=rows(16, 1), output_dir=str(out / "run"),
        training_type="accelerated", deepspeed_config=str(out / "ds.json"), max_steps=8, checkpointing_steps="8",
        per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, eval_strategy="no",
        mixed_precision="no", **options,
    )  # fmt: skip
    if os.environ.get("RANK", "0") != "0":
        return {}
    logged = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    states = sorted((out / "run" / "checkpoints").glob("*/pytorch_model/*optim_states.pt"))
    saved = torch.load(states[0], weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
    return {
        "steps": run["train"]["global_step"],
        "rates": {e["step"]: e["train/learning_rate"] for e in logged if "train/learning_rate" in e},
        "betas": [list(group["betas"]) for group in saved["param_groups"]],
        "final_loss": run["eval"]["loss"],
    }


def main(result_dir: Path) -> None:
    results = {mode: check(mode, options, result_dir / mode) for mode, options in MODES.items()}
    for name, (sections, options) in SECTIONS.items():
        results[name] = one_section(name, sections, options, result_dir / name)
    if os.environ.get("RANK", "0") == "0":
        for name, result in results.items():
            (result_dir / f"{name}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    faulthandler.dump_traceback_later(500, exit=True)  # a hang shows where each process stood, then fails
    main(Path(sys.argv[1]))
    from dist_runs import exit_without_teardown

    exit_without_teardown()
