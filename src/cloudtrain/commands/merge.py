"""`cloudtrain merge`: its options. cloudtrain.models.adapters merges the adapter into its base."""

import argparse

from cloudtrain.commands import add_trust_remote_code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output_dir", required=True, help="The output directory of a training run with --peft.")
    add_trust_remote_code(parser)


def run(args: argparse.Namespace) -> None:
    from cloudtrain.models import adapters  # torch, transformers and peft: only once the options parsed

    adapters.run(args)
