"""The console: progress bars only where a person watches them, each printed line whole, and no library notices
that tell a cloudtrain user nothing.

A log file (`> run.log 2>&1`, SageMaker's CloudWatch, `kubectl logs`) gets no progress bars: their carriage
returns pile every refresh into one line, and the step lines carry the progress already. `setup()`, called once by
every entry point before the heavy imports, decides from CLOUDTRAIN_PROGRESS_BARS (1 or 0 forces them on or off),
else TQDM_DISABLE, else whether stderr is a terminal (or a notebook kernel); train() from Python calls it too.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from typing import TextIO

from cloudtrain.errors import UserError

BARS = "CLOUDTRAIN_PROGRESS_BARS"
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}
# Each library's own switch, read when it is imported; set only where the user left it unset (theirs wins).
LIBRARY_SWITCHES = {
    "datasets": "HF_DATASETS_DISABLE_PROGRESS_BARS",
    "huggingface_hub": "HF_HUB_DISABLE_PROGRESS_BARS",  # transformers' bars follow the Hub's at its import
}
# DeepSpeed's notice whenever it is imported (accelerate imports it to unwrap any model) without CUDA: it picks its
# CPU accelerator anyway, and cloudtrain names the device a run trains on.
DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."

_bars: bool | None = None  # decided by setup(); None: not called, the libraries' defaults
_ours: set[str] = set()  # the library switches setup() set (not the user's): a later setup() may take them back


def progress_bars() -> bool:
    """Whether cloudtrain shows its own progress bars (the training bar): as setup() decided; True without it."""
    return True if _bars is None else _bars


def passing_bar(items: Iterable, what: str, total: int | None = None, unit: str = "it", shown: bool = True) -> Iterable:
    """`items` under a bar on stderr that goes once they are done (an evaluation's batches, predict's), where bars
    show and `shown` (the main process; more than one item)."""
    from tqdm.auto import tqdm

    hidden = not shown or not progress_bars()
    return tqdm(items, desc=what, total=total, unit=unit, leave=False, dynamic_ncols=True, disable=hidden)


def counted(count: int, noun: str) -> str:
    """`count` and its noun, plural unless one ("1 prediction", "3 tokens")."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def wanted(environ: Mapping[str, str] = os.environ, stderr: TextIO | None = None) -> bool:
    """Whether this process should show progress bars: CLOUDTRAIN_PROGRESS_BARS, else TQDM_DISABLE (tqdm's own
    switch), else whether `stderr` (sys.stderr) is a terminal or a notebook kernel shows its output."""
    forced = environ.get(BARS, "").strip().lower()
    if forced in TRUE:
        return True
    if forced in FALSE:
        return False
    if forced:
        raise UserError(f"{BARS}={environ[BARS]!r}: set it to 1 (progress bars), 0 (none), or leave it unset")
    if environ.get("TQDM_DISABLE", "").strip().lower() in TRUE:
        return False
    terminal = _is_terminal(sys.stderr if stderr is None else stderr)
    return terminal or "ipykernel" in sys.modules  # a notebook renders tqdm.auto's bars as widgets


def setup() -> None:
    """Once per process, first thing in every entry point (before datasets, transformers or DeepSpeed load)."""
    global _bars
    _bars = wanted()
    if _bars:
        enable_library_bars()
    else:
        disable_library_bars()
    quiet_known_notices()
    if not _is_terminal(sys.stdout):
        # A file or a pipe is block-buffered: a log shows lines minutes late and out of order with stderr's.
        reconfigure = getattr(sys.stdout, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def follow_in_diffusers() -> None:
    """diffusers reads no variable for its bars (a pipeline's loading): off where setup() turned the others off."""
    if not progress_bars():
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()


def disable_library_bars() -> None:
    """No progress bars from datasets, huggingface_hub and transformers in this process and the ones it starts."""
    for module, variable in LIBRARY_SWITCHES.items():
        if variable in os.environ:
            continue  # the user's choice (or ours already), which the library honours over any call
        os.environ[variable] = "1"
        _ours.add(variable)
        _tell_library(module, "disable")  # imported already: it read the variable before we set it


def enable_library_bars() -> None:
    """Take back the switches an earlier setup() of this process set (in-process runs: a notebook, the tests)."""
    for module, variable in LIBRARY_SWITCHES.items():
        if variable in _ours:
            del os.environ[variable]
            _ours.discard(variable)
            _tell_library(module, "enable")


def _tell_library(module: str, how: str) -> None:
    """`how` ("enable" or "disable") the bars of `module` where it is imported (transformers follows the Hub's
    state, which it read at its own import)."""
    if module in sys.modules:
        getattr(importlib.import_module(f"{module}.utils"), f"{how}_progress_bars")()
        if module == "huggingface_hub" and "transformers" in sys.modules:
            getattr(importlib.import_module("transformers.utils.logging"), f"{how}_progress_bar")()


class _DropNotice(logging.Filter):
    """Drops the messages of the logger it is added to that hold `message`."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return self.message not in record.getMessage()


# accelerate's warning at every checkpoint of a model with tied weights (the LM head is the embedding matrix):
# saving drops the copy by design, and loading ties it again
SHARED_TENSOR_NOTICE = "Removed shared tensor "


# transformers' warning where a model of the GPT-2 kind sees a pad token and no attention_mask: the language-model
# batches pass none by design (each document's position_ids restart and its padding has no labels), so it is false
PADDING_NOTICE = "We strongly recommend passing in an `attention_mask`"
# the SageMaker MLflow plugin (a dependency of sagemaker) reads every tracking URI as an ARN and fails on any other,
# which MLflow's header registry warns about at each request to a server: 14 lines for 3 logged steps (audit)
SAGEMAKER_ARN_NOTICE = "Encountered unexpected error during resolving request headers: list index out of range"
NOTICES = (
    ("DeepSpeed", DEEPSPEED_CPU_NOTICE),
    ("accelerate.utils.other", SHARED_TENSOR_NOTICE),
    ("transformers.modeling_utils", PADDING_NOTICE),
    ("mlflow.tracking.request_header.registry", SAGEMAKER_ARN_NOTICE),
)


def quiet_known_notices() -> None:
    """Keep the libraries' false alarms of NOTICES off the console; any other message still shows. DeepSpeed's
    logger is set up when it is imported, keeping filters added before."""
    for name, notice in NOTICES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) and f.message == notice for f in logger.filters):
            logger.addFilter(_DropNotice(notice))


def say(line: str) -> None:
    """Print one line to stdout on a line of its own, also while a progress bar is shown (the bar is cleared and
    drawn again below it; a plain print would continue the bar's line)."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def _is_terminal(stream: TextIO | None) -> bool:
    try:  # a stream may have no isatty, or be closed
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False
