"""The exceptions that end a run with one line instead of a traceback."""

# Exit status of a run that stopped itself and said why (RunFailed); 2 is a user mistake.
RUN_FAILED_STATUS = 3
# How every error line the command prints starts (cli/messages.py prints them; a launcher
# that started a process reads them back from its output).
ERROR_LINE_PREFIX = "ciuic-train: error: "


def first_line(err: object) -> str:
    """An error's message in one line (its type's name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class UserError(Exception):
    """A bad value, path or combination in what the user asked for."""


class RunFailed(Exception):
    """The run cannot go on and says why in one line: it diverged, or it cannot save.

    Raised on every rank together (the ranks agreed first), after anything it would have
    lost is safe; the process exits with RUN_FAILED_STATUS.
    """


class RankFailed(RunFailed):
    """One rank cannot go on (it ran out of memory) and says why itself, whatever its
    rank: raised on that rank alone, without agreeing first (the others cannot know),
    which the other ranks then meet as a lost peer."""
