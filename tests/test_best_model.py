"""Ending a run at its best (cloudtrain.training.best_model): early stopping and the best model at the end.

The runs are made to get worse where the test needs it: from a given step the loss is negated (gradient ascent,
tests/dist_faults.py), so every evaluation after it is worse than the one before, whatever the tiny model learned."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_checkpointing import args_for

from cloudtrain.cli import main
from cloudtrain.config.parse import resolve_options
from cloudtrain.errors import UserError
from cloudtrain.training.best_model import better, since_best

EVERY_5 = ["--eval_strategy", "steps", "--eval_steps", "5", "--checkpointing_steps", "5", "--logging_steps", "4"]


def run(tiny_model_dir, topic_csvs, out: Path, *extra: str) -> int:
    options = args_for(tiny_model_dir, topic_csvs, out, "--max_steps", "40", *EVERY_5, *extra)[1:]
    return main([*options, "--metric_for_best_model", "loss"])


def ascend(monkeypatch, from_step: int) -> list[str]:
    """From `from_step` on, gradient ascent; returns the options of a learning rate at which it shows at once."""
    from dist_faults import install

    install({"loss_scale": {"from_step": from_step, "factor": -1.0}}, monkeypatch.setattr)
    return ["--learning_rate", "0.05"]


def evaluations(folder: Path) -> list[dict]:
    return json.loads((folder / "trainer_state.json").read_text())["state"]["evaluations"]


def same_weights(a: Path, b: Path) -> bool:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def model_card(out: Path) -> str:
    """The card a push of `out` would upload (README.md), from the run's options and results."""
    from cloudtrain.publish.classifier_card import build_model_card

    options = json.loads((out / "args.json").read_text()) | {"push_to_hub": True, "hub_model_id": "alice/best"}
    results = {name: json.loads((out / f"{name}_results.json").read_text()) for name in ("train", "eval")}
    return build_model_card(out, resolve_options(None, options), results).text


# ---------------------------------------------------------------- the rule


def test_patience_counts_evaluations_that_do_not_beat_the_best_by_the_threshold():
    losses = [{"step": s, "loss": v} for s, v in ((5, 1.0), (10, 0.9), (15, 0.895), (20, 0.95), (25, 0.85))]
    assert since_best(losses[:3], "loss", 0.0) == (0, losses[2])
    assert since_best(losses[:4], "loss", 0.01) == (2, losses[1])  # 0.895 is not 0.01 better than 0.9
    assert since_best(losses, "loss", 0.01) == (0, losses[4])
    accuracies = [{"step": 1, "accuracy": 0.5}, {"step": 2, "accuracy": 0.4}, {"step": 3, "accuracy": float("nan")}]
    assert since_best(accuracies, "accuracy", 0.0) == (2, accuracies[0])  # higher is better; nan never is
    assert better(0.5, float("nan"), "loss") and not better(float("nan"), 0.5, "loss")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"early_stopping_patience": 0}, "--early_stopping_patience must be at least 1"),
        (
            {"early_stopping_patience": 2, "eval_strategy": "no"},
            "--early_stopping_patience counts evaluations: set --eval_strategy steps",
        ),
        ({"load_best_model_at_end": True}, "picks among checkpoints: set --checkpointing_steps"),
        (
            {"load_best_model_at_end": True, "checkpointing_steps": "10", "eval_strategy": "steps", "eval_steps": 4},
            "evaluates every 4 steps and checkpoints every 10 steps; set --checkpointing_steps a multiple of "
            "--eval_steps 4",
        ),
        (
            {"load_best_model_at_end": True, "checkpointing_steps": "10"},  # evaluations at each epoch's end
            "evaluates at each epoch's end and checkpoints every 10 steps; set --checkpointing_steps epoch",
        ),
    ],
)
def test_schedules_that_cannot_work_are_refused_in_one_line(options, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_options(None, options)


def test_aligned_schedules_are_accepted():
    resolve_options(None, {"load_best_model_at_end": True, "checkpointing_steps": "epoch"})
    resolve_options(
        None, {"load_best_model_at_end": True, "checkpointing_steps": "10", "eval_strategy": "steps", "eval_steps": 5}
    )


# ---------------------------------------------------------------- early stopping


@pytest.mark.slow
def test_a_run_that_stops_improving_ends_early_logs_saves_and_resumes_to_the_same_end(
    tiny_model_dir, topic_csvs, tmp_path, capsys, monkeypatch
):
    fast = ascend(monkeypatch, 1)  # every evaluation is worse than the one before: the first (step 5) stays best
    out = tmp_path / "out"
    assert run(tiny_model_dir, topic_csvs, out, "--early_stopping_patience", "2", *fast) == 0
    said = capsys.readouterr().out
    assert "note: early stopping after step 15 of 40: eval loss has not improved on " in said, said
    assert "(step 5) for 2 evaluations (--early_stopping_patience 2); the run ends there" in said
    assert "trained 15 steps" in said
    results = json.loads((out / "train_results.json").read_text())
    assert results["global_step"] == 15
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "train/loss" in r] == [4, 8, 12, 15]  # the last steps logged at the end
    assert (out / "model.safetensors").is_file() and (out / "eval_results.json").is_file()
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"checkpoint-{s}" for s in (10, 15, 5)]

    # resumed before the stop: the same evaluations, the same end, the same model
    resumed = tmp_path / "resumed"
    again = ["--resume_from_checkpoint", str(checkpoints / "checkpoint-10")]
    assert run(tiny_model_dir, topic_csvs, resumed, "--early_stopping_patience", "2", *fast, *again) == 0
    assert "note: early stopping after step 15 of 40" in capsys.readouterr().out
    assert same_weights(out, resumed)

    # resumed at the step where it stopped: nothing more is trained
    at_end = ["--resume_from_checkpoint", str(checkpoints / "checkpoint-15")]
    assert run(tiny_model_dir, topic_csvs, tmp_path / "at-end", "--early_stopping_patience", "2", *fast, *at_end) == 0
    said = capsys.readouterr().out
    assert "note: early stopping at step 15, where this run resumed: eval loss has not improved" in said
    assert "nothing left to train" in said and same_weights(out, tmp_path / "at-end")
    # the checkpoint at the stop step holds the steps logged at the end: the totals are the first run's
    totals = json.loads((tmp_path / "at-end" / "train_results.json").read_text())
    assert (totals["train_samples"], totals["train_loss"]) == (results["train_samples"], results["train_loss"])


# ---------------------------------------------------------------- the best model at the end


@pytest.mark.slow
def test_the_best_checkpoint_s_model_is_the_run_s_when_the_last_step_is_worse(
    tiny_model_dir, topic_csvs, tmp_path, capsys, monkeypatch
):
    fast = ascend(monkeypatch, 21)  # learns for 20 steps, then gets worse
    out, ends = tmp_path / "out", tmp_path / "ends.py"
    ends.write_text(
        "def at_end(state):\n    if state.event == 'on_train_end':\n"
        "        print(f'callback: train end at {state.global_step} with the model of {state.model_step}')\n"
    )
    at_end = ["--callbacks", f"{ends}:at_end"]
    assert run(tiny_model_dir, topic_csvs, out, "--load_best_model_at_end", "true", *fast, *at_end) == 0
    said = capsys.readouterr().out
    assert said.index("best model: ") < said.index("callback: train end")  # on_train_end comes with the best model
    checkpoints = out / "checkpoints"
    losses = {int(p.name.split("-")[1]): evaluations(p)[-1]["loss"] for p in checkpoints.iterdir() if evaluations(p)}
    best = min(losses, key=losses.get)  # checkpoint-40 has no score: the run evaluates no step after its last
    assert f"best model: checkpoint-{best}'s (eval loss {losses[best]:.4g}; the last step's " in said
    last = float(said.split("the last step's ")[1].split(")")[0])
    assert best <= 20 and last > losses[best]  # the ascent made the last step's model worse
    assert same_weights(out, checkpoints / f"checkpoint-{best}")
    assert json.loads((out / "train_results.json").read_text())["model_from_step"] == best
    assert f"callback: train end at 40 with the model of {best}\n" in said  # CallbackState.model_step
    final = json.loads((out / "eval_results.json").read_text())
    assert final["loss"] == pytest.approx(losses[best], rel=1e-5)  # the evaluation is the best model's
    assert f"(the model of step {best}, --load_best_model_at_end)" in said.split("\neval: ")[1].splitlines()[0]
    # the curve's step 40 is step 40's own model, once; the best model's numbers are in the results (audit: the
    # best checkpoint's were drawn at step 40, a false rebound)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    at_end = [r["eval/loss"] for r in logged if r["step"] == 40 and "eval/loss" in r]
    assert at_end == [pytest.approx(last, rel=1e-3)] and last != pytest.approx(final["loss"], rel=1e-3)
    card = model_card(out)
    assert f"The model is the run's best checkpoint, at step {best} of 40, by its validation `loss`" in card

    # resumed from checkpoint-10 to end at step 12: the better checkpoints 15 and 20 are a run it abandoned
    again = ["--resume_from_checkpoint", str(checkpoints / "checkpoint-10"), "--max_steps", "12"]
    assert run(tiny_model_dir, topic_csvs, out, "--load_best_model_at_end", "true", *fast, *again) == 0
    assert json.loads((out / "train_results.json").read_text()).get("model_from_step") in (None, 5, 10)


def test_the_last_step_s_model_stays_when_no_checkpoint_beats_it(tiny_model_dir, topic_csvs, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(tiny_model_dir, topic_csvs, out, "--load_best_model_at_end", "true", "--learning_rate", "1e-30") == 0
    said = capsys.readouterr().out  # nothing learns: every evaluation ties, and a tie keeps the last step's
    assert "best model: the last step's (eval loss " in said
    assert "model_from_step" not in json.loads((out / "train_results.json").read_text())
    assert "best checkpoint" not in model_card(out)
