"""Run under torchrun by test_async_checkpoint.py: the application with --async_checkpointing true, watched.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_async_checkpoint.py LOG_DIR <training options>

Each process writes to LOG_DIR/overlap.<rank> whether its first background save's writer saw the loop finish
the next step before it wrote anything: the writer waits for that step (at most 120 s), which comes only if
the loop was not blocked by the save. `Published` (--callbacks dist_async_checkpoint:Published) records each
on_save it is called with, whether the checkpoint was complete and under its final name then, and after how
many step ends it fired; process 1's saves publish a second late (`LateLock`).
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

from cloudtrain.checkpointing import Checkpointer
from cloudtrain.cli import main
from cloudtrain.training.accelerated import AcceleratedTrainer
from cloudtrain.training.trainer import Trainer

RANK = os.environ.get("RANK", "0")


class Published:
    all_processes = True
    step_ends = 0

    def on_step_end(self, state) -> None:
        self.step_ends += 1

    def on_save(self, state) -> None:
        folder = state.checkpoint
        record = [state.global_step, folder.name, (folder / "trainer_state.json").is_file(), folder.is_dir()]
        record.append(self.step_ends)  # when it fired: the same step end on every process
        with open(Path(os.environ["ASYNC_LOG"]) / f"on_save.{state.process_index}", "a") as f:
            f.write(json.dumps(record) + "\n")


def watch(log: Path) -> None:
    """Make the first background save's writer wait for the loop's next step, and say whether it came."""
    done, changed, first = [0], threading.Condition(), [True]
    real_step, real_snapshot = Trainer._step, AcceleratedTrainer.checkpoint_snapshot

    def step(self, window, loop) -> None:
        real_step(self, window, loop)
        with changed:
            done[0] = loop.state.global_step
            changed.notify_all()

    def snapshot(self):
        write, at, watched = real_snapshot(self), done[0], first[0]
        first[0] = False

        def waiting_write(folder: Path) -> None:
            if watched:
                with changed:
                    went_on = changed.wait_for(lambda: done[0] > at, timeout=120)
                (log / f"overlap.{RANK}").write_text(json.dumps({"saved_step": at, "went_on": went_on}))
            write(folder)

        return waiting_write

    Trainer._step, AcceleratedTrainer.checkpoint_snapshot = step, snapshot
    if RANK == "1":
        publish_late()


class LateLock:
    """A checkpointer's lock that the background thread of process 1 takes a second late: its saves publish
    after process 0's, so on_save would fire at different step ends unless the processes agree."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(1.0)
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def publish_late() -> None:
    real_init = Checkpointer.__init__

    def init(self, *args, **kwargs) -> None:
        real_init(self, *args, **kwargs)
        self._lock = LateLock()

    Checkpointer.__init__ = init


if __name__ == "__main__":
    log_dir = Path(sys.argv[1])
    os.environ["ASYNC_LOG"] = str(log_dir)
    watch(log_dir)
    sys.exit(main(sys.argv[2:]))
