"""Mistakes as one line a user can act on, and the exit that follows.

Hydra and OmegaConf describe a configuration mistake in their own terms, over several
lines; `as_user_errors` turns each into a `UserError` that names the key or option, the
valid ones, and the likeliest meant (did you mean ...?). `fail` prints such a line and
exits with status 2 (or the status given).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import typing
from difflib import get_close_matches
from typing import Any, Iterator

from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from ciuic_train.cli.flags import PROG
from ciuic_train.config import Config
from ciuic_train.errors import ERROR_LINE_PREFIX, UserError, first_line
from ciuic_train.environment import launcher_rank


def fail(message: str, status: int = 2) -> None:
    """Report a mistake in one line and exit; under torchrun only rank 0 speaks."""
    if is_rank_0():
        print_error(message)
    sys.exit(status)


def print_error(message: str) -> None:
    """The one shape of every error line the command prints: `ciuic-train: error: ...`."""
    print(f"{ERROR_LINE_PREFIX}{message}", file=sys.stderr)


def print_warning(message: str) -> None:
    """A warning found before Hydra runs (no log exists yet), in the shape of the error lines."""
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def is_rank_0() -> bool:
    return launcher_rank() == 0


@contextlib.contextmanager
def as_user_errors() -> Iterator[None]:
    """Hydra's and OmegaConf's composition errors, as one line a user can act on."""
    try:
        yield
    except MissingConfigException as err:
        raise UserError(_unknown_option(err)) from None
    except OmegaConfBaseException as err:
        raise UserError(_describe_omegaconf(err)) from None
    except HydraException as err:
        cause = err.__cause__
        if isinstance(cause, OmegaConfBaseException):
            raise UserError(_describe_omegaconf(cause)) from None
        raise UserError(first_line(err)) from None


def _unknown_option(err: MissingConfigException) -> str:
    """`model=tyny` -> name the group, the bad option and the valid ones."""
    missing = getattr(err, "missing_cfg_file", None) or ""
    options = list(err.options or [])
    group, _, option = missing.rpartition("/")
    if not group:
        return first_line(err)
    if not options:
        options = GlobalHydra.instance().config_loader().get_group_options(group)
    hint = get_close_matches(option, options, n=1)
    valid = ", ".join(options) if options else "none yet"
    return (
        f"unknown {group} {option!r}"
        + (f" (did you mean {hint[0]!r}?)" if hint else "")
        + f"; available: {valid}"
    )


def _describe_omegaconf(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or ""
    msg = first_line(getattr(err, "msg", None) or str(err))
    name = type(err).__name__
    if name in ("ConfigKeyError", "ConfigAttributeError") and key:
        parent, _, leaf = str(key).rpartition(".")
        if parent == "trick":  # trick.NAME.PARAM=... where +trick=NAME was not given
            return _unselected_trick(leaf)
        allowed = _schema_keys(parent)
        if allowed is not None:
            hint = get_close_matches(leaf, allowed, n=1)
            return (
                f"unknown config key {key!r}"
                + (f" (did you mean {(parent + '.' if parent else '') + hint[0]!r}?)" if hint else "")
                + f"; valid keys{' in ' + repr(parent) if parent else ''}: {', '.join(allowed)}"
            )
    if name == "MissingMandatoryValue" and key:
        return f"{key} must be set (add {key}=...)"
    return f"{key}: {msg}" if key and key not in msg else msg


def _unselected_trick(name: str) -> str:
    from ciuic_train.tricks import registry

    tricks = sorted(registry())
    if name in tricks:
        return (f"trick.{name} sets a parameter of a trick this run does not select; "
                f"add +trick={name} (several: '+trick=[a,b]')")
    hint = get_close_matches(name, tricks, n=1)
    return (f"unknown trick {name!r} in trick.{name}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + f"; available: {', '.join(tricks)}")


def _schema_keys(path: str) -> list[str] | None:
    """The keys the schema allows under a dotted path, or None if that is not a typed section."""
    parts = [p for p in path.split(".") if p]
    if len(parts) == 2 and parts[0] == "trick":
        from ciuic_train.tricks import registry

        cls = registry().get(parts[1])
        return [f.name for f in dataclasses.fields(cls.Params)] if cls else None
    node: Any = Config
    for part in parts:
        node = typing.get_type_hints(node).get(part)
        if not dataclasses.is_dataclass(node):
            return None
    return [f.name for f in dataclasses.fields(node)]
