"""The one exception type for user mistakes, and how its line reaches the user.

Anything a user can fix (a bad flag, a missing file, a column that is not there) is raised as a
`UserError`; the CLI prints its message as one line and exits non-zero, with no traceback.
Everything else is a bug and keeps its traceback.
"""

import json
import os
import sys
from pathlib import Path

ERROR_DIR = "CLOUDTRAIN_ERROR_DIR"  # set by `cloudtrain launch`: where each process records its error line


class UserError(Exception):
    """A mistake in the user's input: the message says what was wrong and how to fix it.

    `quiet`: another process of the same launch prints this error, so this one exits without repeating it.
    """

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, for wrapping library errors in a UserError."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


class TrainingStopped(Exception):
    """Training ended early on purpose (preemption, a non-finite loss); the message says what comes next."""

    def __init__(self, message: str, exit_code: int, quiet: bool = False):
        """`quiet`: another process of the launch prints the same message."""
        super().__init__(message)
        self.exit_code, self.quiet = exit_code, quiet


def report(line: str, status: int) -> None:
    """An error line on stderr; under `cloudtrain launch`, recorded for the launcher instead, which prints each
    distinct line of the launch's failed processes once. An attempt torchrun will restart also prints it here, as
    the launcher sees only the last attempt's."""
    env = os.environ
    folder, rank, pid = env.get(ERROR_DIR), int(env.get("RANK", "0")), os.getpid()
    attempt, restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if folder:
        record = {"rank": rank, "pid": pid, "attempt": attempt, "line": line, "status": status}
        path = Path(folder) / f"{attempt}-{rank}.json"
        try:
            path.with_suffix(".tmp").write_text(json.dumps(record))
            path.with_suffix(".tmp").replace(path)  # whole or absent, were this process killed while writing
            if attempt >= restarts or status in (130, 143):  # the last attempt, or stopped: never restarted
                return
        except OSError:  # the launcher's folder is gone: say it here
            pass
    print(line, file=sys.stderr)
