"""The options of the commands whose work needs torch, transformers or huggingface_hub: `predict`, `generate`,
`push`, `plan` and `merge`, one module each with `add_arguments(parser)` and `run(args)`.

A module here imports only the standard library and cloudtrain.config, so that `--help`, a refused option and
the checks of values that need no model answer at once; its `run` imports the module that does the work
(cloudtrain.predict, cloudtrain.generate, cloudtrain.publish.hub, cloudtrain.planning, cloudtrain.models.adapters)
once the options are valid. (`preprocess` is light as it is: its options are in cloudtrain.data.preprocess.)
tests/test_cli_startup.py checks what a fresh interpreter has imported after each command's `--help`.
"""

import argparse

from cloudtrain.config import parse_bool


def true_or_false(value: str) -> bool:
    """An argparse type for explicit booleans (`--trust_remote_code true`)."""
    try:
        return parse_bool(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust_remote_code",
        type=true_or_false,
        nargs="?",
        const=True,
        default=False,
        metavar="true|false",
        help="Run the model's own Python code (auto_map in its config) to load it; read that code first "
        "(default: false, such a model is refused).",
    )
