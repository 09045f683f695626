"""`cloudtrain predict`: its options. cloudtrain.predict classifies the texts.

Everything that needs no model is checked here, before torch and transformers are imported: the numbers, that
there is something to classify, the files named (an --output_file is never the --input_file, and replaces an
existing file only with --overwrite_output_file true), and that the texts come in pairs exactly when the saved
model was trained on pairs (its args.json: a classifier's text_pair_column; an encoder reward model reads
prompt and answer as a pair; one trained on plain text, as its tokenizer_config.json records, reads either).
"""

import argparse
import json
import os
import stat
from pathlib import Path

from cloudtrain.commands import (
    add_switch,
    add_trust_remote_code,
    check_input_file,
    existing_run_dir,
)
from cloudtrain.errors import UserError, refuse_first
from cloudtrain.models.positions import saved_positions
from cloudtrain.publish.saving import check_not_checkpoint, check_not_diffusion, holds_model, read_arguments
from cloudtrain.registry_table import PROMPT_ANSWERS, QUESTIONS, TEXTS, predict_input

DEFAULT_MAX_LENGTH = 512
# the text column a task's run reads without --text_column where its data has no `text`: answer_spans.SQUAD_COLUMNS'
# and word_tags.CONLL_COLUMNS' (named here: those modules load torch and transformers)
NAMED_TEXT = {"question_answering": "question", "token_classification": "tokens"}
# how a cloudtrain reward model read its texts (the reward task writes it into the saved tokenizer_config.json, which
# an adapter folder and a merged model keep too): "plain" (implicit-prompt pairs of strings: each side its whole
# text), "template" (rendered through the chat template), "text_pair" (prompt and answer as a text pair). A model
# saved before it records nothing and is read by its chat template, if any, else as a text pair.
REWARD_INPUT, PLAIN_INPUT = "cloudtrain_reward_input", "plain"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model_dir", required=True, help="A directory written by the training application.")
    parser.add_argument("--text", action="append", default=[], help="A text to classify (repeatable).")
    parser.add_argument(
        "--text_pair",
        action="append",
        default=[],
        help="The second text of a sentence-pair model, one per --text, in the same order (repeatable).",
    )
    parser.add_argument(
        "--input_file",
        help="A .txt file (one text per line) or a csv/tsv/json/jsonl/parquet file with a --text_column.",
    )
    parser.add_argument(
        "--text_column",
        help="Column of --input_file holding the texts (default: the text_column the model was trained with, from "
        "its args.json: text, or the question or tokens column a question-answering or token-classification run read "
        "without the option, where the file has no text column).",
    )
    parser.add_argument(
        "--text_pair_column",
        help="Column of --input_file holding the second texts of a sentence-pair model "
        "(default: the text_pair_column the model was trained with, from its args.json).",
    )
    parser.add_argument(
        "--output_file",
        help="Write the predictions here instead of printing them: .csv or .tsv (one column per field), "
        ".json (one array), any other name JSON lines.",
    )
    add_switch(
        parser,
        "--overwrite_output_file",
        "Replace an existing --output_file (default: false, an existing file is refused).",
    )
    parser.add_argument("--batch_size", type=int, default=32, help="Texts per forward pass (default: 32).")
    parser.add_argument(
        "--max_length",
        type=int,
        help="Truncate texts to this many tokens, at most the model's context (default: the max_length the model "
        f"was trained with, from its args.json; for a model without one {DEFAULT_MAX_LENGTH}, or its context if "
        "shorter).",
    )
    add_switch(
        parser,
        "--handle_impossible_answer",
        'A question-answering model answers "" (no answer) where that scores higher than its best span, as the '
        "run's evaluation did when its training data had questions without an answer (SQuAD 2.0); default: false, "
        "always the best span, as transformers' pipeline.",
    )
    add_trust_remote_code(parser)


def too_long(max_length: int, context: int) -> str:
    return (
        f"--max_length {max_length} is longer than the model's context ({context} positions); pass --max_length "
        f"{context} or less"
    )


def check_options(args: argparse.Namespace) -> None:
    """What needs no model: the numbers, something to classify, the files named and the text pairs; one UserError
    otherwise. Sets args.text_pair_column to the model's recorded one where the user named none."""
    refuse_first(
        [
            (args.batch_size < 1, f"--batch_size must be at least 1, got {args.batch_size}"),
            (
                args.max_length is not None and args.max_length < 1,
                f"--max_length must be at least 1, got {args.max_length}",
            ),
            (not (args.text or args.input_file), 'nothing to classify: pass --text "..." or --input_file FILE'),
            (
                bool(args.text_pair) and len(args.text_pair) != len(args.text),
                f"{len(args.text_pair)} --text_pair for {len(args.text)} --text: give each --text its second text "
                "with one --text_pair, in the same order",
            ),
            (
                args.text_pair_column is not None and args.text_pair_column == args.text_column,
                "--text_pair_column must differ from --text_column",
            ),
        ]
    )
    check_input_file(args.input_file)
    check_output_file(args.output_file, args.input_file, args.overwrite_output_file)
    check_not_checkpoint("--model_dir", existing_run_dir("--model_dir", args.model_dir))  # its weights: no model
    if not holds_model(Path(args.model_dir)):
        check_not_diffusion("--model_dir", Path(args.model_dir))
        raise UserError(f"--model_dir {args.model_dir} holds no saved model (no config.json/model.safetensors)")
    context = saved_positions(args.model_dir)  # an adapter's base is checked once it loads
    if args.max_length is not None and context and args.max_length > context:
        raise UserError(too_long(args.max_length, context))
    task, reads = saved_task(Path(args.model_dir))
    trained_text_column(args, task)
    if args.text_pair_column is not None and args.text_pair_column == args.text_column:  # the column as resolved
        raise UserError("--text_pair_column must differ from --text_column")
    check_pairs(args, *trained_on_pairs(Path(args.model_dir), reads))
    if args.handle_impossible_answer and reads != QUESTIONS:
        what = f"was trained for --task {task}" if task else "is not a question-answering model"
        raise UserError(
            f"--handle_impossible_answer is for question-answering models; the model in {args.model_dir} {what}: "
            "drop it"
        )


# ---------------------------------------------------------------- the output file


def check_output_file(output_file: str | None, input_file: str | None, overwrite: bool) -> None:
    """An --output_file that is not the --input_file, not an existing file (unless `overwrite`), in a folder that
    can be written (made at the end if missing): so nothing of the user's is replaced unasked, and a run that
    would fail to write its predictions fails before it loads the model."""
    if output_file is None:
        return
    out = Path(output_file)
    if input_file is not None and same_file(out, Path(input_file)):
        raise UserError(
            f"--output_file {output_file} is the --input_file: the predictions would replace the texts; "
            f"write them to another file, such as {free_name(out.with_name(out.stem + '-predictions.jsonl'))}"
        )
    if out.is_dir():
        raise UserError(
            f"--output_file {output_file} is a folder; name a file in it, such as {out / 'predictions.jsonl'}"
        )
    if out.exists() and not out.is_file():  # a device or a FIFO (through a symlink too): never replaced by a file
        raise UserError(
            f"--output_file {output_file} is {special_kind(out)}, not a regular file, and is never replaced: name a "
            "regular file, or leave out --output_file to print the predictions (and pipe them where you want)"
        )
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise UserError(
            f"--output_file {output_file} exists and is not replaced: name a new file, such as {free_name(out)}, "
            "or pass --overwrite_output_file true to replace it"
        )
    folder = out.resolve().parent  # a symlink's target is what gets written; a missing folder is made then
    there = next(p for p in (folder, *folder.parents) if p.exists())
    if not there.is_dir():
        raise UserError(f"--output_file {output_file}: {there} is a file, not a folder; name a file in a folder")
    probe = there / f".cloudtrain-write-probe-{os.getpid()}"
    try:  # root ignores permission bits, not a read-only filesystem: so try
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        probe.unlink()
    except OSError as err:
        raise UserError(
            f"--output_file {output_file}: {there} cannot be written ({err.strerror}); choose a folder you can write to"
        ) from None


def special_kind(path: Path) -> str:
    """What a path that is neither a folder nor a regular file is, in words."""
    mode = path.stat().st_mode
    for test, kind in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
    ):
        if test(mode):
            return kind
    return "a socket" if stat.S_ISSOCK(mode) else "a special file"


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: through relative paths, symlinks and hard links."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): the same path once resolved
        return a.resolve() == b.resolve()


def free_name(path: Path) -> Path:
    """`path` with -2, -3, ... added to its stem: the first name no file has."""
    suffix = path.suffix or ".jsonl"
    stem = path.stem if path.suffix else path.name
    candidate, n = path.with_name(stem + suffix), 2
    while candidate.exists() or candidate.is_symlink():
        candidate, n = path.with_name(f"{stem}-{n}{suffix}"), n + 1
    return candidate


# ---------------------------------------------------------------- text pairs


def trained_text_column(args: argparse.Namespace, task: str | None) -> None:
    """--text_column, where not given, as the run read its texts (its args.json), as --text_pair_column is: a QA
    or token-classification run's own validation file was refused "column 'text' is not in ..." for a default of
    `text` where the run read `question` or `tokens` (found in audit). args.text_column_fallback: the family's
    column read where the file has no column of the recorded name: a family's, or `text`, the option's default
    before it followed the run (an input file that worked then works still; found in review)."""
    args.text_column_fallback = None
    if args.text_column is not None:
        return
    args.text_column = read_arguments(Path(args.model_dir)).get("text_column") or "text"
    # the option's default: the run read its data family's column where no `text`
    args.text_column_fallback = NAMED_TEXT.get(task or "") if args.text_column == "text" else "text"


def trained_on_pairs(model_dir: Path, reads: str | None) -> tuple[bool | None, str, str | None]:
    """(whether the saved model reads text pairs, how it was trained in words, the recorded text_pair_column), from
    the args.json the training application saved with it and what it `reads` (`saved_task`); (None, "", None)
    for a model from elsewhere."""
    recorded = read_arguments(model_dir)
    if reads == QUESTIONS:
        # a run that read SQuAD's columns without options recorded none: its contexts were in "context"
        context = recorded.get("text_pair_column") or "context"
        return True, "on a question and its context (--text QUESTION --text_pair CONTEXT)", context
    if reads == TEXTS:
        column = recorded.get("text_pair_column")
        if column:
            return (
                True,
                f"on text pairs (--text_column {recorded.get('text_column')} --text_pair_column {column})",
                column,
            )
        return False, "on single texts (its args.json records no text_pair_column)", None
    if reads == PROMPT_ANSWERS:
        if reward_input(model_dir) == PLAIN_INPUT:  # a whole text, or a prompt and the rest of its text: either
            return None, "on plain texts", None
        if recorded.get("chat_template") or has_chat_template(model_dir):
            return True, "on a prompt and an answer rendered through its chat template", None
        if (model_dir / "tokenizer_config.json").is_file():
            return True, "on prompt and answer as a text pair", None
    return None, "", None


def saved_task(model_dir: Path) -> tuple[str | None, str | None]:
    """(the --task a saved model was trained for, from its args.json; what predict gives it, from the task's
    registry row): a question-answering model trained elsewhere reads questions; (None, None) where nothing says."""
    task = read_arguments(model_dir).get("task")
    if task:
        return task, predict_input(task)
    return None, QUESTIONS if _answers_questions(model_dir) else None


def _answers_questions(model_dir: Path) -> bool:
    """Whether config.json names a question-answering model, or adapter_config.json a QUESTION_ANS adapter (one
    trained elsewhere has no args.json to say so)."""
    for name, says in (
        ("config.json", lambda c: any(str(a).endswith("ForQuestionAnswering") for a in c.get("architectures") or [])),
        ("adapter_config.json", lambda c: c.get("task_type") == "QUESTION_ANS"),
    ):
        try:
            config = json.loads((model_dir / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and says(config):
            return True
    return False


def reward_input(model_dir: Path | str) -> str | None:
    """How a cloudtrain reward model read its texts (REWARD_INPUT in its tokenizer_config.json), or None where it
    does not say (a model saved before it was recorded, or from elsewhere)."""
    try:
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get(REWARD_INPUT) if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


def has_chat_template(model_dir: Path) -> bool:
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def check_pairs(args: argparse.Namespace, pairs: bool | None, how: str, recorded_column: str | None) -> None:
    """The texts come in pairs exactly when the model reads pairs (`pairs`; None: the model does not say, so the
    user's options decide), inline and from the file alike; one UserError saying which option to add or drop."""
    txt_file = args.input_file is not None and Path(args.input_file).suffix == ".txt"
    if args.input_file and args.text_pair_column is None and pairs and recorded_column and not txt_file:
        args.text_pair_column = recorded_column
    model = f"the model in {args.model_dir} was trained {how}"
    if pairs is False:
        given = "--text_pair" if args.text_pair else "--text_pair_column" if args.text_pair_column else None
        if given:
            raise UserError(f"{model}: drop {given}")
        return
    if txt_file and (pairs or args.text_pair_column or args.text_pair):
        raise UserError(
            f"--input_file {args.input_file} holds one text per line, with no second text; "
            + (f"{model}: " if pairs else "")
            + "give a csv/tsv/json/jsonl/parquet file and name its columns with --text_column and --text_pair_column"
        )
    if pairs and args.text and not args.text_pair:
        raise UserError(f'{model}: give each --text its second text with --text_pair "..."')
    if pairs and args.input_file and args.text_pair_column is None:
        raise UserError(f"{model}: name the column of --input_file holding the second texts with --text_pair_column")
    if args.text and args.input_file and bool(args.text_pair) != (args.text_pair_column is not None):
        raise UserError(
            "the --text options and --input_file must both come with second texts or both without: "
            + ("add --text_pair_column" if args.text_pair else 'add --text_pair "..." after each --text')
        )


def run(args: argparse.Namespace) -> None:
    check_options(args)
    from cloudtrain import predict  # torch and transformers: only once the options parsed

    predict.run(args)
