"""One rank of a bench/pipeline_bench.py launch (torchrun starts this file once per process): times every
optimizer step of the application it runs unchanged, and writes the figures to rank<R>.json.

    python bench/pipeline_rank.py RESULT_DIR -- APPLICATION_OPTIONS...
"""

import json
import os
import sys
import time
from pathlib import Path

from pipeline_plan import ENTRY


def _schedstat() -> tuple[float, float]:
    """(seconds on a core, seconds runnable but waiting for one) of the calling thread.

    The time on a core comes from the thread's CPU clock, which the kernel brings up to date when read;
    schedstat's own figure lags by up to a scheduler tick (4 ms), more than 10% of a quick run's steps.
    """
    with open("/proc/thread-self/schedstat") as f:
        _, waiting, _ = f.read().split()
    return time.thread_time(), int(waiting) / 1e9


def _vm(key: str) -> float:
    """A /proc/self/status memory figure in MiB (VmHWM, VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rank_main(result_dir: str, app_args: list[str]) -> int:
    """Run the application on this rank, timing every optimizer step; write rank<R>.json."""
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(name, value)
    sys.path.insert(0, str(ENTRY.parent))  # as `python src/training_application.py` has it
    from cloudtrain import cli
    from cloudtrain.training.accelerated import AcceleratedTrainer
    from cloudtrain.training.basic import BasicTrainer
    from cloudtrain.training.pipeline import PipelineTrainer

    marks: list[tuple[float, float, float]] = []  # (wall, on a core, waiting for a core) at each step's end
    peak_at_last_step = [0.0]

    def hooked(original):
        def optimizer_step(self) -> None:
            original(self)
            on_cpu, waiting = _schedstat()
            marks.append((time.perf_counter(), on_cpu, waiting))
            peak_at_last_step[0] = _vm("VmHWM")

        return optimizer_step

    for cls in (BasicTrainer, AcceleratedTrainer, PipelineTrainer):
        cls.optimizer_step = hooked(cls.optimizer_step)
    sys.argv = [str(ENTRY), *app_args]
    code = cli.main(app_args)
    rank = int(os.environ.get("RANK", "0"))
    steps = [
        {"wall": w1 - w0, "busy": c1 - c0, "ready": q1 - q0}
        for (w0, c0, q0), (w1, c1, q1) in zip(marks, marks[1:], strict=False)
    ]
    result = {
        "rank": rank,
        "exit": code,
        "steps": steps,
        "peak_rss_mb": _vm("VmHWM"),
        "peak_rss_training_mb": peak_at_last_step[0],
    }
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result))
    return code or 0


if __name__ == "__main__":
    rest = sys.argv[2:]
    status = rank_main(sys.argv[1], rest[1:] if rest[:1] == ["--"] else rest)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # as cloudtrain.cli.main: skip the teardown where gloo's threads
        sys.stdout.flush()  # can abort a finished process (and torchrun then stops the others mid-save)
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
