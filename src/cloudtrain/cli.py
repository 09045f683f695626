"""Command line: `train` (the default), `launch`, `predict`, `generate`, `push`, `plan` and `merge`.

    cloudtrain [train] [--config FILE] [--<option> VALUE ...]
    cloudtrain launch --nproc_per_node 8 [--<option> VALUE ...]
    cloudtrain predict --model_dir DIR --text "..."
    cloudtrain generate --model_dir DIR --prompt "..."
    cloudtrain push --output_dir DIR --hub_model_id USER/NAME
    cloudtrain plan --model_name_or_path DIR --num_gpus 8 --gpu_memory_gb 24
    cloudtrain merge --output_dir DIR

`cloudtrain` is the installed console script; `python src/training_application.py` (the SageMaker
entry script) and `python -m cloudtrain` run the same `main`.

Each command other than train is a light module with `add_arguments(parser)` and `run(args)`, imported only
when used (cloudtrain.commands.<name>; preprocess's is cloudtrain.data.preprocess): its `run` imports what does
the work (torch, transformers, huggingface_hub) only once the options are valid, so that `--help` and a refused
option answer at once. User mistakes print one `error:` line and exit with status 2; no traceback.
"""

import difflib
import importlib
import os
import sys

from cloudtrain import __version__
from cloudtrain.config import ConfigParser, add_config_arguments, config_from_namespace, option_fields
from cloudtrain.config.inert import print_inert_notes
from cloudtrain.errors import TrainingStopped, UserError, earlier_mistake, record_quiet, report
from cloudtrain.invocation import check_launcher_variables, prog
from cloudtrain.observe import console
from cloudtrain.paths import check_local_paths
from cloudtrain.redact import mask, scrub_argv
from cloudtrain.registry_table import TASK_ROWS

COMMANDS = {  # name: (its light module: add_arguments and run, one-line description, ending in a period)
    "launch": (
        "cloudtrain.commands.launch",
        "Train on several processes (one per GPU) and nodes, through torchrun; each error printed once.",
    ),
    "predict": (
        "cloudtrain.commands.predict",
        "Classify texts (or score them, with a reward model) with a saved model.",
    ),
    "generate": (
        "cloudtrain.commands.generate",
        "Continue prompts with a saved causal language model, or answer them with a seq2seq model.",
    ),
    "push": ("cloudtrain.commands.push", "Upload an existing output dir to the Hugging Face Hub."),
    "plan": ("cloudtrain.commands.plan", "Estimate memory per GPU and pick a distributed strategy."),
    "preprocess": ("cloudtrain.data.preprocess", "Tokenize a corpus once into Parquet shards for --streaming true."),
    "merge": (
        "cloudtrain.commands.merge",
        "Merge a trained adapter (--peft) into its base model: <output_dir>/merged.",
    ),
}
INTERRUPTED_TRAINING = (
    ": nothing saved now (a first Ctrl-C during training saves a checkpoint, one after it the model); a run that "
    "saved checkpoints before continues from the newest with --resume_from_checkpoint latest"
)
DESCRIPTION = (
    "Train a Hugging Face model for a --task (default classification): "
    + "; ".join(f"{name}, {row.summary}" for name, row in TASK_ROWS.items())
    + ".\nWith no options it trains all-MiniLM-L6-v2 on Reuters R8 (8 news topics), both shipped offline.\n"
    "Other commands: " + "; ".join(f"`{name}`: {text.rstrip('.')}" for name, (_, text) in COMMANDS.items()) + "."
)


def train_parser(named: bool = False) -> ConfigParser:
    """The training options' parser; `named`: the user wrote `train`, which its usage line then shows."""
    parser = ConfigParser(prog=f"{prog()} train" if named else prog(), description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"cloudtrain {__version__}")
    add_config_arguments(parser)
    return parser


def command_parser(name: str) -> ConfigParser:
    """The parser of command `name`; its module (light, cloudtrain.commands) is imported here."""
    module_name, description = COMMANDS[name]
    parser = ConfigParser(prog=f"{prog()} {name}", description=description)
    importlib.import_module(module_name).add_arguments(parser)
    return parser


def train_main(argv: list[str], named: bool = False) -> None:
    cfg = config_from_namespace(train_parser(named).parse_args(argv))
    check_local_paths(cfg)
    check_launcher_variables()
    print_inert_notes(cfg)
    from cloudtrain.pipeline import run_training  # heavy imports only once the options and paths are valid

    run_training(cfg)


def check_command(word: str) -> None:
    """Training takes no positional arguments, so a first word that is not an option names a command: a
    mistyped one is told the closest (or every command), not parsed as training's stray arguments."""
    names = ["train", *COMMANDS]
    close = difflib.get_close_matches(word, names, n=1)
    hint = f"did you mean {close[0]}?" if close else f"the commands are {', '.join(names)}"
    raise UserError(f"unknown command {word!r}; {hint}")


def command_main(name: str, argv: list[str]) -> None:
    args = command_parser(name).parse_args(argv)
    importlib.import_module(COMMANDS[name][0]).run(args)


# `cloudtrain predict ... | head` ended in a BrokenPipeError traceback once head stopped reading. Python ignores
# SIGPIPE, so a write to a pipe nobody reads raises; the standard tools (cat, seq, grep) die of the signal instead,
# which shells report as 128 + 13. The same status, quietly: a pipeline under `set -o pipefail` treats cloudtrain as
# it treats them (the output was cut short), and one without it reports the reader's status, as before.
SIGPIPE_STATUS = 141


def closed_by_reader() -> bool:
    """Whether stdout (or stderr) is a pipe whose reader has gone (`| head`); if so, it is pointed at os.devnull, as
    Python's documentation of SIGPIPE advises, so that the interpreter's last flush at exit raises nothing more."""
    import select

    broken = False
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):  # replaced (pytest's capture) or closed
            continue
        if not hasattr(select, "poll"):  # Windows: no poll to ask; stdout is where a command writes most
            broken = broken or stream is sys.stdout
            continue
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0)):
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
            broken = True
    return broken


def secret_options() -> list[str]:
    return [name for name, (_, f) in option_fields().items() if f.metadata["secret"]]


def main(argv: list[str] | None = None) -> int:
    code = run_command(sys.argv[1:] if argv is None else list(argv))
    if code == 0 and argv is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # One process of a launch that succeeded: everything is written and closed by now. Skip the interpreter's
        # teardown, where gloo's and DeepSpeed's threads can abort (SIGABRT) a ZeRO-3 process whose run completed.
        # (A failing process exits as usual: the launcher stops the others only once each has said why.)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run_command(argv: list[str]) -> int:
    secrets = secret_options()
    if any(arg.split("=")[0] in {f"--{name}" for name in secrets} for arg in argv):
        print(
            "warning: a token on the command line is visible to other users of this machine (ps) and in your "
            "shell history; set HF_TOKEN or pass --hub_token_file instead",
            file=sys.stderr,
        )
    scrub_argv(secrets)  # read already; trackers record sys.argv as the program's arguments
    mistake = earlier_mistake()
    if mistake is not None:  # a restarted attempt of a launch: the same mistake would end it again
        report(mistake, 2, echo=False)
        return 2
    try:
        console.setup()  # bars only on a terminal; before datasets, transformers or DeepSpeed are imported
        if argv and argv[0] == "launch":  # the training options too, as typed, for the processes it starts
            return importlib.import_module(COMMANDS["launch"][0]).main(argv[1:], command_parser("launch"))
        if argv and argv[0] in COMMANDS:
            command_main(argv[0], argv[1:])
        elif argv and argv[0] == "train":
            train_main(argv[1:], named=True)
        else:
            if argv and not argv[0].startswith("-"):
                check_command(argv[0])
            train_main(argv)
    except UserError as err:
        if not err.quiet:
            report(f"error: {mask(str(err))}", 2, transient=err.transient)
        else:
            record_quiet(2)
        return 2
    except TrainingStopped as err:
        if err.exit_code == 0:  # nothing went wrong: the run had nothing left to do
            if not err.quiet:
                print(f"note: {mask(str(err))}", flush=True)
            return 0
        if not err.quiet:
            report(f"{'stopped' if err.exit_code in (130, 143) else 'error'}: {mask(str(err))}", err.exit_code)
        else:
            record_quiet(err.exit_code)
        return err.exit_code
    except BrokenPipeError:
        if not closed_by_reader():
            raise  # some other pipe (a tracker's, a worker's): a fault to see whole
        return SIGPIPE_STATUS
    except KeyboardInterrupt:
        training = not (argv and argv[0] in COMMANDS)
        # inside the training loop a first Ctrl-C saves a checkpoint; here it came elsewhere, or came twice
        print(f"interrupted{INTERRUPTED_TRAINING if training else ''}", file=sys.stderr)
        return 130
    return 0
