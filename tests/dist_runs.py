"""Run under torchrun (or plain python) by tests: several runs of the application in one launch, one after another.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_runs.py RUNS_JSON

RUNS_JSON holds a list of command lines (lists of arguments, as after `training_application.py`). Each run is the
command's own `cloudtrain.cli.main`, with accelerate's per-process state reset before it as `cloudtrain.train`
does; each run joins the launch's process group and leaves it at its end (under keys of its own in torchrun's
store: cloudtrain.parallel.runtime.join_launch), and undoes the environment flags accelerate set for it. Process 0
prints `=== run <i>` before run i, so a test reads each run's own output (`run_outputs`). One launch instead of one
per run spares each run the start of its processes (torch, transformers, DeepSpeed imported again), which costs
more than these tiny runs themselves.
"""

import json
import os
import sys
from pathlib import Path

MARK = "=== run "


def run_outputs(stdout: str, count: int) -> list[str]:
    """Each run's stdout (process 0's lines after its mark), in order."""
    parts = stdout.split(MARK)[1:]
    assert [p.split("\n", 1)[0] for p in parts] == [str(i) for i in range(count)], stdout[-2000:]
    return [p.split("\n", 1)[1] if "\n" in p else "" for p in parts]


def exit_without_teardown(code: int = 0) -> None:
    """Leave as cloudtrain.cli.main does once its output is written: the interpreter's teardown is where gloo's and
    DeepSpeed's threads can abort a finished ZeRO-3 run (SIGABRT) on a loaded machine."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(runs_file: str) -> None:
    from accelerate.state import AcceleratorState, GradientState

    from cloudtrain.cli import run_command

    for i, argv in enumerate(json.loads(Path(runs_file).read_text())):
        if os.environ.get("RANK", "0") == "0":
            print(f"{MARK}{i}", flush=True)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        code = run_command(argv)
        if code != 0:
            sys.exit(code)
    exit_without_teardown()


if __name__ == "__main__":
    main(sys.argv[1])
