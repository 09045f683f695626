"""Options a run would leave unused: which tasks read each option, and which other option enables it.

Recipes and config files are shared between tasks, so an option that a run does not use is not an error; but
set silently, it looks like it counted (`--lora_r 4` without `--peft` trains every weight). A run prints one
`note:` per option the user set (a value other than its default) that it will not use, saying what would make
it count. Which task reads which option is each task's own declaration (Task.reads_options, mirrored in its registry
row); tests/test_inert_options.py keeps that in step with the config sections and the tasks' code.
"""

import dataclasses
import os
import shlex
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from cloudtrain.config.images import ImagesConfig
from cloudtrain.config.model import PEFT_METHODS, ModelConfig
from cloudtrain.config.preference import PREFERENCE_LOSSES, REFERENCE_FREE
from cloudtrain.config.root import Config, option_default, option_fields
from cloudtrain.registry_table import STREAMING, TASK_ROWS
from cloudtrain.sagemaker_env import job_notes


class Use(NamedTuple):
    """When an option counts: for one of `tasks` (empty: any task), and when option `needs` holds one of
    `values` (no `needs`: always; no `values`: any value but its default)."""

    tasks: tuple[str, ...] = ()
    needs: str = ""
    values: tuple[Any, ...] = ()


ADAPTER_METHODS = tuple(method for method in PEFT_METHODS if method != "none")
SECTIONS = {"images": ImagesConfig}  # read whole by a task whose reads_options names the section
STREAMED = Use(tuple(STREAMING), "streaming", (True,))  # the tasks whose rows a stream can feed
STREAM_OPTIONS = (
    "train_weights",
    "datasets",
    "max_tokens",
    "mixture_exhausted",
    "stream_buffer",
    "stream_buffer_mb",
    "stream_validation_docs",
    "on_bad_data",
)
# option -> the option that enables it, and the values that do (none: any value but its default)
ENABLED_BY: dict[str, tuple[str, tuple[Any, ...]]] = {
    **{f.name: ("peft", ADAPTER_METHODS) for f in dataclasses.fields(ModelConfig) if f.name.startswith("lora_")},
    "compile_layers": ("torch_compile", (True,)),
    "eval_steps": ("eval_strategy", ("steps",)),
    "simpo_gamma": ("preference_loss", ("simpo",)),
    # a config file's precomputed reference stays valid for a reference-free loss given as a flag (make dpo ARGS=)
    "precompute_reference": ("preference_loss", tuple(x for x in PREFERENCE_LOSSES if x not in REFERENCE_FREE)),
    "early_stopping_threshold": ("early_stopping_patience", ()),
    "profile_steps": ("profile", (True,)),
    # what a tracker's run is filed under: read only where a tracker is on (any --report_to but none)
    **{name: ("report_to", ()) for name in ("project_name", "tags")},
    # DreamBooth: the class images and their loss count only with prior preservation; the prompt only for
    # --instance_data_dir (a --train_data_dir brings its own captions)
    **{name: ("with_prior_preservation", (True,)) for name in ("class_data_dir", "class_prompt", "prior_loss_weight")},
    "instance_prompt": ("instance_data_dir", ()),
    # a stream has no stored training split to cut or carve (--max_tokens/--max_steps and --stream_validation_docs)
    "max_train_samples": ("streaming", (False,)),
    "validation_split_percentage": ("streaming", (False,)),
    "group_by_length": ("streaming", (False,)),  # sorts stored rows; a stream's rows come in its own order
    "num_train_epochs": ("streaming", (False,)),  # a stream's length is --max_steps or --max_tokens
    # pushes during training, and the token (never saved): a later `push` reads the other Hub options from args.json
    **{name: ("push_to_hub", (True,)) for name in ("hub_token", "hub_strategy")},
    **{  # the anomaly watcher's settings: it runs only with --monitoring true
        name: ("monitoring", (True,))
        for name in (
            "loss_spike_threshold",
            "grad_norm_spike_threshold",
            "throughput_drop_ratio",
            "straggler_ratio",
            "on_anomaly",
        )
    },
}


def _readers() -> dict[str, tuple[str, ...]]:
    """Option -> the tasks that read it, from the tasks' rows (Task.reads_options): the options only some read."""
    readers: dict[str, list[str]] = {}
    for task, row in TASK_ROWS.items():
        for entry in row.reads_options:
            names = [f.name for f in dataclasses.fields(SECTIONS[entry])] if entry in SECTIONS else [entry]
            for name in names:
                readers.setdefault(name, []).append(task)
    return {name: tuple(tasks) for name, tasks in readers.items()}


def _training_table() -> dict[str, Use]:
    """When each option counts that a run may leave unused, in the order of the config's sections."""
    readers, table = _readers(), {}
    for name in option_fields():
        if name in STREAM_OPTIONS:
            table[name] = STREAMED
        elif name in readers or name in ENABLED_BY:
            table[name] = Use(readers.get(name, ()), *ENABLED_BY.get(name, ("", ())))
    return table


# option -> when it counts, for `cloudtrain train` (a Config)
TRAINING = _training_table()

OWN_MODULE = "own_module"  # the Python API's model= (ModuleTask): it reads none of the tasks' own options...
MODULE_READS = ("validation_split_percentage",)  # ...but these: it carves its validation rows as the tasks do

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
        wanted = _either(use.values) if use.values else _placeholder(use.needs)
        enabled = not use.needs or (
            values[use.needs] in use.values if use.values else values[use.needs] != defaults[use.needs]
        )
        condition = f" with --{use.needs} {wanted}" if use.needs else ""
        if use.tasks and known and task not in use.tasks and not (task == OWN_MODULE and name in MODULE_READS):
            others = set(TASK_ROWS) - set(use.tasks) - {task}
            tasks = "every other task" if not others else f"--task {_either(use.tasks)}"
            notes.append(f"{given} has no effect on {run}; it counts for {tasks}{condition}")
        elif not enabled:
            notes.append(f"{given} has no effect without --{use.needs} {wanted}")
    return notes


PLACEHOLDERS = {"report_to": "TRACKER"}  # an enabling option's value as a note writes it, where not N or FOLDER


def _placeholder(name: str) -> str:
    """What an enabling option with no fixed values takes, as --help would show it: FOLDER for a path, else N."""
    field = option_fields().get(name)
    if field is not None and field[1].metadata.get("path"):
        return "FOLDER"
    return PLACEHOLDERS.get(name, "N")


def inert_notes(cfg: Config, task: str | None = None) -> list[str]:
    """The notes of a training run: the options set in `cfg` that it will not use (`task`: default its --task)."""
    fields = option_fields()
    defaults = {name: option_default(f) for name, (_, f) in fields.items()}
    separators = {name: f.metadata["separator"] for name, (_, f) in fields.items()}
    values = cfg.to_dict(include_secrets=True)
    for name, (_, f) in fields.items():
        if f.metadata["secret"] and values.get(name) is not None:  # a note never shows a token
            values[name] = "<hidden>"
    return unused(TRAINING, values, defaults, task or cfg.training.task, separators)


def print_inert_notes(cfg: Config, task: str | None = None) -> None:
    """The notes of `inert_notes`, printed once per launch (by the process of rank 0; a launcher sets RANK), before
    the run loads anything: the command line's and train(...)'s way in."""
    if int(os.environ.get("RANK", "0")) == 0:
        for note in [*inert_notes(cfg, task), *job_notes(cfg.output.output_dir)]:
            print(f"note: {note}", flush=True)


def as_typed(name: str, value: Any) -> str:
    """An option as the notes show it: --name value, the value quoted for the shell and cut where long."""
    return f"--{name} {_shown(value)}"


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
