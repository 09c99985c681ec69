"""Training tricks: each module in this package defines one `Trick` subclass.

The registry is built by importing every module here, so adding a trick is adding one
file (plus its `conf/trick/<name>.yaml`); nothing else in the trainer changes. Where a
trick hooks in, and how, is in `base.py`.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from functools import lru_cache
from typing import Any, Mapping

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ciuic_train.errors import UserError
from ciuic_train.tricks.base import CommHook, Trick, TrickContext, TrickSet, refuse_seam_conflicts


@lru_cache(maxsize=None)
def registry() -> dict[str, type[Trick]]:
    found: dict[str, type[Trick]] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name == "base":
            continue
        loaded = importlib.import_module(f"{__name__}.{module.name}")
        for value in vars(loaded).values():
            if isinstance(value, type) and issubclass(value, Trick) and value.__module__ == loaded.__name__:
                found[value.name] = value
    return found


def trick_classes(selected: Mapping[str, Any]) -> list[type[Trick]]:
    """The classes of the selected tricks, in a stable order; unknown names are user errors."""
    available = registry()
    unknown = sorted(set(selected) - set(available))
    if unknown:
        valid = ", ".join(sorted(available)) or "none yet"
        raise UserError(f"unknown trick {unknown[0]!r}; available tricks: {valid}")
    return [available[name] for name in sorted(selected)]


def seam_owner(selected: Mapping[str, Any], seam: str) -> str | None:
    """The selected trick that replaces `seam`, or None (two never do: `check_tricks`)."""
    return next((cls.name for cls in trick_classes(selected) if seam in cls.claimed_seams()), None)


def parse_params(cls: type[Trick], values: Mapping[str, Any] | None) -> Any:
    """A trick's typed parameters: a misspelt or mistyped `trick.<name>.<param>` fails here."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls.Params), dict(values or {}))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = f"trick.{cls.name}.{err.key}" if getattr(err, "key", None) else f"trick.{cls.name}"
        allowed = ", ".join(f.name for f in dataclasses.fields(cls.Params)) or "none"
        reason = str(err).strip().splitlines()[0]
        raise UserError(f"{key}: {reason}; parameters of {cls.name}: {allowed}") from None
    except ValueError as err:  # a Params.__post_init__ check
        raise UserError(f"trick.{cls.name}: {err}") from None


def check_tricks(selected: Mapping[str, Any]) -> None:
    """Everything about the trick selection that can be checked before any process starts."""
    classes = trick_classes(selected)
    for cls in classes:
        parse_params(cls, selected[cls.name])
    refuse_seam_conflicts(classes)


def build_tricks(selected: Mapping[str, Mapping[str, Any]], ctx: TrickContext) -> TrickSet:
    """Instantiate the selected tricks (config `trick.<name>.<param>`)."""
    return TrickSet([cls(ctx, parse_params(cls, selected[cls.name])) for cls in trick_classes(selected)], ctx)


__all__ = ["CommHook", "Trick", "TrickContext", "TrickSet", "build_tricks", "check_tricks", "registry"]
