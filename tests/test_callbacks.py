"""User callbacks (cloudtrain.training.callbacks): the events in order with their state, given as objects through
cloudtrain.train or by name with --callbacks; a raising callback stops the run and keeps the last checkpoint; a
bad name is refused in one line before anything loads; main-only and all-process callbacks under a 2-process
launch."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ENTRY, REPO, child_pythonpath, run_cli, topic_run_args

import cloudtrain
from cloudtrain.errors import UserError
from cloudtrain.training.callbacks import Callback, CallbackState

RUN = {
    "max_steps": 4,
    "per_device_train_batch_size": 8,
    "logging_steps": 2,
    "eval_strategy": "steps",
    "eval_steps": 2,
    "checkpointing_steps": "2",
    "mixed_precision": "no",
    "training_type": "basic",
}
RUN_FLAGS = [item for key, value in RUN.items() for item in (f"--{key}", str(value))]


def api_options(tiny_model_dir, topic_csvs, out: Path) -> dict:
    return {
        "model_name_or_path": tiny_model_dir,
        "train_file": str(topic_csvs["train"]),
        "validation_file": str(topic_csvs["validation"]),
        "output_dir": str(out),
        **RUN,
    }


class Recorder(Callback):
    def __init__(self):
        self.calls: list[tuple[str, int, dict, Path | None]] = []
        self.checkpoint_existed: list[bool] = []
        self.model_steps: list[int | None] = []

    def _record(self, state: CallbackState) -> None:
        self.calls.append((state.event, state.global_step, state.metrics, state.checkpoint))
        self.model_steps.append(state.model_step)

    on_train_begin = on_step_end = on_evaluate = on_train_end = _record

    def on_save(self, state: CallbackState) -> None:
        self._record(state)
        self.checkpoint_existed.append(state.checkpoint is not None and state.checkpoint.is_dir())


def test_events_come_in_order_with_the_state(tiny_model_dir, topic_csvs, tmp_path):
    recorder, seen = Recorder(), []

    def function_callback(state: CallbackState) -> None:  # a function: every event, named by state.event
        seen.append((state.event, state.global_step, state.epoch, state.output_dir, state.total_steps))

    out = tmp_path / "run"
    cloudtrain.train(api_options(tiny_model_dir, topic_csvs, out), callbacks=[recorder, function_callback])

    events = [(event, step) for event, step, _, _ in recorder.calls]
    assert events == [
        ("on_train_begin", 0),
        ("on_step_end", 1),
        ("on_step_end", 2),
        ("on_evaluate", 2),
        ("on_save", 2),
        ("on_step_end", 3),
        ("on_step_end", 4),
        ("on_save", 4),  # the last step is saved; it is not evaluated during training (the run evaluates after)
        ("on_train_end", 4),
    ]
    assert [(event, step) for event, step, *_ in seen] == events
    assert recorder.model_steps == [None, 1, 2, 2, 2, 3, 4, 4, 4]  # the model's own step (none before training)
    assert all(where == out and total == 4 for *_, where, total in seen)
    steps_per_epoch = 60 // 8 + 1  # 60 training rows in batches of 8
    assert seen[2][2] == pytest.approx(2 / steps_per_epoch)
    metrics = {(event, step): m for event, step, m, _ in recorder.calls}
    assert metrics[("on_step_end", 1)] == {}  # nothing logged yet
    assert {"train/loss", "train/learning_rate"} <= metrics[("on_step_end", 2)].keys()
    assert "eval/accuracy" in metrics[("on_evaluate", 2)] and "eval/accuracy" not in metrics[("on_step_end", 2)]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    at_4 = next(e for e in logged if e.get("step") == 4 and "train/loss" in e)
    assert metrics[("on_train_end", 4)]["train/loss"] == pytest.approx(at_4["train/loss"])
    saves = [checkpoint for event, _, _, checkpoint in recorder.calls if event == "on_save"]
    assert [c.name for c in saves] == ["checkpoint-2", "checkpoint-4"] and recorder.checkpoint_existed == [True, True]


def test_one_callback_needs_no_list_and_sys_exit_in_it_stops_the_run_in_one_line(tiny_model_dir, topic_csvs, tmp_path):
    """callbacks=fn was a TypeError traceback, and sys.exit() in a callback ended the run silently with status 0
    and no model (found in audit)."""

    from cloudtrain.errors import TrainingStopped

    steps = []
    options = api_options(tiny_model_dir, topic_csvs, tmp_path / "one") | {"max_steps": 2, "eval_strategy": "no"}
    cloudtrain.train(options, callbacks=lambda s: steps.append(s.global_step) if s.event == "on_step_end" else None)
    assert steps == [1, 2]
    steps.clear()  # a set of them, as any collection (found in review)
    options["output_dir"] = str(tmp_path / "set")
    cloudtrain.train(options, callbacks={lambda s: steps.append(s.global_step) if s.event == "on_step_end" else None})
    assert steps == [1, 2]

    def leave(state: CallbackState) -> None:
        if state.event == "on_step_end":
            sys.exit(0)

    options["output_dir"] = str(tmp_path / "exit")
    with pytest.raises(TrainingStopped, match="callback .*leave raised SystemExit in on_step_end"):
        cloudtrain.train(options, callbacks=leave)


@pytest.mark.slow  # 6-8 s of fresh processes: the full suite runs it
def test_a_raising_callback_stops_the_run_with_its_message_and_keeps_the_checkpoint(
    tiny_model_dir, topic_csvs, tmp_path
):
    module = tmp_path / "my_callbacks.py"
    module.write_text(
        textwrap.dedent("""
        class StopAtThree:
            def on_step_end(self, state):
                if state.global_step == 3:
                    raise ValueError("the validation set drifted")
        """)
    )
    out = tmp_path / "run"
    result = run_cli(
        *topic_run_args(tiny_model_dir, topic_csvs, out), *RUN_FLAGS, "--callbacks", f"{module}:StopAtThree"
    )
    assert result.returncode == 1
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in result.stderr
    assert "stopped at step 3: callback my_callbacks:StopAtThree raised ValueError in on_step_end" in error[0]
    assert "the validation set drifted" in error[0] and "checkpoint-2" in error[0]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["checkpoint-2"]
    assert not (out / "model.safetensors").exists()  # no final model from a stopped run


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("no_such_module_xyz:Thing", "cannot be imported (ModuleNotFoundError"),
        ("json:NoSuchThing", "cannot be imported (AttributeError"),
        ("json", "give module:name"),
        ("json:__doc__", "is neither a function nor an object"),
        ("missing/file.py:Thing", "no file missing/file.py"),
    ],
)
def test_a_bad_callback_name_is_refused_in_one_line_before_anything_loads(
    tiny_model_dir, topic_csvs, tmp_path, name, says
):
    out = tmp_path / "run"
    with pytest.raises(UserError) as refused:
        cloudtrain.train(api_options(tiny_model_dir, topic_csvs, out), callbacks=[name])
    message = str(refused.value)
    assert says in message and name.split(":")[0] in message and "\n" not in message
    assert not out.exists()  # refused before the output folder is claimed


class Begins(Callback):
    """Given as a class: what each made instance saw at on_train_begin, in the class's list."""

    seen: list[dict] = []

    def on_train_begin(self, state: CallbackState) -> None:
        Begins.seen.append(dict(state.metrics))


def test_a_class_given_as_a_callback_is_made_and_a_resume_starts_with_the_last_evaluation(
    tiny_model_dir, topic_csvs, tmp_path
):
    """callbacks=[Begins] (a class, as the Hugging Face Trainer takes) was called with the state as its self: a
    stop at step 0 naming 'builtins:type'; a resumed run's metrics were empty until its next evaluation (audit)."""
    options = api_options(tiny_model_dir, topic_csvs, tmp_path / "run")
    first = cloudtrain.train({**options, "max_steps": 2}, callbacks=[Begins])
    cloudtrain.train({**options, "resume_from_checkpoint": "latest"}, callbacks=[Begins])
    assert Begins.seen[0] == {}
    assert Begins.seen[1]["eval/loss"] == pytest.approx(first["eval"]["loss"])


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


DIST_CALLBACKS = """
import json, os
from pathlib import Path

OUT = Path(os.environ["CALLBACK_LOG"])


class MainOnly:
    def on_step_end(self, state):
        with open(OUT / f"main_only.{state.process_index}", "a") as f:
            f.write(json.dumps([state.event, state.global_step, state.num_processes]) + "\\n")
        if state.global_step == 3:
            raise RuntimeError("main process gives up")


class Everywhere:
    all_processes = True

    def on_step_end(self, state):
        with open(OUT / f"everywhere.{state.process_index}", "a") as f:
            f.write(json.dumps([state.event, state.global_step, state.is_main_process]) + "\\n")
"""


@pytest.mark.slow
def test_main_only_and_all_process_callbacks_under_two_processes(tiny_model_dir, topic_csvs, tmp_path):
    """One torchrun launch: the main-only callback runs on process 0 alone, the all-process one on both; the
    main-only one raising at step 3 stops both processes (they agree), not a hang."""
    (tmp_path / "dist_callbacks.py").write_text(DIST_CALLBACKS)
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "PYTHONPATH": child_pythonpath(tmp_path), "OMP_NUM_THREADS": "1", "CALLBACK_LOG": str(logs)}
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
    args = [*topic_run_args(tiny_model_dir, topic_csvs, out), *RUN_FLAGS, "--training_type", "accelerated"]
    callbacks = ["--callbacks", "dist_callbacks:MainOnly,dist_callbacks:Everywhere"]
    result = subprocess.run(
        [*command, str(ENTRY), *args, *callbacks], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )
    assert result.returncode != 0, result.stdout[-2000:]
    assert result.stderr.count("callback dist_callbacks:MainOnly raised RuntimeError in on_step_end") == 1
    assert sorted(p.name for p in logs.iterdir()) == ["everywhere.0", "everywhere.1", "main_only.0"]
    main_only = [json.loads(line) for line in (logs / "main_only.0").read_text().splitlines()]
    assert main_only == [["on_step_end", step, 2] for step in (1, 2, 3)]
    # on the main process the failing callback comes first, so the one after it is not called at step 3
    for index, steps in ((0, (1, 2)), (1, (1, 2, 3))):
        lines = [json.loads(line) for line in (logs / f"everywhere.{index}").read_text().splitlines()]
        assert lines == [["on_step_end", step, index == 0] for step in steps]
    assert (out / "checkpoints" / "checkpoint-2").is_dir()


def test_on_save_comes_once_a_background_save_is_published(tmp_path, monkeypatch):
    """--async_checkpointing: on_save is called when the checkpoint is complete under its final name, not when its
    save starts. The writer of checkpoint-2 waits until step 3 has run, so the save is still in flight at step 2."""
    from test_own_module import fresh_module, rows

    from cloudtrain.training.basic import BasicTrainer
    from cloudtrain.training.trainer import Trainer

    done, real_step, real_snapshot = [0], Trainer._step, BasicTrainer.checkpoint_snapshot

    def step(self, window, loop) -> None:
        real_step(self, window, loop)
        done[0] = loop.state.global_step

    def snapshot(self):
        write, saved_at = real_snapshot(self), done[0]

        def held_write(folder: Path) -> None:
            deadline = time.monotonic() + 60
            while saved_at < 4 and done[0] <= saved_at and time.monotonic() < deadline:
                time.sleep(0.01)
            write(folder)

        return held_write

    monkeypatch.setattr(Trainer, "_step", step)
    monkeypatch.setattr(BasicTrainer, "checkpoint_snapshot", snapshot)
    seen: list[tuple] = []

    def record(state: CallbackState) -> None:
        complete = state.checkpoint is not None and (state.checkpoint / "trainer_state.json").is_file()
        seen.append((state.event, state.global_step, state.checkpoint and state.checkpoint.name, complete))

    cloudtrain.train(
        model=fresh_module(), train_dataset=rows(64, 0), output_dir=str(tmp_path / "run"), callbacks=[record],
        **{**RUN, "eval_strategy": "no", "async_checkpointing": True},
    )  # fmt: skip
    saves = [entry for entry in seen if entry[0] == "on_save"]
    assert saves == [("on_save", 2, "checkpoint-2", True), ("on_save", 4, "checkpoint-4", True)]
    order = [(event, step) for event, step, *_ in seen]
    assert order.index(("on_save", 2)) > order.index(("on_step_end", 3))  # published after step 3 ran
    assert order[-2:] == [("on_save", 4), ("on_train_end", 4)]  # the last save, waited for, before the end


def test_a_failing_callback_names_the_checkpoint_a_background_save_was_writing(tmp_path, monkeypatch):
    """--async_checkpointing: the line named checkpoint-1 while checkpoint-2, in flight, was published just after
    (found in audit). The save in flight is finished first."""
    from test_own_module import fresh_module, rows

    from cloudtrain.errors import TrainingStopped
    from cloudtrain.training.basic import BasicTrainer

    real_snapshot = BasicTrainer.checkpoint_snapshot

    def slow_snapshot(self):
        write = real_snapshot(self)
        return lambda folder: (time.sleep(0.5), write(folder))[1]  # still writing when the callback fails

    monkeypatch.setattr(BasicTrainer, "checkpoint_snapshot", slow_snapshot)

    def fail_at_two(state: CallbackState) -> None:
        if state.event == "on_step_end" and state.global_step == 2:
            raise ValueError("drifted")

    options = {**RUN, "eval_strategy": "no", "async_checkpointing": True, "checkpointing_steps": "1"}
    with pytest.raises(TrainingStopped, match=r"the last checkpoint, .*checkpoint-2, is kept"):
        cloudtrain.train(
            model=fresh_module(), train_dataset=rows(64, 0), output_dir=str(tmp_path / "run"), callbacks=fail_at_two,
            **options,
        )  # fmt: skip
