"""One benchmark run in a fresh interpreter: `python <script> --worker SPEC RESULT`, its output to a log."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_script(script: str, spec: dict, log, what: str, timeout: float | None = None) -> dict:
    """Run `script`'s worker on `spec`; its result (the JSON it writes) comes back, a failure names `what`."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        proc = subprocess.run([sys.executable, str(Path(script).resolve()), "--worker", json.dumps(spec),
                               str(result)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed with exit {proc.returncode}; see {getattr(log, 'name', 'the log')}")
        return json.loads(result.read_text())
