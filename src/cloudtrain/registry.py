"""Where names given on the command line meet classes: one registry per axis (`--task`, `--training_type`).

A class registers itself once, by its `name`, with `@TASKS.register` or `@TRAINERS.register`; its package's
`__init__` imports its module. Everything else (the config's choices, best-metric defaults, the planner, the
model card, generation) asks the registered classes, so no other module compares task or trainer names.
This module imports nothing itself; asking a registry for its names imports its package (and so torch), which the
config does when it checks or describes --task and --training_type.
"""

import importlib
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes by name, in registration order; `package` is imported (registering its classes) on first use."""

    def __init__(self, flag: str, package: str):
        self.flag, self.package = flag, package
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        name = cls.name  # type: ignore[attr-defined]
        if name in self._classes and self._classes[name] is not cls:
            raise ValueError(f"{self.flag} {name!r} is registered twice: {self._classes[name]} and {cls}")
        self._classes[name] = cls
        return cls

    def _loaded(self) -> dict[str, type[T]]:
        importlib.import_module(self.package)
        return self._classes

    def names(self) -> tuple[str, ...]:
        return tuple(self._loaded())

    def __getitem__(self, name: str) -> type[T]:
        classes = self._loaded()
        if name not in classes:
            raise KeyError(f"{self.flag} {name!r} is not one of {', '.join(classes)}")
        return classes[name]

    def __iter__(self) -> Iterator[type[T]]:
        return iter(self._loaded().values())


TASKS: Registry = Registry("--task", "cloudtrain.tasks")
TRAINERS: Registry = Registry("--training_type", "cloudtrain.training")
