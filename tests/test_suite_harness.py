"""The suite's own process handling (conftest): a launch that runs out of time is stopped whole."""

import subprocess
import sys
import time

import psutil
import pytest

# a launcher like torchrun: its worker runs in a session of its own, and the launcher waits for it
LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(worker.pid, flush=True)
time.sleep(120)
"""


def test_a_launch_out_of_time_is_killed_with_the_workers_in_their_own_sessions(tmp_path):
    out = tmp_path / "worker.pid"
    for limit in (3, 20):  # a busy machine may take longer than 3 s to start both interpreters: then again
        with out.open("w") as sink, pytest.raises(subprocess.TimeoutExpired):
            subprocess.run([sys.executable, "-c", LAUNCHER], stdout=sink, timeout=limit)
        if out.read_text().split():
            break
    assert out.read_text().split(), "the launcher did not start its worker within 20 s"
    worker = int(out.read_text().split()[0])
    deadline = time.monotonic() + 10
    while alive(worker):
        assert time.monotonic() < deadline, "the launcher's worker outlived it"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
