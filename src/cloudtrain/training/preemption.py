"""SIGTERM (spot reclaim, Kubernetes, SLURM preemption) and Ctrl-C, from the start of training to the saved model. In
the training loop: a flag the loop reads at its next sync point, where it saves a checkpoint and stops
(training/hooks.py: PreemptionHook). Once the loop has ended: what is left of the final evaluation and predictions is
skipped and the trained model saved before the run ends (cloudtrain.pipeline)."""

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence


class PreemptionSignal:
    """While active, SIGTERM and a first Ctrl-C (SIGINT) only set `received` (and `by`, the signal's name), and what
    they do depends on the phase: in the loop a checkpoint and a stop; once `loop_ended`, the evaluation stops and
    the model is saved. A second Ctrl-C stops at once (KeyboardInterrupt), unsaved. `agree` (Runtime.agree) makes
    every process of a launch see the same answer; `alone`: a lone process may stop within an evaluation."""

    def __init__(self, agree: Callable[[list[bool]], list[bool]] = lambda flags: flags, alone: bool = True):
        self.received = False
        self.by = ""
        self.loop_ended = False
        self.agree, self.alone = agree, alone
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
        if signum == signal.SIGINT and self.received:  # asked twice: the user will not wait for the save
            raise KeyboardInterrupt
        if not self.received and os.environ.get("RANK", "0") == "0":  # one line, not one per process
            said = self._saying(signum)
            if said:
                print(f"\n{said}", file=sys.stderr, flush=True)
        self.received, self.by = True, self.by or signal.Signals(signum).name

    def _saying(self, signum: int) -> str:
        ctrl_c = signum == signal.SIGINT
        if self.loop_ended:
            again = " (Ctrl-C again: stop now, unsaved)" if ctrl_c else ""
            return f"{'Ctrl-C' if ctrl_c else 'SIGTERM'}: the evaluation stops and the trained model is saved{again}"
        if ctrl_c:  # a scheduler's SIGTERM needs no word: the stop line follows at the next sync point
            return (
                "Ctrl-C: a checkpoint is saved at the next logging step, then the run stops (Ctrl-C again: stop now, "
                "without one)"
            )
        return ""

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous = {}

    def stopped(self) -> bool:
        """Whether any process of the launch was signalled (one small collective with more than one)."""
        return self.agree([self.received])[0]

    def cut_short(self) -> Callable[[], bool] | None:
        """What an evaluation's batches stop at: the signal, in a lone process; None (every batch) in a launch,
        whose processes must run the same collectives."""
        return (lambda: self.received) if self.alone else None


def until(stop: Callable[[], bool] | None, batches: Iterable) -> Iterable:
    """`batches`, or those before `stop()` turned true: the first always, so no task sees an empty split."""
    return batches if stop is None else _until(stop, batches)


def _until(stop: Callable[[], bool], batches: Iterable) -> Iterator:
    for i, batch in enumerate(batches):
        if i and stop():
            return
        yield batch


class UnlessCutShort(Sequence[str]):
    """An evaluation's sample prompts, or none where `stop` holds when a task first reads them (after the
    evaluation's batches): a cut-short evaluation's generations or renders are meaningless, and may take minutes
    of a reclaim's grace period. Read once, it keeps its answer, so a task that zips prompts with outputs sees one
    list."""

    def __init__(self, prompts: Sequence[str], stop: Callable[[], bool]):
        self._prompts, self._stop = prompts, stop
        self._kept: list[str] | None = None

    def _items(self) -> list[str]:
        if self._kept is None:
            self._kept = [] if self._stop() else list(self._prompts)
        return self._kept

    def __getitem__(self, index):  # type: ignore[override]
        return self._items()[index]

    def __len__(self) -> int:
        return len(self._items())
