"""Options a run would leave unused: which tasks read each option, and which other option enables it.

Recipes and config files are shared between tasks, so an option that a run does not use is not an error; but
set silently, it looks like it counted (`--lora_r 4` without `--peft` trains every weight). A run prints one
`note:` per option the user set (a value other than its default) that it will not use, saying what would make
it count. The tables say where each option is read in the tasks' code; tests/test_inert_options.py keeps them
in step with the config sections and the task registry rows.
"""

import dataclasses
import os
import shlex
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from cloudtrain.config.images import ImagesConfig
from cloudtrain.config.model import PEFT_METHODS, ModelConfig
from cloudtrain.config.root import Config, _default, _fields
from cloudtrain.registry_table import STREAMING, TASK_ROWS


class Use(NamedTuple):
    """When an option counts: for one of `tasks` (empty: any task), and when option `needs` holds one of
    `values` (no `needs`: always; no `values`: any value but its default)."""

    tasks: tuple[str, ...] = ()
    needs: str = ""
    values: tuple[Any, ...] = ()


ADAPTERS = Use(needs="peft", values=tuple(method for method in PEFT_METHODS if method != "none"))
STREAMED = Use(tuple(STREAMING), "streaming", (True,))  # the tasks whose rows a stream can feed
SFT = ("sft",)
CHAT = ("sft", "dpo", "reward")  # the chat template, and the prompt column of pairs (cloudtrain.data.pairs)
SAMPLES = ("causal_lm", "sft", "dpo")  # greedy answers at evaluation; dpo's prompts come from its pairs

# option -> when it counts, for `cloudtrain train` (a Config)
TRAINING: dict[str, Use] = {
    **{f.name: ADAPTERS for f in dataclasses.fields(ModelConfig) if f.name.startswith("lora_")},
    "compile_layers": Use(needs="torch_compile", values=(True,)),
    # rows of documents or examples; dpo and reward pad their pairs (and refuse any other --packing)
    "packing": Use(("causal_lm", "sft")),
    "chat_template": Use(CHAT),
    "prompt_column": Use(CHAT),
    "messages_column": Use(SFT),
    "completion_column": Use(SFT),
    "system_prompt": Use(SFT),
    "train_on_prompt": Use(SFT),
    "sample_prompts": Use(("causal_lm", "sft")),  # dpo samples the prompts of its validation pairs
    "num_sample_prompts": Use(SAMPLES),
    "sample_max_new_tokens": Use(SAMPLES),
    **dict.fromkeys(
        (
            "train_weights",
            "datasets",
            "max_tokens",
            "mixture_exhausted",
            "stream_buffer",
            "stream_validation_docs",
            "on_bad_data",
        ),
        STREAMED,
    ),
    **dict.fromkeys(("preference_loss", "beta", "precompute_reference"), Use(("dpo",))),
    "simpo_gamma": Use(("dpo",), "preference_loss", ("simpo",)),
    "early_stopping_threshold": Use(needs="early_stopping_patience"),
    "chosen_column": Use(("dpo", "reward")),
    "rejected_column": Use(("dpo", "reward")),
    "margin_column": Use(("reward",)),
    "label_separator": Use(("multi_label",)),
    "label_smoothing": Use(("classification", "token_classification", "seq2seq", "causal_lm", "sft")),
    "doc_stride": Use(("question_answering",)),
    "max_answer_length": Use(("question_answering",)),
    "max_target_length": Use(("seq2seq",)),
    "source_prefix": Use(("seq2seq",)),
    "generation_num_beams": Use(("seq2seq",)),
    "rouge_stemmer": Use(("seq2seq",)),
    "source_lang": Use(("seq2seq",)),
    "target_lang": Use(("seq2seq",)),
    **{f.name: Use(("text_to_image",)) for f in dataclasses.fields(ImagesConfig)},
}

OWN_MODULE = "own_module"  # the Python API's model= (ModuleTask): it reads none of the tasks' own options

# option -> when it counts, for `cloudtrain generate` (greedy decoding reads no sampling option)
GENERATE: dict[str, Use] = dict.fromkeys(("temperature", "top_k", "top_p"), Use(needs="do_sample", values=(True,)))


def reads(task: str, name: str) -> bool:
    """Whether a run of --task `task` reads the training option `name` (by the table; an option it does not
    list counts for every task)."""
    use = TRAINING.get(name)
    return use is None or not use.tasks or task in use.tasks


def unused(
    table: Mapping[str, Use],
    values: Mapping[str, Any],
    defaults: Mapping[str, Any],
    task: str | None = None,
    separators: Mapping[str, str] | None = None,
) -> list[str]:
    """One note per option of `table` whose value in `values` differs from `defaults` and that this run leaves
    unused, in the table's order. `task`: the run's --task (or OWN_MODULE); one the tables do not know (an
    extension registered at run time) may read anything, so only the enabling options are checked for it.
    `separators`: how a list option's items are written on the command line (default: commas)."""
    known = task in TASK_ROWS or task == OWN_MODULE
    run = "your own module (model=)" if task == OWN_MODULE else f"--task {task}"
    notes = []
    for name, use in table.items():
        if name not in values or values[name] == defaults[name]:
            continue
        given = f"--{name} {_shown(values[name], (separators or {}).get(name, ','))}"
        wanted = _either(use.values) if use.values else "N"
        enabled = not use.needs or (
            values[use.needs] in use.values if use.values else values[use.needs] != defaults[use.needs]
        )
        condition = f" with --{use.needs} {wanted}" if use.needs else ""
        if use.tasks and known and task not in use.tasks:
            tasks = _either(use.tasks)
            notes.append(f"{given} has no effect on {run}; it counts for --task {tasks}{condition}")
        elif not enabled:
            notes.append(f"{given} has no effect without --{use.needs} {wanted}")
    return notes


def inert_notes(cfg: Config, task: str | None = None) -> list[str]:
    """The notes of a training run: the options set in `cfg` that it will not use (`task`: default its --task)."""
    fields = _fields()
    defaults = {name: _default(f) for name, (_, f) in fields.items()}
    separators = {name: f.metadata["separator"] for name, (_, f) in fields.items()}
    return unused(TRAINING, cfg.to_dict(include_secrets=True), defaults, task or cfg.training.task, separators)


def print_inert_notes(cfg: Config, task: str | None = None) -> None:
    """The notes of `inert_notes`, printed once per launch (by the process of rank 0; a launcher sets RANK), before
    the run loads anything: the command line's and train(...)'s way in."""
    if int(os.environ.get("RANK", "0")) == 0:
        for note in inert_notes(cfg, task):
            print(f"note: {note}", flush=True)


def _either(values: Iterable[Any]) -> str:
    """lora, dora or qlora."""
    words = [_shown(value) for value in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _shown(value: Any, separator: str = ",", limit: int = 60) -> str:
    """A value as it is typed on the command line (a list as one `separator`-joined string), cut at `limit`."""
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, list):
        text = separator.join(map(str, value))
    else:
        text = str(value)
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return shlex.quote(text)
