"""Run logging shared by both trainers: every logging event goes to `<output_dir>/metrics.jsonl`.

Only the main process writes. One line per event: {"step": N, "time": unix seconds, <name>: value}.
"""

import json
import time
from pathlib import Path


class RunLog:
    def __init__(self, output_dir: Path, is_main_process: bool):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = is_main_process
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def log(self, values: dict, step: int) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, "time": round(time.time(), 3), **values}) + "\n")

    def finish(self) -> None:
        pass
