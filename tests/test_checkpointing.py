"""Fault tolerance, for real: SIGKILL mid-epoch then resume, SIGTERM, a kill during a save, rotation,
a diverging loss, and damaged checkpoints."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from conftest import ENTRY, REPO, child_pythonpath
from safetensors.torch import load_file

from cloudtrain.checkpointing import (
    FORMAT,
    MARKS,
    STATE_FILE,
    Checkpointer,
    Storage,
    complete_checkpoints,
    finish_replacement,
    storage_from,
)
from cloudtrain.cli import main
from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.resume import choose_resume, cut_short, local_view, restarted_defaults

FAST = [
    "--per_device_train_batch_size",
    "4",
    "--learning_rate",
    "3e-3",
    "--warmup_ratio",
    "0.1",
    "--logging_steps",
    "5",
    "--eval_strategy",
    "epoch",
]


def args_for(tiny_model_dir, topic_csvs, out: Path, *extra: str) -> list[str]:
    return [
        str(ENTRY),
        "--model_name_or_path",
        tiny_model_dir,
        "--train_file",
        str(topic_csvs["train"]),
        "--validation_file",
        str(topic_csvs["validation"]),
        "--output_dir",
        str(out),
        *FAST,
        *extra,
    ]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}


def run(cmd: list[str], expect: int = 0) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO, timeout=600)
    assert result.returncode == expect, (result.stdout[-2000:], result.stderr[-4000:])
    return result


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO, start_new_session=True
    )


def wait_for(condition, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker it started (torchrun's workers have their own sessions)."""
    try:
        parent = psutil.Process(proc.pid)
        everyone = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:  # it ended (and wait_for reaped it): its own failure is what the test reports
        return
    for p in everyone:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(everyone, timeout=30)
    proc.wait()


def train_losses(out: Path) -> dict[int, float]:
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e["train/loss"] for e in events if "train/loss" in e}


@pytest.mark.slow
def test_killed_mid_epoch_then_resumed_equals_never_stopped(tiny_model_dir, topic_csvs, tmp_path):
    """One process; two, as two nodes with their own disks, in test_fault_tolerance.py."""
    steps = ["--max_steps", "30", "--checkpointing_steps", "7"]  # 15 steps per epoch
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run([sys.executable] + args_for(tiny_model_dir, topic_csvs, straight, *steps))

    proc = start([sys.executable] + args_for(tiny_model_dir, topic_csvs, resumed, *steps))
    wait_for(lambda: (resumed / "checkpoints" / "checkpoint-14").is_dir(), proc)
    kill_all(proc)  # no chance to clean up, as on a node failure
    assert not (resumed / "model.safetensors").exists()
    killed_at = complete_checkpoints(resumed / "checkpoints")[-1][0]
    assert killed_at < 30 and killed_at % 15 != 0  # mid-epoch

    result = run(
        [sys.executable] + args_for(tiny_model_dir, topic_csvs, resumed, *steps, "--resume_from_checkpoint", "latest")
    )
    assert f"checkpoint-{killed_at} at step {killed_at} (loaded in" in result.stdout, result.stdout
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[name], b[name]) for name in a), "final weights differ"
    after = {s: v for s, v in train_losses(straight).items() if s > killed_at}
    assert after and {s: v for s, v in train_losses(resumed).items() if s > killed_at} == after


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_then_resume_continues(tiny_model_dir, topic_csvs, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable] + args_for(tiny_model_dir, topic_csvs, out, "--max_steps", "3000", "--eval_strategy", "no")
    proc = start(cmd)  # no --checkpointing_steps: the preemption checkpoint is saved anyway
    wait_for(lambda: (out / "metrics.jsonl").exists() and "train/loss" in (out / "metrics.jsonl").read_text(), proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - sent < 30  # inside Kubernetes' default grace period (2 s when the machine is idle)
    assert proc.returncode == 143
    assert "stopped: SIGTERM at step" in stderr and "--resume_from_checkpoint latest" in stderr
    ((step, path),) = complete_checkpoints(out / "checkpoints")
    assert 0 < step < 3000 and (path / "model.safetensors").exists()

    result = run(
        [sys.executable]
        + args_for(
            tiny_model_dir,
            topic_csvs,
            out,
            "--max_steps",
            str(step + 10),
            "--eval_strategy",
            "no",
            "--resume_from_checkpoint",
            "latest",
        )
    )
    launch = f"trained steps {step + 1}-{step + 10} of {step + 10} (10 this launch, resumed at step {step}) in "
    assert f"at step {step}" in result.stdout and launch in result.stdout


@pytest.mark.slow
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_as_latest(tiny_model_dir, topic_csvs, tmp_path):
    """12 steps with a save every 2; the process kills itself inside the second save, its part written and the
    folder not yet sealed (a kill point: a polling test could arrive after the save had finished)."""
    out = tmp_path / "out"
    options = ("--checkpointing_steps", "2", "--max_steps", "12", "--eval_strategy", "no")
    cmd = [sys.executable, *args_for(tiny_model_dir, topic_csvs, out, *options)]
    killed = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
        env={**env(), "CLOUDTRAIN_TEST_KILL_AT": "checkpoint.written:2"},
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    folder = out / "checkpoints"
    partial = list(folder.glob("*.partial"))
    previous = complete_checkpoints(folder)[-1][0]
    assert previous == 2 and [p.name for p in partial] == ["checkpoint-4.partial"]

    result = run(cmd + ["--resume_from_checkpoint", "latest"])
    assert f"checkpoint-{previous} at step {previous}" in result.stdout
    assert (
        f"trained steps {previous + 1}-12 of 12 ({12 - previous} this launch, resumed at step {previous})"
        in result.stdout
    )
    assert not list(folder.glob("*.partial"))


def fake_checkpoint(folder: Path, step: int, score: float | None) -> None:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / STATE_FILE).write_text(json.dumps({"format": "cloudtrain-checkpoint/1", "score": score}))


@pytest.mark.parametrize(
    "limit, scores, kept",
    [
        (1, [0.5, 0.9, 0.7, 0.6], [2, 4]),  # the best (step 2) and the newest (4)
        (2, [0.5, 0.9, 0.7, 0.6], [2, 4]),
        (2, [0.5, 0.6, 0.7, 0.9], [3, 4]),  # the newest is the best: the two newest stay
        (1, [None, None, None], [3]),  # never evaluated: only the newest
        (3, [0.9, 0.1, 0.2, 0.3, 0.4], [1, 4, 5]),
        # steps 3 and 4 saved after the same evaluation (4: the last step, or a save on SIGTERM): the best is 3,
        # the model that evaluation scored
        (1, [0.5, 0.6, 0.9, 0.9, 0.8], [3, 5]),
    ],
)
def test_rotation_keeps_the_newest_and_the_best(tmp_path, limit, scores, kept):
    for step, score in enumerate(scores, start=1):
        fake_checkpoint(tmp_path, step, score)
    checkpointer = Checkpointer(
        build_config({"save_total_limit": limit, "checkpointing_steps": "1"}), tmp_path, tmp_path, True, lambda: None
    )
    checkpointer.delete(checkpointer.doomed(saved=len(scores)))
    assert [step for step, _ in complete_checkpoints(tmp_path)] == kept


def test_rotation_scores_checkpoints_of_another_metric_by_this_runs(tmp_path):
    """Resumed with --metric_for_best_model loss, checkpoints the first launch scored by accuracy (+0.33) beat
    every -loss score, and rotation kept the worst model as the best (found in audit): scored again here."""
    first = {"accuracy": 0.33, "loss": 1.10}, {"accuracy": 0.40, "loss": 0.90}
    for step, evaluation in enumerate(first, start=1):
        path = tmp_path / f"checkpoint-{step}"
        path.mkdir()
        state = {"evaluations": [evaluation]}
        meta = {"format": "cloudtrain-checkpoint/1", "metric": "accuracy", "score": evaluation["accuracy"]}
        (path / STATE_FILE).write_text(json.dumps({**meta, "state": state}))
    for step, loss in ((3, 0.57), (4, 0.70)):
        fake_checkpoint(tmp_path, step, -loss)  # this run's: scored by -loss
        meta = json.loads((tmp_path / f"checkpoint-{step}" / STATE_FILE).read_text())
        (tmp_path / f"checkpoint-{step}" / STATE_FILE).write_text(json.dumps({**meta, "metric": "loss"}))
    options = {"save_total_limit": 1, "checkpointing_steps": "1", "metric_for_best_model": "loss"}
    checkpointer = Checkpointer(build_config(options), tmp_path, tmp_path, True, lambda: None)
    checkpointer.delete(checkpointer.doomed(saved=4))
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [3, 4]  # the lowest loss, and the newest


def test_rotation_keeps_the_step_just_saved_though_an_abandoned_later_one_exists(tmp_path):
    """Resumed from step 2 (steps 3 and 4 were complete on one node only), the run saves step 2 again."""
    for step, score in enumerate([0.5, 0.9, 0.7, 0.6], start=1):
        fake_checkpoint(tmp_path, step, score)
    checkpointer = Checkpointer(
        build_config({"save_total_limit": 1, "checkpointing_steps": "1"}), tmp_path, tmp_path, True, lambda: None
    )
    checkpointer.delete(checkpointer.doomed(saved=2))
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2]  # the saved one, also the best


def test_a_folder_removed_while_listed_holds_no_checkpoint(tmp_path, monkeypatch):
    """Another process's storage probe may remove the checkpoint folder between glob's look and its listing."""
    fake_checkpoint(tmp_path, 1, 0.5)

    def vanished(self, pattern):
        raise FileNotFoundError(2, "No such file or directory", str(self))

    monkeypatch.setattr(Path, "glob", vanished)
    assert complete_checkpoints(tmp_path) == []


def test_a_checkpoints_files_are_on_disk_before_its_state_file_seals_it(tiny_model_dir, topic_csvs, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    """Only the state file was synced before the rename that makes a checkpoint count: after a power cut or a VM
    crash `latest` could find a complete checkpoint of empty weights, and every restart failed (found in audit)."""
    from cloudtrain import checkpointing
    from cloudtrain.cli import main
    from cloudtrain.publish import atomic

    events: list[tuple[str, str]] = []
    fsync, write_synced = atomic.fsync, checkpointing._write_synced
    monkeypatch.setattr(atomic, "fsync", lambda path: (events.append(("synced", Path(path).name)), fsync(path)))
    monkeypatch.setattr(
        checkpointing,
        "_write_synced",
        lambda path, text: (events.append(("sealed", path.name)), write_synced(path, text)),
    )
    out = tmp_path / "out"
    assert main(args_for(tiny_model_dir, topic_csvs, out, "--max_steps", "1", "--checkpointing_steps", "1")[1:]) in (
        0,
        None,
    )
    files = {p.name for p in (out / "checkpoints" / "checkpoint-1").rglob("*") if p.is_file()} - {STATE_FILE}
    sealed = events.index(("sealed", STATE_FILE))
    assert files and files <= {name for kind, name in events[:sealed] if kind == "synced"}, (files, events[:sealed])


def test_the_last_steps_checkpoint_holds_the_final_evaluation(tiny_model_dir, topic_csvs, tmp_path):
    """The loop leaves the last step's evaluation to the run's end, so that step's checkpoint kept an earlier
    evaluation's score: a run extended from it (--resume_from_checkpoint latest, more steps) judged it by that, and
    --save_total_limit deleted the best checkpoint (found in audit). Both ways the final evaluation is taken: the
    run's own model, and --load_best_model_at_end's evaluation of the last step."""
    from cloudtrain.cli import main

    for every, extra in ((3, []), (2, ["--load_best_model_at_end", "true"])):
        out = tmp_path / f"out{len(extra)}"
        options = ["--max_steps", "4", "--eval_strategy", "steps", "--eval_steps", str(every), "--checkpointing_steps",
                   "2", "--save_total_limit", "1", "--metric_for_best_model", "loss", *extra]  # fmt: skip
        assert main(args_for(tiny_model_dir, topic_csvs, out, *options)[1:]) in (0, None)
        meta = json.loads((out / "checkpoints" / "checkpoint-4" / STATE_FILE).read_text())
        final = meta["state"]["evaluations"][-1]
        assert [e["step"] for e in meta["state"]["evaluations"]] == [every, 4] and meta["score"] == -final["loss"]
        if not extra:  # the run's model is the last step's: its evaluation is the one the run reports
            assert final["loss"] == pytest.approx(json.loads((out / "eval_results.json").read_text())["loss"])


@pytest.mark.slow
def test_rotation_in_a_real_run(tiny_model_dir, topic_csvs, tmp_path):
    out = tmp_path / "out"
    run(
        [sys.executable]
        + args_for(
            tiny_model_dir,
            topic_csvs,
            out,
            "--max_steps",
            "60",
            "--checkpointing_steps",
            "5",
            "--save_total_limit",
            "1",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "5",
        )
    )
    left = complete_checkpoints(out / "checkpoints")
    scores = {step: json.loads((path / STATE_FILE).read_text())["score"] for step, path in left}
    assert left[-1][0] == 60 and 1 <= len(left) <= 2
    evaluations = json.loads((left[-1][1] / STATE_FILE).read_text())["state"]["evaluations"]
    best = max(evaluations, key=lambda e: (e["accuracy"], e["step"]))
    assert max(scores.values()) == best["accuracy"]


@pytest.mark.slow
def test_a_diverging_loss_stops_and_keeps_the_last_good_checkpoint(tiny_model_dir, topic_csvs, tmp_path):
    out = tmp_path / "out"
    # AdamW's decoupled decay with lr x weight_decay = 100 multiplies the weights by -99 every step
    result = run(
        [sys.executable]
        + args_for(
            tiny_model_dir,
            topic_csvs,
            out,
            "--learning_rate",
            "1e4",
            "--warmup_ratio",
            "0",
            "--lr_scheduler_type",
            "constant",
            "--max_steps",
            "200",
            "--checkpointing_steps",
            "2",
        ),
        expect=1,
    )
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: the loss or its gradients became non-finite at step ")
    step = int(message.split("at step ")[1].split(";")[0])
    last_good = complete_checkpoints(out / "checkpoints")[-1]
    assert last_good[0] == (step - 1) // 2 * 2 and str(last_good[1]) in message
    assert all(torch.isfinite(t).all() for t in load_file(last_good[1] / "model.safetensors").values())
    assert not (out / "model.safetensors").exists()  # no final model from diverged weights


@pytest.mark.parametrize(
    "damage, message",
    [
        ("state", "is not a usable cloudtrain checkpoint"),
        ("weights", "model.safetensors has no readable header"),  # judged before anything loads
        ("foreign", "is not a usable cloudtrain checkpoint"),
        ("random states missing", "random_states_0.pkl"),  # accelerate skipped them with an info log (audit)
        ("random states cut", "random_states_0.pkl is not a whole archive"),  # judged before anything loads
        ("optimizer missing", "optimizer.bin is missing; resume from an earlier checkpoint"),  # (audit)
    ],
)
def test_a_damaged_or_foreign_checkpoint_is_one_clear_error(
    damage, message, tiny_model_dir, topic_csvs, tmp_path, capsys
):
    out = tmp_path / "out"
    base = args_for(tiny_model_dir, topic_csvs, out, "--max_steps", "4", "--checkpointing_steps", "2")[1:]
    assert main(base) == 0
    checkpoint = out / "checkpoints" / "checkpoint-4"
    if damage == "state":
        (checkpoint / STATE_FILE).write_text("{not json")
    elif damage == "weights":
        (checkpoint / "model.safetensors").write_bytes(b"\x00" * 100)
    elif damage == "random states missing":
        (checkpoint / "random_states_0.pkl").unlink()
    elif damage == "optimizer missing":
        (checkpoint / "optimizer.bin").unlink()
    elif damage == "random states cut":
        states = checkpoint / "random_states_0.pkl"
        states.write_bytes(states.read_bytes()[:200])
    else:  # a model folder, not a checkpoint; another folder's: a run of its own here, which must replace the model
        checkpoint, base = Path(tiny_model_dir), [*base, "--overwrite_output_dir", "true"]
    capsys.readouterr()
    code = main(base + ["--resume_from_checkpoint", str(checkpoint), "--max_steps", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and message in err[-1]


@pytest.mark.slow
def test_a_step_back_to_an_older_checkpoint_sets_the_newer_ones_aside(tiny_model_dir, topic_csvs, tmp_path, capsys):
    """Resumed from checkpoint-2 of 4, a run that ends at step 3 left the old checkpoint-4 as `latest`: a later
    resume took the abandoned branch (found in audit). The newer ones now move to abandoned-<time>/, kept whole."""
    out = tmp_path / "out"
    base = args_for(tiny_model_dir, topic_csvs, out, "--max_steps", "4", "--checkpointing_steps", "1")[1:]
    assert main(base) == 0
    old_four = (out / "checkpoints" / "checkpoint-4" / "model.safetensors").read_bytes()
    capsys.readouterr()
    back = ["--resume_from_checkpoint", str(out / "checkpoints" / "checkpoint-2"), "--max_steps", "3"]
    assert main([*base, *back, "--overwrite_output_dir", "true", "--seed", "777"]) == 2  # a refused resume: as it was
    assert [step for step, _ in complete_checkpoints(out / "checkpoints")] == [1, 2, 3, 4]
    assert not list((out / "checkpoints").glob("abandoned-*"))
    assert main([*base, *back, "--overwrite_output_dir", "true", "--lr_scheduler_type", "constant"]) == 0
    said = capsys.readouterr().out
    assert "note: checkpoint-3, checkpoint-4 in " in said and "came after checkpoint-2, which this run resumes" in said
    # another schedule is said, as another --max_steps or --learning_rate is (it changed the rate without a word)
    assert "note: checkpoint-2 was trained on a linear, warmup ratio 0.1 schedule; this run's is constant, and " in said
    assert [step for step, _ in complete_checkpoints(out / "checkpoints")] == [1, 2, 3]  # latest is this run's
    (aside,) = (out / "checkpoints").glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    assert (aside / "checkpoint-4" / "model.safetensors").read_bytes() == old_four
    # the branch set aside is still this folder's run: going back to it needs no --overwrite_output_dir, which
    # would delete the branch left (found in review: it was taken for another folder's checkpoint)
    again = ["--resume_from_checkpoint", str(aside / "checkpoint-4"), "--max_steps", "5"]
    assert main([*base, *again, "--lr_scheduler_type", "constant"]) == 0
    assert f"resumed from {aside / 'checkpoint-4'} at step 4" in capsys.readouterr().out
    assert [step for step, _ in complete_checkpoints(out / "checkpoints")] == [1, 2, 3, 5]


@pytest.mark.slow
def test_latest_passes_over_a_damaged_newer_checkpoint_and_says_so(tiny_model_dir, topic_csvs, tmp_path, capsys):
    out = tmp_path / "out"
    base = args_for(tiny_model_dir, topic_csvs, out, "--max_steps", "4", "--checkpointing_steps", "2")[1:]
    assert main(base) == 0
    state = out / "checkpoints" / "checkpoint-4" / STATE_FILE
    state.write_text(state.read_text()[:40])  # a truncated copy
    old_four = (state.parent / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main([*base, "--resume_from_checkpoint", "latest", "--overwrite_output_dir", "true"]) == 0
    said = capsys.readouterr().out
    assert (
        f"note: checkpoint-4 in {out / 'checkpoints'} cannot be read (its {STATE_FILE} is missing or damaged): " in said
    )
    assert f"resumed from {out / 'checkpoints' / 'checkpoint-2'} at step 2" in said
    # its weights and states were whole: set aside with the branch left, not replaced and deleted by the save at
    # its step (found in audit)
    (aside,) = (out / "checkpoints").glob("abandoned-*")
    assert (aside / "checkpoint-4" / "model.safetensors").read_bytes() == old_four
    weights = out / "checkpoints" / "checkpoint-4" / "model.safetensors"  # saved again by the resumed run
    os.truncate(weights, weights.stat().st_size // 2)
    named = ["--resume_from_checkpoint", str(weights.parent), "--max_steps", "6"]
    assert main([*base, *named]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: checkpoint {weights.parent}: model.safetensors is {weights.stat().st_size} bytes where its header "
    )


@pytest.mark.slow
def test_checkpoints_copied_into_a_fresh_output_folder_are_resumed_there(tiny_model_dir, topic_csvs, tmp_path, capsys):
    """A run's checkpoints copied to another machine's fresh output folder were refused as files cloudtrain did not
    write (the folder's own record of its files lacks them); resuming one of them makes them this run's."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(args_for(tiny_model_dir, topic_csvs, first, "--max_steps", "2", "--checkpointing_steps", "2")[1:]) == 0
    second.mkdir()
    shutil.copytree(first / "checkpoints", second / "checkpoints")
    capsys.readouterr()
    fresh = args_for(tiny_model_dir, topic_csvs, second, "--max_steps", "3")[1:]
    assert main(fresh) == 2  # a fresh run there would mix with them: refused as before
    assert "holds checkpoints of an earlier run (up to checkpoint-2)" in capsys.readouterr().err
    assert main([*fresh, "--resume_from_checkpoint", "latest"]) == 0
    assert f"resumed from {second / 'checkpoints' / 'checkpoint-2'} at step 2" in capsys.readouterr().out
    assert json.loads((second / "train_results.json").read_text())["global_step"] == 3


def test_latest_with_no_checkpoint_starts_fresh(tiny_model_dir, topic_csvs, tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        main(args_for(tiny_model_dir, topic_csvs, out, "--max_steps", "2", "--resume_from_checkpoint", "latest")[1:])
        == 0
    )
    assert "no complete checkpoint in" in capsys.readouterr().out


def test_a_fresh_run_beside_an_earlier_runs_checkpoints_is_refused_or_starts_over(
    tiny_model_dir, topic_csvs, tmp_path, capsys
):
    """An earlier run's checkpoints (killed before it saved a model) in the checkpoint folder: a fresh run there
    is refused in one line before it loads anything (resuming, rotating and choosing the best would mix the two
    runs); with --overwrite_output_dir they are deleted once the run is built. Another trainer's checkpoint-N
    (the HF Trainer's trainer_state.json), which a save of that step would replace, is refused either way."""
    folder = tmp_path / "checkpoints"
    for step in (6, 8):
        fake_checkpoint(folder, step, None)
    options = ["--max_steps", "2", "--checkpointing_steps", "1", "--save_total_limit", "1"]
    options += ["--checkpoint_dir", str(folder)]
    assert main(args_for(tiny_model_dir, topic_csvs, tmp_path / "b", *options)[1:]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {folder} holds checkpoints of an earlier run (up to checkpoint-8): continue it with "
        "--resume_from_checkpoint latest, or pass --overwrite_output_dir true to start over (they are deleted)"
    )
    assert [step for step, _ in complete_checkpoints(folder)] == [6, 8] and not (tmp_path / "b").exists()
    foreign = folder / "checkpoint-1"  # the step this run saves first
    foreign.mkdir()
    (foreign / STATE_FILE).write_text(json.dumps({"global_step": 1, "log_history": []}))
    assert complete_checkpoints(folder)[0][0] == 6  # not ours: not counted, not resumed
    overwrite = [*options, "--overwrite_output_dir", "true"]
    assert main(args_for(tiny_model_dir, topic_csvs, tmp_path / "b", *overwrite)[1:]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {folder} holds checkpoint-1, which cloudtrain did not write and a save of that step would replace; "
        "give the run a --checkpoint_dir of its own"
    )
    shutil.rmtree(foreign)
    assert main(args_for(tiny_model_dir, topic_csvs, tmp_path / "b", *overwrite)[1:]) == 0
    assert "the earlier run's checkpoints" in capsys.readouterr().out
    assert [step for step, _ in complete_checkpoints(folder)] == [2]  # this run's newest, rotation at 1


def test_a_fresh_run_does_not_replace_an_earlier_checkpoint_whose_state_file_is_damaged(
    tiny_model_dir, topic_csvs, tmp_path, capsys
):
    """An earlier run's checkpoint-2 whose trainer_state.json was cut short (a truncated copy): a fresh run saving
    step 2 replaced its weights without a word, where an intact one is refused (audit). It is refused in one line
    before anything loads; with --overwrite_output_dir it is deleted as the intact ones are."""
    folder = tmp_path / "checkpoints"
    old = folder / "checkpoint-2"
    (old / MARKS).mkdir(parents=True)
    (old / MARKS / "0").touch()
    (old / "model.safetensors").write_bytes(b"the earlier run's weights")
    (old / STATE_FILE).write_text(json.dumps({"format": FORMAT, "state": {"global_step": 2}})[:20])
    options = ["--max_steps", "2", "--checkpointing_steps", "2", "--checkpoint_dir", str(folder)]
    assert main(args_for(tiny_model_dir, topic_csvs, tmp_path / "b", *options)[1:]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {folder} holds checkpoint-2 of an earlier run, whose {STATE_FILE} cannot be read (damaged or cut "
        "short): restore that file and continue with --resume_from_checkpoint latest, move the folder elsewhere, or "
        "pass --overwrite_output_dir true to start over (it is deleted)"
    )
    assert (old / "model.safetensors").read_bytes() == b"the earlier run's weights"
    latest = [*options, "--resume_from_checkpoint", "latest"]  # said "starting fresh", then refused (review)
    assert main(args_for(tiny_model_dir, topic_csvs, tmp_path / "b", *latest)[1:]) == 2
    said = capsys.readouterr()
    assert "starting fresh" not in said.out and said.err.strip() == (
        f"error: no checkpoint in {folder} is whole (checkpoint-2: its {STATE_FILE} cannot be read): restore its "
        "files, or pass --overwrite_output_dir true to start over (they are deleted)"
    )
    assert (
        main(args_for(tiny_model_dir, topic_csvs, tmp_path / "b", *options, "--overwrite_output_dir", "true")[1:]) == 0
    )
    assert [step for step, _ in complete_checkpoints(folder)] == [2]  # this run's


def test_a_checkpoint_of_another_optimizer_is_refused_before_anything_loads(tmp_path):
    """Resuming an AdamW checkpoint with --optim adafactor (or back) ended in KeyError 'beta1' from the optimizer's
    first step, after the data and model had loaded (found in audit)."""
    from dataclasses import asdict

    from cloudtrain.checkpointing import FORMAT, TrainerState, check_resumable

    def checkpoint(optimizer: str | None) -> Path:
        path = tmp_path / f"checkpoint-{optimizer}"
        path.mkdir()
        meta = {"format": FORMAT, "state": asdict(TrainerState()), "adapters": None}
        (path / STATE_FILE).write_text(json.dumps(meta if optimizer is None else {**meta, "optimizer": optimizer}))
        return path

    adamw, older = checkpoint("adamw"), checkpoint(None)  # before the record: loading tells
    check_resumable(build_config({"optim": "adamw", "model_config": "llama-8m"}), adamw)
    check_resumable(build_config({"optim": "adafactor", "model_config": "llama-8m"}), older)
    with pytest.raises(UserError) as refused:
        check_resumable(build_config({"optim": "adafactor", "model_config": "llama-8m"}), adamw)
    assert str(refused.value) == (
        f"checkpoint {adamw} was trained with --optim adamw, this run asks for --optim adafactor: resume with --optim "
        "adamw, or start a fresh run without --resume_from_checkpoint"
    )


def test_rotation_renames_a_checkpoint_away_before_deleting_it(tmp_path, monkeypatch):
    """A kill in the middle of rotation's delete left a checkpoint-N without its state file and marks, which now
    reads as another trainer's and refuses every run in the folder (found in review): the folder is renamed to a
    hidden name first, so a kill leaves that instead."""
    from cloudtrain.checkpointing import Checkpointer
    from cloudtrain.resume import foreign_checkpoints

    folder = tmp_path / "checkpoints"
    for step in (2, 4):
        fake_checkpoint(folder, step, None)
    checkpointer = Checkpointer.__new__(Checkpointer)
    checkpointer.folder, checkpointer.before_delete = folder, None

    def killed(path, ignore_errors=False):
        raise KeyboardInterrupt("killed mid-delete")

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpointer.delete([2])
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["checkpoint-4"]
    assert foreign_checkpoints(folder) == []


def test_a_checkpoint_folder_with_no_state_file_of_ours_and_no_marks_is_another_trainers(tmp_path):
    """A `checkpoint-N` with no trainer_state.json (a plain save_pretrained, an HF Trainer checkpoint killed before
    its state file) was taken for a damaged one of ours, and a save of its step deleted it (found in audit)."""
    from cloudtrain.checkpointing import MARKS
    from cloudtrain.resume import foreign_checkpoints

    folder = tmp_path / "checkpoints"
    (folder / "checkpoint-1").mkdir(parents=True)
    (folder / "checkpoint-1" / "pytorch_model.bin").write_bytes(b"weights")
    (folder / "checkpoint-2").mkdir()
    (folder / "checkpoint-2" / STATE_FILE).write_text(json.dumps({"global_step": 2}))  # the HF Trainer's
    (folder / "checkpoint-3" / MARKS).mkdir(parents=True)  # ours, its state file damaged
    (folder / "checkpoint-3" / STATE_FILE).write_text("{not json")
    fake_checkpoint(folder, 4, None)
    assert foreign_checkpoints(folder) == ["checkpoint-1", "checkpoint-2"]


@pytest.mark.slow  # fresh training runs: the full suite's, not the fast tier's
def test_another_folders_checkpoint_resumed_here_starts_a_run_of_its_own(tiny_model_dir, topic_csvs, tmp_path, capsys):
    """A checkpoint of run A resumed into a folder holding run X's model replaced that model unasked and drew
    X's steps and A's as one curve; into a folder holding X's checkpoints, rotation and the best model mixed them
    (found in audit). Another folder's checkpoint starts a run of its own here: refused as a fresh run would be,
    and with --overwrite_output_dir its log is the checkpoint's."""
    a, x = tmp_path / "a", tmp_path / "x"
    steps = ["--logging_steps", "1", "--checkpointing_steps", "2"]
    assert main(args_for(tiny_model_dir, topic_csvs, a, "--max_steps", "4", *steps)[1:]) == 0
    assert main(args_for(tiny_model_dir, topic_csvs, x, "--max_steps", "3", *steps)[1:]) == 0
    kept = (x / "model.safetensors").read_bytes()
    resume = [*steps, "--max_steps", "4", "--resume_from_checkpoint", str(a / "checkpoints" / "checkpoint-2")]
    capsys.readouterr()
    assert main(args_for(tiny_model_dir, topic_csvs, x, *resume)[1:]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --resume_from_checkpoint {a / 'checkpoints' / 'checkpoint-2'} is not in this run's checkpoint "
        f"folder {x / 'checkpoints'}, and --output_dir {x} already holds a model: give --checkpoint_dir "
        f"{a / 'checkpoints'} if it is this run's, or pass --overwrite_output_dir true to continue it here as a run "
        "of its own"
    )
    assert (x / "model.safetensors").read_bytes() == kept
    y = tmp_path / "y"  # X's checkpoints without its model: a run killed before it saved one
    shutil.copytree(x / "checkpoints", y / "checkpoints")
    assert main(args_for(tiny_model_dir, topic_csvs, y, *resume)[1:]) == 2
    assert f"{y / 'checkpoints'} holds checkpoints of an earlier run (up to checkpoint-2)" in capsys.readouterr().err
    assert main(args_for(tiny_model_dir, topic_csvs, x, *resume, "--overwrite_output_dir", "true")[1:]) == 0

    def losses(folder: Path) -> dict[int, float]:
        lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return {e["step"]: e["train/loss"] for e in lines if "train/loss" in e}

    assert losses(x) == losses(a)  # A's steps 1-2 from its checkpoint's log, then the same steps 3-4
    assert [step for step, _ in complete_checkpoints(x / "checkpoints")] == [4]  # X's were deleted


def test_a_restarted_attempt_resumes_only_what_its_launch_saved(tmp_path, monkeypatch):
    """Under torchrun --max-restarts, attempt 1 goes back to the latest checkpoint only when this launch wrote
    it: an earlier run's (older than the launch) leaves the attempt to start as the first did, and be refused."""
    fake_checkpoint(tmp_path, 4, None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    runtime = SimpleNamespace(agree=lambda flags: flags, is_main=False, gather_objects=lambda value: [value])
    cfg = build_config({})
    os.utime(tmp_path / "checkpoint-4" / STATE_FILE, (1, 1))  # written in 1970: before this launch
    assert restarted_defaults(cfg, tmp_path, runtime).checkpoint.resume_from_checkpoint is None
    os.utime(tmp_path / "checkpoint-4" / STATE_FILE)  # now: this launch's
    assert restarted_defaults(cfg, tmp_path, runtime).checkpoint.resume_from_checkpoint == "latest"
    # a c10d launch restarts the healthy node's workers with their count unchanged (0): they resume too, as the
    # restarted node's do, or the two would run different collectives (found in audit)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    other_node_restarted = SimpleNamespace(agree=lambda flags: flags, is_main=False, gather_objects=lambda v: [v, 1])
    assert restarted_defaults(cfg, tmp_path, other_node_restarted).checkpoint.resume_from_checkpoint == "latest"


def test_every_process_of_a_group_joins_under_one_prefix_new_for_each_group():
    """torchrun's restart count named the join's keys: after one node's worker died, a c10d launch restarted the
    healthy node's workers with count 0 and the other node's with 1, and the two waited on different keys until
    the init timeout (found in audit). The count of joins per rank, kept in the launch's store, agrees."""
    import torch.distributed as dist

    from cloudtrain.parallel.runtime import join_prefix

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    first = {rank: join_prefix(store, rank, 2) for rank in (0, 1)}  # the first attempt's two workers
    second = {rank: join_prefix(store, rank, 2) for rank in (1, 0)}  # a restart, whatever order they come in
    assert first[0] == first[1] and second[0] == second[1] and first[0] != second[0]
    assert join_prefix(store, 0, 3) != second[0]  # another world size: keys of its own


@pytest.mark.slow
@pytest.mark.parametrize("training_type", ["basic", "accelerated"])
def test_a_resumed_run_reports_what_this_launch_trained(training_type, tiny_model_dir, topic_csvs, tmp_path, capsys):
    """Steps 3-4 from checkpoint-2, with the throughput over this launch's samples (the checkpoint's logging sums
    not yet logged belong to the launch before); then checkpoint-4, the last step: nothing trained, nothing
    invented, no step trained twice."""
    from cloudtrain import train

    out = tmp_path / "out"
    args = args_for(tiny_model_dir, topic_csvs, out, "--max_steps", "4", "--checkpointing_steps", "2")[1:]
    options = {k.lstrip("-"): v for k, v in zip(args[::2], args[1::2], strict=True)}
    options |= {"training_type": training_type, "logging_steps": "10", "eval_strategy": "no"}  # logged at step 4 only
    first = train(options)["train"]
    assert "trained 4 steps in " in capsys.readouterr().out and "resumed_at_step" not in first

    resumed = train(options | {"resume_from_checkpoint": str(out / "checkpoints" / "checkpoint-2")})["train"]
    said = capsys.readouterr().out
    assert "trained steps 3-4 of 4 (2 this launch, resumed at step 2) in " in said, said[-600:]
    assert resumed["launch_steps"] == 2 and resumed["launch_samples"] == 2 * 4  # steps x per-device batch
    assert resumed["train_samples"] == 4 * 4 and resumed["train_loss"] == first["train_loss"]
    rate = resumed["launch_samples_per_s"]  # over those 8 samples, within the rounding of launch_runtime_s
    assert rate * resumed["launch_runtime_s"] == pytest.approx(8, abs=rate * 0.006)
    assert f"({resumed['launch_samples_per_s']:.1f} samples/s" in said
    saved = json.loads((out / "checkpoints" / "checkpoint-2" / "trainer_state.json").read_text())["state"]
    assert saved["device_s"] == pytest.approx(saved["runtime_s"])  # one process
    assert "in this launch, " in said and "with the launches before it" in said  # the compute line

    finished = train(options | {"resume_from_checkpoint": "latest"})["train"]
    said = capsys.readouterr().out
    assert "checkpoint-4 is at step 4 of 4: nothing left to train; evaluating and saving its model" in said
    assert "trained no steps this launch (resumed at step 4: nothing was left to train)" in said, said[-600:]
    assert "samples/s" not in said.split("trained no steps")[1].splitlines()[0]
    assert (finished["global_step"], finished["launch_steps"], finished["launch_samples"]) == (4, 0, 0)
    assert "launch_samples_per_s" not in finished and finished["train_loss"] == first["train_loss"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "train/loss" in e] == [4]
    kinds = [next(k.split("/")[0] for k in e if "/" in k) for e in logged if e["step"] == 4]
    assert "eval" in kinds and sorted(kinds) == sorted(set(kinds)), kinds  # the final evaluation once, not per launch
    final, last = (
        load_file(out / "model.safetensors"),
        load_file(out / "checkpoints" / "checkpoint-4" / "model.safetensors"),
    )
    assert all(torch.equal(final[name], last[name]) for name in final if name in last)


@pytest.mark.slow  # the fast tier's slowest (5-6 s): the full suite runs it
def test_a_resume_at_another_batch_is_refused_before_it_trains(tiny_model_dir, topic_csvs, tmp_path, capsys):
    """The checkpoint's step is its position in the data: 8 rows a step from a step taken at 4 would skip rows."""
    from cloudtrain import train

    out = tmp_path / "out"
    args = args_for(tiny_model_dir, topic_csvs, out, "--max_steps", "2", "--checkpointing_steps", "2")[1:]
    options = {k.lstrip("-"): v for k, v in zip(args[::2], args[1::2], strict=True)} | {"eval_strategy": "no"}
    train(options)
    checkpoint = out / "checkpoints" / "checkpoint-2"
    again = options | {"max_steps": "4", "resume_from_checkpoint": str(checkpoint), "output_dir": str(tmp_path / "b")}
    with pytest.raises(UserError) as refused:
        train(again | {"per_device_train_batch_size": "8"})
    assert str(refused.value) == (
        f"checkpoint {checkpoint} took 4 rows per process per step (4 rows x 1 accumulation); this run takes 8, and "
        "the checkpoint's step is its position in the data: give --per_device_train_batch_size and "
        "--gradient_accumulation_steps whose product is 4"
    )
    assert not (tmp_path / "b" / "model.safetensors").exists()
    with pytest.raises(UserError, match=r"trained with --seed \d+ and this run has --seed 12345: its step is a posi"):
        train(again | {"seed": "12345"})  # the rows' order is the seed's (accepted silently before: audit)
    # a label renamed between the runs sorts elsewhere: two outputs would silently swap meanings (the audit's
    # resume fell from accuracy 1.0 to 0.33 in one step)
    renamed = {split: tmp_path / f"renamed-{split}.csv" for split in ("train", "validation")}
    for split, path in renamed.items():
        path.write_text(Path(topic_csvs[split]).read_text().replace(",sports", ",athletics"))
    with pytest.raises(UserError) as refused:
        train(again | {f"{split}_file": str(path) for split, path in renamed.items()})
    assert str(refused.value).startswith(
        f"checkpoint {checkpoint} was trained on 3 labels and this run's data names 3: label 0 is 'finance' there and "
        "'athletics' here, so the model's outputs would mean other labels; resume with the data it was trained on"
    )
    assert json.loads((checkpoint / "trainer_state.json").read_text())["labels"] == ["finance", "sports", "weather"]
    capsys.readouterr()
    result = train(again | {"per_device_train_batch_size": "2", "gradient_accumulation_steps": "2"})["train"]
    assert result["global_step"] == 4  # the same rows per step, cut another way: accepted
    assert json.loads((checkpoint / "trainer_state.json").read_text())["state"]["total_steps"] == 2
    said = capsys.readouterr().out
    assert (  # --max_steps 4 extends a run planned for 2: its schedule is rebuilt, and the run says so
        "note: checkpoint-2 was trained on a learning-rate schedule of 2 steps; this run's has 4, and from step 2 the "
        "learning rate follows it (as if 4 had been planned from the start)" in said
    )
    assert "other training data" not in said  # the same rows: the run goes on as the one that stopped
    assert "was trained with --" not in said  # the same learning rate and weight decay
    # another --learning_rate and --weight_decay: the checkpoint's optimizer and schedule states brought back the
    # old ones, silently (found in audit); now this run's take over, the schedule's shape kept
    changed = {"learning_rate": "0.004", "weight_decay": "0.5", "output_dir": str(tmp_path / "lr")}
    train(again | changed | {"logging_steps": "1"})
    said = capsys.readouterr().out
    assert (
        "note: checkpoint-2 was trained with --learning_rate " in said
        and "(this run's 0.004) and --weight_decay" in said
    )
    fresh = train(options | changed | {"max_steps": "4", "logging_steps": "1", "output_dir": str(tmp_path / "fresh")})
    assert fresh["train"]["global_step"] == 4
    rates = {
        name: [
            json.loads(line)["train/learning_rate"]
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            if "train/learning_rate" in line
        ][-2:]
        for name in ("lr", "fresh")
    }
    assert rates["lr"] == pytest.approx(rates["fresh"], rel=1e-9)  # steps 3 and 4 as if planned at 0.004
    # the same labels, edited rows: the step means other batches now, which the run says (it may be meant)
    edited = tmp_path / "edited-train.csv"
    lines = Path(topic_csvs["train"]).read_text().splitlines()
    edited.write_text("\n".join([lines[0], *["today " + line for line in lines[1:]]]) + "\n")
    train(again | {"train_file": str(edited), "output_dir": str(tmp_path / "c")})
    rows = len(lines) - 1
    assert (
        f"note: checkpoint-2 was trained on other training data (the same {rows} rows in number, other in content)"
        in capsys.readouterr().out
    )
    edited.write_text("\n".join([*lines, lines[1]]) + "\n")
    train(again | {"train_file": str(edited), "output_dir": str(tmp_path / "d")})
    assert f"other training data ({rows} rows there, {rows + 1} here)" in capsys.readouterr().out


def views(*steps_by_node: list[int], named: bool = True) -> list[dict]:
    """One process per node, each seeing its own folder's complete steps."""
    return [{"node": n, "host": f"host{n}", "steps": s, "named": named} for n, s in enumerate(steps_by_node)]


def test_latest_is_the_newest_step_every_node_holds(tmp_path, capsys):
    for step in (7, 14):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / STATE_FILE).write_text(json.dumps({"format": "cloudtrain-checkpoint/1", "state": {}}))
    cfg = build_config({"resume_from_checkpoint": "latest"})
    assert choose_resume(cfg, tmp_path, views([7, 14], [7, 14])) == tmp_path / "checkpoint-14"
    assert choose_resume(cfg, tmp_path, views([7, 14, 21], [7, 14])) == tmp_path / "checkpoint-14"
    assert "checkpoint-21 is not complete on node 1 (host1): resuming from checkpoint-14" in capsys.readouterr().out
    assert choose_resume(cfg, tmp_path, views([], [])) is None
    with pytest.raises(UserError, match=r"node 1 \(host1\) holds no complete checkpoint .* up to checkpoint-14"):
        choose_resume(cfg, tmp_path, views([7, 14], []))


def test_a_checkpoint_whose_weights_are_cut_short_is_passed_over_by_latest_and_refused_by_name(tmp_path, capsys):
    """A copy interrupted or a disk that filled left checkpoint-14's weights half written: the resume from `latest`
    failed on loading them, after the model was built. Each file is judged from its header or archive index."""
    from safetensors.torch import save_file

    for step in (7, 14):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / STATE_FILE).write_text(json.dumps({"format": FORMAT, "state": {}}))
        save_file({"w": torch.ones(64)}, folder / "model.safetensors")
        torch.save({"m": torch.ones(64)}, folder / "optimizer.bin")
    cfg = build_config({"resume_from_checkpoint": "latest"})
    assert cut_short(tmp_path / "checkpoint-14") is None and local_view(cfg, tmp_path)["damaged"] == []
    weights = tmp_path / "checkpoint-14" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 10)
    assert cut_short(tmp_path / "checkpoint-14") == (
        f"model.safetensors is {weights.stat().st_size} bytes where its header needs {weights.stat().st_size + 10} "
        "(cut short or damaged)"
    )
    found = [{**local_view(cfg, tmp_path), "node": 0, "host": ""}]
    assert choose_resume(cfg, tmp_path, found) == tmp_path / "checkpoint-7"
    assert "note: checkpoint-14 (model.safetensors is " in capsys.readouterr().out
    optimizer = tmp_path / "checkpoint-7" / "optimizer.bin"
    os.truncate(optimizer, optimizer.stat().st_size // 2)
    assert cut_short(tmp_path / "checkpoint-7") == "optimizer.bin is not a whole archive (cut short or damaged)"
    states = tmp_path / "states" / "random_states_0.pkl"  # accelerate's: torch.save's archive too
    states.parent.mkdir()
    torch.save({"python": list(range(100))}, states)
    os.truncate(states, states.stat().st_size // 2)
    assert cut_short(states.parent) == "random_states_0.pkl is not a whole archive (cut short or damaged)"
    found = [{**local_view(cfg, tmp_path), "node": 0, "host": ""}]
    with pytest.raises(UserError, match="^no checkpoint in .* is whole .*pass --overwrite_output_dir true to start"):
        choose_resume(cfg, tmp_path, found)


@pytest.mark.parametrize(
    ("trainer", "engine", "files", "removed"),
    [
        ("BasicTrainer", None, ["model.safetensors", "training_state.pt"], "training_state.pt"),
        ("BasicTrainer", None, ["model.safetensors", "training_state.pt"], "model.safetensors"),
        ("AcceleratedTrainer", "none", ["model.safetensors", "optimizer.bin", "scheduler.pt"], "optimizer.bin"),
        ("AcceleratedTrainer", "ZeRO-2", ["scheduler.pt"], "scheduler.pt"),
        (
            "PipelineTrainer",
            None,
            ["pipeline.json", "pipeline-rank0.safetensors", "pipeline-rank0.pt"],
            "pipeline-rank0.pt",
        ),
    ],
)
def test_a_checkpoint_missing_a_file_its_trainer_always_writes_is_passed_over_by_latest_and_refused_by_name(
    trainer, engine, files, removed, tmp_path, capsys
):
    """An S3 restore of an interrupted upload (SageMaker's default resume is latest) left checkpoint-14 without one
    of its files: `latest` failed on loading it after the data and model were built, on every restart (audit)."""
    from safetensors.torch import save_file

    for step in (7, 14):
        folder = tmp_path / f"checkpoint-{step}"
        (folder / MARKS).mkdir(parents=True)
        (folder / MARKS / "0").touch()
        meta = {"format": FORMAT, "trainer": trainer, "engine": engine, "mesh": {"world": 1}, "state": {}}
        (folder / STATE_FILE).write_text(json.dumps(meta))
        for name in files:
            if name.endswith(".safetensors"):
                save_file({"w": torch.ones(4)}, folder / name)
            else:
                torch.save({"m": torch.ones(4)}, folder / name)
    cfg = build_config({"resume_from_checkpoint": "latest"})
    assert cut_short(tmp_path / "checkpoint-14") is None
    (tmp_path / "checkpoint-14" / removed).unlink()
    assert cut_short(tmp_path / "checkpoint-14") == f"{removed} is missing"
    found = [{**local_view(cfg, tmp_path), "node": 0, "host": ""}]
    assert choose_resume(cfg, tmp_path, found) == tmp_path / "checkpoint-7"
    assert f"note: checkpoint-14 ({removed} is missing) in {tmp_path}: latest passes over it" in capsys.readouterr().out


def test_adapters_resumed_over_a_base_with_other_weights_of_the_same_shape_are_refused(tiny_model_dir, tmp_path):
    """The checkpoint holds only the adapters; a base of the same shape with other weights (a fine-tuned variant)
    took them without a word. A copy of the same base passes."""
    from safetensors.torch import load_file, save_file

    from cloudtrain.checkpointing import adapter_settings, check_resumable
    from cloudtrain.models.record import model_record

    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(tiny_model_dir, same)
    shutil.copytree(tiny_model_dir, other)
    weights = load_file(other / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name] = weights[name] + 1  # fine-tuned: every value moved
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    trained = build_config({"model_name_or_path": tiny_model_dir, "peft": "lora"})
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    meta = {"format": FORMAT, "state": {}, "adapters": adapter_settings(trained), "model": model_record(trained)}
    (checkpoint / STATE_FILE).write_text(json.dumps(meta))
    check_resumable(build_config({"model_name_or_path": str(same), "peft": "lora"}), checkpoint)
    with pytest.raises(UserError, match=r"trained adapters over other base weights \(.*\) than this run loads"):
        check_resumable(build_config({"model_name_or_path": str(other), "peft": "lora"}), checkpoint)
    assert "base_weights" not in model_record(build_config({"model_name_or_path": str(other)}))  # full weights saved
    resharded = tmp_path / "resharded"  # the same tensors in two shards: the same base (it was refused)
    shutil.copytree(tiny_model_dir, resharded)
    (resharded / "model.safetensors").unlink()
    names = sorted(load_file(same / "model.safetensors"))
    original = load_file(same / "model.safetensors")
    for i, part in enumerate((names[::2], names[1::2]), 1):
        save_file({n: original[n] for n in part}, resharded / f"model-0000{i}-of-00002.safetensors")
    check_resumable(build_config({"model_name_or_path": str(resharded), "peft": "lora"}), checkpoint)


def test_a_step_counts_for_a_process_only_once_its_own_files_are_written(tmp_path):
    for step in (7, 14):
        (tmp_path / f"checkpoint-{step}" / MARKS).mkdir(parents=True)
        (tmp_path / f"checkpoint-{step}" / STATE_FILE).write_text(json.dumps({"format": FORMAT}))
        (tmp_path / f"checkpoint-{step}" / MARKS / "0").touch()
    (tmp_path / "checkpoint-14" / MARKS / "1").touch()
    (tmp_path / "checkpoint-3").mkdir()  # written before the marks existed: whole
    (tmp_path / "checkpoint-3" / STATE_FILE).write_text(json.dumps({"format": FORMAT}))
    cfg = build_config({"resume_from_checkpoint": "latest"})
    assert local_view(cfg, tmp_path, index=0)["steps"] == [3, 7, 14]
    assert local_view(cfg, tmp_path, index=1)["steps"] == [3, 14]  # process 1's part of step 7 never arrived


def test_a_named_checkpoint_missing_on_one_node_is_an_error_naming_it(tmp_path):
    cfg = build_config({"resume_from_checkpoint": str(tmp_path)})
    found = views([7], [7])
    found[1]["named"] = False
    with pytest.raises(UserError, match=r"does not exist on node 1 \(host1\); give a checkpoint directory every node"):
        choose_resume(cfg, tmp_path, found)


def test_a_named_folder_of_checkpoints_names_the_checkpoints_it_holds(tmp_path):
    """--resume_from_checkpoint <out>/checkpoints (the folder, not one checkpoint) said it was not a usable checkpoint
    for want of trainer_state.json (audit): it names the newest checkpoint to give instead."""
    folder = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        fake_checkpoint(folder, step, None)
    (folder / "checkpoint-8" / STATE_FILE).write_text("{cut")  # not complete: not the one to give
    cfg = build_config({"resume_from_checkpoint": str(folder)})
    with pytest.raises(UserError) as refused:
        choose_resume(cfg, folder, views([6]))
    assert str(refused.value) == (
        f"--resume_from_checkpoint {folder} is a folder of checkpoints (... checkpoint-4, checkpoint-6, checkpoint-8), "
        f"not one: give {folder / 'checkpoint-6'}, or latest"
    )
    with pytest.raises(UserError, match=f"give {folder / 'checkpoint-6'}, or latest with --checkpoint_dir {folder}$"):
        choose_resume(cfg, tmp_path / "elsewhere", views([]))
    run = build_config({"resume_from_checkpoint": str(tmp_path)})  # the run's output folder: its checkpoints/ (review)
    with pytest.raises(UserError, match=f"^--resume_from_checkpoint {tmp_path} is a folder of checkpoints .* give "):
        choose_resume(run, tmp_path / "elsewhere", views([]))


def test_storage_is_one_shared_folder_or_one_per_node_and_nothing_else():
    shared = [{"node": r // 2, "host": "", "seen": [0, 1, 2, 3]} for r in range(4)]
    assert [storage_from(shared, r) for r in range(4)] == [Storage(owner=True)] + [Storage(owner=False)] * 3
    local = [{"node": r // 2, "host": "", "seen": [0, 1] if r < 2 else [2, 3]} for r in range(4)]
    assert [s.owner for s in (storage_from(local, r) for r in range(4))] == [True, False, True, False]
    assert all(storage_from(local, r).per_node for r in range(4))
    mixed = [{"node": r // 2, "host": "", "seen": [0, 1, 2] if r != 3 else [3]} for r in range(4)]
    with pytest.raises(UserError, match="neither one folder shared by every node nor one per node"):
        storage_from(mixed, 0)


@pytest.mark.parametrize("sealed", [True, False])
def test_a_kill_between_the_renames_of_a_step_saved_again_loses_neither_checkpoint(tmp_path, sealed):
    """A checkpoint saved again at its step (after a resume) renames the old one aside, then the new one in: a kill
    between the two leaves no checkpoint-N. The next start gives the name to the new one when it was sealed, else
    back to the old one; it used to resume from an older step, and the old one was never removed."""
    fake_checkpoint(tmp_path, 2, 0.5)
    fake_checkpoint(tmp_path, 4, 0.1)
    (tmp_path / "checkpoint-4").rename(tmp_path / "checkpoint-4.replaced")  # what the kill left
    new = tmp_path / "checkpoint-4.partial"
    new.mkdir()
    (new / "model.safetensors").write_text("new weights")
    if sealed:
        (new / STATE_FILE).write_text(json.dumps({"format": FORMAT, "score": 0.9}))
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2]
    finish_replacement(tmp_path)
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2, 4]
    score = json.loads((tmp_path / "checkpoint-4" / STATE_FILE).read_text())["score"]
    assert score == (0.9 if sealed else 0.1)
    assert not (tmp_path / "checkpoint-4.replaced").exists()
    # the second rename had happened (the kill came before the old one was removed): the new one stays
    (tmp_path / "checkpoint-4.replaced").mkdir()
    finish_replacement(tmp_path)
    assert not (tmp_path / "checkpoint-4.replaced").exists() and json.loads(
        (tmp_path / "checkpoint-4" / STATE_FILE).read_text()
    )["score"] == (0.9 if sealed else 0.1)


def wider_copy(model_dir: str, folder: Path) -> str:
    """The same kind of model with a wider hidden size (random weights), its tokenizer beside it."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    config.hidden_size, config.intermediate_size = config.hidden_size * 2, config.intermediate_size * 2
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused_before_the_data_and_named_as_such_when_older(
    tiny_model_dir, topic_csvs, tmp_path, capsys
):
    """It used to load the data and the model, then call the checkpoint "damaged"."""
    first, other = tmp_path / "first", wider_copy(tiny_model_dir, tmp_path / "wider")
    assert main(args_for(tiny_model_dir, topic_csvs, first, "--max_steps", "2", "--checkpointing_steps", "1")[1:]) == 0
    checkpoint = first / "checkpoints" / "checkpoint-1"
    again = [*args_for(other, topic_csvs, tmp_path / "second", "--max_steps", "3")[1:]]
    capsys.readouterr()
    assert main([*again, "--resume_from_checkpoint", str(checkpoint)]) == 2
    said = capsys.readouterr()
    hidden = json.loads((Path(tiny_model_dir) / "config.json").read_text())["hidden_size"]
    assert said.err.strip() == (
        f"error: checkpoint {checkpoint} was written for another model ({tiny_model_dir}, hidden_size {hidden}; "
        f"{other} has {hidden * 2}): resume with the model that wrote it, or start a fresh run without "
        "--resume_from_checkpoint"
    )
    assert "data:" not in said.out
    state = json.loads((checkpoint / STATE_FILE).read_text())
    del state["model"]  # as the checkpoints written before the record: loading finds out, and says what it found
    (checkpoint / STATE_FILE).write_text(json.dumps(state))
    assert main([*again, "--resume_from_checkpoint", str(checkpoint)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: checkpoint {checkpoint} does not fit the model this run builds (size mismatch for ")
    assert err.endswith("resume with the model and options that wrote it, or start a fresh run without "
                        "--resume_from_checkpoint") and "damaged" not in err  # fmt: skip


def test_a_resume_in_another_order_of_the_rows_or_off_a_stream_is_refused(tmp_path):
    """--group_by_length changed at a resume, and a streaming checkpoint resumed on stored rows, trained from the
    checkpoint's step in another order without a word (12 of 64 rows twice, 12 never; found in audit)."""
    from cloudtrain.checkpointing import DATA_STATE_FILE
    from cloudtrain.resume import check_order

    meta = {"seed": 42, "batch": {"per_device_train_batch_size": 4, "group_by_length": True}}
    check_order(meta, tmp_path, build_config({"seed": 42, "group_by_length": True}))
    check_order({"seed": 42}, tmp_path, build_config({"group_by_length": True}))  # a checkpoint before the record
    with pytest.raises(UserError, match="was trained with --group_by_length true and this run has false: its step"):
        check_order(meta, tmp_path, build_config({"seed": 42}))
    (tmp_path / DATA_STATE_FILE).write_text("{}")
    with pytest.raises(UserError, match="holds a stream's position .* with --streaming true; resume it the same way"):
        check_order(meta, tmp_path, build_config({"seed": 42, "group_by_length": True}))


def test_the_partial_folders_of_saves_a_kill_cut_are_removed_before_a_run_starts(tmp_path):
    """Only a save again at the same step removed one: a resume at other --checkpointing_steps kept a whole
    checkpoint's worth of files per preemption, outside --save_total_limit (found in audit)."""
    from types import SimpleNamespace

    from cloudtrain.checkpointing import FORMAT, MARKS
    from cloudtrain.resume import finish_interrupted_saves

    cut = tmp_path / "checkpoint-6.partial"
    (cut / MARKS).mkdir(parents=True)
    (cut / "model.safetensors").write_bytes(b"x" * 100)
    users = tmp_path / "checkpoint-notes.partial"  # not a save of ours (no marks, no step): kept
    users.mkdir()
    sealed = tmp_path / "checkpoint-8.partial"  # complete, killed before its rename: it takes its name (review)
    (sealed / MARKS).mkdir(parents=True)
    (sealed / STATE_FILE).write_text(json.dumps({"format": FORMAT, "state": {"global_step": 8}}))
    finish_interrupted_saves(tmp_path, SimpleNamespace(barrier=lambda: None))
    assert not cut.exists() and users.is_dir() and not sealed.exists()
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [8]


def test_a_misfit_checkpoint_in_a_sagemaker_job_names_what_the_user_can_change(tmp_path, monkeypatch):
    """Found in audit: inside a job the line advised a fresh run "without --resume_from_checkpoint", a value the
    user never passed (the job's own default, over the checkpoints SageMaker restored from S3)."""
    from cloudtrain.resume import load_failure

    misfit = RuntimeError('Error(s) in loading state_dict:\n\tMissing key(s) in state_dict: "score.weight".')
    path = tmp_path / "checkpoint-4"
    monkeypatch.delenv("SM_MODEL_DIR", raising=False)
    assert str(load_failure(path, misfit)).endswith(
        "resume with the model and options that wrote it, or start a fresh run without --resume_from_checkpoint"
    )
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("CLOUDTRAIN_CHECKPOINT_DIR", str(tmp_path))  # the job's own folder, restored from S3
    said = str(load_failure(path, misfit))
    assert said == (
        f'checkpoint {path} does not fit the model this run builds (Missing key(s) in state_dict: "score.weight".): '
        "resume with the model and options that wrote it, or start a fresh job with another checkpoint_s3_uri "
        "(a job resumes the checkpoints SageMaker restores from its own)"
    )
    assert "--resume_from_checkpoint" not in said
    given = tmp_path.parent / "from-another-job" / "checkpoint-4"  # a path the user passed in the job's options
    assert str(load_failure(given, misfit)).endswith("start a fresh run without --resume_from_checkpoint")


def test_a_resume_by_a_run_of_another_task_says_so_not_other_data(tmp_path):
    """Found in audit: a --task reward run over a --task dpo checkpoint was told the checkpoint "was trained on
    other training data" when the task was what differed (the same pairs, encoded for another task)."""
    from cloudtrain.data.fingerprint import other_data_note

    path = tmp_path / "checkpoint-4"
    dpo = {"rows": 16, "fingerprint": "081f6df2308cd2c2", "task": "dpo"}
    reward = {"rows": 16, "fingerprint": "0a0a0a0a0a0a0a0a", "task": "reward"}
    assert other_data_note({"data": dpo}, reward, path) == (
        "note: checkpoint-4 was trained by a --task dpo run and this one is --task reward: its weights and its place "
        "in the data are another task's; resume it with --task dpo, or start from a model, not a checkpoint"
    )
    assert other_data_note({"data": dpo}, dpo, path) is None
    older = {"rows": 16, "fingerprint": "081f6df2308cd2c2"}  # a checkpoint from before the task was recorded
    assert other_data_note({"data": older}, dpo, path) is None
    longer = other_data_note({"data": older}, dpo | {"rows": 17}, path)
    assert "other training data (16 rows there, 17 here)" in str(longer)
    assert other_data_note({"data": {"task": "dpo"}}, {"task": "dpo"}, path) is None  # a stream: no rows recorded
