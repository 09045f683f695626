"""`cloudtrain predict`: its options. cloudtrain.predict classifies the texts."""

import argparse

from cloudtrain.commands import add_trust_remote_code, check_input_file, existing_run_dir, refuse_first
from cloudtrain.errors import UserError
from cloudtrain.publish.saving import holds_model

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


def check_options(args: argparse.Namespace) -> None:
    """What needs no model: the numbers, something to classify, and the files named; one UserError otherwise."""
    refuse_first(
        [
            (args.batch_size < 1, f"--batch_size must be at least 1, got {args.batch_size}"),
            (
                args.max_length is not None and args.max_length < 1,
                f"--max_length must be at least 1, got {args.max_length}",
            ),
            (not (args.text or args.input_file), 'nothing to classify: pass --text "..." or --input_file FILE'),
        ]
    )
    check_input_file(args.input_file)
    if not holds_model(existing_run_dir("--model_dir", args.model_dir)):
        raise UserError(f"--model_dir {args.model_dir} holds no saved model (no config.json/model.safetensors)")


def run(args: argparse.Namespace) -> None:
    check_options(args)
    from cloudtrain import predict  # torch and transformers: only once the options parsed

    predict.run(args)
