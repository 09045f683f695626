"""Command line: `train` (the default) and `predict`.

    python src/training_application.py [train] [--config FILE] [--<option> VALUE ...]
    python src/training_application.py predict --model_dir DIR --text "..."

User mistakes print one `error:` line and exit with status 2; no traceback.
"""

import sys

from cloudtrain.config import _Parser, add_config_arguments, config_from_namespace
from cloudtrain.errors import UserError

PROG = "training_application.py"
DESCRIPTION = """Fine-tune a Hugging Face sequence-classification model.
With no options it trains all-MiniLM-L6-v2 on Reuters R8 (8 news topics), both shipped offline.
Other commands: `predict --model_dir DIR --text ...` classifies texts with a saved model."""


def train_main(argv: list[str]) -> None:
    parser = _Parser(prog=PROG, description=DESCRIPTION)
    add_config_arguments(parser)
    cfg = config_from_namespace(parser.parse_args(argv))
    from cloudtrain.pipeline import run_training  # heavy imports only once the options are valid

    run_training(cfg)


def predict_main(argv: list[str]) -> None:
    from cloudtrain.predict import add_predict_arguments, run_predict

    parser = _Parser(prog=f"{PROG} predict", description="Classify texts with a saved model.")
    add_predict_arguments(parser)
    run_predict(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"train": train_main, "predict": predict_main}
    command = argv.pop(0) if argv and argv[0] in commands else "train"
    try:
        commands[command](argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
