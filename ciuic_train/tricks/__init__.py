"""Training tricks: each module in this package defines one `Trick` subclass.

The registry is built by importing every module here, so adding a trick is adding one
file (plus its `conf/trick/<name>.yaml`); nothing else in the trainer changes.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Mapping

from ciuic_train.errors import UserError
from ciuic_train.tricks.base import Trick, TrickContext, TrickSet


def registry() -> dict[str, type[Trick]]:
    found: dict[str, type[Trick]] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name == "base":
            continue
        loaded = importlib.import_module(f"{__name__}.{module.name}")
        for value in vars(loaded).values():
            if isinstance(value, type) and issubclass(value, Trick) and value is not Trick:
                found[value.name] = value
    return found


def build_tricks(selected: Mapping[str, Mapping[str, Any]], ctx: TrickContext) -> TrickSet:
    """Instantiate the selected tricks (config `trick.<name>.<param>`) in a stable order."""
    available = registry()
    tricks = []
    for name in sorted(selected):
        if name not in available:
            valid = ", ".join(sorted(available)) or "none yet"
            raise UserError(f"unknown trick {name!r}; available tricks: {valid}")
        tricks.append(available[name](ctx, **dict(selected[name] or {})))
    return TrickSet(tricks, ctx)


__all__ = ["Trick", "TrickContext", "TrickSet", "build_tricks", "registry"]
