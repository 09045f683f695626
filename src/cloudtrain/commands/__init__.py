"""The options of the commands whose work needs torch, transformers or huggingface_hub: `predict`, `generate`,
`push`, `plan` and `merge`, one module each with `add_arguments(parser)` and `run(args)`.

A module here imports no torch, transformers or task (the standard library and cloudtrain's light modules:
config, errors, publish.atomic, .output_dir, .saving, planning.accelerators, .strategies), so `--help`, a refused
option and the checks that need no model (numbers in range, files and directories there) answer at once; its
`run` imports the module that does the work (cloudtrain.predict, cloudtrain.generate, cloudtrain.publish.hub,
cloudtrain.planning, cloudtrain.models.adapters) once the options are valid. (`preprocess` is light as it is:
its options are in cloudtrain.data.preprocess.) tests/test_cli_startup.py checks what a fresh interpreter has
imported after each command's `--help` and refusals.
"""

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

from cloudtrain.config import parse_bool
from cloudtrain.errors import UserError


def true_or_false(value: str) -> bool:
    """An argparse type for explicit booleans (`--trust_remote_code true`)."""
    try:
        return parse_bool(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_switch(parser: argparse.ArgumentParser, flag: str, help: str, default: bool | None = False) -> None:
    """A true|false option; given alone (`--chat`) it means true."""
    parser.add_argument(
        flag, type=true_or_false, nargs="?", const=True, default=default, metavar="true|false", help=help
    )


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    add_switch(
        parser,
        "--trust_remote_code",
        "Run the model's own Python code (auto_map in its config) to load it; read that code first "
        "(default: false, such a model is refused).",
    )


def existing_run_dir(flag: str, path: str) -> Path:
    """`path` (given as `flag`) is a directory, with any final save a kill interrupted finished, so that what is
    read next is the previous model or the new one complete; a UserError otherwise."""
    if not Path(path).is_dir():
        if Path(path).exists():  # "does not exist" sent the user looking for a folder that is there (audit)
            raise UserError(f"{flag} {path} is a file; give the folder a training run wrote")
        raise UserError(f"{flag} {path} does not exist; pass the output_dir of a training run")
    from cloudtrain.publish.output_dir import recover_unless_in_use

    recover_unless_in_use(Path(path))
    return Path(path)


def check_input_file(path: str | None) -> None:
    if path is not None and not Path(path).is_file():
        what = "is a folder; give a file" if Path(path).is_dir() else "does not exist"
        raise UserError(f"--input_file {path} {what}")


@contextlib.contextmanager
def holding(folder: Path, flag: str = "--output_dir") -> Iterator[None]:
    """`folder` held as a run holds its output folder (cloudtrain.publish.output_dir.hold) while a command works in
    it: refused in one line while a run holds it. A folder that is not there is left to the command to say so."""
    from cloudtrain.publish.output_dir import hold, release

    if not folder.is_dir():
        yield
        return
    hold(folder, flag, elsewhere=False)
    try:
        yield
    finally:
        release(folder)
