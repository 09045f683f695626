"""SIGTERM (spot reclaim, Kubernetes, SLURM preemption) and Ctrl-C during the training loop: a flag the loop reads at
its next sync point, where it saves a checkpoint and stops (training/hooks.py: PreemptionHook)."""

import os
import signal
import sys
import threading


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
                "Ctrl-C came after the last step was checked: the run finishes (evaluation, the model saved); Ctrl-C "
                "again stops it without them",
                file=sys.stderr,
                flush=True,
            )
