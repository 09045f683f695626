"""Ctrl-C during training, as a terminal sends it (SIGINT to the whole process group, data-loader workers included):
once, a checkpoint and a clean stop; twice, a stop at once, without one. The real entry script, a tiny model.
A launcher's SIGTERM, which reaches the loader workers too, leaves them alive."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO
from test_checkpointing import args_for, complete_checkpoints, env, run, start, wait_for

LATEST = ("--resume_from_checkpoint", "latest")
PROMISE = "Ctrl-C: a checkpoint is saved at the next logging step"
STEPPING = r"training: .*\| *[1-9][0-9]*/[0-9]+ "  # the bar past its first step: inside the loop


class Stderr:
    """The child's standard error as it comes (tqdm redraws without newlines, so bytes, not lines)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.text = proc, ""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        while chunk := os.read(self.proc.stderr.fileno(), 4096):
            self.text += chunk.decode(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text):
            assert self.proc.poll() is None, f"exited early: {self.text[-3000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {pattern!r}: {self.text[-3000:]}"
            time.sleep(0.01)

    def end(self) -> int:
        code = self.proc.wait(timeout=120)
        self.thread.join(timeout=30)
        return code


def ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # start() gives the run its own session: its group is the run's


@pytest.mark.slow
def test_one_ctrl_c_saves_a_checkpoint_then_stops(tiny_model_dir, topic_csvs, tmp_path, monkeypatch):
    monkeypatch.setenv("CLOUDTRAIN_PROGRESS_BARS", "1")  # the bar tells the test the loop has started
    out = tmp_path / "out"
    options = ["--max_steps", "3000", "--eval_strategy", "no", "--dataloader_num_workers", "1"]
    proc = start([sys.executable] + args_for(tiny_model_dir, topic_csvs, out, *options))
    err = Stderr(proc)
    err.wait_for(STEPPING)
    ctrl_c(proc)
    assert err.end() == 130
    assert err.text.count(PROMISE) == 1  # from the run, not again from its data-loader worker
    assert "stopped: Ctrl-C at step" in err.text and "--resume_from_checkpoint latest" in err.text
    assert "Traceback" not in err.text
    ((step, path),) = complete_checkpoints(out / "checkpoints")  # no --checkpointing_steps: saved all the same
    assert 0 < step < 3000 and (path / "model.safetensors").exists()


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tiny_model_dir, topic_csvs, tmp_path, monkeypatch):
    monkeypatch.setenv("CLOUDTRAIN_PROGRESS_BARS", "1")  # the bar tells the test the loop has started
    out = tmp_path / "out"
    never = ["--max_steps", "100000", "--logging_steps", "100000", "--eval_strategy", "no"]  # no step syncs
    proc = start([sys.executable] + args_for(tiny_model_dir, topic_csvs, out, *never))
    err = Stderr(proc)
    err.wait_for(STEPPING)
    ctrl_c(proc)
    err.wait_for(re.escape(PROMISE))
    ctrl_c(proc)
    assert err.end() == 130
    assert err.text.rstrip().endswith(
        "interrupted: nothing saved now (a first Ctrl-C during training saves a checkpoint, one after it the model); a "
        "run that saved checkpoints before continues from the newest with --resume_from_checkpoint latest"
    )
    assert "Traceback" not in err.text
    assert not (out / "checkpoints").exists() or not complete_checkpoints(out / "checkpoints")


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_during_the_final_evaluation_skips_it_and_saves_the_trained_model(
    sig, tiny_model_dir, topic_csvs, tmp_path, monkeypatch
):
    """No --checkpointing_steps: a spot reclaim or a Ctrl-C while the trained model is evaluated used to lose every
    step. The evaluation stops at its next batch; the model is saved whole, without the cut-short metrics, and the
    run ends as a stopped run does (143, 130), saying so."""
    import pandas as pd
    from conftest import topic_rows
    from safetensors.torch import load_file

    monkeypatch.setenv("CLOUDTRAIN_PROGRESS_BARS", "1")  # the evaluation's bar tells the test it has started
    long_validation = tmp_path / "long.csv"
    pd.DataFrame(topic_rows(4, 1) * 4000).to_csv(long_validation, index=False)  # minutes of evaluation
    out = tmp_path / "out"
    options = ["--max_steps", "2", "--eval_strategy", "no", "--validation_file", str(long_validation)]
    proc = start([sys.executable] + args_for(tiny_model_dir, topic_csvs, out, *options))
    err = Stderr(proc)
    err.wait_for("evaluation of validation: .*[1-9][0-9]*/")  # a few batches in
    os.killpg(proc.pid, getattr(signal, sig))
    assert err.end() == (143 if sig == "SIGTERM" else 130), err.text[-3000:]
    said = "Ctrl-C" if sig == "SIGINT" else sig
    assert f"{said}: the evaluation stops and the trained model is saved" in err.text
    assert (
        f"stopped: {sig} after the last step: the trained model is saved in {out}, without its "
        "validation evaluation" in err.text
    )
    assert "Traceback" not in err.text
    assert load_file(out / "model.safetensors")  # published whole: the manifest's check passes below
    assert json.loads((out / "train_results.json").read_text())["global_step"] == 2
    assert not (out / "eval_results.json").exists()  # a cut-short evaluation says nothing
    assert not (out / "checkpoints").exists()
    if sig == "SIGTERM":  # the scheduler requeues the job as it was: it ends at once, the model kept
        before = (out / "model.safetensors").stat().st_mtime_ns
        again = run([sys.executable] + args_for(tiny_model_dir, topic_csvs, out, *options, *LATEST))
        assert (
            f"note: {out} already holds this run's trained model (step 2), saved when SIGTERM stopped" in again.stdout
        )
        assert (out / "model.safetensors").stat().st_mtime_ns == before
        other = run([sys.executable] + args_for(tiny_model_dir, topic_csvs, out, "--max_steps", "4", *LATEST), 2)
        assert "already holds a model from an earlier run (kept)" in other.stderr  # another run: refused as before


WORKERS_SCRIPT = """
import os, signal, sys, time
import torch
from cloudtrain.training.preemption import PreemptionSignal
from cloudtrain.config import DataConfig
from cloudtrain.data.processing import loader_options

options = loader_options(DataConfig(dataloader_num_workers=1)) | {"multiprocessing_context": sys.argv[1]}
loader = iter(torch.utils.data.DataLoader(list(range(400)), batch_size=2, **options))
with PreemptionSignal() as stop:
    next(loader)  # the worker runs
    os.killpg(os.getpid(), signal.SIGINT)  # as a terminal sends it: to the worker too,
    os.kill(loader._workers[0].pid, signal.SIGINT)  # which leaves the group when it runs threads already
    time.sleep(0.5)
    batches = sum(1 for _ in loader)
print(stop.by, batches)
"""


@pytest.mark.slow
@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_a_loader_worker_not_forked_from_the_run_survives_the_first_ctrl_c(start):
    """Workers started by spawn or forkserver (macOS; Linux from Python 3.14) do not inherit the run's handler."""
    done = subprocess.run(
        [sys.executable, "-c", WORKERS_SCRIPT, start],
        capture_output=True, text=True, timeout=300, env=env(), cwd=REPO, start_new_session=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["SIGINT", "199"]  # every batch after the first, none lost with the worker


SIGTERM_SCRIPT = """
import multiprocessing, os, subprocess, threading, time
import psutil
from cloudtrain.data.processing import leave_stops_to_the_run

def serve(ready, threaded):
    if threaded:  # as a spawned or forkserver worker, whose imports start BLAS threads before its init
        threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
    leave_stops_to_the_run(0)
    ready.set()
    time.sleep(120)

def start(context, threaded=False):
    ready = context.Event()
    worker = context.Process(target=serve, args=(ready, threaded), daemon=True)
    worker.start()
    assert ready.wait(120)
    return worker

def train(pids):  # a training process with a worker, killed by the test
    pids.put(start(multiprocessing.get_context("fork")).pid)
    time.sleep(120)

def gone(pid):
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

if __name__ == "__main__":
    context = multiprocessing.get_context("fork")  # Linux's default before Python 3.14
    worker = start(context)
    subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)  # from another process: a launcher, SLURM
    time.sleep(1)
    survived = worker.is_alive()
    worker.terminate()  # from its own process, as multiprocessing and the DataLoader end a worker
    worker.join(60)
    threaded = start(context, threaded=True)
    own_group = os.getpgid(threaded.pid) == threaded.pid
    threaded.terminate()
    pids = context.Queue()
    trainer = context.Process(target=train, args=(pids,))
    trainer.start()
    orphan = pids.get(timeout=120)
    trainer.kill()
    deadline = time.monotonic() + 30
    while not gone(orphan) and time.monotonic() < deadline:
        time.sleep(0.2)
    print(survived, worker.exitcode, own_group, gone(orphan))
"""


@pytest.mark.slow  # 6-8 s of fresh processes: the full suite runs it
def test_a_loader_worker_outlives_a_sigterm_from_elsewhere_and_ends_with_its_run(tmp_path):
    """The SIGTERM of a stop reaches the workers too (torchrun's agent signals each process's group, SLURM every
    process of the job): a worker outlives it, so the stop's checkpoint can be saved; the training process still
    ends it with SIGTERM (status 0, as torch's own handler leaves), and a worker whose training process was killed
    ends by itself. A worker that runs threads already (BLAS threads of a spawned or forkserver worker, which the
    signal could reach) leaves the process group instead."""
    script = tmp_path / "worker.py"
    script.write_text(SIGTERM_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env(), cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "0", "True", "True"]


def test_after_the_loop_a_ctrl_c_stops_the_evaluation_and_a_second_stops_at_once(capsys):
    """Once the loop has ended a first Ctrl-C says the model is saved (the pipeline skips the rest of the
    evaluation); a second raises KeyboardInterrupt; the handlers are restored at the end."""
    from cloudtrain.training.preemption import PreemptionSignal, until

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), PreemptionSignal() as stop:
        stop.loop_ended = True
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.stopped() and capsys.readouterr().err == (
            "\nCtrl-C: the evaluation stops and the trained model is saved (Ctrl-C again: stop now, unsaved)\n"
        )
        assert list(until(stop.cut_short(), iter([1, 2, 3]))) == [1]  # the first batch always: no split is empty
        os.kill(os.getpid(), signal.SIGINT)
    assert stop.by == "SIGINT" and signal.getsignal(signal.SIGINT) is before
    assert PreemptionSignal(alone=False).cut_short() is None  # a launch's processes run every batch


class Split:
    """A trainer's evaluation and prediction as the pipeline calls them, recording which ran."""

    def __init__(self, stop, signal_during: str | None = None):
        self.eval_dls, self.predict_dls = {"validation": [], "test": []}, {"unlabelled": []}
        self.ran, self.stop, self.signal_during, self.phase = [], stop, signal_during, ""
        self.logged = []

    def evaluate(self, split, cut_short):
        self.ran.append(split)
        if split == self.signal_during:
            self.stop.received = True
        return {"loss": 1.0}

    def predict(self, split, cut_short):
        self.ran.append(split)
        return [0]

    def log_evaluation(self, metrics, name, step):
        self.logged.append((name, step))


@pytest.mark.parametrize("alone", [True, False])
def test_a_signal_during_the_first_split_skips_the_splits_after_it(alone):
    """Every process asks `stopped` (agreed) before each split, so a launch skips the rest as one process does; a
    lone process's cut-short split is left out, a launch's (which ran every batch) kept."""
    from cloudtrain.pipeline import _evaluate, _predict
    from cloudtrain.training.preemption import PreemptionSignal

    stop = PreemptionSignal(alone=alone)
    trainer = Split(stop, signal_during="validation")
    results = {}
    skipped = _evaluate(trainer, stop, 3, results) + _predict(trainer, stop)[1]
    assert trainer.ran == ["validation"]
    assert skipped == (["validation evaluation"] if alone else []) + ["test evaluation", "unlabelled predictions"]
    assert list(results) == ([] if alone else ["eval"])
    calm = PreemptionSignal(alone=alone)
    trainer, results = Split(calm), {}
    assert _evaluate(trainer, calm, 3, results) == [] and _predict(trainer, calm) == ({"unlabelled": [0]}, [])
    assert trainer.ran == ["validation", "test", "unlabelled"] and list(results) == ["eval", "test"]
    assert trainer.logged == [("eval", 3), ("test", 3)]


def test_a_best_model_from_an_earlier_step_is_not_logged_as_the_last_steps_validation():
    """--load_best_model_at_end: the last step's validation point and tables (a text-to-image grid, named by its
    step) are that step's own model's; the best model's were logged at its own step (a grid was overwritten)."""
    from cloudtrain.pipeline import _evaluate
    from cloudtrain.training.preemption import PreemptionSignal

    stop = PreemptionSignal(alone=True)
    trainer, results = Split(stop), {}
    assert _evaluate(trainer, stop, 40, results, own_step=False) == []
    assert trainer.ran == ["validation", "test"] and list(results) == ["eval", "test"]
    assert trainer.logged == [("test", 40)]


@pytest.mark.parametrize("when", ["as the loop's hooks end it", "before the first evaluation batch"])
def test_a_sigterm_once_the_loop_ended_saves_the_model_without_the_evaluation(
    when, tiny_model_dir, topic_csvs, tmp_path, monkeypatch
):
    """Found in review: a SIGTERM in the loop's own end (the best model's evaluation, a checkpoint completing) was
    dropped, the evaluation ran in full and the run ended 0; one just before the first evaluation batch gave the task
    no batch, and its crash lost the model. Either way now: the model saved, its evaluation skipped, 143."""
    from conftest import topic_run_args

    from cloudtrain import evaluation
    from cloudtrain.config import build_config
    from cloudtrain.errors import TrainingStopped
    from cloudtrain.pipeline import run_training
    from cloudtrain.training import hooks

    sent = []

    def signalling(original):
        def call(*args, **kwargs):
            if not sent:
                sent.append(os.kill(os.getpid(), signal.SIGTERM))  # our handler: a flag, nothing more
            return original(*args, **kwargs)

        return call

    if when == "as the loop's hooks end it":
        monkeypatch.setattr(hooks.Hook, "on_train_end", signalling(hooks.Hook.on_train_end))
    else:
        monkeypatch.setattr(evaluation, "load_metric", signalling(evaluation.load_metric))
    out = tmp_path / "out"
    args = topic_run_args(tiny_model_dir, topic_csvs, out)
    options = {k.lstrip("-"): v for k, v in zip(args[::2], args[1::2], strict=True)}
    options |= {"max_steps": 1, "eval_strategy": "no", "report_to": "none", "mixed_precision": "no"}
    with pytest.raises(TrainingStopped) as stopped:
        run_training(build_config(options))
    assert sent and stopped.value.exit_code == 143
    assert str(stopped.value).endswith(f"the trained model is saved in {out}, without its validation evaluation")
    assert (out / "model.safetensors").is_file() and not (out / "eval_results.json").exists()


def test_a_requeue_compares_the_options_as_resolved_where_they_were_auto(tmp_path):
    """args.json holds what `auto` resolved to (a batch of 16): a requeue giving `auto` again is the same job
    (found in review: it was refused as another run)."""
    from cloudtrain.config import build_config
    from cloudtrain.publish.saving import write_arguments
    from cloudtrain.resume import STOPPED_MARK, trained_already

    out = tmp_path / "out"
    out.mkdir()
    given = {"output_dir": str(out), "resume_from_checkpoint": "latest", "per_device_train_batch_size": "auto"}
    write_arguments(build_config({**given, "per_device_train_batch_size": 16, "resume_from_checkpoint": None}),
                    out / "args.json")  # fmt: skip
    (out / "train_results.json").write_text(json.dumps({"global_step": 2, STOPPED_MARK: "SIGTERM"}))
    assert trained_already(build_config(given), out).startswith(f"{out} already holds this run's trained model")
    assert trained_already(build_config({**given, "learning_rate": 1.0}), out) is None  # another run


@pytest.mark.slow
def test_a_stop_between_logging_steps_logs_the_steps_since_the_last_one(tiny_model_dir, topic_csvs, tmp_path):
    """A SIGTERM taken at a checkpoint step that was no logging step lost those steps' loss and throughput for
    good: the resume starts after them (found in audit). They are logged at the stop, as at a last step."""
    from cloudtrain.observe.tracking import read_metrics

    out = tmp_path / "out"
    options = ["--max_steps", "3000", "--eval_strategy", "no", "--logging_steps", "1000", "--checkpointing_steps", "1"]
    proc = start([sys.executable] + args_for(tiny_model_dir, topic_csvs, out, *options))
    wait_for(lambda: complete_checkpoints(out / "checkpoints"), proc)  # in the loop, before its first logging step
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    stop = max(step for step, _ in complete_checkpoints(out / "checkpoints"))
    assert stop < 1000  # a stop between logging steps, as the test means
    logged = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in logged] == [stop] and logged[0]["train/tokens_per_s"] > 0
