"""Where names given on the command line meet classes: one registry per axis (`--task`, `--training_type`).

A class registers itself once, by its `name`, with `@TASKS.register` or `@TRAINERS.register`; its package's
`__init__` imports its module. Everything else (the planner, the model card, generation) asks the registered
classes, so no other module compares task or trainer names.
The parser (choices, help, best-metric defaults) reads each class's row in cloudtrain.registry_table instead,
so `--help` and a refused option import no task or trainer (which import transformers, datasets and
torch.distributed). A class is imported only when it is asked for by name or the registry is iterated.
"""

import importlib
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from cloudtrain.registry_table import TASK_ROWS, TRAINER_ROWS, Row

T = TypeVar("T")


def row_of(cls: Any) -> Row:
    """The row a registered class answers for itself: what its entry in cloudtrain.registry_table must say."""
    metrics = tuple(getattr(cls, "metrics", ()))
    streams = cls.stream_records if getattr(cls, "streams_data", False) else None
    best, reads = getattr(cls, "default_best_metric", None), tuple(getattr(cls, "reads_options", ()))
    parallel = (bool(getattr(cls, f"{kind}_parallel", False)) for kind in ("tensor", "context"))
    return Row(cls.__module__, cls.summary, metrics, best, streams, reads, getattr(cls, "predicts", None), *parallel)


class Registry(Generic[T]):
    """Classes by name, in registration order; `package` is imported (registering its classes) on first use.
    `table` holds the package's own classes' rows, read without importing them."""

    def __init__(self, flag: str, package: str, table: dict[str, Row]):
        self.flag, self.package, self.table = flag, package, table
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        name = cls.name  # type: ignore[attr-defined]
        if name in self._classes and self._classes[name] is not cls:
            raise ValueError(f"{self.flag} {name!r} is registered twice: {self._classes[name]} and {cls}")
        if name in self.table and self.table[name] != row_of(cls):
            # the parser would describe (and accept) something else than the class does
            raise ValueError(
                f"{self.flag} {name!r}: {row_of(cls)} differs from its row in cloudtrain/registry_table.py "
                f"({self.table[name]}); update the row"
            )
        self._classes[name] = cls
        return cls

    def _loaded(self) -> dict[str, type[T]]:
        importlib.import_module(self.package)
        return self._classes

    def rows(self) -> dict[str, Row]:
        """Every name's row, importing nothing: the table's, then those of classes registered beyond it (an
        extension registered at run time, as docs/extending.md shows)."""
        extra = {name: row_of(cls) for name, cls in self._classes.items() if name not in self.table}
        return {**self.table, **extra}

    def names(self) -> tuple[str, ...]:
        return tuple(self.rows())

    def __getitem__(self, name: str) -> type[T]:
        classes = self._loaded()
        if name not in classes:
            raise KeyError(f"{self.flag} {name!r} is not one of {', '.join(classes)}")
        return classes[name]

    def __iter__(self) -> Iterator[type[T]]:
        return iter(self._loaded().values())


TASKS: Registry = Registry("--task", "cloudtrain.tasks", TASK_ROWS)
TRAINERS: Registry = Registry("--training_type", "cloudtrain.training", TRAINER_ROWS)
