"""One benchmark run in a fresh interpreter: `python <script> --worker SPEC RESULT`, its output to a log."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def prepare_worker() -> None:
    """What a worker sets before it imports torch & co.: no Hub, quiet tokenizers (cloudtrain itself is
    installed by make setup)."""
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(name, value)


def run_as_script(main, worker_main) -> None:
    """A bench script's `__main__`: `--worker SPEC RESULT` (how run_script starts it) runs one measurement
    through `worker_main`; anything else is the whole section, `main`."""
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(*sys.argv[2:4])
    else:
        main()


def run_script(script: str, spec: dict, log, what: str, timeout: float | None = None) -> dict:
    """Run `script`'s worker on `spec`; its result (the JSON it writes) comes back, a failure names `what`."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        proc = subprocess.run(
            [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(spec), str(result)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed with exit {proc.returncode}; see {getattr(log, 'name', 'the log')}")
        return json.loads(result.read_text())
