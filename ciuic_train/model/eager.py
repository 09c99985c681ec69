"""Functions a compiled block must call eagerly, without importing dynamo in every process.

`@torch.compiler.disable` imports `torch._dynamo` where it is applied, at import time:
about half a second of every process's start-up (each rank of each run, each test), for
runs that mostly never compile. `kept_eager` marks a function the same way but applies
`torch.compiler.disable` only in `prepare_compile`, which `parallelize` calls before it
compiles the first block (`compile=true`); until then the function is called as it is.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

# (the function, a list that `prepare_compile` fills with its disabled twin)
_MARKED: list[tuple[Callable, list[Callable]]] = []


def kept_eager(fn: F) -> F:
    """`fn`, run eagerly between the graphs of a compiled caller (a graph break), as
    `torch.compiler.disable` would, once `prepare_compile` has run."""
    disabled: list[Callable] = []
    _MARKED.append((fn, disabled))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if disabled and torch.compiler.is_compiling():
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def prepare_compile() -> None:
    """Before the first `torch.compile`: every `kept_eager` function gets its disabled twin."""
    for fn, disabled in _MARKED:
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
