"""`cloudtrain generate`: its options, and the checks of their values. cloudtrain.generate loads the model and
generates."""

import argparse
import math
import sys

from cloudtrain.commands import add_switch, add_trust_remote_code, check_input_file, existing_run_dir
from cloudtrain.config.inert import GENERATE, unused
from cloudtrain.errors import refuse_first
from cloudtrain.publish.saving import check_not_diffusion

DEVICES = ("auto", "cpu", "cuda")
SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # the defaults of the options only sampling reads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model_dir",
        required=True,
        help="A directory written by the training application holding a causal language model or a seq2seq model.",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="A text to continue (repeatable; an empty prompt starts from the BOS token, or for a chat model is "
        "an empty user message).",
    )
    parser.add_argument(
        "--input_file",
        help="A .txt file with one prompt per line (blank lines skipped), "
        "or a csv/tsv/json/jsonl/parquet file with a --text_column.",
    )
    parser.add_argument(
        "--text_column", default="text", help="Column of --input_file holding the prompts (default: text)."
    )
    parser.add_argument(
        "--max_new_tokens",
        type=int,
        default=100,
        help="Tokens to generate per prompt, at most (default: 100; fewer if the model ends the text).",
    )
    parser.add_argument(
        "--num_beams",
        type=int,
        help="Beam search with this many beams (1: none); the text then prints when it is complete, not as it is "
        "written, and the checkpoint's saved length penalty and length rules apply. Default: as the run evaluated "
        "(--generation_num_beams of a seq2seq run), else 1; 1 with --do_sample true.",
    )
    add_switch(
        parser,
        "--do_sample",
        "Sample the next token (true) or take the most likely one (false: greedy, the default).",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=SAMPLING["temperature"],
        help="With --do_sample true: divide the logits by this (> 0; below 1 is more conservative, "
        "above 1 more varied; default: 1.0).",
    )
    parser.add_argument(
        "--top_k",
        type=int,
        default=SAMPLING["top_k"],
        help="With --do_sample true: sample among the k most likely tokens only (0: no limit; default: 50).",
    )
    parser.add_argument(
        "--top_p",
        type=float,
        default=SAMPLING["top_p"],
        help="With --do_sample true: sample among the most likely tokens whose probabilities add up "
        "to p (0 < p <= 1; 1.0, the default, turns it off).",
    )
    parser.add_argument(
        "--repetition_penalty",
        type=float,
        default=1.0,
        help="Penalise tokens already in the text (> 0; 1.0, the default, turns it off; 1.1-1.3 is typical).",
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="Seed of the random generator, set before each prompt (default: 42)."
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="Where to run: auto (a CUDA GPU if one is visible, else the CPU), cpu or cuda.",
    )
    add_switch(
        parser,
        "--chat",
        "An interactive conversation in the terminal with a chat model (its tokenizer has a "
        "chat template): /reset clears the history, /exit or Ctrl-D quits.",
    )
    add_switch(
        parser,
        "--raw",
        "Continue the prompts as plain text even when the model has a chat template "
        "(default: false, prompts are user messages).",
    )
    parser.add_argument(
        "--system_prompt",
        help="With a chat template: a system message put before the conversation (default: the training's "
        "--system_prompt); without one, or with --raw true, it is not read, and a note says so.",
    )
    add_trust_remote_code(parser)


def check_options(args: argparse.Namespace) -> None:
    """What needs no model: the numbers in range, something to generate from, the files named; one UserError
    naming the fix otherwise."""
    refuse_first(
        [
            (args.max_new_tokens < 1, f"--max_new_tokens must be at least 1, got {args.max_new_tokens}"),
            (
                args.num_beams is not None and args.num_beams < 1,
                f"--num_beams must be at least 1 (1: no beam search), got {args.num_beams}",
            ),
            (
                not args.temperature > 0,
                f"--temperature must be greater than 0, got {args.temperature}; "
                "for deterministic output use --do_sample false instead",
            ),
            (  # inf samples uniformly from the top_k: noise (found in audit)
                not math.isfinite(args.temperature),
                f"--temperature must be a finite number, got {args.temperature}; 1.0 leaves the model's distribution",
            ),
            (
                not math.isfinite(args.repetition_penalty),
                f"--repetition_penalty must be a finite number, got {args.repetition_penalty}; 1.0 turns it off",
            ),
            (not 0 < args.top_p <= 1, f"--top_p must be in (0, 1], got {args.top_p}; 1.0 turns it off"),
            (args.top_k < 0, f"--top_k must be 0 (no limit) or more, got {args.top_k}"),
            (
                not args.repetition_penalty > 0,
                f"--repetition_penalty must be greater than 0, got {args.repetition_penalty}; 1.0 turns it off",
            ),
            (
                args.chat and bool(args.prompt or args.input_file),
                "--chat reads the conversation from the terminal; leave out --prompt and --input_file",
            ),
            (
                not (args.chat or args.prompt or args.input_file),
                'nothing to generate from: pass --prompt "..." (repeatable) or --input_file FILE',
            ),
        ]
    )
    check_input_file(args.input_file)
    check_not_diffusion("--model_dir", existing_run_dir("--model_dir", args.model_dir))


def run(args: argparse.Namespace) -> None:
    check_options(args)
    for note in unused(GENERATE, vars(args), SAMPLING):
        print(f"note: {note}", file=sys.stderr)  # stdout holds the generated text
    from cloudtrain import generate  # torch and transformers: only once the options are valid

    generate.run(args)
