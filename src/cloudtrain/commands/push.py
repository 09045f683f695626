"""`cloudtrain push`: its options. cloudtrain.publish.hub uploads the output dir."""

import argparse
from pathlib import Path

from cloudtrain.commands import add_switch, holding


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output_dir", required=True, help="A directory written by the training application.")
    parser.add_argument(
        "--hub_model_id",
        help="Hub repository <user or org>/<name> (default: the hub_model_id in <output_dir>/args.json).",
    )
    parser.add_argument("--hub_token", help="Hub token; prefer HF_TOKEN or --hub_token_file (never saved).")
    parser.add_argument(
        "--hub_token_file",
        help="A file holding the Hub token (default: HF_TOKEN, else the training run's token file recorded in "
        "args.json if it is still there, else the login).",
    )
    add_switch(
        parser,
        "--hub_private_repo",
        "Create the repository as private (default: as in args.json).",
        default=None,
    )
    parser.add_argument("--hub_revision", help="Branch to push to (default: as in args.json, else main).")


def run(args: argparse.Namespace) -> None:
    from cloudtrain.publish import hub  # huggingface_hub: only once the options parsed

    with holding(Path(args.output_dir)):  # not a model a run is still writing, nor one a run starting there replaces
        hub.run(args)
