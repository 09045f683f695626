"""`opt`: a config field with its help text, choices and how it is parsed."""

from collections.abc import Callable
from dataclasses import field
from typing import Any


def opt(
    default: Any,
    help: str | Callable[[], str],
    choices: tuple | Callable[[], tuple] | None = None,
    secret: bool = False,
    separator: str = ",",
    auto: bool = False,
    path: bool = False,
    mappings: bool = False,
) -> Any:
    """A config field with its help text; `secret` keeps it out of saved arguments and logs; a list option's
    items are split at `separator` when given as one string; `auto` also takes the word auto; `path`: a file or
    folder (a leading ~ is the home folder); `mappings`: a list whose items may be mappings, also given as JSON
    text. `help` and `choices` may be functions, read when needed: those a registry (cloudtrain.registry) answers."""
    kind = dict(default_factory=lambda: list(default)) if isinstance(default, list) else dict(default=default)
    metadata = {
        "help": help,
        "choices": choices,
        "secret": secret,
        "separator": separator,
        "auto": auto,
        "path": path,
        "mappings": mappings,
    }
    return field(**kind, metadata=metadata)
