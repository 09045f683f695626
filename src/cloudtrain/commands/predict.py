"""`cloudtrain predict`: its options. cloudtrain.predict classifies the texts."""

import argparse

from cloudtrain.commands import add_trust_remote_code

DEFAULT_MAX_LENGTH = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model_dir", required=True, help="A directory written by the training application.")
    parser.add_argument("--text", action="append", default=[], help="A text to classify (repeatable).")
    parser.add_argument("--input_file", help="A .txt file (one text per line) or a csv/tsv/json/jsonl file.")
    parser.add_argument("--text_column", default="text", help="Column of --input_file holding the texts.")
    parser.add_argument("--output_file", help="Write the JSON lines here instead of printing them.")
    parser.add_argument("--batch_size", type=int, default=32, help="Texts per forward pass (default: 32).")
    parser.add_argument(
        "--max_length",
        type=int,
        help=f"Truncate texts to this many tokens (default: {DEFAULT_MAX_LENGTH}, or the model's context if shorter).",
    )
    add_trust_remote_code(parser)


def run(args: argparse.Namespace) -> None:
    from cloudtrain import predict  # torch and transformers: only once the options parsed

    predict.run(args)
