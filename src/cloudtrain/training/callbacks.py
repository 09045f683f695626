"""User callbacks: a user's functions or objects called at train begin, step end, evaluate, save and train end.

They ride on the loop's hook mechanism (cloudtrain.training.hooks): `CallbackHook` is one more hook, the
last in `Trainer.hooks`, so at each step it sees what the hooks before it did (the logged numbers, an
evaluation, a saved checkpoint). docs/extending.md (Callbacks) says what each event receives and when.

A callback is
- an object with any of the methods `on_train_begin`, `on_step_end`, `on_evaluate`, `on_save`, `on_train_end`
  (subclass `Callback` or not), each called with a `CallbackState`; or
- a function, called at every event with the `CallbackState` (its `event` names which).
It runs on the main process only unless it has `all_processes = True` (a class attribute, or an attribute
set on the function). Given by name (`--callbacks my_module:MyCallback`), a class is instantiated without
arguments. A callback that raises stops the run: every process agrees (one small collective per event while
main-only callbacks exist and there is more than one process), and the error names the callback.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloudtrain.checkpointing import Checkpointer
from cloudtrain.errors import TrainingStopped, UserError
from cloudtrain.parallel.runtime import Runtime
from cloudtrain.training.hooks import Hook, LoopState, Request

EVENTS = ("on_train_begin", "on_step_end", "on_evaluate", "on_save", "on_train_end")


@dataclass(frozen=True)
class CallbackState:
    """What a callback is told at an event (a copy: changing it changes nothing in the run)."""

    event: str  # one of EVENTS
    global_step: int  # optimizer steps done
    epoch: float | None  # steps done / steps per epoch; None for a stream (--streaming true), which has no epochs
    total_steps: int
    metrics: dict[str, Any] = field(default_factory=dict)  # the last logged numbers: train/... and eval/...
    output_dir: Path | None = None  # the run's output folder
    checkpoint: Path | None = None  # on_save: the checkpoint just published (complete, under its final name)
    # the step whose weights the model holds: global_step, but at on_train_end after --load_best_model_at_end
    # the best evaluation's step (None before the first step)
    model_step: int | None = None
    is_main_process: bool = True
    process_index: int = 0
    num_processes: int = 1


class Callback:
    """A base for callback classes; override the events you need (each receives a `CallbackState`)."""

    all_processes = False  # True: called on every process, not only the main one

    def on_train_begin(self, state: CallbackState) -> None:
        """Once before the first step (after a resume: before the first step still to run)."""

    def on_step_end(self, state: CallbackState) -> None:
        """After every optimizer step, once the loop's hooks (logging, evaluation, checkpoint) ran."""

    def on_evaluate(self, state: CallbackState) -> None:
        """After an evaluation during training; `state.metrics` holds its eval/... numbers."""

    def on_save(self, state: CallbackState) -> None:
        """After a checkpoint is complete on every process and published under its final name; `state.checkpoint`
        is its folder, `state.global_step` the step it holds."""

    def on_train_end(self, state: CallbackState) -> None:
        """After the last step (and after --load_best_model_at_end chose the model), before the final evaluation
        and the final save."""


def callback_name(callback: Any) -> str:
    """How errors name a callback: module:qualname of the function or the object's class."""
    target = type(callback) if _has_events(callback) and not isinstance(callback, type) else callback
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def _import_module(spec: str):
    """`package.module` from sys.path or the current folder, or a `path/to/file.py`."""
    if spec.endswith(".py"):
        path = Path(spec)
        if not path.is_file():
            raise UserError(f"--callbacks: no file {spec}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))  # a module beside where the run starts, as `python -m` would find it
    return importlib.import_module(spec)


def load_callback(name: str) -> Any:
    """The object `module:attribute` names (a class is instantiated); one UserError line if it cannot be."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise UserError(f"--callbacks {name}: give module:name (my_module:MyCallback, or path/to/file.py:name)")
    try:
        found = getattr(_import_module(module_name), attribute)
    except UserError:
        raise
    except Exception as err:  # ImportError, AttributeError, or whatever the module raised on import
        raise UserError(f"--callbacks {name} cannot be imported ({type(err).__name__}: {_first(err)})") from None
    found = _made(found, f"--callbacks {name}")
    check_callback(found, name)
    return found


def _made(found: Any, given: str) -> Any:
    """A class given as a callback, made without arguments (as the Hugging Face Trainer takes one); else `found`."""
    if not isinstance(found, type):
        return found
    try:
        return found()
    except Exception as err:
        raise UserError(f"{given}: the class cannot be made without arguments ({_first(err)})") from None


def check_callback(callback: Any, name: str | None = None) -> None:
    """A function, or an object with at least one event method."""
    if not callable(callback) and not _has_events(callback):
        raise UserError(
            f"callback {name or callback_name(callback)} is neither a function nor an object with "
            f"one of {', '.join(EVENTS)}"
        )


def load_callbacks(names: list[str], objects: list[Any] | None = None) -> list[Any]:
    """The callbacks of --callbacks, then those given as objects (cloudtrain.train(callbacks=[...]))."""
    loaded = [load_callback(name) for name in names]
    # a class among the objects was called with the state as its `self` at the first event (found in audit)
    given = [_made(callback, f"callback {callback_name(callback)}") for callback in objects or []]
    for callback in given:
        check_callback(callback)
    return loaded + given


def _first(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _has_events(callback: Any) -> bool:
    return any(callable(getattr(callback, e, None)) for e in EVENTS)


def _method(callback: Any, event: str) -> Callable[[CallbackState], Any] | None:
    if _has_events(callback):
        return getattr(callback, event, None)
    return callback  # a function: every event


class CallbackHook(Hook):
    """The user's callbacks as one hook, last in the loop's order: after logging, evaluation and checkpoints."""

    phase = "a user callback"
    outside_training = True

    def __init__(
        self,
        callbacks: list[Any],
        runtime: Runtime,
        output_dir: Path | None,
        checkpointer: Checkpointer | None,
        streams: bool = False,
    ):
        self.runtime, self.output_dir, self.checkpointer, self.streams = runtime, output_dir, checkpointer, streams
        self.mine = [c for c in callbacks if runtime.is_main or getattr(c, "all_processes", False)]
        # main-only callbacks fail on the main process alone: the others must hear of it (a collective)
        self.must_agree = runtime.count > 1 and any(not getattr(c, "all_processes", False) for c in callbacks)
        # callbacks on every process see a background save's on_save at the same step end on each
        everywhere = runtime.count > 1 and any(getattr(c, "all_processes", False) for c in callbacks)
        self.agreed_saves = runtime.smallest if everywhere and checkpointer and checkpointer.asynchronous else None
        self.metrics: dict[str, Any] = {}
        self.evaluations_seen = 0
        self.evaluated: dict[str, Any] = {}  # the numbers of the evaluation not yet reported

    def on_train_start(self, loop: LoopState) -> None:
        if loop.step > 0:  # resumed: the evaluations in the checkpoint's state were reported by the earlier run
            self.evaluations_seen = len(loop.state.evaluations)
            if loop.state.evaluations:  # but the last one's numbers are the run's latest (they were missing; audit)
                self.metrics.update({f"eval/{k}": v for k, v in loop.state.evaluations[-1].items() if k != "step"})
        self._emit(loop, [("on_train_begin", None), *self._evaluated(loop)])

    def on_step_end(self, loop: LoopState) -> Request | None:
        if loop.logged:
            self.metrics.update(loop.logged)
        self._emit(loop, [("on_step_end", None), *self._evaluated(loop), *self._published()])
        return None

    def on_train_end(self, loop: LoopState) -> None:
        # the checkpoint hook, before this one, waited for a background save: it is published by now
        self._emit(loop, [*self._published(), ("on_train_end", None)])

    def _published(self) -> list[tuple[str, tuple[int, Path]]]:
        """on_save for each checkpoint complete and renamed since the last event: a synchronous save's at its
        step, a background save's (--async_checkpointing) at the first step end after its thread published it (on every
        process, for callbacks that run on every process)."""
        saved = self.checkpointer.take_published(self.agreed_saves) if self.checkpointer else []
        return [("on_save", step_and_path) for step_and_path in saved]

    def _evaluated(self, loop: LoopState) -> list[tuple[str, None]]:
        """on_evaluate when the evaluation hook evaluated since the last event (its numbers join `metrics`)."""
        evaluations = loop.state.evaluations
        if len(evaluations) == self.evaluations_seen:
            return []
        self.evaluations_seen = len(evaluations)
        self.evaluated = {f"eval/{k}": v for k, v in evaluations[-1].items() if k != "step"}
        return [("on_evaluate", None)]

    def _emit(self, loop: LoopState, events: list[tuple[str, tuple[int, Path] | None]]) -> None:
        failure = None
        for event, saved in events:
            if event == "on_evaluate":  # its numbers join from this event on (on_step_end comes before it)
                self.metrics.update(self.evaluated)
            state = self._state(loop, event, saved)
            failure = failure or self._call_all(event, state)
        if self.must_agree:
            if self.runtime.agree([failure is not None])[0] and failure is None:
                raise TrainingStopped("stopped: a user callback failed on another process", 1, quiet=True)
        if failure:
            if self.checkpointer and self.checkpointer.asynchronous:  # (one process): the save in flight first, so
                with contextlib.suppress(Exception):  # that the line names it (a failed one: the one before)
                    self.checkpointer.background.wait()
            last = self.checkpointer.latest() if self.checkpointer else None
            kept = f"; the last checkpoint, {last}, is kept" if last else "; no checkpoint was saved"
            raise TrainingStopped(f"stopped at step {loop.step}: {failure}{kept}", 1)

    def _call_all(self, event: str, state: CallbackState) -> str | None:
        for callback in self.mine:
            method = _method(callback, event)
            if method is None:
                continue
            try:
                method(state)
            except (Exception, SystemExit) as err:  # sys.exit() too: it ended the run as if it had finished
                return f"callback {callback_name(callback)} raised {type(err).__name__} in {event}: {_first(err)}"
        return None

    def _state(self, loop: LoopState, event: str, saved: tuple[int, Path] | None) -> CallbackState:
        """`saved`: on_save's (step, folder); its step is the checkpoint's (a background save may be published
        a step or more after the step it holds)."""
        step = saved[0] if saved else loop.step
        return CallbackState(
            event=event,
            global_step=step,
            epoch=None if self.streams else step / loop.steps_per_epoch,
            total_steps=loop.total_steps,
            metrics=dict(self.metrics),
            output_dir=self.output_dir,
            checkpoint=saved[1] if saved else None,
            model_step=loop.model_step
            if event == "on_train_end" and loop.model_step is not None
            else loop.step or None,
            is_main_process=self.runtime.is_main,
            process_index=self.runtime.index,
            num_processes=self.runtime.count,
        )
