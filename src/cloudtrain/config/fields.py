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


class OnlyFields:
    """A config whose attributes are its fields only: `cfg.training.learning_rat = 0.5` was taken without a word
    and the run trained at the default rate."""

    def __setattr__(self, name: str, value: Any) -> None:
        fields = self.__dataclass_fields__  # type: ignore[attr-defined]
        if name in fields:  # (every field each config is built with: nothing more here)
            object.__setattr__(self, name, value)
            return
        import difflib

        from cloudtrain.config.root import option_fields

        section = option_fields().get(name, ("",))[0]
        close = difflib.get_close_matches(name, list(fields), n=1)
        hint = f"; it is an option of cfg.{section}" if section else f"; did you mean {close[0]}?" if close else ""
        raise AttributeError(f"{type(self).__name__} has no option {name!r}{hint}")
