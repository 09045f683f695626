"""`cloudtrain launch` (cloudtrain.commands.launch): its options apart from the training run's, torchrun's arguments,
refusals before any process starts, the processes' error lines recorded and printed once; then real launches of
2 CPU processes: a run that trains, one stopped by SIGTERM (its checkpoint saved, one line), one stopped at once by
a second Ctrl-C, a data mistake every process meets (one line, no launcher traceback), and a process killed
mid-run."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
from conftest import ENTRY, REPO, run_cli, topic_run_args

from cloudtrain import errors
from cloudtrain.cli import command_parser, main
from cloudtrain.commands import launch
from cloudtrain.data import remote


def test_the_launchers_options_are_taken_out_and_the_rest_kept_in_order():
    argv = ["--nproc_per_node", "4", "--task", "sft", "--master_port=29600", "--lora_r", "8", "--nnodes", "1"]
    assert launch.training_argv(argv) == ["--task", "sft", "--lora_r", "8"]
    kept = ["--output_dir=out", "--seed", "3"]
    assert launch.training_argv(["--output_dir=out", "--max_restarts", "2", "--seed", "3"]) == kept


def test_torchrun_is_given_one_node_standalone_or_each_nodes_rendezvous():
    parser = command_parser("launch")
    one = launch.torchrun_argv(parser.parse_args(["--nproc_per_node", "2"]), ["--task", "sft"])
    assert one[:5] == ["--nproc_per_node", "2", "--standalone", "--local_addr", "127.0.0.1"]
    assert one[-2:] == ["--task", "sft"]
    assert one[one.index("--shutdown_timeout") + 1] == "300"  # time to save a checkpoint on Ctrl-C
    several = parser.parse_args(["--nproc_per_node", "8", "--nnodes", "2", "--node_rank", "1", "--master_addr", "n0"])
    argv = launch.torchrun_argv(several, [])
    assert argv[argv.index("--node_rank") + 1] == "1" and argv[argv.index("--master_port") + 1] == "29500"
    assert argv[argv.index("--master_addr") + 1] == "n0" and argv[-2:] == ["-m", "cloudtrain"]
    port = launch.torchrun_argv(parser.parse_args(["--nproc_per_node", "2", "--master_port", "29600"]), [])
    assert "--standalone" not in port and port[port.index("--master_port") + 1] == "29600"


def test_mistakes_are_refused_before_any_process_starts(monkeypatch, capsys, tmp_path):
    def started(*args):
        raise AssertionError("processes were started")

    monkeypatch.setattr(launch, "_run", started)
    cases = {
        ("--node_rank", "2"): "error: --node_rank 2 is not a node of --nnodes 1; give 0",
        (
            "--nnodes",
            "2",
            "--node_rank",
            "1",
        ): "error: --nnodes 2: give --master_addr, the address of the node of rank 0",
        ("--master_port", "70000"): "error: --master_port must be 1 to 65535",
        ("--nnodes", "2", "--master_addr", "n0", "--max_restarts", "1"): "restarts one node's processes only",
        ("--nproc_per_node", "0"): "error: --nproc_per_node must be at least 1",
        ("--nproc_per_node", "2", "--learning_rate", "-1"): "error: --learning_rate must be positive",
        ("--nproc_per_node", "2", "--train_file", str(tmp_path / "none.csv")): f"{tmp_path / 'none.csv'}",
        # the parallel sizes against the launch's processes (each process would import torch first to say so)
        (
            "--nproc_per_node",
            "3",
            "--task",
            "causal_lm",
            "--tensor_parallel_size",
            "2",
        ): "--tensor_parallel_size 2 needs a multiple of 2 "
        "processes, and this launch has 3: launch with cloudtrain launch --nproc_per_node 2 (or 4, ...)",
        (
            "--nnodes",
            "2",
            "--master_addr",
            "n0",
            "--nproc_per_node",
            "1",
            "--task",
            "sft",
            "--context_parallel_size",
            "4",
        ): "this launch has 2",
        ("--nproc_per_node", "2", "--training_type", "pipeline", "--pipeline_parallel_size", "3"): "pipeline_parallel",
        # a task that does not take the size: its registry row says so without importing it
        ("--nproc_per_node", "2", "--task", "classification", "--tensor_parallel_size", "2"): "--tensor_parallel_size"
        " 2 is supported for --task causal_lm, sft only (this run is classification)",
        ("--nproc_per_node", "2", "--task", "dpo", "--context_parallel_size", "2"): "--context_parallel_size 2 is "
        "supported for --task causal_lm, sft only (this run is dpo)",
    }
    for argv, line in cases.items():
        assert main(["launch", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and line in err[0], (argv, err)


def test_each_failed_process_is_told_once_by_its_record_or_by_how_it_ended(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(errors.ERROR_DIR, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    for attempt, rank in ((0, 0), (1, 0), (1, 1)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        errors.report(f"error: the data of attempt {attempt}", 2)
    assert capsys.readouterr().err == "error: the data of attempt 0\n"  # an attempt to restart says it at once
    records = launch.recorded_errors(tmp_path)
    assert [(r["attempt"], r["rank"]) for r in records] == [(0, 0), (1, 0), (1, 1)]

    mine = records[-1]["pid"]  # this process wrote them all: as rank 1, and as a rank 0 of attempt 0 too
    same = {0: SimpleNamespace(pid=mine, exitcode=2), 1: SimpleNamespace(pid=mine, exitcode=2)}
    assert launch.failure_lines(same, records[1:], 0) == (["error: the data of attempt 1"], 2)
    killed = {0: SimpleNamespace(pid=mine, exitcode=1), 1: SimpleNamespace(pid=-1, exitcode=-9)}
    lines, status = launch.failure_lines(killed, records[1:], first=1)
    assert status == 137 and lines[0].startswith("error: the process of rank 1 was killed by SIGKILL (often")
    assert lines[1:] == ["error: the data of attempt 1"]
    # the launcher's own SIGTERM to the others, and a rank that left its mistake to rank 0's line: not told
    quiet = {0: SimpleNamespace(pid=mine, exitcode=2), 1: SimpleNamespace(pid=-1, exitcode=2)}
    assert launch.failure_lines(quiet, records[1:2], 0) == (["error: the data of attempt 1"], 2)
    # a rank whose failure another rank reports (a callback failing on rank 0): recorded without a line, not told
    # "exited with status 1; its output is above" of an output that said nothing (found in audit)
    monkeypatch.setenv("RANK", "3")
    errors.record_quiet(1)
    silent = next(r for r in launch.recorded_errors(tmp_path) if r["rank"] == 3)
    assert silent["line"] is None and silent["status"] == 1
    stopped = {0: SimpleNamespace(pid=mine, exitcode=2), 3: SimpleNamespace(pid=mine + 10**6, exitcode=1)}
    silent["pid"] = mine + 10**6  # (this process wrote it: another pid, as another process would have)
    assert launch.failure_lines(stopped, [records[1], silent], 0) == (["error: the data of attempt 1"], 2)
    (tmp_path / "1-3.json").unlink()
    monkeypatch.setenv("RANK", "1")
    crashed = {0: SimpleNamespace(pid=-2, exitcode=-15), 1: SimpleNamespace(pid=-1, exitcode=1)}
    assert launch.failure_lines(crashed, [], 1) == (
        ["error: the process of rank 1 exited with status 1; its output is above"],
        1,
    )

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a stop is never restarted: recorded, not printed
    errors.report("stopped: checkpoint saved to x", 143)
    assert capsys.readouterr().err == ""
    stopped = launch.recorded_errors(tmp_path)
    assert launch.stopped_lines(stopped, "SIGTERM") == ["stopped: checkpoint saved to x"]
    assert launch.stopped_lines(stopped[:1], "SIGTERM")[0].startswith("stopped: the launch received SIGTERM and its")
    (tmp_path / "2-0.json").write_text('{"rank": 0, "pi')  # cut short by a kill: skipped
    assert len(launch.recorded_errors(tmp_path)) == 4

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # attempt 0 ended with a user's mistake (status 2)
    assert errors.earlier_mistake() == "error: the data of attempt 0"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert errors.earlier_mistake() == "error: the data of attempt 1"
    for stale in tmp_path.glob("1-*.json"):
        stale.write_text(json.dumps({**json.loads(stale.read_text()), "status": 1}))  # a crash: worth a restart
    assert errors.earlier_mistake() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert errors.earlier_mistake() is None  # the first attempt has none before it
    unreachable = remote.remote_failure("s3://bucket/data", ConnectionError("no route to host"))
    assert unreachable.transient and "cannot reach the object store" in str(unreachable)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")  # a service that did not answer: tried again
    errors.report(f"error: {unreachable}", 2, transient=True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "4")
    assert errors.earlier_mistake() is None
    for stale in tmp_path.glob("3-*.json"):
        stale.unlink()

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")  # an attempt to restart: each line said once, by anyone
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    for rank, line in ((0, "error: a"), (1, "error: a"), (2, "error: b")):
        monkeypatch.setenv("RANK", str(rank))
        errors.report(line, 2)
    assert capsys.readouterr().err == "error: a\nerror: b\n"
    assert len(launch.recorded_errors(tmp_path)) == 7  # each still recorded for the launcher

    monkeypatch.setenv(errors.ERROR_DIR, str(tmp_path / "gone"))
    errors.report("error: c", 2)  # the launcher's folder is gone: printed here
    assert capsys.readouterr().err == "error: c\n"
    assert launch.exit_reason(1) == "exited with status 1; its output is above"


SECOND_CTRL_C = """
import signal, subprocess, sys, time
import psutil
from torch.distributed.elastic.multiprocessing.api import SignalException
from cloudtrain.commands.launch import SecondInterruptKills

sleep = "import time; time.sleep(120)"
sleeper = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleep!r}]); time.sleep(120)"
subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True)  # a rank: its own session, as torch does
while len(psutil.Process().children(recursive=True)) < 2:  # the rank and its own child (a loader worker)
    time.sleep(0.05)
tree = psutil.Process().children(recursive=True)
handler = SecondInterruptKills()
try:
    handler(signal.SIGINT, None)
except SignalException as err:
    print("first", err.sigval.name, all(p.is_running() for p in tree), flush=True)
try:
    handler(signal.SIGINT, None)
except SignalException:  # raised again: the agent stops from whatever it was doing
    gone, alive = psutil.wait_procs(tree, timeout=20)
    print("second", handler.killed, len(gone), len(alive), flush=True)
try:
    handler(signal.SIGINT, None)
except SignalException:
    print("third", handler.killed)  # nothing left to kill: still says the second killed them
"""


def test_the_first_ctrl_c_goes_to_torchs_agent_and_a_second_kills_every_process_under_the_launcher():
    """In a process of its own: the handler kills whatever runs under the process it is installed in."""
    ran = subprocess.run([sys.executable, "-c", SECOND_CTRL_C], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert ran.stdout.splitlines() == ["first SIGINT True", "second True 2 0", "third True"], ran.stderr[-2000:]


def test_torchrun_is_given_only_the_options_the_installed_torch_takes():
    """torch 2.9 takes neither --shutdown_timeout nor --signals_to_handle, 2.11 not the first: the launch would
    end in torchrun's usage text."""
    from torch.distributed.run import parse_args

    args = command_parser("launch").parse_args(["--nproc_per_node", "2", "--stop_timeout", "90"])
    command = launch.torchrun_argv(args, ["--task", "sft"])
    parsed = parse_args(command)  # the installed torch's own parser
    if "--shutdown_timeout" in launch.torchrun_options():
        assert parsed.shutdown_timeout == 90
    assert command[command.index("--signals_to_handle") + 1] == "SIGTERM,SIGHUP,SIGQUIT"  # SIGINT is the launcher's
    older = launch.torchrun_argv(args, [], known=frozenset({"--nproc_per_node", "--max_restarts"}))
    assert "--shutdown_timeout" not in older and "--signals_to_handle" not in older


@pytest.mark.slow
def test_a_second_ctrl_c_stops_a_launch_at_once_without_a_checkpoint(tiny_model_dir, topic_csvs, tmp_path):
    """The first Ctrl-C asks the processes to save and stop at their next logging step, which is far away here;
    a second stops the launch at once (status 130, one line), where torch's agent would wait --stop_timeout."""
    args = ["launch", "--nproc_per_node", "2", "--eval_strategy", "no", "--report_to", "none", "--stop_timeout", "120"]
    args += ["--max_steps", "100000", "--logging_steps", "100000", "--dataloader_num_workers", "1"]
    out = tmp_path / "run"
    launched = subprocess.Popen(
        [sys.executable, str(ENTRY), *args, *topic_run_args(tiny_model_dir, topic_csvs, out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    timer = threading.Timer(300, launched.kill)
    timer.start()
    assert launched.stdout is not None
    for line in launched.stdout:
        if "process(es) on cpu" in line:  # the banner at the start of training
            break
    deadline, tree = time.monotonic() + 60, []
    while len(tree) < 4 and time.monotonic() < deadline:  # two ranks and a loader worker each: training
        time.sleep(0.2)
        tree = psutil.Process(launched.pid).children(recursive=True)
    if len(tree) < 4:
        launched.kill()
        pytest.fail(f"the launch's loader workers never started: {launched.communicate()[1][-3000:]}")
    launched.send_signal(signal.SIGINT)
    time.sleep(2)
    assert launched.poll() is None  # the first: the ranks train on towards their next logging step
    launched.send_signal(signal.SIGINT)
    second = time.monotonic()
    _, stderr = launched.communicate()
    timer.cancel()
    assert launched.returncode == 130 and time.monotonic() - second < 60, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith(("stopped", "error"))]
    assert said == [launch.KILLED_AT_ONCE] and "Traceback" not in stderr
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive and not list(out.glob("checkpoints/checkpoint-*"))


@pytest.mark.slow
def test_two_processes_train_stop_and_fail_each_with_one_line(tiny_model_dir, topic_csvs, tmp_path):
    """A launch that trains on 2 processes; one sent SIGTERM mid-run, to every process as SLURM does (a loader
    worker each): the processes save a checkpoint and the launcher says so once, status 143; a column no file
    has (met after the processes started): one error line, status 2, no traceback; a process killed mid-run:
    named with its signal, status 137."""
    common = ["launch", "--nproc_per_node", "2", "--eval_strategy", "no", "--report_to", "none"]
    trained = run_cli(*common, "--max_steps", "2", *topic_run_args(tiny_model_dir, topic_csvs, tmp_path / "a"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "2 process(es) on cpu" in trained.stdout and (tmp_path / "a" / "model.safetensors").exists()

    stopped = sigterm_after_first_step(*common, "--max_steps", "500", "--logging_steps", "1",
                                       "--dataloader_num_workers", "1",
                                       *topic_run_args(tiny_model_dir, topic_csvs, tmp_path / "b"))  # fmt: skip
    said = [line for line in stopped.stderr.splitlines() if line.startswith(("stopped", "error"))]
    # one line: each process says the same (a signal landing between a process's two reads of it may make a
    # second, "by a signal to another process", wording)
    assert stopped.returncode == 143 and len(said) in (1, 2), stopped.stderr
    assert all(line.startswith("stopped") and "--resume_from_checkpoint" in line for line in said), said
    assert list((tmp_path / "b" / "checkpoints").glob("checkpoint-*"))

    # restarts cannot mend it: the attempt that meets it says it, the restarted ones end at once without saying it
    # again, and the launcher says the last attempt's (without that, each restart said it again)
    mistaken = run_cli(*common, *topic_run_args(tiny_model_dir, topic_csvs, tmp_path / "c"), "--text_column", "body",
                       "--max_restarts", "2")  # fmt: skip
    lines = [line for line in mistaken.stderr.splitlines() if line.startswith("error")]
    assert mistaken.returncode == 2 and len(lines) == 2 and len(set(lines)) == 1, mistaken.stderr[-3000:]
    assert "column 'body' is not in the train data" in lines[0]
    assert "Traceback" not in mistaken.stderr and "ChildFailedError" not in mistaken.stderr

    killed = run_cli(*common, *topic_run_args(tiny_model_dir, topic_csvs, tmp_path / "d"), "--max_steps", "2",
                     "--checkpointing_steps", "1", env={"CLOUDTRAIN_TEST_KILL_AT": "checkpoint.written"})  # fmt: skip
    assert killed.returncode == 137 and "Traceback" not in killed.stderr
    assert "error: the process of rank " in killed.stderr and "was killed by SIGKILL" in killed.stderr


def sigterm_after_first_step(*args: str) -> subprocess.CompletedProcess:
    """The application launched as run_cli does; once a training step is logged, SIGTERM to it and every process
    under it (the ranks and their loader workers, which torchrun's agent signals again). Stderr goes to a file, so
    that a chatty failure cannot fill a pipe nobody reads; killed after 300 s."""
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(
            [sys.executable, str(ENTRY), *args], stdout=subprocess.PIPE, stderr=errors, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO,
        )  # fmt: skip
        timer = threading.Timer(300, process.kill)
        timer.start()
        stdout = []
        assert process.stdout is not None
        for line in process.stdout:
            stdout.append(line)
            if line.startswith("step "):
                for each in [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        each.send_signal(signal.SIGTERM)
                break
        rest, _ = process.communicate()
        timer.cancel()
        errors.seek(0)
        return subprocess.CompletedProcess(process.args, process.returncode, "".join(stdout) + rest, errors.read())
