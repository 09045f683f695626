"""Run logging shared by both trainers: every logging event goes to `<output_dir>/metrics.jsonl`.

Only the main process writes. One line per event: {"step": N, "time": unix seconds, <name>: value}.
A resumed run (`resume_step`) keeps the lines up to that step and appends after them.
"""

import json
import time
from pathlib import Path

from cloudtrain.config import Config, TrackingConfig
from cloudtrain.errors import UserError


def check_trackers(cfg: TrackingConfig) -> None:
    """Fail before training when a requested tracker cannot be used."""
    if cfg.report_to != ["none"]:
        raise UserError(f"--report_to {','.join(cfg.report_to)}: tracker integration is not in this "
                        "version yet; use --report_to none (metrics.jsonl is always written)")


class RunLog:
    def __init__(self, cfg: Config, output_dir: Path, is_main_process: bool, run_info: dict,
                 resume_step: int | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = is_main_process
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_step is not None and self.path.exists():
                kept = [line for line in self.path.read_text().splitlines()
                        if line.strip() and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, values: dict, step: int) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, "time": round(time.time(), 3), **values}) + "\n")

    def finish(self, results: dict, label_names: list[str]) -> None:
        pass
