"""`cloudtrain launch` (cloudtrain.commands.launch): its options apart from the training run's, torchrun's arguments,
refusals before any process starts, the processes' error lines recorded and printed once; then real launches of
2 CPU processes: a run that trains, a data mistake every process meets (one line, no launcher traceback), and a
process killed mid-run."""

import pytest
from conftest import run_cli, topic_run_args

from cloudtrain import errors
from cloudtrain.cli import command_parser, main
from cloudtrain.commands import launch


def test_the_launchers_options_are_taken_out_and_the_rest_kept_in_order():
    argv = ["--nproc_per_node", "4", "--task", "sft", "--master_port=29600", "--lora_r", "8", "--nnodes", "1"]
    assert launch.split_argv(argv) == (
        {"nproc_per_node": "4", "master_port": "29600", "nnodes": "1"},
        ["--task", "sft", "--lora_r", "8"],
    )
    assert launch.split_argv(["--output_dir=out", "--max_restarts", "2"]) == (
        {"max_restarts": "2"},
        ["--output_dir=out"],
    )


def test_torchrun_is_given_one_node_on_a_free_port_or_each_nodes_rendezvous():
    parser = command_parser("launch")
    one = launch.torchrun_argv(parser.parse_args(["--nproc_per_node", "2"]), ["--task", "sft"])
    assert one[:4] == ["--nproc_per_node", "2", "--nnodes", "1"] and one[-2:] == ["--task", "sft"]
    assert one[one.index("--master_port") + 1] != "29500" and one[one.index("--master_addr") + 1] == "127.0.0.1"
    several = parser.parse_args(["--nproc_per_node", "8", "--nnodes", "2", "--node_rank", "1", "--master_addr", "n0"])
    argv = launch.torchrun_argv(several, [])
    assert argv[argv.index("--node_rank") + 1] == "1" and argv[argv.index("--master_port") + 1] == "29500"
    assert argv[argv.index("--master_addr") + 1] == "n0" and argv[-2:] == ["-m", "cloudtrain"]


def test_mistakes_are_refused_before_any_process_starts(monkeypatch, capsys, tmp_path):
    def started(*args):
        raise AssertionError("processes were started")

    monkeypatch.setattr(launch, "_run", started)
    cases = {
        ("--node_rank", "2"): "error: --node_rank 2 is not a node of --nnodes 1; give 0 to 0",
        ("--nproc_per_node", "0"): "error: --nproc_per_node must be at least 1",
        ("--nproc_per_node", "2", "--learning_rate", "-1"): "error: --learning_rate must be positive",
        ("--nproc_per_node", "2", "--train_file", str(tmp_path / "none.csv")): f"{tmp_path / 'none.csv'}",
    }
    for argv, line in cases.items():
        assert main(["launch", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and line in err[0], (argv, err)


def test_each_process_records_its_line_and_the_last_attempts_are_read_in_rank_order(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(errors.ERROR_DIR, str(tmp_path))
    for attempt, rank, line in ((0, 0, "error: old"), (1, 1, "error: b"), (1, 0, "error: a")):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        errors.report(line, 2)
    assert capsys.readouterr().err == ""  # recorded, not printed
    assert launch.recorded_errors(tmp_path) == [("error: a", 2), ("error: b", 2)]
    monkeypatch.setenv(errors.ERROR_DIR, str(tmp_path / "gone"))
    errors.report("error: c", 2)  # the launcher's folder is gone: printed here
    assert capsys.readouterr().err == "error: c\n"
    assert launch.exit_reason(1) == "exited with status 1"
    assert launch.exit_reason(-9) == "was killed by SIGKILL (often the kernel's out-of-memory killer)"


@pytest.mark.slow
def test_two_processes_train_and_every_failure_is_one_line(tiny_model_dir, topic_csvs, tmp_path):
    """A launch that trains on 2 processes; the same with a column no file has (every process meets it after the
    launch started): one error line, status 2, no traceback; a process killed mid-run: the launcher names it."""
    common = ["launch", "--nproc_per_node", "2", "--max_steps", "2", "--eval_strategy", "no", "--report_to", "none"]
    trained = run_cli(*common, *topic_run_args(tiny_model_dir, topic_csvs, tmp_path / "a"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "2 process(es) on cpu" in trained.stdout and (tmp_path / "a" / "model.safetensors").exists()

    mistaken = run_cli(*common, *topic_run_args(tiny_model_dir, topic_csvs, tmp_path / "b"), "--text_column", "body")
    lines = [line for line in mistaken.stderr.splitlines() if line.startswith("error")]
    assert mistaken.returncode == 2 and len(lines) == 1 and "column 'body' is not in the train data" in lines[0]
    assert "Traceback" not in mistaken.stderr and "ChildFailedError" not in mistaken.stderr

    killed = run_cli(*common, *topic_run_args(tiny_model_dir, topic_csvs, tmp_path / "c"), "--checkpointing_steps",
                     "1", env={"CLOUDTRAIN_TEST_KILL_AT": "checkpoint.written"})  # fmt: skip
    assert killed.returncode == 1 and "Traceback" not in killed.stderr
    assert killed.stderr.strip().splitlines()[-1].startswith("error: the process of rank ")
    assert "was killed by SIGKILL" in killed.stderr
