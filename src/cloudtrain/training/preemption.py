"""SIGTERM (spot reclaim, Kubernetes, SLURM preemption) and Ctrl-C during the training loop: a flag the loop reads at
its next sync point, where it saves a checkpoint and stops (training/hooks.py: PreemptionHook). After the loop
(`AfterTraining`): the final evaluation and predictions stop, and the trained model is saved before the run ends."""

import os
import signal
import sys
import threading
from collections.abc import Callable


class PreemptionSignal:
    """While active, SIGTERM, and a first Ctrl-C (SIGINT), only set `received` (and `by`, the signal's name); the
    training loop saves and stops when it reads it. A second Ctrl-C stops at once (KeyboardInterrupt), unsaved."""

    def __init__(self):
        self.received = False
        self.by = ""
        self._previous: dict[int, object] = {}
        self._pid = os.getpid()

    def __enter__(self) -> "PreemptionSignal":
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            self._pid = os.getpid()
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            return  # a data-loader worker forked meanwhile (a Ctrl-C reaches it too): its process ends it
        if signum == signal.SIGINT:
            if self.received:  # asked twice: the user will not wait for the checkpoint
                raise KeyboardInterrupt
            if os.environ.get("RANK", "0") == "0":  # one line, not one per process
                print(
                    "\nCtrl-C: a checkpoint is saved at the next logging step, then the run stops (Ctrl-C again: "
                    "stop now, without one)",
                    file=sys.stderr,
                    flush=True,
                )
        self.received, self.by = True, self.by or signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous = {}
        if self.by == "SIGINT" and exc[0] is None and os.environ.get("RANK", "0") == "0":  # the loop ended first
            print(
                "Ctrl-C came after the last step was checked: the run evaluates and saves the model; Ctrl-C again "
                "skips the evaluation, a third stops at once, unsaved",
                file=sys.stderr,
                flush=True,
            )


class AfterTraining(PreemptionSignal):
    """While the trained model is evaluated and saved: SIGTERM or a first Ctrl-C skips what is left of the
    evaluation and predictions, and the run saves the model with the results it has, then ends with 143 or 130; a
    second Ctrl-C stops at once, unsaved. A lone process stops within the split under way (`cut_short`); the
    processes of a launch finish it and agree (`stopped`) before the next, as their collectives must match."""

    def __init__(self, agree: Callable[[list[bool]], list[bool]], alone: bool):
        super().__init__()
        self.agree, self.alone = agree, alone
        self.armed = False  # set once the loop ended: before, a signal does what it did without this handler

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            return
        if not self.armed:
            _as_before(self._previous.get(signum), signum, frame)
            return
        if signum == signal.SIGINT and self.received:
            raise KeyboardInterrupt
        if not self.received and os.environ.get("RANK", "0") == "0":
            again = " (Ctrl-C again: stop now, unsaved)" if signum == signal.SIGINT else ""
            print(
                f"\n{signal.Signals(signum).name}: the evaluation stops and the trained model is saved{again}",
                file=sys.stderr,
                flush=True,
            )
        self.received, self.by = True, self.by or signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous = {}

    def stopped(self) -> bool:
        """Whether any process of the launch was signalled (one small collective with more than one)."""
        return self.agree([self.received])[0]

    def cut_short(self) -> Callable[[], bool] | None:
        """What an evaluation's batches stop at: the signal, in a lone process; None (every batch) in a launch."""
        return (lambda: self.received) if self.alone else None


def _as_before(previous, signum: int, frame) -> None:
    """What the handler `previous` would have done: call it, ignore the signal, or its default (end the process)."""
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
