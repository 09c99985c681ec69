"""The one exception type for mistakes a user can fix: reported as one line, never a traceback."""


class UserError(Exception):
    """A bad value, path or combination in what the user asked for."""
