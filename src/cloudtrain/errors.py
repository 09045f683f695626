"""The one exception type for user mistakes, and how its line reaches the user.

Anything a user can fix (a bad flag, a missing file, a column that is not there) is raised as a
`UserError`; the CLI prints its message as one line and exits non-zero, with no traceback.
Everything else is a bug and keeps its traceback.
"""

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

ERROR_DIR = "CLOUDTRAIN_ERROR_DIR"  # set by `cloudtrain launch`: where each process records its error line


class UserError(Exception):
    """A mistake in the user's input: the message says what was wrong and how to fix it.

    `quiet`: another process of the same launch prints this error, so this one exits without repeating it.
    `transient`: a service that did not answer (the network): a restart may get past it, unlike a mistake.
    """

    def __init__(self, message: str, quiet: bool = False, transient: bool = False):
        super().__init__(message)
        self.quiet, self.transient = quiet, transient


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, for wrapping library errors in a UserError."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


class TrainingStopped(Exception):
    """Training ended early on purpose (preemption, a non-finite loss); the message says what comes next."""

    def __init__(self, message: str, exit_code: int, quiet: bool = False):
        """`quiet`: another process of the launch prints the same message."""
        super().__init__(message)
        self.exit_code, self.quiet = exit_code, quiet


def report(line: str, status: int, echo: bool = True, transient: bool = False) -> None:
    """An error line on stderr; under `cloudtrain launch`, recorded for the launcher instead, which prints each
    distinct line of the launch's failed processes once. An attempt torchrun will restart also prints it here, once
    for all its processes, as the launcher sees only the last attempt's (`echo` False: recorded only)."""
    env = os.environ
    folder = env.get(ERROR_DIR)
    attempt, restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if attempt >= restarts and status not in (130, 143):  # the job's last word, not a stop: SageMaker's reason
        _sagemaker_failure(line)
    if folder:
        try:
            _record(Path(folder), line, status, transient)
            if attempt >= restarts or status in (130, 143) or not echo:  # the last attempt, or stopped: never restarted
                return
            if not _first_to_say(Path(folder), attempt, line):  # another process of this attempt said it
                return
        except OSError:  # the launcher's folder is gone: say it here
            pass
    print(line, file=sys.stderr)


def record_quiet(status: int) -> None:
    """Under `cloudtrain launch`: this process's exit, whose error another process of the launch reports, recorded
    without a line (the launcher told "exited with status 1; its output is above" of an output that said nothing)."""
    if folder := os.environ.get(ERROR_DIR):
        with contextlib.suppress(OSError):
            _record(Path(folder), None, status)


def _record(folder: Path, line: str | None, status: int, transient: bool = False) -> None:
    """This process's record for the launcher (cloudtrain.commands.launch reads them), written whole or not at all
    (were this process killed while writing)."""
    env = os.environ
    attempt, rank = int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), int(env.get("RANK", "0"))
    record = {
        "rank": rank,
        "pid": os.getpid(),
        "attempt": attempt,
        "line": line,
        "status": status,
        "transient": transient,
    }
    path = folder / f"{attempt}-{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(record))
    path.with_suffix(".tmp").replace(path)


def _sagemaker_failure(line: str) -> None:
    """Inside a SageMaker job, `line` as the job's FailureReason: its failure file, written by the first process to
    fail (the SDK's driver writes its own, a CalledProcessError traceback, only where none is there)."""
    env = os.environ
    path = env.get("SM_OUTPUT_FAILURE") or (env.get("SM_OUTPUT_DIR") and f"{env['SM_OUTPUT_DIR']}/failure")
    if not path:
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:  # another process said it first, or no such folder
        return
    with os.fdopen(fd, "w") as f:
        f.write(line.removeprefix("error: "))


def _first_to_say(folder: Path, attempt: int, line: str) -> bool:
    """Whether this process is the first of its attempt to say `line`: an atomic claim, one file per line (not a
    record: the launcher reads only *.json)."""
    claim = folder / f"{attempt}-said-{hashlib.sha256(line.encode()).hexdigest()[:16]}"
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def earlier_mistake() -> str | None:
    """In an attempt that torchrun restarted under `cloudtrain launch --max_restarts`: the line of the user's mistake
    (status 2) that ended the attempt before, else None. A restart cannot mend a mistake in the options or the
    data, so such an attempt ends at once with the same line instead of loading the model and the data again. A
    service that did not answer (`UserError(transient=True)`) is tried again."""
    folder, attempt = os.environ.get(ERROR_DIR), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not folder or attempt == 0:
        return None
    for record in recorded_errors(Path(folder)):
        if (
            record["attempt"] == attempt - 1
            and record["status"] == 2
            and record["line"]
            and not record.get("transient")
        ):
            return str(record["line"])
    return None


def recorded_errors(folder: Path) -> list[dict]:
    """The records the processes of a launch wrote (`report`); one cut short by a kill is skipped."""
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


def refuse_first(checks: Iterable[tuple[object, str]]) -> None:
    """The message of the first check that failed (a true value), as a UserError; nothing when all passed."""
    for failed, message in checks:
        if failed:
            raise UserError(message)


def first_difference(was: list, now: list, absent: str = "nothing") -> tuple[int, str, str]:
    """(the first place two lists differ, what each holds there, or `absent` past its end): for a refusal that
    names what changed."""
    i = next((i for i, (a, b) in enumerate(zip(was, now, strict=False)) if a != b), min(len(was), len(now)))
    there, here = (str(items[i]) if i < len(items) else absent for items in (was, now))
    return i, there, here
