"""--async_checkpointing true: the loop goes on while a checkpoint is written from a CPU snapshot; a resume from
it is exact; kill -9 during a background save keeps the previous checkpoint; what cannot save in the
background is refused before training."""

import json
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import REPO, child_pythonpath
from safetensors.torch import load_file
from test_checkpointing import args_for, env, run
from test_distributed import free_port

from cloudtrain.async_save import BackgroundSave, cpu_copy
from cloudtrain.checkpointing import Checkpointer, TrainerState, complete_checkpoints
from cloudtrain.cli import main
from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.parallel.mesh import Mesh

BASIC = ["--training_type", "basic", "--max_steps", "12", "--checkpointing_steps", "4"]
ASYNC = ["--async_checkpointing", "true"]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def checkpointer(folder: Path) -> Checkpointer:
    cfg = build_config({"checkpointing_steps": "1"})
    return Checkpointer(cfg, folder, folder.parent, True, lambda: None)


def test_the_loop_goes_on_while_a_background_save_is_written(tmp_path):
    """save_async returns while the files are still being written; the checkpoint counts only once complete."""
    saver, release = checkpointer(tmp_path / "checkpoints"), threading.Event()

    def write(folder: Path) -> None:
        assert release.wait(60)  # held until the test has seen save_async return
        (folder / "weights.bin").write_bytes(b"w")

    saver.save_async(3, write, "BasicTrainer", Mesh(world=1, dp_replicate=1), TrainerState(global_step=3), 0.0)
    assert saver.background.in_flight and saver.latest() is None
    release.set()
    saver.background.wait()
    assert saver.latest() == tmp_path / "checkpoints" / "checkpoint-3"
    assert (saver.latest() / "weights.bin").read_bytes() == b"w"


def test_an_error_in_the_background_is_one_line_at_the_next_check(tmp_path):
    saver = checkpointer(tmp_path / "checkpoints")

    def write(folder: Path) -> None:
        raise OSError("Input/output error\nmore detail")

    saver.save_async(2, write, "BasicTrainer", Mesh(world=1, dp_replicate=1), TrainerState(global_step=2), 0.0)
    with pytest.raises(UserError) as err:
        saver.background.wait()
    assert "\n" not in str(err.value) and "Input/output error" in str(err.value)
    assert complete_checkpoints(tmp_path / "checkpoints") == []
    saver.background.check()  # raised once; the run decides what happens next


def test_a_snapshot_is_a_copy_that_later_steps_do_not_change():
    live = {"exp_avg": torch.ones(3), "step": torch.tensor(1.0), "nested": [{"lr": 0.1}]}
    snapshot = cpu_copy(live)
    live["exp_avg"].add_(1)
    live["nested"][0]["lr"] = 0.2
    assert torch.equal(snapshot["exp_avg"], torch.ones(3)) and snapshot["nested"][0]["lr"] == 0.1


def test_background_saves_run_one_at_a_time():
    saves, order = BackgroundSave(), []
    release = threading.Event()
    saves.start(lambda: (release.wait(60), order.append("first")), "first")
    starter = threading.Thread(target=saves.start, args=(lambda: order.append("second"), "second"))
    starter.start()
    release.set()
    starter.join(60)
    saves.wait()
    assert order == ["first", "second"]


@pytest.mark.slow
def test_resume_from_an_async_checkpoint_equals_the_uninterrupted_run(tiny_model_dir, topic_csvs, tmp_path):
    """checkpoint-8, written while steps 9 and on ran, equals a synchronous run's; resumed, it ends bit-exact."""
    sync, background, resumed = tmp_path / "sync", tmp_path / "async", tmp_path / "resumed"
    assert main(args_for(tiny_model_dir, topic_csvs, sync, *BASIC)[1:]) == 0
    assert main(args_for(tiny_model_dir, topic_csvs, background, *BASIC, *ASYNC)[1:]) == 0
    steps = [step for step, _ in complete_checkpoints(background / "checkpoints")]
    assert steps == [4, 8, 12]
    mid = Path("checkpoints") / "checkpoint-8"
    assert same(weights(sync / mid), weights(background / mid))
    a, b = (torch.load(out / mid / "training_state.pt", weights_only=True) for out in (sync, background))
    leaves = [torch.utils._pytree.tree_leaves(state["optimizer"]) for state in (a, b)]
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(*leaves, strict=True))
    assert a["scheduler"] == b["scheduler"] and torch.equal(a["rng"]["torch"], b["rng"]["torch"])

    shutil.copytree(background / mid, tmp_path / mid)  # only checkpoint-8, in a folder of its own
    latest = ["--resume_from_checkpoint", "latest", "--checkpoint_dir", str(tmp_path / "checkpoints")]
    assert main(args_for(tiny_model_dir, topic_csvs, resumed, *BASIC, *ASYNC, *latest)[1:]) == 0
    assert same(weights(background), weights(resumed)) and same(weights(sync), weights(resumed))
    # the log in checkpoint-8 was copied before step 9 ran: no step is logged twice after the resume
    events = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if "train/loss" in e] == [5, 10, 12]
    # the time the loop waited for each save, logged after it (as for synchronous saves): 8's is not in its copy
    assert [e["step"] for e in events if "checkpoint/blocked_s" in e] == [4, 12]


@pytest.mark.slow
def test_kill_during_a_background_save_keeps_the_previous_checkpoint(tiny_model_dir, topic_csvs, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run([sys.executable, *args_for(tiny_model_dir, topic_csvs, straight, *BASIC)])
    kill = {**env(), "CLOUDTRAIN_TEST_KILL_AT": "checkpoint.written:2"}  # inside the thread writing checkpoint-8
    cmd = [sys.executable, *args_for(tiny_model_dir, topic_csvs, killed, *BASIC, *ASYNC)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=kill, timeout=600, cwd=REPO)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["checkpoint-4", "checkpoint-8.partial"]

    resumed = run(
        [
            sys.executable,
            *args_for(tiny_model_dir, topic_csvs, killed, *BASIC, *ASYNC, "--resume_from_checkpoint", "latest"),
        ]
    )
    assert f"resumed from {killed / 'checkpoints' / 'checkpoint-4'} at step 4" in resumed.stdout
    assert same(weights(straight), weights(killed))


@pytest.mark.parametrize(
    "options, named",
    [
        (["--zero_stage", "2"], "DeepSpeed ZeRO"),
        (["--fsdp", "true"], "FSDP"),
        (["--training_type", "pipeline", "--pipeline_parallel_size", "2"], "--training_type pipeline"),
    ],
)
def test_what_cannot_save_in_the_background_is_refused_in_one_line(
    tiny_model_dir, topic_csvs, tmp_path, capsys, options, named
):
    code = main(args_for(tiny_model_dir, topic_csvs, tmp_path / "out", *options, *ASYNC)[1:])
    err = capsys.readouterr().err
    assert code != 0 and "--async_checkpointing true" in err and named in err, err
    assert len([line for line in err.splitlines() if "async_checkpointing" in line]) == 1


DIST = REPO / "tests" / "dist_async_checkpoint.py"
TWO = ["--training_type", "accelerated", "--max_steps", "12", "--checkpointing_steps", "4", "--mixed_precision", "no"]


def two_processes(*args: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
    environment = {**env(), "PYTHONPATH": child_pythonpath(REPO / "tests"), "CUDA_VISIBLE_DEVICES": ""}
    if kill_at:
        environment["CLOUDTRAIN_TEST_KILL_AT"] = kill_at
    return subprocess.run([*launcher, *args], capture_output=True, text=True, env=environment, timeout=600, cwd=REPO)


def records(folder: Path, name: str) -> dict[int, list]:
    files = {rank: folder / f"{name}.{rank}" for rank in (0, 1)}
    return {
        rank: [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []
        for rank, f in files.items()
    }


@pytest.mark.slow
def test_two_processes_save_in_the_background_survive_a_kill_and_resume_bit_exactly(
    tiny_model_dir, topic_csvs, tmp_path
):
    """DDP on 2 CPU processes (the AcceleratedTrainer): the loop runs the step after a save while that save is
    being written (each process's writer waits for it); both processes killed -9 while checkpoint-8 is written
    leave checkpoint-4 as the newest complete one; the resume picks it and ends bit-exact with a synchronous
    run, its checkpoints too; on_save fires once a checkpoint is complete and renamed, on both processes at the
    same step end though process 1 publishes a second late."""
    sync, killed = tmp_path / "sync", tmp_path / "killed"
    first, second = tmp_path / "log-killed", tmp_path / "log-resumed"
    first.mkdir(), second.mkdir()
    result = two_processes(*args_for(tiny_model_dir, topic_csvs, sync, *TWO))
    assert result.returncode == 0, result.stderr[-3000:]
    watched = [*TWO, *ASYNC, "--callbacks", "dist_async_checkpoint:Published"]
    run_args = args_for(tiny_model_dir, topic_csvs, killed, *watched)[1:]
    result = two_processes(str(DIST), str(first), *run_args, kill_at="checkpoint.written:2")
    assert result.returncode != 0 and "SIGKILL" in result.stderr, result.stderr[-3000:]
    assert [step for step, _ in complete_checkpoints(killed / "checkpoints")] == [4]
    for rank in (0, 1):
        assert json.loads((first / f"overlap.{rank}").read_text()) == {"saved_step": 4, "went_on": True}
    # checkpoint-4's on_save comes at the first step end after its thread published it: the kill, from the thread
    # writing checkpoint-8, may come first (the resumed run below, not killed, sees every one)
    for saves in records(first, "on_save").values():
        assert [save[:4] for save in saves] in ([], [[4, "checkpoint-4", True, True]])

    result = two_processes(str(DIST), str(second), *run_args, "--resume_from_checkpoint", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {killed / 'checkpoints' / 'checkpoint-4'} at step 4" in result.stdout
    for rank in (0, 1):
        assert json.loads((second / f"overlap.{rank}").read_text()) == {"saved_step": 8, "went_on": True}
    published = records(second, "on_save")  # at the same step end on both, though process 1 publishes late
    assert [save[:4] for save in published[0]] == [[8, "checkpoint-8", True, True], [12, "checkpoint-12", True, True]]
    assert published[0] == published[1], published
    assert same(weights(sync), weights(killed))
    for step in (8, 12):
        mid = Path("checkpoints") / f"checkpoint-{step}"
        assert same(weights(sync / mid), weights(killed / mid))
        a, b = (torch.load(out / mid / "optimizer.bin", weights_only=True) for out in (sync, killed))
        leaves = [torch.utils._pytree.tree_leaves(state) for state in (a, b)]
        assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(*leaves, strict=True))
        for rank in (0, 1):
            rng = [torch.load(out / mid / f"random_states_{rank}.pkl", weights_only=False) for out in (sync, killed)]
            assert torch.equal(rng[0]["torch_manual_seed"], rng[1]["torch_manual_seed"])
    events = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert {8, 12} <= {e["step"] for e in events if "checkpoint/blocked_s" in e}  # the loop's wait, per save


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({}, None),  # one process or DDP: each process snapshots its part
        ({"zero_stage": 2}, "DeepSpeed ZeRO (its engine writes the partitioned states collectively"),
        ({"fsdp": True}, "FSDP (the sharded states are written collectively"),
        ({"tensor_parallel_size": 2}, "--tensor_parallel_size (each process's shards are written from the live"),
    ],
)
def test_the_accelerated_trainer_saves_in_the_background_where_each_process_can_snapshot(options, named):
    from cloudtrain.training.accelerated import AcceleratedTrainer

    why = AcceleratedTrainer.async_refusal(build_config({"training_type": "accelerated", **options}))
    assert why == named if named is None else named in why
