"""Experiment tracking with the real trackers, offline: what each backend stores is read back.

Training runs use the tiny random model. trackio is pointed at a per-test HF_HOME, W&B at a per-test
HOME (so no real login is found) and, where a network is needed, at servers on 127.0.0.1.
"""

import http.server
import json
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import ENTRY, REPO, child_pythonpath, run_cli

from cloudtrain import pipeline
from cloudtrain.config import TrackingConfig, build_config
from cloudtrain.errors import UserError
from cloudtrain.observe import mlflow_tracker, tracking
from cloudtrain.observe.plotting import curve_data, plot_training_curves
from cloudtrain.observe.tracking import reachable, read_metrics

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def tracker_env(tmp_path, monkeypatch) -> Path:
    """No WANDB_*/MLFLOW_*/TRACKIO_* settings; HOME (W&B's login lookup) and HF_HOME (trackio's store) in tmp."""
    for name in list(os.environ):
        if name.startswith(("WANDB_", "MLFLOW_", "TRACKIO_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path


def train_args(tiny_model_dir, topic_csvs, out, *extra) -> list[str]:
    return [
        "--model_name_or_path",
        tiny_model_dir,
        "--train_file",
        str(topic_csvs["train"]),
        "--validation_file",
        str(topic_csvs["validation"]),
        "--test_file",
        str(topic_csvs["test"]),
        "--output_dir",
        str(out),
        "--max_steps",
        "6",
        "--per_device_train_batch_size",
        "8",
        "--logging_steps",
        "2",
        "--learning_rate",
        "1e-3",
        *extra,
    ]


def train_loss(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]


def trackio_rows(hf_home: Path, project: str = "cloudtrain") -> list[tuple[str, int, dict]]:
    """(run id, step, metrics) of every row in trackio's database for the project."""
    import sqlite3

    with sqlite3.connect(hf_home / "trackio" / f"{project}.db") as db:
        rows = db.execute("SELECT run_id, step, metrics FROM metrics ORDER BY id").fetchall()
    return [(run_id, step, json.loads(metrics)) for run_id, step, metrics in rows]


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def scalar_tags(event_file: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(event_file))
    events.Reload()
    return events.Tags()["scalars"]


def wandb_records(run_file: Path):
    """The protobuf records of a W&B .wandb file (a LevelDB-style log of 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            yield record
            chunk = b""


def wandb_run(run_dir: Path) -> dict:
    """What an offline W&B run directory holds: run id, config, history rows, artifacts."""
    (run_file,) = run_dir.glob("run-*.wandb")
    run = {"id": None, "config": {}, "history": [], "artifacts": []}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
        if kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            run["config"].update({u.key: json.loads(u.value_json) for u in updates})
        elif kind == "history":
            run["history"].append(
                {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            )
        elif kind == "artifact":
            run["artifacts"].append(record.artifact)
    return run


def offline_dirs(stdout: str) -> list[Path]:
    """The run directories of the `wandb sync` command the application printed."""
    (line,) = [line for line in stdout.splitlines() if line.startswith("W&B ran offline; to upload this run:")]
    return [Path(word) for word in line.split(":", 1)[1].split() if word.startswith("/")]


TRACKED_PART = textwrap.dedent("""
    import sys
    from pathlib import Path
    from cloudtrain.config import build_config
    from cloudtrain.observe.tracking import RunLog

    out, report_to, first, last, resume_step, offset, finish = sys.argv[1:]
    cfg = build_config({"report_to": report_to, "output_dir": out, "run_name": "resumable"})
    run_log = RunLog(cfg, Path(out), True, {"num_parameters": 10, "device": "cpu", "num_processes": 1,
                                            "training_type": "basic"},
                     resume_step=None if resume_step == "none" else int(resume_step))
    for step in range(int(first), int(last) + 1):
        run_log.log({"train/loss": float(offset) + step / 100}, step=step)
    if finish == "finish":
        run_log.finish({"train": {"global_step": int(last), "train_loss": 0.5},
                        "eval": {"accuracy": 0.8, "confusion_matrix": [[2, 1], [0, 3]]}}, ["a", "b"])
""")

# Prepended to TRACKED_PART by tracked_part(spy=...): records each reachability probe (url, timeout, answer)
# and each wandb.init (its mode) in the JSON file named by TRACKING_SPY, without changing what they do.
SPY = textwrap.dedent("""
    import atexit, json, os
    import wandb
    import cloudtrain.observe.tracking

    _calls = {"reachable": [], "init_modes": []}
    atexit.register(lambda: open(os.environ["TRACKING_SPY"], "w").write(json.dumps(_calls)))
    _real_reachable, _real_init = cloudtrain.observe.tracking.reachable, wandb.init

    def _reachable(url, timeout):
        answered = _real_reachable(url, timeout)
        _calls["reachable"].append([url, timeout, answered])
        return answered

    def _init(*args, **kwargs):
        _calls["init_modes"].append(kwargs.get("mode"))
        return _real_init(*args, **kwargs)

    cloudtrain.observe.tracking.reachable, wandb.init = _reachable, _init
""")


def tracked_part(
    out: Path,
    report_to: str,
    first: int,
    last: int,
    resume_step: int | None = None,
    offset: float = 0.0,
    finish: bool = True,
    spy: Path | None = None,
    **env: str,
) -> str:
    """One process that opens a RunLog (resuming at `resume_step`), logs steps first..last; its stdout.
    With `spy`, that file receives the process's reachability probes and wandb.init modes (see SPY)."""
    args = [
        str(out),
        report_to,
        str(first),
        str(last),
        str(resume_step).lower(),
        str(offset),
        "finish" if finish else "stop",
    ]
    script = TRACKED_PART if spy is None else SPY + TRACKED_PART
    if spy is not None:
        env["TRACKING_SPY"] = str(spy)
    return run_python(script, *args, **env).stdout


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


# ---------------------------------------------------------------- one run, three local trackers


@pytest.mark.slow
def test_trackio_tensorboard_mlflow_match_metrics_jsonl(tiny_model_dir, topic_csvs, tracker_env):
    out = tracker_env / "out"
    result = run_cli(
        *train_args(
            tiny_model_dir,
            topic_csvs,
            out,
            "--report_to",
            "trackio,tensorboard,mlflow",
            "--training_type",
            "basic",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "3",
            "--run_name",
            "tiny-run",
            "--tags",
            "smoke,cpu",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Creating initial MLflow database tables" not in result.stderr  # MLflow's INFO lines, kept off (audit)
    expected = train_loss(out)
    assert [step for step, _ in expected] == [2, 4, 6]
    runs = json.loads((out / "tracker_runs.json").read_text())

    rows = trackio_rows(tracker_env / "hf")
    assert {run_id for run_id, _, _ in rows} == {runs["trackio"]["id"]}  # one run
    assert [(step, m["train/loss"]) for _, step, m in rows if "train/loss" in m] == expected
    assert [step for _, step, m in rows if "eval/accuracy" in m] == [3, 6]
    summary = next(m for _, _, m in rows if "summary/num_parameters" in m)
    assert summary["summary/global_step"] == 6 and summary["summary/num_parameters"] > 0
    assert any("eval/confusion_matrix" in m for _, _, m in rows)

    run_dirs = list((out / "tensorboard").iterdir())
    assert [d.name for d in run_dirs] == ["tiny-run"]
    scalars = tensorboard_scalars(run_dirs[0], "train/loss")
    assert [s for s, _ in scalars] == [s for s, _ in expected]
    assert [v for _, v in scalars] == pytest.approx([v for _, v in expected], rel=1e-6)  # stored as float32

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=runs["mlflow"]["tracking_uri"])
    history = client.get_metric_history(runs["mlflow"]["run_id"], "train/loss")
    assert sorted((m.step, m.value) for m in history) == expected
    run = client.get_run(runs["mlflow"]["run_id"])
    assert run.data.params["learning_rate"] == "0.001" and run.data.params["report_to"] == str(
        ["trackio", "tensorboard", "mlflow"]
    )
    assert {"smoke", "cpu"} <= set(run.data.tags)


def test_training_curves_png_holds_loss_and_eval_curves(tiny_model_dir, topic_csvs, tmp_path, monkeypatch):
    run_logs = []

    class KeptRunLog(tracking.RunLog):  # the real RunLog, kept so its curve data can be inspected
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            run_logs.append(self)

    monkeypatch.setattr(pipeline, "RunLog", KeptRunLog)
    out = tmp_path / "out"
    cfg = build_config(
        {
            "model_name_or_path": tiny_model_dir,
            "train_file": str(topic_csvs["train"]),
            "validation_file": str(topic_csvs["validation"]),
            "output_dir": str(out),
            "max_steps": 8,
            "per_device_train_batch_size": 8,
            "logging_steps": 2,
            "eval_strategy": "steps",
            "eval_steps": 4,
            "training_type": "basic",
        }
    )
    pipeline.run_training(cfg)
    png = (out / "training_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1100, 420)

    curves = run_logs[0].curves
    records = read_metrics(out / "metrics.jsonl")
    assert curves["loss"]["train/loss"] == ([2, 4, 6, 8], [r["train/loss"] for r in records if "train/loss" in r])
    assert curves["loss"]["eval/loss"][0] == [4, 8]
    assert set(curves["evaluation metrics"]) == {"eval/accuracy", "eval/macro_f1"}
    assert curves["evaluation metrics"]["eval/accuracy"] == (
        [4, 8],
        [r["eval/accuracy"] for r in records if "eval/accuracy" in r],
    )


# ---------------------------------------------------------------- W&B


@pytest.mark.slow
def test_wandb_without_credentials_runs_offline(tiny_model_dir, topic_csvs, tracker_env):
    out = tracker_env / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own notes")  # never uploaded (it was: found in audit)
    result = run_cli(
        *train_args(
            tiny_model_dir,
            topic_csvs,
            out,
            "--report_to",
            "wandb",
            "--log_model",
            "true",
            "--project_name",
            "tracking-test",
            "--peft",
            "lora",
            "--merge_adapters",
            "true",
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "W&B: no credentials (set WANDB_API_KEY or run `wandb login`); logging offline" in result.stdout
    (run_dir,) = offline_dirs(result.stdout)
    assert run_dir.parent == out / "wandb" and run_dir.name.startswith("offline-run-")

    run = wandb_run(run_dir)
    assert run["id"] == json.loads((out / "tracker_runs.json").read_text())["wandb"]["id"]
    args = json.loads((out / "args.json").read_text())
    assert {k: run["config"][k] for k in args} == args  # the full resolved configuration
    assert run["config"]["num_parameters"] > 0 and run["config"]["device"] == "cpu"
    logged = [(row["_step"], row["train/loss"]) for row in run["history"] if "train/loss" in row]
    assert logged == train_loss(out)
    assert any("eval/confusion_matrix_table" in key for row in run["history"] for key in row)
    (model,) = [a for a in run["artifacts"] if a.type == "model"]
    assert model.name == f"model-{run['id']}"
    # the model's sub-folders too (a merged model; a diffusers pipeline's parts were left out: found in audit)
    expected = {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "merged/model.safetensors"}
    assert expected <= {e.path for e in model.manifest.contents}
    assert "notes.txt" not in {e.path for e in model.manifest.contents}


EVENT_PART = textwrap.dedent("""
    import sys
    from pathlib import Path
    from cloudtrain.config import build_config
    from cloudtrain.observe.tracking import RunLog

    out = sys.argv[1]
    cfg = build_config({"report_to": "wandb,tensorboard", "output_dir": out, "run_name": "spiky"})
    run_log = RunLog(cfg, Path(out), True, {"num_parameters": 10, "device": "cpu", "num_processes": 1,
                                            "training_type": "basic"})
    for step in (5, 10, 15):
        run_log.log({"train/loss": step / 100}, step=step)
    run_log.event("loss_spike", "loss spike at step 13", 54.7, step=13)  # found at the logging step 15
    run_log.finish({"train": {"global_step": 15, "train_loss": 0.5}}, [])
""")


@pytest.mark.slow
def test_an_anomaly_found_after_its_step_reaches_w_and_b(tracker_env):
    """W&B drops a value logged at a step before its newest: the anomaly of step 13, found at the logging step
    15, never reached it (found in audit). It goes up at step 15; metrics.jsonl keeps its own step."""
    out = tracker_env / "out"
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": child_pythonpath()}
    result = subprocess.run([sys.executable, "-c", EVENT_PART, str(out)], capture_output=True, text=True,
                            timeout=300, cwd=REPO, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    history = wandb_run(run_dir)["history"]
    assert [(row["_step"], row["anomaly/loss_spike"]) for row in history if "anomaly/loss_spike" in row] == [(15, 54.7)]
    (event,) = [e for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "event" in e]
    assert (event["step"], event["event"]) == (13, "loss_spike")


@pytest.fixture
def silent_server():
    """A TCP port on 127.0.0.1 that accepts connections and never answers: a network that hangs."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_reachable_gives_up_after_its_timeout(silent_server, monkeypatch):
    """A server that accepts and never answers is unreachable; so is a probe that hangs for good (a DNS
    lookup is not bound by the socket timeout): reachable() stops waiting at its timeout and says False."""
    assert reachable(silent_server, timeout=0.5) is False

    release, timeouts = threading.Event(), []

    def hanging_urlopen(request, timeout):
        timeouts.append(timeout)
        release.wait(120)  # far past the probe's timeout; then it would report an answer
        raise urllib.error.HTTPError(request.full_url, 401, "late answer", None, None)

    monkeypatch.setattr(urllib.request, "urlopen", hanging_urlopen)
    try:
        assert reachable("https://api.wandb.invalid", timeout=0.2) is False  # True only if it had waited
        deadline = time.monotonic() + 10  # the probe's thread may start late on a busy machine
        while not timeouts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert timeouts == [0.2]  # the socket timeout is the probe's own
    finally:
        release.set()


def test_reachable_counts_any_http_answer(rejecting_wandb_server):
    """A server that answers, even with an error status, is reachable: W&B then decides about the key."""
    assert reachable(rejecting_wandb_server, timeout=3.0) is True


@pytest.mark.slow
def test_wandb_with_key_but_no_network_falls_back_without_waiting_for_wandb(tracker_env, silent_server):
    out, spy = tracker_env / "out", tracker_env / "spy.json"
    stdout = tracked_part(out, "wandb", 1, 3, spy=spy, WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL=silent_server)
    assert f"W&B: {silent_server} cannot be reached (no answer within 3 s); logging offline" in stdout
    calls = json.loads(spy.read_text())
    # One 3-second probe of the configured server found no answer, so W&B was started offline, once: an
    # online wandb.init (which would wait out W&B's own init timeout, then fail) was never attempted.
    assert calls["reachable"] == [[silent_server, tracking.WANDB_CONNECT_TIMEOUT_S, False]]
    assert tracking.WANDB_CONNECT_TIMEOUT_S == 3.0
    assert calls["init_modes"] == ["offline"]
    (run_dir,) = offline_dirs(stdout)
    assert [row["_step"] for row in wandb_run(run_dir)["history"] if "train/loss" in row] == [1, 2, 3]


# ---------------------------------------------------------------- several processes, resume


@pytest.mark.slow
def test_two_processes_make_one_tracker_run(tiny_model_dir, topic_csvs, tracker_env):
    out = tracker_env / "out"
    # gloo on CPU; the GPU (if any) hidden so that two ranks never share it
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(ENTRY),
            "--training_type",
            "accelerated",
            *train_args(tiny_model_dir, topic_csvs, out, "--report_to", "tensorboard,trackio"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es)" in result.stdout
    event_files = [f for f in (out / "tensorboard").rglob("events.out.tfevents.*") if "train/loss" in scalar_tags(f)]
    assert len(list((out / "tensorboard").iterdir())) == 1 and len(event_files) == 1
    rows = trackio_rows(tracker_env / "hf")
    assert len({run_id for run_id, _, _ in rows}) == 1
    assert [step for _, step, m in rows if "train/loss" in m] == [2, 4, 6]  # logged once, not per process
    assert [step for step, _ in train_loss(out)] == [2, 4, 6]


@pytest.fixture
def rejecting_wandb_server():
    """A W&B server on 127.0.0.1 that rejects every API key, as W&B does a wrong one."""

    class Reject(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = b'{"errors": [{"message": "invalid api key"}]}'
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_HEAD = do_POST

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Reject)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.slow
def test_resume_continues_the_same_tracker_runs(tracker_env, rejecting_wandb_server):
    out, trackers = tracker_env / "out", "wandb,trackio,tensorboard"
    # Part one: a key the server rejects (so W&B falls back to offline); logs steps 1-6, then stops.
    first = tracked_part(
        out, trackers, 1, 6, finish=False, WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL=rejecting_wandb_server
    )
    assert f"W&B: {rejecting_wandb_server} rejects the API key (HTTP 401; check WANDB_API_KEY" in first
    ids = json.loads((out / "tracker_runs.json").read_text())
    # Another experiment under the same --run_name: trackio resumes the newest run of a name, so it takes another
    other = tracked_part(tracker_env / "other", "trackio", 1, 2, offset=5.0)
    assert "trackio: project cloudtrain has a run named resumable already; this one is resumable-2" in other
    # Part two resumes from a checkpoint at step 4: steps 5-8 are logged again, with new values.
    second = tracked_part(out, trackers, 5, 8, resume_step=4, offset=1.0)
    assert json.loads((out / "tracker_runs.json").read_text())["trackio"]["id"] == ids["trackio"]["id"]

    expected = [(s, s / 100) for s in range(1, 5)] + [(s, 1.0 + s / 100) for s in range(5, 9)]
    assert train_loss(out) == expected

    dirs = offline_dirs(second)
    assert f"wandb sync --id {ids['wandb']['id']} " in second and len(dirs) == 2
    parts = [wandb_run(d) for d in dirs]
    assert parts[0]["id"] == parts[1]["id"] == ids["wandb"]["id"]
    assert [row["_step"] for row in parts[1]["history"] if "train/loss" in row] == [5, 6, 7, 8]

    other_id = json.loads((tracker_env / "other" / "tracker_runs.json").read_text())["trackio"]["id"]
    rows = trackio_rows(tracker_env / "hf")
    assert {run_id for run_id, _, _ in rows} == {ids["trackio"]["id"], other_id}
    rows = [row for row in rows if row[0] == ids["trackio"]["id"]]
    resumed = [(step, m["train/loss"]) for _, step, m in rows if "train/loss" in m][6:]
    assert resumed == expected[4:]  # part one's steps 5-6 stay in trackio's history, before these

    (run_dir,) = (out / "tensorboard").iterdir()
    assert run_dir.name == "resumable"
    scalars = tensorboard_scalars(run_dir, "train/loss")  # part one's steps after 4 are hidden
    assert [s for s, _ in scalars] == list(range(1, 9))
    assert [v for _, v in scalars] == pytest.approx([v for _, v in expected], rel=1e-6)


# ---------------------------------------------------------------- checks before training


def test_check_trackers_rejects_unusable_choices(monkeypatch):
    with pytest.raises(UserError, match="--log_model true uploads the model to W&B: add wandb to --report_to"):
        tracking.check_trackers(TrackingConfig(report_to=["tensorboard"], log_model=True))
    monkeypatch.setitem(tracking.PACKAGES, "mlflow", "mlflow_not_installed_here")
    with pytest.raises(UserError, match="--report_to mlflow needs the mlflow_not_installed_here package"):
        tracking.check_trackers(TrackingConfig(report_to=["mlflow"]))
    tracking.check_trackers(TrackingConfig(report_to=["wandb", "trackio", "tensorboard"], log_model=True))
    monkeypatch.setenv("WANDB_MODE", "ofline")  # W&B's own 50-line pydantic traceback, after the data (audit)
    with pytest.raises(UserError, match="WANDB_MODE=ofline is not a W&B mode: set one of online, offline"):
        tracking.check_trackers(TrackingConfig(report_to=["wandb"]))
    tracking.check_trackers(TrackingConfig(report_to=["tensorboard"]))  # not W&B's run: its variable is not read
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(UserError, match=rf"^--tags '{'x' * 65}' has 65 characters: W&B takes tags of 1 to 64$"):
        tracking.check_trackers(TrackingConfig(report_to=["wandb"], tags=["fine", "x" * 65]))  # pydantic's 45 lines
    tracking.check_trackers(TrackingConfig(report_to=["wandb"], tags=["x" * 64]))
    tracking.check_trackers(TrackingConfig(report_to=["tensorboard"], tags=["x" * 65]))  # only W&B limits them


def test_a_tracker_named_twice_is_refused_and_a_run_name_stays_one_folder_of_tensorboard():
    """wandb,wandb ended the run with a traceback after the save; tensorboard,tensorboard logged everything twice;
    --run_name ../../x wrote the event files outside the output folder (found in audit)."""
    with pytest.raises(UserError, match="--report_to names wandb twice; name each tracker once"):
        TrackingConfig(report_to=["wandb", "tensorboard", "wandb"]).check()
    assert [tracking.folder_name(n) for n in ("../../escaped", "a\\b", "..", "plain")] == [
        ".._.._escaped",
        "a_b",
        "__",
        "plain",
    ]


def test_w_and_b_settings_it_refuses_are_one_line(monkeypatch, tmp_path):
    import wandb

    wandb.teardown()  # wandb.setup() reads the variables once per process: not an earlier test's
    monkeypatch.setenv("WANDB_BASE_URL", "localhost:8080/x y")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    with pytest.raises(UserError, match=r"^W&B refuses its settings \(base_url: .+\): check the WANDB_\* variables"):
        tracking.wandb_offline_reason()


def test_a_kill_while_a_resumed_run_cuts_its_log_back_leaves_the_old_log_whole(tmp_path, monkeypatch):
    """On resume, metrics.jsonl is cut back to the checkpoint's step: written beside the old log and renamed
    over it, so a kill before the rename loses no line (it used to be truncated and rewritten in place)."""
    from cloudtrain.publish import atomic

    lines = "".join(json.dumps({"step": s, "time": 0.0, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(lines)

    def killed_before_the_rename(source, target) -> None:
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(atomic.os, "replace", killed_before_the_rename)
    with pytest.raises(KeyboardInterrupt):
        tracking.RunLog(build_config({"report_to": ["none"]}), tmp_path, True, {}, resume_step=2)
    assert (tmp_path / "metrics.jsonl").read_text() == lines
    monkeypatch.undo()
    tracking.RunLog(build_config({"report_to": ["none"]}), tmp_path, True, {}, resume_step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow  # fresh processes: the full suite runs it
def test_an_mlflow_run_whose_store_was_emptied_resumes_into_a_new_run(tracker_env):
    """A spot restart into an emptied output folder brings tracker_runs.json back from the checkpoint, naming a run
    its SQLite store no longer has: MLflow's "Run not found" traceback ended the job (found in audit)."""
    out = tracker_env / "out"
    tracked_part(out, "mlflow", 1, 3, finish=False)
    lost = json.loads((out / "tracker_runs.json").read_text())["mlflow"]["run_id"]
    shutil.rmtree(out / "mlruns")
    said = tracked_part(out, "mlflow", 3, 4, resume_step=2)
    assert f"note: MLflow run {lost} is not in sqlite:///" in said and "logs to a new MLflow run" in said
    assert json.loads((out / "tracker_runs.json").read_text())["mlflow"]["run_id"] != lost


@pytest.mark.slow  # fresh processes: the full suite runs it
def test_a_resume_says_which_offline_w_and_b_parts_are_gone_and_syncs_the_rest(tracker_env):
    """A spot restart into an emptied output folder: the sync command named part one's missing folder, so `wandb
    sync` failed and the loss went unsaid (found in audit)."""
    out = tracker_env / "out"
    tracked_part(out, "wandb", 1, 3, finish=False)
    (lost,) = json.loads((out / "tracker_runs.json").read_text())["wandb"]["offline_dirs"]
    shutil.rmtree(lost)
    said = tracked_part(out, "wandb", 3, 4, resume_step=2)
    assert f"W&B: 1 earlier offline part(s) of this run are gone with their folder ({lost})" in said
    (kept,) = offline_dirs(said)
    assert kept.is_dir() and str(kept) != lost


def test_an_mlflow_store_that_cannot_be_used_is_one_line(silent_server, tmp_path):
    """A server that does not answer, or a database in a folder that cannot be written: minutes of MLflow's retries
    and a traceback of 130-200 lines (found in audit)."""
    with pytest.raises(UserError, match=rf"MLflow at {silent_server} \(MLFLOW_TRACKING_URI\) cannot be reached within"):
        mlflow_tracker.check_mlflow_store(silent_server, "MLFLOW_TRACKING_URI")
    (tmp_path / "a-file").write_text("")  # where the database's folder would be made
    with pytest.raises(UserError, match=f"MLflow's database sqlite:///{tmp_path}/a-file/x/m.db .* cannot be written"):
        mlflow_tracker.check_mlflow_store(f"sqlite:///{tmp_path}/a-file/x/m.db", "MLFLOW_TRACKING_URI")
    mlflow_tracker.check_mlflow_store(f"sqlite:///{tmp_path}/m.db", "x")  # a writable folder: fine
    mlflow_tracker.check_mlflow_store(f"sqlite:///{tmp_path}/new/dir/m.db", "x")  # MLflow makes the folders (review)


def test_a_server_whose_certificate_is_not_trusted_here_has_answered(tmp_path):
    """An MLflow server with a private CA's certificate (MLflow's own TLS settings trust it) was taken for one that
    does not answer (found in review)."""
    import ssl as ssl_module

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                           str(cert), "-days", "1", "-subj", "/CN=localhost"], capture_output=True)  # fmt: skip
    if made.returncode:
        pytest.fail(f"openssl could not make a certificate: {made.stderr[-500:]}")
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    context = ssl_module.SSLContext(ssl_module.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert tracking.reachable(f"https://127.0.0.1:{server.server_port}", 3)
    finally:
        server.shutdown()


def test_an_mlflow_server_that_does_not_answer_is_not_taken_for_a_lost_run(monkeypatch):
    """Only "no such run" starts a new run on resume: a server that is down would split the history (review)."""
    from types import SimpleNamespace

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with pytest.raises(UserError, match=f"MLflow at {url} could not be asked for run abc .*start its server") as err:
        mlflow_tracker.MLflow._exists(SimpleNamespace(tracking_uri=url), "abc")
    assert err.value.transient


def test_metrics_jsonl_is_strict_json_and_a_value_that_is_not_finite_is_a_gap_in_its_curve(tmp_path):
    """A NaN correlation or an infinite perplexity was written as bare NaN/Infinity, which jq and JSON.parse
    refuse (left alone earlier): it is null, and the curves leave it out."""
    log = tracking.RunLog(build_config({"report_to": ["none"]}), tmp_path, True, {}, resume_step=None)
    log.log({"train/loss": 2.0, "eval/pearson": float("nan"), "eval/perplexity": float("inf")}, step=1)
    log.log({"train/loss": 1.5, "eval/pearson": 0.5, "eval/perplexity": 9.0}, step=2)

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, second = (json.loads(line, parse_constant=refuse) for line in lines)
    assert (first["eval/pearson"], first["eval/perplexity"], second["eval/pearson"]) == (None, None, 0.5)
    curves = plot_training_curves(read_metrics(tmp_path / "metrics.jsonl"), tmp_path / "curves.png")
    steps, values = curves["evaluation metrics"]["eval/pearson"]  # the null is a gap (nan), not a line through it
    assert steps == [1, 2] and math.isnan(values[0]) and values[1] == 0.5
    steps, values = curves["perplexity"]["eval/perplexity"]
    assert steps == [1, 2] and math.isnan(values[0]) and values[1] == 9.0
    assert curves["loss"]["train/loss"] == ([1, 2], [2.0, 1.5])
    counts = curve_data([{"step": 1, "eval/f1": 60.0, "eval/has_answer_total": 412, "eval/no_answer_total": 88}])
    assert list(counts["evaluation metrics, other scales"]) == ["eval/f1"]  # counts are not metrics (found in audit)


def test_a_fresh_run_starts_its_validation_grids_anew_and_a_resume_keeps_those_before_it(tmp_path):
    """--overwrite_output_dir over a text-to-image run kept its grids, and the newest-named one, the earlier run's,
    was shown on the new run's card and pushed (found in audit). The grids follow metrics.jsonl."""
    from cloudtrain.config import build_config
    from cloudtrain.observe.tracking import RunLog

    cfg = build_config({"report_to": "none", "output_dir": str(tmp_path)})
    folder = tmp_path / "validation"

    def grids(*steps: int) -> None:
        folder.mkdir(exist_ok=True)
        for step in steps:
            (folder / f"eval-step-{step:06d}.png").write_bytes(b"png")

    grids(2, 4)
    (folder / "mine.png").write_bytes(b"a user's")
    RunLog(cfg, tmp_path, True, {}, resume_step=2)  # a resume at step 2: step 4's is redone
    assert sorted(p.name for p in folder.iterdir()) == ["eval-step-000002.png", "mine.png"]
    RunLog(cfg, tmp_path, True, {})  # a fresh run
    assert sorted(p.name for p in folder.iterdir()) == ["mine.png"]


def test_a_resume_over_a_log_cut_mid_line_or_damaged_goes_on_from_what_parses(tmp_path, capsys):
    """A kill or a full disk mid-write left metrics.jsonl's last line cut: every resume failed with a
    JSONDecodeError traceback (found in audit). A cut last line is dropped; other damage falls back to the
    checkpoint's copy of the log, the damaged file kept; with no copy, one line naming the file."""
    cfg = build_config({"report_to": "none", "output_dir": str(tmp_path)})
    lines = [json.dumps({"step": step, "time": 0, "loss": 1.0 / step}) for step in (1, 2, 3, 4)]
    log = tmp_path / "metrics.jsonl"
    log.write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    tracking.RunLog(cfg, tmp_path, True, {}, resume_step=3)
    assert [r["step"] for r in tracking.read_metrics(log)] == [1, 2, 3]

    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    damaged = lines[0] + "\n" + "{not json\n" + lines[2] + "\n"
    log.write_text(damaged)
    tracking.RunLog(cfg, tmp_path, True, {}, resume_step=2, checkpoint=checkpoint)
    assert [r["step"] for r in tracking.read_metrics(log)] == [1, 2]
    assert (tmp_path / "metrics.damaged.jsonl").read_text() == damaged
    assert "line 2 is not a JSON record" in capsys.readouterr().out

    log.write_text(damaged)
    with pytest.raises(UserError, match="line 2 is not a JSON record.*mend or remove it"):
        tracking.RunLog(cfg, tmp_path, True, {}, resume_step=2)


# ---------------------------------------------------------------- a real MLflow server


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on 127.0.0.1 (SQLite store, artifacts proxied into tmp_path/server-artifacts), in a
    process group of its own: (url, process group id, artifacts folder)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    artifacts, log = tmp_path / "server-artifacts", (tmp_path / "mlflow-server.log").open("w")
    mlflow_cli = Path(sys.executable).parent / "mlflow"
    server = subprocess.Popen(
        [str(mlflow_cli) if mlflow_cli.exists() else "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(artifacts)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # its first start migrates the database: many seconds on a busy machine
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start: {(tmp_path / 'mlflow-server.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield url, server.pid, artifacts
    finally:
        try:
            os.killpg(server.pid, 9)
        except ProcessLookupError:  # the test took it down
            pass
        server.wait()
        log.close()


SERVER_GOES_DOWN = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from cloudtrain.config import build_config
    from cloudtrain.observe.tracking import RunLog

    out, server_group = sys.argv[1], int(sys.argv[2])
    cfg = build_config({"report_to": "mlflow,tensorboard", "output_dir": out, "run_name": "down"})
    run_log = RunLog(cfg, Path(out), True, {"num_parameters": 10})
    print("retries", *(os.environ.get(f"MLFLOW_HTTP_REQUEST_{name}") for name in ("MAX_RETRIES", "TIMEOUT")))
    run_log.log({"train/loss": 0.3}, step=1)
    os.killpg(server_group, signal.SIGKILL)  # the server goes down mid-run
    run_log.log({"train/loss": 0.2}, step=2)
    run_log.event("loss_spike", "loss spike at step 3", 9.0, step=3)
    run_log.log({"train/loss": 0.1}, step=3)
    run_log.finish({"train": {"global_step": 3, "train_loss": 0.2}}, [])
    print("trackers left", [t.name for t in run_log.trackers])
""")


@pytest.mark.slow  # a real MLflow server
def test_an_mlflow_server_gone_down_mid_run_is_dropped_with_one_line_and_the_run_goes_on(tracker_env, mlflow_server):
    """MLflow retried for about 4 minutes, then its 90-line traceback ended the run unsaved (found in audit): tracking
    is auxiliary, so the tracker is dropped with one line, the other trackers and metrics.jsonl go on, and MLflow's
    retries are capped where the user did not set them."""
    url, server_group, _ = mlflow_server
    out = tracker_env / "out"
    env = {**os.environ, "MLFLOW_TRACKING_URI": url, "PYTHONPATH": child_pythonpath()}
    result = subprocess.run([sys.executable, "-c", SERVER_GOES_DOWN, str(out), str(server_group)], capture_output=True,
                            text=True, timeout=300, cwd=REPO, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "retries 2 10" in result.stdout  # MLflow's own: 7 retries of up to 120 s each
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, result.stdout
    assert warnings[0].startswith("warning: mlflow failed (API request to ")
    assert warnings[0].endswith("; the run goes on without it")
    assert "trackers left ['tensorboard']" in result.stdout
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3]
    assert (out / "training_curves.png").is_file()
    (run_dir,) = (out / "tensorboard").iterdir()
    assert [s for s, _ in tensorboard_scalars(run_dir, "train/loss")] == [1, 2, 3]


@pytest.mark.slow  # a real MLflow server
def test_runs_on_an_mlflow_server_keep_their_artifacts_on_the_server(tracker_env, mlflow_server, monkeypatch):
    """The first run made the experiment with its own <output_dir>/mlruns/artifacts as the artifact location: every
    later run's artifacts went to that folder, the server held none (found in audit)."""
    from mlflow.tracking import MlflowClient

    url, _, server_artifacts = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    ids = []
    for name in ("first", "second"):
        tracked_part(tracker_env / name, "mlflow", 1, 2)
        ids.append(json.loads((tracker_env / name / "tracker_runs.json").read_text())["mlflow"]["run_id"])
    client = MlflowClient(url)
    assert client.get_experiment_by_name("cloudtrain").artifact_location.startswith("mlflow-artifacts:")
    for run_id in ids:
        assert client.get_run(run_id).info.artifact_uri.startswith("mlflow-artifacts:")
        assert "training_curves.png" in [f.path for f in client.list_artifacts(run_id)]
        assert list(server_artifacts.rglob(f"{run_id}/artifacts/training_curves.png"))
    assert not list((tracker_env / "first" / "mlruns").rglob("*.png"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the output folder's own store keeps them beside it
    tracked_part(tracker_env / "local", "mlflow", 1, 2)
    assert list((tracker_env / "local" / "mlruns" / "artifacts").rglob("training_curves.png"))


@pytest.mark.slow  # a real MLflow server
def test_an_mlflow_uri_with_a_password_is_reached_and_its_password_not_stored(tracker_env, mlflow_server, monkeypatch):
    """http://user:pw@host:port was refused as unreachable (urllib took the user and password for part of the host),
    and past that the URI, password and all, was stored in tracker_runs.json (found in audit). A resume still finds
    the run: by MLFLOW_TRACKING_URI, or without it by the stored URI less its user and password."""
    from mlflow.tracking import MlflowClient

    url, _, _ = mlflow_server
    with_password = url.replace("http://", "http://alice:s3cret-pw@")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", with_password)
    out = tracker_env / "out"
    said = tracked_part(out, "mlflow", 1, 3, finish=False)
    stored = (out / "tracker_runs.json").read_text()
    assert "s3cret-pw" not in stored and "s3cret-pw" not in said
    run = json.loads(stored)["mlflow"]
    assert run["tracking_uri"] == url.replace("http://", "http://***@")
    tracked_part(out, "mlflow", 3, 4, resume_step=2, finish=False)  # MLFLOW_TRACKING_URI given again
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    tracked_part(out, "mlflow", 5, 6, resume_step=4)  # the stored URI, less its masked user and password
    assert json.loads((out / "tracker_runs.json").read_text())["mlflow"]["run_id"] == run["run_id"]
    history = MlflowClient(url).get_metric_history(run["run_id"], "train/loss")
    assert sorted({m.step for m in history}) == [1, 2, 3, 4, 5, 6]
    assert "s3cret-pw" not in (out / "tracker_runs.json").read_text()


def test_trackio_in_a_sagemaker_job_writes_into_the_output_folder(tracker_env):
    """Inside a job trackio wrote under the container's $HF_HOME, gone with the job, and nothing said so (found in
    audit): its database goes under <output_dir>/trackio, which model.tar.gz keeps."""
    out = tracker_env / "model"
    tracked_part(out, "trackio", 1, 2, SM_MODEL_DIR=str(out))
    assert (out / "trackio" / "cloudtrain.db").is_file()
    assert not (tracker_env / "hf" / "trackio" / "cloudtrain.db").exists()
