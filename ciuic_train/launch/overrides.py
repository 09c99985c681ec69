"""Values on a Hydra command line: how a launcher passes a path to the processes it starts."""

from __future__ import annotations

import re


def quote_override(value: str) -> str:
    """A value that Hydra's override parser reads back verbatim (paths may hold spaces or '=').

    In a quoted value Hydra reads a backslash as itself, except in a run right before a
    quote or the closing quote: there each pair stands for one, and an odd one escapes the quote.
    """
    escaped = re.sub(r"(\\*)('|\Z)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), value)
    return f"'{escaped}'"
