"""Fault injection: kill -9 at named points of every write, a full disk, a read-only folder. After each, the
output folder holds the previous model or the new one complete (once `recover` ran, as every command that
reads or writes an output folder does first), and a process that survives says what happened in one line."""

import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import ENTRY, REPO, another_run_holding, lora_run, topic_rows, topic_run_args

from cloudtrain.publish import atomic

pytestmark = pytest.mark.slow  # one training process per case
QUICK = ["--num_train_epochs", "1", "--per_device_train_batch_size", "8", "--mixed_precision", "no"]
MODEL = ("config.json", "model.safetensors", "tokenizer.json", "args.json")


def cli(*args: str, kill_at: str | None = None, file_limit: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CLOUDTRAIN_TEST_KILL_AT", None)
    if kill_at:
        env["CLOUDTRAIN_TEST_KILL_AT"] = kill_at

    def limit_files() -> None:  # the child alone: no file it writes may grow past `file_limit` bytes
        if file_limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    return subprocess.run(
        [sys.executable, str(ENTRY), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
        preexec_fn=limit_files,
    )


def model_hashes(folder: Path) -> dict[str, str]:
    return {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in MODEL if (folder / name).exists()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, request):
    """An earlier model (seed 1) and, uninterrupted, the model a second run (seed 2) saves."""
    base = tmp_path_factory.mktemp("faults")
    csvs = {}
    for split, n, offset in (("train", 20, 0), ("validation", 4, 1)):
        csvs[split] = base / f"{split}.csv"
        pd.DataFrame(topic_rows(n, offset)).to_csv(csvs[split], index=False)
    old, new = base / "old", base / "new"
    for out, seed in ((old, "1"), (new, "2")):
        result = cli(*topic_run_args(tiny_model_dir, csvs, out), *QUICK, "--seed", seed)
        assert result.returncode == 0, result.stderr[-2000:]
    return {"csvs": csvs, "old": old, "new": new, "model": tiny_model_dir, "base": base}


def second_run(runs, out: Path, *extra: str, **kwargs) -> subprocess.CompletedProcess:
    args = topic_run_args(runs["model"], runs["csvs"], out)
    return cli(*args, *QUICK, "--seed", "2", "--overwrite_output_dir", "true", *extra, **kwargs)


@pytest.mark.parametrize(
    "point, survivor",
    [
        ("save.model_written", "old"),  # the new weights are staged, nothing sealed
        ("publish.sealed", "new"),  # sealed, nothing renamed yet
        ("publish.moved_aside", "new"),  # the previous files renamed aside, no new one in place
        ("publish.one_in_place:2", "new"),  # two new files in place, the rest still staged
    ],
)
def test_kill_during_the_final_save_leaves_the_old_model_or_the_new_one_whole(runs, point, survivor, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(runs["old"], out)
    result = second_run(runs, out, kill_at=point)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    if survivor == "old":  # before the seal the folder was never touched: no recovery needed
        assert model_hashes(out) == model_hashes(runs["old"])
    atomic.recover(out)  # what the next command does first
    expected = model_hashes(runs[survivor])
    assert {k: v for k, v in model_hashes(out).items() if k != "args.json"} == {
        k: v for k, v in expected.items() if k != "args.json"
    }
    assert not (out / atomic.STAGING).exists() and not (out / atomic.PREVIOUS).exists()


def test_kill_while_a_checkpoint_is_written_resumes_from_the_last_complete_one(runs, tmp_path):
    out = tmp_path / "out"
    steps = ["--checkpointing_steps", "1", "--resume_from_checkpoint", "latest"]
    result = second_run(runs, out, *steps, kill_at="checkpoint.written:2")
    assert result.returncode == -signal.SIGKILL
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint-1", "checkpoint-2.partial"]
    resumed = second_run(runs, out, *steps)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {out / 'checkpoints' / 'checkpoint-1'} at step 1" in resumed.stdout
    assert model_hashes(out)["model.safetensors"] == model_hashes(runs["new"])["model.safetensors"]


def test_a_file_that_cannot_grow_mid_save_is_one_line_and_the_old_model_stays(runs, tmp_path):
    """RLIMIT_FSIZE makes the weights' write fail as a full disk does (EFBIG), after every check passed."""
    out = tmp_path / "out"
    shutil.copytree(runs["old"], out)
    limit = (runs["old"] / "model.safetensors").stat().st_size // 2
    result = second_run(runs, out, file_limit=limit)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the disk of {out} filled up while the final model was written"), last
    assert "the previous model there was not replaced" in last and "Traceback" not in result.stderr
    assert model_hashes(out) == model_hashes(runs["old"])
    assert not (out / atomic.STAGING).exists()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 12 MiB filesystem of its own (needs the right to mount, which root has in this project's machines)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the RLIMIT_FSIZE case stands in")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_disk_too_small_for_the_model_is_refused_before_training(runs, small_tmpfs):
    out = small_tmpfs / "out"
    shutil.copytree(runs["old"], out)
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_tmpfs).free - 2 * 2**20))  # leave 2 MiB
    result = second_run(runs, out)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "saving the final model needs about" in last and "free some space" in last, last
    assert "epoch" not in result.stdout.lower()  # refused before the first step
    assert model_hashes(out) == model_hashes(runs["old"])


def test_a_read_only_output_folder_is_refused_in_one_line(runs, small_tmpfs):
    out = small_tmpfs / "out"
    shutil.copytree(runs["old"], out)
    before = model_hashes(out)
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    result = second_run(runs, out)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --output_dir {out} cannot be written (Read-only file system); choose a folder you can write to"
    )
    assert model_hashes(out) == before


@pytest.mark.parametrize(
    "share, extra",
    [(0.5, []), (1.5, []), (1.5, ["--async_checkpointing", "true"])],
    ids=["in the weights", "in the optimizer state (torch.save)", "in the optimizer state, saved in the background"],
)
def test_a_full_disk_while_a_checkpoint_is_written_is_one_line_and_keeps_the_model(share, extra, runs, tmp_path):
    """The optimizer state (twice the weights) fails in torch.save's zip writer, which names no OS error: that was
    a traceback, and its .partial folder stayed on the full disk (found in audit)."""
    out = tmp_path / "out"
    shutil.copytree(runs["old"], out)
    limit = int((runs["old"] / "model.safetensors").stat().st_size * share)
    result = second_run(runs, out, "--checkpointing_steps", "1", *extra, file_limit=limit)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the disk of {out / 'checkpoints'} filled up while checkpoint-1 was written"), last
    assert "Traceback" not in result.stderr
    assert not (out / "checkpoints" / "checkpoint-1.partial").exists()
    assert model_hashes(out) == model_hashes(runs["old"])


def test_merge_through_a_dotted_path_and_on_a_full_disk_keeps_the_merged_model(tiny_model_dir, tmp_path):
    """`merge` works on the folder a path names, not on its spelling (`out/merged/..` stopped resolving once merged/
    was moved aside: a traceback, merged/ gone); a merge that cannot write its weights is one line and leaves the
    earlier merged model as it was, with no partial folder."""
    from cloudtrain.cli import main

    out = lora_run(tiny_model_dir, tmp_path)
    assert main(["merge", "--output_dir", str(out)]) == 0
    assert main(["merge", "--output_dir", str(out / "merged" / "..")]) == 0  # replaces the first
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("merged")) == ["merged"]
    before = model_hashes(out / "merged")
    limit = (out / "merged" / "model.safetensors").stat().st_size // 2
    result = cli("merge", "--output_dir", str(out), file_limit=limit)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the disk of {out} filled up while the merged model was written"), last
    assert "Traceback" not in result.stderr
    assert model_hashes(out / "merged") == before
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("merged")) == ["merged"]
    holder = another_run_holding(out)  # a run writing there (a resume, say): its adapter may be half-written
    try:
        result = cli("merge", "--output_dir", str(out))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: --output_dir {out} is in use by another run (pid {holder.pid} on ")
        assert last.endswith("); wait for it to end")  # no other folder to suggest: the adapter is there
        assert model_hashes(out / "merged") == before
    finally:
        holder.kill()
        holder.wait()
