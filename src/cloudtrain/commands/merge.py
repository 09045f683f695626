"""`cloudtrain merge`: its options. cloudtrain.models.adapters merges the adapter into its base."""

import argparse
from pathlib import Path

from cloudtrain.commands import add_trust_remote_code, existing_run_dir, holding
from cloudtrain.errors import UserError
from cloudtrain.publish.output_dir import users_files, written
from cloudtrain.publish.saving import (
    ADAPTER_CONFIG,
    MERGED,
    check_not_checkpoint,
    check_not_diffusion,
    is_adapter_dir,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output_dir",
        "--model_dir",  # as predict and generate name the run they read
        dest="output_dir",
        required=True,
        action=_NamedAs,
        help="The output directory of a training run with --peft (also --model_dir).",
    )
    add_trust_remote_code(parser)


class _NamedAs(argparse.Action):
    """Stores the folder and the spelling given (errors name the flag the user typed)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        setattr(namespace, self.dest, values)
        namespace.flag = option_string or "--output_dir"


def check_options(args: argparse.Namespace) -> None:
    """--output_dir holds an adapter (any interrupted final save finished first), and no merged/ folder that
    cloudtrain did not write (it would be replaced); one UserError otherwise."""
    flag = getattr(args, "flag", "--output_dir")
    if not is_adapter_dir(existing_run_dir(flag, args.output_dir)):
        check_not_checkpoint(flag, Path(args.output_dir))  # a LoRA run's checkpoint holds no adapter_config.json
        check_not_diffusion(flag, Path(args.output_dir))
        raise UserError(
            f"{flag} {args.output_dir} holds no adapter ({ADAPTER_CONFIG}); merge needs the "
            "output of a run with --peft lora, dora or qlora"
        )
    merged = Path(args.output_dir) / MERGED
    if merged.exists() and MERGED not in written(Path(args.output_dir)):
        raise UserError(
            f"{merged} is not one cloudtrain wrote, and merge would replace it: move it elsewhere, then merge again"
        )
    theirs = [name for name in users_files(Path(args.output_dir)) if name.startswith(f"{MERGED}/")]
    if theirs:
        raise UserError(
            f"{flag} {args.output_dir} holds {', '.join(theirs[:4])}{' ...' if len(theirs) > 4 else ''}, "
            f"which cloudtrain did not write and merge would delete with the {MERGED}/ it replaces: move them "
            "elsewhere, then merge again"
        )


def run(args: argparse.Namespace) -> None:
    check_options(args)
    from cloudtrain.models import adapters  # torch, transformers and peft: only once the options parsed

    flag = getattr(args, "flag", "--output_dir")
    with holding(Path(args.output_dir), flag):  # not while a run writes the adapter, nor one starting there
        adapters.run(args)
