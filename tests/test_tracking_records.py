"""What the trackers and training_curves.png hold, in cases an audit found wrong.

The helpers and fixtures are test_tracking's: a per-test HOME and HF_HOME, and a W&B server on 127.0.0.1.
"""

import shutil
import textwrap
from pathlib import Path

import pytest
import test_tracking
from conftest import run_cli
from test_tracking import (
    FAKE_KEY,
    TRACKED_PART,
    offline_dirs,
    run_python,
    tensorboard_scalars,
    train_args,
    wandb_run,
)

from cloudtrain.config import build_config
from cloudtrain.observe.plotting import curve_data, draw_curves
from cloudtrain.observe.tracking import RunLog, read_metrics
from cloudtrain.publish.output_dir import record

tracker_env, rejecting_wandb_server = test_tracking.tracker_env, test_tracking.rejecting_wandb_server  # fixtures


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


def test_a_run_of_nan_evaluations_draws_its_curves(tmp_path):
    """Found in audit: every evaluation nan (null perplexity) ended the run after the model was saved, with a
    matplotlib traceback (no log scale with nothing to draw)."""
    from cloudtrain.observe.plotting import plot_training_curves

    records = [{"step": s, "train/loss": None, "eval/loss": None, "eval/perplexity": None} for s in (1, 2)]
    plot_training_curves(records, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert panels(records)["perplexity"][0] == "linear"


@pytest.mark.parametrize("steps", [[2], [1, 2], [5, 10, 15, 40]])
def test_the_step_axis_is_marked_in_whole_steps(steps):
    """A run of one logged step showed steps 1.900 to 2.100, a run of two showed 2.5 (found in audit)."""
    figure = draw_curves(curve_data([{"step": s, "train/loss": 1.0 / s, "eval/accuracy": 0.5} for s in steps]))
    for ax in figure.axes:
        low, high = ax.get_xlim()
        ticks = [tick for tick in ax.get_xticks() if low <= tick <= high]
        assert ticks and all(float(tick).is_integer() for tick in ticks), (ax.get_title(), ticks)
        assert low < min(steps) and max(steps) < high  # every point inside, off the edges


# ---------------------------------------------------------------- TensorBoard after a resume


def finished_part(out: Path, checkpoint: Path) -> None:
    """A run's first part: steps 1-6, a checkpoint at 6 (its copy of the log), then its final evaluation at 6."""
    cfg = build_config({"report_to": "tensorboard", "output_dir": str(out), "run_name": "tb"})
    run_log = RunLog(cfg, out, True, {"num_parameters": 10})
    for step in range(1, 7):
        run_log.log({"train/loss": step / 10}, step=step)
    checkpoint.mkdir(parents=True)
    shutil.copy(out / "metrics.jsonl", checkpoint / "metrics.jsonl")  # as a checkpoint keeps it
    run_log.log({"checkpoint/blocked_s": 0.1}, step=6)
    run_log.log({"eval/accuracy": 0.5}, step=6)
    run_log.finish({"train": {"global_step": 6, "train_loss": 0.3}}, [])


def test_a_resume_at_the_checkpoints_own_step_shows_that_step_once_in_tensorboard(tmp_path):
    """A requeue at a finished run's last checkpoint evaluates again: TensorBoard showed eval/accuracy at step 6
    twice, while metrics.jsonl kept one (found in audit). It hides step 6 whole, and the points of step 6 from
    before the save come again from metrics.jsonl."""
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint-6"
    finished_part(out, checkpoint)
    cfg = build_config({"report_to": "tensorboard", "output_dir": str(out), "run_name": "tb"})
    resumed = RunLog(cfg, out, True, {"num_parameters": 10}, resume_step=6, checkpoint=checkpoint)
    resumed.log({"eval/accuracy": 0.75}, step=6)
    resumed.finish({"train": {"global_step": 6, "train_loss": 0.3}}, [])

    run_dir = out / "tensorboard" / "tb"
    assert tensorboard_scalars(run_dir, "eval/accuracy") == [(6, 0.75)]
    assert [s for s, _ in tensorboard_scalars(run_dir, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in tensorboard_scalars(run_dir, "checkpoint/blocked_s")] == [6]
    logged = [(r["step"], r["eval/accuracy"]) for r in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in r]
    assert logged == [(6, 0.75)]


def test_a_resume_past_the_checkpoints_step_keeps_that_steps_points(tmp_path):
    """Where the first part logged nothing at the checkpoint's step after the save, that step is not hidden."""
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint-4"
    cfg = build_config({"report_to": "tensorboard", "output_dir": str(out), "run_name": "tb"})
    first = RunLog(cfg, out, True, {})
    for step in range(1, 5):
        first.log({"train/loss": step / 10}, step=step)
    checkpoint.mkdir()
    shutil.copy(out / "metrics.jsonl", checkpoint / "metrics.jsonl")
    first.log({"train/loss": 0.5}, step=5)
    resumed = RunLog(cfg, out, True, {}, resume_step=4, checkpoint=checkpoint)
    resumed.log({"train/loss": 0.55}, step=5)
    resumed.finish({"train": {"global_step": 5, "train_loss": 0.3}}, [])
    scalars = tensorboard_scalars(out / "tensorboard" / "tb", "train/loss")
    assert [s for s, _ in scalars] == [1, 2, 3, 4, 5] and scalars[-1][1] == pytest.approx(0.55)


@pytest.mark.slow  # two trainings
def test_a_requeue_of_a_finished_run_shows_its_final_evaluation_once_in_tensorboard(
    tiny_model_dir, topic_csvs, tracker_env
):
    """The audit's case: a run of 6 steps checkpointed every 3, run again with --resume_from_checkpoint latest."""
    out = tracker_env / "out"
    args = train_args(tiny_model_dir, topic_csvs, out, "--report_to", "tensorboard", "--training_type", "basic",
                      "--eval_strategy", "steps", "--eval_steps", "3", "--checkpointing_steps", "3",
                      "--run_name", "tb")  # fmt: skip
    for extra in ([], ["--resume_from_checkpoint", "latest"]):
        result = run_cli(*args, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
    assert "nothing left to train" in result.stdout
    logged = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in r]
    assert logged == [3, 6]
    run_dir = out / "tensorboard" / "tb"
    assert [s for s, _ in tensorboard_scalars(run_dir, "eval/accuracy")] == logged
    assert [s for s, _ in tensorboard_scalars(run_dir, "train/loss")] == [2, 4, 6]


# ---------------------------------------------------------------- W&B with a key the server rejects


@pytest.mark.slow  # a fresh process with W&B
def test_a_key_the_server_rejects_leaves_the_offline_run_alone_and_one_line(tracker_env, rejecting_wandb_server):
    """The fallback after a 401 left the online attempt's run folder in <output_dir>/wandb, its `Find logs at` line
    after the sync command, and `Failed to export metrics batch code: 401` lines (found in audit)."""
    out = tracker_env / "out"
    args = [str(out), "wandb", "1", "3", "none", "0.0", "finish"]
    result = run_python(TRACKED_PART, *args, WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL=rejecting_wandb_server)
    said = [line for line in result.stdout.splitlines() if line.startswith("W&B:")]
    assert said == [
        f"W&B: {rejecting_wandb_server} rejects the API key (HTTP 401; check WANDB_API_KEY or run "
        "`wandb login --relogin`); logging offline"
    ]
    (run_dir,) = offline_dirs(result.stdout)
    assert [p.name for p in (out / "wandb").iterdir() if p.name.startswith(("run-", "offline-run-"))] == [run_dir.name]
    printed = result.stdout + result.stderr
    assert "401" not in printed.replace(said[0], "")
    logs = [line for line in printed.splitlines() if "Find logs at" in line]
    assert logs and all(run_dir.name in line for line in logs)
    assert [row["_step"] for row in wandb_run(run_dir)["history"] if "train/loss" in row] == [1, 2, 3]


@pytest.mark.parametrize("status, rejected", [(200, False), (401, True), (403, False), (500, False)])
def test_only_a_401_to_the_key_is_a_rejected_key(status, rejected):
    """The key check before wandb.init (found in review: only the 401 path was tested): a server that takes the key,
    or fails otherwise, is left to wandb.init; the key goes as W&B sends it (HTTP basic, user `api`)."""
    import base64
    import threading
    import types
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from cloudtrain.observe.tracking import wandb_key_rejected

    seen: list[str] = []

    class Answer(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(f"{self.path} {self.headers.get('Authorization')}")
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = types.SimpleNamespace(api_key=FAKE_KEY, base_url=f"http://127.0.0.1:{server.server_port}")
        assert wandb_key_rejected(settings) is rejected
    finally:
        server.shutdown()
    assert seen == [f"/graphql Basic {base64.b64encode(f'api:{FAKE_KEY}'.encode()).decode()}"]
