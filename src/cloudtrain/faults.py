"""Named points inside every write, where the fault-injection tests kill the process (tests/test_faults.py).

`CLOUDTRAIN_TEST_KILL_AT=<point>[:<n>]` makes the process SIGKILL itself the n-th time (default 1st) it
passes `<point>`; unset, `kill_point` costs one dictionary lookup. For tests only, like
CLOUDTRAIN_TEST_CPU_BF16: a user never sets it.
"""

import os
import signal

_passed: dict[str, int] = {}


def kill_point(name: str) -> None:
    wanted = os.environ.get("CLOUDTRAIN_TEST_KILL_AT")
    if not wanted:
        return
    point, _, nth = wanted.partition(":")
    if point != name:
        return
    _passed[name] = _passed.get(name, 0) + 1
    if _passed[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
