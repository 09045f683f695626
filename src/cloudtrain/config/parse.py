"""From flags, config files and a SageMaker job to one checked `Config`.

Values come from, lowest precedence first: the defaults, the SageMaker training-job contract (when running
inside a job), a YAML or JSON file given with `--config` (flat `key: value` pairs, or grouped under the
section names), and command-line flags. Every boolean also takes an explicit value (`--fp16 true`), as
SageMaker passes hyperparameters. A config file may start from another: `extends: base.yaml` (a path relative
to the extending file) reads that file first, and the extending file's values win; chains work, cycles are
refused. Values keep no type a field does not have: a list where a number belongs, 2.5 for a whole number,
true for a number and nan or infinities for any number are refused in one line.
"""

import argparse
import contextlib
import dataclasses
import difflib
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from cloudtrain.config.checks import validate
from cloudtrain.config.root import Config, differs_from_default, option_default, option_fields
from cloudtrain.errors import UserError, first_line
from cloudtrain.sagemaker_env import sagemaker_defaults, unjoined_hosts, unread_channel, yielded_channel

# Other trainers' names for our options (Transformers' Trainer, TRL, PEFT): a user coming from them is told ours.
PEER_OPTIONS = {
    "num_epochs": "num_train_epochs", "epochs": "num_train_epochs", "lr": "learning_rate",
    "per_gpu_train_batch_size": "per_device_train_batch_size", "train_batch_size": "per_device_train_batch_size",
    "batch_size": "per_device_train_batch_size", "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "eval_batch_size": "per_device_eval_batch_size", "evaluation_strategy": "eval_strategy",
    "save_steps": "checkpointing_steps", "fp16": "mixed_precision fp16", "bf16": "mixed_precision bf16",
    "max_seq_length": "max_length", "max_seq_len": "max_length", "dataset_text_field": "text_column",
    "lora_rank": "lora_r", "target_modules": "lora_target_modules", "use_peft": "peft lora",
    "deepspeed": "deepspeed_config", "model_name": "model_name_or_path", "tokenizer_name": "tokenizer_name_or_path",
    "label_smoothing_factor": "label_smoothing",
}  # fmt: skip
NOT_NEEDED = {
    "do_train": "a run always trains",
    "do_eval": "evaluation follows --eval_strategy",
    "do_predict": "a --test_file is evaluated after training",
    "config": "a config file starts from another with extends: <file>",  # not --model_config, the nearest name
}


def unknown_option_hint(name: str, known: list[str], flag: str = "") -> str:
    """What to write instead of the unknown option `name`, as '; ...' (or ''): cloudtrain's name for another
    trainer's option, else the closest of `known`; `flag` is "--" on the command line."""
    if name == "config" and flag:  # a command's line without --config (plan, predict, generate, preprocess)
        return "; this command reads no config file: give its options as flags"
    if name in NOT_NEEDED:
        return f"; not needed: {NOT_NEEDED[name]}"
    target = PEER_OPTIONS.get(name)
    if target is None or target.split()[0] not in known:
        target = next(iter(difflib.get_close_matches(name, known, n=1)), None)
    return f"; did you mean {flag}{target}?" if target else ""


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _meta(f: dataclasses.Field, key: str) -> Any:
    """A field's help or choices (read from a registry when given as a function)."""
    value = f.metadata[key]
    return value() if callable(value) else value


def _base_type(f: dataclasses.Field) -> type:
    tp: Any = f.type  # a type, or its name as a string
    if isinstance(tp, types.UnionType):  # `X | None`, or `int | str` for an option that also takes auto
        tp = next(t for t in typing.get_args(tp) if t is not type(None))
    return tp


# options whose absence picks a default (the built-in data, the default model, a folder named after them): an
# empty value is a mistake, not that default
GIVEN_OR_LEFT_OUT = ("train_file", "dataset_name", "model_name_or_path", "output_dir", "tokenizer_name_or_path")


def _coerce(name: str, value: Any) -> Any:
    """Turn a value from the command line or a config file into the field's type, or raise UserError."""
    _, f = option_fields()[name]
    tp = _base_type(f)
    optional = type(None) in typing.get_args(f.type)
    if f.metadata["auto"] and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if name in GIVEN_OR_LEFT_OUT and isinstance(value, str) and not value.strip():
        raise UserError(
            f"--{name} is empty (an unset shell variable?); give its value, or leave it out for the default"
        )  # else the run trained on the built-in data, or the default model, without a word
    if isinstance(value, bool) and tp is str:  # YAML reads an unquoted no, off, yes or on as a boolean
        if value is False and "no" in (_meta(f, "choices") or []):
            return "no"
        word = str(value).lower()
        raise UserError(f"--{name}: got {word} (YAML reads an unquoted yes, no, on or off as {word}); quote the value")
    try:
        # `none`/`null` unsets any `X | None` option (so a SageMaker hyperparameter can turn off a default);
        # for a required option it is an ordinary value, like `--report_to none`.
        if value is None or (
            isinstance(value, str) and value.strip().lower() in ("none", "null") and (optional or tp not in (str, list))
        ):
            if optional:
                return None
            raise ValueError("a value is required")
        if f.metadata["mappings"] and isinstance(value, str) and value.lstrip().startswith("["):
            value = json.loads(value)  # a list as JSON text: a SageMaker hyperparameter (sagemaker/launch.py)
        elif tp is list and isinstance(value, str) and value.lstrip().startswith("["):
            value = _json_list(value)
        value = _convert(tp, value, f.metadata["separator"], f.metadata["mappings"])
    except (ValueError, TypeError) as err:  # TypeError: int([1, 2]), a config file's list where a number belongs
        kind = "true, false" if tp is bool else "a number"
        reason = f"expected {kind} or auto, got {value!r}" if f.metadata["auto"] else str(err)
        raise UserError(f"--{name}: {reason}") from None
    choices = _meta(f, "choices")
    for item in value if isinstance(value, list) else [value]:
        if choices and item not in choices:
            raise UserError(f"--{name}: {item!r} is not one of {', '.join(map(str, choices))}")
    return _home(value) if f.metadata["path"] else value


def _home(value: Any) -> Any:
    """A path option with a leading ~ expanded, as the shell does only at a word's start: not in a config file nor
    after `=` (`--output_dir=~/run` made a folder named ~); each of a comma-separated list of sources, and a
    `datasets:` entry's path."""
    if isinstance(value, list):
        return [_home(item) for item in value]
    if isinstance(value, dict):
        return {**value, "path": _home(value["path"])} if isinstance(value.get("path"), str) else value
    if not isinstance(value, str) or "~" not in value:
        return value
    return ",".join(os.path.expanduser(p.strip()) if p.strip().startswith("~") else p for p in value.split(","))


def _json_list(text: str) -> Any:
    """A list option's value written as a JSON list (the SageMaker SDK's form of a Python list hyperparameter: it
    was split at its commas, brackets and quotes kept); other text is the option's own."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    plain = isinstance(value, list) and all(isinstance(item, (str, int, float)) for item in value)
    return value if plain else text  # a list of mappings is a value's own text (a chat as a sample prompt)


def _convert(tp: type, value: Any, separator: str, mappings: bool = False) -> Any:
    """`value` as type `tp`. A config file's value keeps its YAML type, so what Python would convert silently is
    refused here: a list or mapping for a single value (str([1, 2]) is a string), true for a number (int(True) is
    1), 2.5 for a whole number (int(2.5) is 2); and a float must be finite (nan passes every `<= 0` check)."""
    if tp is bool:
        return parse_bool(value)
    if tp is list:
        if isinstance(value, dict):
            raise ValueError(f"expected a list, got a mapping {value!r}")
        items = value if isinstance(value, list) else [value]
        if not mappings and any(isinstance(item, (dict, list)) for item in items):
            raise ValueError(f"expected a list of values, got {value!r}")
        # a mapping in a config file's list (a `datasets:` entry) stays a mapping; strings split at the separator
        parts = [[item] if isinstance(item, dict) else str(item).split(separator) for item in items]
        return [p if isinstance(p, dict) else p.strip() for ps in parts for p in ps if isinstance(p, dict) or p.strip()]
    if isinstance(value, (list, tuple, dict)):
        kind = "a mapping" if isinstance(value, dict) else "a list"
        raise TypeError(f"expected one {_type_word(tp)}, got {kind} {value!r}")
    if tp in (int, float) and isinstance(value, bool):
        raise TypeError(f"expected a {_type_word(tp)}, got {str(value).lower()}")
    if tp is int and isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected a whole number, got {value!r}")
        return int(value)
    try:
        converted = tp(value)
    except ValueError:  # int('two'): Python's wording names int(), not what the option takes
        if tp not in (int, float):
            raise
        raise ValueError(f"expected a {_type_word(tp)}, got {value!r}") from None
    if tp is float and not math.isfinite(converted):
        raise ValueError(f"expected a finite number, got {value!r}")
    return converted


def _type_word(tp: type) -> str:
    return {int: "whole number", float: "number", str: "value"}.get(tp, tp.__name__)


PATH_ENDINGS = ("_dir", "_file", "_path", "_or_path")  # a command's options that name a file or folder


class ConfigParser(argparse.ArgumentParser):
    """argparse that reports mistakes as one line instead of usage + error, and takes no abbreviations."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def parse_known_args(  # type: ignore[override]  # one of typeshed's overloads: the one argparse calls
        self, args: typing.Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """argparse reports a missing required option before an unknown one, yet a mistyped required option
        (`--modeldir x` for `--model_dir`) is both, and the unknown one is the cause: it is checked first."""
        required = self._required = [action for action in self._actions if action.required]
        for action in required:
            action.required = False
        try:
            parsed, extras = super().parse_known_args(args, namespace)
        finally:
            for action in required:
                action.required = True
        if any(word.startswith("--") for word in extras):
            return parsed, extras  # parse_args reports them, with the did-you-mean
        missing = [action for action in required if getattr(parsed, action.dest, None) is None]
        if missing:
            names = ", ".join("/".join(action.option_strings) or action.dest for action in missing)
            self.error(f"the following arguments are required: {names}")
        for name, value in vars(parsed).items():  # a command's paths (a training option's again in _coerce)
            if name.endswith(PATH_ENDINGS):
                setattr(parsed, name, _home(value))
        return parsed, extras

    def format_usage(self) -> str:
        with self._as_declared():
            return super().format_usage()

    def format_help(self) -> str:
        with self._as_declared():
            return super().format_help()

    @contextlib.contextmanager
    def _as_declared(self) -> typing.Iterator[None]:
        """--help, asked while parse_known_args holds the required options optional, shows them required (its
        usage line bracketed --model_dir as optional; found in audit)."""
        held = [action for action in getattr(self, "_required", []) if not action.required]
        for action in held:
            action.required = True
        try:
            yield
        finally:
            for action in held:
                action.required = False

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            known = [o[2:] for o in self._option_string_actions if o.startswith("--")]
            unknown = [w[2:].split("=")[0] for w in message.split(":", 1)[1].split() if w.startswith("--")]
            message += "".join(unknown_option_hint(name, known, "--") for name in unknown[:1])
        raise UserError(f"{message} (see {self.prog} --help)")


def _help(f: dataclasses.Field) -> str:
    text, choices = _meta(f, "help"), _meta(f, "choices")
    if choices:
        text += f" Choices: {', '.join(map(str, choices))}."
    default = option_default(f)
    if default not in (None, []) and not f.metadata["secret"]:
        shown = str(default).lower() if isinstance(default, bool) else default  # true|false, as a flag is typed
        text += f" (default: {','.join(default) if isinstance(default, list) else shown})"
    return text.replace("%", "%%")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, grouped by section; unset flags stay out of the namespace."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        action="append",
        default=argparse.SUPPRESS,
        help="YAML or JSON file of options; flags given on the command line override it. Given again, each file "
        "overrides the ones before it. A file may start from another with `extends: <file>` (a path relative to it).",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, (section, f) in option_fields().items():
        group = groups.setdefault(section, parser.add_argument_group(f"{section} options"))
        group.add_argument(f"--{name}", default=argparse.SUPPRESS, **_flag(f))


def _flag(f: dataclasses.Field) -> dict[str, Any]:
    """The argparse keywords every flag of field `f` shares: its help, and how its value is shown."""
    kwargs: dict[str, Any] = dict(help=_help(f), metavar=_base_type(f).__name__.upper())
    if _base_type(f) is bool:
        kwargs.update(nargs="?", const="true", metavar="true|false|auto" if f.metadata["auto"] else "true|false")
    elif _meta(f, "choices"):
        kwargs["metavar"] = "{" + ",".join(map(str, _meta(f, "choices"))) + "}"
    elif f.metadata["auto"]:
        kwargs["metavar"] = f"{kwargs['metavar']}|auto"
    return kwargs


def add_config_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str) -> None:
    """The flag of option `name` alone, for a command that shares some of the training options (`plan`): the same
    help, choices and default as the application's, the value converted and checked as the application does."""
    _, f = option_fields()[name]
    default = option_default(f)
    parser.add_argument(f"--{name}", default=default, type=lambda value: _coerce(name, value), **_flag(f))


def load_config_file(path: str, _chain: tuple[Path, ...] = (), origins: dict[str, str] | None = None) -> dict:
    """Read a YAML/JSON config file into flat {flag name: value}, over the options of the file it `extends`.
    `_chain`: the files that extend this one, nearest last (a cycle is refused); `origins`, where given, gets
    option -> the file whose value won (this one, or the one it extends)."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise UserError(f"config file {path} is a folder; give a YAML or JSON file")
    if not file.is_file():
        raise UserError(f"config file {path} does not exist")
    chain = (*_chain, file)
    if file.resolve() in {f.resolve() for f in _chain}:
        raise UserError(f"config files extend each other in a cycle: {' -> '.join(map(str, chain))}")
    try:
        data = yaml.load(file.read_text(encoding="utf-8"), Loader=_UniqueKeys) or {}  # YAML is a superset of JSON
    except yaml.YAMLError as err:
        raise UserError(f"config file {path} is not valid YAML/JSON: {_yaml_problem(err)}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"could not read config file {path} (UTF-8 YAML or JSON): {first_line(err)}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold key: value pairs")
    return with_bases(data, file.parent, chain, f"config file {path}", origins, path)


class _UniqueKeys(yaml.SafeLoader):
    """safe_load's loader, refusing a key given twice in one mapping: PyYAML keeps the last silently, and a
    section written twice lost every option of its first copy."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be given again here
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if not isinstance(key, typing.Hashable):  # PyYAML's own error says so, in one line
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice (first at line {seen[key] + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's complaint in one line, with where it is: its str() spreads the problem and the construct it was
    reading (the context) over several lines, each with its own mark; line and column count from 1, as an
    editor's do."""
    if not isinstance(err, yaml.MarkedYAMLError):
        return first_line(err)

    def at(mark: typing.Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    problem = err.problem or err.context or "invalid"
    where = err.problem_mark or err.context_mark
    text = f"{at(where)}: {problem}" if where is not None else problem
    if err.problem and err.context:
        text += f" ({err.context}" + (f" at {at(err.context_mark)}" if err.context_mark is not None else "") + ")"
    return text


def with_bases(
    data: dict,
    folder: Path,
    chain: tuple[Path, ...] = (),
    origin: str = "the config",
    origins: dict[str, str] | None = None,
    file: str | None = None,
) -> dict:
    """flatten(data) over the options of the config file it names with `extends` (a path relative to `folder`,
    the extending file's own), which may extend another in turn; the extending file's values win. `origins`
    (where given) gets option -> the file that set it: `file` for data's own, the base's path for the rest."""
    data = dict(data)
    base = data.pop("extends", None)
    values = flatten(data, origin)
    if base is None:
        _record(origins, values, file)
        return values
    if not isinstance(base, str) or not base.strip():
        raise UserError(f"{origin}: extends takes the path of one config file, got {base!r}")
    base_file = folder / Path(base).expanduser()
    if not base_file.is_file():
        raise UserError(f"{origin} extends {base}, which does not exist ({base_file})")
    inherited = load_config_file(str(base_file), chain, origins)
    _record(origins, values, file)
    return {**inherited, **values}


def _record(origins: dict[str, str] | None, values: dict, file: str | None) -> None:
    """Note `file` as where each of `values` was set (a later, nearer file's values overwrite a base's)."""
    if origins is not None and file is not None:
        origins.update(dict.fromkeys(values, file))


def check_name(key: object, origin: str, where: str = "") -> None:
    """A key YAML read as a value (on, yes, no, a number) is no option name: said in one line."""
    if not isinstance(key, str):
        raise UserError(
            f"{origin}: {key!r}{where} is not an option name (YAML reads on, yes, no and numbers as values); quote it"
        )


def flatten(data: dict, origin: str = "the config") -> dict:
    """{flag name: value} from options given flat or grouped under their section names. A section holds its own
    options only: an option under another section's name is a mistake (the file's reader would look for it
    there), refused naming the section it belongs to; unknown names are left to build_config's hints."""
    sections = {f.name for f in dataclasses.fields(Config)}
    known = option_fields()
    flat = {}
    for key, value in data.items():
        check_name(key, origin)
        if key in sections and value is None:  # a section whose options are all commented out
            value = {}
        if key in sections and isinstance(value, dict):
            for name in value:
                check_name(name, origin, f" under {key}")
                home = known[name][0] if name in known else key
                if home != key:
                    raise UserError(
                        f"{origin}: {name} belongs to the {home} section, not {key}; move it under {home}: "
                        "(or to the top level)"
                    )
            twice = next((name for name in value if name in flat), None)
            if twice is not None:
                raise UserError(f"{origin}: {twice} is given both at the top level and under {key}; keep one")
            flat.update(value)
        else:
            if key in flat:
                home = known[key][0] if key in known else "its section"
                raise UserError(f"{origin}: {key} is given both under {home} and at the top level; keep one")
            flat[key] = value
    return flat


def build_config(values: dict) -> Config:
    """A Config from flat {flag name: value}; unknown names get a 'did you mean' hint."""
    known = option_fields()
    sections: dict[str, dict] = {s.name: {} for s in dataclasses.fields(Config)}
    for name, value in values.items():
        if name not in known:
            section = difflib.get_close_matches(name, list(sections), n=1) if isinstance(value, dict) else []
            hint = f"; did you mean the section {section[0]}?" if section else unknown_option_hint(name, list(known))
            if name in sections:  # `model: gpt2`: a section given a value
                own = [n for n, (home, _) in known.items() if home == name][:3]
                hint = f"; {name} is a section: give its options under it ({', '.join(own)}, ...)"
            raise UserError(f"unknown option {name!r}{hint or '; see --help for the options'}")
        sections[known[name][0]][name] = _coerce(name, value)
    hints = typing.get_type_hints(Config)
    return Config(**{name: hints[name](**kw) for name, kw in sections.items()})


def config_from_namespace(namespace: argparse.Namespace) -> Config:
    """Merge defaults < --config file < command-line flags, then check the values."""
    given = vars(namespace).copy()
    return resolve_options(given.pop("config", None), {k: v for k, v in given.items() if k in option_fields()})


def resolve_options(config: "Config | dict | str | Path | list | None", overrides: dict) -> Config:
    """Options from lowest precedence up, merged and checked: the defaults, a SageMaker job's, `config` (a
    Config, a dict of options, a config file's path or a list of them, each over the ones before: cloudtrain.train,
    --config), then `overrides`."""
    defaults = sagemaker_defaults()  # inside a SageMaker job: its model dir, data channels, job name
    values = dict(defaults)
    origins: dict[str, str] = {}  # option -> the config file its value came from, named in a refusal of it
    if isinstance(config, Config):  # every option is set in it: those left at their defaults keep the job's
        given = config.to_dict(include_secrets=True)
        values.update({k: v for k, v in given.items() if k not in values or differs_from_default(config, k)})
    elif isinstance(config, dict):
        values.update(with_bases(config, Path.cwd()))
    elif config is not None:
        for file in config if isinstance(config, list) else [config]:
            values.update(load_config_file(str(file), origins=origins))
    given = flatten(overrides)
    values.update(given)
    for name in given:
        origins.pop(name, None)
    for name in yielded_channel(defaults, values):  # the train channel, where datasets: or --dataset_name name data
        del values[name]
    files = [str(f) for f in (config if isinstance(config, list) else [config]) if isinstance(f, (str, Path))]
    if refusal := unread_channel(values, read=files) or unjoined_hosts():  # a channel that holds the config is read
        raise UserError(refusal)
    try:
        resolved = build_config(values)
        validate(resolved)
    except UserError as err:
        raise UserError(_naming_file(str(err), origins)) from None
    return resolved


def _naming_file(message: str, origins: dict[str, str]) -> str:
    """A refusal of an option whose value a config file gave says which file (the user looks there, not at the
    command line): the first `--name` in the message that came from a file."""
    for flag, unknown in re.findall(r"--(\w+)|unknown option '(\w+)'", message):
        if (name := flag or unknown) in origins:
            return f"{message} ({name if unknown else '--' + name} is set in {origins[name]})"
    return message
