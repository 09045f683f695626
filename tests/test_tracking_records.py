"""What the trackers and training_curves.png hold, in cases an audit found wrong.

The helpers and fixtures are test_tracking's: a per-test HOME and HF_HOME, and a W&B server on 127.0.0.1.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import test_tracking
from conftest import REPO, child_pythonpath
from test_tracking import wandb_run

from cloudtrain.observe.plotting import curve_data, draw_curves
from cloudtrain.publish.output_dir import record

tracker_env = test_tracking.tracker_env  # a fixture


def run_python(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter (W&B's service is per process), with `env` added; it must succeed."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": child_pythonpath(), **env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# ---------------------------------------------------------------- the W&B model artifact

LOGGED_MODEL = textwrap.dedent("""
    import sys
    from pathlib import Path
    from cloudtrain.config import build_config
    from cloudtrain.observe.tracking import RunLog, read_metrics

    out = Path(sys.argv[1])
    cfg = build_config({"report_to": "wandb", "log_model": True, "output_dir": str(out), "run_name": "m"})
    run_log = RunLog(cfg, out, True, {"num_parameters": 10})
    run_log.log({"train/loss": 0.5}, step=1)
    run_log.finish({"train": {"global_step": 1, "train_loss": 0.5}}, [])
""")


@pytest.mark.slow  # a fresh process with W&B
def test_the_model_artifact_holds_only_the_files_cloudtrain_wrote(tracker_env):
    """`--log_model true` uploaded every top-level file of the output folder: a user's notes.txt went into the
    model artifact (found in audit). It holds what the manifest says cloudtrain wrote, as `cloudtrain push` does."""
    out = tracker_env / "out"
    (out / "merged").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "notes.txt", "tokenizer_corpus.txt"):
        (out / name).write_text("{}")
    for name in ("config.json", "model.safetensors", "model.gguf"):
        (out / "merged" / name).write_text("{}")
    record(out, ["config.json", "model.safetensors", "tokenizer.json", "merged"])  # as save_final records them
    record(out / "merged", ["config.json", "model.safetensors"])  # as the merge does
    run_python(LOGGED_MODEL, str(out), WANDB_MODE="offline")

    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (model,) = [a for a in wandb_run(run_dir)["artifacts"] if a.type == "model"]
    assert {e.path for e in model.manifest.contents} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "merged/config.json",
        "merged/model.safetensors",
        "metrics.jsonl",  # the run's own log and curves, recorded in the manifest once the trackers are done
        "training_curves.png",
    }


# ---------------------------------------------------------------- training_curves.png

SFT_RECORDS = [  # a supervised fine-tuning run's metrics.jsonl, as the audit found it
    {"step": 1, "train/loss": 7.1, "eval/loss": 7.24, "eval/perplexity": 1389.0, "eval/exact_match": 0.0},
    {"step": 2, "train/loss": 4.2, "eval/loss": 3.87, "eval/perplexity": 48.0, "eval/exact_match": 0.25},
    {"step": 2, "eval/f1": 61.5},  # SQuAD's F1, in percent
]


def panels(records: list[dict]) -> dict[str, tuple[str, list[str]]]:
    """{title: (y scale, series drawn)} of the curves figure of `records`."""
    figure = draw_curves(curve_data(records))
    return {ax.get_title(): (ax.get_yscale(), [line.get_label() for line in ax.get_lines()]) for ax in figure.axes}


def test_curves_of_different_scales_are_drawn_in_panels_of_their_own():
    """A perplexity of 1389 -> 48 and an exact match of 0-1 shared a linear axis: the exact match was a flat line
    (found in audit). Metrics on a 0-1 scale, perplexity (log) and the other scales each have their panel."""
    assert panels(SFT_RECORDS) == {
        "loss": ("linear", ["train/loss", "eval/loss"]),
        "evaluation metrics": ("linear", ["eval/exact_match"]),
        "perplexity": ("log", ["eval/perplexity"]),
        "evaluation metrics, other scales": ("linear", ["eval/f1"]),
    }
    preference = [{"step": 1, "train/rewards/margins": 4.5, "train/rewards/accuracies": 0.75, "eval/exact_match": 0.5}]
    assert panels(preference) == {
        "loss": ("linear", []),
        "evaluation metrics": ("linear", ["eval/exact_match"]),
        "reward margins": ("linear", ["train/rewards/margins"]),
        "pair accuracy": ("linear", ["train/rewards/accuracies"]),
    }


@pytest.mark.parametrize("steps", [[2], [1, 2], [5, 10, 15, 40]])
def test_the_step_axis_is_marked_in_whole_steps(steps):
    """A run of one logged step showed steps 1.900 to 2.100, a run of two showed 2.5 (found in audit)."""
    figure = draw_curves(curve_data([{"step": s, "train/loss": 1.0 / s, "eval/accuracy": 0.5} for s in steps]))
    for ax in figure.axes:
        low, high = ax.get_xlim()
        ticks = [tick for tick in ax.get_xticks() if low <= tick <= high]
        assert ticks and all(float(tick).is_integer() for tick in ticks), (ax.get_title(), ticks)
        assert low < min(steps) and max(steps) < high  # every point inside, off the edges
