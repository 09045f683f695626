"""The one exception type for user mistakes.

Anything a user can fix (a bad flag, a missing file, a column that is not there) is raised as a
`UserError`; the CLI prints its message as one line and exits non-zero, with no traceback.
Everything else is a bug and keeps its traceback.
"""


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
